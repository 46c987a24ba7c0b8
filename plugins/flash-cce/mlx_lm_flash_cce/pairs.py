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
response_lens [2B], refs)``, the B chosen responses then the B
rejected ones, right-padded (``padded``: to a multiple of 8 up to 128
tokens, then of an eighth of the length's power of two, so at most 1/8
padding and few distinct shapes for the compiled step). ``refs`` is
``[B, 2]``, the reference log-probs, where every pair of the batch has
them, else ``[B, 3]``: zeros and each pair's ``index`` (a step that
computes them hands them back by it; the shapes differ, so the compiled
step traces each case apart).

A row may also carry ``system`` (a string): the system message in front of
a prompt of messages, or, with ``--apply-chat-template``, of a string prompt
that the template renders as the user's message (the responses then the
assistant's), as TRL does for conversational data.
"""

import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from mlx_lm_ext.api import PluginError

log = logging.getLogger("mlx_lm_flash_cce")

KEYS = ("prompt", "chosen", "rejected")
SPLITS = ("train", "valid", "test")
PAD_MIN = 8


class Pair:
    """One tokenized preference pair; ``ref`` is DPO's ``(chosen, rejected)`` reference."""

    __slots__ = ("prompt", "chosen", "rejected", "ref", "index")

    def __init__(self, prompt: List[int], chosen: List[int], rejected: List[int]):
        self.prompt, self.chosen, self.rejected = prompt, chosen, rejected
        self.ref: Optional[Tuple[float, float]] = None
        self.index = -1  # its number among the run's pairs (``preference.keep_reference``)

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


def _shape_error(row):
    got = sorted(row) if isinstance(row, dict) else type(row).__name__
    return (
        "not a preference row: needs 'prompt', 'chosen' and 'rejected' as strings, "
        f"or a prompt of chat messages (got {got})"
    )


def _messages(key, value):
    """``value`` as chat messages, or ``ValueError`` naming what is wrong in ``key``."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"'{key}' must be a string or a non-empty list of chat messages")
    for i, m in enumerate(value, 1):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"'{key}' message {i} is not a chat message {{role, content}}")
        for field in ("role", "content"):
            if not isinstance(m[field], str):
                raise ValueError(
                    f"'{key}' message {i}: '{field}' must be a string "
                    f"(got {type(m[field]).__name__})"
                )
    return value


def _template(tokenizer, messages, **kw):
    try:
        return list(tokenizer.apply_chat_template(messages, return_dict=False, **kw))
    except Exception as e:  # jinja raises anything: TemplateError, TypeError, KeyError
        raise ValueError(f"the chat template fails on this row ({type(e).__name__}: {e})") from None


def _encode(tokenizer, text, **kw):
    try:
        return list(tokenizer.encode(text, **kw))
    except Exception as e:
        raise ValueError(f"the tokenizer fails on this row ({type(e).__name__}: {e})") from None


def _with_system(row, prompt):
    """The prompt's messages with the row's ``system`` field, if any, in front."""
    system = row.get("system")
    if system is None:
        return prompt
    if not isinstance(system, str):
        raise ValueError(f"'system' must be a string (got {type(system).__name__})")
    if prompt[0]["role"] == "system":
        raise ValueError("the row has a 'system' field and its prompt a system message")
    return [{"role": "system", "content": system}] + prompt


def _plain(row, tokenizer):
    ids = _encode(tokenizer, row["prompt"])
    eos = tokenizer.eos_token_id
    out = [ids]
    for key in ("chosen", "rejected"):
        if not row[key].strip():
            raise ValueError(f"'{key}' is empty")
        resp = _encode(tokenizer, row[key], add_special_tokens=False)
        out.append(resp + [eos] if eos is not None else resp)
    return out


def _chat(row, prompt, tokenizer):
    prompt = _with_system(row, _messages("prompt", prompt))
    ids = _template(tokenizer, prompt, add_generation_prompt=True)
    out = [ids]
    for key in ("chosen", "rejected"):
        resp = row[key]
        if isinstance(resp, str):
            if not resp.strip():
                raise ValueError(f"'{key}' is empty")
            resp = [{"role": "assistant", "content": resp}]
        full = _template(tokenizer, prompt + _messages(key, resp))
        if full[: len(ids)] != ids:
            raise ValueError(
                f"the chat template does not continue the prompt with '{key}' "
                "(its rendering of prompt + response does not start with the prompt's)"
            )
        out.append(full[len(ids) :])
    return out


def render(
    row: Any, tokenizer: Any, chat_template: bool = False
) -> Tuple[List[int], List[int], List[int]]:
    """``(prompt, chosen, rejected)`` token ids of one row; ``ValueError`` says what is wrong.

    A string prompt is encoded as it is, unless ``chat_template``
    (``--apply-chat-template``): then it is the user's message, the responses
    the assistant's, and ``system`` the system message, rendered with the
    tokenizer's chat template as a prompt of messages is.
    """
    if not isinstance(row, dict) or any(k not in row for k in KEYS):
        raise ValueError(_shape_error(row))
    prompt = row["prompt"]
    if isinstance(prompt, str):
        if not all(isinstance(row[k], str) for k in ("chosen", "rejected")):
            raise ValueError("with a string prompt, 'chosen' and 'rejected' must be strings")
        if chat_template:
            out = _chat(row, [{"role": "user", "content": prompt}], tokenizer)
        elif row.get("system") is not None:
            raise ValueError(
                "a 'system' field needs a prompt of chat messages or --apply-chat-template"
            )
        else:
            out = _plain(row, tokenizer)
    elif isinstance(prompt, list):
        out = _chat(row, prompt, tokenizer)
    else:
        raise ValueError(_shape_error(row))
    for key, toks in zip(KEYS, out, strict=True):
        if not toks:
            raise ValueError(f"'{key}' is empty after tokenization")
    return tuple(out)


def _row(raw: bytes) -> Any:
    """One JSONL line's row; ``ValueError`` says what is wrong, in one level."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"column {e.start + 1}: not UTF-8 text (byte 0x{raw[e.start]:02x})"
        ) from None
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:  # its own "line 1 column N" would nest a second line
        raise ValueError(f"column {e.colno}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise ValueError("not valid JSON (nested too deeply)") from None


def _lines(path: Path) -> Iterator[Tuple[int, bytes]]:
    try:
        with open(path, "rb") as f:
            yield from enumerate(f, 1)
    except OSError as e:
        raise PluginError(f"{path}: cannot read ({e.strerror or e})") from None


def load_split(
    path: Path, tokenizer: Any, max_seq_length: int, chat_template: bool = False
) -> PairDataset:
    """Read, check and tokenize one JSONL file; rows that cannot fit are dropped (logged)."""
    pairs, dropped, cut = [], 0, 0
    for lineno, raw in _lines(path):
        if not raw.strip():
            continue
        try:
            prompt, chosen, rejected = render(_row(raw), tokenizer, chat_template)
        except ValueError as e:
            where = f"{path.name} line {lineno}"
            text = str(e)
            sep = ", " if text.startswith("column ") else ": "
            raise PluginError(f"{where}{sep}{text}") from None
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
    chat = bool(getattr(args, "apply_chat_template", False))
    if chat and not getattr(tokenizer, "chat_template", None):
        raise PluginError("--apply-chat-template: this model's tokenizer has no chat template")
    sets = []
    for name in SPLITS:
        path = folder / f"{name}.jsonl"
        sets.append(
            load_split(path, tokenizer, args.max_seq_length, chat)
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


def read_by(args: Any, sets: Sequence[PairDataset]) -> List[PairDataset]:
    """The splits of ``(train, valid, test)`` this run reads: train and valid for
    ``--train`` (valid unless ``--val-batches 0``), test for ``--test``."""
    train, valid, test = sets
    out = []
    if getattr(args, "train", False):
        out.append(train)
        if getattr(args, "val_batches", -1) != 0:
            out.append(valid)
    if getattr(args, "test", False) and getattr(args, "test_batches", -1) != 0:
        out.append(test)
    return out


def padded(n: int) -> int:
    """``n`` rounded up to a multiple of ``max(PAD_MIN, 2**floor(log2 n) / 8)``."""
    step = max(PAD_MIN, (1 << max(n.bit_length() - 1, 0)) >> 3)
    return step * ((n + step - 1) // step)


def collate(pairs: Sequence[Pair]) -> Tuple[mx.array, ...]:
    """One batch of pairs as arrays (see the module docstring)."""
    b = len(pairs)
    p = padded(max(len(x.prompt) for x in pairs))
    responses = [x.chosen for x in pairs] + [x.rejected for x in pairs]
    r = padded(max(len(x) for x in responses))
    prompts = np.zeros((b, p), np.int32)
    resp = np.zeros((2 * b, r), np.int32)
    for i, x in enumerate(pairs):
        prompts[i, : len(x.prompt)] = x.prompt
    for i, x in enumerate(responses):
        resp[i, : len(x)] = x
    if all(x.ref is not None for x in pairs):
        refs = np.array([x.ref for x in pairs], np.float32)
    else:
        refs = np.array([(0.0, 0.0, x.index) for x in pairs], np.float32)
    return (
        mx.array(prompts),
        mx.array([len(x.prompt) for x in pairs], mx.int32),
        mx.array(resp),
        mx.array([len(x) for x in responses], mx.int32),
        mx.array(refs),
    )


def unread(batch: Tuple[mx.array, ...]) -> Tuple[mx.array, ...]:
    """``batch`` as the step that first reads its pairs gets it: their reference
    log-probs unknown (``refs`` ``[B, 3]``: zeros and the index -1, no pair's, so
    what the step computes is kept for none), so the step computes them."""
    b = batch[0].shape[0]
    return (*batch[:4], mx.concatenate([mx.zeros((b, 2)), -mx.ones((b, 1))], axis=1))


def iterate_batches(
    dataset: Any,
    batch_size: int,
    max_seq_length: int,
    loop: bool = False,
    seed: Optional[int] = None,
    comm_group: Any = None,
    harvest: Optional[Callable[[], Any]] = None,
) -> Iterator[Tuple[mx.array, ...]]:
    """mlx-lm's ``iterate_batches`` for pairs: sorted by length, shuffled batches,
    a rank's share of each batch under data parallelism. Lengths were fitted
    to ``max_seq_length`` when the rows were loaded. ``harvest()`` runs before
    each batch is made: the last step's reference log-probs reach their pairs
    (``preference.keep_reference``), so a batch read again carries them."""
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
            if harvest is not None:
                harvest()
            yield collate([dataset[j] for j in batches[i]])
        if not loop:
            break
