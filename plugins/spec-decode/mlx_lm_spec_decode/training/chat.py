"""Chat data: prompts made from passages of the training text, and the
target's own greedy answers to them, so the drafter learns the register of
open chat (the target's answers are what it will be asked to draft).
"""

import logging
import random
import re
import sys
import time
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from .. import target as target_mod

log = logging.getLogger("mlx_lm_spec_decode")


# Chat prompts: tasks on passages of the data, and open-ended requests
# (stories, letters, advice, explanations) on a word from it, so that the
# answers cover the register of open chat, not only talk about code.
TEMPLATES = [
    "Explain what the following code does:\n\n{passage}",
    "Summarize the following text in a few sentences:\n\n{passage}",
    "Continue this text:\n\n{passage}",
    "Write a short paragraph about {word}.",
    "What is {word}? Explain it simply.",
    "Give me three tips about {word}.",
    "Write a short story that mentions {word}.",
    "Describe {word} to a beginner.",
    "Write a letter to a friend about {word}.",
    "Write a short poem about {word}.",
    "I want to learn about {word}. Where should I start, and why?",
    "Explain {word} to a ten-year-old.",
    "Write an email to a colleague about {word}.",
    "What are the pros and cons of {word}?",
    "Write a dialogue between two friends who disagree about {word}.",
    "Tell me a story about a {word} that changed someone's life.",
]
# Part of what makes the generated data: a change here remakes it.
PROMPTS_VERSION = 3  # 3: answer masks saved with the chats


def chat_prompts(tokenizer, tokens: np.ndarray, n: int, seed: int) -> list[list[int]]:
    """``n`` chat prompts (token lists) built from passages of the data."""
    rng = random.Random(seed)
    prompts = []
    tries = 0
    while len(prompts) < n and tries < 20 * n:
        tries += 1
        start = rng.randrange(0, max(1, len(tokens) - 120))
        passage = tokenizer.decode(tokens[start : start + rng.randint(40, 100)].tolist()).strip()
        words = re.findall(r"\b[a-z]{5,12}\b", passage) or re.findall(r"[A-Za-z]{5,14}", passage)
        template = TEMPLATES[len(prompts) % len(TEMPLATES)]
        if "{word}" in template and not words:
            continue
        text = template.format(passage=passage, word=rng.choice(words) if words else "")
        msgs = [{"role": "user", "content": text}]
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        else:
            ids = tokenizer.encode(text)
        prompts.append(list(ids))
    return prompts


def greedy_batch(
    model: nn.Module,
    split: tuple,
    prompts: list[list[int]],
    max_tokens: int,
    stop_ids: set[int],
    prefill_step: int = 256,
) -> list[list[int]]:
    """The target's greedy answers to ``prompts`` (token lists), cut before
    the first stop token: all prompts at once, left-padded in mlx-lm's batch
    caches, one forward per token for the whole batch. (mlx-lm's
    ``batch_generate`` does Python work per sequence and token, which bounds
    it on a GPU at ~10 answers/s for this use.)"""
    backbone, head = split
    B, L = len(prompts), max(len(p) for p in prompts)
    pads = [L - len(p) for p in prompts]
    x = mx.array([[0] * n + list(p) for p, n in zip(prompts, pads, strict=True)], mx.uint32)
    cache = [
        type(cs[0]).merge(list(cs))
        for cs in zip(*(make_prompt_cache(model) for _ in range(B)), strict=True)
    ]
    for c in cache:
        c.prepare(left_padding=pads)
    for s in range(0, L, prefill_step):
        h = backbone(x[:, s : s + prefill_step], cache)
        mx.eval(h, [c.keys for c in cache])
    stops = mx.array(sorted(stop_ids), mx.uint32)
    y = mx.argmax(head(h[:, -1:]), axis=-1)  # [B, 1]
    done = (y == stops).any(-1)
    toks = [y]
    for i in range(1, max_tokens):
        y = mx.argmax(head(backbone(y, cache)), axis=-1)
        done = done | (y == stops).any(-1)
        toks.append(y)
        mx.async_eval(y, done)
        if i % 16 == 0 and done.all().item():
            break
    answers = []
    for row in mx.concatenate(toks, axis=1).tolist():
        answers.append(row[: next((j for j, t in enumerate(row) if t in stop_ids), len(row))])
    return answers


def generate_chat(
    model: nn.Module,
    tokenizer,
    prompts: list[list[int]],
    max_tokens: int,
    batch_size: int = 64,
    progress: bool = True,
    time_limit: Optional[float] = None,
) -> list[list[int]]:
    """The target's greedy answers, as ``prompt + answer + EOS`` token lists
    (fewer than asked where ``time_limit`` seconds ran out)."""
    from mlx_lm.generate import batch_generate
    from tqdm import tqdm

    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    stop_ids = set(getattr(tokenizer, "eos_token_ids", None) or [eos])
    split = target_mod.split(model)
    out = []
    bar = tqdm(
        total=len(prompts),
        desc="generating",
        unit=" answers",
        disable=not progress,
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    for s in range(0, len(prompts), batch_size):
        if time_limit and s and time.perf_counter() - t0 >= time_limit:
            log.warning(f"--generate-time-limit {time_limit:g}s: {s} of {len(prompts)} answers")
            break
        part = prompts[s : s + batch_size]
        answers = None
        if split is not None:
            try:
                answers = greedy_batch(model, split, part, max_tokens, stop_ids)
            except Exception as e:  # a cache type without batch support: mlx-lm's generator
                log.warning(
                    f"train-drafter: batched greedy generation failed ({e}); "
                    "using mlx-lm's batch_generate"
                )
                split = None
        if answers is None:
            r = batch_generate(
                model,
                tokenizer,
                part,
                max_tokens=max_tokens,
                return_token_ids=True,
                completion_batch_size=len(part),
                prefill_batch_size=min(len(part), 16),
            )
            answers = r.token_ids
        for p, ids in zip(part, answers, strict=False):
            out.append(p + list(ids) + [eos])
        bar.update(len(part))
    bar.close()
    return out


def answer_mask(prompts: list[list[int]], seqs: list[list[int]]) -> np.ndarray:
    """1 where a token belongs to an answer (its EOS included): what drafting predicts."""
    return np.concatenate(
        [
            np.asarray([0] * len(p) + [1] * (len(s) - len(p)), np.uint8)
            for p, s in zip(prompts, seqs, strict=False)  # fewer answers after a time limit
        ]
    )
