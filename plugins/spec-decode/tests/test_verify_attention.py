"""Verify-window attention (target.verify_attention): the explicit and the
padded forms compute what mlx-lm's fused attention computes, the loop uses
them only inside its verify forwards, and decoding stays greedy-identical."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlx_lm_spec_decode import DraftModelDrafter, NGramDrafter, speculative_generate_step
from mlx_lm_spec_decode import target as target_mod


def _qkv(hq, hkv, n, s, d=16, seed=0):
    mx.random.seed(seed)
    return (
        mx.random.normal((2, hq, n, d)),
        mx.random.normal((2, hkv, s, d)),
        mx.random.normal((2, hkv, s, d)),
    )


def _masks(hq, n, s):
    keep_first = mx.arange(s)[None] == 0  # every row sees something
    return {
        "none": None,
        "causal": "causal",
        "bool [L,S]": (mx.random.uniform(shape=(n, s)) > 0.3) | keep_first,
        "additive [B,1,L,S]": mx.random.normal((2, 1, n, s)),
        "bool per head": (mx.random.uniform(shape=(2, hq, n, s)) > 0.2) | keep_first,
    }


@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("n,s", [(2, 9), (5, 5), (7, 40)])
def test_explicit_attention_matches_fused(hq, hkv, n, s):
    q, k, v = _qkv(hq, hkv, n, s)
    for name, mask in _masks(hq, n, s).items():
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
        got = target_mod.explicit_attention(q, k, v, 0.3, mask)
        assert got.shape == ref.shape
        assert mx.allclose(got, ref, atol=1e-5, rtol=1e-5).item(), name


@pytest.mark.parametrize("n", [2, 3, 4, 5, 9])
def test_padded_attention_reads_only_the_valid_rows(n):
    # A cache whose buffer holds stale rows past its offset (a trimmed verify).
    hq, hkv, d = 6, 2, 16
    cache = KVCache()
    _, k, v = _qkv(hq, hkv, 1, 300, d, seed=1)
    cache.update_and_fetch(k[:1], v[:1])
    cache.trim(40)
    q, k_new, v_new = _qkv(hq, hkv, n, n, d, seed=2)
    keys, values = cache.update_and_fetch(k_new[:1], v_new[:1])
    assert cache.keys.shape[2] > cache.offset  # the buffer is longer than the window sees
    ref = mx.fast.scaled_dot_product_attention(q[:1], keys, values, scale=0.25, mask="causal")
    got = target_mod.padded_attention(q[:1], cache, 0.25, {})
    assert got.shape == ref.shape
    assert mx.allclose(got, ref, atol=1e-5, rtol=1e-5).item()


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("n", [2, 3, 8])
def test_padded_attention_over_a_batch_buffer_keeps_the_rows_masks(n, fused):
    """A batch cache with left padding and holes: over the whole buffer (its
    stale tail included), with the cache's own mask, the fused op's answer."""
    from mlx_lm_spec_decode.ragged import RaggedKVCache

    hq, hkv, d = 6, 2, 16
    cache = RaggedKVCache.of(BatchKVCache([3, 0, 5]))
    _, k, v = _qkv(hq, hkv, 1, 40, d, seed=3)
    k, v = mx.concatenate([k, k[:1]]), mx.concatenate([v, v[:1]])  # three rows
    cache.update_and_fetch(k, v)
    cache.rollback([2, 0, 4])  # rows 0 and 2 drop entries: holes
    cache.trim(0)
    mask = cache.make_mask(n, return_array=True)
    q, k_new, v_new = _qkv(hq, hkv, n, n, d, seed=4)
    q = mx.concatenate([q, q[:1]])
    keys, values = cache.update_and_fetch(
        mx.concatenate([k_new, k_new[:1]]), mx.concatenate([v_new, v_new[:1]])
    )
    assert cache.keys.shape[2] > keys.shape[2]  # the buffer is longer than the window sees
    ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.25, mask=mask)
    got = target_mod.padded_attention(q, cache, 0.25, {}, mask, fused)
    assert got.shape == ref.shape
    assert mx.allclose(got, ref, atol=1e-5, rtol=1e-5).item()


def test_padded_attention_declines_other_caches():
    from mlx_lm.models.cache import RotatingKVCache

    cache = RotatingKVCache(max_size=64)
    _, k, v = _qkv(4, 2, 1, 10)
    cache.update_and_fetch(k[:1], v[:1])
    assert target_mod.padded_attention(mx.zeros((1, 4, 2, 16)), cache, 1.0, {}) is None


def test_policy_from_environment(monkeypatch):
    monkeypatch.delenv("MLX_LM_SPEC_ATTENTION", raising=False)
    cuda = getattr(mx, "cuda", None)
    on_cuda = cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu
    assert target_mod.attention_policy() == (target_mod.AUTO_CUDA if on_cuda else "fused")
    assert target_mod.attention_policy(batch=True) == (
        target_mod.AUTO_CUDA_BATCH if on_cuda else "fused"
    )
    for how in ("fused", "explicit", "padded", "buffer"):
        monkeypatch.setenv("MLX_LM_SPEC_ATTENTION", how)
        assert target_mod.attention_policy() == how == target_mod.attention_policy(batch=True)
    monkeypatch.setenv("MLX_LM_SPEC_ATTENTION", "flash")
    with pytest.raises(ValueError, match="MLX_LM_SPEC_ATTENTION must be one of"):
        target_mod.attention_policy()


@pytest.mark.parametrize("policy", ["explicit", "padded"])
@pytest.mark.parametrize("which", ["self", "ngram"])
def test_loop_uses_it_and_stays_greedy_identical(
    tiny_llama, repetitive_prompt, monkeypatch, policy, which
):
    model, tok = tiny_llama
    prompt = repetitive_prompt(tok)
    ref = [
        int(t)
        for t, _ in zip(
            (t for t, _ in generate_step(prompt, model, max_tokens=40)), range(40), strict=False
        )
    ]
    calls = {"explicit": 0, "padded": 0}
    for name in calls:
        real = getattr(target_mod, f"{name}_attention")

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(target_mod, f"{name}_attention", counted)
    monkeypatch.setenv("MLX_LM_SPEC_ATTENTION", policy)
    drafter = DraftModelDrafter(model, auto_off=False) if which == "self" else NGramDrafter(n_min=1)
    out = [
        t
        for t, _, _ in speculative_generate_step(
            prompt, model, drafter, num_draft_tokens=3, max_tokens=40
        )
    ]
    assert out == ref
    assert calls[policy] > 0
    if policy == "explicit":
        assert calls["padded"] == 0
    # Outside the verify forwards mlx-lm's own function is back in place.
    import mlx_lm.models.base as base
    import mlx_lm.models.llama as llama

    assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention


def test_bad_policy_fails_before_the_first_token(tiny_llama, repetitive_prompt, monkeypatch):
    model, tok = tiny_llama
    monkeypatch.setenv("MLX_LM_SPEC_ATTENTION", "flash")
    gen = speculative_generate_step(
        repetitive_prompt(tok), model, NGramDrafter(n_min=1), max_tokens=5
    )
    with pytest.raises(ValueError, match="MLX_LM_SPEC_ATTENTION must be one of"):
        next(gen)


def test_fused_policy_leaves_attention_alone(tiny_llama, repetitive_prompt, monkeypatch):
    model, tok = tiny_llama
    seen = []
    monkeypatch.setattr(target_mod, "explicit_attention", lambda *a, **k: seen.append(1))
    monkeypatch.setattr(target_mod, "padded_attention", lambda *a, **k: seen.append(1))
    monkeypatch.setenv("MLX_LM_SPEC_ATTENTION", "fused")
    list(
        speculative_generate_step(
            repetitive_prompt(tok), model, NGramDrafter(n_min=1), max_tokens=20
        )
    )
    assert not seen
