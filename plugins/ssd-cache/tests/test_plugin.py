"""The plugin's hooks, flags and operator commands."""

import argparse
import logging
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

from mlx_lm_ext import PluginError
from mlx_lm_ssd_cache import SSDPromptCache, plugin

BIN = Path(sys.executable).parent


def parsed(*argv, command="server"):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--adapter-path", default=None)
    parser.add_argument("--draft-model", default=None)
    for k in ("--kv-bits", "--kv-group-size", "--quantized-kv-start"):
        parser.add_argument(k, type=int, default=None)
    plugin.add_arguments(command, parser.add_argument_group("ssd-cache"))
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    "text,value",
    [
        ("123", 123),
        ("10K", 10 << 10),
        ("500M", 500 << 20),
        ("1.5G", 3 << 29),
        ("2GiB", 2 << 30),
        ("1t", 1 << 40),
        ("64MB", 64 << 20),
    ],
)
def test_sizes(text, value):
    assert plugin.parse_bytes(text) == value


@pytest.mark.parametrize("text", ["12X", "-1", "0", "", "G", "1.5.2G"])
def test_bad_sizes(text):
    with pytest.raises(PluginError, match="--ssd-cache-bytes"):
        plugin.parse_bytes(text)


def test_bad_dirs(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    for bad in (f, f / "under"):
        with pytest.raises(PluginError, match="not a directory"):
            plugin.check_dir(str(bad))
    assert plugin.check_dir(str(tmp_path / "new" / "dir")) == tmp_path / "new" / "dir"


def test_defaults_are_json_and_under_the_user_cache_dir():
    import json

    args = parsed()
    json.dumps(vars(args))
    assert args.ssd_cache_dir.endswith("mlx-lm-ext/ssd-cache")
    assert plugin.options(args)[1] == 8 << 30


def test_refuses_distributed(monkeypatch):
    monkeypatch.setattr(plugin, "_world_size", lambda: 2)
    with pytest.raises(PluginError, match="distributed"):
        plugin.activate("server", parsed())


def test_report_line_of_the_disk_tier(tmp_path):
    cache = SSDPromptCache(10, directory=tmp_path)
    (line,) = plugin.report_lines("server", cache)
    assert line.startswith("- disk: 0 entries, 0.00 GB, 0 hits / 0 lookups")
    assert plugin.report_lines("server", object()) is None
    assert plugin.report_lines("generate", cache) is None
    cache.close()


def test_one_entry_is_counted_in_the_singular(tmp_path, tiny, caplog):
    model, _, path = tiny("llama")
    d = tmp_path / "cache"
    c = SSDPromptCache(10, directory=d)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([1] * 40)[None], cache=cache), [x.state for x in cache])
    c.insert_cache(str(path), [1] * 40, cache)
    c.flush(30)
    (line,) = plugin.report_lines("server", c)
    assert line.startswith("- disk: 1 entry, "), line
    c.close(30)
    again = SSDPromptCache(10, directory=d)
    with caplog.at_level(logging.INFO, logger="mlx_lm_ssd_cache"):
        again.fetch_nearest_cache(str(path), [1] * 41)  # identifies and scans the directory
    assert "(1 entry on disk)" in caplog.text, caplog.text
    again.close()
    r = subprocess.run(
        [str(BIN / "mlx-lm-ext"), "ssd-cache", "stats", "--dir", str(d)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert f"{d}: 1 entry, " in r.stdout, r.stdout + r.stderr


# ------------------------------------------- a directory that cannot be written

STORED, OTHER = [3] * 40, [4] * 48


def _stored_once(model, path, d):
    """One entry in ``d``, stored as a server on ``path`` stores it."""
    args = parsed("--model", str(path), "--ssd-cache-dir", str(d))
    c = plugin.make_prompt_cache(args, plugin.activate("server", args), 10, 1 << 63)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(STORED)[None], cache=cache), [x.state for x in cache])
    c.insert_cache((str(path), None, None), STORED, cache)
    assert c.close(30) and c.disk_stats()["entries"] == 1
    plugin.deactivate()


def _files(d):
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def _tier(cache, opts):
    """The disk tier's state as ``/metrics`` and ``/status`` show it: ``[(labels, value)]``."""
    (fam,) = [f for f in plugin.metrics(cache, opts) if f.name == "mlx_lm_ssd_cache_disk_tier"]
    return [(s.labels, s.value) for s in fam.samples]


def _start(path, d, caplog):
    """``(args, activate's options, the one warning it logged)``."""
    caplog.clear()
    args = parsed("--model", str(path), "--ssd-cache-dir", str(d))
    with caplog.at_level(logging.WARNING, logger="mlx_lm_ssd_cache"):
        opts = plugin.activate("server", args)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    return args, opts, warning


def check_unwritable(model, path, d, error, caplog):
    """``d``, holding one entry, and everything in it can no longer be written."""
    key = (str(path), None, None)
    before = _files(d)
    args, opts, warning = _start(path, d, caplog)
    assert warning == f"ssd-cache: cannot write to {d}: {error}; restores only, nothing is stored"
    cache = plugin.make_prompt_cache(args, opts, 10, 1 << 63)
    try:
        restored, rest = cache.fetch_nearest_cache(key, STORED + [7])
        assert restored is not None and rest == [7]  # the entry on disk still serves
        new = make_prompt_cache(model)
        mx.eval(model(mx.array(OTHER)[None], cache=new), [x.state for x in new])
        cache.insert_cache(key, OTHER, new)
        assert cache.flush(30)
        assert cache.disk_stats()["failures"] == 0 and _files(d) == before  # none attempted
        assert cache.fetch_nearest_cache(key, OTHER + [7])[1] == [7]  # memory serves it
        (line,) = plugin.report_lines("server", cache)
        assert line.endswith(", read-only (nothing is stored)")
        assert _tier(cache, opts) == [({"state": "read-only", "reason": error}, 1)]
    finally:
        cache.close()
        plugin.deactivate()
    # A directory that cannot even be made: no disk tier, mlx-lm's memory cache.
    args, opts, warning = _start(path, d / "new", caplog)
    assert warning.startswith(f"ssd-cache: cannot write to {d / 'new'}: ")
    assert warning.endswith("; the disk tier is off")
    assert plugin.make_prompt_cache(args, opts, 10, 1 << 63) is None
    ((labels, value),) = _tier(LRUPromptCache(), opts)
    assert labels["state"] == "off" and labels["reason"].startswith(error.split()[0]) and value == 1
    plugin.deactivate()


def _chmod_restricts(tmp_path):
    """False for root (or any process allowed to override file modes)."""
    probe = tmp_path / "probe"
    probe.mkdir(mode=0o555)
    try:
        (probe / "file").write_text("x")
        return False
    except PermissionError:
        return True


def test_a_read_only_directory_is_said_at_start_up(tiny, tmp_path, caplog):
    if not _chmod_restricts(tmp_path):
        pytest.skip("this user writes through chmod (root)")
    model, _, path = tiny("llama")
    d = tmp_path / "cache"
    _stored_once(model, path, d)
    for p in [d, *d.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        check_unwritable(model, path, d, "Permission denied (EACCES)", caplog)
    finally:
        for p in [d, *d.rglob("*")]:
            p.chmod(0o755)


def test_a_read_only_file_system_is_said_at_start_up(tiny, tmp_path, caplog):
    model, _, path = tiny("llama")
    d = tmp_path / "mnt"
    d.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], capture_output=True
    )
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        _stored_once(model, path, d)
        subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)
        check_unwritable(model, path, d, "Read-only file system (EROFS)", caplog)
    finally:
        subprocess.run(["umount", "-l", str(d)])


def test_a_writable_directory_is_on(tmp_path):
    args = parsed("--ssd-cache-dir", str(tmp_path / "cache"))
    opts = plugin.activate("server", args)
    try:
        cache = plugin.make_prompt_cache(args, opts, 10, 1 << 63)
        assert _tier(cache, opts) == [({"state": "on"}, 1)]
        assert _files(tmp_path / "cache") == ["CACHEDIR.TAG"]  # the write check left nothing
        cache.close()
    finally:
        plugin.deactivate()


def test_make_prompt_cache_uses_flags(tmp_path, tiny_model):
    path = tiny_model("llama")
    args = parsed(
        "--model",
        str(path),
        "--ssd-cache-dir",
        str(tmp_path),
        "--ssd-cache-bytes",
        "1G",
        "--ssd-cache-verify",
        "--kv-bits",
        "8",
    )
    opts = plugin.activate("server", args)
    try:
        cache = plugin.make_prompt_cache(args, opts, 7, 1 << 63)
    finally:
        plugin.deactivate()
    assert isinstance(cache, SSDPromptCache) and cache.max_size == 7
    assert cache.disk.max_bytes == 1 << 30 and cache.disk.verify
    assert cache.disk.settings["kv_bits"] == 8
    cache.flush(30)  # the default model's directory was identified in advance
    assert (str(path), None, None) in cache.disk._spaces
    cache.close()


def test_server_exits_2_on_bad_flags(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    for flags, message in (
        (["--ssd-cache-bytes", "lots"], "is not a size"),
        (["--ssd-cache-dir", str(f)], "not a directory"),
        (["--ssd-cache-dir", ""], "empty path"),
        (["--ssd-cache-dir", str(tmp_path)], "not ssd-cache entries"),  # holds `file`
    ):
        r = subprocess.run(
            [str(BIN / "mlx_lm.server"), "--plugin", "ssd-cache", *flags],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2 and message in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1  # one line, no usage block


def test_python_api_enable_disable(tmp_path):
    import mlx_lm_ext

    mlx_lm_ext.enable("ssd-cache", ssd_cache_dir=str(tmp_path), ssd_cache_bytes="2G")
    try:
        assert "ssd-cache" in mlx_lm_ext.enabled()
    finally:
        mlx_lm_ext.disable("ssd-cache")
    with pytest.raises(PluginError):
        mlx_lm_ext.enable("ssd-cache", ssd_cache_bytes="nope")


def test_operator_commands(tmp_path, tiny):
    model, _, path = tiny("llama")
    d = tmp_path / "cache"
    c = SSDPromptCache(10, directory=d)
    for t in ([1] * 40, [2] * 50):
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array(t)[None], cache=cache), [x.state for x in cache])
        c.insert_cache(str(path), t, cache)
    c.close(30)
    other = d / "0000000000000000" / "base"
    other.mkdir(parents=True)
    junk = other / ("0" * 32 + ".safetensors")  # an entry's name: clear only takes those
    junk.write_bytes(b"corrupt")

    def run(*argv):
        r = subprocess.run(
            [str(BIN / "mlx-lm-ext"), "ssd-cache", *argv, "--dir", str(d)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    out = run("stats")
    assert "3 entries" in out and str(path) in out
    out = run("ls")
    assert out.count(" ok") == 2 and "corrupt" in out and " 50 " in out and " 40 " in out
    fp = next(p.name for p in d.iterdir() if p.is_dir() and p.name != "0000000000000000")
    assert "removed 2 files" in run("clear", "--fingerprint", fp[:6], "--yes")
    assert junk.exists() and not (d / fp).exists()
    assert "removed 1 file," in run("clear", "--yes")
    assert "0 entries" in run("stats")


DROP_IN = """
import sys, mlx_lm_ext
early = sys.argv[2] == "early"
if early:
    import mlx_lm.server as server
enabled = mlx_lm_ext.enable("ssd-cache", ssd_cache_dir=sys.argv[1])
import mlx_lm.server as server
from mlx_lm.models.cache import LRUPromptCache as Stock
c = server.LRUPromptCache()
print(type(c).__name__, c.max_size, c.max_bytes == 1 << 63)
c2 = server.LRUPromptCache(3, max_bytes=1000)
print(c2.max_size, c2.max_bytes, isinstance(c2, server.LRUPromptCache), isinstance(c2, Stock))
class Mine(server.LRUPromptCache):
    pass
m = Mine(4)
print(type(m).__name__, m.max_size, issubclass(Mine, Stock))
if enabled is not None:
    mlx_lm_ext.disable("ssd-cache")
print(server.LRUPromptCache is Stock)
"""


@pytest.mark.parametrize("when", ["early", "late"])
def test_python_api_keeps_the_prompt_cache_class_contract(tmp_path, when):
    r = subprocess.run(
        [sys.executable, "-c", DROP_IN, str(tmp_path / "c"), when],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:4] == [
        "SSDPromptCache 10 True",
        "3 1000 True True",
        "Mine 4 True",
        "True",
    ]


def test_the_disable_variable_wins_over_enable(tmp_path):
    import os

    env = dict(os.environ, MLX_LM_EXT_DISABLE="1")
    r = subprocess.run(
        [sys.executable, "-c", DROP_IN, str(tmp_path / "c"), "late"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0] == "LRUPromptCache 10 True"  # mlx-lm's own
    assert "MLX_LM_EXT_DISABLE is set" in r.stderr
