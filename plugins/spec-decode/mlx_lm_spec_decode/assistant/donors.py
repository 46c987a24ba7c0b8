"""What the assistant drafter reads of the target: introspection of its
layers and caches.

Each drafter layer borrows the K/V of one *donor* layer of the target, read
straight from the target's cache: the target's last sliding-window layer and
its last full-attention layer, or the last layer for models without sliding
layers. It also borrows the target's token embedding, lm-head and the donor
layers' RoPE (shared, never copied), and identifies the target by a
fingerprint so a drafter is never used with a model it was not trained for.
"""

import hashlib
import json
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from .. import target as target_mod
from .config import AssistantConfig, AssistantError, AssistantMismatch

# Token ids whose final hidden state fingerprints the target's weights.
PROBE_LEN = 12

NO_HIDDEN = (
    "the assistant drafter needs the target's hidden states, which this "
    "architecture does not expose in mlx-lm's usual layout"
)


def layer_attention(layer: nn.Module) -> Optional[nn.Module]:
    """The attention module of one of the target's layers, by mlx-lm's usual names."""
    for name in ("self_attn", "attn", "attention"):
        attn = getattr(layer, name, None)
        if attn is not None:
            return attn
    return None


def vocab_size(model: nn.Module) -> int:
    v = getattr(getattr(model, "args", None), "vocab_size", None)
    if v:
        return int(v)
    return int(model.model.embed_tokens.weight.shape[0])


def embedding(model: nn.Module) -> nn.Module:
    """The target's token embedding (shared with the drafter)."""
    inner = getattr(model, "model", None)
    emb = getattr(inner, "embed_tokens", None)
    if emb is None:
        raise AssistantError(
            "the assistant drafter needs the target's token embedding (model.model.embed_tokens)"
        )
    return emb


def output_scale(model: nn.Module) -> Optional[mx.array]:
    """The per-channel scale of the target's final norm (its output on a
    vector of ones), or None."""
    norm = getattr(getattr(model, "model", None), "norm", None)
    args = getattr(model, "args", None)
    D = getattr(args, "hidden_size", None)
    if norm is None or not D:
        return None
    try:
        w = norm(mx.ones((int(D),), mx.float32)).astype(mx.float32)
    except Exception:
        return None
    return w if w.shape == (int(D),) and mx.all(mx.isfinite(w)).item() else None


# ------------------------------------------------------------ fingerprint


def _args_dict(model):
    args = getattr(model, "args", None)
    if args is None:
        return {}
    out = {}
    for k, v in sorted(vars(args).items()):
        if isinstance(v, (int, float, str, bool)) or v is None:
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(
            isinstance(x, (int, float, str, bool)) for x in v
        ):
            out[k] = list(v)
    # Weight formats, not the model: a quantized and a float copy are one target.
    for k in ("quantization", "quantization_config"):
        out.pop(k, None)
    return out


def _probe_tokens(vocab):
    return [(1 + 7919 * i) % vocab for i in range(PROBE_LEN)]


def fingerprint(model: nn.Module, split: Optional[tuple] = None) -> dict[str, Any]:
    """What identifies the target: its architecture (exact) and the final
    hidden state of a fixed probe input (compared with a tolerance, so the
    same weights in float32, bfloat16 or their native 4-bit form match)."""
    split = split or target_mod.split(model)
    if split is None:
        raise AssistantError(NO_HIDDEN)
    args = _args_dict(model)
    vocab = vocab_size(model)
    h = split[0](mx.array([_probe_tokens(vocab)], mx.uint32), None)[0, -1].astype(mx.float32)
    config_sha = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()
    return {
        "model_type": args.get("model_type"),
        "config_sha256": config_sha,
        "config": args,
        "probe": [round(float(x), 6) for x in h.tolist()],
    }


def check_fingerprint(expected: dict, actual: dict, where: str = "the drafter") -> None:
    """Raise ``AssistantMismatch`` unless ``actual`` is the target ``expected`` describes."""
    if not expected:
        raise AssistantMismatch(
            f"{where} records no target fingerprint; retrain it with mlx-lm-ext train-drafter"
        )
    if expected.get("config_sha256") != actual.get("config_sha256"):
        ec, ac = expected.get("config", {}), actual.get("config", {})
        diff = sorted(k for k in set(ec) | set(ac) if ec.get(k) != ac.get(k))
        shown = ", ".join(f"{k}: {ec.get(k)!r} vs {ac.get(k)!r}" for k in diff[:4])
        raise AssistantMismatch(
            f"{where} was trained for a different model ({expected.get('model_type')}; differs in "
            f"{shown or 'configuration'}). Train one for this model: "
            "mlx-lm-ext train-drafter --model ..."
        )
    a = mx.array(expected.get("probe", []), mx.float32)
    b = mx.array(actual["probe"], mx.float32)
    if a.shape != b.shape:
        raise AssistantMismatch(f"{where} has a malformed fingerprint (probe of {a.size} values)")
    cos = (a * b).sum() / mx.maximum(mx.linalg.norm(a) * mx.linalg.norm(b), 1e-12)
    ratio = mx.linalg.norm(b) / mx.maximum(mx.linalg.norm(a), 1e-12)
    cos, ratio = cos.item(), ratio.item()
    if cos < 0.99 or not (0.95 < ratio < 1.05):
        raise AssistantMismatch(
            f"{where} was trained for a model with the same architecture but other weights "
            f"(probe similarity {cos:.3f}); train one for this model: "
            "mlx-lm-ext train-drafter --model ..."
        )


# ----------------------------------------------------------------- donors


def find_donors(model: nn.Module, num_layers: int) -> tuple[list[int], list[Optional[int]]]:
    """Donor cache index and sliding window for each of ``num_layers`` layers.

    With sliding-window layers: the last sliding layer and the last full one
    (one layer: the full one); otherwise the last layer, for every layer.
    """
    caches = make_prompt_cache(model)
    sliding = [i for i, c in enumerate(caches) if isinstance(c, RotatingKVCache)]
    full = [i for i, c in enumerate(caches) if type(c) in (KVCache, QuantizedKVCache)]
    if not sliding and not full:
        kinds = ", ".join(sorted({type(c).__name__ for c in caches}))
        raise AssistantError(f"the target has no attention KV cache to borrow ({kinds})")
    if sliding and full:
        order = [full[-1]] if num_layers == 1 else [sliding[-1]] + [full[-1]] * (num_layers - 1)
    else:
        order = [(full or sliding)[-1]] * num_layers
    windows = [
        caches[i].max_size if isinstance(caches[i], RotatingKVCache) else None for i in order
    ]
    return order, windows


def _given_donors(model, donors, num_layers):
    """``--donors``: checked, made non-negative, with their windows."""
    caches = make_prompt_cache(model)
    n = len(caches)
    bad = [d for d in donors if not (-n <= d < n)]
    if len(donors) != num_layers or bad:
        raise AssistantError(f"--donors needs {num_layers} cache indices in [0, {n}), got {donors}")
    donors = [d % n for d in donors]
    windows = [
        caches[d].max_size if isinstance(caches[d], RotatingKVCache) else None for d in donors
    ]
    return donors, windows


def donor_layout(model: nn.Module, donors: list[int]) -> tuple[int, int, int, mx.Dtype]:
    """``(n_kv_heads, head_dim, v_head_dim, dtype)`` of the donors' cached K/V, from a probe."""
    caches = make_prompt_cache(model)
    model(mx.array([[1, 2]], mx.uint32), cache=caches)
    shapes = set()
    for i in donors:
        k, v = caches[i].keys, caches[i].values
        if not isinstance(k, mx.array):
            raise AssistantError(
                f"target cache {i} ({type(caches[i]).__name__}) holds no K/V arrays"
            )
        shapes.add((k.shape[1], k.shape[3], v.shape[3], k.dtype))
    if len(shapes) != 1:
        raise AssistantError(
            f"donor layers {donors} differ in K/V layout: {sorted(map(str, shapes))}"
        )
    return shapes.pop()


def rope_of(model: nn.Module, index: int) -> Optional[nn.Module]:
    """The donor layer's RoPE module (shared, not copied), or None."""
    layers = getattr(model, "layers", None)
    if layers is None or len(layers) != len(make_prompt_cache(model)):
        raise AssistantError("the assistant drafter needs one cache per layer (model.layers)")
    attn = layer_attention(layers[index])
    return getattr(attn, "rope", None) if attn is not None else None


def donor_view(cache: Any) -> tuple[Any, Any, Optional[tuple[int, int]]]:
    """The donor cache's valid K/V as views of its own arrays.

    Returns ``(keys, values, quant)``; ``quant`` is ``(group_size, bits)``
    for a quantized cache (keys/values are then tuples). A rotating cache
    past its window holds the window out of temporal order; attention over
    a set of keys does not depend on their order.
    """
    if isinstance(cache, QuantizedKVCache):
        n = cache.offset

        def cut(t):
            return tuple(a[..., :n, :] for a in t)

        return cut(cache.keys), cut(cache.values), (cache.group_size, cache.bits)
    n = min(cache.offset, cache.keys.shape[2])
    return cache.keys[..., :n, :], cache.values[..., :n, :], None


# ----------------------------------------------------------------- sizing


def make_config(
    model: nn.Module,
    num_layers: int = 1,
    intermediate_size: Optional[int] = None,
    donors: Optional[list[int]] = None,
    split: Optional[tuple] = None,
) -> AssistantConfig:
    """A config for a new assistant drafter sized for ``model``."""
    if num_layers not in (1, 2, 3, 4):
        raise AssistantError(f"the assistant drafter has 1 to 4 layers, got {num_layers}")
    if donors is None:
        donors, windows = find_donors(model, num_layers)
    else:
        donors, windows = _given_donors(model, donors, num_layers)
    n_kv, hd, vhd, _ = donor_layout(model, donors)
    # As many query heads as the donor has (a multiple of its K/V heads).
    attn = layer_attention(model.layers[donors[-1]])
    heads = getattr(attn, "n_heads", None) or getattr(
        getattr(model, "args", None), "num_attention_heads", n_kv
    )
    heads = n_kv * max(1, int(heads) // n_kv)
    args = getattr(model, "args", None)
    D = int(
        embedding(model).weight.shape[1] if not hasattr(args, "hidden_size") else args.hidden_size
    )
    inter = intermediate_size or getattr(args, "intermediate_size", None) or 4 * D
    eps = float(getattr(args, "rms_norm_eps", 1e-5) or 1e-5)
    return AssistantConfig(
        hidden_size=D,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=n_kv,
        head_dim=hd,
        v_head_dim=vhd,
        intermediate_size=int(inter),
        donors=list(donors),
        windows=windows,
        rms_norm_eps=eps,
        target=fingerprint(model, split),
    )
