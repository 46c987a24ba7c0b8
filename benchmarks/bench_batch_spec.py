"""Speculative decoding in the batched server against the stock batched server.

    source scripts/env.sh
    python benchmarks/bench_batch_spec.py                      # CPU, float32
    python benchmarks/bench_batch_spec.py --device gpu --dtype bfloat16

Two ``mlx_lm.server`` processes on the same model, started by this script
and kept up side by side: mlx-lm's own (no plugin: continuous batching) and
``--plugin spec-decode`` (n-gram drafter, batched). For each prompt kind
(grounded: code edits and quoting, the answer copies its input; open: chat)
and each concurrency C, C clients send the kind's whole prompt pool (eight
requests) to one server, then to the other: client j sends its share one
request after another, so C requests are in flight until the pool runs
out, as concurrent users keep a server busy (a request that finishes early
frees its slot for the next, rather than leaving the batch to its slowest
row). ``--repeats`` times, interleaved; the best run of each is kept.
Columns: aggregate tok/s (completion tokens over the wall time from the
first request sent to the last answer), mean per-request latency, the
ratio of ours to stock, the acceptance of drafted tokens, and ``same``
(every greedy text identical to stock's). ``ours`` drafts token trees where
its drafter proposes them (the default ``--draft-tree auto``); ``--trees``
adds a third server drafting chains only (``--draft-tree off``) and a
second table: trees against chains at the same drafter, tok/s and tokens
per target forward.

``--dtype`` casts the float32 SmolLM2 folder's weights into a folder of its
own; ``--device`` is MLX's default device inside both servers.
"""

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_spec_decode import passage, stdlib_function  # noqa: E402
from common import (  # noqa: E402
    add_device_args,
    add_target_args,
    batch_levels,
    print_header,
    target_name,
    target_path,
)

SERVE = (
    "import sys, mlx.core as mx; mx.set_default_device(getattr(mx, sys.argv.pop(1))); "
    "from mlx_lm.server import main; sys.argv[0] = 'mlx_lm.server'; main()"
)


def grounded():
    fns = [
        ("textwrap", "indent"),
        ("bisect", "insort_right"),
        ("textwrap", "dedent"),
        ("bisect", "bisect_left"),
        ("shlex", "quote"),
        ("fnmatch", "translate"),
    ]
    out = [
        f"Here is a function from Python's standard library:\n\n{stdlib_function(m, f)}\n"
        "Rewrite this function with every local variable renamed to a longer, clearer "
        "name. Output the complete code only."
        for m, f in fns
    ]
    out.append(
        "Read this passage:\n\n"
        + passage()
        + "\n\nWho created Python, and where? Answer with exact quotes from the passage."
    )
    out.append(
        "Read this passage:\n\n"
        + passage()
        + "\n\nQuote the passage's first two sentences exactly, then summarise it."
    )
    return out


OPEN = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain to a child why the sky is blue and why sunsets are red.",
    "Give me three ideas for a weekend trip in the mountains, with reasons.",
    "What makes a good cup of tea? Answer in a friendly tone.",
    "Describe a busy market in the morning, in a few sentences.",
    "Why do cats purr? Explain briefly.",
    "Write a limerick about a forgetful robot.",
    "Suggest a name for a bakery and explain the choice.",
]


def cast_folder(src: Path, dtype: str) -> Path:
    """A copy of ``src`` with its floating-point weights in ``dtype``."""
    import mlx.core as mx

    dst = Path(tempfile.mkdtemp(prefix=f"smollm2-{dtype}-"))
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            w = mx.load(str(f))
            cast = {
                k: v.astype(getattr(mx, dtype)) if mx.issubdtype(v.dtype, mx.floating) else v
                for k, v in w.items()
            }
            mx.save_safetensors(str(dst / f.name), cast, metadata={"format": "mlx"})
        elif f.is_file():
            shutil.copy(f, dst / f.name)
    return dst


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model, device, *flags):
    port = free_port()
    cmd = [sys.executable, "-c", SERVE, device, "--model", str(model)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), *flags]
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return port, proc
        except Exception:
            if proc.poll() is not None:
                log.seek(0)
                sys.exit(f"server failed:\n{log.read()[-3000:]}")
            time.sleep(0.5)
    sys.exit("server did not start")


def ask(port, prompt, max_tokens):
    body = json.dumps(
        {
            "model": "default_model",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    text, usage = [], None
    with urllib.request.urlopen(req, timeout=1800) as resp:
        for line in resp:
            line = line.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    text.append(choice["delta"]["content"])
    return {"usage": usage, "text": "".join(text)}, time.perf_counter() - t0


def burst(port, prompts, max_tokens, clients=None):
    """``prompts`` over ``clients`` concurrent clients (default: one each), each
    sending its share (client j: every ``clients``-th from j) one after another."""
    clients = clients or len(prompts)
    shares = [list(range(j, len(prompts), clients)) for j in range(clients)]
    res = [None] * len(prompts)

    def client(share):
        for i in share:
            res[i] = ask(port, prompts[i], max_tokens)

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(clients) as ex:
        list(ex.map(client, shares))
    wall = time.perf_counter() - t0
    tokens = sum(r["usage"]["completion_tokens"] for r, _ in res)
    spec = [r["usage"].get("speculative_decoding") for r, _ in res]
    drafted = sum(s["drafted"] for s in spec if s)
    accepted = sum(s["accepted"] for s in spec if s)
    forwards = sum(s["forwards"] for s in spec if s)
    return {
        "tpf": sum(s["emitted"] for s in spec if s) / forwards if forwards else 1.0,
        "trees": sum(s.get("tree_rounds", 0) for s in spec if s),
        "tps": tokens / wall,
        "latency": sum(t for _, t in res) / len(res),
        "texts": [r["text"] for r, _ in res],
        "accept": accepted / drafted if drafted else 0.0,
        "drafted": drafted,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_args(ap, "cpu")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kinds", default="grounded,open")
    ap.add_argument(
        "--trees",
        action="store_true",
        help="also run a third server drafting chains only (--draft-tree off) and "
        "print a table of token trees against chains",
    )
    add_target_args(ap)
    args = ap.parse_args()
    print_header()
    levels, kinds = batch_levels(ap, args)

    model = target_path(args, args.dtype)  # a stand-in is built in --dtype
    if args.dtype != "float32" and not args.standin:
        model = cast_folder(model, args.dtype)
    env_note = os.environ.get("LD_PRELOAD", "") and " (LD_PRELOAD set)"
    print(f"# {target_name(args, args.dtype)} on {args.device}{env_note}, {args.max_tokens} tokens")
    servers = {
        "stock": start(model, args.device),
        "ours": start(model, args.device, "--plugin", "spec-decode"),
    }
    if args.trees:
        flags = ("--plugin", "spec-decode", "--draft-tree", "off")
        servers["chain"] = start(model, args.device, *flags)
    rows, tree_rows = [], []
    try:
        for port, _ in servers.values():  # warm up (first-call compiles, caches)
            burst(port, OPEN[:2], 8)
            # Two grounded rows at once: drafting rounds, rows rolling back
            # apart and finishing with holes (on a GPU, kernels compiled on first use).
            burst(port, grounded()[:2], 48)
        for kind in kinds:
            pool = grounded() if kind == "grounded" else OPEN
            for c in levels:
                best = {}
                for _ in range(args.repeats):
                    for name, (port, _) in servers.items():
                        r = burst(port, pool, args.max_tokens, clients=c)
                        if name not in best or r["tps"] > best[name]["tps"]:
                            best[name] = r
                s, o = best["stock"], best["ours"]
                row = (
                    f"| {kind} | {c} | {s['tps']:.2f} | {o['tps']:.2f} | "
                    f"{o['tps'] / s['tps']:.2f}x | {s['latency']:.2f} | {o['latency']:.2f} | "
                    f"{100 * o['accept']:.0f}% | {'yes' if s['texts'] == o['texts'] else 'no'} |"
                )
                print(row, flush=True)
                rows.append(row)
                if args.trees:
                    ch = best["chain"]
                    tree_rows.append(
                        f"| {kind} | {c} | {ch['tps']:.2f} | {o['tps']:.2f} | "
                        f"{o['tps'] / ch['tps']:.2f}x | {ch['tpf']:.2f} | {o['tpf']:.2f} | "
                        f"{o['trees']} | {'yes' if ch['texts'] == s['texts'] else 'no'} |"
                    )
                    print(tree_rows[-1], flush=True)
    finally:
        for _, proc in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    print()
    print(
        "| prompts | concurrency | stock tok/s | ours tok/s | ratio | "
        "stock latency s | ours latency s | accept | same |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if tree_rows:
        print()
        print(
            "| prompts | concurrency | chains tok/s | trees tok/s | trees/chains | "
            "chains tok/fwd | trees tok/fwd | tree rounds | chains same |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        print("\n".join(tree_rows))


if __name__ == "__main__":
    main()
