"""Speculative decoding's series (``metrics`` hook): folding, and on a real server."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlx_lm_ext.metrics import render
from mlx_lm_spec_decode import metrics
from mlx_lm_spec_decode.stats import SpecStats


def samples(families):
    text = render(families).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_requests_fold_into_per_drafter_totals():
    metrics.reset()
    a = SpecStats("ngram", 3, drafted=10, accepted=7, emitted=20, forwards=12, draft_rounds=5)
    b = SpecStats("ngram", 3, drafted=4, accepted=1, emitted=6, forwards=5, draft_rounds=2)
    b.auto_off = True
    c = SpecStats("suffix", 3, drafted=8, accepted=8, emitted=9, forwards=1, draft_rounds=1)
    for s in (a, b, c):
        metrics.fold({"spec-decode": s})
    metrics.fold({})  # a request the loop did not serve
    got = samples(metrics.families())
    ngram, suffix = (("drafter", "ngram"),), (("drafter", "suffix"),)
    assert got[("mlx_lm_spec_decode_requests_total", ngram)] == 2
    assert got[("mlx_lm_spec_decode_drafted_total", ngram)] == 14
    assert got[("mlx_lm_spec_decode_accepted_total", ngram)] == 8
    assert got[("mlx_lm_spec_decode_rounds_total", ngram)] == 7
    assert got[("mlx_lm_spec_decode_auto_off_total", ngram)] == 1
    assert got[("mlx_lm_spec_decode_tokens_per_target_forward", ngram)] == pytest.approx(26 / 17)
    assert got[("mlx_lm_spec_decode_accepted_total", suffix)] == 8
    metrics.reset()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url):
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read().decode()


@pytest.mark.slow
def test_server_series_match_the_responses_usage(smollm2_f32_path, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        str(Path(sys.executable).with_name("mlx_lm.server")),
        *("--model", str(smollm2_f32_path), "--port", str(port), "--plugin", "spec-decode"),
    ]
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        for _ in range(600):
            try:
                get(url + "/health")
                break
            except OSError:
                assert proc.poll() is None, (tmp_path / "server.log").read_text()
                time.sleep(0.5)
        usages = []
        for content in ("Repeat exactly: red green blue red green blue red green blue", "Say hi."):
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": 24}
            req = urllib.request.Request(
                url + "/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=300) as r:
                usages.append(json.loads(r.read())["usage"]["speculative_decoding"])
        text = get(url + "/metrics")
    finally:
        proc.kill()
        proc.wait()
        log.close()
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    ngram = (("drafter", "ngram"),)
    assert got[("mlx_lm_spec_decode_requests_total", ngram)] == 2
    for key, name in (("drafted", "drafted"), ("accepted", "accepted"), ("emitted", "emitted")):
        assert got[(f"mlx_lm_spec_decode_{name}_total", ngram)] == sum(u[key] for u in usages)
    assert got[("mlx_lm_spec_decode_target_forwards_total", ngram)] == sum(
        u["forwards"] for u in usages
    )
