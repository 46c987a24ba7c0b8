"""A smaller mlx-lm model as the drafter (mlx-lm's own ``--draft-model``).

Drafting runs the draft model for ``n`` single-token steps and leaves the
tokens lazy, so the target's verify forward joins the same graph and one
``mx.eval`` runs both (as mlx-lm does). Tokens the draft model has not yet
consumed (the target's correction token, or the last accepted draft) wait in
``ctx.state["pending"]`` and go in front of the next draft step.
"""

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from .drafter import DraftContext, Drafter

PREFILL_STEP = 512


class VocabularyMismatch(ValueError):
    pass


def check_vocab(target_tokenizer: Any, draft_tokenizer: Any) -> None:
    """Raise ``VocabularyMismatch`` unless both tokenizers map tokens to the same ids."""
    t = dict(target_tokenizer.get_vocab())
    d = dict(draft_tokenizer.get_vocab())
    if t == d:
        return
    differ = sum(1 for k, v in t.items() if d.get(k) != v) + sum(1 for k in d if k not in t)
    raise VocabularyMismatch(
        f"the draft model's tokenizer does not match the target's "
        f"({len(t)} vs {len(d)} tokens, {differ} differ); speculative decoding "
        f"needs the same vocabulary"
    )


def _vocab_size(model):
    args = getattr(model, "args", None)
    return getattr(args, "vocab_size", None)


class DraftModelDrafter(Drafter):
    """Drafts with a smaller mlx-lm model that shares the target's tokenizer."""

    name = "draft-model"

    def __init__(
        self,
        model: nn.Module,
        *,
        tokenizer: Any = None,
        target_tokenizer: Any = None,
        target_vocab_size: Optional[int] = None,
        max_draft: int = 6,
        adaptive: bool = True,
        auto_off: bool = True,
    ):
        if tokenizer is not None and target_tokenizer is not None:
            check_vocab(target_tokenizer, tokenizer)
        if max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {max_draft}")
        caches = make_prompt_cache(model)
        if not can_trim_prompt_cache(caches):
            kinds = sorted({type(c).__name__ for c in caches if not c.is_trimmable()})
            raise ValueError(f"the draft model's caches cannot be rolled back ({', '.join(kinds)})")
        self.model = model
        self.max_draft = max_draft
        self.adaptive, self.auto_off = adaptive, auto_off
        # Draft tokens must be target tokens: drop any padded rows beyond.
        self.vocab = target_vocab_size

    def __repr__(self):
        return f"DraftModelDrafter({type(self.model).__module__}, max_draft={self.max_draft})"

    def make_cache(self) -> list[Any]:
        return make_prompt_cache(self.model)

    def cache_ok(self, caches: list[Any]) -> bool:
        fresh = self.make_cache()
        return len(caches) == len(fresh) and all(
            type(a) is type(b) for a, b in zip(caches, fresh, strict=True)
        )

    def _feed(self, ctx, tokens):
        for s in range(0, len(tokens), PREFILL_STEP):
            self.model(mx.array(tokens[s : s + PREFILL_STEP], mx.uint32)[None], cache=ctx.cache)
            mx.eval([c.state for c in ctx.cache])

    def prefill(self, ctx: DraftContext, tokens: list[int]) -> None:
        pending = ctx.state.setdefault("pending", []) + list(tokens)
        self._feed(ctx, pending[:-1])
        ctx.state["pending"] = pending[-1:]

    def draft(self, ctx: DraftContext, n: int) -> tuple[Any, Optional[mx.array]]:
        pending = ctx.state.get("pending", [])
        if n <= 0 or not pending:
            ctx.state["k"] = 0
            return [], None
        y = mx.array(pending, mx.uint32)
        tokens, probs = [], []
        for _ in range(n):
            logits = self.model(y[None], cache=ctx.cache)[0, -1:, :]
            if self.vocab is not None and logits.shape[-1] > self.vocab:
                logits = logits[:, : self.vocab]
            if ctx.temp == 0:
                y = mx.argmax(logits, axis=-1)
            else:
                logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                if ctx.filter is not None:
                    logprobs = ctx.filter(logprobs)
                logprobs = logprobs.astype(mx.float32) * (1.0 / ctx.temp)
                y = mx.random.categorical(logprobs)
                probs.append(mx.softmax(logprobs, axis=-1))
            tokens.append(y)
        ctx.state["pending"] = []
        ctx.state["k"] = n
        # The last draft is not fed: it is fed with the next pending tokens.
        return mx.concatenate(tokens), (mx.concatenate(probs) if probs else None)

    def accept(self, ctx: DraftContext, tokens: list[int], n_drafted: int) -> None:
        k = ctx.state.pop("k", 0)
        if k == 0:
            ctx.state.setdefault("pending", []).extend(tokens)
            return
        if n_drafted == k:
            # All accepted: the last draft was never fed; it goes first next time.
            ctx.state["pending"] = list(tokens[k - 1 :])
        else:
            # Drafts n_drafted+1 .. k-1 were fed but rejected.
            trim_prompt_cache(ctx.cache, k - 1 - n_drafted)
            ctx.state["pending"] = list(tokens[n_drafted:])

    def trim(self, ctx: DraftContext, n: int) -> None:
        pending = ctx.state.get("pending", [])
        drop = min(n, len(pending))
        ctx.state["pending"] = pending[: len(pending) - drop]
        if n > drop:
            trim_prompt_cache(ctx.cache, n - drop)

    def flush(self, ctx: DraftContext) -> None:
        pending = ctx.state.get("pending", [])
        if pending:
            self._feed(ctx, pending)
        ctx.state["pending"] = []
