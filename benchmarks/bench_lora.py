"""The whole ``mlx_lm.lora`` step with ``--grad-checkpoint``: stock loss vs ``--loss flash-cce``.

Runs mlx-lm's own ``mlx_lm.lora`` command (its trainer, its compiled step,
LoRA, Adam) on the float32 SmolLM2-135M, once per loss, each in a fresh
process, with the flags memory-minded users run (``--grad-checkpoint``).
The step time is what mlx-lm's trainer measures per step (its
``iterations_per_second`` with one report per step, read by a training
callback), the median of the steps after the first
(which compiles); the peak is the process's ``mx.get_peak_memory()`` at the
end (weights included). Ratios are against the stock loss of the same run.

    python benchmarks/bench_lora.py [--iters 4] [--batch-size 2] [--max-seq-length 512]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import common

# Runs mlx_lm.lora's entry point as the console script does, with a training
# callback that prints each report as JSON (the printed report rounds tokens
# to 100s) and the process's peak memory at the end.
DRIVER = """
import atexit, json, sys
import mlx.core as mx
import mlx_lm.lora as lora
from mlx_lm.tuner.callbacks import TrainingCallback

class Report(TrainingCallback):
    def on_train_loss_report(self, info):
        print("REPORT", json.dumps(info), flush=True)

atexit.register(lambda: print("PEAK_BYTES", mx.get_peak_memory(), flush=True))
lora.get_reporting_callbacks = lambda *args, **kwargs: Report()  # run() ignores its argument
sys.argv = ["mlx_lm.lora", *sys.argv[1:]]
lora.main()
"""


def write_data(folder: Path, tok, seq: int, rows: int, valid: int) -> None:
    """``train.jsonl`` / ``valid.jsonl`` (``rows`` / ``valid`` examples of ``seq`` tokens).

    Python's LICENSE in pieces, repeated as needed: this measures time, not learning.
    """
    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    ids = tok.encode(text)
    seq -= 1  # the trainer appends EOS
    pieces = [tok.decode(ids[i * seq : (i + 1) * seq]) for i in range(len(ids) // seq)]
    if not pieces:
        raise SystemExit(f"the text is shorter than {seq} tokens")
    pieces = (pieces * ((rows + valid) // len(pieces) + 1))[: rows + valid]  # timing, not learning
    for name, part in (("train", pieces[:rows]), ("valid", pieces[rows:])):
        with open(folder / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": p}) + "\n" for p in part)


def one_run(model: Path, data: Path, loss: str, a) -> dict:
    cmd = [
        sys.executable, "-c", DRIVER,
        "--model", str(model), "--train", "--data", str(data), "--loss", loss,
        "--iters", str(a.iters), "--batch-size", str(a.batch_size),
        "--max-seq-length", str(a.max_seq_length), "--num-layers", str(a.num_layers),
        "--grad-checkpoint", "--steps-per-report", "1", "--steps-per-eval", str(a.iters + 1),
        "--val-batches", "1", "--adapter-path", str(data / f"adapters-{loss}"),
    ]  # fmt: skip
    env = {**os.environ, "NO_COLOR": "1", "TERM": "dumb"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"mlx_lm.lora --loss {loss} failed (exit {proc.returncode})")
    out = proc.stdout.splitlines()
    reports = [json.loads(x.split(" ", 1)[1]) for x in out if x.startswith("REPORT ")]
    steps = [{"loss": r["train_loss"], "seconds": 1 / r["iterations_per_second"]} for r in reports]
    peak = [int(x.split()[1]) for x in out if x.startswith("PEAK_BYTES")]
    if len(steps) != a.iters or not peak:
        sys.stderr.write(proc.stdout[-3000:])
        raise SystemExit(f"mlx_lm.lora --loss {loss}: {len(steps)} reports of {a.iters} read")
    logs = [x for x in (proc.stdout + proc.stderr).splitlines() if x.startswith("flash-cce")]
    return {"steps": steps, "peak_bytes": peak[0], "log": logs}


def summary(runs: dict) -> list:
    rows, base = [], None
    for loss, r in runs.items():
        after = [s["seconds"] for s in r["steps"][1:]]
        med, peak = statistics.median(after), r["peak_bytes"] / 2**20
        base = base or (med, peak)
        rows.append(
            [
                "stock (`--loss default`)" if loss == "default" else f"`--loss {loss}`",
                f"{med:.2f}",
                f"{min(after):.2f}-{max(after):.2f}",
                f"{peak:.0f}",
                f"{med / base[0]:.2f}x",
                f"{base[1] / peak:.2f}x less" if loss != "default" else "1",
                f"{r['steps'][-1]['loss']:.3f}",
            ]
        )
    return rows


COLUMNS = ["loss", "s/step", "range", "process peak MiB", "time vs stock", "peak vs stock", "loss"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-f32", help="an offline model name")
    p.add_argument("--iters", type=int, default=4, help="steps per loss; the first compiles")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--max-seq-length", type=int, default=512, help="also each example's length")
    p.add_argument("--num-layers", type=int, default=16, help="LoRA layers (mlx-lm's default)")
    p.add_argument("--losses", nargs="+", default=["default", "flash-cce"])
    p.add_argument("--json", default=None, help="write the figures and the header here")
    p.add_argument("--figures", default=None, help="name of a README figures block to print")
    a = p.parse_args()
    if a.iters < 2 or a.batch_size < 1 or a.max_seq_length < 8:
        p.error("--iters must be >= 2, --batch-size >= 1, --max-seq-length >= 8")
    if a.losses[0] != "default":
        p.error("--losses must start with default (the ratios' reference)")
    from mlx_lm.utils import load_tokenizer

    from mlx_lm_ext import models

    info = common.print_header()
    model = models.build(a.model, progress=False)
    print(
        f"mlx_lm.lora on {a.model}: {a.iters} steps per loss, batch {a.batch_size} x "
        f"{a.max_seq_length} tokens, LoRA on {a.num_layers} layers, --grad-checkpoint; "
        f"s/step is the median of the {a.iters - 1} steps after the first, fresh process per loss",
        flush=True,
    )
    runs = {}
    with tempfile.TemporaryDirectory() as d:
        write_data(
            Path(d), load_tokenizer(model), a.max_seq_length, a.batch_size * a.iters, a.batch_size
        )
        for loss in a.losses:
            runs[loss] = one_run(model, Path(d), loss, a)
            for line in runs[loss]["log"]:
                print(f"  {line}", flush=True)
    rows = summary(runs)
    print(common.table(COLUMNS, rows))
    if a.figures:
        print(common.figures_block(a.figures, COLUMNS, rows))
    if a.json:
        common.dump_json(a.json, {"runs": runs, "columns": COLUMNS, "rows": rows}, info)


if __name__ == "__main__":
    main()
