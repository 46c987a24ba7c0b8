"""Helpers shared by the flash-cce tests (imported by name: conftest puts this folder on sys.path)."""

import json
import os
import random
import sysconfig
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"


def stock_ce(logits, targets, softcap=None, logit_scale=None):
    """mlx's own cross-entropy of (scaled, capped) logits, per token, float32."""
    z = logits.astype(mx.float32)
    if logit_scale is not None:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * mx.tanh(z / softcap)
    return nn.losses.cross_entropy(z, targets)


def max_abs(a, b):
    return mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item()


# MLX's CUDA backend runs float32 matmuls at reduced (TF32-like) precision, so
# two float32 computations of the same loss agree less closely there.
ON_GPU = mx.default_device() == mx.gpu
SLACK = 300.0 if ON_GPU else 1.0


def near(a, b, rel):
    """``a`` equals ``b`` to ``rel`` (times SLACK) relative to ``b``'s largest entry."""
    scale = max(mx.abs(b.astype(mx.float32)).max().item(), 1e-30)
    return max_abs(a, b) <= rel * SLACK * scale


def real_paragraphs(min_words=20):
    """Paragraphs of real English prose from CPython's LICENSE.txt."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    return [" ".join(p.split()) for p in text.split("\n\n") if len(p.split()) >= min_words]


def openblas_env():
    """Environment for subprocesses doing float32 work (OpenBLAS when present)."""
    env = dict(os.environ)
    if os.path.exists(OPENBLAS):
        env["LD_PRELOAD"] = OPENBLAS
    return env


def write_dataset(folder, n_train=8, n_valid=4, chars=200, seed=0):
    """A tiny mlx-lm ``{"text": ...}`` JSONL dataset of real text."""
    paras = real_paragraphs()
    random.Random(seed).shuffle(paras)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", paras[:n_train]), ("valid", paras[n_train : n_train + n_valid])):
        with open(folder / f"{name}.jsonl", "w") as f:
            for p in part:
                f.write(json.dumps({"text": p[:chars]}) + "\n")
    return folder
