"""The CUDA backend's host side, on any machine: kernels replaced by an MLX model.

``fake_kernel`` computes what each kernel promises (per-split max and sum
of exponentials over exactly the vocabulary rows the grid gives that split,
the target's logit; the scaled hidden gradient) with plain MLX ops, so the
Python around the kernels (split sizes, the merge into the log-sum-exp, the
custom VJP, the weight-gradient path, the fallbacks, mx.compile) is checked
here against the pure-MLX backend. The kernels themselves are checked on a
GPU by test_cuda.py.
"""

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_lm_ext import PluginError
from mlx_lm_flash_cce import backends, cuda, heads, linear_cross_entropy, portable, selection
from mlx_lm_flash_cce.candidate import Path


def _dense(vals, quantized, h):
    if not quantized:
        return vals[0].astype(mx.float32)
    w, scales, biases = vals
    group = h // scales.shape[1]
    bits = 32 * w.shape[1] // h
    return mx.dequantize(w, scales, biases, group_size=group, bits=bits).astype(mx.float32)


def _logits(h, w, prm):
    scale, cap = prm[0].item(), prm[1].item()
    r = h.astype(mx.float32) @ w.T
    z = r * scale
    dz = mx.full(z.shape, scale)
    if cap > 0:
        th = mx.tanh(z / cap)
        z, dz = cap * th, scale * (1 - th * th)
    return z, dz


def fake_kernel(kind, quantized):
    def call(inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value=None):
        assert threadgroup == (cuda.NT, 1, 1) and grid[0] % cuda.NT == 0
        h, t = inputs[0], inputs[1]
        n_tok, hid = h.shape
        assert grid[0] // cuda.NT == -(-n_tok // cuda.BM)
        prm = inputs[-1]
        if kind == "fwd":
            vals = inputs[2:-1]
            w = _dense(vals, quantized, hid)
            z, _ = _logits(h, w, prm)
            vocab, splits = w.shape[0], grid[1]
            nvb = -(-vocab // cuda.BN)
            ms, ls = [], []
            for j in range(splits):
                lo, hi = j * nvb // splits * cuda.BN, min((j + 1) * nvb // splits * cuda.BN, vocab)
                assert lo < hi  # no empty split
                part = z[:, lo:hi]
                m = part.max(axis=1)
                ms.append(m)
                ls.append(mx.exp(part - m[:, None]).sum(axis=1))
            zt = mx.take_along_axis(z, t[:, None], axis=1)[:, 0]
            return mx.stack(ms), mx.stack(ls), zt
        lse, g = inputs[2], inputs[3]
        vals = inputs[4:-1]
        w = _dense(vals, quantized, hid)
        z, dz = _logits(h, w, prm)
        onehot = mx.arange(w.shape[0])[None, :] == t[:, None]
        d = (mx.exp(z - lse[:, None]) - onehot) * dz
        return ((g[:, None] * d) @ w,)

    return call


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(cuda, "_kernel", fake_kernel)
    cuda._CORES.clear()
    yield
    cuda._CORES.clear()


def _case(n, v, h, quantized=False, seed=0):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    hidden = mx.random.normal((n, h), key=k1).astype(mx.bfloat16)
    weight = (2 * mx.random.normal((v, h), key=k2) / h**0.5).astype(mx.bfloat16)
    targets = mx.random.randint(0, v, (n,), key=k3)
    if quantized:
        layer = nn.QuantizedLinear(h, v, bias=False, group_size=64, bits=4)
        layer.weight, layer.scales, layer.biases = mx.quantize(weight, group_size=64, bits=4)
        return hidden, heads.as_head(layer), targets
    return hidden, heads.as_head(weight), targets


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("n,v", [(1, 300), (130, 5003), (300, 9000)])
@pytest.mark.parametrize("cap", [{}, {"softcap": 4.0, "logit_scale": 0.5}])
def test_host_side_matches_pure_mlx(fake, n, v, quantized, cap):
    hidden, head, targets = _case(n, v, 128, quantized)
    opts = portable.Options(compute_dtype=mx.float32, dequantize=True, **cap)
    train = {"weight": False}
    fn = lambda backend: (
        lambda x: (backend(head, x, targets, opts, train) * mx.arange(1, n + 1)).sum()
    )
    v1, g1 = mx.value_and_grad(fn(cuda.per_token))(hidden.astype(mx.float32).astype(mx.bfloat16))
    v2, g2 = mx.value_and_grad(fn(portable.per_token))(hidden)
    assert abs(v1.item() - v2.item()) <= 1e-4 * abs(v2.item())
    assert g1.dtype == mx.bfloat16
    assert mx.allclose(
        g1.astype(mx.float32), g2.astype(mx.float32), rtol=2e-2, atol=1e-3 * mx.abs(g2).max().item()
    )
    compiled = mx.compile(mx.value_and_grad(fn(cuda.per_token)))(hidden)
    assert abs(compiled[0].item() - v1.item()) <= 1e-6 * abs(v1.item())


def test_weight_gradient_of_a_trainable_dense_head(fake):
    hidden, head, targets = _case(90, 700, 128, seed=1)
    opts = portable.Options(compute_dtype=mx.float32)

    def fn(backend):
        return lambda x, w: backend(head._replace(weight=w), x, targets, opts, None).mean()

    (_, (gh1, gw1)) = mx.value_and_grad(fn(cuda.per_token), argnums=(0, 1))(hidden, head.weight)
    (_, (gh2, gw2)) = mx.value_and_grad(fn(portable.per_token), argnums=(0, 1))(hidden, head.weight)
    scale = mx.abs(gw2).max().item()
    assert gw1.dtype == head.weight.dtype
    assert mx.abs(gw1.astype(mx.float32) - gw2.astype(mx.float32)).max().item() <= 2e-2 * scale


def test_split_sizes():
    # forward: about 4 blocks per multiprocessor, never more splits than tiles
    assert cuda.fwd_splits(8192, 151936) * 64 >= 4 * cuda.SMS
    assert cuda.fwd_splits(8192, 200) == 2
    # backward: whole waves of one block per multiprocessor
    for n, v in ((8192, 151936), (8192, 262144), (2048, 49152), (100, 1000)):
        s = cuda.bwd_splits(n, v)
        assert 1 <= s <= -(-v // cuda.RC)
        ctas = -(-n // cuda.BM) * s
        if -(-v // cuda.RC) >= 8:
            assert ctas >= cuda.SMS * 0.9 or s == -(-v // cuda.RC)


def test_unsupported_cases_say_why():
    x = mx.zeros((4, 128), dtype=mx.bfloat16)
    w = mx.zeros((10, 128), dtype=mx.bfloat16)
    assert cuda.unsupported(heads.as_head(w), x) is None
    assert "float32" in cuda.unsupported(heads.as_head(w.astype(mx.float32)), x.astype(mx.float32))
    assert "differs" in cuda.unsupported(heads.as_head(w.astype(mx.float16)), x)
    assert "multiple of 64" in cuda.unsupported(
        heads.as_head(mx.zeros((10, 96), mx.bfloat16)), mx.zeros((4, 96), mx.bfloat16)
    )
    assert "bias" in cuda.unsupported(heads.as_head(nn.Linear(128, 10)), x)
    q = nn.QuantizedLinear(128, 64, bias=False, group_size=32, bits=3)
    assert "3-bit" in cuda.unsupported(heads.as_head(q), x)
    mxfp = nn.QuantizedLinear(128, 64, bias=False, group_size=32, bits=4, mode="mxfp4")
    assert "mxfp4" in cuda.unsupported(heads.as_head(mxfp), x)


def test_cpu_never_picks_the_kernels():
    if cuda.available():
        pytest.skip("a CUDA GPU is the default device here")
    assert "cuda" in backends.names() and "cuda" not in backends.available()
    hidden, head, targets = _case(8, 100, 128)
    opts = portable.Options()
    plan = selection.select(selection.request("flash"), head, hidden, None, opts)
    assert plan.path is Path.MLX
    with pytest.raises(PluginError, match="'cuda' cannot run this call here: no CUDA GPU"):
        linear_cross_entropy(hidden, head.weight, targets, impl="flash", backend="cuda")
    assert cuda.plan(head, hidden) == "no CUDA GPU as the default device"
