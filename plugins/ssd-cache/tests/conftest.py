"""Fixtures: tiny random-weight mlx-lm models saved as real model folders.

Each folder has a config, safetensors weights and a byte-level BPE tokenizer
with a ChatML template, so ``mlx_lm.load`` and ``mlx_lm.server`` take it like
a downloaded model. Weights are random (seeded): the caches, files and
servers are real, the text is noise.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CONFIGS = {
    "llama": dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-5, vocab_size=320, tie_word_embeddings=True,
        rope_theta=10000.0, max_position_embeddings=4096,
    ),
    # sliding-window layers (RotatingKVCache, window 16) with a global layer
    "gemma3_text": dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=3,
        intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, rms_norm_eps=1e-6, vocab_size=320, sliding_window=16,
        sliding_window_pattern=3, query_pre_attn_scalar=32,
        max_position_embeddings=4096, rope_theta=10000.0,
        rope_local_base_freq=10000.0,
    ),
}


def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def write_tokenizer(path):
    """A byte-level BPE without merges: one token per byte, plus ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(_bytes_to_unicode())}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
        "model_max_length": 4096,
    }))


def build_tiny(kind, path, seed=0):
    import mlx.core as mx
    from mlx_lm.utils import _get_classes, save_config, save_model

    config = dict(CONFIGS[kind])
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model, donate_model=False)
    save_config(config, path / "config.json")
    write_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    return {kind: build_tiny(kind, root / kind) for kind in CONFIGS}


@pytest.fixture(scope="session")
def tiny(tiny_dirs):
    """``tiny(kind) -> (model, tokenizer, path)``, loaded once per kind."""
    from mlx_lm import load

    loaded = {}

    def get(kind="llama"):
        if kind not in loaded:
            model, tok = load(str(tiny_dirs[kind]))
            loaded[kind] = (model, tok, tiny_dirs[kind])
        return loaded[kind]

    return get


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
        # faults=True: the same server through fault_server.py (slow/hanging writes)
        start = [str(HERE / "fault_server.py")] if faults else ["-m", "mlx_lm", "server"]
        cmd = [
            sys.executable, *start, "--model", str(model),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--plugin", "ssd-cache", "--ssd-cache-dir", str(cache_dir),
            *extra,
        ]
        full_env = dict(os.environ, **(env or {}))
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full_env)

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
            "max_tokens": max_tokens, "temperature": 0.0, **extra,
        }
        req = urllib.request.Request(
            self.url + "/v1/chat/completions", data=json.dumps(body).encode(),
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
