"""The prefix index against a brute-force scan of every entry."""

import numpy as np
import pytest

from mlx_lm_ssd_cache import index as index_module
from mlx_lm_ssd_cache.index import Entry, PrefixIndex, common_length


def brute_best(entries, prompt, block, at_least=0):
    cap = len(prompt) - 1
    best = 0
    for e in entries:
        common = common_length(e.tokens, prompt)
        n = 0
        if common == len(e.tokens) <= cap:
            n = common  # a prefix of the prompt: any cache type
        elif e.trimmable and common >= block:
            n = min(common, cap)
        best = max(best, n)
    return best if best > at_least else 0


def random_entries(rng, n, base):
    entries = []
    for i in range(n):
        # share prefixes of varied length with a common base, then diverge
        keep = int(rng.integers(0, len(base)))
        tail = rng.integers(0, 3, int(rng.integers(0, 60)))
        tokens = np.concatenate([base[:keep], tail]).astype(np.int64)
        if len(tokens) == 0:
            continue
        entries.append(
            Entry(f"e{i}", tokens, bool(rng.integers(0, 2)), int(rng.integers(1, 100)), 0.0)
        )
    return entries


@pytest.mark.parametrize("seed", range(6))
def test_best_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 3, 300)
    block = 8
    idx = PrefixIndex(block)
    entries = random_entries(rng, 40, base)
    for e in entries:
        idx.add(e)
    for _ in range(60):
        keep = int(rng.integers(0, len(base)))
        prompt = np.concatenate([base[:keep], rng.integers(0, 3, int(rng.integers(1, 40)))])
        at_least = int(rng.integers(0, 20))
        m = idx.best(prompt, at_least)
        want = brute_best(entries, prompt, block, at_least)
        assert (m.length if m else 0) == want
        if m:
            assert m.length <= len(prompt) - 1
            common = common_length(m.entry.tokens, prompt)
            assert m.length <= common
            if not m.entry.trimmable:
                assert m.length == len(m.entry.tokens)


def test_collisions_cost_comparisons_not_answers(monkeypatch):
    real = index_module.prefix_hashes
    monkeypatch.setattr(index_module, "prefix_hashes", lambda t: real(t) * np.uint64(0))
    rng = np.random.default_rng(1)
    base = rng.integers(0, 3, 200)
    idx = PrefixIndex(8)
    entries = random_entries(rng, 30, base)
    for e in entries:
        idx.add(e)
    for _ in range(30):
        prompt = np.concatenate([base[: int(rng.integers(0, 200))], rng.integers(0, 3, 5)])
        m = idx.best(prompt)
        assert (m.length if m else 0) == brute_best(entries, prompt, 8)


def test_remove_and_prefixes_of():
    idx = PrefixIndex(4)
    a = Entry("a", np.arange(4), True, 1, 0.0)
    b = Entry("b", np.arange(9), True, 1, 0.0)
    c = Entry("c", np.arange(12), True, 1, 0.0)
    for e in (a, b, c):
        idx.add(e)
    assert {e.name for e in idx.prefixes_of(np.arange(12))} == {"a", "b"}
    assert idx.best(np.arange(30)).entry is c
    idx.remove("c")
    assert idx.best(np.arange(30)).entry is b
    idx.remove("b")
    idx.remove("a")
    assert idx.best(np.arange(30)) is None
    assert not idx._blocks and not idx._ends and not idx._end_hashes


def test_exact_match_leaves_one_token_and_ties_prefer_small_files():
    idx = PrefixIndex(4)
    idx.add(Entry("big", np.arange(10), True, 1000, 0.0))
    idx.add(Entry("small", np.arange(9), False, 10, 0.0))
    m = idx.best(np.arange(10))
    assert m.length == 9 and m.entry.name == "small"
    assert idx.best(np.arange(1)) is None
