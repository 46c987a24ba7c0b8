"""Does a stored entry fit the running model? Checked from the header, before any load.

An entry's header can be consistent (its hash matches) and still describe
caches the model never makes: wrong layer classes, head counts or head sizes,
dtypes, offsets that disagree with the buffers, or tensors far larger than
its tokens need. Given to mlx-lm, such a cache ends the server's generation
thread or changes answers. So every entry is compared with a *reference*: the
caches the model itself makes for one token, built lazily (shapes and dtypes
of an unevaluated forward pass: no compute, no memory), and with its own
token count. Only an entry that matches is loaded.
"""

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from .fileformat import DTYPES, Corrupt, Header

log = logging.getLogger("mlx_lm_ssd_cache")

# Caches whose arrays grow along the token axis (-2); the rest are fixed size.
KV_CLASSES = (
    "KVCache",
    "QuantizedKVCache",
    "RotatingKVCache",
    "ChunkedKVCache",
    "ConcatenateKVCache",
)
FLOATS = ("F16", "BF16", "F32")


@dataclass
class Reference:
    """The caches a model makes, described as spec trees of ``(shape, dtype)``."""

    layers: list  # [{"class": name, "state": tree}] with {"a": [shape, dtype]} leaves
    quantized: Optional[list]  # the same with KVCache layers as QuantizedKVCache
    exact_dtype: bool  # dtypes come from the loaded model (not a random-weight copy)

    def __len__(self):
        return len(self.layers)


def reference(
    models: Iterable[Any], settings: Optional[dict] = None, exact_dtype: bool = True
) -> Reference:
    """The reference of ``models`` (the target, then mlx-lm's draft model if any).

    ``settings`` are the server's ``kv_bits`` / ``kv_group_size``: with
    ``kv_bits`` a stored KV layer may also be quantized.
    """
    caches = []
    for model in models:
        made = make_prompt_cache(model)
        model(mx.array([[1]], dtype=mx.uint32), cache=made)  # shapes only, never evaluated
        caches += made
    layers = [_describe(c) for c in caches]
    settings = settings or {}
    quantized = None
    if settings.get("kv_bits"):
        group, bits = settings.get("kv_group_size") or 64, settings["kv_bits"]
        quantized = [
            _describe(c.to_quantized(group_size=group, bits=bits)) if type(c) is KVCache else d
            for c, d in zip(caches, layers, strict=True)
        ]
    return Reference(layers, quantized, exact_dtype)


def _describe(cache):
    name = type(cache).__name__
    if name == "CacheList":
        state = [(_describe(c)["state"], type(c).__name__) for c in cache.caches]
    else:
        state = cache.state
    return {"class": name, "state": _tree(state)}


def _tree(x):
    if isinstance(x, mx.array):
        return {"a": [list(x.shape), DTYPES[str(x.dtype).rsplit(".", 1)[-1]][0]]}
    if isinstance(x, (list, tuple)):
        return {"tuple" if isinstance(x, tuple) else "list": [_tree(y) for y in x]}
    return x


# -------------------------------------------------------------------- check


def validate(header: Header, ref: Reference) -> None:
    """Raise ``Corrupt`` unless ``header`` describes caches ``ref``'s model makes."""
    if len(header.spec) != len(ref.layers):
        raise Corrupt(f"{len(header.spec)} caches, the model makes {len(ref.layers)}")
    floats = set()
    for i, layer in enumerate(header.spec):
        want = ref.layers[i]
        if ref.quantized and layer["class"] != want["class"]:
            want = ref.quantized[i]  # a KV layer quantized past --quantized-kv-start
        try:
            _layer(layer["class"], layer["state"], want, header, ref.exact_dtype, floats)
        except Corrupt as e:
            raise Corrupt(f"cache {i} ({layer['class']}): {e}") from None
    # Without the loaded model the float dtype is unknown, but it is one dtype.
    if len(floats) > 1:
        raise Corrupt(f"mixed dtypes {sorted(floats)}")


def _layer(name, state, want, header, exact, floats):
    if name != want["class"]:
        raise Corrupt(f"class {name}, the model makes {want['class']}")
    if name == "CacheList":
        got, ref = _items(state, "list"), _items(want["state"], "list")
        if len(got) != len(ref):
            raise Corrupt("sub-cache count differs")
        for g, r in zip(got, ref, strict=True):
            (gs, gname), (rs, rname) = _items(g, "tuple"), _items(r, "tuple")
            _layer(gname, gs, {"class": rname, "state": rs}, header, exact, floats)
        return
    kv = name in KV_CLASSES
    lengths = set()
    _match(state, want["state"], header.tensors, kv, lengths, exact, floats)
    if kv:
        got = [v for v in _items(state, "tuple") if type(v) is int]
        ref = [v for v in _items(want["state"], "tuple") if type(v) is int]
        _lengths(name, got, ref, lengths, len(header.tokens))


def _match(x, r, tensors, kv, lengths, exact, floats):
    """Walk the entry's state tree ``x`` and the reference's ``r`` together."""
    if isinstance(r, dict) and "a" in r:
        if not (isinstance(x, dict) and "t" in x):
            raise Corrupt("an array is missing")
        info = tensors[str(x["t"])]
        shape, dtype = info["shape"], info["dtype"]
        ref_shape, ref_dtype = r["a"]
        if len(shape) != len(ref_shape):
            raise Corrupt(f"array of rank {len(shape)}, the model makes {len(ref_shape)}")
        if kv:  # the token axis (-2) is checked against the offsets instead
            lengths.add(shape[-2])
            shape, ref_shape = shape[:-2] + shape[-1:], ref_shape[:-2] + ref_shape[-1:]
        if shape != ref_shape:
            raise Corrupt(f"array of shape {info['shape']}, the model makes {r['a'][0]}")
        if dtype in FLOATS and ref_dtype in FLOATS and not exact:
            floats.add(dtype)
        elif dtype != ref_dtype:
            raise Corrupt(f"dtype {dtype}, the model makes {ref_dtype}")
        return
    if isinstance(r, dict):
        ((kind, items),) = r.items()
        got = _items(x, kind)
        if len(got) != len(items):
            raise Corrupt("the state has another structure")
        for g, w in zip(got, items, strict=True):
            _match(g, w, tensors, kv, lengths, exact, floats)
    elif r is None:
        if x is not None:
            raise Corrupt("the state holds a value where the model holds none")
    elif type(x) is not type(r):  # ints (offsets, sizes) are compared in _lengths
        raise Corrupt("the state has another structure")


def _items(x, kind):
    if not (isinstance(x, dict) and isinstance(x.get(kind), list)):
        raise Corrupt(f"the state is not a {kind}")
    return x[kind]


def _lengths(name, got, ref, lengths, n_tokens):
    """Offsets, window settings and buffer lengths agree with each other and the tokens."""
    if len(lengths) != 1:
        raise Corrupt("keys and values hold different numbers of tokens")
    (t,) = lengths
    if name == "KVCache":
        ok = got[0] == t == n_tokens
    elif name == "QuantizedKVCache":  # (offset, group_size, bits)
        ok = got[0] == t == n_tokens and got[1:] == ref[1:]
    elif name == "RotatingKVCache":  # (offset, keep, max_size, idx)
        offset, keep, max_size, idx = got
        ok = (
            offset == n_tokens
            and [keep, max_size] == ref[1:3]
            and 0 <= idx <= t <= offset
            and (t == offset if offset < max_size else t >= max_size - 1)
        )
    elif name == "ChunkedKVCache":  # (offset, chunk_size, start_position)
        offset, chunk, start = got
        ok = offset == n_tokens and chunk == ref[1] and 0 <= start <= offset and t == offset - start
    else:  # ConcatenateKVCache: its offset is its buffer length
        ok = t == n_tokens
    if not ok:
        raise Corrupt(
            f"offsets and settings {got} with {t} buffered tokens do not fit "
            f"{n_tokens} tokens and the model's {ref}"
        )
