"""SSDPromptCache: stock behaviour in memory, store/find/restore/evict/scan on disk."""

import logging
import os
import random
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, LRUPromptCache, make_prompt_cache, trim_prompt_cache

from mlx_lm_ssd_cache import SSDPromptCache, disk, fileformat


def kv(n, width=4):
    c = KVCache()
    x = mx.ones((1, 1, n, width))
    c.update_and_fetch(x, x)
    mx.eval(c.keys, c.values)
    return c


def prefill(model, tokens, cache=None):
    cache = cache if cache is not None else make_prompt_cache(model)
    mx.eval(model(mx.array(tokens)[None], cache=cache), [c.state for c in cache])
    return cache


def next_logits(model, cache, tokens):
    out = model(mx.array(tokens)[None], cache=cache)
    mx.eval(out)
    return np.array(out)


def ssd(tmp_path, **kw):
    kw.setdefault("directory", tmp_path / "cache")
    return SSDPromptCache(kw.pop("max_size", 10), kw.pop("max_bytes", 1 << 63), **kw)


def lru_state(c):
    return (
        len(c),
        c.nbytes,
        c.stats_by_type(),
        {k: list(v) for k, v in c._lru._lrus.items()},
    )


# ------------------------------------------------------------ memory tier


@pytest.mark.parametrize("seed", range(3))
def test_memory_behaviour_is_stock(tmp_path, seed):
    """Random inserts, fetches and trims: the same answers, order and bytes.

    The model key names no local model, so the disk tier stays off and only
    the memory tier is compared.
    """
    rnd = random.Random(seed)
    stock = LRUPromptCache(max_size=5, max_bytes=400)
    ours = ssd(tmp_path, max_size=5, max_bytes=400)
    models = ["no/such-model-a", "no/such-model-b"]
    for _ in range(300):
        model = rnd.choice(models)
        tokens = [rnd.randint(0, 2) for _ in range(rnd.randint(1, 9))]
        op = rnd.random()
        if op < 0.5:
            n, kind = len(tokens), rnd.choice(["assistant", "user", "system"])
            stock.insert_cache(model, tokens, [kv(n)], cache_type=kind)
            ours.insert_cache(model, tokens, [kv(n)], cache_type=kind)
        elif op < 0.9:
            a, rest_a = stock.fetch_nearest_cache(model, tokens)
            b, rest_b = ours.fetch_nearest_cache(model, tokens)
            if a is not None and not rest_a:
                # mlx-lm's exact hit leaves no token to process (and then
                # fails in generation); ours gives the last token back.
                assert rest_b == tokens[-1:] and b[0].offset == len(tokens) - 1
            else:
                assert rest_a == rest_b
                assert (a is None) == (b is None)
                if a is not None:
                    assert a[0].offset == b[0].offset
        else:
            kw = rnd.choice([{"n_sequences": rnd.randint(0, 4)}, {"n_bytes": rnd.randint(0, 300)}])
            stock.trim_to(**kw)
            ours.trim_to(**kw)
        assert lru_state(ours) == lru_state(stock)
    ours.close()


def test_evictions_spill_through_the_trie(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(disk.DiskTier, "put", lambda self, *a, **k: calls.append((a[1], k)))
    c = ssd(tmp_path, max_size=2)
    for t in ([1], [2], [3]):
        c.insert_cache("m", t, [kv(1)])
    c.trim_to(n_sequences=0)
    inserted = [t for t, k in calls if "touch" not in k]
    spilled = [t for t, k in calls if k.get("touch") is False]
    assert inserted == [[1], [2], [3]]
    assert spilled == [[1], [2], [3]]  # max_size eviction, then trim_to
    c.close()


# -------------------------------------------------------------- disk tier


def test_restore_after_restart_computes_like_a_fresh_prefill(tiny, tmp_path):
    model, _, path = tiny("llama")
    key = (str(path), None, None)  # the server's model key
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 256, 50).tolist(), rng.integers(0, 256, 7).tolist()
    first = ssd(tmp_path)
    first.insert_cache(key, a, prefill(model, a))
    assert first.flush(30)
    first.close()
    assert first.disk_stats()["entries"] == 1

    second = ssd(tmp_path)  # a new process's view: scan, then restore
    cache, rest = second.fetch_nearest_cache(key, a + b)
    assert rest == b and cache[0].offset == 50
    fresh = prefill(model, a)
    np.testing.assert_array_equal(next_logits(model, cache, b), next_logits(model, fresh, b))
    s = second.disk_stats()
    assert s["hits"] == 1 and s["restored_tokens"] == 50
    second.close()


def test_longer_entries_are_trimmed_and_exact_hits_leave_a_token(tiny, tmp_path):
    model, _, path = tiny("llama")
    key = str(path)
    toks = list(range(100))
    c = ssd(tmp_path)
    c.insert_cache(key, toks, prefill(model, toks))
    c.flush(30)
    fresh = ssd(tmp_path)
    prompt = toks[:70] + [255, 254]
    cache, rest = fresh.fetch_nearest_cache(key, prompt)
    assert rest == [255, 254] and cache[0].offset == 70
    # Exactly the stored entry trimmed to 70 tokens; a fresh 70-token prefill
    # agrees to rounding only (BLAS blocks a 100-row matmul differently).
    ref = prefill(model, toks)
    trim_prompt_cache(ref, 30)
    got = next_logits(model, cache, rest)
    np.testing.assert_array_equal(got, next_logits(model, ref, rest))
    np.testing.assert_allclose(got, next_logits(model, prefill(model, toks[:70]), rest), atol=1e-4)
    cache, rest = fresh.fetch_nearest_cache(key, toks)
    assert rest == [99] and cache[0].offset == 99
    c.close()
    fresh.close()


def test_rotating_cache_past_its_window_is_used_only_as_a_prefix(tiny, tmp_path):
    model, _, path = tiny("gemma3_text")  # window 8
    key = str(path)
    toks = list(range(1, 41))
    c = ssd(tmp_path)
    c.insert_cache(key, toks, prefill(model, toks))
    c.flush(30)
    fresh = ssd(tmp_path)
    cache, rest = fresh.fetch_nearest_cache(key, toks[:30] + [3, 3])
    assert cache is None  # would need a trim: impossible past the window
    cache, rest = fresh.fetch_nearest_cache(key, toks + [5, 6])
    assert rest == [5, 6]
    ref = prefill(model, toks)
    np.testing.assert_array_equal(next_logits(model, cache, rest), next_logits(model, ref, rest))
    c.close()
    fresh.close()


def test_memory_wins_ties_and_disk_wins_when_longer(tiny, tmp_path):
    model, _, path = tiny("llama")
    key = str(path)
    toks = list(range(64))
    c = ssd(tmp_path, max_size=1)
    c.insert_cache(key, toks, prefill(model, toks))
    c.flush(30)
    c.fetch_nearest_cache(key, toks + [1])
    assert c.disk_stats()["hits"] == 0  # in memory as long as on disk
    c.insert_cache(key, [7, 7, 7], prefill(model, [7, 7, 7]))  # evicts toks
    c.flush(30)
    cache, rest = c.fetch_nearest_cache(key, toks + [1])
    assert rest == [1] and c.disk_stats()["hits"] == 1
    c.close()


def test_new_entry_supersedes_stored_prefixes(tiny, tmp_path):
    model, _, path = tiny("llama")
    key = str(path)
    c = ssd(tmp_path)
    system = list(range(40))
    c.insert_cache(key, system, prefill(model, system), cache_type="system")
    c.insert_cache(key, system + [1, 2, 3], prefill(model, system + [1, 2, 3]))
    c.insert_cache(key, [9] * 40, prefill(model, [9] * 40))  # unrelated: kept
    c.flush(30)
    s = c.disk_stats()
    assert s["entries"] == 2 and s["superseded"] == 1
    stored = sorted(len(fileformat.read_header(p).tokens) for p in _entries(tmp_path))
    assert stored == [40, 43]
    c.close()


def _entries(tmp_path):
    return sorted((tmp_path / "cache").glob("*/*/*.safetensors"))


def test_byte_cap_evicts_least_recently_used(tiny, tmp_path):
    model, _, path = tiny("llama")
    key = str(path)
    seqs = [[i] * 33 for i in range(4)]
    caches = [prefill(model, s) for s in seqs]
    c = ssd(tmp_path)
    for s, cache in zip(seqs[:3], caches[:3], strict=False):
        c.insert_cache(key, s, cache)
        c.flush(30)
    size = max(p.stat().st_size for p in _entries(tmp_path))
    cap = int(3.5 * size)  # room for three entries
    fresh = ssd(tmp_path, disk_bytes=cap, max_size=1)
    fresh.fetch_nearest_cache(key, seqs[0] + [1])  # a hit refreshes entry 0
    fresh.flush(30)
    fresh.insert_cache(key, seqs[3], caches[3])
    fresh.flush(30)
    left = {int(fileformat.read_header(p).tokens[0]) for p in _entries(tmp_path)}
    assert left == {0, 2, 3}  # entry 1 was the least recently used
    assert fresh.disk_stats()["evicted"] == 1
    assert sum(p.stat().st_size for p in _entries(tmp_path)) <= cap
    c.close()
    fresh.close()


def test_scan_removes_corrupt_reaps_dead_tmp_and_leaves_others(tiny, tmp_path, caplog):
    model, _, path = tiny("llama")
    key = str(path)
    c = ssd(tmp_path)
    good, bad = list(range(40)), list(range(100, 140))
    c.insert_cache(key, good, prefill(model, good))
    c.insert_cache(key, bad, prefill(model, bad))
    c.flush(30)
    c.close()
    files = _entries(tmp_path)
    space = files[0].parent
    bad_file = [p for p in files if fileformat.read_header(p).tokens[0] == 100][0]
    raw = bad_file.read_bytes()
    bad_file.write_bytes(raw[: len(raw) // 2])  # truncated
    dead = space / f".{'a' * 32}.safetensors.{disk.HOST}.999999999.abcd.tmp"
    dead.write_bytes(b"partial")
    stale = dead.stat().st_mtime - 60  # unlocked and untouched past the grace period
    os.utime(dead, (stale, stale))
    foreign = space / f".{'b' * 32}.safetensors.otherhost.12.abcd.tmp"  # fresh, other host
    foreign.write_bytes(b"partial")
    other_fp = tmp_path / "cache" / "0123456789abcdef" / "base"
    other_fp.mkdir(parents=True)
    (other_fp / "junk.safetensors").write_bytes(b"not ours to judge")

    with caplog.at_level(logging.WARNING, logger="mlx_lm_ssd_cache"):
        fresh = ssd(tmp_path)
        cache, rest = fresh.fetch_nearest_cache(key, good + [1])
    assert rest == [1]
    assert not bad_file.exists() and not dead.exists() and foreign.exists()
    assert bad_file.with_name(bad_file.name + ".rejected").exists()  # set aside, not lost
    assert (other_fp / "junk.safetensors").exists()
    assert fresh.disk_stats()["entries"] == 1
    assert fresh.fetch_nearest_cache(key, bad + [1])[0] is None
    assert sum("corrupt" in r.message for r in caplog.records) == 1
    fresh.close()


def test_model_changes_change_the_fingerprint(tiny_model, tmp_path):
    from mlx_lm_ssd_cache import identity

    src = tiny_model("llama")
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    fp = identity.identify(str(src))[0]
    assert identity.identify(str(copy))[0] == fp  # a copy keeps its entries
    assert identity.identify(str(copy), {"kv_bits": 4})[0] != fp
    weights = copy / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-5] ^= 1  # one weight byte, in a sampled window (the file's end)
    weights.write_bytes(bytes(raw))
    assert identity.identify(str(copy))[0] != fp
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    mx.save_safetensors(str(adapter / "adapters.safetensors"), {"a": mx.zeros((2, 2))})
    (adapter / "adapter_config.json").write_text("{}")
    fp2, ns, _ = identity.identify((str(src), str(adapter), None))
    assert fp2 == fp and ns != "base"  # an adapter: same model, own namespace


def test_io_failures_never_raise(tiny, tmp_path, caplog):
    model, _, path = tiny("llama")
    key = str(path)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with caplog.at_level(logging.WARNING, logger="mlx_lm_ssd_cache"):
        c = SSDPromptCache(10, directory=blocker / "sub")  # under a file
        for i in range(3):
            c.insert_cache(key, [i] * 40, prefill(model, [i] * 40))
        c.flush(30)
        assert c.fetch_nearest_cache(key, [5] * 41)[0] is None
    s = c.disk_stats()
    assert s["failures"] == 3 and s["entries"] == 0
    assert len([r for r in caplog.records if "not stored" in r.message]) == 1
    c.close()


def test_caches_a_plugin_appends_are_left_out_unless_registered(tiny, tmp_path):
    model, _, path = tiny("llama")
    c = ssd(tmp_path)
    toks = list(range(40))
    cache = prefill(model, toks) + [kv(40)]  # e.g. a plugin drafter's cache appended
    c.insert_cache(str(path), toks, cache)
    c.flush(30)
    assert c.disk_stats()["entries"] == 1
    c.close()
    fresh = ssd(tmp_path)
    restored, rest = fresh.fetch_nearest_cache(str(path), toks + [7])
    assert rest == [7] and len(restored) == len(cache) - 1  # the model's caches only
    fresh.close()


class History(KVCache):
    """A plugin's cache riding after the model's: state plus meta state."""

    @property
    def meta_state(self):
        return ("7",)

    @classmethod
    def from_state(cls, state, meta_state):
        assert meta_state == ("7",)
        obj = cls()
        obj.keys, obj.values, obj.offset = state
        return obj


def test_registered_plugin_caches_are_stored_and_restored(tiny, tmp_path):
    model, _, path = tiny("llama")
    c = ssd(tmp_path, extra_classes=lambda: [History])
    toks = list(range(40))
    extra = History()
    extra.update_and_fetch(mx.ones((1, 1, 40, 4)), mx.zeros((1, 1, 40, 4)))
    c.insert_cache(str(path), toks, prefill(model, toks) + [extra])
    c.close(30)
    fresh = ssd(tmp_path, extra_classes=lambda: [History])
    restored, rest = fresh.fetch_nearest_cache(str(path), toks + [7])
    assert rest == [7] and isinstance(restored[-1], History)
    assert restored[-1].offset == 40 and restored[-1].keys.sum().item() == 160
    fresh.close()
    plain = ssd(tmp_path)  # a server without that plugin gets the model's caches
    restored, _ = plain.fetch_nearest_cache(str(path), toks + [7])
    assert not any(isinstance(x, History) for x in restored)
    plain.close()


def test_a_failing_writer_releases_its_pending_entries(tiny, tmp_path, monkeypatch):
    model, _, path = tiny("llama")

    def broken(*a, **k):
        raise TypeError("a bug in the writer")

    monkeypatch.setattr(fileformat, "write", broken)
    c = ssd(tmp_path)
    for i in range(3):
        c.insert_cache(str(path), [i] * 40, prefill(model, [i] * 40))
    c.flush(30)
    s = c.disk_stats()
    assert s["failures"] == 3 and s["pending"] == 0 and s["pending_bytes"] == 0
    assert s["entries"] == 0 and not list((tmp_path / "cache").glob("*/*/*"))
    assert c.fetch_nearest_cache(str(path), [1] * 41)[0] is not None  # memory still works
    c.close()


def test_a_cache_made_without_settings_shares_a_default_servers_entries(tiny, tmp_path):
    """The Python API's ``SSDPromptCache(directory=...)`` and a server at its
    default KV options (what ``--plugin ssd-cache`` passes) read one another's
    entries; a server quantizing its KV cache does not."""
    model, _, path = tiny("llama")
    key = (str(path), None, None)
    toks = list(range(40))
    server = {"kv_bits": None, "kv_group_size": 64, "quantized_kv_start": 5000}
    first = ssd(tmp_path)  # no settings
    first.insert_cache(key, toks, prefill(model, toks))
    assert first.flush(30)
    first.close()
    second = ssd(tmp_path, settings=server)
    cache, rest = second.fetch_nearest_cache(key, toks + [7])
    assert rest == [7] and cache[0].offset == 40
    second.close()
    third = ssd(tmp_path, settings=dict(server, kv_bits=4))
    cache, rest = third.fetch_nearest_cache(key, toks + [7])
    assert cache is None and rest == toks + [7]
    third.close()
