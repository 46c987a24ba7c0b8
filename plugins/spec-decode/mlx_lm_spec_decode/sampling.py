"""Acceptance rules: which drafted tokens the target keeps, losslessly.

Three rules, picked from the sampler the caller passed:

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
"""

from typing import Any, Callable, List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

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


def verify_greedy(logprobs: mx.array, drafts: mx.array) -> mx.array:
    """(lazy) target tokens for every row; the caller counts the matches."""
    return mx.argmax(logprobs, axis=-1)


def verify_explicit(
    logprobs: mx.array, drafts: Any, q: Optional[mx.array], temp: float, filt: Optional[Sampler]
) -> tuple[mx.array, mx.array, mx.array]:
    """Lazy ``(keep[k], residual_tokens[k], bonus[1])`` for the speculative sampling rule."""
    lp = filt(logprobs) if filt is not None else logprobs
    p = mx.softmax(lp.astype(mx.float32) * (1.0 / temp), axis=-1)
    k = len(drafts) if not isinstance(drafts, mx.array) else drafts.size
    bonus = mx.random.categorical(mx.log(p[k:]))
    if k == 0:
        return mx.zeros((0,), mx.bool_), mx.zeros((0,), mx.uint32), bonus
    d = drafts if isinstance(drafts, mx.array) else mx.array(drafts, mx.uint32)
    rows = mx.arange(k)
    pk = p[:k]
    p_d = pk[rows, d]
    if q is None:
        ratio = p_d
        residual = mx.put_along_axis(pk, d[:, None].astype(mx.int32), mx.array(0.0), axis=-1)
    else:
        q = q.astype(mx.float32)
        V = pk.shape[-1]
        if q.shape[-1] < V:
            q = mx.concatenate([q, mx.zeros((k, V - q.shape[-1]), mx.float32)], axis=-1)
        q = q[:, :V]
        ratio = mx.minimum(1.0, p_d / mx.maximum(q[rows, d], 1e-30))
        residual = mx.maximum(pk - q, 0.0)
    # A residual of all zeros only occurs where rejection has probability 0.
    total = residual.sum(axis=-1, keepdims=True)
    residual = mx.where(total > 0, residual, pk)
    keep = mx.random.uniform(shape=(k,)) < ratio
    res_tokens = mx.random.categorical(mx.log(residual))
    return keep, res_tokens, bonus


def verify_match(logprobs: mx.array, sampler: Sampler) -> mx.array:
    """The sampler's own draw for each row, one row per call."""
    return mx.concatenate(
        [sampler(logprobs[i : i + 1]).reshape(1) for i in range(logprobs.shape[0])]
    )


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
            path, j = [], i
            while j >= 0:
                path.append(j)
                j = parents[j]
            seen = mx.array([tokens[j] for j in reversed(path)], mx.uint32)
        toks = mx.concatenate([base, seen])
        row = logits[i : i + 1]
        for proc in processors:
            row = proc(toks, row)
        rows.append(row)
    out = mx.concatenate(rows, axis=0)
    return out - mx.logsumexp(out, axis=-1, keepdims=True)


def kept(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many drafts a greedy or sample-and-match round keeps: the length
    of their common prefix with the target's tokens (``targets`` may be
    shorter: what was emitted so far, for drafts no round verified)."""
    a, n = 0, min(len(drafts), len(targets))
    while a < n and drafts[a] == targets[a]:
        a += 1
    return a
