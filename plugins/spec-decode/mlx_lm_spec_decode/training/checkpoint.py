"""The output folder of a run: the checkpoint (weights, optimizer state,
step and the run's settings), the step and eval logs, and the checks that
let a rerun of the same command resume exactly where the last one stopped.
"""

import json
import shutil
from argparse import Namespace
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..assistant import CONFIG_FILE, WEIGHTS_FILE
from . import TrainError
from .data import DATA_FILE

CKPT = "checkpoint"
LOG_FILE = "log.jsonl"
EVAL_FILE = "eval.jsonl"
# The flags a resumed run must repeat (they shape the schedule or the data).
RUN_KEYS = (
    "layers",
    "intermediate_size",
    "donors",
    "seq_len",
    "batch_size",
    "draft_steps",
    "lr",
    "steps",
    "warmup",
    "feature_weight",
    "seed",
    "generate",
    "generate_tokens",
    "chat_fraction",
    "max_data_tokens",
    "patterns",
    "eval_rows",
)


def clear(out: Path) -> None:
    """``--restart``: remove a previous run's files (other files stay)."""
    for name in (CKPT, CKPT + ".old", DATA_FILE, LOG_FILE, CONFIG_FILE, WEIGHTS_FILE):
        p = out / name
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)


def save_checkpoint(
    out: Path, net: nn.Module, opt: optim.Optimizer, step: int, meta: dict[str, Any]
) -> None:
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


def find_checkpoint(out: Path) -> Optional[Path]:
    """The checkpoint folder, or the previous one if a save was cut short."""
    for name in (CKPT, CKPT + ".old"):
        d = Path(out) / name
        if (d / "state.json").is_file():
            return d
    return None


def load_checkpoint(d: Path, net: nn.Module, opt: optim.Optimizer) -> dict:
    try:
        state = json.loads((d / "state.json").read_text())
        net.load_weights(list(mx.load(str(d / "weights.safetensors")).items()), strict=True)
        opt.init(net.trainable_parameters())
        opt.state = tree_unflatten(list(mx.load(str(d / "optimizer.safetensors")).items()))
    except Exception as e:
        raise TrainError(
            f"the checkpoint in {d} cannot be read ({e}); start over with --restart"
        ) from e
    return state


def saved_run(ckpt: Path) -> dict:
    """The settings (``RUN_KEYS``) of the run that wrote ``ckpt``, and its step."""
    state = json.loads((ckpt / "state.json").read_text())
    return {"run": state.get("run", {}), "step": state["step"]}


def check_resume(out: Path, prev: dict, run: dict) -> None:
    """Refuse to resume a run with other settings (``steps`` excepted)."""
    changed = {k: (prev.get(k), run[k]) for k in RUN_KEYS if k != "steps" and prev.get(k) != run[k]}
    if changed:
        shown = ", ".join(
            f"--{k.replace('_', '-')} {a!r} -> {b!r}" for k, (a, b) in changed.items()
        )
        raise TrainError(
            f"{out} holds a run with other settings ({shown}); use the same flags to resume, "
            f"another --out, or --restart"
        )


def run_settings(args: Namespace) -> dict:
    return {k: getattr(args, k) for k in RUN_KEYS}


def truncate_log(path: Path, step: int) -> None:
    """Drop the lines logged after ``step``: steps after the checkpoint are redone."""
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


def tail_metrics(path: Path, step: int, n: int = 20) -> dict:
    """Mean loss and per-step top-1 agreement of the last ``n`` logged steps."""
    recs = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    recs = [r for r in recs if r["step"] <= step][-n:]
    top1 = np.mean([r["top1"] for r in recs], axis=0).tolist()
    return {"loss": float(np.mean([r["loss"] for r in recs])), "top1": top1}
