"""``mlx-lm-ext train-drafter`` (and ``python -m mlx_lm_spec_decode.training``):
the flags, their checks, and the exit status.
"""

import argparse
import sys
from typing import Optional

from ..assistant import AssistantError
from . import TrainError
from .data import DEFAULT_PATTERNS
from .train import train


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True, help="The target model (path or name mlx_lm.load accepts)."
    )
    p.add_argument(
        "--data", required=True, help="A text file or a folder of text files (read recursively)."
    )
    p.add_argument(
        "--out",
        required=True,
        help="Folder for the drafter and its checkpoints (resumed if present).",
    )
    p.add_argument(
        "--patterns",
        default=DEFAULT_PATTERNS,
        help=f"File name patterns read from a --data folder. Default: {DEFAULT_PATTERNS}.",
    )
    p.add_argument(
        "--max-data-tokens",
        type=int,
        default=2_000_000,
        help="Tokens of data to read at most. Default: 2M.",
    )
    p.add_argument(
        "--generate",
        type=int,
        default=0,
        help="Also train on the target's greedy answers to this many chat prompts made from "
        "the data. Default: 0.",
    )
    p.add_argument(
        "--generate-tokens", type=int, default=256, help="Longest generated answer. Default: 256."
    )
    p.add_argument(
        "--generate-batch", type=int, default=64, help="Answers generated at once. Default: 64."
    )
    p.add_argument(
        "--generate-time-limit",
        type=float,
        default=None,
        help="Stop generating after this many seconds (keeping the answers made). Default: none.",
    )
    p.add_argument(
        "--chat-fraction",
        type=float,
        default=0.5,
        help="Share of each batch taken from the generated chats (with --generate). Default: 0.5.",
    )
    p.add_argument(
        "--layers", type=int, default=1, help="Drafter layers (1 or 2; up to 4). Default: 1."
    )
    p.add_argument(
        "--intermediate-size",
        type=int,
        default=None,
        help="Drafter MLP width. Default: the target's.",
    )
    p.add_argument(
        "--donors",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="Target cache index each drafter layer reads, comma separated. Default: the last "
        "sliding-window and last full-attention layers (else the last layer).",
    )
    p.add_argument(
        "--steps",
        type=_steps,
        default=2000,
        help="Training steps (sets the learning-rate schedule), or 'auto': as many as fit in "
        "--time-limit at the measured speed. Default: 2000.",
    )
    p.add_argument("--batch-size", type=int, default=8, help="Sequences per step. Default: 8.")
    p.add_argument("--seq-len", type=int, default=256, help="Tokens per sequence. Default: 256.")
    p.add_argument(
        "--draft-steps",
        type=int,
        default=3,
        help="Chained draft steps trained from every position. Default: 3.",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=3e-4,
        help="Peak learning rate (AdamW, cosine decay). Default: 3e-4 (1e-3 measured unstable: the "
        "head's sharp logits make early steps overshoot).",
    )
    p.add_argument("--warmup", type=int, default=100, help="Warm-up steps. Default: 100.")
    p.add_argument(
        "--eval-rows",
        type=int,
        default=8,
        help="Rows of text and of chats held out of training and evaluated at every checkpoint "
        "(at most a tenth of the data). Default: 8.",
    )
    p.add_argument(
        "--feature-weight",
        type=float,
        default=1.0,
        help="Weight of the hidden-state regression loss. Default: 1.0.",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="Seed for weights, data order and prompts. Default: 0."
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="Stop (with a checkpoint) after this many seconds of training; rerun to continue.",
    )
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="Train at most this many steps in this run (checkpointed); rerun to continue.",
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=200,
        help="Checkpoint every N steps (and every 2 minutes). Default: 200.",
    )
    p.add_argument(
        "--target-dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="Cast the target's weights (e.g. bfloat16 on a GPU). Default: as loaded.",
    )
    p.add_argument(
        "--compile",
        dest="compile",
        action="store_true",
        default=None,
        help="mx.compile the training step. Default: on a GPU only (on the CPU it compiles for "
        "long and runs no faster).",
    )
    p.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="Never mx.compile the training step.",
    )
    p.add_argument(
        "--restart", action="store_true", help="Discard a previous run in --out and start over."
    )
    p.add_argument("--quiet", action="store_true", help="No progress bars.")


def _steps(value):
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a number of steps or 'auto', got {value!r}"
        ) from None


def _validate(args):
    if args.steps == "auto" and not args.time_limit:
        raise TrainError("--steps auto needs --time-limit SECONDS")
    for name in (
        "steps",
        "batch_size",
        "seq_len",
        "draft_steps",
        "save_every",
        "layers",
        "generate_batch",
    ):
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


def run(args: argparse.Namespace) -> int:
    """The command: 0 when trained, 2 (with a one-line message) on bad input."""
    try:
        _validate(args)
        return train(args)
    except (TrainError, AssistantError) as e:
        print(f"train-drafter: {e}", file=sys.stderr)
        return 2


def add_subcommand(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train-drafter",
        help="train an assistant drafter for spec-decode (--drafter assistant) "
        "by self-distillation",
        description="Train the KV-borrowing assistant drafter of the spec-decode plugin for a "
        "target model: the frozen target runs over real text and the drafter learns its next "
        "tokens from its caches and hidden states. Resumes from --out when run again.",
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_lm_spec_decode.training")
    add_arguments(p)
    return run(p.parse_args(argv))
