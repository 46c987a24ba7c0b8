"""Unfinished writes are reaped by their lock, never by the pid in their name.

Two servers may share a directory under one hostname while each runs in its
own PID namespace (as containers do): neither can see the other's pids. A
temp file another process is still writing, named with a pid that does not
exist here, must survive a scan; once nobody holds its lock and it has been
untouched for the grace period, it is reaped.
"""

import os
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_lm_ext import safefs
from mlx_lm_ssd_cache import SSDPromptCache


def unseen_pid():
    """A pid no process has here: what a writer in another PID namespace looks like."""
    pid = 4_000_000
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid += 1


def age(path, seconds):
    t = time.time() - seconds
    os.utime(path, (t, t))


def stored_space(tiny, tmp_path):
    """A namespace directory of the tiny model holding one entry."""
    model, _, path = tiny("llama")
    c = SSDPromptCache(10, 1 << 63, directory=tmp_path / "cache")
    tokens = list(range(40))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(tokens)[None], cache=cache), [x.state for x in cache])
    c.insert_cache(str(path), tokens, cache)
    c.flush(30)
    c.close()
    (entry,) = (tmp_path / "cache").glob("*/*/*.safetensors")
    return entry.parent, str(path), tokens


def scan(tmp_path, key, tokens):
    """A new tier on the directory: its first look-up scans it."""
    c = SSDPromptCache(10, 1 << 63, directory=tmp_path / "cache")
    cache, rest = c.fetch_nearest_cache(key, tokens + [1])
    c.close()
    assert cache is not None and rest == [1]  # the entry itself is still found


def test_a_write_under_way_in_another_pid_namespace_survives_a_scan(
    tiny, tmp_path, write_under_way
):
    space, key, tokens = stored_space(tiny, tmp_path)
    live = space / f".{'a' * 32}.safetensors.{safefs.HOST}.{unseen_pid()}.abcd.tmp"
    with write_under_way(live):
        age(live, 2 * safefs.REAP_OTHER_HOST)  # even a stalled write is someone's
        scan(tmp_path, key, tokens)
        assert live.exists()
    scan(tmp_path, key, tokens)  # its writer is gone: nobody holds the lock
    assert not live.exists()


def test_an_unlocked_temp_file_is_reaped_after_the_grace_period(tiny, tmp_path):
    space, key, tokens = stored_space(tiny, tmp_path)
    name = f".{'b' * 32}.safetensors.{safefs.HOST}.{unseen_pid()}.abcd.tmp"
    (space / name).write_bytes(b"a dead write")  # just now: it may be a writer's first moment
    scan(tmp_path, key, tokens)
    assert (space / name).exists()
    age(space / name, 2 * safefs.REAP_GRACE)
    scan(tmp_path, key, tokens)
    assert not (space / name).exists()


def test_reap_takes_the_lock_not_the_name(tmp_path):
    d = os.open(tmp_path, os.O_RDONLY)
    try:
        here = safefs.temp_name("x")
        fd = safefs.create_temp(here, d)
        age(tmp_path / here, 10 * safefs.REAP_OTHER_HOST)
        assert not safefs.reap(d, here)  # this process's own live write, too
        os.close(fd)
        assert safefs.reap(d, here)
        # Another host's unlocked file: given an hour (a network folder's clocks).
        other = f".x.elsewhere.{os.getpid()}.abcd.tmp"
        (tmp_path / other).write_bytes(b"")
        age(tmp_path / other, 60)
        assert not safefs.reap(d, other)
        age(tmp_path / other, 2 * safefs.REAP_OTHER_HOST)
        assert safefs.reap(d, other)
        # A link under a temp name is neither followed nor removed.
        victim = tmp_path / "victim"
        victim.write_bytes(b"keep")
        age(victim, 2 * safefs.REAP_OTHER_HOST)
        link = safefs.temp_name("y")
        (tmp_path / link).symlink_to(victim)
        assert not safefs.reap(d, link)
        assert (tmp_path / link).is_symlink() and victim.read_bytes() == b"keep"
    finally:
        os.close(d)
