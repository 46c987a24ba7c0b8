"""The assistant drafter: a small transformer that borrows the target's KV cache.

A 1-2 layer transformer drafts with the target's own context instead of its
own copy of it. Each of its layers attends to

- the K/V of one *donor* layer of the target, read straight from the
  target's cache (slices of the cache's own arrays, never copied or stored):
  the target's last sliding-window layer and its last full-attention layer,
  or the last layer for models without sliding layers; and
- its own K/V for the positions it is drafting, which the target has not
  seen yet. These live only while a draft chain is being built: after the
  target verifies, every kept token is in the target's cache, so the
  drafter's own entries are rolled back to nothing, exactly where the
  target's cache ends.

Its input at the first drafted position is the target's final hidden state
``ctx.hidden`` (the state that produced the last emitted token) and the
embedding of that token (the target's embedding table); at later positions,
its own output state and the drafted token. It scores with the target's own
lm-head (shared, never copied) and drafts ``n`` tokens autoregressively, as
EAGLE-style heads do. Its own keys are rotated with the donor layer's RoPE
at their absolute positions, so they sit in the donor's key space.

A trained drafter is one folder: ``assistant.safetensors`` (weights) and
``assistant.json`` (shape, donor layers and the fingerprint of the target it
was trained for). ``load(path, model)`` refuses a folder made for another
model. ``mlx-lm-ext train-drafter`` (``assistant_train``) trains one.
"""

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from . import target as target_mod
from .drafter import Drafter

FORMAT = 1
CONFIG_FILE = "assistant.json"
WEIGHTS_FILE = "assistant.safetensors"
# Token ids whose final hidden state fingerprints the target's weights.
PROBE_LEN = 12


class AssistantError(ValueError):
    """The assistant drafter cannot be built, loaded or used with this model."""


class AssistantMismatch(AssistantError):
    """The drafter folder was made for a different target model."""


@dataclass
class AssistantConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    intermediate_size: int
    donors: list  # target cache index each layer reads, one per layer
    windows: list  # sliding window of each donor (None: full attention)
    rms_norm_eps: float = 1e-5
    target: dict = field(default_factory=dict)  # fingerprint(model)
    format: int = FORMAT

    @classmethod
    def from_dict(cls, d):
        names = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in d.items() if k in names})
        if cfg.format != FORMAT:
            raise AssistantError(f"assistant format {cfg.format} is not supported (this version reads {FORMAT})")
        if len(cfg.donors) != cfg.num_layers or len(cfg.windows) != cfg.num_layers:
            raise AssistantError(f"assistant config: {cfg.num_layers} layers but donors {cfg.donors}")
        return cfg


# ------------------------------------------------------------ the target


def _layer_attention(layer):
    for name in ("self_attn", "attn", "attention"):
        attn = getattr(layer, name, None)
        if attn is not None:
            return attn
    return None


def _args_dict(model):
    args = getattr(model, "args", None)
    if args is None:
        return {}
    out = {}
    for k, v in sorted(vars(args).items()):
        if isinstance(v, (int, float, str, bool)) or v is None:
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (int, float, str, bool)) for x in v):
            out[k] = list(v)
    # Weight formats, not the model: a quantized and a float copy are one target.
    for k in ("quantization", "quantization_config"):
        out.pop(k, None)
    return out


def _probe_tokens(vocab):
    return [(1 + 7919 * i) % vocab for i in range(PROBE_LEN)]


def fingerprint(model, split=None):
    """What identifies the target: its architecture (exact) and the final
    hidden state of a fixed probe input (compared with a tolerance, so the
    same weights in float32, bfloat16 or their native 4-bit form match)."""
    split = split or target_mod.split(model)
    if split is None:
        raise AssistantError("the assistant drafter needs the target's hidden states, which this "
                             "architecture does not expose in mlx-lm's usual layout")
    args = _args_dict(model)
    vocab = _vocab(model)
    h = split[0](mx.array([_probe_tokens(vocab)], mx.uint32), None)[0, -1].astype(mx.float32)
    config_sha = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()
    return {
        "model_type": args.get("model_type"),
        "config_sha256": config_sha,
        "config": args,
        "probe": [round(float(x), 6) for x in h.tolist()],
    }


def check_fingerprint(expected, actual, where="the drafter"):
    """Raise ``AssistantMismatch`` unless ``actual`` is the target ``expected`` describes."""
    if not expected:
        raise AssistantMismatch(f"{where} records no target fingerprint; retrain it with mlx-lm-ext train-drafter")
    if expected.get("config_sha256") != actual.get("config_sha256"):
        ec, ac = expected.get("config", {}), actual.get("config", {})
        diff = sorted(k for k in set(ec) | set(ac) if ec.get(k) != ac.get(k))
        shown = ", ".join(f"{k}: {ec.get(k)!r} vs {ac.get(k)!r}" for k in diff[:4])
        raise AssistantMismatch(
            f"{where} was trained for a different model ({expected.get('model_type')}; differs in "
            f"{shown or 'configuration'}). Train one for this model: mlx-lm-ext train-drafter --model ..."
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
            f"(probe similarity {cos:.3f}); train one for this model: mlx-lm-ext train-drafter --model ..."
        )


def _vocab(model):
    v = getattr(getattr(model, "args", None), "vocab_size", None)
    if v:
        return int(v)
    return int(model.model.embed_tokens.weight.shape[0])


def _embedding(model):
    inner = getattr(model, "model", None)
    emb = getattr(inner, "embed_tokens", None)
    if emb is None:
        raise AssistantError("the assistant drafter needs the target's token embedding (model.model.embed_tokens)")
    return emb


def output_scale(model):
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


def init_from_target(net, model):
    """Start training from "draft what the target just predicted": the
    input projection passes the target's (normalized) hidden state through,
    the attention and MLP branches start at zero, and the final norm restores
    the hidden state's scale. The first predictions are then the target's
    own (calibrated) distribution one position back, not random and
    saturated ones; measured on SmolLM2, better top-1 agreement after the
    same steps than a random start."""
    D = net.fc.weight.shape[0]
    net.fc.weight = mx.concatenate([mx.eye(D), mx.zeros((D, D))], axis=1).astype(net.fc.weight.dtype)
    for layer in net.layers:
        layer.o_proj.weight = mx.zeros_like(layer.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    s = output_scale(model)
    if s is not None:
        net.norm.weight = mx.full((D,), mx.sqrt((s * s).mean()).item(), net.norm.weight.dtype)


def find_donors(model, num_layers):
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
    windows = [caches[i].max_size if isinstance(caches[i], RotatingKVCache) else None for i in order]
    return order, windows


def donor_layout(model, donors):
    """``(n_kv_heads, head_dim, v_head_dim, dtype)`` of the donors' cached K/V, from a probe."""
    caches = make_prompt_cache(model)
    model(mx.array([[1, 2]], mx.uint32), cache=caches)
    shapes = set()
    for i in donors:
        k, v = caches[i].keys, caches[i].values
        if not isinstance(k, mx.array):
            raise AssistantError(f"target cache {i} ({type(caches[i]).__name__}) holds no K/V arrays")
        shapes.add((k.shape[1], k.shape[3], v.shape[3], k.dtype))
    if len(shapes) != 1:
        raise AssistantError(f"donor layers {donors} differ in K/V layout: {sorted(map(str, shapes))}")
    return shapes.pop()


def rope_of(model, index):
    """The donor layer's RoPE module (shared, not copied), or None."""
    layers = getattr(model, "layers", None)
    if layers is None or len(layers) != len(make_prompt_cache(model)):
        raise AssistantError("the assistant drafter needs one cache per layer (model.layers)")
    attn = _layer_attention(layers[index])
    return getattr(attn, "rope", None) if attn is not None else None


def donor_view(cache):
    """The donor cache's valid K/V as views of its own arrays.

    Returns ``(keys, values, quant)``; ``quant`` is ``(group_size, bits)``
    for a quantized cache (keys/values are then tuples). A rotating cache
    past its window holds the window out of temporal order; attention over
    a set of keys does not depend on their order.
    """
    if isinstance(cache, QuantizedKVCache):
        n = cache.offset
        cut = lambda t: tuple(a[..., :n, :] for a in t)
        return cut(cache.keys), cut(cache.values), (cache.group_size, cache.bits)
    n = min(cache.offset, cache.keys.shape[2])
    return cache.keys[..., :n, :], cache.values[..., :n, :], None


# -------------------------------------------------------------- the net


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: AssistantConfig):
        super().__init__()
        D, H, K = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads
        self.n_heads, self.n_kv = H, K
        self.head_dim, self.v_head_dim = cfg.head_dim, cfg.v_head_dim
        self.scale = cfg.head_dim**-0.5
        self.input_layernorm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.q_proj = nn.Linear(D, H * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(D, K * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(D, K * cfg.v_head_dim, bias=False)
        self.o_proj = nn.Linear(H * cfg.v_head_dim, D, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.mlp = MLP(D, cfg.intermediate_size)

    def qkv(self, x, rope, offset):
        B, L, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(h).reshape(B, L, self.n_kv, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(h).reshape(B, L, self.n_kv, -1).transpose(0, 2, 1, 3)
        if rope is not None:
            q, k = rope(q, offset=offset), rope(k, offset=offset)
        return q, k, v

    def finish(self, x, attn):
        B, H, L, _ = attn.shape
        x = x + self.o_proj(attn.transpose(0, 2, 1, 3).reshape(B, L, -1))
        return x + self.mlp(self.post_attention_layernorm(x))


def attend(q, donor, own_k, own_v, scale, donor_mask=None):
    """Attention of ``q`` over a donor's K/V and the drafter's own entries.

    ``q``: ``[B, H, L, d]``. ``donor``: ``(keys, values, quant)`` from
    ``donor_view`` (``[B, Hkv, T, d]``, read in place by the matmuls).
    ``own_k``/``own_v``: lists of ``[B, Hkv, L, d]``, row ``i`` of each
    being one more key for query row ``i`` (the drafter's own positions).
    ``donor_mask``: ``[L, T]`` booleans (training), or None (all visible).
    One softmax over the union, in float32.
    """
    B, H, L, d = q.shape
    keys, values, quant = donor
    n_kv = (keys[0] if quant else keys).shape[1]
    rep = H // n_kv
    # A quantized cache is (packed uint32, scales, biases): compute in the scales' dtype.
    q = (q * scale).astype(keys[1].dtype if quant else keys.dtype)
    q2 = q.reshape(B, n_kv, rep * L, d)
    if quant:
        gs, bits = quant
        s_d = mx.quantized_matmul(q2, *keys, transpose=True, group_size=gs, bits=bits)
    else:
        s_d = q2 @ keys.swapaxes(-1, -2)
    T = s_d.shape[-1]
    s_d = s_d.reshape(B, n_kv, rep, L, T).astype(mx.float32)
    if donor_mask is not None:
        s_d = mx.where(donor_mask, s_d, -mx.inf)
    if L == 1:
        # Drafting: the chain's own entries are a few more keys of the one
        # query row (concatenated: they are the chain's, not the cache's).
        k_o, v_o = mx.concatenate(own_k, axis=2), mx.concatenate(own_v, axis=2)
        s_o = (q2.astype(k_o.dtype) @ k_o.swapaxes(-1, -2)).reshape(B, n_kv, rep, 1, -1).astype(mx.float32)
    else:
        # Training: row i's own keys are row i of each array.
        q5 = q.reshape(B, n_kv, rep, L, d).astype(mx.float32)
        s_o = mx.stack([(q5 * k[:, :, None].astype(mx.float32)).sum(-1) for k in own_k], axis=-1)
    scores = mx.concatenate([s_d, s_o], axis=-1)
    p = mx.softmax(scores, axis=-1, precise=True)
    p_d = p[..., :T].reshape(B, n_kv, rep * L, T)
    vdt = values[1].dtype if quant else values.dtype
    if quant:
        o_d = mx.quantized_matmul(p_d.astype(vdt), *values, transpose=False, group_size=gs, bits=bits)
    else:
        o_d = p_d.astype(vdt) @ values
    out = o_d.reshape(B, n_kv, rep, L, -1).astype(mx.float32)
    if L == 1:
        p_o = p[..., T:].reshape(B, n_kv, rep, -1)
        out = out + (p_o.astype(v_o.dtype) @ v_o).reshape(B, n_kv, rep, 1, -1).astype(mx.float32)
    else:
        for j, v in enumerate(own_v):
            out = out + p[..., T + j, None] * v[:, :, None].astype(mx.float32)
    return out.reshape(B, H, L, -1).astype(q.dtype)


class Assistant(nn.Module):
    """The drafter's own weights. Target modules (embedding, lm-head, RoPE)
    are passed in at call time and never become part of this module."""

    def __init__(self, cfg: AssistantConfig):
        super().__init__()
        D = cfg.hidden_size
        self.hidden_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.embed_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * D, D, bias=False)
        self.layers = [Layer(cfg) for _ in range(cfg.num_layers)]
        self.norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)

    def inputs(self, hidden, emb):
        dt = self.fc.weight.dtype
        x = mx.concatenate([self.hidden_norm(hidden.astype(dt)), self.embed_norm(emb.astype(dt))], axis=-1)
        return self.fc(x)

    def step(self, hidden, emb, donors, ropes, own, pos):
        """One drafted position (``L == 1``) at absolute position ``pos``.

        ``own[i]`` is layer ``i``'s list of ``(k, v)`` from earlier steps of
        this chain; this step's entries are appended to it."""
        x = self.inputs(hidden, emb)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(x, ropes[i], pos)
            own[i].append((k, v))
            a = attend(q, donors[i], [e[0] for e in own[i]], [e[1] for e in own[i]], layer.scale)
            x = layer.finish(x, a)
        return self.norm(x)

    def unrolled(self, hidden, emb, donors, ropes, windows, steps):
        """Training: ``steps`` chained draft steps from every position at once.

        ``hidden``: the target's final states ``[B, T, D]``; ``emb``: the
        embeddings of the tokens ``[B, T, D]``; ``donors``: per layer the
        donor's K/V over the same ``T`` tokens. Step ``s`` at row ``p``
        drafts from a target cache holding tokens ``0..p-1-s``: it sees the
        donor keys up to ``p-1-s``, its own keys of the chain's earlier
        steps (rows ``p-s..p-1``) and its own; its input state is the
        target's ``hidden[p-1]`` at step 0 and its own output of row
        ``p-1`` after. Returns the output states of each step (row ``p``
        predicts token ``p+1``; rows ``p < s+1`` have no valid chain).
        """
        B, T, _ = hidden.shape
        rows = mx.arange(T)[:, None]
        cols = mx.arange(T)[None]
        shift = _shift
        feat = shift(hidden.astype(self.fc.weight.dtype), 1)
        own = [[] for _ in self.layers]
        outs = []
        for s in range(steps):
            x = self.inputs(feat, emb)
            for i, layer in enumerate(self.layers):
                q, k, v = layer.qkv(x, ropes[i], 0)
                own[i].append((k, v))
                last = rows - 1 - s
                mask = cols <= last
                if windows[i]:
                    mask = mask & (cols > last - windows[i])
                ks = [shift(kk, s - j) for j, (kk, _) in enumerate(own[i])]
                vs = [shift(vv, s - j) for j, (_, vv) in enumerate(own[i])]
                a = attend(q, donors[i], ks, vs, layer.scale, donor_mask=mask)
                x = layer.finish(x, a)
            out = self.norm(x)
            outs.append(out)
            feat = shift(out, 1)
        return outs


def _shift(a, n):
    """Rows moved ``n`` down along axis -2, zeros in front."""
    if n == 0:
        return a
    pad = mx.zeros(a.shape[:-2] + (n, a.shape[-1]), a.dtype)
    return mx.concatenate([pad, a[..., : a.shape[-2] - n, :]], axis=-2)


# ------------------------------------------------------------- building


def make_config(model, num_layers=1, intermediate_size=None, donors=None, split=None):
    """A config for a new assistant drafter sized for ``model``."""
    if num_layers not in (1, 2, 3, 4):
        raise AssistantError(f"the assistant drafter has 1 to 4 layers, got {num_layers}")
    if donors is None:
        donors, windows = find_donors(model, num_layers)
    else:
        n = len(make_prompt_cache(model))
        bad = [d for d in donors if not (-n <= d < n)]
        if len(donors) != num_layers or bad:
            raise AssistantError(f"--donors needs {num_layers} cache indices in [0, {n}), got {donors}")
        caches = make_prompt_cache(model)
        donors = [d % n for d in donors]
        windows = [caches[d].max_size if isinstance(caches[d], RotatingKVCache) else None for d in donors]
    n_kv, hd, vhd, _ = donor_layout(model, donors)
    attn = _layer_attention(model.layers[donors[-1]])
    heads = getattr(attn, "n_heads", None) or getattr(getattr(model, "args", None), "num_attention_heads", n_kv)
    heads = n_kv * max(1, int(heads) // n_kv)
    args = getattr(model, "args", None)
    D = int(_embedding(model).weight.shape[1] if not hasattr(args, "hidden_size") else args.hidden_size)
    inter = intermediate_size or getattr(args, "intermediate_size", None) or 4 * D
    eps = float(getattr(args, "rms_norm_eps", 1e-5) or 1e-5)
    return AssistantConfig(
        hidden_size=D, num_layers=num_layers, num_heads=heads, num_kv_heads=n_kv, head_dim=hd,
        v_head_dim=vhd, intermediate_size=int(inter), donors=list(donors), windows=windows,
        rms_norm_eps=eps, target=fingerprint(model, split),
    )


def save(path, net, cfg, dtype=mx.float16):
    """Write ``assistant.safetensors`` and ``assistant.json`` into ``path``
    (each through a temporary file, so a reader never sees half a folder)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(dtype) if dtype is not None else v for k, v in tree_flatten(net.parameters())}
    tmp = path / ("." + WEIGHTS_FILE + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx"})
    tmp.replace(path / WEIGHTS_FILE)
    tmp = path / ("." + CONFIG_FILE + ".tmp")
    tmp.write_text(json.dumps(asdict(cfg), indent=1) + "\n")
    tmp.replace(path / CONFIG_FILE)


def read_config(path):
    path = Path(path)
    f = path / CONFIG_FILE
    if not path.is_dir():
        raise AssistantError(f"assistant drafter folder {path} does not exist")
    if not f.is_file() or not (path / WEIGHTS_FILE).is_file():
        raise AssistantError(f"{path} is not an assistant drafter folder (needs {CONFIG_FILE} and {WEIGHTS_FILE}); "
                             f"make one with mlx-lm-ext train-drafter")
    try:
        return AssistantConfig.from_dict(json.loads(f.read_text()))
    except AssistantError:
        raise
    except (ValueError, TypeError, KeyError) as e:
        raise AssistantError(f"{f} is not a valid assistant config: {e}") from e


def load_net(path, cfg=None):
    path = Path(path)
    cfg = cfg or read_config(path)
    net = Assistant(cfg)
    try:
        weights = mx.load(str(path / WEIGHTS_FILE))
        net.load_weights(list(weights.items()), strict=True)
    except Exception as e:
        raise AssistantError(f"{path / WEIGHTS_FILE} cannot be loaded into a {cfg.num_layers}-layer assistant: {e}") from e
    return net


def load(path, model, **options):
    """An ``AssistantDrafter`` for ``model`` from a trained folder; raises
    ``AssistantMismatch`` if it was made for another model."""
    cfg = read_config(path)
    split = target_mod.split(model)
    check_fingerprint(cfg.target, fingerprint(model, split), where=f"the drafter in {path}")
    net = load_net(path, cfg)
    return AssistantDrafter(model, net, cfg, split=split, **options)


# -------------------------------------------------------------- drafting


class AssistantDrafter(Drafter):
    """Drafts with an ``Assistant`` that reads the target's cache and hidden state."""

    name = "assistant"
    needs_hidden = True

    def __init__(self, model, net, cfg, *, split=None, max_draft=6, adaptive=True, auto_off=True):
        if max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {max_draft}")
        split = split or target_mod.split(model)
        if split is None:
            raise AssistantError("the assistant drafter needs the target's hidden states, which this "
                                 "architecture does not expose in mlx-lm's usual layout")
        n = len(make_prompt_cache(model))
        if any(not (0 <= d < n) for d in cfg.donors):
            raise AssistantError(f"donor layers {cfg.donors} do not exist in a target with {n} caches")
        self.model = model
        self.cfg = cfg
        self.head = split[1]
        self.embed = _embedding(model)
        self.ropes = [rope_of(model, d) for d in cfg.donors]
        dtype = donor_layout(model, cfg.donors)[3]
        net.set_dtype(dtype)
        net.freeze()
        self.net = net
        self.max_draft = max_draft
        self.adaptive, self.auto_off = adaptive, auto_off
        self.vocab = _vocab(model)

    def __repr__(self):
        return f"AssistantDrafter({self.cfg.num_layers} layers, donors={self.cfg.donors}, max_draft={self.max_draft})"

    # The drafter keeps nothing between rounds: all its context is the
    # target's cache and hidden state, so its caches are an empty list.
    def make_cache(self):
        return []

    def cache_ok(self, caches):
        return len(caches) == 0

    def donors(self, ctx):
        """The donor caches (the target's own objects) each layer reads."""
        return [ctx.target_cache[d] for d in self.cfg.donors]

    def prefill(self, ctx, tokens):
        ctx.state["last"] = list(tokens[-1:])
        ctx.state["own"] = 0

    def draft(self, ctx, n):
        last = ctx.state.get("last")
        if n <= 0 or not last or ctx.hidden is None:
            return [], None
        caches = self.donors(ctx)
        views = [donor_view(c) for c in caches]
        pos = caches[-1].offset
        own = [[] for _ in self.net.layers]
        hidden = ctx.hidden.reshape(1, 1, -1)
        tok = mx.array(last, mx.uint32)
        tokens, probs = [], []
        for s in range(n):
            hidden = self.net.step(hidden, self.embed(tok)[None], views, self.ropes, own, pos + s)
            logits = self.head(hidden)[0, -1:, : self.vocab]
            if ctx.temp == 0:
                tok = mx.argmax(logits, axis=-1).astype(mx.uint32)
            else:
                lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                if ctx.filter is not None:
                    lp = ctx.filter(lp)
                lp = lp.astype(mx.float32) * (1.0 / ctx.temp)
                tok = mx.random.categorical(lp).astype(mx.uint32)
                probs.append(mx.softmax(lp, axis=-1))
            tokens.append(tok)
        # The chain's own K/V entries (``own``) die here: every token the
        # target keeps will be in its own cache after the verify.
        ctx.state["own"] = n
        return mx.concatenate(tokens), (mx.concatenate(probs) if probs else None)

    def accept(self, ctx, tokens, n_drafted):
        ctx.state["own"] = 0
        if tokens:
            ctx.state["last"] = list(tokens[-1:])

    def trim(self, ctx, n):
        # The history shrank behind the loop's back: the last token and the
        # hidden state no longer match, so draft nothing until told again.
        if n > 0:
            ctx.state["last"] = []

    def flush(self, ctx):
        ctx.state["own"] = 0


class _StepRecorder:
    """Stands in for the drafter's net: the same ``step``, its outputs kept."""

    def __init__(self, net):
        self.net, self.layers, self.outs = net, net.layers, []

    def step(self, *args):
        out = self.net.step(*args)
        self.outs.append(out)
        return out


class RecordingDrafter(AssistantDrafter):
    """``base`` as the loop runs it, recording each round as ``(base position,
    pending token, per-step output states, drafts)``, left lazy as the loop
    leaves them: what ``bench_assistant.py --check`` and the tests compare
    with the training graph. ``options``: ``max_draft``, ``adaptive``,
    ``auto_off`` (default: ``base``'s)."""

    def __init__(self, base, **options):
        unknown = set(options) - {"max_draft", "adaptive", "auto_off"}
        if unknown:
            raise TypeError(f"unknown options {sorted(unknown)}")
        self.__dict__.update(base.__dict__)
        self.__dict__.update(options)
        self.net = _StepRecorder(base.net)
        self.rounds = []

    def draft(self, ctx, n):
        base = ctx.target_cache[self.cfg.donors[-1]].offset
        last = list(ctx.state.get("last") or [None])
        self.net.outs = []
        toks, q = super().draft(ctx, n)
        if self.net.outs:
            self.rounds.append((base, last[0], list(self.net.outs), toks))
        return toks, q
