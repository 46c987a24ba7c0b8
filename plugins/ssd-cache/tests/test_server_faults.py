"""Fault injection against real ``mlx_lm.server --plugin ssd-cache`` processes.

Tiny random-weight model (fast); the servers, files and signals are real.
"Warm" texts come from a repeat in the same server (a memory hit that leaves
one token to process, exactly the split a disk hit gives), so a disk restore
must reproduce them token for token. A miss must reproduce the cold run:
requests go in the same order, so mlx-lm's own memory tier makes the same
short prefix hits (the shared chat-template tokens) as in the cold run.
"""

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from mlx_lm_ext import safefs
from mlx_lm_ssd_cache import fileformat

PROMPTS = [
    f"Request {i}. " + f"The quick brown fox {i} jumps over the lazy dog. " * 6 for i in range(6)
]


def text(r):
    return r["choices"][0]["message"]["content"]


def cached(r):
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def restored(r):
    """The whole prompt but its last token came from a cache."""
    return cached(r) == r["usage"]["prompt_tokens"] - 1


def answer(r):
    return cached(r), text(r)


def entries(d):
    return sorted(Path(d).glob("*/*/*.safetensors"))


def tmps(d):
    return sorted(Path(d).glob("*/*/.*.tmp"))


def wait_stored(d, n, timeout=60):
    """Wait until ``n`` entries are on disk and no write is under way."""
    deadline = time.monotonic() + timeout
    stable = 0
    while time.monotonic() < deadline:
        if len(entries(d)) == n and not tmps(d):
            stable += 1
            if stable >= 3:
                return
        else:
            stable = 0
        time.sleep(0.2)
    raise TimeoutError(f"{len(entries(d))} entries, {len(tmps(d))} tmp, wanted {n}")


def file_of(d, tokenizer, prompt):
    """The entry file whose tokens start with the prompt's tokens."""
    want = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True
    )
    for p in entries(d):
        if fileformat.read_header(p).tokens[: len(want)].tolist() == want:
            return p
    raise LookupError(prompt)


@pytest.fixture
def model(tiny_model, tmp_path):
    """A private copy of the tiny llama (some tests replace its weights)."""
    dst = tmp_path / "model"
    shutil.copytree(tiny_model("llama"), dst)
    return dst


@pytest.fixture
def tokenizer(model):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(model)


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size)``: a fresh small tmpfs (needs root; skipped otherwise)."""
    mounted = []

    def make(size):
        mnt = tmp_path / f"tmpfs{len(mounted)}"
        mnt.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True
        )
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
        mounted.append(mnt)
        return mnt

    yield make
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)])


def test_kill_9_during_a_write_loses_only_that_entry(servers, model, tmp_path):
    d, hang = tmp_path / "cache", tmp_path / "hang"
    s = servers(
        model, d, tmp_path / "1.log", faults=True, env={"SSD_TEST_HANG_IF": str(hang)}
    ).wait_ready()
    s.chat(PROMPTS[0]), s.chat(PROMPTS[1])
    warm = [text(s.chat(p)) for p in PROMPTS[:2]]
    wait_stored(d, 2)
    hang.touch()
    cold2 = answer(s.chat(PROMPTS[2]))  # answered; its write hangs half-way
    deadline = time.monotonic() + 30
    while not Path(str(hang) + ".hit").exists():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    dead = s.proc.pid
    s.proc.kill()  # SIGKILL mid-write
    s.proc.wait()
    assert len(tmps(d)) == 1 and len(entries(d)) == 2
    assert f".{dead}." in tmps(d)[0].name
    # Nobody holds its lock now; past the grace period it is reaped.
    stale = time.time() - 2 * safefs.REAP_GRACE
    os.utime(tmps(d)[0], (stale, stale))

    s2 = servers(model, d, tmp_path / "2.log").wait_ready()
    again = [s2.chat(p) for p in PROMPTS[:3]]
    assert [restored(r) for r in again] == [True, True, False]
    assert [text(r) for r in again[:2]] == warm and answer(again[2]) == cold2
    # The dead writer's temp file was reaped. The new server writes the same
    # entry (PROMPTS[2] was a miss) under its own pid, possibly still now.
    assert not [p for p in tmps(d) if f".{dead}." in p.name]
    wait_stored(d, 3)
    assert "reaped unfinished write" in s2.text()
    assert s2.healthy()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_flush_pending_writes(servers, model, tmp_path, sig):
    d = tmp_path / "cache"
    s = servers(
        model, d, tmp_path / "1.log", faults=True, env={"SSD_TEST_WRITE_DELAY": "1.5"}
    ).wait_ready()
    s.chat(PROMPTS[0])
    warm = text(s.chat(PROMPTS[0]))
    assert not entries(d)  # still being written behind
    t0 = time.monotonic()
    s.stop(sig)
    assert time.monotonic() - t0 >= 1.0  # the exit waited for the writer
    assert len(entries(d)) == 1 and not tmps(d)
    s2 = servers(model, d, tmp_path / "2.log").wait_ready()
    r = s2.chat(PROMPTS[0])
    assert restored(r) and text(r) == warm


def test_corrupt_files_are_misses_never_wrong_restores(servers, model, tokenizer, tmp_path):
    d = tmp_path / "cache"
    verify = ["--ssd-cache-verify"]
    s = servers(model, d, tmp_path / "1.log", extra=verify).wait_ready()
    cold = [answer(s.chat(p)) for p in PROMPTS[:4]]
    warm = [text(s.chat(p)) for p in PROMPTS[:4]]
    s.stop()
    files = [file_of(d, tokenizer, p) for p in PROMPTS[:4]]
    raw = files[0].read_bytes()
    files[0].write_bytes(raw[: len(raw) * 2 // 3])  # truncated
    raw = bytearray(files[1].read_bytes())
    at = raw.index(b'"tokens":"[') + 14
    raw[at] = ord("7") if raw[at] != ord("7") else ord("8")  # a token id in the header
    files[1].write_bytes(bytes(raw))
    raw = bytearray(files[2].read_bytes())
    raw[-100] ^= 0x10  # one bit of KV data
    files[2].write_bytes(bytes(raw))

    s2 = servers(model, d, tmp_path / "2.log", extra=verify).wait_ready()
    again = [s2.chat(p) for p in PROMPTS[:4]]
    assert [restored(r) for r in again] == [False, False, False, True]
    assert [answer(r) for r in again[:3]] == cold[:3] and text(again[3]) == warm[3]
    assert s2.healthy()
    log = s2.text()
    assert log.count("set aside entry") == 1  # one warning, then debug
    assert "CRC32" not in log or "set aside" in log
    s2.stop()
    for f in entries(d):  # the bad files were replaced by fresh, whole ones
        fileformat.load(fileformat.read_header(f), verify=True)


def test_disk_full_degrades_to_not_stored(servers, model, tmpfs, tmp_path):
    d = tmpfs("96k")  # room for two or three entries of the tiny model (~20 KB)
    s = servers(model, d, tmp_path / "1.log").wait_ready()
    warm = []
    for p in PROMPTS:
        s.chat(p)
        warm.append(answer(s.chat(p)))
    time.sleep(2)
    deadline = time.monotonic() + 30  # failed writes remove their temp files
    while tmps(d) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not tmps(d)
    assert s.healthy()
    assert s.text().count("disk full") == 1  # one warning, then debug lines
    s.stop()
    for f in entries(d):  # whatever was stored is whole
        fileformat.load(fileformat.read_header(f), verify=True)

    s2 = servers(model, d, tmp_path / "2.log").wait_ready()
    again = [answer(s2.chat(p)) for p in PROMPTS]
    full = [a == w for a, w in zip(again, warm, strict=False)]  # restored whole, same text
    assert 1 <= sum(full) < len(PROMPTS)
    for (n, t), (wn, wt) in zip(again, warm, strict=False):
        if n == wn:
            assert t == wt


def test_read_only_directory_still_restores(servers, model, tmpfs, tmp_path):
    d = tmpfs("4m")
    s = servers(model, d, tmp_path / "1.log").wait_ready()
    s.chat(PROMPTS[0])
    warm = text(s.chat(PROMPTS[0]))
    s.stop()
    subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)
    s2 = servers(model, d, tmp_path / "2.log").wait_ready()
    r = s2.chat(PROMPTS[0])
    assert restored(r) and text(r) == warm
    for p in PROMPTS[1:4]:
        s2.chat(p)
    time.sleep(1)
    assert s2.healthy()
    # Said once, at start-up; no write is attempted, so none fails.
    log = s2.text()
    said = f"cannot write to {d}: Read-only file system (EROFS); restores only"
    assert log.count(said) == 1 and "not stored" not in log
    assert "writes pending, read-only (nothing is stored)" in log  # the server's disk line
    assert tier_row(s2) == ["read-only", "Read-only file system (EROFS)"]
    assert len(entries(d)) == 1


def tier_row(s):
    """The disk tier's state on ``/status.json``: its labels, as the page shows them."""
    import json
    import urllib.request

    with urllib.request.urlopen(s.url + "/status.json", timeout=30) as r:
        doc = json.loads(r.read())
    (table,) = [t for t in doc["tables"] if t["title"] == "Plugin ssd-cache"]
    (row,) = [r for r in table["rows"] if r[2].startswith("mlx_lm_ssd_cache_disk_tier")]
    assert row[1] == "1"
    return re.findall(r"\[([^\]]*)\]", row[2])


def test_a_directory_that_cannot_be_made_leaves_the_memory_cache(servers, model, tmpfs, tmp_path):
    d = tmpfs("64k")
    subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)
    s = servers(model, d / "cache", tmp_path / "1.log").wait_ready()
    s.chat(PROMPTS[0])
    assert cached(s.chat(PROMPTS[0])) > 0  # mlx-lm's memory cache serves
    assert s.healthy()
    log = s.text()
    said = f"cannot write to {d / 'cache'}: Read-only file system (EROFS); the disk tier is off"
    assert log.count(said) == 1 and "- disk:" not in log
    assert tier_row(s) == ["off", "Read-only file system (EROFS)"]


def test_two_servers_share_one_directory(servers, model, tokenizer, tmp_path):
    d = tmp_path / "cache"
    small = ["--prompt-cache-size", "1"]  # memory keeps one entry: disk is used
    a = servers(model, d, tmp_path / "a.log", extra=small).wait_ready()
    b = servers(model, d, tmp_path / "b.log", extra=small).wait_ready()
    a.chat(PROMPTS[0]), b.chat(PROMPTS[1])
    wait_stored(d, 2)
    r = b.chat(PROMPTS[0])  # written by a, found by b's rescan
    assert restored(r)
    r = a.chat(PROMPTS[1])
    assert restored(r)
    warm1 = text(r)

    # Both store the same new entry at once: one valid file results.
    out = {}
    threads = [
        threading.Thread(target=lambda k=k, srv=srv: out.update({k: srv.chat(PROMPTS[2])}))
        for k, srv in (("a", a), ("b", b))
    ]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert text(out["a"]) == text(out["b"])
    wait_stored(d, 3)
    for f in entries(d):
        fileformat.read_header(f)  # every file is whole

    # b removes entries a knows about: a's next look-up is a miss, not an error.
    file_of(d, tokenizer, PROMPTS[0]).unlink()
    a.chat(PROMPTS[3])  # a's memory now holds prompt 3 only
    r = a.chat(PROMPTS[0])
    assert not restored(r)
    r = b.chat(PROMPTS[1])
    assert restored(r) and text(r) == warm1
    assert a.healthy() and b.healthy()


def test_changed_model_never_restores_old_entries(servers, model, smollm2_tokenizer_dir, tmp_path):
    from mlx_lm_ext.testing import build_tiny_model

    d = tmp_path / "cache"
    s = servers(model, d, tmp_path / "1.log").wait_ready()
    s.chat(PROMPTS[0])
    s.stop()
    (old,) = entries(d)
    old_bytes = old.read_bytes()
    build_tiny_model(
        model, "llama", seed=1, tokenizer_dir=smollm2_tokenizer_dir
    )  # same path, other weights
    s2 = servers(model, d, tmp_path / "2.log").wait_ready()
    r = s2.chat(PROMPTS[0])
    assert cached(r) == 0
    s2.stop()
    assert old.read_bytes() == old_bytes  # the old fingerprint is left alone
    assert len([p for p in d.iterdir() if p.is_dir()]) == 2  # two fingerprint directories


# ---------------------------------------------- other cache paths, restarted


@pytest.mark.parametrize(
    "arch,flags",
    [
        # --kv-bits: served one by one (_serve_single), QuantizedKVCache entries
        ("llama", ["--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "0"]),
        # sliding-window layers: stored entries past the window cannot be
        # trimmed, so only those that are a prefix of the prompt restore (the
        # server's prompt-segment entries)
        ("gemma3_text", []),
    ],
)
def test_restart_restores(servers, tiny_model, tmp_path, arch, flags):
    model = tiny_model(arch, head_dim=32)  # KV quantization groups of 32
    d = tmp_path / "cache"
    s = servers(model, d, tmp_path / "1.log", extra=flags).wait_ready()
    cold = answer(s.chat(PROMPTS[0]))
    s.stop()
    assert entries(d)
    s2 = servers(model, d, tmp_path / "2.log", extra=flags).wait_ready()
    r = s2.chat(PROMPTS[0])
    assert cached(r) > cold[0] + 20  # the prompt came from disk
    assert "restored" in s2.text()
    assert s2.healthy()
