"""The read side of the entry file format: ``read_header``, ``load``, CRC checks.

A file may have been written by anyone, so the header is parsed field by
field and every value is type- and range-checked before it is used: whatever
a file holds is either a ``Header`` or ``Corrupt``. Reads are bounded by the
file's real size, and files are opened relative to an open namespace without
following links.
"""

import json
import os
import zlib
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as cache_module

from mlx_lm_ext import safefs

from .filewrite import (
    DTYPES,
    FORMAT,
    MAX_HEADER,
    Corrupt,
    chunks,
    decode_state,
    header_hash,
    mx_name,
)

MAX_TOKEN = 1 << 31  # token ids are uint32 in mlx-lm; anything past int32 is a lie
MAX_INT = 1 << 53  # integers in a state tree (offsets, window sizes)


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
    def trimmable(self) -> bool:
        return self.meta["trimmable"] == "1"


# -------------------------------------------------------------------- header


def read_header(path: str | os.PathLike, dir_fd: int | None = None) -> Header:
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
    return Header(str(path), meta, header, tokens, st.st_size, st.st_mtime, st.st_ino, spec, extras)


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
    """The checked fields of a header blob, in the order the checks run."""
    header = json.loads(blob.decode("utf-8"))
    _expect(isinstance(header, dict), "header is not an object")
    meta = header.pop("__metadata__", None)
    _check_meta(meta, header)
    tokens = _tokens(meta)
    end = _tensor_table_end(header)
    crcs = json.loads(meta["tensor_crc32"])
    _expect(
        isinstance(crcs, list)
        and len(crcs) == len(header)
        and all(isinstance(c, str) and len(c) == 8 for c in crcs),
        "bad tensor CRCs",
    )
    used = []
    spec = _layers(json.loads(meta["spec"]), len(header), used)
    extras = _layers(json.loads(meta.get("extras", "[]")), len(header), used, meta_state=True)
    _expect(sorted(used) == list(range(len(header))), "tensors not used exactly once")
    return header, meta, tokens, spec, extras, end


def _check_meta(meta, header):
    """String fields only, our format, an intact hash: checked before any field is read."""
    _expect(isinstance(meta, dict), "no metadata")
    _expect(
        all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()),
        "metadata values must be strings",
    )
    _expect(meta.get("format") == FORMAT, f"format {meta.get('format')!r}, expected {FORMAT}")
    _expect(header_hash(meta, header) == meta.get("header_sha256"), "header hash mismatch")
    _expect(meta.get("trimmable") in ("0", "1"), "bad trimmable flag")


def _tokens(meta):
    tokens = json.loads(meta["tokens"])
    _expect(
        isinstance(tokens, list) and all(type(t) is int and 0 <= t < MAX_TOKEN for t in tokens),
        "tokens are not token ids",
    )
    tokens = np.array(tokens, dtype=np.int64).reshape(-1)
    if "n_tokens" in meta:
        _expect(meta["n_tokens"] == str(len(tokens)), "n_tokens differs from the tokens")
    return tokens


def _tensor_table_end(header):
    """Where the tensor data ends: tensors 0..n-1, back to back, sized by their shapes."""
    _expect(set(header) == {str(i) for i in range(len(header))}, "tensor names are not 0..n-1")
    end = 0
    for i in range(len(header)):
        info = header[str(i)]
        _expect(isinstance(info, dict), "tensor entry is not an object")
        shape, (b, e) = info["shape"], info["data_offsets"]
        _expect(
            isinstance(shape, list) and all(type(d) is int and 0 <= d < MAX_INT for d in shape),
            "bad tensor shape",
        )
        _expect(type(b) is int and type(e) is int, "bad data offsets")
        nbytes = int(np.prod(shape, dtype=object) or 0) * _itemsize(info["dtype"])
        _expect(b == end and e - b == nbytes, "tensor table out of order")
        end = e
    return end


def _layers(layers, n_tensors, used, meta_state=False):
    """Check a cache spec: a list of ``{"class": str, "state": tree}``."""
    _expect(isinstance(layers, list), "cache spec is not a list")
    for layer in layers:
        _expect(
            isinstance(layer, dict) and isinstance(layer.get("class"), str) and "state" in layer,
            "bad cache spec layer",
        )
        _check_tree(layer["state"], n_tensors, used, depth=0)
        if meta_state:
            m = layer.get("meta_state", [])
            _expect(isinstance(m, list) and all(isinstance(x, str) for x in m), "bad meta state")
    return layers


def _check_tree(x, n_tensors, used, depth):
    _expect(depth < 8, "state tree too deep")
    if isinstance(x, dict):
        _expect(len(x) == 1, "bad state tree node")
        ((kind, value),) = x.items()
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
    return np.dtype(DTYPES[mx_name(st)][1]).itemsize


# ---------------------------------------------------------------------- load


def load(header: Header, verify: bool = False, dir_fd: int | None = None) -> tuple[list, list]:
    """The prompt cache of a checked ``header``: evaluated, owning its memory.

    Returns ``(model caches, extras)`` where extras are the ``(class name,
    state, meta_state)`` of plugin caches stored after the model's. The file
    is opened again relative to ``dir_fd`` without links and must be the very
    file whose header was read. With ``verify`` every tensor's CRC32 is
    checked. Raises ``Corrupt`` or ``OSError``.
    """
    name = header.path if dir_fd is None else os.path.basename(header.path)
    fd = safefs.open_file(dir_fd, name)
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
            getattr(cache_module, layer["class"]).from_state(decode_state(layer["state"], ordered))
            for layer in header.spec
        ]
    except Exception as e:
        raise Corrupt(f"bad cache spec: {type(e).__name__}: {e}") from e
    extras = [
        (x["class"], decode_state(x["state"], ordered), tuple(x.get("meta_state", ())))
        for x in header.extras
    ]
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
        for i, a in enumerate(ordered):
            info = header.tensors[str(i)]
            kind = str(a.dtype).rsplit(".", 1)[-1]
            if list(a.shape) != info["shape"] or DTYPES[kind][0] != info["dtype"]:
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


def _verify(header, arrays):
    expected = json.loads(header.meta["tensor_crc32"])
    views = [a.view(mx.uint16) if a.dtype == mx.bfloat16 else a for a in arrays]
    mx.eval(views)
    for i, (v, want) in enumerate(zip(views, expected, strict=True)):
        got = 0
        for chunk in chunks(np.asarray(v)):
            got = zlib.crc32(chunk, got)
        if f"{got:08x}" != want:
            raise Corrupt(f"tensor {i} fails its CRC32")


# ------------------------------------------------------------------ listings


def entry_meta(header: Header) -> dict:
    """A few header fields as plain Python, for listings."""
    return {
        "n_tokens": len(header.tokens),
        "cache_type": header.meta.get("cache_type", "?"),
        "trimmable": header.trimmable,
        "created": float(header.meta.get("created", 0)),
        "model": header.meta.get("model", ""),
    }
