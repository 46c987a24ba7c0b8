"""All three plugins on one GPU machine, one table.

Runs the plugins' own benchmarks as child processes, each with ``--json``,
then prints one Markdown table with each figure beside its anchor (stock
mlx-lm measured in the same run):

- flash-cce: loss + hidden-state gradient at (N, V, H) = (8192, 151936, 2048)
  and (8192, 262144, 2560) (plus ``--flash-extra`` shapes), bf16 dense and
  4-bit heads; ms and peak MiB of the fused kernels and the cuBLAS-block
  path vs stock's (``bench_flash_cce.py --gpu-table``).
- spec-decode: tokens/s per drafter vs stock greedy on the offline SmolLM2
  model (``bench_spec_decode.py``), and the assistant drafter when
  ``--drafter-path`` is given (``bench_assistant.py``).
- ssd-cache: time to first token of 4k- and 16k-token prompts restored from
  disk vs a cold prefill, and restore throughput vs a sequential read of the
  same file (``bench_ssd_cache.py --only ttft``).

    python benchmarks/bench_gpu.py --out results/   # then read results/table.md

Each part can be skipped (``--skip flash spec ssd``), and ``--table-only``
re-prints the table from an ``--out`` folder that already holds the JSON.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import common

HERE = Path(__file__).resolve().parent


def child(args, log, timeout):
    """Run one benchmark; its output goes to ``log`` and to our stdout."""
    print(f"$ {' '.join(args)}", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            for line in proc.stdout:
                f.write(line)
                print("  " + line, end="", flush=True)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(f"  ({time.perf_counter() - t0:.0f} s, exit {proc.returncode})", flush=True)
    return proc.returncode == 0


def run_all(a, out):
    py = [
        str(HERE / "bench_flash_cce.py"),
        "--gpu-table",
        "--skip-mlx",
        "--max-stock-bytes",
        "1e11",
    ]
    if "flash" not in a.skip:
        shapes = ["8192x151936x2048", "8192x262144x2560", *a.flash_extra]
        for kind, extra in (
            ("bf16", ["--repeats", "3"]),
            ("q4", ["--repeats", "2", "--gemm-configs", "8192x8192@512"]),
        ):
            child(
                py
                + [
                    "--kinds",
                    kind,
                    "--shapes",
                    *shapes,
                    "--json",
                    str(out / f"flash-{kind}.json"),
                    *extra,
                ],
                out / f"flash-{kind}.log",
                a.timeout,
            )
    if "spec" not in a.skip:
        child(
            [
                str(HERE / "bench_spec_decode.py"),
                "--max-tokens",
                str(a.max_tokens),
                "--repeats",
                "2",
                "--json",
                str(out / "spec.json"),
            ],
            out / "spec.log",
            a.timeout,
        )
        if a.drafter_path:
            child(
                [
                    str(HERE / "bench_assistant.py"),
                    "--drafter-path",
                    a.drafter_path,
                    *a.assistant_args.split(),
                    "--max-tokens",
                    str(a.max_tokens),
                    "--json",
                    str(out / "assistant.json"),
                ],
                out / "assistant.log",
                a.timeout,
            )
    if "ssd" not in a.skip:
        for n in a.ssd_tokens:
            child(
                [
                    str(HERE / "bench_ssd_cache.py"),
                    "--only",
                    "ttft",
                    "--tokens",
                    str(n),
                    "--repeats",
                    "3",
                    "--json",
                    str(out / f"ssd-{n}.json"),
                ],
                out / f"ssd-{n}.log",
                a.timeout,
            )


def load(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def flash_rows(out):
    """Rows of ``bench_flash_cce.py --gpu-table``: each method vs the stock
    loss of the same shape and head (the first method of a group)."""
    rows = []
    for kind in ("bf16", "q4"):
        data = load(out / f"flash-{kind}.json") or {}
        base = {}
        for r in data.get("gpu_table", []):
            key = (r["N"], r["V"], r["H"], r["head"])
            where = f"N={r['N']} V={r['V']} H={r['H']} {r['head']}"
            if "error" in r:
                rows.append((f"flash-cce {r['method']}", where, "failed", r["error"][:80]))
                continue
            if r["method"].startswith("stock"):
                base[key] = r
            ms = 1e3 * r["seconds"]
            got = f"{ms:.1f} ms" + (f", {r['peak'] / 2**20:.0f} MiB" if "peak" in r else "")
            vs = []
            b = base.get(key)
            if b is not None and b is not r:
                vs.append(f"{b['seconds'] / r['seconds']:.2f}x stock's speed")
                if "peak" in r:
                    vs.append(f"{b['peak'] / max(r['peak'], 1):.0f}x less memory")
            rows.append((f"flash-cce {r['method']}", where, got, "; ".join(vs) or "-"))
    return rows


def spec_rows(out):
    rows = []
    data = load(out / "spec.json")
    for part in ("float32", "q4"):
        for r in (data or {}).get(part, []):
            if r["method"] == "stock":
                base = r["tps"]
                continue
            rows.append(
                (
                    "spec-decode " + r["method"],
                    f"{r['prompt']} ({part} target)",
                    f"{r['tps']:.0f} tok/s, accept {r['accept'] or '-'}, {r['tpf']} tok/fwd",
                    f"stock {base:.0f} tok/s: {r['ratio']:.2f}x; same text: {r['same']}",
                )
            )
    data = load(out / "assistant.json") or {}
    for key, r in data.get("summary", {}).items():  # "open/assistant": geometric means
        cat, method = key.split("/")
        acc = f"{100 * r['acceptance']:.0f}%" if r.get("acceptance") is not None else "-"
        rows.append(
            (
                f"spec-decode {method} (assistant run)",
                f"{cat} prompts, {data.get('dtype') or 'float32'}",
                f"accept {acc}, {r['tokens_per_forward']:.2f} tok/fwd",
                f"{r['speed']:.2f}x stock (geometric mean); same text: {'yes' if r['same'] else 'NO'}",
            )
        )
    return rows


def ssd_rows(out):
    rows = []
    for f in sorted(out.glob("ssd-*.json"), key=lambda p: int(p.stem.split("-")[1])):
        t = (load(f) or {}).get("ttft")
        if not t:
            continue
        n, mb = t["tokens"], t["entry_bytes"] / 1e6
        rows.append(
            (
                "ssd-cache restore (pages dropped)",
                f"{n}-token prompt, {mb:.0f} MB file",
                f"TTFT {1e3 * t['restore_dropped_s']:.0f} ms",
                f"cold prefill {1e3 * t['cold_prefill_s']:.0f} ms: "
                f"{t['cold_prefill_s'] / t['restore_dropped_s']:.1f}x; stock load_prompt_cache "
                f"{1e3 * t['stock_dropped_s']:.0f} ms",
            )
        )
        rows.append(
            (
                "ssd-cache restore throughput",
                f"{n}-token prompt",
                f"{mb / t['restore_read_dropped_s']:.0f} MB/s",
                f"sequential read {mb / t['read_s']:.0f} MB/s "
                f"({t['read_s'] / t['restore_read_dropped_s']:.2f}x); stock load "
                f"{t['stock_bytes'] / 1e6 / t['stock_read_dropped_s']:.0f} MB/s",
            )
        )
    return rows


def table(out):
    rows = flash_rows(out) + spec_rows(out) + ssd_rows(out)
    head = ("what", "where", "measured", "against")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for each benchmark's log and JSON")
    p.add_argument("--skip", nargs="*", default=[], choices=["flash", "spec", "ssd"])
    p.add_argument("--flash-extra", nargs="*", default=[], help="more NxVxH shapes")
    p.add_argument("--ssd-tokens", type=int, nargs="*", default=[4096, 16384])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--drafter-path", default=None, help="a trained assistant drafter to include")
    p.add_argument(
        "--assistant-args", default="--repeats 3", help="more flags for bench_assistant.py"
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds per child benchmark")
    p.add_argument("--table-only", action="store_true")
    a = p.parse_args()
    common.print_header()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if not a.table_only:
        run_all(a, out)
    text = table(out)
    (out / "table.md").write_text(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
