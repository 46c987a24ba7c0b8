"""Preference data for ``mlx_lm.lora --loss orpo|dpo``: rows, pairs, batches.

A row is ``{"prompt", "chosen", "rejected"}`` (TRL's preference format):
three strings, or a prompt that is a list of chat messages with responses
that are lists of (assistant) messages or strings, rendered with the
model's chat template. Rows are read from mlx-lm's ``--data`` folder
(``train.jsonl``, ``valid.jsonl``, ``test.jsonl``) and tokenized when loaded,
so a bad row stops the run at once with its file and line.

Lengths: a pair's prompt plus either response fits ``--max-seq-length``.
Responses are cut to fit; a row whose prompt alone leaves no room is dropped.
Both are counted and logged per file, never done silently.

Batches go by pairs: ``(prompts [B, P], prompt_lens [B], responses [2B, R],
response_lens [2B], refs [B, 2])``, the B chosen responses then the B
rejected ones, right-padded to a multiple of ``PAD_TO`` (few distinct shapes
for the compiled step); ``refs`` holds DPO's reference log-probs (zeros
until computed).
"""

import json
import logging
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from mlx_lm_ext import PluginError

log = logging.getLogger("mlx_lm_flash_cce")

KEYS = ("prompt", "chosen", "rejected")
SPLITS = ("train", "valid", "test")
PAD_TO = 32


class Pair:
    """One tokenized preference pair; ``ref`` is DPO's ``(chosen, rejected)`` reference."""

    __slots__ = ("prompt", "chosen", "rejected", "ref")

    def __init__(self, prompt: List[int], chosen: List[int], rejected: List[int]):
        self.prompt, self.chosen, self.rejected = prompt, chosen, rejected
        self.ref: Optional[Tuple[float, float]] = None

    def __len__(self) -> int:
        return len(self.prompt) + len(self.chosen) + len(self.rejected)


class PairDataset:
    """A split of pairs, already tokenized (``process`` is the identity for mlx-lm's
    ``CacheDataset``, which wraps every split)."""

    def __init__(self, pairs: List[Pair], name: str):
        self.pairs, self.name = pairs, name

    def __getitem__(self, idx: int) -> Pair:
        return self.pairs[idx]

    def __len__(self) -> int:
        return len(self.pairs)

    def process(self, pair: Pair) -> Pair:
        return pair


def _is_messages(value):
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def _shape_error(row):
    got = sorted(row) if isinstance(row, dict) else type(row).__name__
    return (
        "not a preference row: needs 'prompt', 'chosen' and 'rejected' as strings, "
        f"or a prompt of chat messages (got {got})"
    )


def _template(tokenizer, messages, **kw):
    return list(tokenizer.apply_chat_template(messages, return_dict=False, **kw))


def render(row: Any, tokenizer: Any) -> Tuple[List[int], List[int], List[int]]:
    """``(prompt, chosen, rejected)`` token ids of one row; ``ValueError`` says what is wrong."""
    if not isinstance(row, dict) or any(k not in row for k in KEYS):
        raise ValueError(_shape_error(row))
    prompt = row["prompt"]
    if isinstance(prompt, str):
        if not all(isinstance(row[k], str) for k in ("chosen", "rejected")):
            raise ValueError("with a string prompt, 'chosen' and 'rejected' must be strings")
        ids = list(tokenizer.encode(prompt))
        eos = tokenizer.eos_token_id
        out = [ids]
        for key in ("chosen", "rejected"):
            if not row[key].strip():
                raise ValueError(f"'{key}' is empty")
            resp = list(tokenizer.encode(row[key], add_special_tokens=False))
            out.append(resp + [eos] if eos is not None else resp)
    elif _is_messages(prompt):
        ids = _template(tokenizer, prompt, add_generation_prompt=True)
        out = [ids]
        for key in ("chosen", "rejected"):
            resp = row[key]
            if isinstance(resp, str):
                resp = [{"role": "assistant", "content": resp}]
            if not _is_messages(resp):
                raise ValueError(f"'{key}' must be a string or a list of chat messages")
            full = _template(tokenizer, prompt + resp)
            if full[: len(ids)] != ids:
                raise ValueError(
                    f"the chat template does not continue the prompt with '{key}' "
                    "(its rendering of prompt + response does not start with the prompt's)"
                )
            out.append(full[len(ids) :])
    else:
        raise ValueError(_shape_error(row))
    for key, toks in zip(KEYS, out, strict=True):
        if not toks:
            raise ValueError(f"'{key}' is empty after tokenization")
    return tuple(out)


def load_split(path: Path, tokenizer: Any, max_seq_length: int) -> PairDataset:
    """Read, check and tokenize one JSONL file; rows that cannot fit are dropped (logged)."""
    pairs, dropped, cut = [], 0, 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt, chosen, rejected = render(row, tokenizer)
            except (json.JSONDecodeError, ValueError) as e:
                raise PluginError(f"{path.name} line {lineno}: {e}") from None
            room = max_seq_length - len(prompt)
            if room < 1:
                dropped += 1
                continue
            if len(chosen) > room or len(rejected) > room:
                cut += 1
            pairs.append(Pair(prompt, chosen[:room], rejected[:room]))
    if dropped:
        log.warning(
            "%s: dropped %d of %d rows whose prompt alone reaches --max-seq-length %d",
            path.name,
            dropped,
            dropped + len(pairs),
            max_seq_length,
        )
    if cut:
        log.warning(
            "%s: cut the responses of %d rows to fit --max-seq-length %d",
            path.name,
            cut,
            max_seq_length,
        )
    return PairDataset(pairs, path.name)


def load(args: Any, tokenizer: Any) -> Tuple[PairDataset, PairDataset, PairDataset]:
    """``(train, valid, test)`` from the ``--data`` folder, with mlx-lm's checks."""
    folder = Path(str(args.data))
    if getattr(args, "hf_dataset", None) or not folder.is_dir():
        raise PluginError(
            f"--data {args.data}: preference training reads a local folder with "
            "train.jsonl, valid.jsonl and test.jsonl ({prompt, chosen, rejected} rows)"
        )
    sets = []
    for name in SPLITS:
        path = folder / f"{name}.jsonl"
        sets.append(
            load_split(path, tokenizer, args.max_seq_length)
            if path.exists()
            else PairDataset([], path.name)
        )
    train, valid, test = sets
    if args.train and len(train) == 0:
        raise PluginError(f"{folder / 'train.jsonl'}: no preference pairs to train on")
    if args.train and len(valid) == 0:
        log.warning("valid.jsonl: no pairs; training will proceed without validation")
    if args.test and len(test) == 0:
        raise PluginError(f"{folder / 'test.jsonl'}: no preference pairs to test on")
    log.info("preference pairs: %d train, %d valid, %d test", len(train), len(valid), len(test))
    return train, valid, test


def _padded(n):
    return PAD_TO * ((n + PAD_TO - 1) // PAD_TO)


def collate(pairs: Sequence[Pair]) -> Tuple[mx.array, ...]:
    """One batch of pairs as arrays (see the module docstring)."""
    b = len(pairs)
    p = _padded(max(len(x.prompt) for x in pairs))
    responses = [x.chosen for x in pairs] + [x.rejected for x in pairs]
    r = _padded(max(len(x) for x in responses))
    prompts = np.zeros((b, p), np.int32)
    resp = np.zeros((2 * b, r), np.int32)
    for i, x in enumerate(pairs):
        prompts[i, : len(x.prompt)] = x.prompt
    for i, x in enumerate(responses):
        resp[i, : len(x)] = x
    refs = np.array([x.ref if x.ref is not None else (0.0, 0.0) for x in pairs], np.float32)
    return (
        mx.array(prompts),
        mx.array([len(x.prompt) for x in pairs], mx.int32),
        mx.array(resp),
        mx.array([len(x) for x in responses], mx.int32),
        mx.array(refs),
    )


def iterate_batches(
    dataset: Any,
    batch_size: int,
    max_seq_length: int,
    loop: bool = False,
    seed: Optional[int] = None,
    comm_group: Any = None,
) -> Iterator[Tuple[mx.array, ...]]:
    """mlx-lm's ``iterate_batches`` for pairs: sorted by length, shuffled batches,
    a rank's share of each batch under data parallelism. Lengths were fitted
    to ``max_seq_length`` when the rows were loaded."""
    if len(dataset) < batch_size:
        raise ValueError(
            f"Dataset must have at least batch_size={batch_size} pairs but only has {len(dataset)}."
        )
    offset, step = (comm_group.rank(), comm_group.size()) if comm_group is not None else (0, 1)
    if batch_size % step != 0:
        raise ValueError("The batch size must be divisible by the number of workers")
    idx = sorted(range(len(dataset)), key=lambda i: len(dataset[i]))
    batches = [
        idx[i + offset : i + offset + batch_size : step]
        for i in range(0, len(idx) - batch_size + 1, batch_size)
    ]
    if seed is not None:
        np.random.seed(seed)
    while True:
        for i in np.random.permutation(len(batches)):
            yield collate([dataset[j] for j in batches[i]])
        if not loop:
            break
