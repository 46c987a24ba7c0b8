"""The host's checks on plugins' ``metrics`` results, in process (no server)."""

import argparse

from prometheus_client.parser import text_string_to_metric_families

from mlx_lm_ext import metrics, status_page


def test_a_bad_metrics_result_costs_only_that_plugin(host):
    host.activate("testplugin", "server", argparse.Namespace(testplugin_mode="metrics-bad"))
    host.activate("serveronly", "server", argparse.Namespace())
    out = metrics.plugin_families(None)
    fams, error = out["testplugin"]
    assert fams == [] and "not a metric family" in error
    assert [f.name for f in out["serveronly"][0]] == ["mlx_lm_serveronly_up"]
    text = metrics.exposition(None).decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert "mlx_lm_serveronly_up" in names and "mlx_lm_requests" in names
    assert not any(n.startswith("mlx_lm_testplugin") for n in names)


def test_histogram_quantiles_follow_prometheus():
    buckets = [(0.1, 2.0), (1.0, 6.0), (float("inf"), 8.0)]
    assert status_page.quantile(buckets, 0.25) == 0.1
    assert abs(status_page.quantile(buckets, 0.5) - 0.55) < 1e-9
    assert status_page.quantile(buckets, 0.9) == 1.0  # in +Inf: the last finite bound
    assert status_page.quantile([(0.1, 0.0), (float("inf"), 0.0)], 0.5) is None


def test_history_draws_ratios_and_rates_per_interval():
    h = status_page.History()
    h.add(0.0, {"a_total": 0, "b_total": 0})
    h.add(5.0, {"a_total": 5, "b_total": 10})
    h.add(10.0, {"a_total": 5, "b_total": 10})
    ratio, rate = h.charts([("r", "a_total", "b_total", ""), ("s", "a_total", "", "")])
    assert ratio["points"] == [[5.0, 0.5], [10.0, None]]  # no lookups: a gap, not 0%
    assert rate["points"] == [[5.0, 1.0], [10.0, 0.0]]
