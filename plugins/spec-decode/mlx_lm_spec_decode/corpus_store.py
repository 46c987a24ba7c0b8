"""The suffix corpus on disk, so that a restarted server keeps what it learnt.

``--suffix-corpus-dir DIR`` keeps each model's corpus in
``DIR/<fingerprint>/suffix-corpus.npz``, ssd-cache's layout (one folder per
model fingerprint, a ``CACHEDIR.TAG`` in ``DIR``):

- the fingerprint (``fingerprint``): sha256 over the tokenizer's vocabulary
  fingerprint and, for every parameter of the loaded model, its name, shape,
  dtype and first values. Another model, fine-tune or tokenizer gets another
  folder, so corpora are never shared between them;
- the file: numpy's npz, read without pickles: the corpus tokens oldest
  first (a separator before each document) and a header (format,
  fingerprint, capacity, sha256 of the tokens). It is read with a size
  bound; a file that does not check out is ignored with one warning, and
  the next save replaces it;
- every file operation goes through ``mlx_lm_ext.safefs``, as ssd-cache's
  do: ``DIR`` must be tagged (or new, or hold only corpus folders), the
  fingerprint folder and the file are opened relative to it without
  following a link, and a save writes a locked temp file and renames it over
  the old one (a crash leaves one or the other). A folder that is a link,
  or a ``DIR`` that is not safely ours, is one warning: the corpus then
  stays in memory only;
- when: after a request ends once ``SAVE_SECONDS`` have passed since the
  last save, when its model is dropped, when the plugin is deactivated, and
  at exit (Ctrl-C; SIGTERM too, which the host turns into the server's
  Ctrl-C path). Until then this module holds the corpus: the drafter's own
  reference goes with the model, which the server drops before exit
  handlers run. Only the tokens are stored (4 bytes each); loading indexes
  them again.
"""

import atexit
import hashlib
import io
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_lm_ext import safefs

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


def _read(root: Any, fp: str, limit: int) -> Optional[bytes]:
    """The stored file's bytes (None: there is none), at most ``limit`` of them,
    no link followed at any level."""
    try:
        with safefs.open_folder(root, fp, safefs.CORPUS) as dfd:
            fd = safefs.open_file(dfd, NAME)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    return data


def load(data: bytes, fp: str, corpus: Any, vocab: Optional[int] = None) -> int:
    """Fill ``corpus`` from a stored file's bytes: the documents it held (newest
    kept when the corpus is smaller). Raises on anything that does not check out."""
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


def encode(fp: str, corpus: Any) -> bytes:
    """The file's bytes for ``corpus``."""
    toks = corpus.tokens_in_order()
    head = {
        "format": FORMAT,
        "fingerprint": fp,
        "cap": corpus.cap,
        "sha256": hashlib.sha256(toks.tobytes()).hexdigest(),
    }
    buf = io.BytesIO()
    np.savez(buf, tokens=toks, header=np.frombuffer(json.dumps(head).encode(), np.uint8))
    return buf.getvalue()


def save(root: Any, fp: str, corpus: Any) -> None:
    """Write ``corpus`` to ``root/fp/NAME``. ``OSError``, or ``safefs.NotACache``
    for a root or folder that is not safely ours (a link, foreign files)."""
    data = encode(fp, corpus)
    safefs.make_folder(root, fp, safefs.CORPUS)
    with safefs.open_folder(root, fp, safefs.CORPUS) as dfd:
        safefs.write_file(dfd, NAME, data)


class Store:
    """Where one corpus lives on disk, and when it is saved next."""

    def __init__(self, corpus: Any, root: Any, fp: str):
        self.corpus, self.root, self.fp = corpus, str(Path(root).expanduser()), fp
        self.path = path_for(root, fp)
        self.saved_at, self.saved_end, self.failed = time.monotonic(), corpus.end, False
        self.lock = threading.Lock()

    def save(self, force: bool = False) -> None:
        with self.lock:
            if self.failed or self.corpus.end == self.saved_end:
                return
            if not force and time.monotonic() - self.saved_at < SAVE_SECONDS:
                return
            try:
                save(self.root, self.fp, self.corpus)
            except (OSError, safefs.NotACache) as e:
                self.refuse(e)
                return
            self.saved_at, self.saved_end = time.monotonic(), self.corpus.end

    def refuse(self, e: Exception) -> None:
        """Stop saving, with the one warning."""
        self.failed = True
        log.warning(
            f"spec-decode: cannot keep the suffix corpus in {self.path} ({e}); "
            "it stays in memory only"
        )


# Corpora with a store, kept (and saved at exit) until detached: id -> store.
_STORES: Dict[int, Store] = {}
_STORES_LOCK = threading.Lock()


def attach(corpus: Any, root: Any, model: Any, tok_key: Any) -> Store:
    """Load ``corpus`` from ``root`` (if a stored one checks out) and keep it saved there."""
    fp = fingerprint(model, tok_key)
    store = Store(corpus, root, fp)
    try:
        safefs.make_folder(store.root, fp, safefs.CORPUS)
    except (OSError, safefs.NotACache) as e:
        store.refuse(e)
    else:
        _load_stored(store, getattr(getattr(model, "args", None), "vocab_size", None))
    corpus.after_add = store.save
    with _STORES_LOCK:
        _STORES[id(corpus)] = store
    return store


def _load_stored(store, vocab):
    corpus, t0 = store.corpus, time.perf_counter()
    try:
        data = _read(store.root, store.fp, 4 * corpus.cap + (1 << 20))
        if data is None:
            return
        docs = load(data, store.fp, corpus, vocab)
        log.info(
            f"spec-decode: suffix corpus loaded from {store.path}: {docs} documents, "
            f"{len(corpus)} tokens in {time.perf_counter() - t0:.2f} s"
        )
    except Exception as e:  # any damage: start empty, the next save replaces it
        corpus.reset()
        log.warning(f"spec-decode: ignoring the stored suffix corpus {store.path}: {e}")
    store.saved_end = corpus.end


def detach(corpus: Any) -> None:
    """Save ``corpus`` now and stop keeping it (its model was dropped)."""
    with _STORES_LOCK:
        store = _STORES.pop(id(corpus), None)
    if store is not None:
        store.save(True)


def flush(forget: bool = False) -> None:
    """Save every kept corpus that changed (at exit; ``forget``: and drop them,
    as deactivating the plugin does)."""
    with _STORES_LOCK:
        stores = list(_STORES.values())
        if forget:
            _STORES.clear()
    for store in stores:
        store.save(True)


atexit.register(flush)
