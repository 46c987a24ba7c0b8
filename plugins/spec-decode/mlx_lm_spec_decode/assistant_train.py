"""``mlx-lm-ext train-drafter``: train an assistant drafter by self-distillation.

The target model is frozen. For each batch of real text it runs once, with
plain KV caches, giving what the drafter sees at inference time: its final
hidden states, its donor layers' K/V and its next-token distributions. The
drafter (``assistant.Assistant.unrolled``) then drafts ``--draft-steps``
chained tokens from every position at once, each step reading exactly the
donor keys a real draft from that position would read, and learns

- the target's next-token distribution (soft cross-entropy against the
  target's own softmax, i.e. KL up to a constant), and
- the target's final hidden state (smooth L1), which later steps take as
  their input in place of the target's.

Top-1 agreement (drafter argmax equals target argmax) is what greedy
acceptance measures; the progress bar shows it for the first step. The
figure on training batches is in-sample; the last ``--eval-rows`` rows of
the text and of the generated chats are held out and evaluated at every
checkpoint (``eval.jsonl``): held-out agreement on chat answers is what
decoding open-ended answers accepts (prompt tokens, e.g. the system prompt
repeated in every chat, are never drafted: chat rows train and count only
where the next token belongs to an answer). The decode loop computes exactly
the training graph's numbers (``test_loop_drafts_are_the_training_graph``).

Why not the flash-cce loss: distillation needs the target's full
distribution, so the ``[N, V]`` target logits exist anyway, and
``linear_cross_entropy`` computes hard-label cross-entropy only; on the GPU
the stock loss was also measured faster (../shared/docs/mlx-cuda.md). The
logits are bounded by ``--batch-size x --seq-len``.

``--generate N`` adds the target's own greedy answers to N chat prompts made
from the data (explain/summarize/continue a passage, short open questions on
its words), so the drafter also learns the target's chat register.

Output folder: ``assistant.json`` + ``assistant.safetensors`` (the drafter,
usable with ``--drafter assistant --drafter-path OUT`` at every checkpoint),
``data.safetensors`` (the tokenized training data, reused on resume),
``checkpoint/`` (float32 weights, optimizer state, step), ``log.jsonl``
(every step) and ``eval.jsonl`` (held-out agreement at every checkpoint).
Running the same command again resumes from the last checkpoint.
"""

import argparse
import fnmatch
import json
import logging
import math
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.models.cache import KVCache, make_prompt_cache

from . import assistant as A
from . import target as target_mod

log = logging.getLogger("mlx_lm_spec_decode")

DEFAULT_PATTERNS = "*.py,*.txt,*.md,*.rst"
CKPT = "checkpoint"
DATA_FILE = "data.safetensors"
LOG_FILE = "log.jsonl"
EVAL_FILE = "eval.jsonl"
EVAL_NAMES = {"text": "text", "chat": "chat answers"}


class TrainError(RuntimeError):
    """Bad input to train-drafter: the message says what to do."""


# ------------------------------------------------------------------ data


def iter_files(path, patterns):
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


def read_corpus(tokenizer, path, patterns=DEFAULT_PATTERNS, max_tokens=None, progress=True):
    """The data as one token stream, documents separated by EOS."""
    from tqdm import tqdm

    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    if hasattr(hf, "model_max_length"):
        hf.model_max_length = 1 << 40  # whole files are tokenized, then cut into --seq-len rows
    out, total, files = [], 0, 0
    batch = []

    def flush():
        nonlocal total
        if not batch:
            return
        ids = hf(batch, add_special_tokens=False)["input_ids"]
        for seq in ids:
            out.append(np.asarray(seq + [eos], dtype=np.uint32))
            total += len(seq) + 1
        batch.clear()

    bar = tqdm(desc="tokenizing", unit=" files", disable=not progress, file=sys.stderr)
    for f in iter_files(path, patterns):
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary or unreadable: not text data
        if not text.strip() or "\x00" in text:
            continue
        batch.append(text)
        files += 1
        bar.update(1)
        if len(batch) >= 64:
            flush()
            if max_tokens and total >= max_tokens:
                break
    flush()
    bar.close()
    if not out:
        raise TrainError(f"--data {path}: no readable text files matching {patterns!r}")
    tokens = np.concatenate(out)
    if max_tokens:
        tokens = tokens[:max_tokens]
    return tokens, files


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


def chat_prompts(tokenizer, tokens, n, seed):
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


def greedy_batch(model, split, prompts, max_tokens, stop_ids, prefill_step=256):
    """The target's greedy answers to ``prompts`` (token lists), cut before
    the first stop token: all prompts at once, left-padded in mlx-lm's batch
    caches, one forward per token for the whole batch. (mlx-lm's
    ``batch_generate`` does Python work per sequence and token, which bounds
    it on a GPU at ~10 answers/s for this use.)"""
    backbone, head = split
    B, L = len(prompts), max(len(p) for p in prompts)
    pads = [L - len(p) for p in prompts]
    x = mx.array([[0] * n + list(p) for p, n in zip(prompts, pads)], mx.uint32)
    cache = [type(cs[0]).merge(list(cs)) for cs in zip(*(make_prompt_cache(model) for _ in range(B)))]
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


def generate_chat(model, tokenizer, prompts, max_tokens, batch_size=64, progress=True, time_limit=None):
    """The target's greedy answers, as ``prompt + answer + EOS`` token lists
    (fewer than asked where ``time_limit`` seconds ran out)."""
    from mlx_lm.generate import batch_generate
    from tqdm import tqdm

    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    stop_ids = set(getattr(tokenizer, "eos_token_ids", None) or [eos])
    split = target_mod.split(model)
    out = []
    bar = tqdm(total=len(prompts), desc="generating", unit=" answers", disable=not progress, file=sys.stderr)
    t0 = time.perf_counter()
    for s in range(0, len(prompts), batch_size):
        if time_limit and s and time.perf_counter() - t0 >= time_limit:
            print(f"--generate-time-limit {time_limit:g}s: {s} of {len(prompts)} answers", file=sys.stderr)
            break
        part = prompts[s : s + batch_size]
        answers = None
        if split is not None:
            try:
                answers = greedy_batch(model, split, part, max_tokens, stop_ids)
            except Exception as e:  # a cache type without batch support: mlx-lm's generator
                log.warning(f"train-drafter: batched greedy generation failed ({e}); using mlx-lm's batch_generate")
                split = None
        if answers is None:
            r = batch_generate(model, tokenizer, part, max_tokens=max_tokens, return_token_ids=True,
                               completion_batch_size=len(part), prefill_batch_size=min(len(part), 16))
            answers = r.token_ids
        for p, ids in zip(part, answers):
            out.append(p + list(ids) + [eos])
        bar.update(len(part))
    bar.close()
    return out


def chunk(tokens, seq_len):
    n = len(tokens) // seq_len
    if n == 0:
        raise TrainError(f"the data has {len(tokens)} tokens, fewer than one --seq-len {seq_len} sequence")
    return tokens[: n * seq_len].reshape(n, seq_len)


def batch_rows(n_rows, batch_size, step, seed):
    """Row indices of batch ``step``: epochs of seeded permutations, so a
    resumed run sees exactly the batches the uninterrupted run would."""
    per_epoch = max(1, n_rows // batch_size)
    epoch, i = divmod(step, per_epoch)
    perm = np.random.default_rng(seed + epoch).permutation(n_rows)
    return perm[i * batch_size : (i + 1) * batch_size]


# ----------------------------------------------------------------- model


class Target:
    """The frozen target and the pieces of it the drafter borrows."""

    def __init__(self, model, cfg, split=None):
        self.model = model
        split = split or target_mod.split(model)
        if split is None:
            raise TrainError("this architecture does not expose its hidden states in mlx-lm's usual layout")
        self.backbone, self.head = split
        self.embed = A._embedding(model)
        self.ropes = [A.rope_of(model, d) for d in cfg.donors]
        self.cfg = cfg
        self.dtype = A.donor_layout(model, cfg.donors)[3]
        model.freeze()

    def run(self, x):
        """Hidden states, token embeddings, donor K/V, the target's next-token
        probabilities and its argmax, for tokens ``x [B, T]``."""
        caches = [KVCache() for _ in make_prompt_cache(self.model)]
        h = self.backbone(x, caches)
        logits = self.head(h).astype(mx.float32)
        T = x.shape[1]
        kv = [(caches[d].keys[..., :T, :], caches[d].values[..., :T, :]) for d in self.cfg.donors]
        return h, self.embed(x), kv, mx.softmax(logits, axis=-1, precise=True), mx.argmax(logits, axis=-1)


def loss_fn(net, target, h, emb, kv, p_t, top_t, steps, feature_weight, step_decay=0.8, weights=None):
    """Distillation loss over ``steps`` chained draft steps, step ``s``
    weighted ``step_decay**s``; also each step's cross-entropy and top-1
    agreement with the target (rows with a full chain only, and, with
    ``weights [B, T]``, only rows whose weight is 1: rows predicting an
    answer token of a chat, the only tokens a drafter drafts)."""
    donors = [(k, v, None) for k, v in kv]
    outs = net.unrolled(h, emb, donors, target.ropes, target.cfg.windows, steps)
    T = h.shape[1]
    hf = h.astype(mx.float32)
    total, norm = 0.0, 0.0
    ces, accs = [], []
    for s, out in enumerate(outs):
        valid = (mx.arange(T) >= s + 1)[None].astype(mx.float32)
        valid = valid * weights if weights is not None else mx.broadcast_to(valid, h.shape[:2])
        count = mx.maximum(valid.sum(), 1.0)
        logits = target.head(out.astype(target.dtype)).astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        ce = (-(p_t * lp).sum(-1) * valid).sum() / count
        diff = mx.abs(out.astype(mx.float32) - hf)
        feat = (mx.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5).mean(-1) * valid).sum() / count
        acc = ((mx.argmax(lp, axis=-1) == top_t).astype(mx.float32) * valid).sum() / count
        w = step_decay**s
        total = total + w * (ce + feature_weight * feat)
        norm += w
        ces.append(ce)
        accs.append(acc)
    return total / norm, mx.stack(ces), mx.stack(accs)


# ------------------------------------------------------------ checkpoints


def _schedule(lr, steps, warmup):
    warmup = max(1, min(warmup, steps // 10 or 1))
    return optim.join_schedules(
        [optim.linear_schedule(lr * 0.01, lr, warmup),
         optim.cosine_decay(lr, max(1, steps - warmup), lr * 0.1)],
        [warmup],
    )


def save_checkpoint(out, net, opt, step, meta):
    """Float32 weights, optimizer state and step, replaced as one folder."""
    out = Path(out)
    tmp, dest, old = out / (CKPT + ".tmp"), out / CKPT, out / (CKPT + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "weights.safetensors"), dict(tree_flatten(net.parameters())))
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
    (tmp / "state.json").write_text(json.dumps({"step": step, **meta}, indent=1) + "\n")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(out):
    for name in (CKPT, CKPT + ".old"):
        d = Path(out) / name
        if (d / "state.json").is_file():
            return d
    return None


def load_checkpoint(d, net, opt):
    try:
        state = json.loads((d / "state.json").read_text())
        net.load_weights(list(mx.load(str(d / "weights.safetensors")).items()), strict=True)
        opt.init(net.trainable_parameters())
        opt.state = tree_unflatten(list(mx.load(str(d / "optimizer.safetensors")).items()))
    except Exception as e:
        raise TrainError(f"the checkpoint in {d} cannot be read ({e}); start over with --restart") from e
    return state


# ------------------------------------------------------------------ train


RUN_KEYS = ("layers", "intermediate_size", "donors", "seq_len", "batch_size", "draft_steps", "lr", "steps",
            "warmup", "feature_weight", "seed", "generate", "generate_tokens", "chat_fraction", "max_data_tokens",
            "patterns", "eval_rows")


DATA_KEYS = ("data", "patterns", "max_data_tokens", "generate", "generate_tokens", "generate_time_limit", "seed")


def prepare_data(args, model, tokenizer, out, resuming):
    """Tokenized data, made once and saved so a resumed run reuses it."""
    f = out / DATA_FILE
    made_by = json.dumps({"prompts": PROMPTS_VERSION, **{k: str(getattr(args, k)) for k in DATA_KEYS}},
                         sort_keys=True)
    if f.is_file():
        try:
            d, meta = mx.load(str(f), return_metadata=True)
        except Exception as e:
            if resuming:
                raise TrainError(f"{f} is unreadable ({e}); start over with --restart") from e
            d, meta = None, {}
        if d is not None and (resuming or meta.get("made_by") == made_by):
            chat = np.array(d["chat"]) if "chat" in d else None
            mask = np.array(d["chat_mask"]) if "chat_mask" in d else None
            return np.array(d["corpus"]), chat, mask
        # No checkpoint uses it and it was made from other settings: remake it.
    tokens, files = read_corpus(tokenizer, args.data, args.patterns, args.max_data_tokens, progress=not args.quiet)
    print(f"data: {len(tokens):,} tokens from {files} files", file=sys.stderr)
    chat = mask = None
    if args.generate:
        prompts = chat_prompts(tokenizer, tokens, args.generate, args.seed)
        t0 = time.perf_counter()
        seqs = generate_chat(model, tokenizer, prompts, args.generate_tokens, batch_size=args.generate_batch,
                             progress=not args.quiet, time_limit=args.generate_time_limit)
        chat = np.concatenate([np.asarray(s, np.uint32) for s in seqs])
        # 1 where a token belongs to an answer (its EOS included): what drafting predicts.
        mask = np.concatenate([np.asarray([0] * len(p) + [1] * (len(s) - len(p)), np.uint8)
                               for p, s in zip(prompts, seqs)])
        print(f"generated: {len(seqs)} answers, {len(chat):,} tokens in {time.perf_counter() - t0:.0f}s",
              file=sys.stderr)
    arrays = {"corpus": mx.array(tokens)}
    if chat is not None:
        arrays["chat"] = mx.array(chat)
        arrays["chat_mask"] = mx.array(mask)
    tmp = out / (".tmp." + DATA_FILE)
    mx.save_safetensors(str(tmp), arrays, metadata={"made_by": made_by})
    tmp.replace(f)
    return tokens, chat, mask


def held_out(rows, n):
    """The last ``n`` rows (at most a tenth of them) kept out of training."""
    n = min(n, len(rows) // 10)
    return (rows[: len(rows) - n], rows[len(rows) - n :]) if n else (rows, None)


def row_weights(mask):
    """Per row position: 1 where the next token is an answer token."""
    return np.concatenate([mask[:, 1:], mask[:, -1:]], axis=1).astype(np.float32)


def make_batches(args, corpus, chat, chat_mask=None):
    """``batch(step) -> (tokens [B, T], weights [B, T])`` for each step, the
    numbers of training rows, and the held-out rows ``{"text": (tokens,
    weights), "chat": ...}`` (where there are enough). Text rows weigh 1
    everywhere; chat rows only where the next token is part of an answer
    (``chat_mask``; prompts, the same system prompt in every chat, are never
    drafted, and would inflate the agreement)."""
    rows, eval_text = held_out(chunk(corpus, args.seq_len), args.eval_rows)
    chat_rows = chunk(chat, args.seq_len) if chat is not None and len(chat) >= args.seq_len else None
    eval_chat = None
    if chat_rows is not None:
        if chat_mask is None:  # data made before answer masks: every token
            chat_mask = np.ones(len(chat), np.uint8)
        chat_rows = np.stack([chat_rows, chunk(chat_mask, args.seq_len)], axis=-1)
        chat_rows, eval_chat = held_out(chat_rows, args.eval_rows)
    evals = {}
    if eval_text is not None:
        evals["text"] = (mx.array(eval_text.astype(np.uint32)), mx.ones(eval_text.shape, mx.float32))
    if eval_chat is not None:
        evals["chat"] = (mx.array(eval_chat[..., 0].astype(np.uint32)), mx.array(row_weights(eval_chat[..., 1])))
    n_chat = 0 if chat_rows is None else min(args.batch_size, round(args.batch_size * args.chat_fraction))
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


def evaluate(net, target, evals, steps, feature_weight, rows=4):
    """Top-1 agreement and cross-entropy per draft step on the held-out rows
    (chats: on the rows predicting answer tokens)."""
    out = {}
    for name, (x, w) in evals.items():
        accs, ces, n = 0.0, 0.0, 0.0
        for s in range(0, x.shape[0], rows):
            ws = w[s : s + rows]
            _, ce, acc = loss_fn(net, target, *target.run(x[s : s + rows]), steps, feature_weight, weights=ws)
            k = ws.sum()
            mx.eval(ce, acc, k)
            accs, ces, n = accs + acc * k, ces + ce * k, n + k.item()
        n = max(n, 1.0)
        out[name] = {"top1": (accs / n).tolist(), "ce": (ces / n).tolist(), "rows": int(x.shape[0])}
    return out


def make_trainer(args, cfg, target, ckpt=None):
    """The drafter (fresh, or from checkpoint folder ``ckpt``), its
    optimizer, the state to evaluate and the (compiled) training step."""
    mx.random.seed(args.seed)
    net = A.Assistant(cfg)
    A.init_from_target(net, target.model)
    opt = optim.AdamW(learning_rate=_schedule(args.lr, args.steps, args.warmup), weight_decay=0.0)
    opt.init(net.trainable_parameters())
    if ckpt is not None:  # before compiling: the compiled step captures these state trees
        load_checkpoint(ckpt, net, opt)
    value_grad = nn.value_and_grad(
        net, lambda n, h, emb, kv, p, top, w: loss_fn(n, target, h, emb, kv, p, top, args.draft_steps,
                                                      args.feature_weight, weights=w))

    def update(h, emb, kv, p, top, w):
        (loss, ces, accs), grads = value_grad(net, h, emb, kv, p, top, w)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(net, grads)
        return loss, ces, accs

    state = [net.state, opt.state]
    if not (args.compile if args.compile is not None else mx.default_device().type == mx.DeviceType.gpu):
        return net, opt, state, update
    compiled = mx.compile(update, inputs=state, outputs=state)
    fn = {"step": compiled}

    def step(*inputs):
        try:
            return fn["step"](*inputs)
        except Exception as e:  # a backend that cannot compile it: train uncompiled
            if fn["step"] is update:
                raise
            log.warning(f"train-drafter: mx.compile failed ({e}); training uncompiled")
            print(f"train-drafter: mx.compile failed ({e}); training uncompiled", file=sys.stderr)
            fn["step"] = update
            return update(*inputs)

    return net, opt, state, step


def calibrate(args, cfg, target, batch, warm=3, timed=8):
    """``--steps auto``: as many steps as fit in ``--time-limit`` at the
    speed of a few throwaway steps (the real run starts fresh after)."""
    args.steps = 1000  # any schedule: these steps are discarded
    net, opt, state, step_fn = make_trainer(args, cfg, target)
    t0 = None
    for i in range(warm + timed):
        if i == warm:
            t0 = time.perf_counter()
        x, w = batch(i)
        inputs = target.run(x)
        mx.eval(inputs)
        mx.eval(state, step_fn(*inputs, w))
    per_step = (time.perf_counter() - t0) / timed
    steps = max(10, int(0.9 * args.time_limit / per_step))
    print(f"--steps auto: {per_step:.3f} s/step, {steps} steps fit in --time-limit {args.time_limit:g}s",
          file=sys.stderr)
    return steps


def train(args):
    from mlx_lm import load as load_model
    from tqdm import tqdm

    out = Path(args.out)
    if args.restart and out.exists():
        for name in (CKPT, CKPT + ".old", DATA_FILE, LOG_FILE, A.CONFIG_FILE, A.WEIGHTS_FILE):
            p = out / name
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = find_checkpoint(out)
    run = {k: getattr(args, k) for k in RUN_KEYS}
    if ckpt is not None:
        prev = json.loads((ckpt / "state.json").read_text()).get("run", {})
        if args.steps == "auto":  # the step count the first run calibrated
            args.steps = run["steps"] = prev.get("steps")
        changed = {k: (prev.get(k), run[k]) for k in RUN_KEYS if k != "steps" and prev.get(k) != run[k]}
        if changed:
            shown = ", ".join(f"--{k.replace('_', '-')} {a!r} -> {b!r}" for k, (a, b) in changed.items())
            raise TrainError(f"{out} holds a run with other settings ({shown}); use the same flags to resume, "
                             f"another --out, or --restart")

    model, tokenizer = load_model(args.model)
    if args.target_dtype:
        model.set_dtype(getattr(mx, args.target_dtype))
    split = target_mod.split(model)
    cfg = A.make_config(model, args.layers, args.intermediate_size, args.donors, split=split)
    if ckpt is not None:
        saved = A.read_config(out)
        A.check_fingerprint(saved.target, cfg.target, where=f"the run in {out}")
        cfg.target = saved.target
    target = Target(model, cfg, split)
    corpus, chat, chat_mask = prepare_data(args, model, tokenizer, out, resuming=ckpt is not None)
    batch, n_rows, n_chat_rows, evals = make_batches(args, corpus, chat, chat_mask)

    if args.steps == "auto":
        args.steps = run["steps"] = calibrate(args, cfg, target, batch)
    net, opt, state, step_fn = make_trainer(args, cfg, target, ckpt)
    start = 0
    if ckpt is not None:
        start = json.loads((ckpt / "state.json").read_text())["step"]
        print(f"resuming {out} at step {start}", file=sys.stderr)
    _truncate_log(out / LOG_FILE, start)  # steps logged after the checkpoint are redone
    _truncate_log(out / EVAL_FILE, start)
    n_params = sum(v.size for _, v in tree_flatten(net.parameters()))
    print(f"assistant: {cfg.num_layers} layer(s), {n_params / 1e6:.2f}M parameters, donors {cfg.donors} "
          f"(of {len(make_prompt_cache(model))} caches); {n_rows} text + {n_chat_rows} chat sequences "
          f"of {args.seq_len} tokens; held out: "
          + (", ".join(f"{v[0].shape[0]} {k}" for k, v in evals.items()) or "none (too little data)"), file=sys.stderr)

    last = {"step": None, "eval": None}  # this run's last checkpoint and its held-out figures

    def checkpoint(step):
        save_checkpoint(out, net, opt, step, meta())
        A.save(out, net, cfg)
        res = evaluate(net, target, evals, args.draft_steps, args.feature_weight) if evals else None
        if res:
            with open(out / EVAL_FILE, "a") as f:
                f.write(json.dumps({"step": step, **res}) + "\n")
            tqdm.write(f"step {step}: held-out top-1 agreement: {_eval_line(res)}", file=sys.stderr)
        last.update(step=step, eval=res)

    meta = lambda: {"run": run, "model": str(args.model), "data": str(args.data)}
    logf = open(out / LOG_FILE, "a")
    bar = tqdm(total=args.steps, initial=start, desc="train-drafter", unit=" steps", disable=args.quiet,
               file=sys.stderr, dynamic_ncols=True)
    t0 = time.perf_counter()
    last_save = t0
    ema = ema_top1 = None
    step = start
    stop = None
    try:
        while step < args.steps:
            x, w = batch(step)
            inputs = target.run(x)
            mx.eval(inputs)
            loss, ces, accs = step_fn(*inputs, w)
            mx.eval(state, loss, ces, accs)
            step += 1
            rec = {"step": step, "loss": loss.item(), "ce": ces.tolist(), "top1": accs.tolist(),
                   "lr": float(opt.learning_rate.item()) if isinstance(opt.learning_rate, mx.array) else args.lr,
                   "time": round(time.perf_counter() - t0, 2)}
            logf.write(json.dumps(rec) + "\n")
            ema = rec["loss"] if ema is None else 0.9 * ema + 0.1 * rec["loss"]
            ema_top1 = rec["top1"][0] if ema_top1 is None else 0.9 * ema_top1 + 0.1 * rec["top1"][0]
            bar.set_postfix(loss=f"{ema:.3f}", top1=f"{ema_top1:.3f}",
                            **{f"top1@{i + 2}": f"{a:.2f}" for i, a in enumerate(rec["top1"][1:])})
            bar.update(1)
            now = time.perf_counter()
            if args.time_limit and now - t0 >= args.time_limit:
                stop = f"--time-limit {args.time_limit}s reached"
                break
            if args.stop_after and step - start >= args.stop_after and step < args.steps:
                stop = f"--stop-after {args.stop_after} steps"
                break
            if step % args.save_every == 0 or now - last_save > 120:
                checkpoint(step)
                last_save = time.perf_counter()
    except KeyboardInterrupt:
        stop = "interrupted"
    finally:
        bar.close()
        logf.close()
        if step > start and step != last["step"]:
            checkpoint(step)
    elapsed = time.perf_counter() - t0
    if step > start:
        tail = _tail_metrics(out / LOG_FILE, step)
        print(f"step {step}/{args.steps} in {elapsed:.0f}s ({(step - start) / max(elapsed, 1e-9):.2f} steps/s); "
              f"last 20 steps: loss {tail['loss']:.3f}, top-1 agreement {_per_step(tail['top1'])}", file=sys.stderr)
        if last["eval"] and last["step"] == step:
            print("held-out top-1 agreement (what decoding such text accepts): "
                  + _eval_line(last["eval"], rows=True), file=sys.stderr)
    if stop:
        print(f"stopped at step {step} ({stop}); run the same command again to continue", file=sys.stderr)
    print(f"drafter saved in {out} (use: --drafter assistant --drafter-path {out})", file=sys.stderr)
    return 0


def _truncate_log(path, step):
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            pass  # a line cut short by a crash
    path.write_text("".join(x + "\n" for x in keep))


def _per_step(values):
    return ", ".join(f"step{i + 1} {a:.3f}" for i, a in enumerate(values))


def _eval_line(res, rows=False):
    """Held-out top-1 agreement per data kind and draft step, one line."""
    return "; ".join(f"{EVAL_NAMES[k]}" + (f" ({r['rows']} rows)" if rows else "") + f" {_per_step(r['top1'])}"
                     for k, r in res.items())


def _tail_metrics(path, step, n=20):
    recs = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    recs = [r for r in recs if r["step"] <= step][-n:]
    top1 = np.mean([r["top1"] for r in recs], axis=0).tolist()
    return {"loss": float(np.mean([r["loss"] for r in recs])), "top1": top1}


# -------------------------------------------------------------------- CLI


def add_arguments(p):
    p.add_argument("--model", required=True, help="The target model (path or name mlx_lm.load accepts).")
    p.add_argument("--data", required=True, help="A text file or a folder of text files (read recursively).")
    p.add_argument("--out", required=True, help="Folder for the drafter and its checkpoints (resumed if present).")
    p.add_argument("--patterns", default=DEFAULT_PATTERNS,
                   help=f"File name patterns read from a --data folder. Default: {DEFAULT_PATTERNS}.")
    p.add_argument("--max-data-tokens", type=int, default=2_000_000, help="Tokens of data to read at most. Default: 2M.")
    p.add_argument("--generate", type=int, default=0,
                   help="Also train on the target's greedy answers to this many chat prompts made from the data. Default: 0.")
    p.add_argument("--generate-tokens", type=int, default=256, help="Longest generated answer. Default: 256.")
    p.add_argument("--generate-batch", type=int, default=64, help="Answers generated at once. Default: 64.")
    p.add_argument("--generate-time-limit", type=float, default=None,
                   help="Stop generating after this many seconds (keeping the answers made). Default: none.")
    p.add_argument("--chat-fraction", type=float, default=0.5,
                   help="Share of each batch taken from the generated chats (with --generate). Default: 0.5.")
    p.add_argument("--layers", type=int, default=1, help="Drafter layers (1 or 2; up to 4). Default: 1.")
    p.add_argument("--intermediate-size", type=int, default=None, help="Drafter MLP width. Default: the target's.")
    p.add_argument("--donors", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="Target cache index each drafter layer reads, comma separated. Default: the last "
                        "sliding-window and last full-attention layers (else the last layer).")
    p.add_argument("--steps", type=_steps, default=2000,
                   help="Training steps (sets the learning-rate schedule), or 'auto': as many as fit in "
                        "--time-limit at the measured speed. Default: 2000.")
    p.add_argument("--batch-size", type=int, default=8, help="Sequences per step. Default: 8.")
    p.add_argument("--seq-len", type=int, default=256, help="Tokens per sequence. Default: 256.")
    p.add_argument("--draft-steps", type=int, default=3,
                   help="Chained draft steps trained from every position. Default: 3.")
    p.add_argument("--lr", type=float, default=3e-4,
                   help="Peak learning rate (AdamW, cosine decay). Default: 3e-4 (1e-3 measured unstable: the "
                        "head's sharp logits make early steps overshoot).")
    p.add_argument("--warmup", type=int, default=100, help="Warm-up steps. Default: 100.")
    p.add_argument("--eval-rows", type=int, default=8,
                   help="Rows of text and of chats held out of training and evaluated at every checkpoint "
                        "(at most a tenth of the data). Default: 8.")
    p.add_argument("--feature-weight", type=float, default=1.0,
                   help="Weight of the hidden-state regression loss. Default: 1.0.")
    p.add_argument("--seed", type=int, default=0, help="Seed for weights, data order and prompts. Default: 0.")
    p.add_argument("--time-limit", type=float, default=None,
                   help="Stop (with a checkpoint) after this many seconds of training; rerun to continue.")
    p.add_argument("--stop-after", type=int, default=None,
                   help="Train at most this many steps in this run (checkpointed); rerun to continue.")
    p.add_argument("--save-every", type=int, default=200, help="Checkpoint every N steps (and every 2 minutes). Default: 200.")
    p.add_argument("--target-dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="Cast the target's weights (e.g. bfloat16 on a GPU). Default: as loaded.")
    p.add_argument("--compile", dest="compile", action="store_true", default=None,
                   help="mx.compile the training step. Default: on a GPU only (on the CPU it compiles for "
                        "long and runs no faster).")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="Never mx.compile the training step.")
    p.add_argument("--restart", action="store_true", help="Discard a previous run in --out and start over.")
    p.add_argument("--quiet", action="store_true", help="No progress bars.")


def _steps(value):
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of steps or 'auto', got {value!r}") from None


def _validate(args):
    if args.steps == "auto" and not args.time_limit:
        raise TrainError("--steps auto needs --time-limit SECONDS")
    for name in ("steps", "batch_size", "seq_len", "draft_steps", "save_every", "layers", "generate_batch"):
        if getattr(args, name) != "auto" and getattr(args, name) < 1:
            raise TrainError(f"--{name.replace('_', '-')} must be at least 1")
    if args.eval_rows < 0:
        raise TrainError("--eval-rows must be 0 or more")
    if args.seq_len < args.draft_steps + 2:
        raise TrainError("--seq-len must exceed --draft-steps + 1")
    if not 0.0 <= args.chat_fraction <= 1.0:
        raise TrainError("--chat-fraction must be between 0 and 1")
    if args.lr <= 0:
        raise TrainError("--lr must be positive")


def run(args):
    try:
        _validate(args)
        return train(args)
    except (TrainError, A.AssistantError) as e:
        print(f"train-drafter: {e}", file=sys.stderr)
        return 2


def add_subcommand(subparsers):
    p = subparsers.add_parser(
        "train-drafter",
        help="train an assistant drafter for spec-decode (--drafter assistant) by self-distillation",
        description="Train the KV-borrowing assistant drafter of the spec-decode plugin for a target model: "
        "the frozen target runs over real text and the drafter learns its next tokens from its caches "
        "and hidden states. Resumes from --out when run again.",
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mlx_lm_spec_decode.assistant_train")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
