"""Speculative decoding's series for the server's ``/metrics`` and ``/status``.

Each request's ``SpecStats`` (in the request's info dict) is folded into
per-drafter totals when the host reports the request finished
(``request_finished``); ``metrics`` reports the totals.
"""

import threading
from collections import defaultdict
from typing import Any, Dict, List, Optional

from prometheus_client.core import Metric

from mlx_lm_ext.api import counter, gauge

P = "mlx_lm_spec_decode_"

# (SpecStats field or derived key, series name, help)
COUNTERS = (
    ("requests", "requests", "Requests served by the verify loop"),
    ("drafted", "drafted", "Drafted tokens the target verified"),
    ("accepted", "accepted", "Drafted tokens the target accepted"),
    ("emitted", "emitted", "Tokens the verify loop emitted"),
    ("forwards", "target_forwards", "Target forwards that produced tokens"),
    ("draft_rounds", "rounds", "Target forwards that verified at least one drafted token"),
    ("auto_off", "auto_off", "Requests where drafting switched itself off (slower than plain)"),
    ("fallback", "fallbacks", "Requests decoded plainly (the cache could not be rolled back)"),
)

CHARTS = [("Draft acceptance rate (spec-decode)", P + "accepted_total", P + "drafted_total")]

_lock = threading.Lock()
_totals: Dict[str, Dict[str, int]] = defaultdict(lambda: defaultdict(int))


def fold(info: Dict[str, Any]) -> None:
    """Add a finished request's figures to its drafter's totals."""
    s = info.get("spec-decode")
    if s is None:
        return
    with _lock:
        t = _totals[s.drafter]
        t["requests"] += 1
        for key in ("drafted", "accepted", "emitted", "forwards", "draft_rounds"):
            t[key] += int(getattr(s, key))
        t["auto_off"] += int(bool(s.auto_off))
        t["fallback"] += int(bool(s.fallback))


def families() -> Optional[List[Metric]]:
    """Totals per drafter (label ``drafter``), and tokens per target forward."""
    with _lock:
        totals = {d: dict(t) for d, t in _totals.items()}
    out = []
    for key, name, doc in COUNTERS:
        values = {(d,): t.get(key, 0) for d, t in sorted(totals.items())}
        out.append(counter(P + name, doc, values, labels=["drafter"]))
    per_forward = {
        (d,): t["emitted"] / t["forwards"] for d, t in sorted(totals.items()) if t.get("forwards")
    }
    out.append(
        gauge(
            P + "tokens_per_target_forward",
            "Tokens emitted per target forward, since start",
            per_forward,
            labels=["drafter"],
        )
    )
    return out


def reset() -> None:
    """Forget the totals (tests)."""
    with _lock:
        _totals.clear()
