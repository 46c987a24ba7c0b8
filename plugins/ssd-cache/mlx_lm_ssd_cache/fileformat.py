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

from . import safefs

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
    extras: list = None  # plugin caches after the model's: {"class", "state", "meta_state"}


@dataclass
class Header:
    path: str
    meta: dict
    tensors: dict
    tokens: np.ndarray
    size: int
    mtime: float
    ino: int
    spec: list = None  # per model cache: {"class", "state"}, checked
    extras: list = None  # plugin caches stored after the model's

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


def snapshot(prompt_cache, n_model=None, extra_classes=()):
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
        type(c) in tuple(extra_classes) and getattr(c, "offset", n_tokens) == n_tokens
        for c in rest
    ):
        rest = []
    arrays = []
    spec = [{"class": _cache_class(c), "state": _encode(_sliced_state(c), arrays)} for c in model]
    extras = [
        {"class": type(c).__name__, "state": _encode(c.state, arrays),
         "meta_state": [str(x) for x in c.meta_state]}
        for c in rest
    ]
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


def write(tmp_path, snap, meta, pace=None, dir_fd=None):
    """Write ``snap`` to ``tmp_path`` (created exclusively, relative to
    ``dir_fd``, never through a link) and fsync it.

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
    if snap.extras:
        meta["extras"] = json.dumps(snap.extras, separators=(",", ":"))
    meta["tensor_crc32"] = json.dumps(["00000000"] * len(snap.arrays))
    meta["header_sha256"] = "0" * 64
    head_len = len(_header_bytes(meta, tensors))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    with os.fdopen(os.open(tmp_path, flags, 0o644, dir_fd=dir_fd), "wb") as f:
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

MAX_TOKEN = 1 << 31  # token ids are uint32 in mlx-lm; anything past int32 is a lie
MAX_INT = 1 << 53  # integers in a state tree (offsets, window sizes)


def read_header(path, dir_fd=None):
    """Read and check one file's header only. Raises ``Corrupt`` or ``OSError``.

    ``path`` is opened relative to ``dir_fd`` (an open namespace) without
    following a link, and must be a regular file. Every field is parsed and
    type-checked here, so that anything a file holds is either a ``Header``
    or ``Corrupt``; reads are bounded by the file's real size.
    """
    fd = safefs.open_file(dir_fd, path)
    try:
        st = os.fstat(fd)
        raw = os.pread(fd, 8, 0)
        if len(raw) < 8:
            raise Corrupt("shorter than a header")
        n = int.from_bytes(raw, "little")
        if n > MAX_HEADER or 8 + n > st.st_size:
            raise Corrupt("header length out of range")
        blob = _pread_all(fd, n, 8)
    finally:
        os.close(fd)
    # Our writer writes every byte; a file with holes claims data it lacks.
    if st.st_blocks and st.st_blocks * 512 < (st.st_size - 8 - n) // 2:
        raise Corrupt("sparse file: fewer bytes on disk than its tensors claim")
    try:
        header, meta, tokens, spec, extras, end = _parse(blob)
    except Corrupt:
        raise
    except Exception as e:  # whatever a crafted header holds, it is only corrupt
        raise Corrupt(f"unreadable header: {type(e).__name__}: {e}") from e
    if st.st_size != 8 + n + end:
        raise Corrupt(f"size {st.st_size} != {8 + n + end} (truncated or padded)")
    return Header(str(path), meta, header, tokens, st.st_size, st.st_mtime, st.st_ino,
                  spec, extras)


def _pread_all(fd, n, offset):
    parts, got = [], 0
    while got < n:
        chunk = os.pread(fd, n - got, offset + got)
        if not chunk:
            raise Corrupt("file shrank while reading its header")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _parse(blob):
    header = json.loads(blob.decode("utf-8"))
    _expect(isinstance(header, dict), "header is not an object")
    meta = header.pop("__metadata__", None)
    _expect(isinstance(meta, dict), "no metadata")
    _expect(all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()),
            "metadata values must be strings")
    _expect(meta.get("format") == FORMAT, f"format {meta.get('format')!r}, expected {FORMAT}")
    _expect(_header_hash(meta, header) == meta.get("header_sha256"), "header hash mismatch")
    _expect(meta.get("trimmable") in ("0", "1"), "bad trimmable flag")
    tokens = json.loads(meta["tokens"])
    _expect(isinstance(tokens, list) and all(
        type(t) is int and 0 <= t < MAX_TOKEN for t in tokens), "tokens are not token ids")
    tokens = np.array(tokens, dtype=np.int64).reshape(-1)
    if "n_tokens" in meta:
        _expect(meta["n_tokens"] == str(len(tokens)), "n_tokens differs from the tokens")
    _expect(set(header) == {str(i) for i in range(len(header))}, "tensor names are not 0..n-1")
    end = 0
    for i in range(len(header)):
        info = header[str(i)]
        _expect(isinstance(info, dict), "tensor entry is not an object")
        shape, (b, e) = info["shape"], info["data_offsets"]
        _expect(isinstance(shape, list) and all(type(d) is int and 0 <= d < MAX_INT for d in shape),
                "bad tensor shape")
        _expect(type(b) is int and type(e) is int, "bad data offsets")
        nbytes = int(np.prod(shape, dtype=object) or 0) * _itemsize(info["dtype"])
        _expect(b == end and e - b == nbytes, "tensor table out of order")
        end = e
    crcs = json.loads(meta["tensor_crc32"])
    _expect(isinstance(crcs, list) and len(crcs) == len(header)
            and all(isinstance(c, str) and len(c) == 8 for c in crcs), "bad tensor CRCs")
    used = []
    spec = _layers(json.loads(meta["spec"]), len(header), used)
    extras = _layers(json.loads(meta.get("extras", "[]")), len(header), used, meta_state=True)
    _expect(sorted(used) == list(range(len(header))), "tensors not used exactly once")
    return header, meta, tokens, spec, extras, end


def _layers(layers, n_tensors, used, meta_state=False):
    """Check a cache spec: a list of ``{"class": str, "state": tree}``."""
    _expect(isinstance(layers, list), "cache spec is not a list")
    for layer in layers:
        _expect(isinstance(layer, dict) and isinstance(layer.get("class"), str)
                and "state" in layer, "bad cache spec layer")
        _check_tree(layer["state"], n_tensors, used, depth=0)
        if meta_state:
            m = layer.get("meta_state", [])
            _expect(isinstance(m, list) and all(isinstance(x, str) for x in m), "bad meta state")
    return layers


def _check_tree(x, n_tensors, used, depth):
    _expect(depth < 8, "state tree too deep")
    if isinstance(x, dict):
        _expect(len(x) == 1, "bad state tree node")
        (kind, value), = x.items()
        if kind == "t":
            _expect(type(value) is int and 0 <= value < n_tensors, "bad tensor reference")
            used.append(value)
        elif kind in ("tuple", "list"):
            _expect(isinstance(value, list), "bad state tree node")
            for y in value:
                _check_tree(y, n_tensors, used, depth + 1)
        else:
            raise Corrupt("bad state tree node")
    elif type(x) is int:
        _expect(-MAX_INT < x < MAX_INT, "integer out of range in the cache state")
    else:
        _expect(x is None or isinstance(x, (bool, float, str)), "bad state tree leaf")


def _expect(ok, why):
    if not ok:
        raise Corrupt(why)


def _itemsize(st):
    return np.dtype(DTYPES[_mx_name(st)][1]).itemsize


def load(header, verify=False, dir_fd=None):
    """The prompt cache of a checked ``header``: evaluated, owning its memory.

    Returns ``(model caches, extras)`` where extras are the ``(class name,
    state, meta_state)`` of plugin caches stored after the model's. The file
    is opened again relative to ``dir_fd`` without links and must be the very
    file whose header was read. With ``verify`` every tensor's CRC32 is
    checked. Raises ``Corrupt`` or ``OSError``.
    """
    fd = safefs.open_file(dir_fd, header.path if dir_fd is None else os.path.basename(header.path))
    try:
        st = os.fstat(fd)
        if (st.st_ino, st.st_size) != (header.ino, header.size):
            raise FileNotFoundError("entry replaced since its header was read")
        _read_ahead(fd)
        ordered = _load_tensors(fd, header)
    finally:
        os.close(fd)
    if verify:
        _verify(header, ordered)
    try:
        caches = [
            getattr(cache_module, layer["class"]).from_state(_decode(layer["state"], ordered))
            for layer in header.spec
        ]
    except Exception as e:
        raise Corrupt(f"bad cache spec: {type(e).__name__}: {e}") from e
    extras = [(x["class"], _decode(x["state"], ordered), tuple(x.get("meta_state", ())))
              for x in header.extras]
    return caches, extras


def _load_tensors(fd, header):
    # /proc/self/fd reopens the same inode whatever happens to the name
    # since; elsewhere MLX reads through a file object of the same fd.
    path = safefs.fd_path(fd)
    try:
        if path is not None:
            arrays = mx.load(path, format="safetensors")
        else:
            with os.fdopen(os.dup(fd), "rb") as f:
                arrays = mx.load(f, format="safetensors")
        if len(arrays) != len(header.tensors):
            raise Corrupt("tensor count differs from the header")
        ordered = [arrays[str(i)] for i in range(len(arrays))]
        for a, i in zip(ordered, range(len(ordered))):
            info = header.tensors[str(i)]
            if list(a.shape) != info["shape"] or DTYPES[str(a.dtype).rsplit(".", 1)[-1]][0] != info["dtype"]:
                raise Corrupt(f"tensor {i} differs from the header")
        mx.eval(ordered)
    except Corrupt:
        raise
    except (RuntimeError, ValueError, KeyError) as e:
        raise Corrupt(f"tensor data unreadable: {e}") from e
    return ordered


def _read_ahead(fd):
    """Ask the kernel to start reading the whole file now (Linux, macOS: no-op)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    try:
        advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass


def from_snapshot(snap):
    """The prompt cache of a snapshot that has not reached disk yet (a copy)."""
    arrays = []
    for v, st in zip(snap.arrays, snap.dtypes):
        a = mx.array(np.ascontiguousarray(v))
        arrays.append(a.view(mx.bfloat16) if st == "BF16" else a)
    mx.eval(arrays)
    caches = [
        getattr(cache_module, layer["class"]).from_state(_decode(layer["state"], arrays))
        for layer in snap.spec
    ]
    extras = [(x["class"], _decode(x["state"], arrays), tuple(x["meta_state"]))
              for x in snap.extras or ()]
    return caches, extras


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

