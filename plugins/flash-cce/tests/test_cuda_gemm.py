"""The big-block paths (``cuda-gemm``, ``mlx-blocks``: one pass in big blocks) against mlx's stock loss.

Everything except the CUDA row kernel runs on any device: ``BLOCKS`` is
``cuda-gemm`` (the row kernel) where MLX's CUDA backend has a GPU and
``mlx-blocks`` (the compiled MLX step) elsewhere. The row kernel is
compared with that MLX function where MLX's CUDA backend has a GPU
(skipped elsewhere, with the reason).
"""

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_lm_ext import PluginError
from mlx_lm_flash_cce import backends, cuda_gemm, linear_cross_entropy, portable
from mlx_lm_flash_cce.rows import kernel_step

FROZEN = {"weight": False}
BLOCKS = "cuda-gemm" if cuda_gemm.on_cuda() else "mlx-blocks"


def case(n, v, h, dtype, seed=0):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    hidden = mx.random.normal((n, h), key=k1).astype(dtype)
    weight = (mx.random.normal((v, h), key=k2) * 2 / h**0.5).astype(dtype)
    targets = mx.random.randint(0, v, (n,), key=k3)
    return hidden, weight, targets


def reference(hidden, weight, targets, softcap=None, logit_scale=None, ignore_index=None):
    """Stock loss (mean) and hidden gradient in float32 on the same (rounded) inputs."""
    w = weight.astype(mx.float32)

    def f(x):
        z = x @ w.T
        if logit_scale is not None:
            z = z * logit_scale
        if softcap is not None:
            z = softcap * mx.tanh(z / softcap)
        ce = nn.losses.cross_entropy(
            z,
            mx.where(targets == ignore_index, 0, targets) if ignore_index is not None else targets,
        )
        if ignore_index is None:
            return ce.mean()
        valid = targets != ignore_index
        return mx.where(valid, ce, 0).sum() / valid.sum()

    return mx.value_and_grad(f)(hidden.astype(mx.float32))


def flash(hidden, head, targets, path=BLOCKS, **kw):
    kw.setdefault("train", FROZEN)
    return mx.value_and_grad(
        lambda x: linear_cross_entropy(x, head, targets, impl="flash", backend=path, **kw)
    )(hidden)


def rel_err(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / mx.maximum(mx.abs(b).max(), 1e-30)).item()


def tol(dtype):
    # float32 on the CPU is exact to rounding; half precision on a GPU keeps
    # logits and P in bf16/fp16 (as the stock loss keeps its logits).
    if dtype == mx.float32 and mx.default_device() == mx.cpu:
        return 1e-5, 1e-5
    return 2e-2, 3e-2


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    "n,v,h,blocks",
    [
        (1, 300, 64, (256, 0)),  # one token, the path's default blocks (clamped)
        (77, 1003, 96, (32, 256)),  # ragged token and vocab chunks
        (300, 5003, 128, (128, 1000)),  # vocab chunk not a multiple of anything
        (513, 2049, 64, (8192, 8192)),  # one block
    ],
)
def test_matches_stock(n, v, h, blocks, dtype):
    hidden, weight, targets = case(n, v, h, dtype)
    tc, vc = blocks
    loss, dh = flash(hidden, weight, targets, token_chunk=tc, vocab_chunk=vc)
    ref_loss, ref_dh = reference(hidden, weight, targets)
    lt, gt = tol(dtype)
    assert dh.dtype == dtype and dh.shape == hidden.shape
    assert rel_err(loss, ref_loss) <= lt
    assert rel_err(dh, ref_dh) <= gt


@pytest.mark.parametrize(
    "opts",
    [
        {"softcap": 5.0},
        {"logit_scale": 0.5},
        {"softcap": 3.0, "logit_scale": 2.0},
    ],
    ids=["softcap", "scale", "both"],
)
def test_softcap_and_logit_scale(opts):
    hidden, weight, targets = case(200, 4099, 64, mx.float32, seed=1)
    loss, dh = flash(hidden, weight, targets, token_chunk=64, vocab_chunk=1024, **opts)
    ref_loss, ref_dh = reference(hidden, weight, targets, **opts)
    lt, gt = tol(mx.float32)
    assert rel_err(loss, ref_loss) <= lt
    assert rel_err(dh, ref_dh) <= gt


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_ignore_index(dtype):
    hidden, weight, targets = case(150, 1500, 64, dtype, seed=2)
    targets = mx.where(mx.arange(150) % 3 == 0, -100, targets)
    loss, dh = flash(hidden, weight, targets, ignore_index=-100, token_chunk=64, vocab_chunk=512)
    ref_loss, ref_dh = reference(hidden, weight, targets, ignore_index=-100)
    lt, gt = tol(dtype)
    assert rel_err(loss, ref_loss) <= lt
    assert rel_err(dh, ref_dh) <= gt
    assert mx.abs(dh[::3].astype(mx.float32)).max().item() == 0.0  # ignored tokens get no gradient


def test_quantized_head_matches_dequantized():
    hidden, weight, targets = case(130, 2000, 128, mx.float32, seed=3)
    layer = nn.QuantizedLinear(128, 2000, bias=False, group_size=64, bits=4)
    layer.weight, layer.scales, layer.biases = mx.quantize(weight, group_size=64, bits=4)
    dense = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=64, bits=4)
    loss, dh = flash(hidden, layer, targets, token_chunk=64, vocab_chunk=512)
    ref_loss, ref_dh = reference(hidden, dense, targets)
    lt, gt = tol(mx.float32)
    assert rel_err(loss, ref_loss) <= lt
    assert rel_err(dh, ref_dh) <= gt


def test_trainable_weight_and_loss_only_paths():
    hidden, weight, targets = case(90, 700, 64, mx.float32, seed=4)

    def ours(x, w, with_grad):
        return linear_cross_entropy(
            x,
            w,
            targets,
            impl="flash",
            backend=BLOCKS,
            token_chunk=32,
            vocab_chunk=256,
            with_grad=with_grad,
        )

    def stock(x, w):
        return nn.losses.cross_entropy(x @ w.T, targets).mean()

    ref = mx.grad(stock, argnums=(0, 1))(hidden, weight)
    lt, gt = tol(mx.float32)
    for with_grad in (True, False):
        got = mx.grad(lambda x, w, g=with_grad: ours(x, w, g), argnums=(0, 1))(hidden, weight)
        assert rel_err(got[0], ref[0]) <= gt
        assert rel_err(got[1], ref[1]) <= gt


def test_compiled_matches_eager():
    hidden, weight, targets = case(100, 900, 64, mx.float32, seed=5)
    fn = mx.value_and_grad(
        lambda x: linear_cross_entropy(
            x,
            weight,
            targets,
            impl="flash",
            backend=BLOCKS,
            token_chunk=64,
            vocab_chunk=256,
            train=FROZEN,
        )
    )
    eager = fn(hidden)
    compiled = mx.compile(fn)(hidden)
    assert rel_err(compiled[0], eager[0]) <= 1e-6
    assert rel_err(compiled[1], eager[1]) <= 1e-6


def test_the_big_block_paths_are_named_and_never_run_another():
    assert "mlx-blocks" in backends.available()
    assert ("cuda-gemm" in backends.available()) == cuda_gemm.on_cuda()
    hidden, weight, targets = case(40, 300, 64, mx.float32, seed=6)
    lin = nn.Linear(64, 300, bias=True)
    lin.weight = weight
    # a head the blocks cannot take is an error naming why, never another path
    with pytest.raises(
        PluginError, match="'mlx-blocks' cannot run this call here: a head with an output bias"
    ):
        linear_cross_entropy(hidden, lin, targets, impl="flash", backend="mlx-blocks")
    with pytest.raises(PluginError, match="gradient filters"):
        linear_cross_entropy(
            hidden, weight, targets, impl="flash", backend="mlx-blocks", filter_eps=1e-4
        )
    ref = nn.losses.cross_entropy(lin(hidden), targets).mean()
    got = linear_cross_entropy(hidden, lin, targets, impl="flash", backend="mlx")
    assert rel_err(got, ref) <= 1e-5


def test_elementwise_maps_onto_the_paths():
    hidden, weight, targets = case(40, 300, 64, mx.float32, seed=6)
    want = linear_cross_entropy(hidden, weight, targets, impl="flash", backend="mlx-blocks")
    for ew in ("mlx", "mlx-f32"):  # the deprecated spelling of mlx-blocks (and its f32 step)
        got = linear_cross_entropy(
            hidden, weight, targets, impl="flash", backend="cuda-gemm", elementwise=ew
        )
        assert rel_err(got, want) <= 1e-5
    with pytest.raises(ValueError, match="elementwise"):
        linear_cross_entropy(
            hidden, weight, targets, impl="flash", backend="cuda-gemm", elementwise="fused"
        )
    with pytest.raises(ValueError, match="does not apply"):
        linear_cross_entropy(hidden, weight, targets, impl="flash", elementwise="kernel")
    if not cuda_gemm.on_cuda():
        with pytest.raises(PluginError, match="'cuda-gemm' cannot run this call here: no CUDA GPU"):
            linear_cross_entropy(
                hidden, weight, targets, impl="flash", backend="cuda-gemm", elementwise="kernel"
            )


def test_blocks_default_and_explicit():
    assert cuda_gemm.blocks(portable.Options(), 100_000, 200_000) == (8192, 8192)
    assert cuda_gemm.blocks(portable.Options(), 10, 300) == (10, 300)
    assert cuda_gemm.blocks(
        portable.Options(token_chunk=2048, vocab_chunk=16384), 8192, 151936
    ) == (2048, 16384)


# ------------------------------------------------------------- CUDA only

needs_cuda = pytest.mark.skipif(
    not cuda_gemm.on_cuda(),
    reason="the row kernel needs MLX's CUDA backend with a GPU as the default device",
)


@needs_cuda
@pytest.mark.parametrize(
    "dtype", [mx.bfloat16, mx.float16, mx.float32], ids=["bf16", "fp16", "fp32"]
)
@pytest.mark.parametrize(
    "rows,cols", [(5, 4093), (64, 8192)], ids=["scalar", "vector"]
)  # row length % 8
@pytest.mark.parametrize(
    "opts", [{}, {"softcap": 5.0, "logit_scale": 0.7}], ids=["plain", "capped"]
)
def test_row_kernel_matches_mlx_step(rows, cols, dtype, opts):
    k1, k2 = mx.random.split(mx.random.key(rows * cols), 2)
    z = (mx.random.normal((rows, cols), key=k1) * 4).astype(dtype)
    m = mx.where(mx.arange(rows) % 2 == 0, -mx.inf, mx.random.normal((rows,), key=k2) * 4)
    l = mx.where(mx.isinf(m), 0.0, 3.0)
    cfg = cuda_gemm.Config(
        kind="dense",
        names=("weight",),
        group_size=0,
        bits=0,
        mode="affine",
        softcap=opts.get("softcap"),
        logit_scale=opts.get("logit_scale"),
        token_chunk=rows,
        vocab_chunk=cols,
        with_grad=True,
        compute_dtype=dtype,
        kernel=False,
        train_weight=False,
    )
    want = cuda_gemm.mlx_step(cfg, lean=False)(z, m, l)
    got = kernel_step(z, m, l, opts.get("softcap"), opts.get("logit_scale"))
    lean = cuda_gemm.mlx_step(cfg)(z, m, l)
    for name, g, w, e in zip(("m", "a", "l", "P"), got, want, lean, strict=False):
        assert g.dtype == w.dtype == e.dtype and g.shape == w.shape == e.shape, name
        assert rel_err(g, w) <= (1e-5 if name != "P" else 1e-2), name
        # the lean step sums P in the blocks' dtype: l to that dtype's precision
        tol = {"l": 2e-5 if dtype == mx.float32 else 8e-3, "P": 1e-2}.get(name, 1e-5)
        assert rel_err(e, w) <= tol, name


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
def test_kernel_and_mlx_elementwise_agree(dtype):
    hidden, weight, targets = case(1000, 20000, 256, dtype, seed=7)
    a = flash(hidden, weight, targets, "cuda-gemm", token_chunk=512, vocab_chunk=4096)
    b = flash(hidden, weight, targets, "mlx-blocks", token_chunk=512, vocab_chunk=4096)
    ref_loss, ref_dh = reference(hidden, weight, targets)
    assert rel_err(a[0], b[0]) <= 1e-3  # the MLX step's bf16/fp16 block sums: lse to ~2^-9 relative
    assert rel_err(a[1], b[1]) <= 2e-2
    assert rel_err(a[0], ref_loss) <= 1e-2 and rel_err(a[1], ref_dh) <= 3e-2
