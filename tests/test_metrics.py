"""The host's checks on plugins' ``metrics`` results, in process (no server)."""

import argparse
import json

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
    assert status_page.quantile(buckets, 0.25) == (0.1, False)
    value, above = status_page.quantile(buckets, 0.5)
    assert abs(value - 0.55) < 1e-9 and not above
    # in +Inf: only known to be above the last finite bound
    assert status_page.quantile(buckets, 0.9) == (1.0, True)
    assert status_page.quantile([(0.1, 0.0), (float("inf"), 0.0)], 0.5) is None


def test_latency_percentiles_are_observed_values_never_a_bucket_bound():
    """The times a newcomer saw: p90 read 120 s (the top bucket) for a 254.7 s prefill."""
    s = metrics.make_series()
    times = [0.56, 5.5, 7.5, 254.7]
    for t in times:
        s.ttft.observe(t)
        s.recent["ttft"].append(t)
    fam = next(
        f for f in s.registry.collect() if f.name == metrics.PREFIX + "time_to_first_token_seconds"
    )
    exact = status_page.histogram(metrics.as_dict(fam), recent=list(s.recent["ttft"]))
    assert (exact["p50"], exact["p90"]) == (5.5, 254.7)
    # From the buckets alone the p90 is only a lower bound, and says so.
    bucketed = status_page.histogram(metrics.as_dict(fam))
    assert bucketed["p90_above"] and status_page.fmt_quantile(bucketed, "p90") == "> 120.00 s"
    host = [metrics.as_dict(f) for f in s.registry.collect()]
    host.append(metrics.as_dict(metrics.uptime_family()))
    rows = {
        r[2]: r[1]
        for t in status_page.host_tables(
            {"model": "m", "plugins": []}, status_page.figures(host, s)
        )
        for r in t["rows"]
    }
    assert rows["ttft"] == "5.50 s / 254.70 s"


def test_history_draws_ratios_and_rates_per_interval():
    h = status_page.History()
    h.add(0.0, {"a_total": 0, "b_total": 0})
    h.add(5.0, {"a_total": 5, "b_total": 10})
    h.add(10.0, {"a_total": 5, "b_total": 10})
    ratio, rate = h.charts([("r", "a_total", "b_total", ""), ("s", "a_total", "", "")])
    assert ratio["points"] == [[5.0, 0.5], [10.0, None]]  # no lookups: a gap, not 0%
    assert rate["points"] == [[5.0, 1.0], [10.0, 0.0]]


def test_paths_are_shown_on_loopback_to_loopback_names_or_with_the_flag():
    from mlx_lm_ext.monitoring import show_paths

    def ns(host, flag=False):
        return argparse.Namespace(host=host, status_show_paths=flag)

    assert show_paths(ns("127.0.0.1"), "127.0.0.1:8080")
    assert show_paths(ns("localhost"), "localhost:8080")
    assert show_paths(ns("::1"), "[::1]:8080")
    assert not show_paths(ns("127.0.0.1"), "attacker.example:8080")  # DNS rebinding
    assert not show_paths(ns("127.0.0.1"), None)
    assert not show_paths(ns("0.0.0.0"), "127.0.0.1:8080")  # reachable from the network
    assert show_paths(ns("0.0.0.0", flag=True), "server.lan:8080")


def test_redacted_summary_keeps_only_the_last_part_of_paths():
    info = {
        "model": "/home/someone/models/smollm2",
        "names": ["p"],
        "plugins": [
            {
                "name": "p",
                "dist": "mlx-lm-p",
                "version": "1.0",
                "options": {"--cache-dir": "/home/someone/.cache/p", "--size": 3, "--on": True},
            }
        ],
    }
    doc = status_page.summary(info, None, status_page.History(), [], metrics.make_series())
    doc["errors"] = {"p": "cannot open /home/someone/.cache/p/x.bin: denied"}
    shown = status_page.redact(doc)
    assert "/home/someone" not in json.dumps(shown, ensure_ascii=False)
    assert shown["model"] == "…/smollm2" and shown["title"].endswith("…/smollm2")
    assert shown["plugins"][0]["options"] == {"--cache-dir": "…/p", "--size": 3, "--on": True}
    assert shown["errors"]["p"] == "cannot open …/x.bin: denied"
    rows = {r[2]: r[1] for t in shown["tables"] for r in t["rows"]}
    assert rows["option.p.--cache-dir"] == "…/p" and rows["option.p.--size"] == "3"
    assert status_page.redact_path("mlx-community/SmolLM2-135M") == "mlx-community/SmolLM2-135M"
    assert status_page.redact_path("3 / 4") == "3 / 4"
