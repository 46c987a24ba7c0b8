"""Scoring suffix matches: what followed the longest occurrences of the
current suffix, how many of them agree at each token, and how much of a
draft is worth a verify.

The occurrences that match longest continue the draft token by token; each
step keeps the continuation most of them agree on (its share), and the
product of the shares is the draft's score: the walk stops when it drops
below ``min_score``, or at ``alpha`` times the match length (a short match
is a weak guess). ``draft_length`` then keeps the prefix with the most
expected tokens per plain step under the measured verify cost.
"""

from typing import Callable, Optional

FULL_MATCH = 12  # occurrences matching this long all count as evidence


def chain_draft(
    cands: list[tuple[int, int]],
    follow: Callable[[int], Optional[int]],
    n: int,
    alpha: float,
    min_score: float,
    present: Optional[int] = None,
) -> tuple[list[int], int]:
    """The draft continuing ``cands`` (``(match length, position)``) and the
    match length it rests on. ``follow(q)`` is the token at ``q`` or None;
    with ``present`` (the history's length) a match running into the present
    repeats what it drafted (LZ77-style: a loop continues)."""
    out, _, best = walk(cands, follow, n, alpha, min_score, present)
    return out, best


def walk(cands, follow, n, alpha, min_score, present=None):
    """``chain_draft``'s draft with each token's share (of the occurrences
    still agreeing, how many go that way): ``(tokens, shares, match)``."""
    if not cands:
        return [], [], 0
    best = max(m for m, _ in cands)
    floor = min(best, FULL_MATCH)
    live = [p for m, p in cands if m >= floor]
    limit = min(n, int(alpha * best))
    out: list[int] = []
    shares: list[float] = []
    score = 1.0

    def at(q):
        if present is not None and q >= present:
            return out[q - present] if q - present < len(out) else None
        return follow(q)

    for j in range(limit):
        counts: dict[int, int] = {}
        for p in live:
            t = at(p + j)
            if t is not None:
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        tok, c = max(counts.items(), key=lambda kv: kv[1])
        score *= c / len(live)
        if score < min_score:
            break
        shares.append(c / len(live))
        live = [p for p in live if at(p + j) == tok]
        out.append(tok)
    return out, shares, best


def draft_length(p: float, shares: list[float], cost: tuple[float, float], gain: float) -> int:
    """How many of a draft's tokens to verify: the length with the most
    expected tokens per plain step, if each token is kept with probability
    ``p`` times its share and a verify over ``w`` tokens costs ``a + b * w``
    plain steps; 0 where no length beats a plain step by ``gain``."""
    a, b = cost
    best, best_rate, expect, reach = 0, gain, 1.0, 1.0
    for g, share in enumerate(shares, 1):
        reach *= p * share
        expect += reach
        rate = expect / (a + b * (g + 1))
        if rate > best_rate:
            best, best_rate = g, rate
    return best


def continuations(
    cands: list[tuple[int, int]],
    follow: Callable[[int], Optional[int]],
    n: int,
    alpha: float,
    present: Optional[int] = None,
) -> list[tuple[list[int], float]]:
    """What followed each of the longest-matching occurrences (as
    ``chain_draft`` keeps them), up to ``n`` tokens and ``alpha`` times the
    match length, each with weight 1: a token tree's paths."""
    if not cands:
        return []
    best = max(m for m, _ in cands)
    limit = min(n, int(alpha * best))
    out = []
    for m, p in cands:
        if m < min(best, FULL_MATCH):
            continue
        path: list[int] = []
        for j in range(limit):
            q = p + j
            if present is not None and q >= present:
                t = path[q - present] if q - present < len(path) else None
            else:
                t = follow(q)
            if t is None:
                break
            path.append(t)
        if path:
            out.append((path, 1.0))
    return out
