"""When to draft and how much in the verify loop: ``policy.Policy`` at one
row (B = 1), and what only a request has.

The loop asks ``want()`` before each round and reports each round with
``update(k, a, seconds)`` (``k == 0``: a plain step). The policy times both,
sets γ by the batch's rule for one row and switches drafting off with
doubling back-off (``Policy.judge``: the rounds' tokens per second against
plain steps'), or for good where the drafter or the verify forward cannot
pay. What the batch has no use for stays here: a draft model's step timed
apart from the verify, plain steps probed now and then (a draft model never
yields one), the timings carried to the drafter's next request, and the
watch that ends a back-off where a free drafter's guesses hold again.
"""

from collections import deque
from typing import Optional

from . import policy


class Controller(policy.Policy):
    """The serial loop's adaptive draft length and measured on/off switch."""

    # A draft step costing this fraction of a plain target step or more cannot
    # pay off: a verify over 2+ tokens already costs more than one step.
    DRAFT_COST = 0.8
    # Timed drafts (their fastest) before a draft step found that dear
    # switches drafting off for good: one timing slowed by other work (a
    # shared machine's scheduler, Python's garbage collector) must not.
    DRAFT_SURE = 3
    # Where a forward over w tokens costs nearly w plain steps (MLX's CPU
    # kernel for quantized weights), even a drafter right BEST_ACCEPT of the
    # time gains nothing (``Policy.cannot_pay``): judged after EXPLORE verify
    # rounds as a back-off (two verifies timed while other work ran may have
    # been slowed), then for the request once this many agree.
    VERIFY_SURE = 6
    PROBE_EVERY = 12  # drafting rounds in a row, no plain step among them, before one is timed

    def __init__(
        self,
        gamma: int,
        gmax: int,
        adaptive: bool = True,
        auto_off: bool = True,
        widths: tuple = (),
        lookup: bool = False,
    ):
        super().__init__(gamma, gmax, adaptive, auto_off, widths)
        # The drafter pairs a model with a lookup (``LookupFirst``): it asks
        # its model only where the model's rounds pay, and its lookups cost
        # nothing, so a dear model step never switches drafting off for good.
        self.lookup = lookup
        self.probe = 0  # plain steps to time before the next round
        self.draft_step = None  # seconds per draft token, when measurable
        self.timed = 0  # drafting rounds whose draft was timed on its own
        self.draft_samples = 0  # drafts timed in all, carried ones included
        self.drafting_rounds = 0
        self.since_plain = 0  # drafting rounds since a plain step was last timed
        self.acceptance = policy.Acceptance()
        self.carried = False  # plain steps timed by an earlier request (``carry``)

    # -------------------------------------------------- across requests

    def carry(self, timings: tuple) -> None:
        """Start from an earlier request's ``timings()`` of the same drafter
        and target: the machine does not change between requests, so its
        plain steps are not timed again before drafting starts, its verify
        cost is known from the first round, and a draft model's step is not
        timed again."""
        plain, verify, draft = timings
        self._table(self.plain, 1).extend(plain)
        self._table(self.verify, 1).extend(verify)
        self.carried = len(self.plain[1]) >= 2
        if draft is not None and self.timed < 2:
            # Its drafts need no timing, unless the step looks dear on too few.
            self.draft_step, self.draft_samples = draft
            self.timed = 2

    def timings(self) -> tuple:
        """What this request timed of plain steps, verifies and a draft
        step with its count of timed drafts (None: not timed, or a free
        drafter), for ``carry``."""
        draft = (self.draft_step, self.draft_samples) if self.timed >= 2 else None
        return tuple(self.plain.get(1, ())), tuple(self.verify.get(1, ())), draft

    # -------------------------------------------------- the loop asks

    def want(self) -> int:
        """Tokens to draft this round (0: a plain step, to time it)."""
        if self.probe > 0:
            self.probe -= 1
            return 0
        if self.needs_plain(1):
            return 0
        if self.auto_off and self.draft_step is None and self.timed == 0:
            return 1  # the first timed draft: one step tells its cost
        return self.gamma

    @property
    def off_for(self) -> int:
        """Tokens to decode plainly now: drafting is switched off (a huge
        number where for good). The loop spends them at once, then ``resume``."""
        return self.switch(1).left

    @property
    def for_good(self) -> bool:
        return self.switch(1).final

    @property
    def switched_off(self) -> bool:
        return self.switch(1).left > 0

    @property
    def why(self) -> str:
        """Why drafting was last switched off, for the request's summary line."""
        return self.switch(1).why

    def resume(self) -> None:
        """The back-off was spent (or a watch ended it): draft again."""
        self.switch(1).retry()

    def best_gain(self, accept: float) -> Optional[float]:
        """Best tokens/s of drafting relative to plain decoding, over draft
        lengths 1..gmax, if each draft token is right with probability
        ``accept``; ``None`` until enough steps are timed."""
        return self.gain(1, accept, self._draft())

    # -------------------------------------------------- a draft model's step

    def time_draft(self) -> bool:
        """Whether to evaluate this round's (lazy) drafts on their own, to
        time them: the first two, and more while the step looks dear on
        fewer than ``DRAFT_SURE``."""
        return self.auto_off and (self.timed < 2 or self._dear_unsure())

    def _dear(self) -> bool:
        """Whether the timed draft step costs ``DRAFT_COST`` of a plain step or more."""
        p = self.plain_cost(1)
        return self.timed >= 2 and p is not None and self._draft() >= self.DRAFT_COST * p

    def _dear_unsure(self) -> bool:
        """A model's draft step looks dear, but on fewer than ``DRAFT_SURE`` timed drafts."""
        return self.draft_samples < self.DRAFT_SURE and not self.lookup and self._dear()

    def free_drafts(self) -> None:
        """The drafter computes nothing on the device (n-gram lookup)."""
        self.timed = 2

    def computed_drafts(self) -> None:
        """Drafts computed on the device after free ones (a lookup first,
        then a model): the model's steps are timed from here on."""
        if self.draft_step is None:
            self.timed = 0

    def drafted(self, k: int, seconds: float) -> None:
        # The fastest timed draft: a process's first one also builds the
        # draft model's kernels, and would switch a paying drafter off.
        self.timed += 1
        self.draft_samples += 1
        step = seconds / k
        self.draft_step = step if self.draft_step is None else min(self.draft_step, step)

    def draft_cost(self) -> Optional[float]:
        """Plain steps a drafted token costs (a draft model's step); None
        until both are timed."""
        p = self.plain_cost(1)
        return None if self.draft_step is None or not p else self.draft_step / p

    def _draft(self) -> float:
        """Seconds a drafted token costs (a draft model's step): paid per
        draft, while a padded window's columns cost the same at any length."""
        return self.draft_step or 0.0

    # -------------------------------------------------- a round reported

    def update(
        self,
        k: int,
        a: int,
        dt: float,
        trials: Optional[int] = None,
        timed: bool = True,
        free: bool = False,
        built: bool = True,
    ) -> None:
        """A round drafted ``k`` tokens (0: a plain step), kept ``a``, took
        ``dt`` seconds (``trials``: a branching token tree's, the drafts its
        accepted path met: ``a``, and one more where a draft was rejected;
        the acceptance rate is per draft on a path, not per node; ``timed``:
        False where its forward ran behind a plain step, so ``dt`` is what
        it added to the run, not what a verify costs; ``free``: its drafts
        cost nothing to draft, a lookup's, where the drafter also computes
        some; ``built``: False for the first round of its shape, which
        built kernels: neither its cost nor its rate is drafting's)."""
        if k == 0:
            self.plain_step(1, dt)
            self.since_plain = 0
            return
        self.drafting_rounds += 1
        self.since_plain += 1
        tree = trials is not None
        drafting = 0.0 if free else k * self._draft()
        tokens = a + 1 if built else 0
        self.verify_round(1, self.width(k + 1), dt, tree, tokens, timed and built, drafting)
        self.acceptance.observe(trials if tree else k, a)
        if self.adaptive:
            self.gamma = self._next_gamma(a == k)
        if not self.auto_off:
            return
        # Measure a plain step now and then: a draft model never yields one,
        # and other processes on the machine change both figures over time.
        # Where the text's gaps already ran plain steps (a lookup's misses),
        # those are the measure: a probe would spend a forward on one token.
        if self.drafting_rounds == 2 and not self.carried:
            self.probe = 2
        elif self.since_plain >= self.PROBE_EVERY:
            self.probe = 1
        self._judge()

    def _next_gamma(self, all_kept: bool) -> int:
        """The next round's draft length: the batch's rule for one row
        (``Policy.length``) once the verify cost is known; before it, no
        growth (a wide first window is what costs most where windows are
        not cheap) and one less after a rejection."""
        best = None
        if self.auto_off:
            best = self.length(1, [self.acceptance.alpha], [self.gmax], self._draft())
        if best is None:
            grow = 2 if not self.auto_off else 0
            return min(self.gamma + grow, self.gmax) if all_kept else max(1, self.gamma - 1)
        return max(1, best[0])

    def _judge(self) -> None:
        """Drafting off for good where a draft step is as dear as a target
        step (on ``DRAFT_SURE`` timed drafts); off where the verify cannot
        pay (for good once ``VERIFY_SURE`` verifies agree); else the rounds
        judged against plain steps."""
        p = self.plain_cost(1)
        if p is None:
            return
        if not self.lookup and self._dear():
            if self.draft_samples >= self.DRAFT_SURE:
                self.switch_off(1, "a draft step costs about as much as a target step", True)
            return  # until then, more drafts are timed (``time_draft``)
        draft = 0.0 if self.lookup else self._draft()
        if self.cannot_pay(1, draft):
            sure = len(self.verify.get(1, ())) >= self.VERIFY_SURE
            self.switch_off(1, "a verify forward costs too many plain steps to gain", sure)
        else:
            self.judge(1, self._table(self.yields, 1), 1.0 / p)

    def switch_off(self, B: int, why: str, for_good: bool = False) -> None:
        # A retry is judged on its own rounds, times one more draft, and
        # starts with a plain step.
        super().switch_off(B, why, for_good)
        self.yields[B] = deque(maxlen=self.SAMPLES)
        self.timed = min(self.timed, 1)
        self.probe = 1
