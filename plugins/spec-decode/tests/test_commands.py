"""End to end through mlx-lm's own commands: mlx_lm.generate --verbose and
mlx_lm.server with the openai client (127.0.0.1 only)."""

import socket
import subprocess
import sys
import time

import pytest

PROMPT = "Repeat exactly: " + " ".join(["one two three four five six seven eight nine ten."] * 2)


def run_generate(model, *extra):
    cmd = [
        sys.executable,
        "-m",
        "mlx_lm",
        "generate",
        "--model",
        str(model),
        "--prompt",
        PROMPT,
        "--max-tokens",
        "24",
        *extra,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_generate_verbose_prints_figures_and_matches_stock(tiny_model):
    model = tiny_model("llama")
    stock = run_generate(model, "--verbose", "True")
    assert stock.returncode == 0, stock.stderr
    ours = run_generate(
        model,
        "--plugin",
        "spec-decode",
        "--drafter",
        "ngram",
        "--ngram-min",
        "1",
        "--verbose",
        "True",
    )
    assert ours.returncode == 0, ours.stderr
    assert "Speculative decoding (ngram): drafted" in ours.stdout
    assert "tokens per target forward" in ours.stdout
    text = lambda out: out.split("==========")[1]  # noqa: E731
    assert text(ours.stdout) == text(stock.stdout)


def test_generate_with_a_draft_model_and_prompt_lookup(tiny_model):
    """``--draft-lookup``: mlx-lm's own --draft-model, the lookup first."""
    model = tiny_model("llama")
    stock = run_generate(model, "--verbose", "True")
    args = ["--plugin", "spec-decode", "--draft-model", str(model), "--draft-lookup"]
    ours = run_generate(model, *args, "--verbose", "True")
    assert ours.returncode == 0, ours.stderr
    assert "Speculative decoding (ngram+draft-model): drafted" in ours.stdout
    text = lambda out: out.split("==========")[1]  # noqa: E731
    assert text(ours.stdout) == text(stock.stdout)
    bad = run_generate(model, "--plugin", "spec-decode", "--draft-lookup")
    assert bad.returncode == 2 and "--draft-lookup adds prompt lookup" in bad.stderr


def test_generate_refuses_bad_options(tiny_model):
    model = tiny_model("llama")
    bad = run_generate(model, "--plugin", "spec-decode", "--ngram-min", "5", "--ngram-max", "2")
    assert bad.returncode == 2 and "ngram" in bad.stderr
    bad = run_generate(model, "--plugin", "spec-decode", "--drafter", "draft-model")
    assert bad.returncode == 2 and "--draft-model" in bad.stderr


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tiny_model, request):
    model = tiny_model("llama")
    flags = getattr(request, "param", ["--drafter", "ngram", "--ngram-min", "1"])
    flags = [str(tiny_model(f[1:])) if f.startswith("@") else f for f in flags]
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlx_lm",
            "server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--plugin",
            "spec-decode",
            "--num-draft-tokens",
            "4",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    import urllib.request

    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            break
        except Exception:
            if proc.poll() is not None:
                raise RuntimeError(proc.stdout.read()) from None
            time.sleep(0.5)
    yield f"http://127.0.0.1:{port}/v1", proc
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def test_server_usage_carries_acceptance(server):
    from openai import OpenAI

    base, proc = server
    client = OpenAI(base_url=base, api_key="none", timeout=120, max_retries=0)
    msgs = [{"role": "user", "content": PROMPT}]
    r = client.chat.completions.create(
        model="default_model", messages=msgs, max_tokens=24, temperature=0
    )
    usage = r.usage.model_dump()
    spec = usage["speculative_decoding"]
    assert spec["drafter"] == "ngram" and spec["emitted"] == usage["completion_tokens"]
    assert spec["drafted"] >= spec["accepted"] >= 0 and spec["forwards"] >= 1
    details = usage["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] == spec["accepted"]
    assert details["rejected_prediction_tokens"] == spec["drafted"] - spec["accepted"]

    # Same request again: served from the prompt cache, same greedy text.
    r2 = client.chat.completions.create(
        model="default_model", messages=msgs, max_tokens=24, temperature=0
    )
    assert r2.choices[0].message.content == r.choices[0].message.content
    assert r2.usage.model_dump()["prompt_tokens_details"]["cached_tokens"] > 0

    # Streaming, with sampling, usage in the last chunk.
    chunks = list(
        client.chat.completions.create(
            model="default_model",
            messages=msgs,
            max_tokens=16,
            temperature=0.7,
            top_p=0.9,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    last = chunks[-1].usage.model_dump()
    assert last["speculative_decoding"]["emitted"] == last["completion_tokens"]

    proc.terminate()
    out, _ = proc.communicate(timeout=20)
    assert out.count("Speculative decoding (ngram): drafted") >= 3, out[-3000:]


@pytest.mark.parametrize("server", [["--draft-model", "@llama", "--no-auto-off"]], indirect=True)
def test_server_with_a_draft_model(server):
    """mlx-lm's own --draft-model flag, served by this plugin's loop."""
    from openai import OpenAI

    base, proc = server
    client = OpenAI(base_url=base, api_key="none", timeout=120, max_retries=0)
    r = client.chat.completions.create(
        model="default_model",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=12,
        temperature=0,
    )
    spec = r.usage.model_dump()["speculative_decoding"]
    # The draft model is the target itself here: every draft is accepted.
    assert (
        spec["drafter"] == "draft-model"
        and spec["drafted"] > 0
        and spec["accepted"] == spec["drafted"]
    )
