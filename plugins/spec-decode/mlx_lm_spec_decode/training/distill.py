"""Self-distillation: the frozen target, the loss against it, and the
training step.

The target runs once per batch with plain KV caches, giving what the drafter
sees at inference time (``Target.run``). The drafter then drafts
``steps`` chained tokens from every position at once
(``Assistant.unrolled``) and learns the target's next-token distribution
(soft cross-entropy, i.e. KL up to a constant) and its final hidden state
(smooth L1), which later steps take as their input.
"""

import logging
from argparse import Namespace
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx_lm.models.cache import KVCache, make_prompt_cache

from .. import target as target_mod
from ..assistant import (
    Assistant,
    AssistantConfig,
    donor_layout,
    embedding,
    init_from_target,
    rope_of,
)
from . import TrainError
from .checkpoint import load_checkpoint

log = logging.getLogger("mlx_lm_spec_decode")

# One step: (hidden, embeddings, donor K/V, target probs, target argmax, row weights)
# -> (loss, per-step cross-entropies, per-step top-1 agreements).
StepFn = Callable[..., tuple[mx.array, mx.array, mx.array]]


class Target:
    """The frozen target and the pieces of it the drafter borrows."""

    def __init__(self, model: nn.Module, cfg: AssistantConfig, split: Optional[tuple] = None):
        self.model = model
        split = split or target_mod.split(model)
        if split is None:
            raise TrainError(
                "this architecture does not expose its hidden states in mlx-lm's usual layout"
            )
        self.backbone, self.head = split
        self.embed = embedding(model)
        self.ropes = [rope_of(model, d) for d in cfg.donors]
        self.cfg = cfg
        self.dtype = donor_layout(model, cfg.donors)[3]
        model.freeze()

    def run(self, x: mx.array) -> tuple:
        """Hidden states, token embeddings, donor K/V, the target's next-token
        probabilities and its argmax, for tokens ``x [B, T]``."""
        caches = [KVCache() for _ in make_prompt_cache(self.model)]
        h = self.backbone(x, caches)
        logits = self.head(h).astype(mx.float32)
        T = x.shape[1]
        kv = [(caches[d].keys[..., :T, :], caches[d].values[..., :T, :]) for d in self.cfg.donors]
        return (
            h,
            self.embed(x),
            kv,
            mx.softmax(logits, axis=-1, precise=True),
            mx.argmax(logits, axis=-1),
        )


def loss_fn(
    net: Assistant,
    target: Target,
    h: mx.array,
    emb: mx.array,
    kv: list,
    p_t: mx.array,
    top_t: mx.array,
    steps: int,
    feature_weight: float,
    step_decay: float = 0.8,
    weights: Optional[mx.array] = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """Distillation loss over ``steps`` chained draft steps, step ``s``
    weighted ``step_decay**s``; also each step's cross-entropy and top-1
    agreement with the target (rows with a full chain only, and, with
    ``weights [B, T]``, only rows whose weight is 1: rows predicting an
    answer token of a chat, the only tokens a drafter drafts)."""
    donors = [(k, v, None) for k, v in kv]
    outs = net.unrolled(h, emb, donors, target.ropes, target.cfg.windows, steps)
    T = h.shape[1]
    hf = h.astype(mx.float32)
    total, norm = 0.0, 0.0
    ces, accs = [], []
    for s, out in enumerate(outs):
        valid = (mx.arange(T) >= s + 1)[None].astype(mx.float32)
        valid = valid * weights if weights is not None else mx.broadcast_to(valid, h.shape[:2])
        count = mx.maximum(valid.sum(), 1.0)
        logits = target.head(out.astype(target.dtype)).astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        ce = (-(p_t * lp).sum(-1) * valid).sum() / count
        diff = mx.abs(out.astype(mx.float32) - hf)
        feat = (mx.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5).mean(-1) * valid).sum() / count
        acc = ((mx.argmax(lp, axis=-1) == top_t).astype(mx.float32) * valid).sum() / count
        w = step_decay**s
        total = total + w * (ce + feature_weight * feat)
        norm += w
        ces.append(ce)
        accs.append(acc)
    return total / norm, mx.stack(ces), mx.stack(accs)


def evaluate(
    net: Assistant, target: Target, evals: dict, steps: int, feature_weight: float, rows: int = 4
) -> dict:
    """Top-1 agreement and cross-entropy per draft step on the held-out rows
    (chats: on the rows predicting answer tokens)."""
    out = {}
    for name, (x, w) in evals.items():
        accs, ces, n = 0.0, 0.0, 0.0
        for s in range(0, x.shape[0], rows):
            ws = w[s : s + rows]
            _, ce, acc = loss_fn(
                net, target, *target.run(x[s : s + rows]), steps, feature_weight, weights=ws
            )
            k = ws.sum()
            mx.eval(ce, acc, k)
            accs, ces, n = accs + acc * k, ces + ce * k, n + k.item()
        n = max(n, 1.0)
        out[name] = {"top1": (accs / n).tolist(), "ce": (ces / n).tolist(), "rows": int(x.shape[0])}
    return out


def schedule(lr: float, steps: int, warmup: int) -> Callable:
    """Linear warm-up (at most a tenth of the steps), then cosine decay to a tenth."""
    warmup = max(1, min(warmup, steps // 10 or 1))
    return optim.join_schedules(
        [
            optim.linear_schedule(lr * 0.01, lr, warmup),
            optim.cosine_decay(lr, max(1, steps - warmup), lr * 0.1),
        ],
        [warmup],
    )


class _FallbackStep:
    """The compiled step, replaced by the uncompiled one the first time it
    fails (a backend that cannot compile it trains uncompiled)."""

    def __init__(self, compiled: StepFn, plain: StepFn):
        self.fn, self.plain = compiled, plain

    def __call__(self, *inputs):
        try:
            return self.fn(*inputs)
        except Exception as e:
            if self.fn is self.plain:
                raise
            log.warning(f"train-drafter: mx.compile failed ({e}); training uncompiled")
            self.fn = self.plain
            return self.plain(*inputs)


def make_trainer(
    args: Namespace, cfg: AssistantConfig, target: Target, ckpt: Optional[Path] = None
) -> tuple[Assistant, optim.Optimizer, list, StepFn]:
    """The drafter (fresh, or from checkpoint folder ``ckpt``), its
    optimizer, the state to evaluate and the (compiled) training step."""
    mx.random.seed(args.seed)
    net = Assistant(cfg)
    init_from_target(net, target.model)
    opt = optim.AdamW(learning_rate=schedule(args.lr, args.steps, args.warmup), weight_decay=0.0)
    opt.init(net.trainable_parameters())
    if ckpt is not None:  # before compiling: the compiled step captures these state trees
        load_checkpoint(ckpt, net, opt)

    def distill_loss(n, h, emb, kv, p, top, w):
        return loss_fn(
            n, target, h, emb, kv, p, top, args.draft_steps, args.feature_weight, weights=w
        )

    value_grad = nn.value_and_grad(net, distill_loss)

    def update(h, emb, kv, p, top, w):
        (loss, ces, accs), grads = value_grad(net, h, emb, kv, p, top, w)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(net, grads)
        return loss, ces, accs

    state = [net.state, opt.state]
    # On the CPU compiling takes long and runs no faster: compile on a GPU only, unless told.
    compile_ = (
        args.compile if args.compile is not None else mx.default_device().type == mx.DeviceType.gpu
    )
    if not compile_:
        return net, opt, state, update
    return net, opt, state, _FallbackStep(mx.compile(update, inputs=state, outputs=state), update)
