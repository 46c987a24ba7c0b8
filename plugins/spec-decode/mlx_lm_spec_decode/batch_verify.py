"""One batched verify forward's per-row acceptance, and the batch's draft length.

``verify`` turns the logits of a forward over ``[B, W]`` windows (row i:
its ``sampling.Window``, a chain or a tree, then padding) into each row's
log-probabilities, accepted path and next token, with the row's own
sampler and logits processors (the rules of ``sampling``: greedy match,
lossless speculative sampling, or sample-and-match).

``BatchController`` picks the draft length γ for a round by the policy
both drivers share (``policy.Policy``, keyed by batch size B; the serial
loop is B = 1): the cost of a plain step, what a verify round costs beyond
it whatever its width (the round is read back before the next is built,
where plain steps overlap; its Python work), and how much each extra window
column adds, against the tokens each row is expected to gain from its
drafts at its measured acceptance. Rounds that verified branching token
trees are timed apart: where a tree costs more than a chain of its width (a
GPU's extra kernels), rows draft chains. What only the batch has stays
here: γ = 0 (a plain batched step) wins whenever drafting does not pay, so
a batch never decodes slower than the plain batched loop by more than the
measurements' noise; where the cost model or the size's recent rounds
(``Policy.losing``) keep declining, one round runs anyway after ``RETRY``
declines and ``RETRY_STEPS`` plain steps, so that the round's timings stay
current, each retry that did not win doubling the wait (a ``policy.Switch``
counting decisions). And the caller's clock: every call's tokens and
seconds while drafting is on, judged against plain steps' by the policy's
one switch (``Policy.judge``, counting calls).

A plain step's cost is its clean one: the median of the steps timed far
from any round (``Policy.CLEAN`` plain steps after one, or before the
first) where that is lower than the recent steps'. On a GPU a round evicts
the step's executable graphs and the steps after it run slow for a while;
timed as plain steps, they would make plain decoding look slow and the
rounds that slowed them look cheap (``Policy.plain_step``).
"""

from collections import deque
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from . import policy, sampling


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


class BatchController(policy.Policy):
    """The batch's policy: ``policy.Policy`` at every batch size it runs,
    its decisions (a round, or γ = 0) and its calls judged on the caller's
    clock."""

    EXPLORE = 3  # verify rounds timed before the cost model decides (the median of
    # three outvotes one round that stalled, e.g. on a GPU kernel compiled on first use)
    SLACK = 1.05  # drafting must promise this much more throughput than plain steps
    PROBE = 3  # plain steps in a row that time one (the first of a run is not timed)
    RETRY = 4  # drafting decisions in a row that chose γ = 0 before one round runs anyway
    RETRY_STEPS = 120  # ... and plain steps since the last round, where the caller counts them
    RETRY_DOUBLINGS = 5  # retries that lost in a row, each doubling the wait, before it stops
    # Drafting judged on the caller's clock: calls at a batch size with it on
    # (plain steps included: what a round costs beyond its own call shows in
    # theirs), which need more of them than a request's rounds do; the wait
    # after a loss is in calls too.
    JUDGE = JUDGE_AGAIN = 24
    WAIT = 64

    def __init__(
        self,
        gamma: int,
        gmax: int,
        adaptive: bool = True,
        auto_off: bool = True,
        widths: tuple = (),
    ):
        super().__init__(gamma, gmax, adaptive, auto_off, widths)
        self.declined = 0  # decisions in a row that chose γ = 0
        self.declines: Dict[int, policy.Switch] = {}  # B -> its declines' retries
        self.on_calls: Dict[int, deque] = {}  # B -> (tokens, seconds) of calls with drafting on
        self.off_calls: Dict[int, deque] = {}  # B -> the same with drafting off
        self.shapes: set = set()  # the (B, W, cache buffer) of the rounds run

    def call(
        self, B: int, tokens: int, seconds: float, on: bool, shape: Optional[tuple] = None
    ) -> None:
        """A call of the batch at size ``B`` emitted ``tokens`` in ``seconds``
        (the caller's time after it included); ``on``: drafting was on;
        ``shape``: a round's ``(B, W, cache buffer)``. The first round of
        each shape is left out: it builds the kernels that later rounds of
        it reuse (its attention runs over the buffer: ``target``).

        The cost model prices what it sees of a round; this judges what the
        caller sees (``Policy.judge``): whatever a round costs beyond its
        own call (plain steps after it slowed by its holes or by a GPU's
        evicted graphs, the proposals' Python, exploring) shows there, so a
        batch size whose drafting loses decodes as mlx-lm's own steps for
        ``WAIT`` calls (twice as many after each loss in a row,
        ``Policy.drafting``), and tries again."""
        if not self.auto_off or seconds <= 0:
            return
        if shape is not None and shape not in self.shapes:
            self.shapes.add(shape)
            return
        if not on:
            q = self.off_calls.setdefault(B, deque(maxlen=4 * self.JUDGE))
            q.append((tokens, seconds))
            return
        q = self.on_calls.setdefault(B, deque(maxlen=self.JUDGE))
        q.append((tokens, seconds))
        self.judge(B, q, self._plain_rate(B), "calls")

    def resumes(self, B: int, alphas: List[float]) -> bool:
        """Whether drafting, off at B, is retried now: the rows with an
        acceptance in ``alphas`` (0: their guesses did not hold lately,
        ``policy.resume_watch``) drafting ``gmax`` and the others nothing
        would beat plain steps by ``SLACK`` at B's measured cost. A wait
        ended this way is judged again on its calls, and a loss doubles the
        next wait."""
        cost = self.cost(B)
        if cost is None or not any(alphas):
            return False
        best = self.length(
            B, alphas, [self.gmax if a else 0 for a in alphas], floor=B / cost[0] * self.SLACK
        )
        if not best or not best[0]:
            return False
        self.resume(B)
        return True

    def _plain_rate(self, B: int) -> Optional[float]:
        """Tokens per second of plain steps at ``B``: its calls with drafting
        off where there are enough, else its clean plain steps'."""
        q = self.off_calls.get(B)
        if q and len(q) >= self.JUDGE // 2:
            return policy.rate(q)
        return B / self._plain_at(B) if self.plain.get(B) else None

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
        best, _ = self.length(B, alphas, proposed, floor=plain_rate * self.SLACK)
        if best and not self.losing(B, plain_rate):
            self.gamma, self.declined = best, 0
            self._declines(B).win()
            return best
        self.declined += 1
        if not self._retry(B, idle):
            return 0
        self.declined = 0
        return min(self.gamma, top)

    def _declines(self, B: int) -> policy.Switch:
        if B not in self.declines:
            self.declines[B] = policy.Switch(self.RETRY, self.RETRY_DOUBLINGS)
        return self.declines[B]

    def _retry(self, B: int, idle: Optional[int]) -> bool:
        """Whether a decision that declines at ``B`` runs a round anyway: the
        last of a wait of ``RETRY`` declines (twice as many after each retry
        that did not win) that is also ``RETRY_STEPS`` plain steps (as
        doubled) after the last round, where the caller counts them. Only
        rounds renew a round's timings: without one now and then, rounds
        timed while the machine was busy would keep γ at 0 for good."""
        sw = self._declines(B)
        if not sw.off:  # a run of declines starts, or a retry did not win
            sw.lose("the cost model or the rounds' record declined")
        return sw.elapse(idle is None or idle >= self.RETRY_STEPS * sw.factor)
