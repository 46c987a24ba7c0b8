"""The disk tier's series (``metrics`` hook) on ``/metrics`` of a real server, and alone."""

import os
import sysconfig
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlx_lm_ext.metrics import render
from mlx_lm_ssd_cache import metrics
from mlx_lm_ssd_cache.store import RESTORE_BUCKETS, new_counters

LICENSE = os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")


def scrape(server):
    with urllib.request.urlopen(server.url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def settled(server, answered, timeout=10.0):
    """A scrape once ``answered`` requests have ended: the server counts a
    request when its handler returns, just after the client has the answer."""
    deadline = time.monotonic() + timeout
    while True:
        got = scrape(server)
        done = sum(v for (n, _), v in got.items() if n == "mlx_lm_requests_total")
        if done >= answered and got.get(("mlx_lm_requests_in_flight", ()), 0) == 0:
            return got
        if time.monotonic() > deadline:
            return got
        time.sleep(0.05)


class _Cache:
    def __init__(self, stats):
        self.stats = stats

    def disk_stats(self):
        return self.stats


def test_restore_histogram_is_cumulative_and_parses():
    s = new_counters()
    s.update(entries=3, bytes=300, pending=1, pending_bytes=10, hits=3, restore_s=0.4)
    s["restore_buckets"][0] = 1  # <= 5 ms
    s["restore_buckets"][RESTORE_BUCKETS.index(0.25)] = 1
    # the third restore took longer than the last bound: only in +Inf
    text = render(metrics.families(_Cache(s))).decode()
    got = {
        (x.name, x.labels.get("le")): x.value
        for f in text_string_to_metric_families(text)
        for x in f.samples
    }
    assert got[("mlx_lm_ssd_cache_restore_seconds_bucket", "0.005")] == 1
    assert got[("mlx_lm_ssd_cache_restore_seconds_bucket", "0.1")] == 1
    assert got[("mlx_lm_ssd_cache_restore_seconds_bucket", "0.25")] == 2
    assert got[("mlx_lm_ssd_cache_restore_seconds_bucket", "10.0")] == 2
    assert got[("mlx_lm_ssd_cache_restore_seconds_bucket", "+Inf")] == 3
    assert got[("mlx_lm_ssd_cache_restore_seconds_count", None)] == 3
    assert got[("mlx_lm_ssd_cache_disk_entries", None)] == 3
    assert got[("mlx_lm_ssd_cache_writes_pending", None)] == 1


def test_no_disk_tier_no_series():
    assert metrics.families(object()) is None


@pytest.mark.slow
def test_disk_series_move_on_a_real_server(servers, smollm2_f32_path, tmp_path):
    with open(LICENSE) as f:
        doc = f.read()[:2000]
    ask = "Answer from this document:\n" + doc + "\nWho holds the copyright?"
    d = tmp_path / "cache"
    cold = servers(smollm2_f32_path, d, tmp_path / "cold.log").wait_ready(300)
    cold.chat(ask, max_tokens=4)
    cold.stop()  # pending writes are flushed at exit

    warm = servers(smollm2_f32_path, d, tmp_path / "warm.log").wait_ready(300)
    usage = warm.chat(ask, max_tokens=4)["usage"]
    after = settled(warm, answered=1)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert after[("mlx_lm_ssd_cache_hits_total", ())] == 1
    assert after[("mlx_lm_ssd_cache_disk_entries", ())] >= 1
    assert after[("mlx_lm_ssd_cache_restored_tokens_total", ())] == cached
    assert after[("mlx_lm_ssd_cache_restore_seconds_count", ())] == 1
    assert after[("mlx_lm_ssd_cache_restore_seconds_sum", ())] > 0
    assert after[("mlx_lm_cached_prompt_tokens_total", ())] == cached  # the host's figure agrees
    assert after[("mlx_lm_prompt_cache_hits_total", ())] == 1
    assert warm.healthy()
