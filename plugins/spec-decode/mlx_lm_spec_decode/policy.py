"""How long a round's drafts should be: one cost model and one rule for the
serial loop (one row, ``controller.Controller``) and the batch
(``batch_verify.BatchController``).

A verify forward over ``W`` tokens costs ``p + extra + b * (W - 1)``: ``p``
a plain step, ``extra`` what a verify costs beyond one at any width (its
host sync, the window's attention), ``b`` each column more. On a
memory-bound device ``b`` is near 0 and ``extra`` carries the cost; on a
CPU each column costs compute. Each row's drafts are right with
probability ``alpha`` each, given the ones before them (``Acceptance``),
so a round over ``g`` drafts yields ``expected_tokens(alpha, g)``.
``best_length`` takes the ``g`` that yields most tokens per second.
"""

from statistics import fmean, median
from typing import Callable, Iterable, List, Optional, Tuple

Cost = Tuple[float, float, float]  # (p, extra, b)

# Plain steps a verify column may cost and still count as free: a
# memory-bound device's, where a wider window costs what a narrow one does.
FREE_COLUMN = 0.03


def free_columns(cost: Optional[Tuple[float, float]]) -> bool:
    """Whether a measured verify cost ``(a, b)`` (``Controller.verify_cost``)
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
