"""The disk tier's series for the server's ``/metrics`` and ``/status`` (the ``metrics`` hook).

Built on each scrape from the tier's own counters (``DiskTier.stats``, read
under the store's lock), so nothing here runs on the generation thread.
"""

from typing import Any, List, Optional

from prometheus_client.core import HistogramMetricFamily, Metric

from mlx_lm_ext.api import counter, gauge

from .store import RESTORE_BUCKETS

P = "mlx_lm_ssd_cache_"

# (counter key in DiskTier.stats(), series name, help)
COUNTERS = (
    ("lookups", "lookups", "Disk tier lookups"),
    ("hits", "hits", "Prompts restored from disk"),
    ("restored_tokens", "restored_tokens", "Prompt tokens restored from disk"),
    ("writes", "writes", "Entries written to disk"),
    ("written_bytes", "written_bytes", "Bytes written to disk"),
    ("failures", "write_failures", "Writes that failed (I/O errors)"),
    ("skipped", "writes_skipped", "Entries not stored (too large, backlog, unsupported)"),
    ("evicted", "evictions", "Entries evicted to keep under the byte cap"),
    ("superseded", "superseded", "Entries dropped for a longer entry of the same prompt"),
    ("removed_corrupt", "removed_corrupt", "Unreadable entry files removed"),
)

CHARTS = [("Disk hit rate (ssd-cache)", P + "hits_total", P + "lookups_total")]


def families(prompt_cache: Any, options: Any = None) -> Optional[List[Metric]]:
    """The tier's series; only its state when the server's cache has no disk tier.

    ``options``: what the plugin's ``activate`` returned (its start-up check
    of the directory), None when unknown.
    """
    stats = getattr(prompt_cache, "disk_stats", None)
    state = tier_state(options)
    if not callable(stats):
        return None if state is None else [state]
    s = stats()
    out = [state] if state is not None else []
    out += [
        gauge(P + "disk_entries", "Entries on disk", {(): s["entries"]}),
        gauge(P + "disk_bytes", "Bytes of entries on disk", {(): s["bytes"]}),
        gauge(
            P + "writes_pending", "Writes handed to the writer, not on disk yet", {(): s["pending"]}
        ),
        gauge(P + "pending_bytes", "Bytes of pending writes", {(): s["pending_bytes"]}),
    ]
    out += [counter(P + name, doc, {(): s[key]}) for key, name, doc in COUNTERS]
    out.append(restore_histogram(s))
    return out


def tier_state(options: Any) -> Optional[Metric]:
    """``disk_tier{state="on"|"read-only"|"off"}`` 1, with the start-up check's reason."""
    tier = options.get("tier") if isinstance(options, dict) else None
    if tier is None:
        return None
    reason = str(options.get("tier_reason") or "")
    labels, key = (("state", "reason"), (tier, reason)) if reason else (("state",), (tier,))
    doc = "Disk tier state (on; read-only: restores only; off), with why it is not on"
    return gauge(P + "disk_tier", doc, {key: 1}, labels)


def restore_histogram(s: dict) -> Metric:
    """Seconds to restore an entry from disk, as a Prometheus histogram."""
    h = HistogramMetricFamily(P + "restore_seconds", "Seconds to restore a prompt cache from disk")
    cumulative, buckets = 0, []
    for bound, n in zip(RESTORE_BUCKETS, s["restore_buckets"], strict=True):
        cumulative += n
        buckets.append((str(bound), cumulative))
    buckets.append(("+Inf", s["hits"]))
    h.add_metric([], buckets, sum_value=s["restore_s"])
    return h
