"""One prompt cache per file: safetensors with the tokens and a hash in the header.

A file is plain safetensors (8-byte little-endian header length, JSON header,
raw tensor bytes), so ``mx.load`` and the ``safetensors`` package read it. The
header's ``__metadata__`` (str -> str) carries the entry: its tokens, the cache
classes with their non-array state, a CRC32 per tensor, and ``header_sha256``
over all of that and the tensor table. KV buffers are stored sliced to their
offset (in memory they are padded to a multiple of 256 tokens).

The write side (``snapshot``, ``write``) is ``filewrite``, the read side
(``read_header``, ``load``) is ``fileread``; this module is the format's one
public face. The disk tier calls ``fileformat.write`` through this module, so
that a test or a fault-injecting server that replaces it here is obeyed.
"""

from .fileread import MAX_INT, MAX_TOKEN, Header, entry_meta, load, read_header
from .filewrite import (
    DTYPES,
    FORMAT,
    MAX_HEADER,
    SUFFIX,
    Corrupt,
    Snapshot,
    Unsupported,
    from_snapshot,
    header_bytes,
    header_hash,
    snapshot,
    tokens_json,
    write,
)

# The names tests craft headers with (they predate the split into two modules).
_header_hash = header_hash
_header_bytes = header_bytes

__all__ = [
    "DTYPES",
    "FORMAT",
    "MAX_HEADER",
    "MAX_INT",
    "MAX_TOKEN",
    "SUFFIX",
    "Corrupt",
    "Header",
    "Snapshot",
    "Unsupported",
    "entry_meta",
    "from_snapshot",
    "header_bytes",
    "header_hash",
    "load",
    "read_header",
    "snapshot",
    "tokens_json",
    "write",
]
