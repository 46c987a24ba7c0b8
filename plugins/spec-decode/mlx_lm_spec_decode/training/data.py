"""Training data: text files as one token stream, cut into rows, served in
seeded batches; the tokenized data saved once per output folder.

Rows are ``--seq-len`` tokens. Text rows weigh 1 at every position; chat
rows (``chat``) weigh 1 only where the next token belongs to an answer, the
only tokens a drafter ever drafts.
"""

import fnmatch
import json
import os
import sys
from argparse import Namespace
from pathlib import Path
from typing import Callable, Iterator, Optional

import mlx.core as mx
import numpy as np

from . import TrainError

DEFAULT_PATTERNS = "*.py,*.txt,*.md,*.rst"
DATA_FILE = "data.safetensors"
# The flags the saved data depends on: a change in any remakes it.
DATA_KEYS = (
    "data",
    "patterns",
    "max_data_tokens",
    "generate",
    "generate_tokens",
    "generate_time_limit",
    "seed",
)
TOKENIZE_FILES = 64  # files tokenized per call of the (batched) tokenizer

Batches = Callable[[int], tuple[mx.array, mx.array]]


# ------------------------------------------------------------------ corpus


def iter_files(path: Path, patterns: str) -> Iterator[Path]:
    path = Path(path)
    if path.is_file():
        yield path
        return
    if not path.is_dir():
        raise TrainError(f"--data {path}: no such file or directory")
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for f in sorted(files):
            if any(fnmatch.fnmatch(f, p) for p in pats):
                yield Path(root) / f


def _read_text(f):
    """The file's text, or None for binary, unreadable or empty files."""
    try:
        text = f.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    if not text.strip() or "\x00" in text:
        return None
    return text


def _tokenize(hf, texts, eos):
    """One uint32 array per text, each ending in ``eos``."""
    ids = hf(texts, add_special_tokens=False)["input_ids"]
    return [np.asarray(seq + [eos], dtype=np.uint32) for seq in ids]


def read_corpus(
    tokenizer,
    path: Path,
    patterns: str = DEFAULT_PATTERNS,
    max_tokens: Optional[int] = None,
    progress: bool = True,
) -> tuple[np.ndarray, int]:
    """The data as one token stream, documents separated by EOS, and the
    number of files read."""
    from tqdm import tqdm

    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    if hasattr(hf, "model_max_length"):
        hf.model_max_length = 1 << 40  # whole files are tokenized, then cut into --seq-len rows
    out, batch, files = [], [], 0
    bar = tqdm(desc="tokenizing", unit=" files", disable=not progress, file=sys.stderr)
    for f in iter_files(path, patterns):
        text = _read_text(f)
        if text is None:
            continue
        batch.append(text)
        files += 1
        bar.update(1)
        if len(batch) >= TOKENIZE_FILES:
            out += _tokenize(hf, batch, eos)
            batch = []
            if max_tokens and sum(map(len, out)) >= max_tokens:
                break
    if batch:
        out += _tokenize(hf, batch, eos)
    bar.close()
    if not out:
        raise TrainError(f"--data {path}: no readable text files matching {patterns!r}")
    tokens = np.concatenate(out)
    if max_tokens:
        tokens = tokens[:max_tokens]
    return tokens, files


# -------------------------------------------------------------------- rows


def chunk(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    n = len(tokens) // seq_len
    if n == 0:
        raise TrainError(
            f"the data has {len(tokens)} tokens, fewer than one --seq-len {seq_len} sequence"
        )
    return tokens[: n * seq_len].reshape(n, seq_len)


def batch_rows(n_rows: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """Row indices of batch ``step``: epochs of seeded permutations, so a
    resumed run sees exactly the batches the uninterrupted run would."""
    per_epoch = max(1, n_rows // batch_size)
    epoch, i = divmod(step, per_epoch)
    perm = np.random.default_rng(seed + epoch).permutation(n_rows)
    return perm[i * batch_size : (i + 1) * batch_size]


def held_out(rows: np.ndarray, n: int) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """The last ``n`` rows (at most a tenth of them) kept out of training."""
    n = min(n, len(rows) // 10)
    return (rows[: len(rows) - n], rows[len(rows) - n :]) if n else (rows, None)


def row_weights(mask: np.ndarray) -> np.ndarray:
    """Per row position: 1 where the next token is an answer token."""
    return np.concatenate([mask[:, 1:], mask[:, -1:]], axis=1).astype(np.float32)


def _chat_rows(chat, chat_mask, seq_len):
    """Chat rows as ``[n, seq_len, 2]``: tokens and answer mask, or None."""
    if chat is None or len(chat) < seq_len:
        return None
    if chat_mask is None:  # data made before answer masks: every token
        chat_mask = np.ones(len(chat), np.uint8)
    return np.stack([chunk(chat, seq_len), chunk(chat_mask, seq_len)], axis=-1)


def make_batches(
    args: Namespace,
    corpus: np.ndarray,
    chat: Optional[np.ndarray],
    chat_mask: Optional[np.ndarray] = None,
) -> tuple[Batches, int, int, dict]:
    """``batch(step) -> (tokens [B, T], weights [B, T])`` for each step, the
    numbers of training rows, and the held-out rows ``{"text": (tokens,
    weights), "chat": ...}`` (where there are enough). Text rows weigh 1
    everywhere; chat rows only where the next token is part of an answer
    (``chat_mask``; prompts, the same system prompt in every chat, are never
    drafted, and would inflate the agreement)."""
    rows, eval_text = held_out(chunk(corpus, args.seq_len), args.eval_rows)
    chat_rows = _chat_rows(chat, chat_mask, args.seq_len)
    eval_chat = None
    if chat_rows is not None:
        chat_rows, eval_chat = held_out(chat_rows, args.eval_rows)
    evals = {}
    if eval_text is not None:
        evals["text"] = (
            mx.array(eval_text.astype(np.uint32)),
            mx.ones(eval_text.shape, mx.float32),
        )
    if eval_chat is not None:
        evals["chat"] = (
            mx.array(eval_chat[..., 0].astype(np.uint32)),
            mx.array(row_weights(eval_chat[..., 1])),
        )
    n_chat = (
        0
        if chat_rows is None
        else min(args.batch_size, round(args.batch_size * args.chat_fraction))
    )
    n_text = args.batch_size - n_chat

    def batch(step):
        toks, weights = [], []
        if n_text:
            t = rows[batch_rows(len(rows), n_text, step, args.seed)]
            toks.append(t)
            weights.append(np.ones(t.shape, np.float32))
        if n_chat:
            c = chat_rows[batch_rows(len(chat_rows), n_chat, step, args.seed + 7919)]
            toks.append(c[..., 0])
            weights.append(row_weights(c[..., 1]))
        return mx.array(np.concatenate(toks).astype(np.uint32)), mx.array(np.concatenate(weights))

    return batch, len(rows), (0 if chat_rows is None else len(chat_rows)), evals


# ------------------------------------------------------------- saved data


def data_signature(args: Namespace, prompts_version: int) -> str:
    """What made the saved data: the prompt templates' version and the flags."""
    return json.dumps(
        {"prompts": prompts_version, **{k: str(getattr(args, k)) for k in DATA_KEYS}},
        sort_keys=True,
    )


def load_data(out: Path, made_by: str, resuming: bool) -> Optional[tuple]:
    """``(corpus, chat, chat_mask)`` saved in ``out``, if a resumed run uses
    it or it was made from the same settings; else None (make it anew)."""
    f = out / DATA_FILE
    if not f.is_file():
        return None
    try:
        d, meta = mx.load(str(f), return_metadata=True)
    except Exception as e:
        if resuming:
            raise TrainError(f"{f} is unreadable ({e}); start over with --restart") from e
        return None
    if not (resuming or meta.get("made_by") == made_by):
        return None  # no checkpoint uses it and it was made from other settings
    chat = np.array(d["chat"]) if "chat" in d else None
    mask = np.array(d["chat_mask"]) if "chat_mask" in d else None
    return np.array(d["corpus"]), chat, mask


def save_data(
    out: Path,
    made_by: str,
    tokens: np.ndarray,
    chat: Optional[np.ndarray],
    mask: Optional[np.ndarray],
) -> None:
    arrays = {"corpus": mx.array(tokens)}
    if chat is not None:
        arrays["chat"] = mx.array(chat)
        arrays["chat_mask"] = mx.array(mask)
    tmp = out / (".tmp." + DATA_FILE)
    mx.save_safetensors(str(tmp), arrays, metadata={"made_by": made_by})
    tmp.replace(out / DATA_FILE)
