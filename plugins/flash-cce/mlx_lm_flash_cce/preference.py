"""Preference losses for ``mlx_lm.lora --loss orpo|dpo``: log-probs without logits.

Each batch of pairs (``pairs.collate``) runs its prompts once
(``shared_prompt``); the response tokens' log-probs come from the hidden
states and the head through ``api.linear_cross_entropy`` (its quantized
heads, its row padding for the 2- and 3-row quantized matmul, its backends),
never from ``[tokens, vocab]`` logits.

- ORPO (Hong et al., as TRL computes it): with ``c``, ``r`` the mean
  per-token log-probs of the chosen and rejected responses,
  ``log_odds = (c - r) - (log(1 - e^c) - log(1 - e^r))`` and
  ``loss = NLL(chosen) - beta * mean(log_sigmoid(log_odds))``; the NLL is
  the mean over the chosen responses' tokens; rewards ``beta * c`` and
  ``beta * r``.
- DPO (sigmoid): with ``c``, ``r`` the summed log-probs and ``c0``, ``r0``
  those of the reference model,
  ``loss = mean(-log_sigmoid(beta * ((c - r) - (c0 - r0))))``; rewards
  ``beta * (c - c0)`` and ``beta * (r - r0)``. The reference log-probs are
  computed once, before the first step, for every pair of every split, with
  LoRA/DoRA adapters switched off (a full fine-tune: the weights as training
  starts), and ride in each batch.

The loss reports ``METRICS`` (the host prints them beside mlx-lm's lines):
the mean reward margin, the fraction of pairs whose chosen reward is higher,
and the mean chosen and rejected log-probs the loss uses (per-token means
for ORPO, sums for DPO).
"""

import contextlib
import logging
import time
from typing import Any, Callable, Iterator, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlx_lm_ext import backbone

from . import api, pairs, shared_prompt

log = logging.getLogger("mlx_lm_flash_cce")

LOSSES = ("orpo", "dpo")
METRICS = ("reward_margin", "accuracy", "chosen_logp", "rejected_logp")
DEFAULT_BETA = 0.1


def log_sigmoid(x: mx.array) -> mx.array:
    return -mx.logaddexp(mx.zeros_like(x), -x)


def log1m_exp(x: mx.array) -> mx.array:
    """``log(1 - exp(x))`` for ``x < 0``, stable at both ends."""
    x = mx.minimum(x, -1e-7)  # a mean log-prob of exactly 0 would be log(0)
    return mx.where(x > -0.6931, mx.log(-mx.expm1(x)), mx.log1p(-mx.exp(x)))


def orpo(
    chosen: mx.array, rejected: mx.array, nll: mx.array, beta: float
) -> Tuple[mx.array, mx.array, mx.array]:
    """``(loss, chosen_rewards, rejected_rewards)`` from mean per-token log-probs ``[B]``."""
    log_odds = (chosen - rejected) - (log1m_exp(chosen) - log1m_exp(rejected))
    loss = nll - beta * log_sigmoid(log_odds).mean()
    return loss, beta * chosen, beta * rejected


def dpo(
    chosen: mx.array, rejected: mx.array, ref_chosen: mx.array, ref_rejected: mx.array, beta: float
) -> Tuple[mx.array, mx.array, mx.array]:
    """``(loss, chosen_rewards, rejected_rewards)`` from summed log-probs ``[B]``."""
    margin = (chosen - rejected) - (ref_chosen - ref_rejected)
    loss = -log_sigmoid(beta * margin).mean()
    return loss, beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)


def metrics(
    chosen_rewards: mx.array, rejected_rewards: mx.array, chosen: mx.array, rejected: mx.array
) -> mx.array:
    """``METRICS`` of one batch, float32 ``[4]``."""
    return mx.stack(
        [
            (chosen_rewards - rejected_rewards).mean(),
            (chosen_rewards > rejected_rewards).astype(mx.float32).mean(),
            chosen.mean(),
            rejected.mean(),
        ]
    ).astype(mx.float32)


def make_token_logps(
    model: Any, check: bool = True, share_prompt: bool = True, **options: Any
) -> Callable:
    """``token_logps(model, prompts, prompt_lens, responses) -> [2B, R]`` for this model.

    The prompt is shared and the head read without logits where the model
    allows; otherwise (logged) two full sequences per pair, or the model's
    own logits when its head does not decompose.
    """
    from . import loss as cce_loss

    name, arch = backbone.resolve(model)
    flash, message = True, "self-check skipped"
    if check:
        flash, _, message = cce_loss.self_check(model, arch, options)
    if not flash:
        log.warning(
            "flash-cce: %s model does not fit the head rule (%s); preference log-probs "
            "from its full logits",
            name,
            message,
        )

        def stock(model, prompts, prompt_lens, responses):
            return shared_prompt.stock_logps(model, prompts, prompt_lens, responses)

        stock.shared, stock.flash = False, False
        return stock
    vocab = model(mx.zeros((1, 1), mx.int32)).shape[-1]
    if share_prompt:
        shared, why = shared_prompt.check(model, arch, vocab)
    else:  # mlx-lm's --grad-checkpoint: a checkpointed layer's keys carry no gradient out
        shared, why = (
            False,
            "--grad-checkpoint recomputes each layer, so its keys cannot be handed on",
        )
    if shared:
        log.info("flash-cce: %s model, prompt run once per pair (%s)", name, why)
    else:
        log.info(
            "flash-cce: %s model cannot share the prompt (%s); each pair runs as two full "
            "sequences",
            name,
            why,
        )
    hidden_of = shared_prompt.shared_hidden if shared else shared_prompt.unshared_hidden

    def token_logps(model, prompts, prompt_lens, responses):
        hidden = hidden_of(model, arch, prompts, prompt_lens, responses)
        ce = api.linear_cross_entropy(
            hidden,
            arch.head(model),
            responses,
            softcap=arch.softcap(model),
            logit_scale=arch.logit_scale(model),
            reduction="none",
            with_grad=model.training,
            **options,
        )
        return -ce

    token_logps.shared, token_logps.flash = shared, True
    return token_logps


def sequence_logps(token_logps: mx.array, response_lens: mx.array) -> mx.array:
    """``[2B]`` summed log-probs over each response's real tokens."""
    mask = mx.arange(token_logps.shape[1])[None] < response_lens[:, None]
    return (token_logps * mask).sum(axis=1)


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[int]:
    """The base model: every LoRA/DoRA layer swapped for the layer it wraps, then back."""
    swapped = []
    for path, module in model.named_modules():
        if "lora_a" in module:
            base = module.get("linear", module.get("embedding"))
            if isinstance(base, nn.Module):
                swapped.append((path, module, base))
    model.update_modules(tree_unflatten([(p, b) for p, _, b in swapped]))
    try:
        yield len(swapped)
    finally:
        model.update_modules(tree_unflatten([(p, m) for p, m, _ in swapped]))


def reference(model: nn.Module, token_logps: Callable, sets: Sequence[Any], batch_size: int) -> int:
    """Fill ``pair.ref`` for every pair of ``sets`` that has none; returns how many."""
    todo = [p for s in sets for p in s.pairs if p.ref is None]
    if not todo:
        return 0
    tic = time.perf_counter()
    was_training = model.training
    model.eval()
    with adapters_off(model) as n_off:
        for i in range(0, len(todo), batch_size):
            chunk = todo[i : i + batch_size]
            prompts, plens, responses, rlens, _ = pairs.collate(chunk)
            seq = sequence_logps(token_logps(model, prompts, plens, responses), rlens)
            seq = seq.tolist()
            for j, pair in enumerate(chunk):
                pair.ref = (seq[j], seq[len(chunk) + j])
    model.train(was_training)
    log.info(
        "flash-cce: dpo reference log-probs of %d pairs (%s) in %.1f s",
        len(todo),
        f"{n_off} adapter layers off" if n_off else "the weights as training starts",
        time.perf_counter() - tic,
    )
    return len(todo)


def make_loss(
    model: nn.Module,
    name: str,
    *,
    beta: float = DEFAULT_BETA,
    sets: Sequence[Any] = (),
    batch_size: int = 4,
    check: bool = True,
    share_prompt: bool = True,
    **options: Any,
) -> Callable[..., Tuple[mx.array, mx.array, mx.array]]:
    """``loss(model, prompts, prompt_lens, responses, response_lens, refs)
    -> (loss, ntokens, metrics)`` for ``name`` in ``LOSSES``.

    ``ntokens`` counts each prompt once plus both responses. DPO first fills
    the reference log-probs of every pair in ``sets``. ``share_prompt=False``
    (mlx-lm's ``--grad-checkpoint``) runs each pair as two full sequences.
    """
    if name not in LOSSES:
        raise ValueError(f"unknown preference loss {name!r} (have: {', '.join(LOSSES)})")
    options = {k: v for k, v in options.items() if k != "verbose"}
    token_logps = make_token_logps(model, check=check, share_prompt=share_prompt, **options)
    if name == "dpo":
        reference(model, token_logps, sets, batch_size)

    def loss(model, prompts, prompt_lens, responses, response_lens, refs):
        b = prompts.shape[0]
        tok = token_logps(model, prompts, prompt_lens, responses)
        seq = sequence_logps(tok, response_lens)
        if name == "orpo":
            lens = response_lens.astype(mx.float32)
            mean = seq / lens
            nll = -seq[:b].sum() / lens[:b].sum()
            value, cr, rr = orpo(mean[:b], mean[b:], nll, beta)
            chosen, rejected = mean[:b], mean[b:]
        else:
            value, cr, rr = dpo(seq[:b], seq[b:], refs[:, 0], refs[:, 1], beta)
            chosen, rejected = seq[:b], seq[b:]
        ntoks = prompt_lens.sum() + response_lens.sum()
        return value.astype(mx.float32), ntoks, metrics(cr, rr, chosen, rejected)

    loss.metrics, loss.shared, loss.flash = METRICS, token_logps.shared, token_logps.flash
    return loss
