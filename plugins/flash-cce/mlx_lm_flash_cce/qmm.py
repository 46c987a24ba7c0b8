"""Quantized matmul with the row-count 2/3 workaround, and its probe.

On Metal, MLX returned wrong values for ``quantized_matmul(...,
transpose=False)`` when the input had 2 or 3 rows (reported on mlx 0.31.2).
The loss issues that call for the hidden-state gradient of a quantized head,
so every quantized matmul here goes through ``quantized_matmul``: inputs with
2 or 3 rows are padded with zero rows to 4 and the result is sliced back.
Rows of a matmul are independent, so the real rows are unchanged and the pad
rows' cotangents are exactly zero.
"""

from typing import Any, Dict, Optional, Sequence, Tuple, Union

import mlx.core as mx

BUGGY_ROWS = (2, 3)
PAD_ROWS = 4


def pad_rows(x: mx.array) -> Tuple[mx.array, Optional[int]]:
    """``(x padded to 4 rows, original row count)``; unchanged unless 2 or 3 rows."""
    rows = x.shape[-2] if x.ndim >= 2 else 1
    if x.ndim < 2 or rows not in BUGGY_ROWS:
        return x, None
    widths = [(0, 0)] * x.ndim
    widths[-2] = (0, PAD_ROWS - rows)
    return mx.pad(x, widths), rows


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: Optional[mx.array],
    *,
    transpose: bool,
    group_size: int,
    bits: int,
    mode: str = "affine",
) -> mx.array:
    """``mx.quantized_matmul`` that never runs with 2 or 3 rows."""
    x, rows = pad_rows(x)
    out = mx.quantized_matmul(
        x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits, mode=mode
    )
    if rows is not None:
        out = out[..., :rows, :]
    return out


def probe(
    rows: Sequence[int] = BUGGY_ROWS,
    dims: int = 256,
    out_dims: int = 512,
    group_size: int = 64,
    bits: int = 4,
    stream: Union[mx.Stream, mx.Device, None] = None,
) -> Dict[str, Any]:
    """Check this machine's ``quantized_matmul(transpose=False)`` at 2 and 3 rows.

    Compares the raw call (no padding) against the same product with a
    dequantized float32 weight, on the default device. Returns a dict:
    ``{"device": str, "rows": {2: max_rel_err, 3: ...}, "buggy": bool}``.
    """
    key = mx.random.key(0)
    k1, k2 = mx.random.split(key)
    weight = mx.random.normal((out_dims, dims), key=k1) / dims**0.5
    w, s, b = mx.quantize(weight, group_size=group_size, bits=bits)
    dense = mx.dequantize(w, s, b, group_size=group_size, bits=bits)
    errors = {}
    for m in rows:
        x = mx.random.normal((m, out_dims), key=k2)
        got = mx.quantized_matmul(
            x, w, s, b, transpose=False, group_size=group_size, bits=bits, stream=stream
        )
        want = mx.matmul(x, dense, stream=stream)
        err = mx.max(mx.abs(got - want)) / (mx.max(mx.abs(want)) + 1e-6)
        errors[m] = err.item()
    device = str(stream or mx.default_device())
    return {"device": device, "rows": errors, "buggy": any(e > 1e-3 for e in errors.values())}
