"""Fixtures of the ssd-cache tests, on top of the host's (``mlx_lm_ext.testing``).

Tiny models come from the host's ``tiny_model`` factory: random weights with
the real SmolLM2 tokenizer, saved as real model folders, so ``mlx_lm.load``
and ``mlx_lm.server`` take them like downloaded models. ``Server`` runs a real
``mlx_lm.server --plugin ssd-cache`` process on 127.0.0.1.
"""

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlx_lm_ext.testing import default_sigint

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def tiny(tiny_model):
    """``tiny(arch) -> (model, tokenizer, path)``, loaded once per arch.

    ``gemma3_text`` has sliding-window layers (``RotatingKVCache``, window 8).
    """
    from mlx_lm import load

    loaded = {}

    def get(arch="llama"):
        if arch not in loaded:
            path = tiny_model(arch)
            model, tok = load(str(path))
            loaded[arch] = (model, tok, path)
        return loaded[arch]

    return get


# ------------------------------------------------------ a write under way

# Holds a temp file open, and so locked, until its stdin closes.
_HOLDER = """
import os, sys
from mlx_lm_ext import safefs
dfd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
fd = safefs.create_temp(sys.argv[2], dfd)
os.write(fd, b"half an entry")
print("writing", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def _write_under_way(path: Path):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(path.parent), path.name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "writing\n"
        yield
    finally:
        holder.stdin.close()
        holder.wait(30)


@pytest.fixture
def write_under_way():
    """``with write_under_way(path):`` another process writes the temp file
    ``path`` (holding its lock) until the block ends."""
    return _write_under_way


# ------------------------------------------------------------ real servers


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``mlx_lm.server --plugin ssd-cache`` in a subprocess on 127.0.0.1."""

    def __init__(self, model, cache_dir, log_path, extra=(), env=None, faults=False):
        self.port = free_port()
        self.log_path = Path(log_path)
        # mlx-lm's own console script; faults=True: the same server through
        # fault_server.py (slow or hanging writes)
        if faults:
            start = [sys.executable, str(HERE / "fault_server.py")]
        else:
            start = [str(Path(sys.executable).with_name("mlx_lm.server"))]
        cmd = [
            *start,
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--plugin",
            "ssd-cache",
            "--ssd-cache-dir",
            str(cache_dir),
            *extra,
        ]
        full_env = dict(os.environ, **(env or {}))
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=full_env,
            preexec_fn=default_sigint,  # ``stop`` sends it Ctrl-C
        )

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout=120):
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.text()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"server not ready:\n{self.text()}")

    def chat(self, content, max_tokens=8, timeout=300, **extra):
        import urllib.request

        body = {
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            **extra,
        }
        req = urllib.request.Request(
            self.url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def healthy(self):
        import urllib.request

        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def text(self):
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, sig=None, timeout=60):
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(sig or signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture
def servers():
    """Start servers with ``servers(model, dir, ...)``; all are stopped at the end."""
    started = []

    def start(model, cache_dir, log_path, **kw):
        s = Server(model, cache_dir, log_path, **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()
