"""Acceptance rules: which drafted tokens the target keeps, losslessly.

One verify window (``Window``: a chain is a tree whose parents are
``i - 1``), one log-probabilities function (``window_logprobs``) and one
acceptance function (``accept``; ``draws`` then ``walk`` where a batch
evaluates its rows' draws together) serve the serial loop, its token trees,
the batched server and its trees. Three rules, picked from the sampler the
caller passed (``Rule``):

- ``greedy`` (no sampler, or temperature 0): keep drafts while they equal the
  target's argmax; the first mismatch position yields the target's argmax.
- ``explicit`` (a sampler from mlx-lm's ``make_sampler`` with temperature > 0,
  top-p/min-p/top-k): the target distribution ``p`` per position is computed
  with the sampler's own filter functions; a draft token ``x`` drawn from
  ``q`` is kept with probability ``min(1, p(x)/q(x))`` (``q`` one-hot for a
  deterministic drafter), and on rejection the token is drawn from the
  normalized residual ``max(0, p - q)``. This is the standard speculative
  sampling rule: the emitted tokens are distributed exactly as the target's.
- ``match`` (any other sampler callable, and XTC, whose coin flip is not a
  fixed distribution of its input row): the sampler itself draws the target
  token at each position, one row at a time; drafts are kept while they equal
  the draw. Each emitted token is the sampler's own draw given the emitted
  prefix, so this is exact for any sampler that draws independently from its
  input row; it only accepts less often than ``explicit``.

Logits processors run per position, each seeing the tokens before it (the
accepted drafts included), exactly as in plain decoding. What cannot be made
lossless is refused by ``check_sampler``: a sampler that does not return one
token id for a one-row input.

In a tree each rule walks down from the root: greedy and match follow the
child equal to the target's token; explicit tries a node's children in
order by recursive rejection (a rejected child's token leaves the residual)
and draws from the residual when all are rejected.
"""

from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from . import tree as tree_mod

# logprobs [rows, V] -> token ids (a sampler) or filtered logprobs (a filter)
Sampler = Callable[[mx.array], mx.array]

_FILTERS = {
    ("top_p",): "top_p",
    ("min_p", "min_tokens_to_keep"): "min_p",
    ("top_k",): "top_k",
    ("xtc_probability", "xtc_special_tokens", "xtc_threshold"): "xtc",
}


class UnsupportedSampler(ValueError):
    pass


def _closure(fn):
    code = getattr(fn, "__code__", None)
    if code is None or fn.__closure__ is None:
        return {}
    return dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__), strict=True))


def describe(sampler: Optional[Sampler]) -> tuple[str, Optional[float], Optional[Sampler]]:
    """``("greedy", 0, None)``, ``("explicit", temp, filter)`` or ``("match", None, None)``."""
    if sampler is None or sampler is greedy_sampler:
        return "greedy", 0.0, None
    if (
        getattr(sampler, "__module__", None) == "mlx_lm.sample_utils"
        and getattr(sampler, "__qualname__", "") == "make_sampler.<locals>.sampler"
    ):
        cells = _closure(sampler)
        methods, temp = cells.get("sampling_methods"), cells.get("temp")
        if isinstance(methods, list) and isinstance(temp, (int, float)) and temp > 0:
            kinds = [_FILTERS.get(tuple(sorted(_closure(m)))) for m in methods]
            if all(k in ("top_p", "min_p", "top_k") for k in kinds):
                return "explicit", float(temp), (_chain(methods) if methods else None)
    return "match", None, None


def _chain(methods):
    def apply(logprobs):
        for m in methods:
            logprobs = m(logprobs)
        return logprobs

    return apply


def check_sampler(sampler: Sampler, vocab_size: int) -> None:
    """Refuse a sampler whose draws cannot be matched token by token."""
    probe = mx.zeros((1, vocab_size), mx.float32)
    out = sampler(probe)
    if not isinstance(out, mx.array) or out.size != 1 or not mx.issubdtype(out.dtype, mx.integer):
        raise UnsupportedSampler(
            "speculative decoding needs a sampler that returns one token id per "
            f"row (got {getattr(out, 'shape', type(out))} for a 1x{vocab_size} input); "
            "such a sampler cannot be verified losslessly"
        )


class Rule:
    """How one request's tokens are drawn: its sampler, described once."""

    def __init__(self, sampler: Optional[Sampler]):
        self.sampler = sampler
        self.kind, self.temp, self.filt = describe(sampler)
        self.checked = self.kind != "match"

    def check(self, vocab: int) -> None:
        """A sampler drawn and matched: checked once, on the first round."""
        if not self.checked:
            check_sampler(self.sampler, vocab)
            self.checked = True


class Window(NamedTuple):
    """One verify window, a chain or a tree: ``tokens[0]`` is the pending
    token (the root, parent -1), every other node a drafted token whose
    parent comes before it; a chain's parents are ``i - 1``. ``tokens`` may
    be a (lazy) array: a draft model's drafts feed the forward unread. ``q``:
    for a chain drafted by sampling, the drafter's distribution at each
    drafted node (``[n - 1, V']``); None: drafted deterministically."""

    tokens: Union[List[int], mx.array]
    parents: List[int]
    q: Optional[mx.array] = None


def chain(pending: int, drafts: Any, q: Optional[mx.array] = None) -> Window:
    """The chain window ``[pending, drafts...]`` (``drafts``: ids or an array)."""
    if isinstance(drafts, mx.array):
        tokens = mx.concatenate([mx.array([pending], mx.uint32), drafts.astype(mx.uint32)])
        n = 1 + drafts.size
    else:
        tokens, n = [int(pending)] + [int(t) for t in drafts], 1 + len(drafts)
    return Window(tokens, list(range(-1, n - 1)), q)


def draws(win: Window, logprobs: mx.array, rule: Rule) -> tuple:
    """Lazy draws for ``walk`` from the target's log-probabilities at each
    node of ``win`` (``[n, V]``, as ``window_logprobs`` gives them): greedy,
    the argmax per node; match, the sampler's own draw per node; explicit,
    ``_sampled``."""
    if rule.kind == "greedy":
        return (mx.argmax(logprobs, axis=-1),)
    if rule.kind == "match":
        rule.check(logprobs.shape[-1])
        n = logprobs.shape[0]
        return (mx.concatenate([rule.sampler(logprobs[i : i + 1]).reshape(1) for i in range(n)]),)
    return _sampled(win, logprobs, rule.temp, rule.filt)


def _sampled(win: Window, logprobs: mx.array, temp: float, filt: Optional[Sampler]) -> tuple:
    """Per node ``c``: ``p(c)`` under its parent's target distribution, the
    drafter's ``q(c)`` (1 when drafted deterministically), a uniform, and a
    token drawn from the node's residual (its distribution less what its
    children took: the tokens themselves, or ``q`` for a sampled chain)."""
    lp = filt(logprobs) if filt is not None else logprobs
    p = mx.softmax(lp.astype(mx.float32) * (1.0 / temp), axis=-1)
    n, V = p.shape
    toks = win.tokens if isinstance(win.tokens, mx.array) else mx.array(win.tokens, mx.uint32)
    cols = toks[1:].astype(mx.int32)
    rows = mx.array(win.parents[1:], mx.int32)
    zero = mx.zeros((1,), mx.float32)
    num = mx.concatenate([zero, p[rows, cols]]) if n > 1 else zero
    den = mx.ones((n,), mx.float32)
    if win.q is None or n == 1:
        taken = mx.zeros(p.shape, mx.float32)
        if n > 1:
            taken[rows, cols] = num[1:]
        residual = p - taken
    else:
        if win.parents != list(range(-1, n - 1)):
            raise ValueError("a drafter's distributions q are for chains only")
        q = win.q.astype(mx.float32)
        if q.shape[-1] < V:
            q = mx.concatenate([q, mx.zeros((n - 1, V - q.shape[-1]), mx.float32)], axis=-1)
        q = q[:, :V]
        den = mx.concatenate([mx.ones((1,), mx.float32), q[mx.arange(n - 1), cols]])
        # Node i's child was drawn from q[i]; the last node has none.
        residual = p - mx.concatenate([q, mx.zeros((1, V), mx.float32)])
    residual = mx.maximum(residual, 0.0)
    # All the mass on the children: rejecting them all has probability 0.
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 1e-9, residual, p)
    return num, den, mx.random.uniform(shape=(n,)), mx.random.categorical(mx.log(residual))


def walk(win: Window, values: Sequence[List[Any]], kind: str) -> tuple[List[int], int]:
    """The accepted path (node indices, the root first) and the token after
    it, from ``draws``' values (lists). Greedy and match follow the target's
    token down the tree. Explicit is speculative sampling with recursive
    rejection over siblings: at a node whose remaining distribution is
    ``r`` (the target's, less the children already rejected), child ``c``
    is kept with probability ``min(1, r(c) / q(c))``; when every child is
    rejected, the token is drawn from what is left. Each emitted token is
    then distributed exactly as the target's own."""
    tokens = win.tokens.tolist() if isinstance(win.tokens, mx.array) else win.tokens
    kids = tree_mod.children(win.parents)
    node, path = 0, [0]
    if kind != "explicit":
        (targets,) = values
        while True:
            t = targets[node]
            nxt = next((c for c in kids[node] if tokens[c] == t), None)
            if nxt is None:
                return path, int(t)
            path.append(nxt)
            node = nxt
    num, den, u, res = values
    while True:
        rest = 1.0  # the mass of r: one-hot q takes each rejected child's p
        for c in kids[node]:
            if u[c] * rest * den[c] < num[c]:
                path.append(c)
                node = c
                break
            rest -= num[c]
        else:
            return path, int(res[node])


def accept(
    win: Window, logprobs: mx.array, rule: Rule, drawn: Optional[tuple] = None
) -> tuple[List[int], int]:
    """``walk`` over ``draws`` (``drawn``: those already built for this
    window), evaluated here (with the window's tokens): the accepted path
    and the target's token after it."""
    d = drawn if drawn is not None else draws(win, logprobs, rule)
    mx.eval(d, win.tokens if isinstance(win.tokens, mx.array) else [])
    return walk(win, [x.tolist() for x in d], rule.kind)


def window_logprobs(
    logits: mx.array,
    processors: Optional[Sequence[Any]],
    context: Union[None, List[int], mx.array],
    tokens: Union[List[int], mx.array],
    parents: Optional[List[int]] = None,
) -> mx.array:
    """``[n, V]`` log-probabilities of a verify window's ``n`` positions
    (``tokens[0]``: the pending token), the one function the serial loop,
    the batch and both tree forms use. Position i's logits processors see
    ``context`` (the tokens before the window) and then the window's tokens
    from the first through i along ``parents`` (None: a chain, each node's
    parent the one before it), as a plain step that had fed token i would."""
    if not processors:
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    base = context if isinstance(context, mx.array) else mx.array(list(context or []), mx.uint32)
    base = base.astype(mx.uint32)
    win = tokens if isinstance(tokens, mx.array) else mx.array(tokens, mx.uint32)
    win = win.astype(mx.uint32)
    rows = []
    for i in range(logits.shape[0]):
        if parents is None:
            seen = win[: i + 1]
        else:
            seen = mx.array([tokens[j] for j in tree_mod.path_to(parents, i)], mx.uint32)
        toks = mx.concatenate([base, seen])
        row = logits[i : i + 1]
        for proc in processors:
            row = proc(toks, row)
        rows.append(row)
    out = mx.concatenate(rows, axis=0)
    return out - mx.logsumexp(out, axis=-1, keepdims=True)


def kept_on_device(win: Window, targets: mx.array) -> tuple[mx.array, mx.array]:
    """``walk``'s greedy result for a chain, on the device (lazy, nothing
    read): how many drafts the target's tokens ``targets`` (``draws``)
    keep, and the target's token after them (``[1]``). For work queued
    behind a verify before the host reads it; the host's ``walk`` stays
    the rule, and the two are compared before that work is used."""
    tokens = win.tokens if isinstance(win.tokens, mx.array) else mx.array(win.tokens, mx.uint32)
    n = tokens.size - 1
    same = (tokens[1:].astype(mx.uint32) == targets[:n].astype(mx.uint32)).astype(mx.int32)
    a = mx.cumprod(same).sum() if n else mx.array(0, mx.int32)
    return a, targets[a][None].astype(mx.uint32)


def kept(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many drafts a greedy or sample-and-match round keeps: the length
    of their common prefix with the target's tokens (``targets`` may be
    shorter: what was emitted so far, for drafts no round verified)."""
    a, n = 0, min(len(drafts), len(targets))
    while a < n and drafts[a] == targets[a]:
        a += 1
    return a
