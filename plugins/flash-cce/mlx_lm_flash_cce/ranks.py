"""Data-parallel runs: every rank takes rank 0's choice, through one ``all_sum``.

A candidate travels as five integers (its fields, the path by its place in
``Path``), so the ranks never need the same list of candidates to agree on one.
"""

from typing import Any, Optional

import mlx.core as mx

from .candidate import Candidate, Path

_PATHS = list(Path)  # how a candidate's path travels between ranks


def group() -> Optional[Any]:
    """The distributed group of a data-parallel run, or None when alone."""
    if not mx.distributed.is_available():
        return None
    g = mx.distributed.init()
    return g if g.size() > 1 else None


def encode(cand: Optional[Candidate]) -> list:
    if cand is None:
        return [-1, 0, 0, 0, 0]
    return [
        _PATHS.index(cand.path),
        cand.token_chunk,
        cand.vocab_chunk,
        cand.limit_mib,
        int(cand.last_resort),
    ]


def decode(code: list) -> Optional[Candidate]:
    if code[0] < 0:
        return None
    return Candidate(_PATHS[code[0]], code[1], code[2], code[3], bool(code[4]))


def agree(g: Any, cand: Optional[Candidate]) -> Optional[Candidate]:
    """Rank 0's candidate on every rank (None: rank 0 found none)."""
    mine = encode(cand) if g.rank() == 0 else [0] * 5
    total = mx.distributed.all_sum(mx.array(mine, dtype=mx.int32), group=g)
    mx.eval(total)
    return decode([int(x) for x in total.tolist()])


def rank() -> int:
    g = group()
    return 0 if g is None else g.rank()
