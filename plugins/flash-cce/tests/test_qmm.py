"""The quantized_matmul row-count 2/3 workaround: exact, and engaged only there."""

import mlx.core as mx
import pytest

from mlx_lm_flash_cce import linear_cross_entropy, qmm

DIMS, OUT = 128, 96


def _weights(bits, group_size):
    w = mx.random.normal((OUT, DIMS), key=mx.random.key(0)) / 10
    return mx.quantize(w, group_size=group_size, bits=bits)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("transpose", [True, False])
@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 64)])
def test_padded_equals_unpadded_values_and_gradients(rows, transpose, bits, group_size):
    w, s, b = _weights(bits, group_size)
    x = mx.random.normal((rows, DIMS if transpose else OUT), key=mx.random.key(rows))
    kw = dict(transpose=transpose, group_size=group_size, bits=bits)

    def padded(x):
        return qmm.quantized_matmul(x, w, s, b, **kw)

    def raw(x):
        return mx.quantized_matmul(x, w, s, b, **kw)

    cot = mx.random.normal(raw(x).shape, key=mx.random.key(9))
    (y1,), (g1,) = mx.vjp(padded, [x], [cot])
    (y2,), (g2,) = mx.vjp(raw, [x], [cot])
    assert y1.shape == y2.shape and g1.shape == g2.shape
    # Bit-identical on the CPU: zero pad rows change nothing in the real rows.
    assert mx.array_equal(y1, y2).item()
    assert mx.array_equal(g1, g2).item()


def test_pad_engages_exactly_at_two_and_three_rows(monkeypatch):
    w, s, b = _weights(4, 32)
    seen = []
    real = mx.quantized_matmul

    def spy(x, *args, **kwargs):
        seen.append(x.shape[-2])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(qmm.mx, "quantized_matmul", spy)
    for rows in range(1, 7):
        seen.clear()
        x = mx.ones((rows, DIMS))
        out = qmm.quantized_matmul(x, w, s, b, transpose=True, group_size=32, bits=4)
        assert out.shape == (rows, OUT)
        assert seen == [4 if rows in (2, 3) else rows]
    assert qmm.pad_rows(mx.ones((5, 6, 8)))[1] is None
    padded, rows = qmm.pad_rows(mx.ones((5, 3, 8)))  # batched: pads the row axis
    assert rows == 3 and padded.shape == (5, 4, 8)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_loss_issues_no_two_or_three_row_quantized_matmul(n, monkeypatch):
    """Every quantized matmul the loss runs (forward and backward) has != 2, 3 rows."""
    w, s, b = _weights(4, 32)
    import mlx.nn as nn

    layer = nn.QuantizedLinear(DIMS, OUT, bias=False, group_size=32, bits=4)
    layer.weight, layer.scales, layer.biases = w, s, b
    seen = []
    real = mx.quantized_matmul

    def spy(x, *args, **kwargs):
        seen.append(x.shape[-2])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(qmm.mx, "quantized_matmul", spy)
    hidden = mx.random.normal((n, DIMS), key=mx.random.key(1))
    targets = mx.arange(n) % OUT
    # dequantize=False: the flash path's packed quantized matmuls (the GPU default)
    for impl in ("flash", "stock"):
        seen.clear()
        fn = lambda h, impl=impl: linear_cross_entropy(
            h, layer, targets, impl=impl, dequantize=False
        )
        loss, grad = mx.value_and_grad(fn)(hidden)
        mx.eval(loss, grad)
        assert seen and not (set(seen) & {2, 3}), (impl, seen)


def test_probe_reports_this_machine():
    result = qmm.probe()
    assert set(result["rows"]) == {2, 3}
    assert result["buggy"] is False  # the CPU backend is correct
    assert all(err < 1e-3 for err in result["rows"].values())
