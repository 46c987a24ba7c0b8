"""What the host installs in ``mlx_lm.server`` for ``/metrics`` and ``/status`` (owners ``server.*``).

* ``server.routes``: ``APIHandler.do_GET`` answers ``/metrics``,
  ``/status`` and ``/status.json`` and hands every other path to mlx-lm's
  own (``/health``, ``/v1/models`` untouched). The routes are on the
  server's own socket, so they bind where the server binds. They never
  carry mlx-lm's wildcard ``Access-Control-Allow-Origin: *`` (only an
  origin named in ``--allowed-origins``), so a web page of another origin
  cannot read them; and they show paths (the model folder, plugin options)
  only to a request for a loopback name on a loopback-bound server, or with
  ``--status-show-paths`` (``show_paths``): elsewhere a path is its last
  component.
* ``server.metrics``: ``APIHandler.do_POST`` (a request's start and end,
  in flight), ``_set_completion_headers`` / ``_set_stream_headers`` (its
  HTTP status) and ``ResponseGenerator._await_response`` (the handler
  thread taking the context and each token off the request's queue: time to
  first token, inter-token latency, tokens) measure each request from the
  handler's side, whichever generation path served it. At its end the
  plugins' ``request_finished`` gets the request's info dict.

A sampler thread records the counters every few seconds for the page's
trends. ``integration.on_activate`` installs all of it on the server when a
plugin is active, unless ``--no-status``.
"""

import argparse
import functools
import ipaddress
import json
import logging
import sys
import threading
import time
import urllib.parse
from typing import Any, Dict, List, Optional

from prometheus_client import CONTENT_TYPE_LATEST

from . import metrics, patching, plugins, status_page

log = logging.getLogger("mlx_lm_ext")

ROUTES = ("/metrics", "/status", "/status.json")

_local = threading.local()  # the request this handler thread is serving
_history = status_page.History()
_info: Dict[str, Any] = {}
_args: List[Any] = [argparse.Namespace()]  # the server's parsed command line
_sampler: Optional[threading.Thread] = None


def install(args: Any) -> None:
    """Install the routes and the request measurement (once)."""
    mod = sys.modules["mlx_lm.server"]
    handler, rg = mod.APIHandler, mod.ResponseGenerator
    _args[0] = args
    _info.update(server_info(args))
    metrics.series()
    patching.wrap("server.metrics", handler, "do_POST", _make_post)
    patching.wrap("server.metrics", handler, "_set_completion_headers", _make_status)
    patching.wrap("server.metrics", handler, "_set_stream_headers", _make_status)
    patching.wrap("server.metrics", rg, "_await_response", _make_await)
    patching.wrap("server.routes", handler, "do_GET", _make_get)
    patching.wrap("server.routes", mod, "_run_http_server", _make_run)
    _start_sampler()


def startup_line(host: str, port: int) -> str:
    """``mlx-lm-ext: plugins a 1.0, b 2.0; status page http://HOST:PORT/status ...``"""
    names = ", ".join(f"{p['name']} {p['version']}" for p in _info.get("plugins", []))
    shown = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    shown = f"[{shown}]" if ":" in shown else shown
    url = f"http://{shown}:{port}"
    return (
        f"mlx-lm-ext: plugins {names or 'none'}; status page {url}/status "
        f"({url}/status.json, {url}/metrics; `mlx-lm-ext status {url}` in a terminal)"
    )


def _make_run(original):
    @functools.wraps(original)
    def _run_http_server(host, port, *args, **kwargs):
        log.info(startup_line(host, port))  # logging is set up by now (main's basicConfig)
        return original(host, port, *args, **kwargs)

    return _run_http_server


def server_info(args: Any) -> Dict[str, Any]:
    """The model and each active plugin: its distribution and its flags (fixed at start)."""
    names = list(plugins.STATE.active)
    rows = []
    for name in names:
        try:
            flags = plugins.flags(name, "server")
        except Exception:
            flags = {}
        dist, version = plugins.distribution(name)
        rows.append({"name": name, "dist": dist, "version": version, "flags": flags})
    return {"model": str(getattr(args, "model", None) or "-"), "names": names, "plugins": rows}


def effective_info(args: Any) -> Dict[str, Any]:
    """``_info`` with each plugin's ``options``: ``{flag: value}`` as parsed, with
    what its ``status_options`` hook says they resolved to (asked each time)."""
    resolved = plugins.each("status_options", args=args)
    rows = []
    for row in _info.get("plugins", []):
        flags = row.get("flags", {})
        opts = {flag: _plain(getattr(args, dest, None)) for dest, flag in flags.items()}
        more = resolved.get(row["name"])
        if isinstance(more, Exception):
            log.warning("plugin '%s' failed in status_options: %s", row["name"], more)
        elif isinstance(more, dict):
            for dest, v in more.items():
                opts[flags.get(dest) or "--" + str(dest).replace("_", "-")] = _plain(v)
        rows.append({k: v for k, v in row.items() if k != "flags"} | {"options": opts})
    return dict(_info, plugins=rows)


def show_paths(args: Any, host_header: Optional[str]) -> bool:
    """Whether a status request may see full paths.

    Yes with ``--status-show-paths``; else only on a server bound to a
    loopback address, for a request naming a loopback host: a page that
    rebinds its own domain to 127.0.0.1 sends its domain as ``Host``.
    """
    if getattr(args, "status_show_paths", False):
        return True
    name = urllib.parse.urlsplit("//" + (host_header or "")).hostname
    return _loopback(getattr(args, "host", None)) and _loopback(name)


def _loopback(name: Optional[str]) -> bool:
    if not name:
        return False
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


def _plain(v):
    return v if isinstance(v, (int, float, bool, type(None))) else str(v)


def charts() -> List[tuple]:
    specs = [(t, n, d, "") for t, n, d in status_page.HOST_CHARTS]
    for name, result in plugins.each("status_charts").items():
        if isinstance(result, Exception) or not result:
            continue
        try:
            specs += [(str(t), str(n), str(d or ""), name) for t, n, d in result]
        except (TypeError, ValueError) as e:
            log.warning("plugin '%s' returned bad status charts: %s", name, e)
    return specs


def summary(paths: bool = True) -> Dict[str, Any]:
    """The ``/status.json`` document; with ``paths=False`` every path is cut to its last part."""
    info = effective_info(_args[0])
    s = metrics.series()
    doc = status_page.summary(info, s.prompt_cache, _history, charts(), s)
    return doc if paths else status_page.redact(doc)


# ------------------------------------------------------------ the patches


def _make_post(original):
    @functools.wraps(original)
    def do_POST(self):
        req = metrics.request_started()
        _local.req = req
        s = metrics.series()
        if s.prompt_cache is None:
            s.prompt_cache = self.response_generator.prompt_cache
        try:
            original(self)
        except Exception:
            req.status = req.status or 500
            raise
        finally:
            _local.req = None
            info = metrics.request_ended(req)
            plugins.collect("request_finished", info=info)

    return do_POST


def _make_status(original):
    @functools.wraps(original)
    def set_headers(self, status_code: int = 200):
        req = getattr(_local, "req", None)
        if req is not None:
            req.status = status_code
        return original(self, status_code)

    return set_headers


def _make_await(original):
    @functools.wraps(original)
    def _await_response(self, response_queue):
        item = original(self, response_queue)
        req = getattr(_local, "req", None)
        if req is not None:
            metrics.on_item(req, item)
        return item

    return _await_response


def _make_get(original):
    @functools.wraps(original)
    def do_GET(self):
        path = urllib.parse.urlsplit(self.path).path
        if path not in ROUTES:
            return original(self)
        s = metrics.series()
        if s.prompt_cache is None:
            s.prompt_cache = self.response_generator.prompt_cache
        paths = show_paths(_args[0], self.headers.get("Host"))
        try:
            if path == "/metrics":
                body, kind = metrics.exposition(s.prompt_cache), CONTENT_TYPE_LATEST
            elif path == "/status":
                body, kind = status_page.page(summary(paths)).encode(), "text/html; charset=utf-8"
            else:
                body, kind = json.dumps(summary(paths)).encode(), "application/json"
            status = 200
        except Exception as e:  # a bug here costs this page, never the server
            log.exception("status route %s failed", path)
            body, kind, status = json.dumps({"error": str(e)}).encode(), "application/json", 500
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        _cors_headers(self)
        self.end_headers()
        self.wfile.write(body)

    return do_GET


def _cors_headers(handler: Any) -> None:
    """mlx-lm's CORS headers without its wildcard: only an origin named in
    ``--allowed-origins`` may read the status routes from a web page."""
    allowed = getattr(handler.response_generator.cli_args, "allowed_origins", None) or []
    origin = handler.headers.get("Origin")
    if origin and origin != "*" and origin in allowed:
        handler.send_header("Access-Control-Allow-Origin", origin)
        handler.send_header("Vary", "Origin")


# ---------------------------------------------------------------- sampler


def sample() -> None:
    """Record the counters the trends need (one history point)."""
    s = metrics.series()
    host, fams, _ = status_page.collect(s.prompt_cache)
    _history.add(time.time(), status_page.sample_values(host, fams))


def _start_sampler() -> None:
    global _sampler
    if _sampler is not None:
        return

    def loop():
        while True:
            try:
                if patching.owned("server.routes"):  # not after an undo (tests, benchmarks)
                    sample()
            except Exception as e:  # never let the sampler take anything down
                log.debug("status sampler: %s", e)
            time.sleep(status_page.SAMPLE_S)

    _sampler = threading.Thread(target=loop, name="mlx_lm_ext-status", daemon=True)
    _sampler.start()
