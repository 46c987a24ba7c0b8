"""The suffix corpus on disk, so that a restarted server keeps what it learnt.

``--suffix-corpus-dir DIR`` keeps each model's corpus in
``DIR/<fingerprint>/suffix-corpus.npz``, ssd-cache's layout (one folder per
model fingerprint):

- the fingerprint (``fingerprint``): sha256 over the tokenizer's vocabulary
  fingerprint and, for every parameter of the loaded model, its name, shape,
  dtype and first values. Another model, fine-tune or tokenizer gets another
  folder, so corpora are never shared between them;
- the file: numpy's npz, read without pickles: the corpus tokens oldest
  first (a separator before each document) and a header (format,
  fingerprint, capacity, sha256 of the tokens). It is read with a size
  bound and without following a link; a file that does not check out is
  ignored with one warning, and the next save replaces it;
- saving writes a temporary file and renames it over the old one, so a
  crash leaves one or the other: when a request ends and ``SAVE_SECONDS``
  have passed since the last save, and when the process exits. Only the
  tokens are stored (4 bytes each); loading indexes them again.
"""

import atexit
import hashlib
import io
import json
import logging
import os
import stat
import time
import weakref
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

log = logging.getLogger("mlx_lm_spec_decode")

FORMAT = "mlx-lm-ext-suffix-corpus-1"
NAME = "suffix-corpus.npz"
SAVE_SECONDS = 30.0
SAMPLE = 4096  # values of each parameter in the fingerprint


def fingerprint(model: Any, tok_key: Any) -> str:
    """What a stored corpus must match to be used with ``model``."""
    h = hashlib.sha256(f"{FORMAT}\n{tok_key}\n".encode())
    for name, p in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        h.update(f"{name} {tuple(p.shape)} {p.dtype}\n".encode())
        head = p.reshape(-1)[:SAMPLE]
        if not mx.issubdtype(head.dtype, mx.integer):
            head = head.astype(mx.float32)
        h.update(np.array(head).tobytes())
    return h.hexdigest()[:32]


def path_for(root: Any, fp: str) -> Path:
    return Path(root).expanduser() / fp / NAME


def _read(path: Path, limit: int) -> bytes:
    """The file's bytes: not through a link, at most ``limit`` of them."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    return data


def load(path: Path, fp: str, corpus: Any, vocab: Optional[int] = None) -> int:
    """Fill ``corpus`` from ``path``: the documents it held (newest kept when
    the corpus is smaller). Raises on anything that does not check out."""
    data = _read(path, 4 * corpus.cap + (1 << 20))
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        head = json.loads(bytes(z["header"]).decode())
        toks = z["tokens"]
    if head.get("format") != FORMAT or head.get("fingerprint") != fp:
        raise ValueError("another format or model")
    if toks.dtype != np.int32 or toks.ndim != 1:
        raise ValueError("tokens are not a 1-d int32 array")
    if hashlib.sha256(toks.tobytes()).hexdigest() != head.get("sha256"):
        raise ValueError("checksum mismatch")
    SEP = corpus.SEP
    real = toks[toks != SEP]
    if len(real) and (real.min() < 0 or (vocab is not None and real.max() >= vocab)):
        raise ValueError("token ids out of range")
    toks = toks[-corpus.cap :]
    cuts = np.flatnonzero(toks == SEP)
    docs = [d for d in np.split(toks, cuts) if len(d)]
    for d in docs:
        corpus.add(d[1:] if d[0] == SEP else d)
    return len(docs)


def save(path: Path, fp: str, corpus: Any) -> None:
    toks = corpus.tokens_in_order()
    head = {
        "format": FORMAT,
        "fingerprint": fp,
        "cap": corpus.cap,
        "sha256": hashlib.sha256(toks.tobytes()).hexdigest(),
    }
    buf = io.BytesIO()
    np.savez(buf, tokens=toks, header=np.frombuffer(json.dumps(head).encode(), np.uint8))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{NAME}.{os.getpid()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(tmp, flags, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(buf.getvalue())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Store:
    """Where one corpus lives on disk, and when it is saved next."""

    def __init__(self, corpus: Any, path: Path, fp: str):
        self.corpus, self.path, self.fp = weakref.ref(corpus), path, fp
        self.saved_at, self.saved_end, self.failed = time.monotonic(), corpus.end, False

    def save(self, force: bool = False) -> None:
        corpus = self.corpus()
        if corpus is None or self.failed or corpus.end == self.saved_end:
            return
        if not force and time.monotonic() - self.saved_at < SAVE_SECONDS:
            return
        try:
            save(self.path, self.fp, corpus)
        except OSError as e:
            self.failed = True
            log.warning(f"spec-decode: cannot save the suffix corpus to {self.path}: {e}")
            return
        self.saved_at, self.saved_end = time.monotonic(), corpus.end


def attach(corpus: Any, root: Any, model: Any, tok_key: Any) -> Store:
    """Load ``corpus`` from ``root`` (if a stored one checks out) and keep it saved there."""
    fp = fingerprint(model, tok_key)
    path = path_for(root, fp)
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    if path.exists() or path.is_symlink():
        t0 = time.perf_counter()
        try:
            docs = load(path, fp, corpus, vocab)
            log.info(
                f"spec-decode: suffix corpus loaded from {path}: {docs} documents, "
                f"{len(corpus)} tokens in {time.perf_counter() - t0:.2f} s"
            )
        except Exception as e:  # any damage: start empty, the next save replaces it
            corpus.reset()
            log.warning(f"spec-decode: ignoring the stored suffix corpus {path}: {e}")
    store = Store(corpus, path, fp)
    corpus.after_add = store.save
    atexit.register(store.save, True)
    return store
