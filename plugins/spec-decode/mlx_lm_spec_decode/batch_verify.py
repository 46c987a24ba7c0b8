"""One batched verify forward's per-row acceptance, and the batch's draft length.

``verify`` turns the logits of a forward over ``[B, W]`` windows (row i:
its ``sampling.Window``, a chain or a tree, then padding) into each row's
log-probabilities, accepted path and next token, with the row's own
sampler and logits processors (the rules of ``sampling``: greedy match,
lossless speculative sampling, or sample-and-match).

``BatchController`` picks the draft length γ for a round from the loop's own
timings: per batch size B, the cost of a plain step, what a verify round
costs beyond it whatever its width (the round is read back before the next
is built, where plain steps overlap; its Python work), and how much each
extra window column adds, against the tokens each row is expected to gain
from its drafts at its measured acceptance. Rounds that verified branching
token trees are timed apart: where a tree costs more than a chain of its
width (a GPU's extra kernels), rows draft chains. γ = 0 (a plain batched step) wins
whenever drafting does not pay, so a batch never decodes slower than the
plain batched loop by more than the measurements' noise (and one round
after ``RETRY`` decisions that chose it and ``RETRY_STEPS`` plain steps, so
that the round's timings stay current). The prediction is checked against
what rounds did: where a batch size's recent rounds emitted fewer tokens
per second, call to call, than its plain steps, γ is 0 there whatever the
model predicts, and each retry there that loses again doubles the wait
before the next (capped at ``2**BACKOFF`` times), so a batch size where
drafting does not pay settles to plain steps.

A plain step's cost is its clean one: the median of the steps timed far
from any round (``CLEAN`` plain steps after one, or before the first)
where that is lower than the recent steps'. On a GPU a round evicts the
step's executable graphs and the steps after it run slow for a while;
timed as plain steps, they would make plain decoding look slow and the
rounds that slowed them look cheap.
"""

from collections import deque
from statistics import median
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from . import policy, sampling
from . import target as target_mod


def verify(
    logits: mx.array,
    windows: List[sampling.Window],
    rules: List[sampling.Rule],
    processors: List[Sequence[Any]],
    contexts: List[Optional[mx.array]],
) -> Tuple[List[mx.array], List[List[int]], List[int], List[bool]]:
    """Per row, from the logits of a forward over ``[B, W]`` (row i: its
    window's nodes, then padding): log-probabilities along the accepted path
    (``[a + 1, V]``), the path (window indices, the pending token's 0 first),
    the token after it, and whether a drafted node below the path's end was
    rejected. Chains and trees alike (``sampling.accept``'s rules).

    Everything is evaluated in one ``mx.eval``: the rows' logprobs (the
    server reads each emitted token's) and their acceptance draws.
    """
    if not any(processors) and all(r.kind == "greedy" for r in rules):
        return _greedy(logits, windows)
    lps, draws = [], []
    for i, (win, rule) in enumerate(zip(windows, rules, strict=True)):
        # Processors see the row's tokens through each node: its context
        # holds what the cache holds, the pending token (the root) follows.
        n = len(win.parents)
        lp = sampling.window_logprobs(
            logits[i, :n], processors[i], contexts[i], win.tokens, win.parents
        )
        lps.append(lp)
        draws.append(sampling.draws(win, lp, rule))
    mx.eval(lps, draws)
    walked = [
        sampling.walk(win, [x.tolist() for x in d], rule.kind)
        for win, d, rule in zip(windows, draws, rules, strict=True)
    ]
    return _rows(lps, windows, walked)


def _greedy(
    logits: mx.array, windows: List[sampling.Window]
) -> Tuple[List[mx.array], List[List[int]], List[int], List[bool]]:
    """``verify`` for greedy rows without processors: one log-softmax and one
    argmax for the batch (a GPU launches a handful of kernels, not B times
    as many), then each row's walk in Python."""
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    best = mx.argmax(lp, axis=-1)
    mx.eval(lp, best)
    walked = [
        sampling.walk(win, (t[: len(win.parents)],), "greedy")
        for win, t in zip(windows, best.tolist(), strict=True)
    ]
    return _rows([lp[i] for i in range(len(windows))], windows, walked)


def _rows(lps, windows, walked):
    """``verify``'s lists from each row's log-probs and ``(path, token)``."""
    out_lps, paths, targets, rejected = [], [], [], []
    for lp, win, (path, tok) in zip(lps, windows, walked, strict=True):
        m = len(path)
        out_lps.append(lp[:m] if path == list(range(m)) else lp[mx.array(path, mx.int32)])
        paths.append(path)
        targets.append(tok)
        rejected.append(any(p == path[-1] for p in win.parents[1:]))
    return out_lps, paths, targets, rejected


class BatchController:
    """γ per round from timings per batch size: plain steps against verify rounds.

    A batch size not measured yet borrows the nearest measured one's costs
    (rows join and leave all the time: probing and exploring each size anew
    would spend plain steps and wasted rounds on every change); it times its
    own plain steps once it has run ``OWN`` rounds on borrowed figures.
    """

    SAMPLES = 8  # recent timings kept per batch size; their medians are compared: a
    # GPU's rounds stall often (tens of ms; throughput pays that, the fastest
    # round hides it), while a CPU shared with other work spikes now and then
    PROBE = 3  # plain steps in a row that time one (the first of a run is not timed)
    EXPLORE = 3  # verify rounds timed before the cost model decides (the median of
    # three outvotes one round that stalled, e.g. on a GPU kernel compiled on first use)
    RETRY = 4  # drafting decisions in a row that chose γ = 0 before one round runs anyway
    RETRY_STEPS = 120  # ... and plain steps since the last round, where the caller counts them
    SLACK = 1.05  # drafting must promise this much more throughput than plain steps
    REPROBE = 48  # verify rounds at one batch size between plain re-measurements
    OWN = 8  # verify rounds at a batch size on a neighbour's plain cost before its own
    TREE_SLACK = 0.05  # a tree round may cost this much of a plain step beyond a chain's
    TREE_RETRY = 32  # chain rounds between tree rounds once trees were found dear
    AFTER = 4  # plain steps after a round whose excess over a plain step is the round's
    CLEAN = 16  # plain steps after a round before they time a clean plain step
    BACKOFF = 5  # retries that lost in a row, each doubling the wait, before it stops growing
    MODE = 24  # calls at a batch size with drafting on that are judged against plain steps
    MODE_SLACK = 0.97  # ... which must reach this share of the plain steps' tokens per second
    MODE_WAIT = 64  # calls with drafting off after it first lost at a size (doubling, to 16x)

    def __init__(self, gamma: int, gmax: int, adaptive: bool = True, auto_off: bool = True):
        self.gmax = max(1, gmax)
        self.gamma = max(1, min(gamma, self.gmax))
        self.adaptive, self.auto_off = adaptive, auto_off
        self.plain: Dict[int, deque] = {}
        self.verify: Dict[int, deque] = {}  # B -> (window width, seconds)
        self.rounds: Dict[int, int] = {}
        self.tree_cost: Dict[int, deque] = {}  # B -> a tree round's seconds beyond a chain's
        self.since_tree: Dict[int, int] = {}
        self.declined = 0  # decisions in a row that chose γ = 0
        self.yielded: Dict[int, deque] = {}  # B -> (tokens a round emitted, its seconds)
        self.last_round: Optional[int] = None  # batch size of the last round recorded
        self.charged = [False, False]  # its entries: a chain's timing, a yield
        self.clean: Dict[int, deque] = {}  # B -> plain steps timed far from any round
        self.lost: Dict[int, int] = {}  # B -> retries in a row that lost
        self.retried: Dict[int, bool] = {}  # B -> its last round was a retry
        self.widths: tuple = ()  # the widths windows are padded up to (``target.window_widths``)
        self.on_calls: Dict[int, deque] = {}  # B -> (tokens, seconds) of calls with drafting on
        self.off_calls: Dict[int, deque] = {}  # B -> the same with drafting off
        self.off_left: Dict[int, int] = {}  # B -> calls left with drafting off there
        self.off_losses: Dict[int, int] = {}  # B -> verdicts in a row that switched it off
        self.shapes: set = set()  # the (B, W, cache buffer) of the rounds run

    def drafting(self, B: int) -> bool:
        """Whether drafting is on at this batch size, as its calls have shown.

        The cost model prices what it sees of a round; this judges what the
        caller sees: every call's tokens and seconds (``call``), plain steps
        and rounds alike, while drafting is on, against plain steps' rate.
        Whatever a round costs beyond its own call (plain steps after it
        slowed by its holes or by a GPU's evicted graphs, the proposals'
        Python, exploring) shows there, so a batch size whose drafting
        loses decodes as mlx-lm's own steps for ``MODE_WAIT`` calls (then
        twice as many after each loss), and tries again. A size never
        judged takes the verdict of the one ``losing`` would borrow from."""
        if not self.auto_off:
            return True
        k = self._judged(B)
        if k is None or self.off_left.get(k, 0) <= 0:
            return True
        self.off_left[k] -= 1
        return False

    def _judged(self, B: int) -> Optional[int]:
        """``B`` if it was judged, else the size whose verdict it borrows."""
        return self._borrowed(list(self.off_left), B)

    @staticmethod
    def _borrowed(have: List[int], B: int) -> Optional[int]:
        """Of the sizes that ``have`` a record, the one ``B`` takes: itself or
        the largest smaller one (where fewer rows lost, more rows lose too),
        else the nearest larger one up to a third larger (rows leaving one by
        one must not explore each size anew); ``None`` without either."""
        below = [k for k in have if k <= B]
        above = [k for k in have if B < k <= B + max(1, B // 3)]
        return max(below) if below else (min(above) if above else None)

    def call(
        self, B: int, tokens: int, seconds: float, on: bool, shape: Optional[tuple] = None
    ) -> None:
        """A call of the batch at size ``B`` emitted ``tokens`` in ``seconds``
        (the caller's time after it included); ``on``: drafting was on;
        ``shape``: a round's ``(B, W, cache buffer)``. The first round of
        each shape is left out: it builds the kernels that later rounds of
        it reuse (its attention runs over the buffer: ``target``)."""
        if not self.auto_off or seconds <= 0:
            return
        if shape is not None and shape not in self.shapes:
            self.shapes.add(shape)
            return
        if not on:
            self.off_calls.setdefault(B, deque(maxlen=4 * self.MODE)).append((tokens, seconds))
            return
        q = self.on_calls.setdefault(B, deque(maxlen=self.MODE))
        q.append((tokens, seconds))
        ref = self._plain_rate(B)
        if len(q) < self.MODE or ref is None:
            return
        if sum(n for n, _ in q) / sum(t for _, t in q) >= self.MODE_SLACK * ref:
            self.off_losses[B], self.off_left[B] = 0, 0
            return
        losses = self.off_losses.get(B, 0)
        self.off_left[B] = self.MODE_WAIT << min(losses, 4)
        self.off_losses[B] = losses + 1
        q.clear()

    def _plain_rate(self, B: int) -> Optional[float]:
        """Tokens per second of plain steps at ``B``: its calls with drafting
        off where there are enough, else its clean plain steps'."""
        q = self.off_calls.get(B)
        if q and len(q) >= self.MODE // 2:
            return sum(n for n, _ in q) / sum(t for _, t in q)
        p = self._plain_at(B) if self.plain.get(B) else None
        return B / p if p else None

    def needs_plain(self, B: int) -> bool:
        """Whether plain steps at this batch size must be timed before deciding."""
        if not self.auto_off:
            return False
        rounds = self.rounds.get(B, 0)
        if len(self.plain.get(B, ())) < 2:
            return self._near(self.plain, B, 2) is None or rounds >= self.OWN
        return rounds >= self.REPROBE

    def plain_step(self, B: int, seconds: float, since_round: Optional[int] = None) -> None:
        """A pipelined plain step took ``seconds``; ``since_round``: plain
        steps since the last round, this one included, if the caller counts.

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
        if B not in self.rounds or (since_round or 0) > self.CLEAN:
            self.clean.setdefault(B, deque(maxlen=self.SAMPLES)).append(seconds)
        q = self.plain.setdefault(B, deque(maxlen=self.SAMPLES))
        if self.rounds.get(B, 0) >= self.REPROBE:
            self.rounds[B] = 0
            q.clear()  # a fresh reading: the machine's load changes
        q.append(seconds)

    def plain_cost(self, B: int) -> Optional[float]:
        """Seconds of a plain step at this batch size (or the nearest measured)."""
        near = self._near(self.plain, B, 1)
        return self._plain_at(near) if near is not None else None

    def _plain_at(self, B: int) -> float:
        """A plain step at a measured batch size: its recent steps' median, or
        its clean steps' where lower (rounds only ever slow the steps near them)."""
        p = median(self.plain[B])
        return min(p, median(self.clean[B])) if self.clean.get(B) else p

    def _charge(self, B: int, seconds: float) -> None:
        """Add ``seconds`` to the last round recorded at ``B`` (its timing and its yield)."""
        for table in (self.verify, self.yielded):
            q = table.get(B)
            if q and self.charged[table is self.yielded]:
                n, t = q[-1]
                q[-1] = (n, t + seconds)

    def verify_round(
        self, B: int, width: int, seconds: float, tree: bool = False, tokens: int = 0
    ) -> None:
        self.rounds[B] = self.rounds.get(B, 0) + 1
        self.last_round, self.charged = B, [not tree, bool(tokens)]
        if tokens:
            self.yielded.setdefault(B, deque(maxlen=self.SAMPLES)).append((tokens, seconds))
        if not tree:
            self.verify.setdefault(B, deque(maxlen=self.SAMPLES)).append((width, seconds))
            self.since_tree[B] = self.since_tree.get(B, 0) + 1
            return
        self.since_tree[B] = 0
        cost = self.cost(B)
        if cost is None:
            # No chain rounds to compare with yet: a tree round stands in for
            # one (at most what a chain costs), so that γ is still decided.
            self.verify.setdefault(B, deque(maxlen=self.SAMPLES)).append((width, seconds))
            return
        p, extra, b = cost
        chain = p + extra + b * (width - 1)
        self.tree_cost.setdefault(B, deque(maxlen=self.SAMPLES)).append(seconds - chain)

    def trees_pay(self, B: int) -> bool:
        """Whether rows may fill their windows with tree nodes: until a few
        tree rounds are timed, and while they cost about a chain's
        price; once found dear, one tree round every ``TREE_RETRY``."""
        near = self._near(self.tree_cost, B, 3)
        if near is None:
            return True
        bp = self._near(self.plain, near, 1)
        if bp is None or median(self.tree_cost[near]) <= self.TREE_SLACK * self._plain_at(bp):
            return True
        return self.since_tree.get(B, 0) >= self.TREE_RETRY

    @staticmethod
    def _near(table: Dict[int, deque], B: int, need: int) -> Optional[int]:
        """``B`` if it has ``need`` samples, else the nearest batch size that
        has (the larger on a tie), else ``None``."""
        have = [k for k, q in table.items() if len(q) >= need]
        if not have:
            return None
        return B if B in have else min(have, key=lambda k: (abs(k - B), -k))

    def cost(self, B: int) -> Optional[Tuple[float, float, float]]:
        """``(p, extra, b)``: seconds of a plain step, of a verify round beyond
        it at any width, and of each extra window column (``policy.fit``
        over the recent rounds at the nearest size with enough of them)."""
        bp, bv = self._near(self.plain, B, 1), self._near(self.verify, B, self.EXPLORE)
        if bp is None or bv is None:
            return None
        p = self._plain_at(bp)
        pv = self._plain_at(self._near(self.plain, bv, 1))
        extra, b = policy.fit(self.verify[bv], pv)
        # Measured on fewer rows, a column costs at most proportionally more.
        return p, extra, b * max(1.0, B / bv)

    def losing(self, B: int, plain_rate: float) -> bool:
        """Whether this batch size's recent rounds emitted fewer tokens per
        second than plain steps do, whatever the cost model predicts: the
        tokens are counted, not expected, and the seconds run from one call
        to the next, so a cost the model does not see (a server's work
        around a round, acceptance below the rows' estimates) still shows.
        A size with too few rounds of its own takes the record of the
        largest smaller size that has one, against that size's plain steps:
        where fewer rows lost, more rows lose too (a step's cost grows with
        rows, a round's even more), while far fewer rows may still win; or,
        without one, of the nearest larger size up to a third larger (rows
        leaving one by one must not explore each size anew where drafting
        lost)."""
        near = self._borrowed([k for k, q in self.yielded.items() if len(q) >= self.EXPLORE], B)
        if near is None:
            return False
        if near != B:
            bp = self._near(self.plain, near, 1)
            if bp is None:
                return False
            plain_rate = near / self._plain_at(bp)
        done = self.yielded[near]
        return sum(n for n, _ in done) / sum(t for _, t in done) < plain_rate

    def choose(
        self, B: int, proposed: List[int], alphas: List[float], idle: Optional[int] = None
    ) -> int:
        """Draft length for this round (0: a plain batched step); ``idle``:
        plain steps since the last round, if the caller counts them."""
        top = max(proposed, default=0)
        if top == 0:
            return 0
        cost = self.cost(B) if self.adaptive and self.auto_off else None
        if cost is None:
            self.declined = 0
            return min(self.gamma, top)  # explore (or no adaptation or switch-off asked for)
        plain_rate = B / cost[0]
        best, _ = policy.best_length(
            alphas,
            proposed,
            cost,
            self.gmax,
            # A window is padded (``target.padded_width``): its columns all cost.
            width=lambda w: target_mod.padded_width(w, self.widths, B),
            floor=plain_rate * self.SLACK,
        )
        losing = bool(best) and self.losing(B, plain_rate)
        if best and not losing:
            self.gamma, self.declined, self.lost[B] = best, 0, 0
            return best
        if self.retried.pop(B, False):
            # The retry did not win: wait twice as long before the next.
            self.lost[B] = min(self.lost.get(B, 0) + 1, self.BACKOFF)
        self.declined += 1
        wait = 1 << self.lost.get(B, 0)
        if self.declined < self.RETRY * wait or (
            idle is not None and idle < self.RETRY_STEPS * wait
        ):
            return 0
        # Only rounds renew a round's timings: without one now and then, rounds
        # timed while the machine was busy would keep γ at 0 for good.
        self.declined, self.retried[B] = 0, True
        return min(self.gamma, top)
