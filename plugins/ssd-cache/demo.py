"""ssd-cache demo: a restarted server answers a long prompt from its disk cache.

    python plugins/ssd-cache/demo.py [--model M] [--dir D] [--port P]

Starts ``mlx_lm.server --plugin ssd-cache`` on 127.0.0.1, asks a question
about a ~1,000-token document with the openai client, stops the server with
Ctrl-C (SIGINT), starts a new one on the same cache directory and asks again.
The second answer is the same, its prompt comes from disk
(``usage.prompt_tokens_details.cached_tokens``), and it arrives much sooner.
"""

import argparse
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent


def start(model, cache_dir, port, log):
    cmd = [
        str(BIN / "mlx_lm.server"),
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--plugin",
        "ssd-cache",
        "--ssd-cache-dir",
        cache_dir,
    ]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(0.2)
    raise SystemExit("server did not start")


def ask(port):
    import openai

    doc = Path(sysconfig.get_paths()["stdlib"], "LICENSE.txt").read_text()[:4000]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=900)
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model="default_model",
        messages=[
            {"role": "system", "content": "Answer from this document:\n" + doc},
            {"role": "user", "content": "Who holds the copyright of Python?"},
        ],
        max_tokens=30,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    ttft, text, usage = None, "", None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft or time.perf_counter() - t0
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    total = time.perf_counter() - t0
    print(
        f"  time to first token {ttft:6.2f} s (all 30 tokens {total:5.1f} s); prompt "
        f"{usage.prompt_tokens} tokens, cached {usage.prompt_tokens_details.cached_tokens}",
        flush=True,
    )
    print(f"  {text!r}", flush=True)
    return text, ttft, usage.prompt_tokens_details.cached_tokens


def _fast_model():
    from mlx_lm_ext import models

    return str(models.build(models.fast_model(), progress=False))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default=None, help="default: the offline model that is fast here (doctor)"
    )
    p.add_argument("--dir", default=None, help="cache directory (default: a new temp dir)")
    p.add_argument("--port", type=int, default=8765)
    args = p.parse_args()
    model = args.model or _fast_model()
    cache_dir = args.dir or tempfile.mkdtemp(prefix="ssd-cache-demo-")
    os.makedirs(cache_dir, exist_ok=True)
    log_path = os.path.join(tempfile.gettempdir(), f"ssd-cache-demo-{os.getpid()}.log")
    answers = []
    with open(log_path, "ab") as log:
        for run in (
            "first run (cold: the whole prompt is prefilled)",
            "second run, new process (prompt cache restored from disk)",
        ):
            print(f"\n== {run}")
            proc = start(model, cache_dir, args.port, log)
            try:
                answers.append(ask(args.port))
            finally:
                proc.send_signal(signal.SIGINT)  # Ctrl-C: pending writes are flushed
                proc.wait(120)
    (text1, ttft1, _), (text2, ttft2, cached2) = answers
    same = "the same" if text1 == text2 else "DIFFERENT"
    print(
        f"\n== measured in this run: after the restart the first token came {ttft1 / ttft2:.1f}x "
        f"sooner ({ttft2:.2f} s vs {ttft1:.2f} s), {cached2} prompt tokens from disk; "
        f"answers {same}",
        flush=True,
    )
    print("\n$ mlx-lm-ext ssd-cache ls --dir", cache_dir, flush=True)
    subprocess.run([str(BIN / "mlx-lm-ext"), "ssd-cache", "ls", "--dir", cache_dir])
    print(f"\nserver logs: {log_path}")
    lines = [
        line
        for line in Path(log_path).read_text().splitlines()
        if "ssd-cache:" in line or "- disk:" in line
    ]
    print("\n".join(lines[-4:]))


if __name__ == "__main__":
    main()
