"""Preference losses for ``mlx_lm.lora --loss NAME``: log-probs without logits.

Each batch of pairs (``pairs.collate``) runs its prompts once
(``shared_prompt``); the response tokens' log-probs come from the hidden
states and the head through ``api.linear_cross_entropy`` (its quantized
heads, its row padding for the 2- and 3-row quantized matmul, its backends),
never from ``[tokens, vocab]`` logits. The objectives (ORPO, DPO, IPO, hinge,
SimPO, CPO) and their formulas are in ``objectives``.

The reference log-probs of DPO, IPO and hinge (``reference_plan`` says
which way, and the log names it):

- in the step, where every trained weight lies in adapters of the top ``k``
  layers (mlx-lm's ``--num-layers 16`` of more) and the reference is the
  base model: the lower layers' output is the same for both, so each
  forward, training and evaluation alike, runs them once and the top ``k``
  twice, with and without the adapters (``shared_prompt``'s ``top``); the
  reference costs those ``k`` layers and the head, no pass before training.
  Each pair's are kept from the first step that reads it
  (``keep_reference``): a batch read again (the next epoch, the next
  validation) runs the policy alone, so the reference costs each pair
  once, about ``reference_share`` of a forward, never once per read.
- else precomputed once, before the first step, for every pair of the
  splits the run reads (``sets``): in batches of twice ``--batch-size``
  pairs of similar length, forward only (eager: a compiled forward would
  retrace for each batch's shape), from the model with its LoRA/DoRA
  adapters switched off (a full fine-tune: the weights as training starts),
  or from another checkpoint (``--reference-model``); they ride in each
  batch.

The loss reports ``METRICS`` (the host prints them beside mlx-lm's lines):
the mean reward margin, the fraction of pairs whose chosen reward is higher,
and the mean chosen and rejected log-probs the objective uses (per-token
means or sums). In training its token count is each prompt once plus both
responses (mlx-lm's tokens per second); in evaluation it is the number of
pairs, so mlx-lm's ``evaluate``, which weights each batch by that count,
reports the mean over pairs, as TRL does, not over tokens.
"""

import logging
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from mlx_lm_ext.api import backbone

from . import api, objectives, pairs, shared_prompt
from .objectives import dpo, log1m_exp, log_sigmoid, orpo  # noqa: F401  (the formulas' home)

log = logging.getLogger("mlx_lm_flash_cce")

adapters_off = shared_prompt.adapters_off  # the reference's base model, layer by layer too
LOSSES = objectives.LOSSES
METRICS = ("reward_margin", "accuracy", "chosen_logp", "rejected_logp")
DEFAULT_BETA = 0.1
# The step's reference log-probs on their way to their pairs: a key starting
# with "_" is no parameter (never trained or saved), and mlx-lm's compiled
# step carries the model's arrays out (mlx_lm_ext/training.py does the same).
REFS = "_mlx_lm_flash_cce_refs"


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
    """``token_logps(model, prompts, prompt_lens, responses, top=0) -> [2B, R]`` for this model.

    The prompt is shared and the head read without logits where the model
    allows; otherwise (logged) two full sequences per pair, or the model's
    own logits when its head does not decompose. With ``top`` (the adapted
    top layers, see ``reference_plan``) it returns ``(policy, reference)``,
    the reference's without gradient.
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

        def stock(model, prompts, prompt_lens, responses, top=0):
            if top:
                raise ValueError("the reference in the step needs a head that decomposes")
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

    def logps(model, hidden, responses, with_grad):
        ce = api.linear_cross_entropy(
            hidden,
            arch.head(model),
            responses,
            softcap=arch.softcap(model),
            logit_scale=arch.logit_scale(model),
            reduction="none",
            with_grad=with_grad,
            **options,
        )
        return -ce

    def token_logps(model, prompts, prompt_lens, responses, top=0):
        hidden = hidden_of(model, arch, prompts, prompt_lens, responses, top)
        if not top:
            return logps(model, hidden, responses, model.training)
        n = responses.shape[0]
        policy = logps(model, hidden[:n], responses, model.training)
        return policy, logps(model, mx.stop_gradient(hidden[n:]), responses, False)

    def probe_reference(model, top):
        return shared_prompt.check_reference(model, arch, vocab, top, hidden_of)

    token_logps.shared, token_logps.flash = shared, True
    token_logps.vocab, token_logps.probe_reference = vocab, probe_reference
    return token_logps


def sequence_logps(token_logps: mx.array, response_lens: mx.array) -> mx.array:
    """``[2B]`` summed log-probs over each response's real tokens."""
    mask = mx.arange(token_logps.shape[1])[None] < response_lens[:, None]
    return (token_logps * mask).sum(axis=1)


def _by_length(sets: Sequence[Any]) -> List[pairs.Pair]:
    todo = [p for s in sets for p in s.pairs if p.ref is None]
    return sorted(todo, key=lambda p: (len(p.prompt), max(len(p.chosen), len(p.rejected))))


def _progress(total: int, what: str):
    from tqdm import tqdm  # as mlx_lm.lora's --test

    return tqdm(total=total, desc=what, unit="pair", disable=mx.distributed.init().rank() != 0)


def fill_reference(
    model: nn.Module, token_logps: Callable, todo: Sequence[pairs.Pair], batch_size: int
) -> None:
    """``pair.ref`` (summed log-probs) for each of ``todo`` from ``model`` as it is, no gradients."""
    was_training = model.training
    model.eval()

    # Not compiled: the batches' shapes follow their lengths, so a compiled
    # forward retraces for nearly every batch, and once traced it runs no
    # faster than this on the CPU (benchmarks/bench_preference.py).
    def forward(prompts, plens, responses, rlens):
        return sequence_logps(token_logps(model, prompts, plens, responses), rlens)

    try:
        with _progress(len(todo), "reference log-probs") as bar:
            for i in range(0, len(todo), batch_size):
                chunk = todo[i : i + batch_size]
                prompts, plens, responses, rlens, _ = pairs.collate(chunk)
                seq = forward(prompts, plens, responses, rlens).tolist()
                for j, pair in enumerate(chunk):
                    pair.ref = (seq[j], seq[len(chunk) + j])
                bar.update(len(chunk))
    finally:
        model.train(was_training)


def reference(
    model: nn.Module,
    token_logps: Callable,
    sets: Sequence[Any],
    batch_size: int,
    reference_model: Optional[nn.Module] = None,
    **options: Any,
) -> int:
    """Fill ``pair.ref`` for every pair of ``sets`` that has none; returns how many.

    From ``reference_model`` when given (its log-probs by the same ``options``),
    else from ``model`` with its adapters off.
    """
    todo = _by_length(sets)
    if not todo:
        return 0
    tic = time.perf_counter()
    if reference_model is not None:
        ref_logps = make_token_logps(reference_model, **options)
        fill_reference(reference_model, ref_logps, todo, batch_size)
        what = "the reference model"
    else:
        with adapters_off(model) as n_off:
            fill_reference(model, token_logps, todo, batch_size)
        what = f"{n_off} adapter layers off" if n_off else "the weights as training starts"
    took = time.perf_counter() - tic
    log.info(
        "flash-cce: reference log-probs of %d pairs (%s) in %.1f s (%.2f s per pair)",
        len(todo),
        what,
        took,
        took / len(todo),
    )
    return len(todo)


def reference_plan(
    model: nn.Module, token_logps: Callable, reference_model: Optional[nn.Module] = None
) -> Tuple[int, str]:
    """``(k, why)``: the reference log-probs in the step, over the top ``k``
    adapted layers, wherever that applies (kept per pair, it costs each pair
    about ``reference_share`` of a forward once, the pass a whole one);
    ``(0, why)``: precomputed once.
    """
    if reference_model is not None:
        return 0, "--reference-model: another checkpoint"
    if not token_logps.flash:
        return 0, "the head does not decompose"
    top, why = shared_prompt.adapted_top(model)
    if not top:
        return 0, why
    share = shared_prompt.reference_share(model, token_logps.vocab, top)
    ok, message = token_logps.probe_reference(model, top)
    if not ok:
        return 0, f"{why}, but the model does not split there ({message})"
    return top, f"{why}, about {share:.2f} of a forward per pair, once; {message}"


def _prepare_reference(model, token_logps, sets, batch_size, reference_model, precompute, options):
    """The reference's top layers for the step, or 0 once the pass has filled the pairs."""
    if precompute:
        top, why = 0, "asked for"
    else:
        top, why = reference_plan(model, token_logps, reference_model)
    if top:
        log.info(
            "flash-cce: reference log-probs in the step that first reads each pair, no pass "
            "before training (%s): the layers below run once, the top %d twice, with and "
            "without the adapters",
            why,
            top,
        )
        return top
    log.info("flash-cce: reference log-probs precomputed before training (%s)", why)
    # Forward only, nothing kept per layer but the prompt's keys: twice the
    # training batch holds less than one training step does, in fewer calls.
    reference(model, token_logps, sets, 2 * batch_size, reference_model, **options)
    return 0


def keep_reference(model: nn.Module, sets: Sequence[Any]) -> Callable[[], int]:
    """Number the pairs of ``sets`` (``Pair.index``) and return ``harvest()``:
    the reference log-probs that the steps since the last call computed
    (``model[REFS]``, rows of ``(index, chosen, rejected)``) into their
    pairs; how many. Logs once per split when all its pairs have them."""
    every = [(k, p) for k, s in enumerate(sets) for p in s.pairs]
    if len(every) >= 1 << 24:  # the index rides in float32
        return lambda: 0
    for i, (_, p) in enumerate(every):
        p.index = i
    model[REFS] = mx.zeros((0, 3))
    # pairs still without them, per split: counted down, not rescanned per step
    left = [sum(p.ref is None for p in s.pairs) for s in sets]

    def harvest():
        rows = model.get(REFS)
        if rows is None or not rows.shape[0]:
            return 0
        model[REFS] = mx.zeros((0, 3))
        for i, chosen, rejected in rows.tolist():
            if not 0 <= i < len(every):  # -1: a pair the loss was not made for
                continue
            k, pair = every[int(i)]
            if pair.ref is None:
                left[k] -= 1
                if not left[k]:
                    log.info(
                        "flash-cce: reference log-probs of all %d pairs of %s kept: their "
                        "steps from now on run the policy alone",
                        len(sets[k].pairs),
                        sets[k].name,
                    )
            pair.ref = (chosen, rejected)
        return len(rows)

    return harvest


def make_loss(
    model: nn.Module,
    name: str,
    *,
    beta: Optional[float] = None,
    gamma: float = objectives.DEFAULT_GAMMA,
    sets: Sequence[Any] = (),
    batch_size: int = 4,
    check: bool = True,
    share_prompt: bool = True,
    reference_model: Optional[nn.Module] = None,
    precompute: bool = False,
    **options: Any,
) -> Callable[..., Tuple[mx.array, mx.array, mx.array]]:
    """``loss(model, prompts, prompt_lens, responses, response_lens, refs)
    -> (loss, ntokens, metrics)`` for ``name`` in ``LOSSES``.

    ``beta`` defaults per objective (``objectives.DEFAULT_BETA``), ``gamma``
    is SimPO's target margin. ``ntokens`` counts each prompt once plus both
    responses in training and the pairs in evaluation. DPO, IPO and hinge
    compute their reference log-probs in the step that first reads a pair or
    first fill those of every pair in ``sets`` (``reference_plan``;
    ``precompute``: the pass in any case). ``share_prompt=False`` (mlx-lm's
    ``--grad-checkpoint``) runs each pair as two full sequences.
    ``loss.reference_layers`` is the ``k`` of the reference in the step (0:
    none or precomputed); ``loss.harvest()`` hands the pairs the reference
    log-probs that steps computed (``keep_reference``; the batches call it).
    """
    if name not in LOSSES:
        raise ValueError(f"unknown preference loss {name!r} (have: {', '.join(LOSSES)})")
    beta = objectives.DEFAULT_BETA[name] if beta is None else beta
    options = {k: v for k, v in options.items() if k != "verbose"}
    token_logps = make_token_logps(model, check=check, share_prompt=share_prompt, **options)
    top, harvest = 0, lambda: 0
    if name in objectives.REFERENCE:
        top = _prepare_reference(
            model, token_logps, sets, batch_size, reference_model, precompute, options
        )
        if top:
            harvest = keep_reference(model, sets)

    def loss(model, prompts, prompt_lens, responses, response_lens, refs):
        if top and refs.shape[1] == 3:  # not yet known (their indices ride along)
            tok, ref_tok = token_logps(model, prompts, prompt_lens, responses, top)
            ref = sequence_logps(ref_tok, response_lens)
            b, index = prompts.shape[0], refs[:, 2:]
            refs = mx.stack([ref[:b], ref[b:]], axis=1)
            # kept: the compiled step's state carries them out to the next
            # batch's harvest(); evaluation is not compiled, so at once
            model[REFS] = mx.concatenate([index, refs], axis=1)
            if not model.training:
                harvest()
        else:
            tok = token_logps(model, prompts, prompt_lens, responses)
            refs = refs[:, :2]
        seq = sequence_logps(tok, response_lens)
        value, cr, rr, chosen, rejected = objectives.objective(
            name, seq, response_lens, refs, beta, gamma
        )
        if model.training:
            ntoks = prompt_lens.sum() + response_lens.sum()
        else:  # evaluate weights batches by this: a mean over pairs
            ntoks = mx.array(prompts.shape[0], mx.int32)
        return value.astype(mx.float32), ntoks, metrics(cr, rr, chosen, rejected)

    loss.metrics, loss.shared, loss.flash = METRICS, token_logps.shared, token_logps.flash
    loss.reference_layers, loss.harvest = top, harvest
    return loss
