"""One prompt cache per file: safetensors with the tokens and a hash in the header.

A file is plain safetensors (8-byte little-endian header length, JSON header,
raw tensor bytes), so ``mx.load`` and the ``safetensors`` package read it. The
header's ``__metadata__`` (str -> str) carries the entry: its tokens, the cache
classes with their non-array state, a CRC32 per tensor, and ``header_sha256``
over all of that and the tensor table. KV buffers are stored sliced to their
offset (in memory they are padded to a multiple of 256 tokens).

``snapshot`` runs on the server's generation thread: it only slices, evaluates
and takes zero-copy numpy views. ``write`` runs on the writer thread and
streams those views to disk without another copy.
"""

import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from typing import List

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as cache_module

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
    arrays: List[np.ndarray]  # zero-copy views, tensor i is named str(i)
    dtypes: List[str]  # safetensors dtype per tensor
    trimmable: bool
    n_tokens: int  # tokens the KV layers hold (None: no KV layer)
    nbytes: int


@dataclass
class Header:
    path: str
    meta: dict
    tensors: dict
    tokens: np.ndarray
    size: int
    mtime: float
    ino: int

    @property
    def trimmable(self):
        return self.meta["trimmable"] == "1"


# ------------------------------------------------------------------ snapshot


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


def _decode(x, arrays):
    if isinstance(x, dict):
        if "t" in x:
            return arrays[x["t"]]
        if "tuple" in x:
            return tuple(_decode(y, arrays) for y in x["tuple"])
        if "list" in x:
            return [_decode(y, arrays) for y in x["list"]]
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


def snapshot(prompt_cache):
    """Slice, evaluate and view ``prompt_cache`` as numpy (generation thread).

    Raises ``Unsupported`` for caches this format cannot store.
    """
    arrays = []
    spec = []
    for c in prompt_cache:
        name = _cache_class(c)
        spec.append({"class": name, "state": _encode(_sliced_state(c), arrays)})
    views, dtypes = [], []
    for a in arrays:
        kind = str(a.dtype).rsplit(".", 1)[-1]
        if kind not in DTYPES:
            raise Unsupported(f"dtype {kind} is not storable")
        st, np_dtype = DTYPES[kind]
        dtypes.append(st)
        views.append(a.view(mx.uint16) if kind == "bfloat16" else a)
    mx.eval(views)
    views = [np.asarray(v) for v in views]  # zero-copy on the CPU
    for v, st in zip(views, dtypes):
        if v.dtype != np.dtype(DTYPES[_mx_name(st)][1]):
            raise Unsupported(f"unexpected numpy dtype {v.dtype}")
    return Snapshot(
        spec=spec,
        arrays=views,
        dtypes=dtypes,
        trimmable=bool(prompt_cache) and cache_module.can_trim_prompt_cache(prompt_cache),
        n_tokens=_kv_length(prompt_cache),
        nbytes=sum(v.nbytes for v in views),
    )


def _mx_name(st):
    for name, (s, _) in DTYPES.items():
        if s == st:
            return name
    raise Corrupt(f"unknown dtype {st}")


# --------------------------------------------------------------------- write


def _chunks(a):
    """Contiguous pieces of a (possibly strided) view, as bytes, without copies."""
    if a.flags.c_contiguous:
        if a.nbytes:
            yield memoryview(a.reshape(-1).view(np.uint8))
    else:
        for i in range(a.shape[0]):
            yield from _chunks(a[i])


def _header_hash(meta, tensors):
    body = {k: v for k, v in meta.items() if k != "header_sha256"}
    blob = json.dumps({"meta": body, "tensors": tensors}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _header_bytes(meta, tensors):
    header = dict(tensors)
    header["__metadata__"] = meta
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # 8-byte aligned data, as safetensors does


def write(tmp_path, snap, meta, pace=None):
    """Write ``snap`` to ``tmp_path`` (created exclusively) and fsync it.

    ``meta`` are the entry's string fields; the per-tensor CRCs and the header
    hash are added here. The header has a fixed size, so it is written after
    the data, whose CRCs are taken while streaming: one pass over the bytes.
    ``pace(n)`` is called after each piece of ``n`` bytes (to spread the
    write over time). Returns the file size.
    """
    tensors, offset = {}, 0
    for i, (a, st) in enumerate(zip(snap.arrays, snap.dtypes)):
        tensors[str(i)] = {
            "dtype": st,
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    meta = dict(meta)
    meta["format"] = FORMAT
    meta["spec"] = json.dumps(snap.spec, separators=(",", ":"))
    meta["trimmable"] = "1" if snap.trimmable else "0"
    meta["tensor_crc32"] = json.dumps(["00000000"] * len(snap.arrays))
    meta["header_sha256"] = "0" * 64
    head_len = len(_header_bytes(meta, tensors))
    with open(tmp_path, "xb") as f:
        f.seek(8 + head_len)
        crcs = []
        for a in snap.arrays:
            crc = 0
            for chunk in _chunks(a):
                crc = zlib.crc32(chunk, crc)
                f.write(chunk)
                if pace is not None:
                    pace(len(chunk))
            crcs.append(f"{crc:08x}")
        meta["tensor_crc32"] = json.dumps(crcs)
        meta["header_sha256"] = _header_hash(meta, tensors)
        head = _header_bytes(meta, tensors)
        assert len(head) == head_len
        f.seek(0)
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        f.flush()
        os.fsync(f.fileno())
        return 8 + head_len + offset


# ---------------------------------------------------------------------- read


def read_header(path):
    """Read and check one file's header only. Raises ``Corrupt`` or ``OSError``."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        raw = f.read(8)
        if len(raw) < 8:
            raise Corrupt("shorter than a header")
        n = int.from_bytes(raw, "little")
        if n > MAX_HEADER or 8 + n > st.st_size:
            raise Corrupt("header length out of range")
        blob = f.read(n)
    try:
        header = json.loads(blob.decode("utf-8"))
        meta = header.pop("__metadata__")
        if meta.get("format") != FORMAT:
            raise Corrupt(f"format {meta.get('format')!r}, expected {FORMAT}")
        if _header_hash(meta, header) != meta.get("header_sha256"):
            raise Corrupt("header hash mismatch")
        tokens = np.array(json.loads(meta["tokens"]), dtype=np.int64).reshape(-1)
        end = 0
        for i in range(len(header)):
            info = header[str(i)]
            b, e = info["data_offsets"]
            nbytes = int(np.prod(info["shape"], dtype=np.int64)) * _itemsize(info["dtype"])
            if b != end or e - b != nbytes:
                raise Corrupt("tensor table out of order")
            end = e
    except Corrupt:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise Corrupt(f"unreadable header: {e}") from e
    if st.st_size != 8 + n + end:
        raise Corrupt(f"size {st.st_size} != {8 + n + end} (truncated or padded)")
    return Header(str(path), meta, header, tokens, st.st_size, st.st_mtime, st.st_ino)


def _itemsize(st):
    return np.dtype(DTYPES[_mx_name(st)][1]).itemsize


def load(header, verify=False):
    """The prompt cache of a checked ``header``: evaluated, owning its memory.

    With ``verify`` every tensor's CRC32 is checked. Raises ``Corrupt`` or
    ``OSError`` (file gone or replaced since the header was read).
    """
    _read_ahead(header.path)
    try:
        arrays = mx.load(header.path)
    except (RuntimeError, ValueError) as e:
        raise Corrupt(f"mx.load failed: {e}") from e
    if len(arrays) != len(header.tensors):
        raise Corrupt("tensor count differs from the header")
    try:
        ordered = [arrays[str(i)] for i in range(len(arrays))]
        mx.eval(ordered)
    except (KeyError, RuntimeError) as e:
        raise Corrupt(f"tensor data unreadable: {e}") from e
    st = os.stat(header.path)
    if (st.st_ino, st.st_size) != (header.ino, header.size):
        raise FileNotFoundError("entry replaced while loading")
    if verify:
        _verify(header, ordered)
    try:
        spec = json.loads(header.meta["spec"])
        return [
            getattr(cache_module, layer["class"]).from_state(
                _decode(layer["state"], ordered)
            )
            for layer in spec
        ]
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise Corrupt(f"bad cache spec: {e}") from e


def _read_ahead(path):
    """Ask the kernel to start reading the whole file now (Linux, macOS: no-op)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
    except OSError:
        pass


def from_snapshot(snap):
    """The prompt cache of a snapshot that has not reached disk yet (a copy)."""
    arrays = []
    for v, st in zip(snap.arrays, snap.dtypes):
        a = mx.array(np.ascontiguousarray(v))
        arrays.append(a.view(mx.bfloat16) if st == "BF16" else a)
    mx.eval(arrays)
    return [
        getattr(cache_module, layer["class"]).from_state(_decode(layer["state"], arrays))
        for layer in snap.spec
    ]


def _verify(header, arrays):
    expected = json.loads(header.meta["tensor_crc32"])
    views = [a.view(mx.uint16) if a.dtype == mx.bfloat16 else a for a in arrays]
    mx.eval(views)
    for i, (v, want) in enumerate(zip(views, expected)):
        got = 0
        for chunk in _chunks(np.asarray(v)):
            got = zlib.crc32(chunk, got)
        if f"{got:08x}" != want:
            raise Corrupt(f"tensor {i} fails its CRC32")


def tokens_json(tokens):
    return json.dumps([int(t) for t in tokens], separators=(",", ":"))


def entry_meta(header):
    """A few header fields as plain Python, for listings."""
    return {
        "n_tokens": len(header.tokens),
        "cache_type": header.meta.get("cache_type", "?"),
        "trimmable": header.trimmable,
        "created": float(header.meta.get("created", 0)),
        "model": header.meta.get("model", ""),
    }

