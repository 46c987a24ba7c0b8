"""When to draft and how much: the verify loop's adaptive draft length and
its measured on/off switch.

The loop asks ``want()`` before each round and reports each round with
``update(k, a, seconds)`` (``k == 0``: a plain step). Drafting pays only
when a verify round yields more tokens per second than plain steps do; the
controller times both and switches drafting off (with doubling back-off, or
for good when the drafter or the verify forward cannot pay) when it does not.
"""

from collections import deque
from typing import Callable, List, Optional

from . import policy
from . import target as target_mod


class Controller:
    """Adaptive draft length and the measured on/off switch."""

    WINDOW = 16  # recent drafting rounds compared against plain steps
    MIN_ROUNDS = 4  # drafting rounds measured before the first decision
    RETRY_ROUNDS = 3  # ... and after each retry
    SLACK = 1.03  # drafting must be at least this much slower to switch off
    BACKOFF = 32  # tokens decoded plainly before drafting is tried again
    # A draft step costing this fraction of a plain target step or more cannot
    # pay off: a verify over 2+ tokens already costs more than one step.
    DRAFT_COST = 0.8
    # The verify side of the same question: where a forward over w tokens
    # costs nearly w plain steps (MLX's CPU kernel for quantized weights),
    # even a drafter that is right this often gains nothing, so drafting
    # stays off for the request instead of retrying after each back-off.
    BEST_ACCEPT = 0.9
    VERIFY_SAMPLES = 2  # verify rounds timed before this is judged
    # ... and before the judgement is final: until then it is a back-off,
    # as two verifies timed while other work ran may have been slowed.
    VERIFY_SURE = 6

    def __init__(
        self,
        gamma: int,
        gmax: int,
        adaptive: bool = True,
        auto_off: bool = True,
        widths: tuple = (),
    ):
        self.gmax = max(1, gmax)
        self.widths = widths  # the widths a chain window is padded up to
        self.gamma = max(1, min(gamma, self.gmax))
        self.adaptive, self.auto_off = adaptive, auto_off
        self.spec = deque(maxlen=self.WINDOW)  # (seconds, tokens)
        self.verify = deque(maxlen=8)  # (window width, seconds of the verify forward)
        self.tree_verify = deque(maxlen=8)  # the same for branching token trees
        self.plain = deque(maxlen=5)  # seconds per plain step
        # Time two plain steps first: every decision compares against them.
        self.probe = 2 if auto_off else 0
        self.draft_step = None  # seconds per draft token, when measurable
        self.timed = 0  # drafting rounds whose draft was timed on its own
        self.rounds = 0
        self.backoff = self.BACKOFF
        self.off_for = 0
        self.switched_off = False
        self.why = ""  # why drafting was last switched off
        self.need = self.MIN_ROUNDS
        self.acceptance = policy.Acceptance()
        self.carried = False  # plain steps timed by an earlier request (``carry``)

    def carry(self, timings: tuple) -> None:
        """Start from an earlier request's ``timings()`` of the same drafter
        and target: the machine does not change between requests, so its
        plain steps are not timed again before drafting starts, its verify
        cost is known from the first round, and a draft model's step is not
        timed again."""
        plain, verify, draft_step = timings
        self.plain.extend(plain)
        self.verify.extend(verify)
        if len(self.plain) >= 2:
            self.probe, self.carried = 0, True
        if draft_step is not None and self.timed < 2:
            self.draft_step, self.timed = draft_step, 2  # its drafts need no timing

    def timings(self) -> tuple:
        """What this request timed of plain steps, verifies and a draft
        step (None: not timed, or a free drafter), for ``carry``."""
        step = self.draft_step if self.timed >= 2 else None
        return tuple(self.plain), tuple(self.verify), step

    def want(self) -> int:
        """Tokens to draft this round (0: a plain step, to time it)."""
        if self.probe > 0:
            self.probe -= 1
            return 0
        if self.auto_off and self.draft_step is None and self.timed == 0:
            return 1  # the first timed draft: one step tells its cost
        return self.gamma

    def time_draft(self) -> bool:
        """Whether to evaluate this round's (lazy) drafts on their own, to time them."""
        return self.auto_off and self.timed < 2

    def free_drafts(self) -> None:
        """The drafter computes nothing on the device (n-gram lookup)."""
        self.timed = 2

    def drafted(self, k: int, seconds: float) -> None:
        # The fastest timed draft: a process's first one also builds the
        # draft model's kernels, and would switch a paying drafter off.
        self.timed += 1
        step = seconds / k
        self.draft_step = step if self.draft_step is None else min(self.draft_step, step)

    def _switch_off(self, why, for_good=False):
        # Too costly a drafter stays off (the machine will not change within
        # a request); too little acceptance is retried after a back-off.
        self.why = why  # for the request's summary line
        self.off_for = (1 << 30) if for_good else self.backoff
        self.backoff *= 2
        self.switched_off = True
        self.spec.clear()
        self.need = self.RETRY_ROUNDS
        self.timed = min(self.timed, 1)  # time one more draft on retry
        self.probe = 1

    def best_gain(self, accept: float) -> Optional[float]:
        """Best tokens/s of drafting relative to plain decoding, over draft
        lengths 1..gmax, if each draft token is right with probability
        ``accept`` (``policy.best_length`` for one row); ``None`` until
        enough steps are timed."""
        cost = self._cost()
        if cost is None:
            return None
        return policy.best_length(
            [accept], [self.gmax], cost, self.gmax, self.width, draft=self._draft_cost()
        )[1]

    def width(self, w: int) -> int:
        """The width a window of ``w`` tokens is fed at (``target.padded_width``)."""
        return target_mod.padded_width(w, self.widths)

    def _cost(self) -> Optional[policy.Cost]:
        """The verify cost as ``policy`` prices it, in plain steps."""
        cost = self.verify_cost()
        if cost is None:
            return None
        a, b = cost
        return 1.0, a + b - 1.0, b

    def _draft_cost(self) -> float:
        """A draft token's own cost (a draft model's step) in plain steps:
        paid per draft, while a padded window's columns cost the same at
        any draft length."""
        return (self.draft_step or 0.0) / min(self.plain) if self.plain else 0.0

    def verify_cost(self) -> Optional[tuple[float, float]]:
        """``(a, b)``: a verify forward over w tokens costs about ``a + b * w``
        plain steps (``policy.fit`` over the recent verifies, the plain step
        the fastest one timed: other processes only ever slow one down);
        None until enough steps are timed. Token trees size themselves by it."""
        if len(self.plain) < 2 or len([w for w, _ in self.verify if w > 1]) < self.VERIFY_SAMPLES:
            return None
        p = min(self.plain)
        extra, b = policy.fit(((w, t / p) for w, t in self.verify), 1.0, bool(self.widths))
        return 1.0 + extra - b, b

    def _next_gamma(self, all_kept: bool) -> int:
        """The next round's draft length: the batch's rule for one row
        (``policy.best_length``) once the verify cost is known; before it,
        no growth (a wide first window is what costs most where windows are
        not cheap) and one less after a rejection."""
        cost = self._cost() if self.auto_off else None
        if cost is None:
            grow = 2 if not self.auto_off else 0
            return min(self.gamma + grow, self.gmax) if all_kept else max(1, self.gamma - 1)
        g, _ = policy.best_length(
            [self.acceptance.alpha],
            [self.gmax],
            cost,
            self.gmax,
            self.width,
            draft=self._draft_cost(),
        )
        return max(1, g)

    def tree_surcharge(self) -> float:
        """Plain steps a branching tree's verify costs beyond a chain of its
        width (its mask and depth positions; 0 until a tree is timed).
        Where it is dear (a GPU's unfused attention path), trees stop
        paying and the selection falls back to chains."""
        cost = self.verify_cost()
        if cost is None or not self.tree_verify or not self.plain:
            return 0.0
        a, b = cost
        p = min(self.plain)
        return max(0.0, min(t / p - (a + b * w) for w, t in self.tree_verify))

    def verify_cannot_pay(self) -> bool:
        gain = self.best_gain(self.BEST_ACCEPT)
        return gain is not None and gain < self.SLACK

    def update(
        self, k: int, a: int, dt: float, trials: Optional[int] = None, timed: bool = True
    ) -> None:
        """A round drafted ``k`` tokens (0: a plain step), kept ``a``, took
        ``dt`` seconds (``trials``: a branching token tree's, the drafts its
        accepted path met: ``a``, and one more where a draft was rejected;
        the acceptance rate is per draft on a path, not per node; ``timed``:
        False where its forward ran behind a plain step, so ``dt`` is what
        it added to the run, not what a verify costs)."""
        if k == 0:
            self.plain.append(dt)
            return
        self.rounds += 1
        self.spec.append((dt, a + 1))
        if timed:
            # A tree's forward is timed apart: its surcharge must not make chains look dear.
            (self.verify if trials is None else self.tree_verify).append(
                (self.width(k + 1), dt - k * (self.draft_step or 0.0))
            )
        self.acceptance.observe(k if trials is None else trials, a)
        if self.adaptive:
            self.gamma = self._next_gamma(a == k)
        if not self.auto_off:
            return
        # Measure a plain step now and then: a draft model never yields one,
        # and other processes on the machine change both figures over time.
        if self.rounds == 2 and not self.carried:
            self.probe = 2
        elif self.rounds % 12 == 0:
            self.probe = 1
        if not self.plain:
            return
        plain = sorted(self.plain)[(len(self.plain) - 1) // 2]
        if (
            self.draft_step is not None
            and self.timed >= 2
            and self.draft_step >= self.DRAFT_COST * plain
        ):
            self._switch_off("a draft step costs about as much as a target step", True)
        elif self.verify_cannot_pay():
            sure = len([w for w, _ in self.verify if w > 1]) >= self.VERIFY_SURE
            self._switch_off("a verify forward costs too many plain steps to gain", sure)
        elif len(self.plain) >= 2 and len(self.spec) >= self.need:
            spec = sum(t for t, _ in self.spec) / sum(n for _, n in self.spec)
            if spec > plain * self.SLACK:
                n = len(self.spec)
                self._switch_off(
                    f"its last {n} rounds took {spec / plain:.2f}x a plain step per token"
                )


RESUME_HITS = 3  # guesses kept in a row while drafting is off before it resumes


def resume_watch(guess: Callable[[], List[int]], last: Callable[[], int]) -> Callable[[], bool]:
    """While drafting is off: score a free drafter's guesses (``guess()``, the
    drafter's proposal now) against each token emitted (``last()``); True
    once ``RESUME_HITS`` in a row would have been kept: the text has started
    to repeat something the drafter holds, so drafting should resume. The
    count runs on across guesses: a guess kept to its end is followed by the
    next one, so short guesses (two tokens, as n-gram lookups often are)
    resume drafting too."""
    state = {"guess": [], "pos": 0, "hits": 0}

    def watch() -> bool:
        g, pos = state["guess"], state["pos"]
        hit = pos < len(g) and g[pos] == last()
        state["hits"] = state["hits"] + 1 if hit else 0
        if state["hits"] >= RESUME_HITS:
            return True
        if hit and pos + 1 < len(g):
            state["pos"] = pos + 1
        else:  # a miss, or the guess kept to its end: ask again for what follows
            state["guess"], state["pos"] = [int(t) for t in guess()], 0
        return False

    return watch
