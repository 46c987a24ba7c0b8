"""The offline preference objectives of ``mlx_lm.lora --loss NAME``, as TRL writes them.

Each takes per-pair log-probs ``[B]`` of the chosen (``c``) and rejected
(``r``) responses and returns ``(loss, chosen_rewards, rejected_rewards)``.
``MEAN`` objectives use per-token mean log-probs (length-normalised), the
others summed ones; ``REFERENCE`` objectives also take ``c0``, ``r0``, the
reference model's log-probs of the same kind, with ``h = (c - r) - (c0 - r0)``.

- ``orpo`` (Hong et al.): ``NLL(chosen) - beta * mean(log_sigmoid(log_odds))``,
  ``log_odds = (c - r) - (log(1 - e^c) - log(1 - e^r))``; rewards ``beta * c``.
- ``dpo`` (Rafailov et al., sigmoid): ``mean(-log_sigmoid(beta * h))``;
  rewards ``beta * (c - c0)``.
- ``ipo`` (Azar et al.): ``mean((h - 1 / (2 * beta))^2)`` on mean log-probs;
  rewards ``beta * (c - c0)``.
- ``hinge`` (SLiC, Zhao et al.): ``mean(relu(1 - beta * h))``; rewards
  ``beta * (c - c0)``.
- ``simpo`` (Meng et al.): ``mean(-log_sigmoid(beta * (c - r) - gamma))`` on
  mean log-probs, no reference, ``gamma`` the target margin; rewards ``beta * c``.
- ``cpo`` (Xu et al.): ``mean(-log_sigmoid(beta * (c - r))) + NLL(chosen)``,
  no reference; rewards ``beta * c``.

``NLL(chosen)`` is the mean over the chosen responses' tokens.
"""

from typing import Tuple

import mlx.core as mx

LOSSES = ("orpo", "dpo", "ipo", "hinge", "simpo", "cpo")
REFERENCE = ("dpo", "ipo", "hinge")
MEAN = ("orpo", "ipo", "simpo")
DEFAULT_BETA = {"orpo": 0.1, "dpo": 0.1, "ipo": 0.1, "hinge": 0.1, "simpo": 2.0, "cpo": 0.1}
DEFAULT_GAMMA = 0.5  # SimPO's target margin (TRL's simpo_gamma)
MAX_STRENGTH = 100.0  # beta and gamma above this saturate every pair: refused

Out = Tuple[mx.array, mx.array, mx.array]


def log_sigmoid(x: mx.array) -> mx.array:
    return -mx.logaddexp(mx.zeros_like(x), -x)


def log1m_exp(x: mx.array) -> mx.array:
    """``log(1 - exp(x))`` for ``x < 0``, stable at both ends."""
    x = mx.minimum(x, -1e-7)  # a mean log-prob of exactly 0 would be log(0)
    return mx.where(x > -0.6931, mx.log(-mx.expm1(x)), mx.log1p(-mx.exp(x)))


def orpo(chosen: mx.array, rejected: mx.array, nll: mx.array, beta: float) -> Out:
    log_odds = (chosen - rejected) - (log1m_exp(chosen) - log1m_exp(rejected))
    loss = nll - beta * log_sigmoid(log_odds).mean()
    return loss, beta * chosen, beta * rejected


def _rewards(chosen, rejected, ref_chosen, ref_rejected, beta):
    return beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)


def dpo(chosen, rejected, ref_chosen, ref_rejected, beta: float) -> Out:
    margin = (chosen - rejected) - (ref_chosen - ref_rejected)
    loss = -log_sigmoid(beta * margin).mean()
    return (loss, *_rewards(chosen, rejected, ref_chosen, ref_rejected, beta))


def ipo(chosen, rejected, ref_chosen, ref_rejected, beta: float) -> Out:
    margin = (chosen - rejected) - (ref_chosen - ref_rejected)
    loss = mx.square(margin - 1 / (2 * beta)).mean()
    return (loss, *_rewards(chosen, rejected, ref_chosen, ref_rejected, beta))


def hinge(chosen, rejected, ref_chosen, ref_rejected, beta: float) -> Out:
    margin = (chosen - rejected) - (ref_chosen - ref_rejected)
    loss = mx.maximum(1 - beta * margin, 0).mean()
    return (loss, *_rewards(chosen, rejected, ref_chosen, ref_rejected, beta))


def simpo(chosen: mx.array, rejected: mx.array, beta: float, gamma: float) -> Out:
    loss = -log_sigmoid(beta * (chosen - rejected) - gamma).mean()
    return loss, beta * chosen, beta * rejected


def cpo(chosen: mx.array, rejected: mx.array, nll: mx.array, beta: float) -> Out:
    loss = -log_sigmoid(beta * (chosen - rejected)).mean() + nll
    return loss, beta * chosen, beta * rejected


def objective(
    name: str,
    seq: mx.array,
    lens: mx.array,
    refs: mx.array,
    beta: float,
    gamma: float = DEFAULT_GAMMA,
) -> Tuple[mx.array, mx.array, mx.array, mx.array, mx.array]:
    """``(loss, chosen_rewards, rejected_rewards, chosen, rejected)`` of one batch.

    ``seq`` ``[2B]`` summed log-probs (chosen rows, then rejected), ``lens``
    their token counts, ``refs`` ``[B, 2]`` the reference's summed log-probs
    of the same responses; ``chosen`` and ``rejected`` are the log-probs
    the objective read (means or sums).
    """
    b = refs.shape[0]
    lens = lens.astype(mx.float32)
    logps = seq / lens if name in MEAN else seq
    c, r = logps[:b], logps[b:]
    if name in REFERENCE:
        ref = refs / mx.stack([lens[:b], lens[b:]], axis=1) if name in MEAN else refs
        loss, cr, rr = _WITH_REFERENCE[name](c, r, ref[:, 0], ref[:, 1], beta)
    elif name == "simpo":
        loss, cr, rr = simpo(c, r, beta, gamma)
    else:  # orpo, cpo: with the chosen responses' NLL
        nll = -seq[:b].sum() / lens[:b].sum()
        loss, cr, rr = _WITH_NLL[name](c, r, nll, beta)
    return loss, cr, rr, c, r


_WITH_REFERENCE = {"dpo": dpo, "ipo": ipo, "hinge": hinge}
_WITH_NLL = {"orpo": orpo, "cpo": cpo}
