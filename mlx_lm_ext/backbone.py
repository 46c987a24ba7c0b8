"""A language model as ``post(head(backbone(inputs)))``, checked against ``model(x)``.

Plugins that read the final hidden states (a drafter reading the target's
state, a loss that never builds the logits) need the same decomposition: the
backbone (everything up to the last norm), the head (``lm_head`` or the tied
input embedding) and the final logit transform (a scale, a soft cap). A
registry says how, per mlx-lm model module; other models get the common
rule (``model.model`` then ``lm_head`` or the tied embedding). ``split``
checks the decomposition on a short input, so a wrong guess is refused,
never used.
"""

from typing import Any, Callable, NamedTuple, Optional, Tuple

import mlx.core as mx


class Arch(NamedTuple):
    """How one architecture decomposes (each field takes the model)."""

    hidden: Callable  # (model, inputs [B, T], cache=None) -> hidden states [B, T, H]
    head: Callable  # model -> head (module, an ``as_linear`` method, or an array)
    softcap: Callable = lambda model: None
    logit_scale: Callable = lambda model: None


def _inner(model, inputs, cache=None):
    return model.model(inputs, cache=cache)


def _lm_head_or_embedding(model):
    # An untied model keeps `lm_head`; tied ones (llama/qwen default,
    # gemma3_text after sanitize) have none and reuse the input embedding.
    if "lm_head" in model and not getattr(model, "tie_word_embeddings", False):
        return model.lm_head
    return model.model.embed_tokens.as_linear


STANDARD = Arch(hidden=_inner, head=_lm_head_or_embedding)

ARCHS = {
    "llama": STANDARD,  # also mistral (mlx-lm remaps it to llama)
    "qwen2": STANDARD,
    "qwen3": STANDARD,
    "phi3": STANDARD,
    "gemma3_text": STANDARD,
    "gemma2": Arch(
        hidden=_inner,
        head=lambda m: m.model.embed_tokens.as_linear,
        softcap=lambda m: float(m.final_logit_softcapping),
    ),
    "gpt2": Arch(hidden=_inner, head=lambda m: m.model.wte.as_linear),
    "cohere": Arch(
        hidden=_inner,
        head=lambda m: m.model.embed_tokens.as_linear,
        logit_scale=lambda m: float(m.model.args.logit_scale),
    ),
    "granite": Arch(
        hidden=_inner,
        head=_lm_head_or_embedding,
        logit_scale=lambda m: 1.0 / float(m.logits_scaling),
    ),
}


def arch_name(model: Any) -> str:
    """The mlx-lm model module a model comes from (``mlx_lm.models.llama`` -> llama)."""
    return type(model).__module__.rsplit(".", 1)[-1]


def resolve(model: Any) -> Tuple[str, Arch]:
    """``(name, Arch)`` for ``model``: its registry entry or the common rule."""
    name = arch_name(model)
    if name in ARCHS:
        return name, ARCHS[name]
    return "generic", STANDARD


def post(logits: mx.array, softcap: Optional[float], scale: Optional[float]) -> mx.array:
    """The final logit transform: a scale, then a soft cap."""
    if scale is not None:
        logits = logits * scale
    if softcap:
        logits = mx.tanh(logits / softcap) * softcap
    return logits


def split(
    model: Any, atol: float = 1e-4, rtol: float = 1e-3
) -> Optional[Tuple[Callable, Callable]]:
    """``(backbone, head)`` with ``head(backbone(x, cache)) == model(x, cache)``.

    Checked on a short input; ``None`` when the model does not decompose so.
    """
    try:
        _, arch = resolve(model)
        proj = arch.head(model)
        softcap, scale = arch.softcap(model), arch.logit_scale(model)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None

    def backbone(x, cache=None):
        return arch.hidden(model, x, cache)

    def head(h):
        return post(proj(h), softcap, scale)

    x = mx.array([[1, 2, 3]], mx.uint32)
    try:
        ok = mx.allclose(head(backbone(x, None)), model(x), atol=atol, rtol=rtol).item()
    except Exception:
        return None
    return (backbone, head) if ok else None
