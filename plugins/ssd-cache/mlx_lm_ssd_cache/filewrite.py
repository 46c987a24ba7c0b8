"""The write side of the entry file format: constants, state encoding, ``snapshot``, ``write``.

``snapshot`` runs on the server's generation thread: it only slices, evaluates
and takes zero-copy numpy views. ``write`` runs on the writer thread and
streams those views to disk without another copy. ``from_snapshot`` turns a
snapshot that has not reached disk yet back into a prompt cache.

The format itself is described in ``fileformat``; the read side is
``fileread``.
"""

import hashlib
import json
import os
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as cache_module

from mlx_lm_ext import safefs

FORMAT = "mlx-lm-ssd-cache/1"
SUFFIX = ".safetensors"
MAX_HEADER = 64 << 20

# mlx dtype name -> (safetensors dtype, numpy dtype of the bytes we write)
DTYPES = {
    "float32": ("F32", np.float32),
    "float16": ("F16", np.float16),
    "bfloat16": ("BF16", np.uint16),  # numpy has no bfloat16: write the raw bits
    "float64": ("F64", np.float64),
    "int64": ("I64", np.int64),
    "int32": ("I32", np.int32),
    "int16": ("I16", np.int16),
    "int8": ("I8", np.int8),
    "uint64": ("U64", np.uint64),
    "uint32": ("U32", np.uint32),
    "uint16": ("U16", np.uint16),
    "uint8": ("U8", np.uint8),
    "bool": ("BOOL", np.bool_),
}


class Unsupported(ValueError):
    """A cache that this format cannot store (custom class, odd state)."""


class Corrupt(ValueError):
    """A file that is not a valid entry; the caller removes it."""


@dataclass
class Snapshot:
    """An evaluated prompt cache, ready for the writer thread."""

    spec: list  # per layer: {"class": name, "state": encoded state tree}
    arrays: list[np.ndarray]  # zero-copy views, tensor i is named str(i)
    dtypes: list[str]  # safetensors dtype per tensor
    trimmable: bool
    n_tokens: int  # tokens the KV layers hold (None: no KV layer)
    nbytes: int
    extras: list = None  # plugin caches after the model's: {"class", "state", "meta_state"}


def mx_name(st: str) -> str:
    """The mlx dtype name of a safetensors dtype; ``Corrupt`` if there is none."""
    for name, (s, _) in DTYPES.items():
        if s == st:
            return name
    raise Corrupt(f"unknown dtype {st}")


def tokens_json(tokens: Sequence[int] | np.ndarray) -> str:
    return json.dumps([int(t) for t in tokens], separators=(",", ":"))


# ------------------------------------------------------------ state encoding


def _cache_class(c):
    name = type(c).__name__
    if getattr(cache_module, name, None) is not type(c) or name.startswith("Batch"):
        raise Unsupported(f"cache class {type(c).__module__}.{name} is not storable")
    return name


def _sliced_state(c):
    """``c.state`` with KV buffers cut to the tokens they hold."""
    name = _cache_class(c)
    if name == "CacheList":
        return [(_sliced_state(x), _cache_class(x)) for x in c.caches]
    state = c.state
    if name in ("KVCache", "QuantizedKVCache"):
        n = c.offset
    elif name == "RotatingKVCache":
        # Past the window the buffer is a ring, kept whole; before, it is in
        # temporal order and only the first offset slots are filled.
        n = c.offset if c.offset < c.max_size else None
    elif name == "ChunkedKVCache":
        n = c.offset - c.start_position
    else:
        return state
    state = list(state)
    if n is not None and state[0] is not None:
        cut = lambda x: x[..., :n, :] if x.shape[-2] > n else x  # noqa: E731
        state[0] = _tree(state[0], cut)
        state[1] = _tree(state[1], cut)
    return tuple(state)


def _tree(x, fn):
    if isinstance(x, (list, tuple)):
        return type(x)(_tree(y, fn) for y in x)
    return fn(x)


def _encode(x, out):
    """A JSON tree of ``x`` whose arrays are appended to ``out`` and named by index."""
    if isinstance(x, mx.array):
        out.append(x)
        return {"t": len(out) - 1}
    if isinstance(x, tuple):
        return {"tuple": [_encode(y, out) for y in x]}
    if isinstance(x, list):
        return {"list": [_encode(y, out) for y in x]}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise Unsupported(f"cache state holds a {type(x).__name__}")


def decode_state(x, arrays: Sequence):
    """The state tree that ``_encode`` made, with its arrays put back."""
    if isinstance(x, dict):
        if "t" in x:
            return arrays[x["t"]]
        if "tuple" in x:
            return tuple(decode_state(y, arrays) for y in x["tuple"])
        if "list" in x:
            return [decode_state(y, arrays) for y in x["list"]]
        raise Corrupt("bad state tree")
    return x


def _kv_length(caches):
    """Tokens held by the KV layers (the smallest offset), None if none has one."""
    lengths = []
    for c in caches:
        if type(c).__name__ == "CacheList":
            n = _kv_length(c.caches)
            if n is not None:
                lengths.append(n)
        elif hasattr(c, "offset") and not isinstance(c.offset, mx.array):
            lengths.append(int(c.offset))
    return min(lengths) if lengths else None


# ------------------------------------------------------------------ snapshot


def snapshot(
    prompt_cache: Sequence, n_model: int | None = None, extra_classes: Iterable[type] = ()
) -> Snapshot:
    """Slice, evaluate and view ``prompt_cache`` as numpy (generation thread).

    The first ``n_model`` caches are the model's (all of them by default);
    the caches after them were added by plugins (a drafter's state) and are
    stored as extras when every one is of a class in ``extra_classes``,
    else left out. Raises ``Unsupported`` for caches this format cannot store.
    """
    n_model = len(prompt_cache) if n_model is None else n_model
    model, rest = list(prompt_cache[:n_model]), list(prompt_cache[n_model:])
    n_tokens = _kv_length(model)
    # Plugin caches are kept only when their class is known and they hold
    # exactly the model's tokens (so that one trim keeps them all in step).
    if rest and not all(
        type(c) in tuple(extra_classes) and getattr(c, "offset", n_tokens) == n_tokens for c in rest
    ):
        rest = []
    arrays = []
    spec = [{"class": _cache_class(c), "state": _encode(_sliced_state(c), arrays)} for c in model]
    extras = [
        {
            "class": type(c).__name__,
            "state": _encode(c.state, arrays),
            "meta_state": [str(x) for x in c.meta_state],
        }
        for c in rest
    ]
    views, dtypes = _numpy_views(arrays)
    kept = model + rest
    return Snapshot(
        spec=spec,
        arrays=views,
        dtypes=dtypes,
        trimmable=bool(kept) and cache_module.can_trim_prompt_cache(kept),
        n_tokens=n_tokens,
        nbytes=sum(v.nbytes for v in views),
        extras=extras,
    )


def _numpy_views(arrays):
    """Evaluated zero-copy numpy views of mlx arrays, and their safetensors dtypes."""
    views, dtypes = [], []
    for a in arrays:
        kind = str(a.dtype).rsplit(".", 1)[-1]
        if kind not in DTYPES:
            raise Unsupported(f"dtype {kind} is not storable")
        dtypes.append(DTYPES[kind][0])
        views.append(a.view(mx.uint16) if kind == "bfloat16" else a)
    mx.eval(views)
    views = [np.asarray(v) for v in views]  # zero-copy on the CPU
    for v, st in zip(views, dtypes, strict=True):
        if v.dtype != np.dtype(DTYPES[mx_name(st)][1]):
            raise Unsupported(f"unexpected numpy dtype {v.dtype}")
    return views, dtypes


def from_snapshot(snap: Snapshot) -> tuple[list, list]:
    """The prompt cache of a snapshot that has not reached disk yet (a copy).

    Returns ``(model caches, extras)`` as ``fileread.load`` does.
    """
    arrays = []
    for v, st in zip(snap.arrays, snap.dtypes, strict=True):
        a = mx.array(np.ascontiguousarray(v))
        arrays.append(a.view(mx.bfloat16) if st == "BF16" else a)
    mx.eval(arrays)
    caches = [
        getattr(cache_module, layer["class"]).from_state(decode_state(layer["state"], arrays))
        for layer in snap.spec
    ]
    extras = [
        (x["class"], decode_state(x["state"], arrays), tuple(x["meta_state"]))
        for x in snap.extras or ()
    ]
    return caches, extras


# --------------------------------------------------------------------- write


def chunks(a: np.ndarray) -> Iterator[memoryview]:
    """Contiguous pieces of a (possibly strided) view, as bytes, without copies."""
    if a.flags.c_contiguous:
        if a.nbytes:
            yield memoryview(a.reshape(-1).view(np.uint8))
    else:
        for i in range(a.shape[0]):
            yield from chunks(a[i])


def header_hash(meta: dict, tensors: dict) -> str:
    """``header_sha256``: over every metadata field but itself, and the tensor table."""
    body = {k: v for k, v in meta.items() if k != "header_sha256"}
    blob = json.dumps({"meta": body, "tensors": tensors}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def header_bytes(meta: dict, tensors: dict) -> bytes:
    """The JSON header as safetensors lays it out, padded to 8 bytes."""
    header = dict(tensors)
    header["__metadata__"] = meta
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # 8-byte aligned data, as safetensors does


def write(
    tmp_path: str | os.PathLike,
    snap: Snapshot,
    meta: dict,
    pace: Callable[[int], None] | None = None,
    dir_fd: int | None = None,
) -> int:
    """Write ``snap`` to ``tmp_path`` (created exclusively, relative to
    ``dir_fd``, never through a link) and fsync it.

    ``meta`` are the entry's string fields; the per-tensor CRCs and the header
    hash are added here. The header has a fixed size, so it is written after
    the data, whose CRCs are taken while streaming: one pass over the bytes.
    ``pace(n)`` is called after each piece of ``n`` bytes (to spread the
    write over time). Returns the file size.
    """
    tensors, size = _tensor_table(snap)
    meta = _entry_meta(snap, meta)
    head_len = len(header_bytes(meta, tensors))
    # Locked while written, so no reaper of another process takes it.
    with os.fdopen(safefs.create_temp(os.fspath(tmp_path), dir_fd), "wb") as f:
        f.seek(8 + head_len)
        crcs = [_stream(f, a, pace) for a in snap.arrays]
        meta["tensor_crc32"] = json.dumps(crcs)
        meta["header_sha256"] = header_hash(meta, tensors)
        head = header_bytes(meta, tensors)
        assert len(head) == head_len  # the placeholders had the final widths
        f.seek(0)
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        f.flush()
        os.fsync(f.fileno())
        return 8 + head_len + size


def _tensor_table(snap):
    """The safetensors tensor table of ``snap`` and the size of its data."""
    tensors, offset = {}, 0
    for i, (a, st) in enumerate(zip(snap.arrays, snap.dtypes, strict=True)):
        tensors[str(i)] = {
            "dtype": st,
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    return tensors, offset


def _entry_meta(snap, meta):
    """The header's metadata, with fixed-width placeholders for the CRCs and hash."""
    meta = dict(meta)
    meta["format"] = FORMAT
    meta["spec"] = json.dumps(snap.spec, separators=(",", ":"))
    meta["trimmable"] = "1" if snap.trimmable else "0"
    if snap.extras:
        meta["extras"] = json.dumps(snap.extras, separators=(",", ":"))
    meta["tensor_crc32"] = json.dumps(["00000000"] * len(snap.arrays))
    meta["header_sha256"] = "0" * 64
    return meta


def _stream(f, a, pace):
    """Write one tensor's bytes; its CRC32 as 8 hex digits."""
    crc = 0
    for chunk in chunks(a):
        crc = zlib.crc32(chunk, crc)
        f.write(chunk)
        if pace is not None:
            pace(len(chunk))
    return f"{crc:08x}"
