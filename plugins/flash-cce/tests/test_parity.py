"""linear_cross_entropy vs mlx's stock cross-entropy: values and gradients.

Small blocks (16 tokens x 64 vocabulary rows) force many blocks with ragged
tails: N and V below are not multiples of any block size.
"""

import mlx.core as mx
import mlx.nn as nn
import pytest
from cce_helpers import ON_GPU, max_abs, near, stock_ce
from mlx.utils import tree_flatten
from mlx_lm.tuner.dora import DoRALinear
from mlx_lm.tuner.lora import LoRAEmbedding, LoRALinear

from mlx_lm_flash_cce import linear_cross_entropy

SMALL = dict(token_chunk=16, vocab_chunk=64)


def _data(n, h, v, dtype=mx.float32, seed=0):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    hidden = mx.random.normal((n, h), key=k1).astype(dtype)
    weight = (0.3 * mx.random.normal((v, h), key=k2)).astype(dtype)
    targets = mx.random.randint(0, v, (n,), key=k3)
    return hidden, weight, targets


def _reduce(ce, reduction, valid=None):
    if valid is not None:
        ce = mx.where(valid, ce, 0.0)
    if reduction == "none":
        return ce
    if reduction == "sum":
        return ce.sum()
    return ce.sum() / (valid.sum() if valid is not None else ce.size)


def _stock(hidden, weight, targets, reduction="mean", ignore_index=None, **cap):
    valid = None
    if ignore_index is not None:
        valid = targets != ignore_index
        targets = mx.where(valid, targets, 0)
    return _reduce(stock_ce(hidden @ weight.T, targets, **cap), reduction, valid)


def _value_and_grads(fn, hidden, weight):
    if fn is None:
        return None
    scalar = lambda h, w: fn(h, w).sum()  # "none" reduction: sum for a gradient
    value = fn(hidden, weight)
    _, (gh, gw) = mx.value_and_grad(scalar, argnums=(0, 1))(hidden, weight)
    mx.eval(value, gh, gw)
    return value, gh, gw


@pytest.mark.parametrize(
    "n,h,v",
    [(1, 16, 100), (2, 16, 100), (3, 16, 100), (4, 16, 100), (37, 24, 301), (130, 40, 1000)],
)
@pytest.mark.parametrize(
    "cap", [{}, {"softcap": 5.0}, {"logit_scale": 0.25}, {"softcap": 3.0, "logit_scale": 2.0}]
)
@pytest.mark.parametrize("with_grad", [True, False])
def test_dense_float32_matches_stock(n, h, v, cap, with_grad):
    hidden, weight, targets = _data(n, h, v)
    ours = _value_and_grads(
        lambda x, w: linear_cross_entropy(
            x, w, targets, impl="flash", with_grad=with_grad, **SMALL, **cap
        ),
        hidden,
        weight,
    )
    want = _value_and_grads(lambda x, w: _stock(x, w, targets, **cap), hidden, weight)
    assert near(ours[0], want[0], 1e-5)
    assert near(ours[1], want[1], 1e-4)
    assert near(ours[2], want[2], 1e-4)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("impl", ["flash", "stock"])
def test_ignore_index_and_reductions(reduction, impl):
    hidden, weight, targets = _data(45, 32, 257, seed=1)
    targets = mx.where(mx.arange(45) % 4 == 1, -100, targets)  # a quarter ignored
    fn = lambda x, w: linear_cross_entropy(
        x, w, targets, ignore_index=-100, reduction=reduction, impl=impl, **SMALL
    )
    ours = _value_and_grads(fn, hidden, weight)
    want = _value_and_grads(
        lambda x, w: _stock(x, w, targets, reduction, ignore_index=-100), hidden, weight
    )
    assert ours[0].shape == want[0].shape
    assert near(ours[0], want[0], 2e-5)
    assert near(ours[1], want[1], 1e-4)
    assert near(ours[2], want[2], 1e-4)
    # ignored tokens get no gradient at all
    assert mx.all(ours[1][1::4] == 0).item()


def test_batched_shapes_and_bad_input():
    hidden, weight, targets = _data(24, 16, 99)
    ours = linear_cross_entropy(
        hidden.reshape(2, 12, 16), weight, targets.reshape(2, 12), reduction="none", impl="flash"
    )
    assert ours.shape == (2, 12)
    assert near(ours.reshape(-1), _stock(hidden, weight, targets, "none"), 1e-5)
    with pytest.raises(ValueError, match="targets shape"):
        linear_cross_entropy(hidden, weight, targets[:5])
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, targets, reduction="avg")
    with pytest.raises(ValueError, match="integer"):
        linear_cross_entropy(hidden, weight, targets.astype(mx.float32))
    with pytest.raises(TypeError, match="head must be"):
        linear_cross_entropy(hidden, "lm_head", targets)


@pytest.mark.parametrize("cap", [{}, {"softcap": 4.0}])
@pytest.mark.parametrize("n", [3, 70])
def test_bfloat16_error_no_larger_than_stock(cap, n):
    """Against a float32 reference, flash-cce's error is at most stock's plus a small tolerance."""
    hidden, weight, targets = _data(n, 64, 517, dtype=mx.bfloat16, seed=2)
    ref = _value_and_grads(
        lambda x, w: _stock(x, w, targets, **cap),
        hidden.astype(mx.float32),
        weight.astype(mx.float32),
    )

    def stock_bf16(x, w):  # mlx's own loss in the model's dtype, as default_loss computes it
        z = x @ w.T
        if "softcap" in cap:
            z = cap["softcap"] * mx.tanh(z / cap["softcap"])
        return nn.losses.cross_entropy(z, targets).astype(mx.float32).mean()

    stock = _value_and_grads(stock_bf16, hidden, weight)
    ours = _value_and_grads(
        lambda x, w: linear_cross_entropy(x, w, targets, impl="flash", **SMALL, **cap),
        hidden,
        weight,
    )
    assert ours[1].dtype == mx.bfloat16 and ours[2].dtype == mx.bfloat16
    for i, tol in ((0, 1e-3), (1, 1e-3), (2, 1e-3)):
        assert max_abs(ours[i], ref[i]) <= max_abs(stock[i], ref[i]) + tol


# --------------------------------------------------------------------- heads

# Hidden 128, not 64: MLX 0.32.4's CUDA quantized_matmul is wrong when the
# hidden size equals the group size (see "MLX on NVIDIA GPUs" in docs/gpu.md),
# which would
# break the stock reference on a GPU.
H, V, N = 128, 300, 37


def _layer(kind):
    mx.random.seed(3)
    if kind == "linear":
        layer = nn.Linear(H, V, bias=True)
    elif kind.startswith("qlinear"):  # qlinear-<bits>-<group>[-<mode>]
        _, bits, group, *mode = kind.split("-")
        layer = nn.QuantizedLinear.from_linear(
            nn.Linear(H, V, bias=False), int(group), int(bits), mode=(mode or ["affine"])[0]
        )
    elif kind == "embedding":
        layer = nn.Embedding(V, H).as_linear
    elif kind == "qembedding":
        layer = nn.QuantizedEmbedding.from_embedding(nn.Embedding(V, H), 32, 8).as_linear
    elif kind in ("lora-linear", "lora-qlinear"):
        base = nn.Linear(H, V, bias=False)
        if kind == "lora-qlinear":
            base = nn.QuantizedLinear.from_linear(base, 32, 4)
        base.freeze()
        layer = LoRALinear.from_base(base, r=4, scale=2.0)
        layer.lora_b = 0.1 * mx.random.normal(layer.lora_b.shape)  # zero at init; make it count
    elif kind == "lora-embedding":
        base = nn.Embedding(V, H)
        base.freeze()
        lora = LoRAEmbedding.from_base(base, r=4, scale=2.0)
        lora.lora_b = 0.1 * mx.random.normal(lora.lora_b.shape)
        layer = lora.as_linear
    elif kind == "dora":
        base = nn.Linear(H, V, bias=False)
        base.freeze()
        layer = DoRALinear.from_base(base, r=4, scale=2.0)
        layer.lora_b = 0.1 * mx.random.normal(layer.lora_b.shape)
    elif kind == "callable":
        w = mx.random.normal((V, H)) / 8
        layer = lambda x: x @ w.T
    else:
        raise AssertionError(kind)
    return layer


def _module(layer):
    return getattr(layer, "__self__", layer) if not isinstance(layer, nn.Module) else layer


HEADS = [
    "linear",
    "qlinear-4-32",
    "qlinear-4-64",
    "qlinear-8-64",
    "qlinear-4-32-mxfp4",
    "embedding",
    "qembedding",
    "lora-linear",
    "lora-qlinear",
    "lora-embedding",
    "dora",
    "callable",
]


@pytest.mark.parametrize("kind", HEADS)
@pytest.mark.parametrize("n", [2, 3, N])
@pytest.mark.parametrize("dequantize", [True, False])
def test_heads_match_stock(kind, n, dequantize):
    if dequantize and "q" not in kind:
        pytest.skip("dequantize only changes quantized heads")
    layer = _layer(kind)
    module = _module(layer)
    k1, k2 = mx.random.split(mx.random.key(4))
    hidden = mx.random.normal((n, H), key=k1)
    targets = mx.random.randint(0, V, (n,), key=k2)

    def ours(x):
        return linear_cross_entropy(
            x,
            layer,
            targets,
            impl="auto",
            min_flash_elements=0,
            softcap=6.0,
            dequantize=dequantize,
            **SMALL,
        )

    def stock(x):
        return stock_ce(layer(x), targets, softcap=6.0).mean()

    results = []
    for fn in (ours, stock):
        value, gh = mx.value_and_grad(fn)(hidden)
        grads = {}
        if isinstance(module, nn.Module) and tree_flatten(module.trainable_parameters()):
            _, g = nn.value_and_grad(module, fn)(hidden)
            grads = dict(tree_flatten(g))
        mx.eval(value, gh, grads)
        results.append((value, gh, grads))
    (v1, gh1, g1), (v2, gh2, g2) = results
    assert near(v1, v2, 1e-5)
    assert near(gh1, gh2, 1e-4)
    assert g1.keys() == g2.keys()
    for name in g2:
        assert near(g1[name], g2[name], 1e-4), name
    if kind.startswith("lora"):
        assert {"lora_a", "lora_b"} <= set(g1) and mx.abs(g1["lora_b"]).max().item() > 0


def test_larger_head_group_sizes():
    """Group size 128 (hidden 256: two groups per row)."""
    mx.random.seed(5)
    for bits in (4, 8):
        layer = nn.QuantizedLinear.from_linear(nn.Linear(256, 333, bias=False), 128, bits)
        hidden = mx.random.normal((21, 256))
        targets = mx.random.randint(0, 333, (21,))
        fn1 = lambda x, layer=layer, targets=targets: linear_cross_entropy(
            x, layer, targets, impl="flash", **SMALL
        )
        fn2 = lambda x, layer=layer, targets=targets: stock_ce(layer(x), targets).mean()
        (v1, g1), (v2, g2) = mx.value_and_grad(fn1)(hidden), mx.value_and_grad(fn2)(hidden)
        assert near(v1, v2, 1e-5)
        assert near(g1, g2, 1e-4)


def test_flash_refuses_a_plain_callable():
    hidden, weight, targets = _data(5, 8, 20)
    with pytest.raises(ValueError, match="only a callable"):
        linear_cross_entropy(hidden, lambda x: x @ weight.T, targets, impl="flash")


# ----------------------------------------------------------- approximations


def test_filters_keep_the_loss_exact_and_gradients_close():
    hidden, weight, targets = _data(96, 32, 640, seed=6)
    weight = weight * 4  # peaked softmax: most coefficients are tiny
    want = _value_and_grads(lambda x, w: _stock(x, w, targets), hidden, weight)
    for opts in ({"filter_eps": 1e-4}, {"block_skip_eps": 1e-4}):
        ours = _value_and_grads(
            lambda x, w, opts=opts: linear_cross_entropy(
                x, w, targets, impl="flash", **SMALL, **opts
            ),
            hidden,
            weight,
        )
        assert near(ours[0], want[0], 1e-5)
        scale = mx.abs(want[1]).max().item()
        assert 0 < max_abs(ours[1], want[1]) <= 0.05 * scale  # approximate, but close


# ------------------------------------------------------------------- memory


@pytest.mark.skipif(
    ON_GPU, reason="GPU evaluation allocates ahead of execution: see the README's GPU table"
)
def test_memory_is_bounded_by_blocks_not_logits():
    """Loss + gradient of flash-cce never holds [N, V]: peak << the logits' size."""
    n, h, v = 2048, 64, 8192
    hidden, weight, targets = _data(n, h, v, seed=7)
    logits_bytes = n * v * 4

    def peak(fn):
        mx.eval(hidden, weight, targets)
        mx.synchronize()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        loss, grad = mx.value_and_grad(fn)(hidden)
        mx.eval(loss, grad)
        return mx.get_peak_memory() - base

    stock = peak(lambda x: _stock(x, weight, targets))
    flash = peak(
        lambda x: linear_cross_entropy(
            x, weight, targets, impl="flash", token_chunk=256, vocab_chunk=512
        )
    )
    assert stock > logits_bytes  # the stock loss materialises the logits (and more)
    assert flash < logits_bytes / 8
