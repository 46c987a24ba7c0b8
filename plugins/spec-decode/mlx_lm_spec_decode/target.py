"""The target model split into backbone and lm-head, for drafters that read
its last hidden state (``Drafter.needs_hidden``)."""

import mlx.core as mx


def split(model):
    """``(backbone, head)`` with ``head(backbone(x, cache)) == model(x, cache)``.

    Covers mlx-lm's common layout (``model.model`` then ``lm_head`` or the
    tied embedding, optional final soft-cap) and checks it on a short input;
    returns ``None`` when the check fails.
    """
    inner = getattr(model, "model", None)
    if inner is None:
        return None
    if getattr(model, "lm_head", None) is not None and not getattr(model, "tie_word_embeddings", False):
        proj = model.lm_head
    elif hasattr(inner, "embed_tokens"):
        proj = inner.embed_tokens.as_linear
    else:
        return None
    cap = getattr(model, "final_logit_softcapping", None)

    def head(h):
        out = proj(h)
        return mx.tanh(out / cap) * cap if cap else out

    def backbone(x, cache):
        return inner(x, cache=cache)

    x = mx.array([[1, 2, 3]], mx.uint32)
    try:
        ok = mx.allclose(head(backbone(x, None)), model(x), atol=1e-4, rtol=1e-3).item()
    except Exception:
        return None
    return (backbone, head) if ok else None
