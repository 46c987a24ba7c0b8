"""``/metrics``, ``/status``, ``/status.json`` and ``mlx-lm-ext status`` on a real server.

A real ``mlx_lm.server`` on the offline SmolLM2 (float32) with two test
plugins: ``serveronly`` reports a series; ``testplugin`` in mode
``metrics-crash`` raises in its ``metrics`` hook, which must cost only its
own series. The page is loaded in headless Chromium (Debian's ``chromium``,
driven by Playwright) where ``/usr/bin/chromium`` exists.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, log_path, plugin_dir, extra):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(plugin_dir), env.get("PYTHONPATH", "")])
        cmd = [
            str(Path(sys.executable).with_name("mlx_lm.server")),
            *("--model", str(model), "--host", "127.0.0.1", "--port", str(self.port)),
            *extra,
        ]
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_path.read_text()}")
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(self.log_path.read_text())

    def get(self, path):
        return self.request(path)[::2]

    def request(self, path, headers=None):
        """``(status, headers, body)`` of ``GET path`` sent with ``headers``."""
        req = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.headers, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read().decode()

    def post(self, body, path="/v1/chat/completions", raw=None):
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def chat(self, content, max_tokens=12, stream=False):
        body = {
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        status, text = self.post(body)
        assert status == 200, text
        if not stream:
            return json.loads(text)["usage"]
        chunks = [json.loads(x[6:]) for x in text.split("\n\n") if x.startswith("data: {")]
        return chunks[-1]["usage"]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def server(smollm2_f32_path, plugin_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("status") / "server.log"
    s = Server(
        smollm2_f32_path,
        log,
        plugin_dir,
        ["--plugin", "serveronly", "--plugin", "testplugin", "--testplugin-mode", "metrics-crash"],
    )
    yield s
    s.stop()


def scrape(server):
    status, text = server.get("/metrics")
    assert status == 200
    out = {}
    for fam in text_string_to_metric_families(text):  # Prometheus' own parser
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            out[key] = s.value
    return out


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_parse_and_move_as_requests_are_served(server):
    before = scrape(server)
    u1 = server.chat("Name three colours.", max_tokens=10)
    u2 = server.chat("Name three fruits.", max_tokens=8, stream=True)
    assert server.post(None, raw=b"{not json")[0] == 400

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    # A request is counted when its handler returns, just after the client
    # has its answer: scrape until the three have ended.
    deadline = time.monotonic() + 10
    while True:
        after = scrape(server)
        ended = moved("mlx_lm_requests_total", status="200") + moved(
            "mlx_lm_requests_total", status="400"
        )
        if (ended >= 3 and value(after, "mlx_lm_requests_in_flight") == 0) or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(0.05)

    assert moved("mlx_lm_requests_total", status="200") == 2
    assert moved("mlx_lm_requests_total", status="400") == 1
    assert value(after, "mlx_lm_requests_in_flight") == 0
    assert moved("mlx_lm_prompt_tokens_total") == u1["prompt_tokens"] + u2["prompt_tokens"]
    generated = u1["completion_tokens"] + u2["completion_tokens"]
    assert moved("mlx_lm_generated_tokens_total") == generated
    assert moved("mlx_lm_time_to_first_token_seconds_count") == 2
    assert moved("mlx_lm_inter_token_latency_seconds_count") == generated - 2
    assert moved("mlx_lm_time_to_first_token_seconds_sum") > 0
    assert moved("mlx_lm_prompt_cache_lookups_total") == 2
    assert sum(v for (n, _), v in after.items() if n == "mlx_lm_prompt_cache_entries") >= 1
    # the plugins' series: the working one is there, the raising one's is not
    assert value(after, "mlx_lm_serveronly_up") == 1
    assert not any(n.startswith("mlx_lm_testplugin") for n, _ in after)


def test_a_raising_metrics_hook_costs_only_its_own_series(server):
    status, body = server.get("/status.json")
    assert status == 200
    doc = json.loads(body)
    assert "simulated metrics failure" in doc["errors"]["testplugin"]
    titles = [t["title"] for t in doc["tables"]]
    assert {"Requests", "Latency", "Prompt cache (memory)", "Plugin serveronly"} <= set(titles)
    rows = {r[2]: r[1] for t in doc["tables"] for r in t["rows"]}
    assert "simulated metrics failure" in rows["testplugin.error"]
    assert server.get("/status")[0] == 200
    assert server.get("/health")[0] == 200  # mlx-lm's own routes are untouched
    assert server.get("/v1/models")[0] == 200
    assert server.chat("Say hi.", max_tokens=3)["completion_tokens"] >= 1


def test_status_routes_are_not_readable_cross_origin_and_hide_paths_from_other_hosts(
    server, smollm2_f32_path
):
    page_origin = {"Origin": "http://attacker.example"}
    for path in ("/metrics", "/status", "/status.json"):
        status, headers, _ = server.request(path, page_origin)
        assert status == 200, path
        assert headers.get("Access-Control-Allow-Origin") is None, path
    # mlx-lm's own routes keep mlx-lm's CORS headers
    assert server.request("/v1/models", page_origin)[1]["Access-Control-Allow-Origin"] == "*"

    model = str(smollm2_f32_path)
    # A loopback-bound server, asked for a loopback name: this machine's user.
    doc = json.loads(server.get("/status.json")[1])
    assert doc["model"] == model
    # The same server asked under another name (a page that rebound its own
    # domain to 127.0.0.1 sends that domain): no paths, only their last part.
    rebound = {"Host": f"attacker.example:{server.port}"}
    for path in ("/status", "/status.json"):
        status, _, body = server.request(path, rebound)
        assert status == 200 and model not in body and str(Path(model).parent) not in body
    doc = json.loads(server.request("/status.json", rebound)[2])
    assert doc["model"] == "…/" + Path(model).name


def test_cli_status_prints_the_summary(server):
    doc = json.loads(server.get("/status.json")[1])
    out = subprocess.run(
        [str(Path(sys.executable).with_name("mlx-lm-ext")), "status", server.url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    generated = next(r for t in doc["tables"] for r in t["rows"] if r[2] == "generated_tokens")
    assert any(
        line.split() == ["generated", "tokens", generated[1]] for line in out.stdout.splitlines()
    )
    assert "Plugin serveronly" in out.stdout and "simulated metrics failure" in out.stdout
    bad = subprocess.run(
        [str(Path(sys.executable).with_name("mlx-lm-ext")), "status", "ftp://nowhere"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "not a server URL" in bad.stderr


@pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason="needs Debian's chromium at /usr/bin/chromium (scripts/setup.sh installs it as root)",
)
def test_status_page_in_chromium_shows_the_api_figures(server, tmp_path, monkeypatch):
    from playwright.sync_api import sync_playwright

    # OpenBLAS preloaded into Playwright's node driver stops it creating threads.
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    server.chat("Write one word.", max_tokens=4)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 390, "height": 844})  # a phone
            fetched = []
            page.on("request", lambda r: fetched.append(r.url))
            page.goto(server.url + "/status")
            page.wait_for_selector("[data-table='Requests']")
            # it refreshes itself: a request served now shows up without a reload
            server.chat("Write two words.", max_tokens=4)
            doc = json.loads(server.get("/status.json")[1])
            want = next(
                r[1] for t in doc["tables"] for r in t["rows"] if r[2] == "generated_tokens"
            )
            page.wait_for_function(
                "w => document.querySelector(\"tr[data-key='generated_tokens'] td.v\")"
                ".textContent === w",
                arg=want,
                timeout=20000,
            )
            doc = json.loads(server.get("/status.json")[1])
            page.wait_for_function(
                "t => Number(document.body.dataset.updated) >= t", arg=doc["time"], timeout=20000
            )
            page.screenshot(path=str(tmp_path / "status-phone.png"), full_page=True)
            page.set_viewport_size({"width": 1280, "height": 900})
            page.screenshot(path=str(tmp_path / "status.png"), full_page=True)
            shown = page.eval_on_selector_all(
                "tr[data-key]",
                "rows => rows.map(r => [r.dataset.key, r.querySelector('td.v').textContent])",
            )
            charts = page.eval_on_selector_all("[data-chart]", "cs => cs.map(c => c.dataset.chart)")
        finally:
            browser.close()
    shown = dict(shown)
    for table in doc["tables"]:
        for label, text, key in table["rows"]:
            if key != "uptime":
                assert shown[key] == text, (table["title"], label)
    assert shown["generated_tokens"] == str(int(doc["figures"]["generated_tokens"]))
    assert "Generated tokens per second" in charts and "Prompt cache hit rate" in charts
    assert (tmp_path / "status.png").stat().st_size > 10_000
    # self-contained: nothing but the page and its own JSON
    paths = {urllib.parse.urlsplit(u).path for u in fetched}
    assert all(u.startswith(server.url) for u in fetched) and paths <= {"/status", "/status.json"}


def test_no_status_turns_the_routes_off(smollm2_f32_path, plugin_dir, tmp_path):
    s = Server(
        smollm2_f32_path,
        tmp_path / "server.log",
        plugin_dir,
        ["--plugin", "serveronly", "--no-status"],
    )
    try:
        for path in ("/metrics", "/status", "/status.json"):
            assert s.get(path)[0] == 404, path
        assert s.get("/health")[0] == 200
        assert s.chat("Say hi.", max_tokens=2)["completion_tokens"] >= 1
    finally:
        s.stop()


SERIAL_SRC = '''
"""Test plugin: a drafter the server serves one request at a time, with its own loop."""
import sys

from mlx_lm_ext import hookimpl


class Marker:
    """The server's draft model: this plugin's speculative loop handles it."""

    def make_cache(self):
        return []


@hookimpl
def commands():
    return ["server"]


@hookimpl
def add_arguments(command, group):
    group.add_argument("--serial-dir", default=None, help="a folder (shown on /status)")
    group.add_argument("--serial-width", type=int, default=None, help="unset: 4 when active")


@hookimpl
def make_drafter(command, model, tokenizer, draft_model, args):
    return Marker()


@hookimpl
def speculative_generate_step(prompt, model, drafter, kwargs):
    if not isinstance(drafter, Marker):
        return None
    # mlx-lm's plain loop without a progress callback, as a plugin's own loop is
    gen = sys.modules["mlx_lm.generate"].generate_step
    keep = ("max_tokens", "sampler", "logits_processors", "prompt_cache", "prefill_step_size")
    args = {k: v for k, v in kwargs.items() if k in keep}
    return ((int(t), lp, False) for t, lp in gen(prompt, model, **args))


@hookimpl
def status_options(args):
    return {"serial_width": args.serial_width or 4}
'''


@pytest.fixture(scope="module")
def serial_server(smollm2_f32_path, plugin_dir, tmp_path_factory):
    """A server whose plugin's drafter runs on mlx-lm's serial speculative path."""
    # the conftest's writer (under --import-mode=importlib it is no plain import)
    write_plugin_dist = next(
        m.write_plugin_dist
        for k, m in list(sys.modules.items())
        if k.rsplit(".", 1)[-1] == "conftest" and hasattr(m, "write_plugin_dist")
    )
    root = tmp_path_factory.mktemp("serialplugin")
    write_plugin_dist(
        root,
        "mlx-lm-ext-serial",
        "0.0.2",
        {"mlx_lm_ext_serial": SERIAL_SRC},
        {"serial": "mlx_lm_ext_serial"},
    )
    folder = tmp_path_factory.mktemp("serial-folder")
    s = Server(
        smollm2_f32_path,
        tmp_path_factory.mktemp("serial") / "server.log",
        os.pathsep.join([str(root), str(plugin_dir)]),
        ["--plugin", "serial", "--serial-dir", str(folder), "--prefill-step-size", "16"],
    )
    s.folder = folder
    yield s
    s.stop()


def test_start_up_line_names_the_plugins_and_the_status_url(serial_server):
    log = serial_server.log_path.read_text()
    line = next(ln for ln in log.splitlines() if "mlx-lm-ext:" in ln and "/status" in ln)
    assert "serial 0.0.2" in line and f"{serial_server.url}/status" in line


def test_a_serial_speculative_prefill_reports_progress(serial_server):
    prompt = " ".join(f"item {i}," for i in range(120))
    status, text = serial_server.post({"prompt": prompt, "max_tokens": 2}, path="/v1/completions")
    assert status == 200, text
    n = json.loads(text)["usage"]["prompt_tokens"]
    log = serial_server.log_path.read_text()
    # mlx-lm's own lines, which its speculative path never printed
    assert f"Prompt processing progress: 0/{n}" in log
    assert f"Prompt processing progress: {n}/{n}" in log


def test_options_show_effective_values_and_paths_only_to_loopback(serial_server):
    doc = json.loads(serial_server.get("/status.json")[1])
    rows = {r[2]: r[1] for t in doc["tables"] for r in t["rows"]}
    assert rows["option.serial.--serial-width"] == "4"  # unset: what it resolved to
    assert rows["option.serial.--serial-dir"] == str(serial_server.folder)
    assert doc["plugins"][0]["options"] == {
        "--serial-dir": str(serial_server.folder),
        "--serial-width": 4,
    }
    rebound = {"Host": f"attacker.example:{serial_server.port}"}
    doc = json.loads(serial_server.request("/status.json", rebound)[2])
    rows = {r[2]: r[1] for t in doc["tables"] for r in t["rows"]}
    assert rows["option.serial.--serial-dir"] == "…/" + serial_server.folder.name


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium")
def test_trend_charts_draw_lone_samples(monkeypatch):
    from playwright.sync_api import sync_playwright

    from mlx_lm_ext import status_page

    monkeypatch.delenv("LD_PRELOAD", raising=False)
    history = status_page.History()
    # lookups only now and then: each hit rate sits between gaps
    for i, (hits, lookups) in enumerate([(0, 0), (1, 1), (1, 1), (2, 2), (2, 2), (2, 3)]):
        history.add(5.0 * i, {"h_total": hits, "l_total": lookups})
    info = {"model": "m", "names": [], "plugins": []}
    doc = status_page.summary(info, None, history, [("Hit rate", "h_total", "l_total", "")])
    assert [v for _, v in doc["charts"][0]["points"]] == [1.0, None, 1.0, None, 0.0]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.set_content(status_page.page(doc))
            page.wait_for_selector("[data-chart='Hit rate'] svg")
            marks = page.eval_on_selector(
                "[data-chart='Hit rate'] svg",
                # what shows: a one-point line has an empty box, a dot does not
                "s => [...s.querySelectorAll('circle, polyline')]"
                ".filter(e => e.getBoundingClientRect().width > 0).length",
            )
        finally:
            browser.close()
    assert marks == 3  # one mark per lone sample
