"""The status summary: ``/status.json``, the ``/status`` page, and ``mlx-lm-ext status``.

One summary (plain data) carries the figures as readable tables, built
here once, so the page and the terminal show the same text; the page is
one self-contained HTML file (inline CSS, a small script that polls
``status.json`` and draws the trends as SVG), with no network fetches.
"""

import collections
import html
import json
import math
import os
import re
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from . import metrics

SAMPLE_S = 5.0  # one trend point per 5 s ...
KEEP = 120  # ... for the last 10 minutes
POLL_MS = 3000  # the page's refresh

HOST_CHARTS = [
    ("Generated tokens per second", metrics.PREFIX + "generated_tokens_total", ""),
    (
        "Prompt cache hit rate",
        metrics.PREFIX + "prompt_cache_hits_total",
        metrics.PREFIX + "prompt_cache_lookups_total",
    ),
]


# ------------------------------------------------------------- formatting


def fmt_seconds(x: Optional[float]) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.3f}"


def fmt_ratio(num: float, den: float) -> str:
    return f"{100 * num / den:.1f}% ({int(num)} / {int(den)})" if den else "-"


def fmt_option(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    return "-" if v is None else str(v)


def quantile(buckets: List[Tuple[float, float]], q: float) -> Optional[Tuple[float, bool]]:
    """Estimate a quantile from cumulative ``(upper bound, count)`` buckets, as
    Prometheus' ``histogram_quantile`` does (linear within a bucket).

    Returns ``(value, above)``: ``above`` when the quantile lies past the last
    finite bound, which is then ``value`` (a lower bound, not an estimate).
    """
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return (lower, True)
            return (lower + (upper - lower) * (rank - below) / max(count - below, 1e-12), False)
        lower, below = upper, count
    return (lower, True)


def exact_quantile(values: List[float], q: float) -> Optional[float]:
    """The nearest-rank quantile: the smallest observed value that at least
    ``q`` of ``values`` do not exceed (always one of the values)."""
    if not values:
        return None
    xs = sorted(values)
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


def fmt_quantile(h: Dict[str, Any], key: str) -> str:
    """A histogram's ``p50``/``p90`` as text: ``"> 120.00 s"`` past the top bucket."""
    if h.get(key + "_above"):
        return "> " + fmt_seconds(h[key])
    return fmt_seconds(h[key])


def histogram(
    family: Dict[str, Any],
    labels: Optional[Dict[str, str]] = None,
    recent: Optional[List[float]] = None,
) -> Dict[str, Any]:
    """``{count, sum, mean, p50, p90}`` of one histogram (plain family data).

    With ``recent`` (the latest observations, exact) the percentiles are
    theirs, over ``window`` of them; else they are estimated from the buckets
    and ``p50_above``/``p90_above`` say a value is only a lower bound.
    """
    labels = labels or {}
    buckets, count, total = [], 0.0, 0.0
    for s in family["samples"]:
        own = {k: v for k, v in s["labels"].items() if k != "le"}
        if own != labels:
            continue
        if s["name"].endswith("_bucket"):
            buckets.append((float(s["labels"]["le"]), s["value"]))
        elif s["name"].endswith("_count"):
            count = s["value"]
        elif s["name"].endswith("_sum"):
            total = s["value"]
    buckets.sort()
    out = {"count": count, "sum": total, "mean": total / count if count else None}
    for key, q in (("p50", 0.5), ("p90", 0.9)):
        if recent:
            out[key], out[key + "_above"] = exact_quantile(recent, q), False
        else:
            value, above = quantile(buckets, q) or (None, False)
            out[key], out[key + "_above"] = value, above
    if recent:
        out["window"] = len(recent)
    return out


def _value(families: Dict[str, Dict[str, Any]], sample: str, **labels: str) -> float:
    """Sum of a sample's values over label sets that include ``labels``."""
    total = 0.0
    for fam in families.values():
        for s in fam["samples"]:
            if s["name"] == sample and labels.items() <= s["labels"].items():
                total += s["value"]
    return total


# ---------------------------------------------------------------- history


class History:
    """Counter values sampled every ``SAMPLE_S`` seconds, for the page's trends."""

    def __init__(self, keep: int = KEEP):
        self.points: collections.deque = collections.deque(maxlen=keep)
        self.lock = threading.Lock()

    def add(self, t: float, values: Dict[str, float]) -> None:
        with self.lock:
            self.points.append((t, values))

    def charts(self, specs: List[Tuple[str, str, str, str]]) -> List[Dict[str, Any]]:
        """``[{title, unit, points: [[t, value or None], ...]}]`` from consecutive samples."""
        with self.lock:
            pts = list(self.points)
        out = []
        for title, num, den, owner in specs:
            series = []
            for (t0, a), (t1, b) in zip(pts, pts[1:], strict=False):
                dn = b.get(num, 0.0) - a.get(num, 0.0)
                if den:
                    dd = b.get(den, 0.0) - a.get(den, 0.0)
                    series.append([round(t1, 1), dn / dd if dd > 0 else None])
                else:
                    series.append([round(t1, 1), dn / (t1 - t0) if t1 > t0 else None])
            unit = "ratio" if den else "per second"
            out.append({"title": title, "unit": unit, "owner": owner, "points": series})
        return out


def sample_values(host: List[Dict], plugin: Dict[str, List[Dict]]) -> Dict[str, float]:
    """Every sample's value summed over its label sets (``_created`` left out)."""
    values: Dict[str, float] = collections.defaultdict(float)
    for fam in host + [f for fams in plugin.values() for f in fams]:
        for s in fam["samples"]:
            if not s["name"].endswith("_created"):
                values[s["name"]] += s["value"]
    return dict(values)


# ---------------------------------------------------------------- summary


def collect(prompt_cache: Any) -> Tuple[List[Dict], Dict[str, List[Dict]], Dict[str, str]]:
    """``(host families, {plugin: families}, {plugin: error})`` as plain data."""
    host = [metrics.as_dict(f) for f in metrics.series().registry.collect()]
    host += [metrics.as_dict(f) for f in metrics.cache_families(prompt_cache)]
    host.append(metrics.as_dict(metrics.uptime_family()))
    fams, errors = {}, {}
    for name, (families, error) in metrics.plugin_families(prompt_cache).items():
        fams[name] = [metrics.as_dict(f) for f in families]
        if error:
            errors[name] = error
    return host, fams, errors


def figures(host: List[Dict], series: Any = None) -> Dict[str, Any]:
    """The host's figures as numbers (the tables are made from these).

    ``series`` (``metrics.Series``) brings the latest exact latencies, from
    which the percentiles are taken.
    """
    fams = {f["name"]: f for f in host}
    p = metrics.PREFIX
    by_status = {}
    for s in fams[p + "requests"]["samples"]:
        if s["name"].endswith("_total"):
            by_status[s["labels"]["status"]] = s["value"]
    entries = fams.get(p + "prompt_cache_entries", {"samples": []})["samples"]
    nbytes = fams.get(p + "prompt_cache_bytes", {"samples": []})["samples"]
    return {
        "uptime_s": _value(fams, p + "uptime_seconds"),
        "requests_in_flight": _value(fams, p + "requests_in_flight"),
        "requests_by_status": dict(sorted(by_status.items())),
        "prompt_tokens": _value(fams, p + "prompt_tokens_total"),
        "cached_prompt_tokens": _value(fams, p + "cached_prompt_tokens_total"),
        "generated_tokens": _value(fams, p + "generated_tokens_total"),
        "prompt_cache_lookups": _value(fams, p + "prompt_cache_lookups_total"),
        "prompt_cache_hits": _value(fams, p + "prompt_cache_hits_total"),
        "prompt_cache_entries": {s["labels"]["type"]: s["value"] for s in entries},
        "prompt_cache_bytes": {s["labels"]["type"]: s["value"] for s in nbytes},
        "ttft": histogram(fams[p + "time_to_first_token_seconds"], recent=_recent(series, "ttft")),
        "itl": histogram(fams[p + "inter_token_latency_seconds"], recent=_recent(series, "itl")),
    }


def _recent(series: Any, key: str) -> Optional[List[float]]:
    recent = getattr(series, "recent", None)
    return list(recent[key]) if recent and key in recent else None


def option_tables(info: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One table per active plugin: each flag with its effective value."""
    out = []
    for p in info["plugins"]:
        rows = [
            [flag, fmt_option(v), f"option.{p['name']}.{flag}"]
            for flag, v in sorted((p.get("options") or {}).items())
        ]
        if rows:  # a plugin without flags has no table
            out.append({"title": f"Options: {p['name']}", "rows": rows})
    return out


def host_tables(info: Dict[str, Any], fig: Dict[str, Any]) -> List[Dict[str, Any]]:
    plugins = [
        [p["name"], f"{p.get('version', '?')} ({p.get('dist', '?')})", f"plugin.{p['name']}"]
        for p in info["plugins"]
    ]
    up = fig["uptime_s"]
    server = [
        ["model", info["model"], "model"],
        ["uptime", f"{int(up // 3600)}h {int(up % 3600 // 60):02d}m {int(up % 60):02d}s", "uptime"],
    ]
    requests = [["in flight", fmt_number(fig["requests_in_flight"]), "requests_in_flight"]]
    for status, n in fig["requests_by_status"].items():
        requests.append([f"answered ({status})", fmt_number(n), f"requests.{status}"])
    requests += [
        ["prompt tokens", fmt_number(fig["prompt_tokens"]), "prompt_tokens"],
        ["cached prompt tokens", fmt_number(fig["cached_prompt_tokens"]), "cached_prompt_tokens"],
        ["generated tokens", fmt_number(fig["generated_tokens"]), "generated_tokens"],
    ]
    latency = []
    for key, label in (("ttft", "time to first token"), ("itl", "inter-token latency")):
        h = fig[key]
        window = f" (last {h['window']})" if h.get("window", h["count"]) < h["count"] else ""
        latency += [
            [f"{label}: mean", fmt_seconds(h["mean"]), f"{key}.mean"],
            [
                f"{label}: p50 / p90{window}",
                f"{fmt_quantile(h, 'p50')} / {fmt_quantile(h, 'p90')}",
                key,
            ],
        ]
    mean_itl = fig["itl"]["mean"]
    speed = f"{1 / mean_itl:.1f} tok/s" if mean_itl else "-"
    latency.append(["decode speed (1 / mean inter-token latency)", speed, "decode_speed"])
    entries, nbytes = fig["prompt_cache_entries"], fig["prompt_cache_bytes"]
    cache = [
        ["entries", fmt_number(sum(entries.values())), "cache.entries"],
        ["bytes", fmt_bytes(sum(nbytes.values())), "cache.bytes"],
    ]
    for kind in entries:
        row = f"{fmt_number(entries[kind])} ({fmt_bytes(nbytes.get(kind, 0))})"
        cache.append([f"- {kind}", row, f"cache.{kind}"])
    hits = fmt_ratio(fig["prompt_cache_hits"], fig["prompt_cache_lookups"])
    cache.append(["requests with cached tokens", hits, "cache.hits"])
    return [
        {"title": "Server", "rows": server},
        {"title": "Plugins", "rows": plugins or [["none", "-", "plugins"]]},
        *option_tables(info),
        {"title": "Requests", "rows": requests},
        {"title": "Latency", "rows": latency},
        {"title": "Prompt cache (memory)", "rows": cache},
    ]


def plugin_table(name: str, fams: List[Dict], error: Optional[str]) -> Dict[str, Any]:
    """One plugin's series as rows: each sample (by its labels), histograms summarised."""
    rows = []
    if error:
        rows.append(["error", error, f"{name}.error"])
    for fam in fams:
        if fam["type"] == "histogram":
            label_sets = {
                tuple(sorted((k, v) for k, v in s["labels"].items() if k != "le"))
                for s in fam["samples"]
            }
            for ls in sorted(label_sets):
                h = histogram(fam, dict(ls))
                tag = "".join(f" [{v}]" for _, v in ls)
                mean, p90 = fmt_seconds(h["mean"]), fmt_quantile(h, "p90")
                text = f"{int(h['count'])} (mean {mean}, p90 {p90})"
                rows.append([fam["help"] + tag, text, fam["name"] + tag])
            continue
        for s in fam["samples"]:
            if s["name"].endswith("_created"):
                continue
            tag = "".join(f" [{v}]" for v in s["labels"].values())
            v = s["value"]
            if s["name"].endswith(("_bytes", "_bytes_total")):
                text = fmt_bytes(v)
            elif s["name"].endswith("_seconds"):
                text = fmt_seconds(v)
            else:
                text = fmt_number(v)
            rows.append([fam["help"] + tag, text, s["name"] + tag])
    return {"title": f"Plugin {name}", "rows": rows or [["no figures yet", "-", f"{name}.none"]]}


def summary(
    info: Dict[str, Any], prompt_cache: Any, history: History, charts: List, series: Any = None
) -> Dict:
    """The ``/status.json`` document."""
    host, fams, errors = collect(prompt_cache)
    fig = figures(host, series)
    tables = host_tables(info, fig)
    for name in info["names"]:
        if name in fams or name in errors:
            tables.append(plugin_table(name, fams.get(name, []), errors.get(name)))
    return {
        "title": f"mlx_lm.server: {info['model']}",
        "model": info["model"],
        "plugins": info["plugins"],
        "time": time.time(),
        "figures": fig,
        "tables": tables,
        "charts": history.charts(charts),
        "errors": errors,
    }


# A path: from the start or after a space, quote or "=", up to the next one.
_PATH = re.compile(r"""(?<![^\s'"=(])(?:~|\.{1,2})?/[^\s'",;)]+""")


def redact_path(value: Any) -> Any:
    """A path cut to its last component (``…/name``); anything else as it is.

    Local paths only: an absolute one, ``~/...``, ``./...``, or an existing
    file or folder; a Hugging Face repo id (``org/name``) is no path.
    """
    if not isinstance(value, str) or "/" not in value and os.sep not in value:
        return value
    if not (value.startswith(("/", "~", ".")) or os.path.exists(value)):
        return value
    name = os.path.basename(os.path.normpath(value))
    return f"…/{name}" if name not in ("", ".", "..", "/") else "…"


def _redact_text(text: str) -> str:
    return _PATH.sub(lambda m: redact_path(m.group(0)), text)


def redact(doc: Dict[str, Any]) -> Dict[str, Any]:
    """``doc`` (a ``summary``) with every path cut to its last component: the
    model, plugin options, and paths inside table values and errors."""
    out = dict(doc)
    out["model"] = redact_path(doc["model"])
    out["title"] = doc["title"].replace(str(doc["model"]), str(out["model"]))
    out["plugins"] = [
        dict(p, options={k: redact_path(v) for k, v in (p.get("options") or {}).items()})
        for p in doc["plugins"]
    ]
    out["tables"] = [
        dict(t, rows=[[r[0], _redact_text(redact_path(str(r[1]))), r[2]] for r in t["rows"]])
        for t in doc["tables"]
    ]
    out["errors"] = {k: _redact_text(str(v)) for k, v in doc["errors"].items()}
    return out


def text(doc: Dict[str, Any]) -> str:
    """The summary for a terminal (``mlx-lm-ext status URL``)."""
    lines = [doc["title"], ""]
    for table in doc["tables"]:
        lines.append(table["title"])
        width = max(len(r[0]) for r in table["rows"])
        lines += [f"  {r[0].ljust(width)}  {r[1]}" for r in table["rows"]]
        lines.append("")
    for chart in doc["charts"]:
        vals = [v for _, v in chart["points"] if v is not None]
        if not vals:
            lines.append(f"{chart['title']}: no data yet")
            continue
        fmt = (lambda v: f"{100 * v:.1f}%") if chart["unit"] == "ratio" else "{:.1f}".format
        minutes = len(chart["points"]) * SAMPLE_S / 60
        lines.append(
            f"{chart['title']}: last {fmt(vals[-1])}, "
            f"range {fmt(min(vals))} - {fmt(max(vals))} over {minutes:.1f} min"
        )
    return "\n".join(lines).rstrip() + "\n"


# ------------------------------------------------------------------- page


def page(doc: Dict[str, Any]) -> str:
    """The ``/status`` page with ``doc`` inlined; its script keeps it fresh."""
    data = json.dumps(doc).replace("</", "<\\/")  # no "</script>" inside the script
    return (
        _PAGE.replace("{{TITLE}}", html.escape(doc["title"]))
        .replace("{{DATA}}", data)
        .replace("{{POLL_MS}}", str(POLL_MS))
    )


_PAGE = """<!doctype html>
<html lang="en"><head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{TITLE}}</title>
<style>
:root { color-scheme: light dark; --fg:#1d2327; --muted:#667; --bg:#f6f7f9; --card:#fff;
  --line:#e3e6ea; --accent:#2b6cb0; }
@media (prefers-color-scheme: dark) { :root { --fg:#e6e8eb; --muted:#9aa3ad; --bg:#14171a;
  --card:#1d2125; --line:#2e343a; --accent:#63a4ff; } }
* { box-sizing: border-box; }
body { margin:0; font:15px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif;
  color:var(--fg); background:var(--bg); }
header { padding:.8rem 1rem; border-bottom:1px solid var(--line); background:var(--card); }
h1 { font-size:1.1rem; margin:0; overflow-wrap:anywhere; }
#state { color:var(--muted); font-size:.85rem; }
main { display:grid; gap:.8rem; padding:.8rem;
  grid-template-columns:repeat(auto-fill, minmax(min(100%, 24rem), 1fr)); }
section { background:var(--card); border:1px solid var(--line); border-radius:8px;
  padding:.6rem .8rem; min-width:0; }
h2 { font-size:.95rem; margin:.1rem 0 .4rem; }
table { width:100%; border-collapse:collapse; table-layout:fixed; }
td { padding:.25rem 0; border-top:1px solid var(--line); vertical-align:top;
  overflow-wrap:break-word; width:58%; }
td.v { text-align:right; padding-left:.8rem; font-variant-numeric:tabular-nums; width:42%; }
.max { fill:var(--muted); font-size:10px; }
svg { width:100%; height:90px; display:block; }
.axis { stroke:var(--line); } .line { fill:none; stroke:var(--accent); stroke-width:2; }
.dot { fill:var(--accent); }
.muted { color:var(--muted); font-size:.85rem; }
.err td { color:#c53030; }
</style></head>
<body>
<header><h1 id="title">{{TITLE}}</h1><div id="state">loading</div></header>
<main id="charts"></main>
<main id="tables"></main>
<script id="initial" type="application/json">{{DATA}}</script>
<script>
"use strict";
const SVGNS = "http://www.w3.org/2000/svg";
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const k of kids) e.append(k);
  return e;
}
function svg(tag, attrs) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}
function fmt(v, unit) {
  if (v === null || v === undefined) return "-";
  return unit === "ratio" ? (100 * v).toFixed(1) + "%" : v.toFixed(1);
}
function chart(c) {
  const W = 300, H = 80, pts = c.points, vals = pts.map(p => p[1]).filter(v => v !== null);
  const s = svg("svg", {viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none",
    role: "img", "aria-label": c.title});
  s.append(svg("line", {x1: 0, y1: H - 1, x2: W, y2: H - 1, class: "axis"}));
  const top = c.unit === "ratio" ? 1 : Math.max(1e-9, ...vals) * 1.1;
  const label = svg("text", {x: 2, y: 10, class: "max"});
  label.textContent = fmt(top, c.unit);
  s.append(label);
  const t0 = pts.length ? pts[0][0] : 0, span = Math.max(1, pts.length ? pts[pts.length - 1][0] - t0 : 1);
  let seg = [];
  // A value between two gaps is a point of its own: a dot, since a
  // one-point line draws nothing.
  const flush = () => {
    if (seg.length > 1) s.append(svg("polyline", {points: seg.join(" "), class: "line"}));
    else if (seg.length === 1) {
      const [x, y] = seg[0].split(",");
      s.append(svg("circle", {cx: x, cy: y, r: 2.5, class: "dot"}));
    }
    seg = [];
  };
  for (const [t, v] of pts) {
    if (v === null) { flush(); continue; }
    seg.push(`${((t - t0) / span * W).toFixed(1)},${(H - 2 - v / top * (H - 6)).toFixed(1)}`);
  }
  flush();
  const last = vals.length ? fmt(vals[vals.length - 1], c.unit) : "no data yet";
  const mins = (pts.length * 5 / 60).toFixed(1);
  return el("section", {"data-chart": c.title}, el("h2", {}, c.title), s,
    el("div", {class: "muted"}, `last ${last} · ${mins} min` + (c.owner ? ` · ${c.owner}` : "")));
}
function table(t) {
  const body = el("tbody");
  for (const [label, value, key] of t.rows)
    body.append(el("tr", {"data-key": key, class: label === "error" ? "err" : ""},
      el("td", {}, label), el("td", {class: "v"}, String(value))));
  return el("section", {"data-table": t.title}, el("h2", {}, t.title), el("table", {}, body));
}
function render(d) {
  document.getElementById("title").textContent = d.title;
  document.getElementById("charts").replaceChildren(...d.charts.map(chart));
  document.getElementById("tables").replaceChildren(...d.tables.map(table));
  document.getElementById("state").textContent =
    "updated " + new Date(d.time * 1000).toLocaleTimeString();
  document.body.dataset.updated = String(d.time);
}
async function poll() {
  try {
    const r = await fetch("status.json", {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
  } catch (e) {
    document.getElementById("state").textContent = "server unreachable (" + e.message + ")";
  }
  setTimeout(poll, {{POLL_MS}});
}
render(JSON.parse(document.getElementById("initial").textContent));
setTimeout(poll, {{POLL_MS}});
</script>
</body></html>
"""
