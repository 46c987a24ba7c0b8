"""mlx_lm.server --plugin spec-decode stays batched: concurrent requests on
the offline SmolLM2 (float32) against the stock batched server."""

import concurrent.futures as cf
import json
import subprocess
import sys
import time
import urllib.request

import pytest
from test_commands import free_port

from mlx_lm_ext.testing import default_sigint

CODE = (
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n"
)
REQUESTS = [  # prompt, max_tokens, stop words
    ("Repeat this code exactly, renaming width to w:\n" + CODE, 48, None),
    # A stop word: whatever mlx-lm's server does with it, ours must do the same.
    ("Quote this sentence twice: the quick brown fox jumps over the lazy dog.", 32, ["fox"]),
    ("Say hi.", 12, None),
    ("Copy the list: " + ", ".join(str(i) for i in range(30)), 40, None),
]


def start(model, *flags):
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), *flags]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=default_sigint,  # the exit tests send it Ctrl-C
    )
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return f"http://127.0.0.1:{port}/v1", proc
        except Exception:
            if proc.poll() is not None:
                raise RuntimeError(proc.stdout.read()) from None
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


def stop(proc):
    proc.terminate()
    try:
        return proc.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[0]


def post(base, prompt, max_tokens, stop_words=None, temperature=0.0, stream=False):
    body = {
        "model": "default_model",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": stream,
    }
    if stop_words:
        body["stop"] = stop_words
    req = urllib.request.Request(
        f"{base}/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(req, timeout=600)


def ask(base, prompt, max_tokens, stop_words=None, temperature=0.0):
    return json.loads(post(base, prompt, max_tokens, stop_words, temperature).read())


def cancel_mid_stream(base):
    """A streamed request whose client goes away after three chunks."""
    r = post(base, "Count from one to fifty in words.", 64, stream=True)
    for _ in range(3):
        r.readline()
    r.close()


def concurrent(base):
    with cf.ThreadPoolExecutor(len(REQUESTS) + 2) as ex:
        cancelled = ex.submit(cancel_mid_stream, base)
        sampled = ex.submit(ask, base, REQUESTS[0][0], 24, None, 0.8)
        greedy = [ex.submit(ask, base, *r) for r in REQUESTS]
        cancelled.result()
        return [f.result() for f in greedy], sampled.result()


@pytest.mark.slow
def test_concurrent_greedy_requests_match_the_stock_batched_server(smollm2_f32_path):
    base, proc = start(smollm2_f32_path)
    try:
        stock, _ = concurrent(base)
    finally:
        stop(proc)
    base, proc = start(
        smollm2_f32_path, "--plugin", "spec-decode", "--num-draft-tokens", "4", "--no-auto-off"
    )
    try:
        ours, sampled = concurrent(base)
        again = ask(base, *REQUESTS[0])  # from the prompt cache the batch inserted
    finally:
        out = stop(proc)
    for s, o in zip(stock, ours, strict=True):
        assert o["choices"][0]["message"]["content"] == s["choices"][0]["message"]["content"]
        assert o["choices"][0]["finish_reason"] == s["choices"][0]["finish_reason"]
        spec = o["usage"]["speculative_decoding"]
        assert spec["emitted"] == o["usage"]["completion_tokens"]
        assert spec["drafter"] == "ngram" and spec["fallback"] is None
    assert sum(o["usage"]["speculative_decoding"]["accepted"] for o in ours) > 0
    sampled_n = sampled["usage"]["completion_tokens"]  # sampled: may meet the end token before 24
    assert 0 < sampled_n <= 24 and sampled["usage"]["speculative_decoding"]["emitted"] == sampled_n
    assert again["choices"][0]["message"]["content"] == ours[0]["choices"][0]["message"]["content"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # Batched, not one at a time; the cancelled stream only cost its handler
    # thread (a broken pipe), and the generation thread kept serving.
    assert "does not batch" not in out and "generation thread died" not in out
    assert out.count("Speculative decoding (ngram): drafted") >= len(REQUESTS) + 2
