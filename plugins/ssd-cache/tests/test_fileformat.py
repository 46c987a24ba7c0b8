"""Entry files: every storable cache type round-trips and computes the same."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from mlx_lm_ssd_cache import fileformat


def prefill(model, tokens, cache):
    logits = model(mx.array(tokens)[None], cache=cache)
    mx.eval(logits, [c.state for c in cache])
    return logits


def roundtrip(tmp_path, cache, tokens=(1, 2, 3), verify=True):
    snap = fileformat.snapshot(cache)
    path = tmp_path / "e.safetensors"
    meta = {"tokens": fileformat.tokens_json(tokens), "fingerprint": "f", "namespace": "n"}
    size = fileformat.write(path, snap, meta)
    assert size == path.stat().st_size
    header = fileformat.read_header(path)
    assert header.tokens.tolist() == list(tokens)
    return fileformat.load(header, verify=verify)[0], header, snap


def next_logits(model, cache, tokens):
    out = model(mx.array(tokens)[None], cache=cache)
    mx.eval(out)
    return np.array(out)


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
@pytest.mark.parametrize("n", [5, 40])  # gemma: inside and past its 8-token window
def test_model_cache_roundtrip_computes_identically(tiny, tmp_path, kind, n):
    model, _, _ = tiny(kind)
    tokens = np.random.default_rng(n).integers(0, 256, n).tolist()
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache)
    restored, header, snap = roundtrip(tmp_path, cache, tokens)
    assert [type(c) for c in restored] == [type(c) for c in cache]
    assert snap.n_tokens == n
    # stored sliced to the offset: far less than the 256-step buffers
    assert snap.nbytes < sum(c.nbytes for c in cache)
    nxt = [7, 8, 9]
    np.testing.assert_array_equal(next_logits(model, restored, nxt), next_logits(model, cache, nxt))
    rotating = [c for c in restored if isinstance(c, RotatingKVCache)]
    assert snap.trimmable == (not rotating or n < 8)


def test_quantized_bf16_arrays_and_cachelist_roundtrip(tmp_path):
    k = mx.random.normal((1, 2, 70, 64)).astype(mx.bfloat16)
    kv = KVCache()
    kv.update_and_fetch(k, k * 2)
    q = QuantizedKVCache(group_size=32, bits=4)
    q.update_and_fetch(k.astype(mx.float32), k.astype(mx.float32))
    arrays = ArraysCache(2)
    arrays[0] = mx.arange(6).reshape(1, 6).astype(mx.int32)
    nested = CacheList(KVCache(), RotatingKVCache(max_size=8, keep=2))
    nested[0].update_and_fetch(k[..., :5, :], k[..., :5, :])
    nested[1].update_and_fetch(k[..., :12, :], k[..., :12, :])
    cache = [kv, q, arrays, nested]
    mx.eval([c.state for c in cache])
    restored, header, _ = roundtrip(tmp_path, cache)
    assert header.tensors["0"]["dtype"] == "BF16"
    assert restored[0].keys.dtype == mx.bfloat16
    assert restored[0].keys.shape[2] == 70  # sliced from a 256-token buffer
    assert mx.array_equal(restored[0].keys, kv.keys[..., :70, :]).item()
    assert restored[1].offset == 70 and restored[1].bits == 4
    for a, b in zip(restored[1].keys, q.keys, strict=False):
        assert mx.array_equal(a, b[..., :70, :]).item()
    assert restored[2][1] is None and restored[2][0].tolist() == [[0, 1, 2, 3, 4, 5]]
    assert isinstance(restored[3], CacheList)
    assert restored[3][1].offset == 12 and restored[3][1].keep == 2
    assert mx.array_equal(restored[3][1].keys, nested[1].keys).item()


def test_file_is_plain_safetensors(tiny, tmp_path):
    from safetensors import safe_open

    model, _, _ = tiny("llama")
    cache = make_prompt_cache(model)
    prefill(model, [1, 2, 3, 4], cache)
    _, header, _ = roundtrip(tmp_path, cache, [1, 2, 3, 4])
    with safe_open(str(tmp_path / "e.safetensors"), framework="numpy") as f:
        assert json.loads(f.metadata()["tokens"]) == [1, 2, 3, 4]
        np.testing.assert_array_equal(f.get_tensor("0"), np.array(cache[0].keys[..., :4, :]))


def test_custom_cache_class_is_unsupported():
    class MyCache(KVCache):
        pass

    with pytest.raises(fileformat.Unsupported):
        fileformat.snapshot([MyCache()])


def _written(tiny, tmp_path):
    model, _, _ = tiny("llama")
    cache = make_prompt_cache(model)
    prefill(model, list(range(20)), cache)
    roundtrip(tmp_path, cache, list(range(20)))
    return tmp_path / "e.safetensors"


def test_flipped_header_byte_is_corrupt(tiny, tmp_path):
    path = _written(tiny, tmp_path)
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    i = raw.index(b'"tokens"') + 12  # inside the token list
    assert i < 8 + n
    raw[i] = ord("9") if raw[i] != ord("9") else ord("8")
    path.write_bytes(bytes(raw))
    with pytest.raises(fileformat.Corrupt):
        fileformat.read_header(path)


def test_truncated_file_is_corrupt(tiny, tmp_path):
    path = _written(tiny, tmp_path)
    raw = path.read_bytes()
    for cut in (4, 100, len(raw) - 1):
        path.write_bytes(raw[:cut])
        with pytest.raises(fileformat.Corrupt):
            fileformat.read_header(path)


def test_flipped_tensor_byte_caught_by_verify(tiny, tmp_path):
    path = _written(tiny, tmp_path)
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0x40
    path.write_bytes(bytes(raw))
    header = fileformat.read_header(path)  # the header is intact
    with pytest.raises(fileformat.Corrupt, match="CRC32"):
        fileformat.load(header, verify=True)
    fileformat.load(header, verify=False)  # without --ssd-cache-verify: not seen
