"""The server's figures as Prometheus series: the host's own, the prompt cache's, the plugins'.

The host measures what every request shares, from the handler's side of
mlx-lm's response queue (``ResponseGenerator._await_response``, which the
HTTP handler thread calls for the context, then once per token): so the
same figures come out of the serial ``_serve_single`` path and the batched
``_generate`` path, and time to first token is what the client waits.
The prompt cache's memory tier is read when scraped; each plugin's series
come from its ``metrics`` hook, rendered apart so that a plugin that raises
or returns something broken loses only its own series.
"""

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from . import plugins

log = logging.getLogger("mlx_lm_ext")

PREFIX = "mlx_lm_"
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
RECENT = 2048  # exact latencies kept for the status page's percentiles (buckets only bound them)


def _recent() -> Dict[str, Any]:
    return {"ttft": collections.deque(maxlen=RECENT), "itl": collections.deque(maxlen=RECENT)}


@dataclass
class Series:
    """The host's series in one registry (one per server process)."""

    registry: CollectorRegistry
    in_flight: Gauge
    requests: Counter
    prompt_tokens: Counter
    cached_tokens: Counter
    generated_tokens: Counter
    cache_lookups: Counter
    cache_hits: Counter
    ttft: Histogram
    itl: Histogram
    started: float = field(default_factory=time.time)
    prompt_cache: Any = None  # the server's, seen on the first request or scrape
    recent: Dict[str, Any] = field(default_factory=_recent)  # the latest exact latencies


def make_series() -> Series:
    r = CollectorRegistry(auto_describe=True)
    p = PREFIX
    return Series(
        registry=r,
        in_flight=Gauge(p + "requests_in_flight", "Completion requests being served", registry=r),
        requests=Counter(
            p + "requests", "Completion requests answered, by HTTP status", ["status"], registry=r
        ),
        prompt_tokens=Counter(
            p + "prompt_tokens", "Prompt tokens of answered requests", registry=r
        ),
        cached_tokens=Counter(
            p + "cached_prompt_tokens", "Prompt tokens served from the prompt cache", registry=r
        ),
        generated_tokens=Counter(p + "generated_tokens", "Tokens generated", registry=r),
        cache_lookups=Counter(
            p + "prompt_cache_lookups", "Requests that looked up the prompt cache", registry=r
        ),
        cache_hits=Counter(
            p + "prompt_cache_hits",
            "Requests that reused cached prompt tokens (memory, or a plugin's tier)",
            registry=r,
        ),
        ttft=Histogram(
            p + "time_to_first_token_seconds",
            "From the request's arrival to its first generated token",
            buckets=TTFT_BUCKETS,
            registry=r,
        ),
        itl=Histogram(
            p + "inter_token_latency_seconds",
            "Between consecutive generated tokens of a request, as the handler receives them",
            buckets=ITL_BUCKETS,
            registry=r,
        ),
    )


_lock = threading.Lock()
_series: Optional[Series] = None


def series() -> Series:
    """This process's host series (made on first use)."""
    global _series
    with _lock:
        if _series is None:
            _series = make_series()
        return _series


# ----------------------------------------------------------- per request


@dataclass
class Request:
    """One completion request as its handler thread sees it."""

    start: float
    status: int = 0
    ctx: Any = None  # mlx-lm's GenerationContext, once generation started
    tokens: int = 0
    last: float = 0.0


def request_started() -> Request:
    series().in_flight.inc()
    return Request(start=time.perf_counter())


def on_item(req: Request, item: Any) -> None:
    """An item the handler took off the request's queue (context, token, progress, end)."""
    if hasattr(item, "finish_reason") and hasattr(item, "token"):  # a Response: one token
        now = time.perf_counter()
        s = _series
        s.generated_tokens.inc()
        if req.tokens == 0:
            s.ttft.observe(now - req.start)
            s.recent["ttft"].append(now - req.start)
        else:
            s.itl.observe(now - req.last)
            s.recent["itl"].append(now - req.last)
        req.tokens += 1
        req.last = now
    elif hasattr(item, "prompt") and hasattr(item, "prompt_cache_count"):
        req.ctx = item


def request_ended(req: Request) -> Dict[str, Any]:
    """Count the ended request; returns its info dict for ``request_finished``."""
    s = series()
    s.in_flight.dec()
    s.requests.labels(str(req.status or 500)).inc()
    ctx = req.ctx
    if ctx is None:
        return {}
    s.prompt_tokens.inc(len(ctx.prompt))
    # mlx-lm sets the count after handing the context over; by the end it is set.
    cached = getattr(ctx, "prompt_cache_count", -1)
    if cached >= 0:
        s.cache_lookups.inc()
        if cached > 0:
            s.cache_hits.inc()
            s.cached_tokens.inc(cached)
    info = getattr(ctx, "mlx_lm_ext", None)
    return info if isinstance(info, dict) else {}


# ------------------------------------------------------------ at scrape


def cache_families(prompt_cache: Any) -> List[Metric]:
    """The prompt cache's memory tier: entries and bytes, by entry type."""
    if prompt_cache is None:
        return []
    entries = GaugeMetricFamily(
        PREFIX + "prompt_cache_entries", "Prompt caches held in memory", labels=["type"]
    )
    nbytes = GaugeMetricFamily(
        PREFIX + "prompt_cache_bytes", "Bytes of prompt caches held in memory", labels=["type"]
    )
    for _ in range(3):  # the generation thread may change the cache while it is read
        try:
            by_type = prompt_cache.stats_by_type()
            break
        except RuntimeError:
            continue
    else:
        return []
    for kind, st in sorted(by_type.items()):
        entries.add_metric([kind], st["n_sequences"])
        nbytes.add_metric([kind], st["n_bytes"])
    return [entries, nbytes]


def plugin_families(prompt_cache: Any) -> Dict[str, Tuple[List[Metric], Optional[str]]]:
    """``{plugin: (families, error)}``: what each plugin's ``metrics`` gave, checked."""
    out = {}
    taken = set(series_names())
    for name, result in plugins.each("metrics", prompt_cache=prompt_cache).items():
        if result is None:
            continue
        if isinstance(result, Exception):
            log.warning("plugin '%s' failed in metrics: %s", name, result)
            out[name] = ([], f"metrics failed: {result}")
            continue
        try:
            fams = list(result)
            bad = [f for f in fams if not isinstance(f, Metric)]
            if bad:
                raise TypeError(f"not a metric family: {bad[0]!r}"[:200])
            clash = [f.name for f in fams if f.name in taken]
            if clash:
                raise ValueError(f"series name already taken: {clash[0]}")
            render(fams)  # a family that cannot be written costs this plugin, not the page
        except Exception as e:
            log.warning("plugin '%s' returned bad metrics: %s", name, e)
            out[name] = ([], f"bad metrics: {e}")
            continue
        taken.update(f.name for f in fams)
        out[name] = (fams, None)
    return out


def series_names() -> List[str]:
    return [m.name for m in series().registry.collect()] + [
        PREFIX + "prompt_cache_entries",
        PREFIX + "prompt_cache_bytes",
        PREFIX + "uptime_seconds",
    ]


class _Families:
    """A collector over fixed families (prometheus_client renders collectors)."""

    def __init__(self, families: Iterable[Metric]):
        self.families = list(families)

    def collect(self):
        return iter(self.families)


def render(families: Iterable[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)


def uptime_family() -> Metric:
    g = GaugeMetricFamily(PREFIX + "uptime_seconds", "Seconds since the status routes started")
    g.add_metric([], time.time() - series().started)
    return g


def exposition(prompt_cache: Any) -> bytes:
    """The whole ``/metrics`` body (Prometheus text format 0.0.4)."""
    parts = [generate_latest(series().registry), render([uptime_family()])]
    parts.append(render(cache_families(prompt_cache)))
    for fams, _ in plugin_families(prompt_cache).values():
        parts.append(render(fams))
    return b"".join(parts)


def as_dict(family: Metric) -> Dict[str, Any]:
    """A family as plain data (for ``/status.json``)."""
    return {
        "name": family.name,
        "type": family.type,
        "help": family.documentation,
        "samples": [
            {"name": s.name, "labels": dict(s.labels), "value": s.value} for s in family.samples
        ],
    }


def counter(name: str, doc: str, values: Dict[Tuple[str, ...], float], labels=()) -> Metric:
    """A counter family from ``{label values: total}`` (for plugins' ``metrics``)."""
    c = CounterMetricFamily(name, doc, labels=list(labels))
    for key, v in values.items():
        c.add_metric(list(key), v)
    return c


def gauge(name: str, doc: str, values: Dict[Tuple[str, ...], float], labels=()) -> Metric:
    """A gauge family from ``{label values: value}`` (for plugins' ``metrics``)."""
    g = GaugeMetricFamily(name, doc, labels=list(labels))
    for key, v in values.items():
        g.add_metric(list(key), v)
    return g
