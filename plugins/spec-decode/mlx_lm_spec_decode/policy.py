"""How long a round's drafts should be, and whether to draft at all: one
cost model, one rule and one switch for both drivers, kept per batch size
B by ``Policy``: the serial loop is B = 1 (``controller.Controller``), the
batch times every size it runs (``batch_verify.BatchController``).

A verify forward over ``W`` tokens costs ``p + extra + b * (W - 1)``: ``p``
a plain step, ``extra`` what a verify costs beyond one at any width (its
host sync, the window's attention), ``b`` each column more. On a
memory-bound device ``b`` is near 0 and ``extra`` carries the cost; on a
CPU each column costs compute. Each row's drafts are right with
probability ``alpha`` each, given the ones before them (``Acceptance``),
so a round over ``g`` drafts yields ``expected_tokens(alpha, g)``.
``best_length`` takes the ``g`` that yields most tokens per second.

What the model predicts is checked against what drafting did: tokens per
second measured while it was on against plain steps' (``Policy.judge``).
A size where drafting lost is switched off for a wait that doubles with
each loss in a row, then retried (``Switch``); where it can never pay (a
verify or a draft step as dear as the steps it saves) a request switches
it off for good.
"""

from collections import deque
from statistics import fmean, median
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from . import sampling
from . import target as target_mod

Cost = Tuple[float, float, float]  # (p, extra, b)

FOREVER = 1 << 30  # a switch-off's wait that does not end (the rest of a request)

# Plain steps a verify column may cost and still count as free: a
# memory-bound device's, where a wider window costs what a narrow one does.
FREE_COLUMN = 0.03


def free_columns(cost: Optional[Tuple[float, float]]) -> bool:
    """Whether a measured verify cost ``(a, b)`` (``Policy.verify_cost``)
    prices each column at next to nothing."""
    return cost is not None and cost[1] <= FREE_COLUMN


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round yields for a row with ``k`` drafts, each right with
    probability ``alpha`` given the ones before it were (the row's own next
    token included)."""
    return sum(alpha**j for j in range(k + 1))


def fit(
    samples: Iterable[Tuple[int, float]], p: float, padded: bool = False
) -> Tuple[float, float]:
    """``(extra, b)`` from verify rounds' ``(width, seconds)`` against a plain
    step of ``p`` seconds: with two widths or more, a line through each
    width's median (least squares) whose intercept, less the plain step, is
    ``extra``; otherwise (one width, or a line below the plain step)
    ``extra`` is 0 and each round's excess is all columns, unless windows
    are ``padded`` (a memory-bound device, ``target.window_widths``): there
    one width's excess is all ``extra``, columns free until a second width
    is timed. (Priced as columns, one padded width's excess keeps the draft
    length inside it, and no second width is ever timed.)"""
    widths: dict = {}
    for w, t in samples:
        if w > 1:
            widths.setdefault(w - 1, []).append(t)
    if not widths:
        return 0.0, 0.0
    xs, ys = list(widths), [median(v) for v in widths.values()]
    if padded and len(xs) == 1:
        return max(0.0, ys[0] - p), 0.0
    extra, b = 0.0, max(0.0, median((t - p) / x for x, t in zip(xs, ys, strict=True)))
    if len(xs) >= 2:
        mx_, my = fmean(xs), fmean(ys)
        slope = sum((x - mx_) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
            (x - mx_) ** 2 for x in xs
        )
        if slope >= 0 and my - slope * mx_ >= p:
            extra, b = my - slope * mx_ - p, slope
    return extra, b


def best_length(
    alphas: List[float],
    proposed: List[int],
    cost: Cost,
    gmax: int,
    width: Optional[Callable[[int], int]] = None,
    floor: float = 0.0,
    draft: float = 0.0,
) -> Tuple[int, float]:
    """``(g, rate)``: the draft length in ``1..min(gmax, max(proposed))``
    whose rows' expected tokens (row i drafts ``min(g, proposed[i])``) per
    second of its round is highest, and that rate; ``(0, floor)`` when none
    beats ``floor``. ``width(w)``: the width a window of ``w`` tokens is
    run at (padded: its columns all cost); ``draft``: what drafting one
    token costs (a draft model's step), paid per draft, not per column."""
    p, extra, b = cost
    best, best_rate = 0, floor
    for g in range(1, min(gmax, max(proposed, default=0)) + 1):
        tokens = sum(expected_tokens(a, min(g, n)) for a, n in zip(alphas, proposed, strict=True))
        w = width(g + 1) if width else g + 1
        rate = tokens / (p + extra + b * (w - 1) + draft * g)
        if rate > best_rate:
            best, best_rate = g, rate
    return best, best_rate


def row_length(alpha: float, proposed: int, verify: Tuple[float, float], draft: float = 0.0) -> int:
    """``best_length`` for one row, in plain steps: the draft length in
    ``1..proposed`` whose rounds emit most per plain step's time, each draft
    right with probability ``alpha`` and costing ``draft`` plain steps to
    draft, where a verify over w tokens costs ``verify = (a, b)``: a + b * w
    plain steps (``Policy.verify_cost``); 0 where no length beats plain steps."""
    a, b = verify
    cost = (1.0, a - 1.0 + b, b)
    return best_length([alpha], [proposed], cost, proposed, draft=draft, floor=1.0)[0]


class Acceptance:
    """A row's per-draft-token acceptance, decayed (recent rounds weigh
    most), prior 1/2: geometric, so a round that drafted ``k`` and kept ``a``
    is ``a`` successes and one failure unless all were kept (in a tree:
    unless the accepted path ended on a leaf, ``rejected``)."""

    DECAY = 0.8

    def __init__(self):
        self.hits, self.tries = 1.0, 2.0

    @property
    def alpha(self) -> float:
        return self.hits / self.tries

    def observe(self, k: int, a: int, rejected: Optional[bool] = None) -> None:
        rejected = a < k if rejected is None else rejected
        self.hits = self.DECAY * self.hits + a
        self.tries = self.DECAY * self.tries + a + (1 if rejected else 0)


def rate(samples: Iterable[Tuple[int, float]]) -> float:
    """Tokens per second of ``(tokens, seconds)`` samples."""
    tokens = seconds = 0.0
    for n, t in samples:
        tokens, seconds = tokens + n, seconds + t
    return tokens / seconds if seconds > 0 else float("inf")


class Switch:
    """Whether drafting is on at one batch size. A verdict that it lost
    switches it off for ``wait`` units of the driver's (a request's tokens,
    a batch's calls or decisions), twice as many after each loss in a row
    (up to ``2**cap`` times), or for good; the wait's last unit retries
    drafting; a verdict that it paid ends the doubling."""

    def __init__(self, wait: int, cap: int, need: int = 0):
        self.wait, self.cap = wait, cap
        self.need = need  # samples before the next verdict (``Policy.judge``)
        self.left = 0  # units of the wait still to pass
        self.factor = 1  # the wait's doubling now
        self.losses = 0  # verdicts in a row that drafting lost
        self.off = False  # it lost and was not retried since
        self.judged = False  # a verdict was reached (sizes not judged borrow it)
        self.why = ""  # why it was last switched off

    @property
    def final(self) -> bool:
        """Off for good."""
        return self.left >= FOREVER // 2

    def lose(self, why: str, final: bool = False, need: int = 0) -> None:
        self.factor = 1 << min(self.losses, self.cap)
        self.left = FOREVER if final else self.wait * self.factor
        self.losses += 1
        self.off, self.judged, self.why = True, True, why
        self.need = need or self.need

    def win(self) -> None:
        self.left = self.losses = 0
        self.off, self.judged = False, True

    def elapse(self, ready: bool = True) -> bool:
        """One unit of the wait passes (the one asking): True once none is
        left and the driver is ``ready`` (a second clock of its own), when
        drafting is retried."""
        self.left = max(0, self.left - 1)
        if self.left or not ready:
            return False
        self.off = False
        return True

    def retry(self) -> None:
        """End the wait now (a driver that spent it at once, or saw that
        drafting would pay again)."""
        self.left, self.off = 0, False


class Policy:
    """Per batch size B: plain steps' and verify rounds' timings (by window
    width; token trees' surcharge apart), the tokens rounds emitted, the
    cost fit from them (``cost``), the draft length that pays most
    (``length``) and drafting's switch (``judge``, ``switch_off``,
    ``drafting``). A size not timed yet borrows the nearest timed one's
    figures: rows join and leave a batch all the time, and probing each size
    anew would spend plain steps and wasted rounds on every change.

    The class's numbers are the serial loop's; the batch sets its own where
    its samples differ (a call of the batch is not a request's round).
    """

    SAMPLES = 8  # recent timings kept per batch size; their medians are compared: a
    # GPU's rounds stall often (tens of ms; throughput pays that, the fastest
    # round hides it), while a CPU shared with other work spikes now and then
    EXPLORE = 2  # verify rounds timed before the cost model decides
    BEST_ACCEPT = 0.9  # acceptance at which a verify that can never pay is judged
    SLACK = 1.03  # the gain over plain steps the cost model must promise
    KEEP = 0.97  # the share of plain steps' tokens per second drafting must keep
    JUDGE = 4  # samples taken with drafting on before the first verdict
    JUDGE_AGAIN = 3  # ... and after each switch-off
    WAIT = 32  # units off after a first loss (the serial loop's: tokens)
    DOUBLINGS = 4  # losses in a row that double the wait, before it stops growing
    AFTER = 4  # plain steps after a round whose excess over a plain step is the round's
    CLEAN = 16  # plain steps after a round before they time a clean plain step
    OWN = 8  # verify rounds at a batch size on a neighbour's plain cost before its own
    REPROBE = 48  # verify rounds at one batch size between plain re-measurements
    TREE_SLACK = 0.05  # a tree round may cost this much of a plain step beyond a chain's
    TREE_RETRY = 32  # chain rounds between tree rounds once trees were found dear
    TREE_SHARE = 0.25  # of the rounds run on known pending tokens, the share that
    # verified a branching tree, below which rounds stop waiting for those tokens
    # (a batch's trees are built on them; an ahead round drafts chains)
    TREE_LOOKS = 4  # rounds on known tokens before that share is judged

    def __init__(
        self,
        gamma: int,
        gmax: int,
        adaptive: bool = True,
        auto_off: bool = True,
        widths: tuple = (),
    ):
        self.gmax = max(1, gmax)
        self.gamma = max(1, min(gamma, self.gmax))
        self.adaptive, self.auto_off = adaptive, auto_off
        self.widths = widths  # the widths windows are padded up to (``target.window_widths``)
        self.plain: Dict[int, deque] = {}  # B -> seconds of plain steps
        self.clean: Dict[int, deque] = {}  # B -> plain steps timed far from any round
        self.verify: Dict[int, deque] = {}  # B -> (window width, seconds) of chain rounds
        self.tree_cost: Dict[int, deque] = {}  # B -> a tree round's seconds beyond a chain's
        self.yields: Dict[int, deque] = {}  # B -> (tokens a round emitted, its seconds)
        self.rounds: Dict[int, int] = {}  # B -> rounds since its plain steps were renewed
        self.since_tree: Dict[int, int] = {}  # B -> chain rounds since its last tree round
        self.branched: Dict[int, deque] = {}  # B -> whether rounds on known tokens branched
        self.since_wait: Dict[int, int] = {}  # B -> rounds since one ran on known tokens
        self.switches: Dict[int, Switch] = {}
        self.last_round: Optional[int] = None  # batch size of the last round recorded
        self.charged = [False, False]  # its entries: a chain's timing, a yield

    def _table(self, table: Dict[int, deque], B: int) -> deque:
        if B not in table:
            table[B] = deque(maxlen=self.SAMPLES)
        return table[B]

    # ------------------------------------------------------------ timings

    def plain_step(self, B: int, seconds: float, since_round: Optional[int] = None) -> None:
        """A plain step at B took ``seconds``; ``since_round``: plain steps
        since the last round, this one included, where the driver counts.

        The first ``AFTER`` steps after a round are not timings of a plain
        step: where a round slows the steps after it (on a GPU, MLX's
        executable graphs of a ``[B, 1]`` step evicted by the round's
        ``[B, W]`` and rebuilt), their excess over a plain step is the
        round's cost, charged to the round just recorded. Only steps more
        than ``CLEAN`` after one (or before any) time a clean plain step."""
        near = since_round is not None and self.last_round == B
        p = self.plain_cost(B)
        if near and since_round <= self.AFTER and p is not None:
            self._charge(B, max(0.0, seconds - p))
            return
        if since_round is not None and (B not in self.rounds or since_round > self.CLEAN):
            self._table(self.clean, B).append(seconds)
        q = self._table(self.plain, B)
        if self.rounds.get(B, 0) >= self.REPROBE:
            self.rounds[B] = 0
            q.clear()  # a fresh reading: the machine's load changes
        q.append(seconds)

    def verify_round(
        self,
        B: int,
        width: int,
        seconds: float,
        tree: bool = False,
        tokens: int = 0,
        timed: bool = True,
        drafting: float = 0.0,
    ) -> None:
        """A round at B over windows ``width`` wide took ``seconds`` and
        emitted ``tokens`` (0: not counted); ``tree``: it verified branching
        token trees, timed apart (their surcharge must not make chains look
        dear); ``timed``: False where its forward ran behind a plain step, so
        its seconds count for its rate, not as a verify's cost; ``drafting``:
        seconds of it spent drafting, not verifying."""
        self.rounds[B] = self.rounds.get(B, 0) + 1
        self.since_wait[B] = self.since_wait.get(B, 0) + 1
        self.last_round, self.charged = B, [timed and not tree, bool(tokens)]
        if tokens:
            self._table(self.yields, B).append((tokens, seconds))
        if not timed:
            return
        seconds -= drafting
        cost = self.cost(B) if tree else None
        self.since_tree[B] = 0 if tree else self.since_tree.get(B, 0) + 1
        if cost is None:
            # A tree round with no chain rounds to compare with stands in for
            # one (at most what a chain costs), so that γ is still decided.
            self._table(self.verify, B).append((width, seconds))
            return
        p, extra, b = cost
        self._table(self.tree_cost, B).append(seconds - (p + extra + b * (width - 1)))

    def _charge(self, B: int, seconds: float) -> None:
        """Add ``seconds`` to the last round recorded at B (its timing and its yield)."""
        for table in (self.verify, self.yields):
            q = table.get(B)
            if q and self.charged[table is self.yields]:
                n, t = q[-1]
                q[-1] = (n, t + seconds)

    def needs_plain(self, B: int) -> bool:
        """Whether plain steps at B must be timed before deciding: none near
        it yet, ``OWN`` rounds run on a neighbour's, or ``REPROBE`` rounds
        since its own were renewed."""
        if not self.auto_off:
            return False
        rounds = self.rounds.get(B, 0)
        if len(self.plain.get(B, ())) < 2:
            return self._near(self.plain, B, 2) is None or rounds >= self.OWN
        return rounds >= self.REPROBE

    def plain_cost(self, B: int) -> Optional[float]:
        """Seconds of a plain step at B (or the nearest measured size)."""
        near = self._near(self.plain, B, 1)
        return self._plain_at(near) if near is not None else None

    def _plain_at(self, B: int) -> float:
        """A plain step at a measured size: its recent steps' median, or its
        clean steps' where lower (rounds only ever slow the steps near them)."""
        p = median(self.plain[B])
        return min(p, median(self.clean[B])) if self.clean.get(B) else p

    @staticmethod
    def _near(table: Dict[int, deque], B: int, need: int) -> Optional[int]:
        """``B`` if it has ``need`` samples, else the nearest batch size that
        has (the larger on a tie), else ``None``."""
        have = [k for k, q in table.items() if len(q) >= need]
        if not have:
            return None
        return B if B in have else min(have, key=lambda k: (abs(k - B), -k))

    @staticmethod
    def _borrowed(have: List[int], B: int) -> Optional[int]:
        """Of the sizes that ``have`` a record, the one ``B`` takes: itself or
        the largest smaller one (where fewer rows lost, more rows lose too: a
        step's cost grows with rows, a round's even more), else the nearest
        larger one up to a third larger (rows leaving one by one must not
        explore each size anew); ``None`` without either."""
        below = [k for k in have if k <= B]
        above = [k for k in have if B < k <= B + max(1, B // 3)]
        return max(below) if below else (min(above) if above else None)

    # ------------------------------------------------------------ the cost

    def width(self, w: int, B: int = 1) -> int:
        """The width a window of ``w`` tokens is fed at in a batch of B
        (``target.padded_width``): a padded window's columns all cost."""
        return target_mod.padded_width(w, self.widths, B)

    def cost(self, B: int) -> Optional[Cost]:
        """``(p, extra, b)`` in seconds at B (``fit`` over the recent rounds
        at the nearest size with ``EXPLORE`` of them; padded windows as
        ``fit`` prices them); None until timed."""
        bp, bv = self._near(self.plain, B, 1), self._near(self.verify, B, self.EXPLORE)
        if bp is None or bv is None:
            return None
        p = self._plain_at(bp)
        pv = self._plain_at(self._near(self.plain, bv, 1))
        extra, b = fit(self.verify[bv], pv, bool(self.widths))
        # Measured on fewer rows, a column costs at most proportionally more.
        return p, extra, b * max(1.0, B / bv)

    def verify_cost(self, B: int = 1) -> Optional[Tuple[float, float]]:
        """``(a, b)``: a verify forward over w tokens costs about ``a + b * w``
        plain steps at B (``cost`` in plain steps); None until timed. Token
        trees size themselves by it."""
        cost = self.cost(B)
        if cost is None:
            return None
        p, extra, b = cost
        return 1.0 + (extra - b) / p, b / p

    def tree_surcharge(self, B: int = 1) -> float:
        """Plain steps a branching tree's verify costs beyond a chain of its
        width at B (its mask and depth positions; 0 until a tree is timed).
        Where it is dear (a GPU's unfused attention path), trees stop paying
        and rows draft chains."""
        near, p = self._near(self.tree_cost, B, 1), self.plain_cost(B)
        if near is None or not p:
            return 0.0
        return max(0.0, median(self.tree_cost[near]) / p)

    def trees_pay(self, B: int) -> bool:
        """Whether rows may fill their windows with tree nodes: until a few
        tree rounds are timed, and while they cost about a chain's price;
        once found dear, one tree round every ``TREE_RETRY``."""
        near = self._near(self.tree_cost, B, 3)
        if near is None:
            return True
        bp = self._near(self.plain, near, 1)
        if bp is None or median(self.tree_cost[near]) <= self.TREE_SLACK * self._plain_at(bp):
            return True
        return self.since_tree.get(B, 0) >= self.TREE_RETRY

    def trees_drawn(self, B: int, branched: bool) -> None:
        """A round at B ran on known pending tokens, where rows may draft
        trees; ``branched``: a row's window was a branching tree."""
        self._table(self.branched, B).append(branched)
        self.since_wait[B] = 0

    def trees_wait(self, B: int) -> bool:
        """Whether a round behind a plain step waits for its pending tokens
        to draft token trees on them. Waiting costs the overlap of the
        round's build with the step in flight; it is worth that while trees
        pay (``trees_pay``) and rounds verify them: ``TREE_SHARE`` of the last
        rounds on known tokens, judged after ``TREE_LOOKS`` of them. Where they
        are rarer, rounds go ahead with chains, and one waits every
        ``TREE_RETRY`` rounds to look again."""
        if not self.trees_pay(B):
            return False
        near = self._near(self.branched, B, self.TREE_LOOKS)
        if near is None or sum(self.branched[near]) >= self.TREE_SHARE * len(self.branched[near]):
            return True
        return self.since_wait.get(B, 0) >= self.TREE_RETRY

    # ------------------------------------------------------------ the length

    def length(
        self,
        B: int,
        alphas: List[float],
        proposed: List[int],
        draft: float = 0.0,
        floor: float = 0.0,
    ) -> Optional[Tuple[int, float]]:
        """``best_length`` at B's measured cost: ``(g, tokens per second)``
        for rows right with probability ``alphas`` that propose ``proposed``
        (``draft``: seconds a drafted token costs; ``(0, floor)`` where no
        length beats ``floor``); None until the cost is timed."""
        cost = self.cost(B)
        if cost is None:
            return None
        return best_length(
            alphas, proposed, cost, self.gmax, lambda w: self.width(w, B), floor, draft
        )

    def gain(self, B: int, accept: float, draft: float = 0.0) -> Optional[float]:
        """Best tokens per second of drafting at B over plain steps', every
        row proposing ``gmax`` drafts right with probability ``accept``;
        None until timed."""
        best = self.length(B, [accept] * B, [self.gmax] * B, draft)
        return None if best is None else best[1] * self.plain_cost(B) / B

    def cannot_pay(self, B: int, draft: float = 0.0) -> bool:
        """Whether drafting at B gains less than ``SLACK`` even at
        ``BEST_ACCEPT``: the verify (or a drafted token) costs about what
        the plain steps it saves do."""
        g = self.gain(B, self.BEST_ACCEPT, draft)
        return g is not None and g < self.SLACK

    def losing(self, B: int, plain_rate: float) -> bool:
        """Whether B's recent rounds emitted less than ``KEEP`` of plain
        steps' tokens per second, whatever the cost model predicts: the
        tokens are counted, not expected, so a cost the model does not see
        (work around a round, acceptance below the rows' estimates) still
        shows. A size with fewer than ``EXPLORE`` rounds of its own takes
        the record ``_borrowed`` picks, against that size's plain steps."""
        have = [k for k, q in self.yields.items() if len(q) >= self.EXPLORE]
        near = self._borrowed(have, B)
        if near is None:
            return False
        if near != B:
            bp = self._near(self.plain, near, 1)
            if bp is None:
                return False
            plain_rate = near / self._plain_at(bp)
        return rate(self.yields[near]) < self.KEEP * plain_rate

    # ------------------------------------------------------------ the switch

    def switch(self, B: int) -> Switch:
        """B's switch (made on first use)."""
        if B not in self.switches:
            self.switches[B] = Switch(self.WAIT, self.DOUBLINGS, self.JUDGE)
        return self.switches[B]

    def judge(
        self, B: int, samples: deque, plain_rate: Optional[float], what: str = "rounds"
    ) -> bool:
        """Judge drafting at B on ``samples``, ``(tokens, seconds)`` taken
        while it was on (a request's rounds, a batch's calls), against plain
        steps' ``plain_rate`` once there are the switch's ``need`` of them:
        where they kept less than ``KEEP`` of it, drafting is switched off
        (the samples cleared: a retry is judged on its own) and True
        returned; where they kept it, the back-off's doubling ends."""
        sw = self.switch(B)
        if not self.auto_off or plain_rate is None or len(samples) < sw.need:
            return False
        n, got = len(samples), rate(samples)
        if got >= self.KEEP * plain_rate:
            sw.win()
            return False
        samples.clear()
        ratio = plain_rate / got if got > 0 else float("inf")
        self.switch_off(B, f"its last {n} {what} took {ratio:.2f}x a plain step per token")
        return True

    def switch_off(self, B: int, why: str, for_good: bool = False) -> None:
        """Drafting at B off for the switch's wait, or ``for_good``; ``why``
        for the request's summary line."""
        self.switch(B).lose(why, for_good, self.JUDGE_AGAIN)

    def _verdict(self, B: int) -> Optional[Switch]:
        """The switch whose verdict B takes: its own, or, never judged, the
        one ``_borrowed`` picks; None without any."""
        k = self._borrowed([k for k, s in self.switches.items() if s.judged], B)
        return None if k is None else self.switches[k]

    def resume(self, B: int) -> None:
        """End the wait of the switch ``drafting(B)`` reads: drafting is on
        at B from the next call."""
        sw = self._verdict(B)
        if sw is not None:
            sw.retry()

    def drafting(self, B: int) -> bool:
        """Whether drafting is on at B, as the verdicts have shown; while off,
        each call counts one unit of the wait. A size never judged takes the
        verdict of the one ``_borrowed`` picks."""
        if not self.auto_off:
            return True
        sw = self._verdict(B)
        return sw is None or sw.left <= 0 or sw.elapse()


RESUME_HITS = 3  # guesses kept in a row while drafting is off before it resumes


def follow(guess: List[int], pos: int, tokens: List[int]) -> Tuple[int, bool]:
    """A guess never verified (drafting off, or a copy declined), kept up to
    ``pos``, read on against the ``tokens`` emitted since: how far it is
    kept now, and whether it has ended (a token differed, or it was kept to
    its end), to be scored as a round of ``len(guess)`` drafts would be."""
    m = sampling.kept(guess[pos:], tokens)
    return pos + m, pos + m >= len(guess) or m < len(tokens)


def resume_watch(
    guess: Callable[[], List[int]],
    last: Callable[[], int],
    score: Optional[Callable[[int, int], None]] = None,
) -> Callable[[], bool]:
    """While drafting is off: score a free drafter's guesses (``guess()``, the
    drafter's proposal now) against each token emitted (``last()``); True
    while the last ``RESUME_HITS`` or more in a row would have been kept:
    the text has started to repeat something the drafter holds, so drafting
    should resume. The count runs on across guesses: a guess kept to its end
    is followed by the next one, so short guesses (two tokens, as n-gram
    lookups often are) resume drafting too. ``score(k, a)``: a guess of
    ``k`` tokens ended with ``a`` kept (as a round would have)."""
    state = {"guess": [], "pos": 0, "hits": 0}

    def watch() -> bool:
        g = state["guess"]
        kept, ended = follow(g, state["pos"], [last()])
        state["hits"] = state["hits"] + 1 if kept > state["pos"] else 0
        state["pos"] = kept
        if ended:  # a miss, or the guess kept to its end: ask again for what follows
            if g and score is not None:
                score(len(g), kept)
            state["guess"], state["pos"] = [int(t) for t in guess()], 0
        return state["hits"] >= RESUME_HITS

    return watch
