"""One ``train-drafter`` run, step by step: open (or resume) the output
folder, load the target, prepare the data, train, report.

This is the command's own output: progress goes to stderr with ``print``
and tqdm, as the user ran it to watch it.
"""

import json
import sys
import time
from argparse import Namespace
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from .. import target as target_mod
from ..assistant import AssistantConfig, check_fingerprint, make_config, read_config, save
from . import checkpoint as ckpt_mod
from .chat import PROMPTS_VERSION, answer_mask, chat_prompts, generate_chat
from .checkpoint import EVAL_FILE, LOG_FILE
from .data import Batches, data_signature, load_data, make_batches, read_corpus, save_data
from .distill import StepFn, Target, evaluate, make_trainer

EVAL_NAMES = {"text": "text", "chat": "chat answers"}
SAVE_SECONDS = 120  # a checkpoint at least this often, whatever --save-every says


def train(args: Namespace) -> int:
    """Train (or resume training) a drafter into ``--out``; 0 when done."""
    out = Path(args.out)
    ckpt, run = open_out(args, out)
    model, tokenizer = load_target_model(args)
    split = target_mod.split(model)
    cfg = drafter_config(args, model, split, out, ckpt)
    target = Target(model, cfg, split)
    corpus, chat, chat_mask = prepare_data(args, model, tokenizer, out, resuming=ckpt is not None)
    batch, n_rows, n_chat_rows, evals = make_batches(args, corpus, chat, chat_mask)
    if args.steps == "auto":
        args.steps = run["steps"] = calibrate(args, cfg, target, batch)
    net, opt, state, step_fn = make_trainer(args, cfg, target, ckpt)
    start = 0
    if ckpt is not None:
        start = ckpt_mod.saved_run(ckpt)["step"]
        print(f"resuming {out} at step {start}", file=sys.stderr)
    ckpt_mod.truncate_log(out / LOG_FILE, start)  # steps logged after the checkpoint are redone
    ckpt_mod.truncate_log(out / EVAL_FILE, start)
    _describe(args, model, cfg, net, n_rows, n_chat_rows, evals)
    session = Session(args, out, run, cfg, target, net, opt, evals)
    t0 = time.perf_counter()
    step, stop = session.train(batch, state, step_fn, start)
    session.report(start, step, stop, time.perf_counter() - t0)
    return 0


# ------------------------------------------------------------ setting up


def open_out(args: Namespace, out: Path) -> tuple[Optional[Path], dict]:
    """The output folder (cleared with ``--restart``), its checkpoint if a
    run is resumed, and this run's settings (checked against that run's)."""
    if args.restart and out.exists():
        ckpt_mod.clear(out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = ckpt_mod.find_checkpoint(out)
    run = ckpt_mod.run_settings(args)
    if ckpt is not None:
        prev = ckpt_mod.saved_run(ckpt)["run"]
        if args.steps == "auto":  # the step count the first run calibrated
            args.steps = run["steps"] = prev.get("steps")
        ckpt_mod.check_resume(out, prev, run)
    return ckpt, run


def load_target_model(args: Namespace) -> tuple[nn.Module, object]:
    from mlx_lm import load as load_model

    model, tokenizer = load_model(args.model)
    if args.target_dtype:
        model.set_dtype(getattr(mx, args.target_dtype))
    return model, tokenizer


def drafter_config(
    args: Namespace, model: nn.Module, split: Optional[tuple], out: Path, ckpt: Optional[Path]
) -> AssistantConfig:
    """The drafter's shape for this target; a resumed run must be for the
    same target as the run it resumes (and keeps that run's fingerprint)."""
    cfg = make_config(model, args.layers, args.intermediate_size, args.donors, split=split)
    if ckpt is not None:
        saved = read_config(out)
        check_fingerprint(saved.target, cfg.target, where=f"the run in {out}")
        cfg.target = saved.target
    return cfg


def prepare_data(args: Namespace, model: nn.Module, tokenizer, out: Path, resuming: bool) -> tuple:
    """Tokenized data, made once and saved so a resumed run reuses it."""
    made_by = data_signature(args, PROMPTS_VERSION)
    saved = load_data(out, made_by, resuming)
    if saved is not None:
        return saved
    tokens, files = read_corpus(
        tokenizer, args.data, args.patterns, args.max_data_tokens, progress=not args.quiet
    )
    print(f"data: {len(tokens):,} tokens from {files} files", file=sys.stderr)
    chat = mask = None
    if args.generate:
        prompts = chat_prompts(tokenizer, tokens, args.generate, args.seed)
        t0 = time.perf_counter()
        seqs = generate_chat(
            model,
            tokenizer,
            prompts,
            args.generate_tokens,
            batch_size=args.generate_batch,
            progress=not args.quiet,
            time_limit=args.generate_time_limit,
        )
        chat = np.concatenate([np.asarray(s, np.uint32) for s in seqs])
        mask = answer_mask(prompts, seqs)
        print(
            f"generated: {len(seqs)} answers, {len(chat):,} tokens "
            f"in {time.perf_counter() - t0:.0f}s",
            file=sys.stderr,
        )
    save_data(out, made_by, tokens, chat, mask)
    return tokens, chat, mask


def calibrate(
    args: Namespace,
    cfg: AssistantConfig,
    target: Target,
    batch: Batches,
    warm: int = 3,
    timed: int = 8,
) -> int:
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
    print(
        f"--steps auto: {per_step:.3f} s/step, {steps} steps fit in "
        f"--time-limit {args.time_limit:g}s",
        file=sys.stderr,
    )
    return steps


def _describe(args, model, cfg, net, n_rows, n_chat_rows, evals):
    n_params = sum(v.size for _, v in tree_flatten(net.parameters()))
    held = ", ".join(f"{v[0].shape[0]} {k}" for k, v in evals.items()) or "none (too little data)"
    print(
        f"assistant: {cfg.num_layers} layer(s), {n_params / 1e6:.2f}M parameters, "
        f"donors {cfg.donors} (of {len(make_prompt_cache(model))} caches); "
        f"{n_rows} text + {n_chat_rows} chat sequences of {args.seq_len} tokens; held out: " + held,
        file=sys.stderr,
    )


# -------------------------------------------------------------- training


class Session:
    """The training steps of one run, its checkpoints and its last figures."""

    def __init__(self, args, out, run, cfg, target, net, opt, evals):
        self.args, self.out, self.run, self.cfg = args, out, run, cfg
        self.target, self.net, self.opt, self.evals = target, net, opt, evals
        self.last_step = None  # this run's last checkpoint ...
        self.last_eval = None  # ... and its held-out figures

    def checkpoint(self, step: int) -> None:
        """Checkpoint, a usable drafter folder, and the held-out figures."""
        from tqdm import tqdm

        meta = {"run": self.run, "model": str(self.args.model), "data": str(self.args.data)}
        ckpt_mod.save_checkpoint(self.out, self.net, self.opt, step, meta)
        save(self.out, self.net, self.cfg)
        res = None
        if self.evals:
            res = evaluate(
                self.net, self.target, self.evals, self.args.draft_steps, self.args.feature_weight
            )
        if res:
            with open(self.out / EVAL_FILE, "a") as f:
                f.write(json.dumps({"step": step, **res}) + "\n")
            tqdm.write(f"step {step}: held-out top-1 agreement: {_eval_line(res)}", file=sys.stderr)
        self.last_step, self.last_eval = step, res

    def train(
        self, batch: Batches, state: list, step_fn: StepFn, start: int
    ) -> tuple[int, Optional[str]]:
        """Steps from ``start`` to ``--steps`` (or until a limit or Ctrl-C),
        each logged; returns the last step and why it stopped early, if it did."""
        from tqdm import tqdm

        args = self.args
        logf = open(self.out / LOG_FILE, "a")
        bar = tqdm(
            total=args.steps,
            initial=start,
            desc="train-drafter",
            unit=" steps",
            disable=args.quiet,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        t0 = last_save = time.perf_counter()
        ema = ema_top1 = None
        step, stop = start, None
        try:
            while step < args.steps:
                rec = self._step(batch, state, step_fn, step, t0)
                step += 1
                logf.write(json.dumps(rec) + "\n")
                ema = rec["loss"] if ema is None else 0.9 * ema + 0.1 * rec["loss"]
                ema_top1 = (
                    rec["top1"][0] if ema_top1 is None else 0.9 * ema_top1 + 0.1 * rec["top1"][0]
                )
                bar.set_postfix(
                    loss=f"{ema:.3f}",
                    top1=f"{ema_top1:.3f}",
                    **{f"top1@{i + 2}": f"{a:.2f}" for i, a in enumerate(rec["top1"][1:])},
                )
                bar.update(1)
                now = time.perf_counter()
                stop = self._limit(step, start, now - t0)
                if stop:
                    break
                if step % args.save_every == 0 or now - last_save > SAVE_SECONDS:
                    self.checkpoint(step)
                    last_save = time.perf_counter()
        except KeyboardInterrupt:
            stop = "interrupted"
        finally:
            bar.close()
            logf.close()
            if step > start and step != self.last_step:
                self.checkpoint(step)
        return step, stop

    def _step(self, batch, state, step_fn, step, t0):
        """One training step; its log record (``step`` is the one done)."""
        x, w = batch(step)
        inputs = self.target.run(x)
        mx.eval(inputs)
        loss, ces, accs = step_fn(*inputs, w)
        mx.eval(state, loss, ces, accs)
        lr = self.opt.learning_rate
        return {
            "step": step + 1,
            "loss": loss.item(),
            "ce": ces.tolist(),
            "top1": accs.tolist(),
            "lr": float(lr.item()) if isinstance(lr, mx.array) else self.args.lr,
            "time": round(time.perf_counter() - t0, 2),
        }

    def _limit(self, step, start, elapsed):
        """Why to stop after ``step`` (``--time-limit``, ``--stop-after``), or None."""
        args = self.args
        if args.time_limit and elapsed >= args.time_limit:
            return f"--time-limit {args.time_limit}s reached"
        if args.stop_after and step - start >= args.stop_after and step < args.steps:
            return f"--stop-after {args.stop_after} steps"
        return None

    def report(self, start: int, step: int, stop: Optional[str], elapsed: float) -> None:
        out, args = self.out, self.args
        if step > start:
            tail = ckpt_mod.tail_metrics(out / LOG_FILE, step)
            rate = (step - start) / max(elapsed, 1e-9)
            print(
                f"step {step}/{args.steps} in {elapsed:.0f}s ({rate:.2f} steps/s); last 20 steps: "
                f"loss {tail['loss']:.3f}, top-1 agreement {_per_step(tail['top1'])}",
                file=sys.stderr,
            )
            if self.last_eval and self.last_step == step:
                print(
                    "held-out top-1 agreement (what decoding such text accepts): "
                    + _eval_line(self.last_eval, rows=True),
                    file=sys.stderr,
                )
        if stop:
            print(
                f"stopped at step {step} ({stop}); run the same command again to continue",
                file=sys.stderr,
            )
        print(
            f"drafter saved in {out} (use: --drafter assistant --drafter-path {out})",
            file=sys.stderr,
        )


def _per_step(values):
    return ", ".join(f"step{i + 1} {a:.3f}" for i, a in enumerate(values))


def _eval_line(res, rows=False):
    """Held-out top-1 agreement per data kind and draft step, one line."""
    return "; ".join(
        f"{EVAL_NAMES[k]}" + (f" ({r['rows']} rows)" if rows else "") + f" {_per_step(r['top1'])}"
        for k, r in res.items()
    )
