"""Decode speed of ``mlx_lm.server`` with and without the status instrumentation.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/bench_status_overhead.py

One process runs mlx-lm's own HTTP server (``ThreadingHTTPServer`` with its
``APIHandler`` and ``ResponseGenerator``) on SmolLM2-135M-Instruct
(float32). Rounds alternate (ABBA) between:

- ``stock``: mlx-lm's handler as shipped (the host's ``server.metrics`` and
  ``server.routes`` patches undone);
- ``status``: both installed (``monitoring.install``), the sampler thread
  running and a client polling ``/status.json`` every 3 s, as an open status
  page does.

Each round streams one greedy request; decode tok/s is (tokens - 1) over the
time from the first to the last streamed token, seen by the client. The
table gives the median per arm and the ratio ``status / stock``
(target: >= 0.99, i.e. at most 1% overhead). On a shared CPU the rounds'
spread is wider than 1%, so the script also times the per-token path the
instrumentation adds (the wrapped ``_await_response``, alone, 200,000
calls) and gives it as a share of a stock decode step.
"""

import argparse
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from http.server import ThreadingHTTPServer

import mlx_lm_ext
from mlx_lm_ext import metrics, models, monitoring, patching

PROMPT = "Write a long story about a lighthouse keeper and a storm. Use many details."


def server_args(model):
    return argparse.Namespace(
        model=str(model), adapter_path=None, host="127.0.0.1", port=0, allowed_origins=["*"],
        draft_model=None, num_draft_tokens=3, trust_remote_code=False, log_level="WARNING",
        chat_template="", use_default_chat_template=False, temp=0.0, top_p=1.0, top_k=0,
        min_p=0.0, max_tokens=512, chat_template_args={}, decode_concurrency=32,
        prompt_concurrency=8, prefill_step_size=2048, prompt_cache_size=10,
        prompt_cache_bytes=None, kv_bits=None, kv_group_size=64, quantized_kv_start=0,
        pipeline=False,
    )  # fmt: skip


def start(model):
    server = sys.modules["mlx_lm.server"]
    args = server_args(model)
    rg = server.ResponseGenerator(server.ModelProvider(args), server.LRUPromptCache(10))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), lambda *a, **kw: server.APIHandler(rg, *a, **kw))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return args, rg, httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def stream(url, max_tokens):
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    first = last = None
    tokens = 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"]:
                now = time.perf_counter()
                first = first or now
                last = now
    return tokens, (tokens - 1) / (last - first)


def poll(url, stop):
    while not stop.wait(3.0):
        with urllib.request.urlopen(url + "/status.json", timeout=60) as r:
            r.read()


def per_token_cost(n=200_000):
    """Seconds the instrumentation adds per streamed token: the handler's
    wrapped ``_await_response`` and the host's per-token figures, timed alone."""
    server = sys.modules["mlx_lm.server"]
    item = server.Response("x", 1, 0.0, None, ())
    stock = lambda self, q: item
    wrapped = monitoring._make_await(stock)
    monitoring._local.req = metrics.request_started()
    best = []
    for fn in (stock, wrapped, stock, wrapped):
        t0 = time.perf_counter()
        for _ in range(n):
            fn(None, None)
        best.append((time.perf_counter() - t0) / n)
    monitoring._local.req = None
    return min(best[1], best[3]) - min(best[0], best[2])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8, help="rounds per arm (default 8)")
    p.add_argument("--max-tokens", type=int, default=64)
    a = p.parse_args()
    mlx_lm_ext._boot.install()
    import mlx_lm.server  # noqa: F401  (patched by the start-up hook: owner "core")

    model = models.build("smollm2-135m-f32", progress=False)
    args, rg, httpd, url = start(model)
    stream(url, 16)  # load and warm up
    results = {"stock": [], "status": []}
    order = ["stock", "status", "status", "stock"] * ((a.rounds + 1) // 2)
    for arm in order[: 2 * a.rounds]:
        stop = threading.Event()
        if arm == "status":
            monitoring.install(args)
            poller = threading.Thread(target=poll, args=(url, stop), daemon=True)
            poller.start()
        else:
            patching.undo("server.metrics")
            patching.undo("server.routes")
        tokens, tps = stream(url, a.max_tokens)
        stop.set()
        results[arm].append(tps)
        print(f"{arm:7s} {tokens} tokens  {tps:.2f} tok/s", flush=True)
    httpd.shutdown()
    stock, status = (statistics.median(results[k]) for k in ("stock", "status"))
    print()
    print("| arm | rounds | decode tok/s (median) | min | max | ratio to stock |")
    print("|---|---|---|---|---|---|")
    for k, m in (("stock", stock), ("status", status)):
        r = results[k]
        print(f"| {k} | {len(r)} | {m:.2f} | {min(r):.2f} | {max(r):.2f} | {m / stock:.3f} |")
    overhead = 100 * (1 - status / stock)
    verdict = "met" if overhead <= 1 else "missed"
    print(f"\nend to end: overhead {overhead:.2f}% of decode tok/s (target <= 1%: {verdict})")
    cost = per_token_cost()
    share = 100 * cost * stock
    verdict = "met" if share <= 1 else "missed"
    print(
        f"per token: the instrumentation costs {cost * 1e6:.2f} us, "
        f"{share:.3f}% of a stock decode step ({1e3 / stock:.1f} ms) (target <= 1%: {verdict})"
    )
    sys.stdout.flush()
    os._exit(0)  # MLX's generation thread is still up; skip interpreter teardown


if __name__ == "__main__":
    main()
