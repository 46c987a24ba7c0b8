"""What an output head is, as plain arrays the loss kernels can slice by vocab.

``as_head(head)`` accepts a weight array ``[V, H]``, ``nn.Linear``,
``nn.QuantizedLinear``, ``nn.Embedding`` / ``nn.QuantizedEmbedding`` (or their
``as_linear`` method: an embedding used as the output layer), mlx-lm's
``LoRALinear`` / ``LoRAEmbedding`` wrapping any of those, and any other
callable ``hidden -> logits`` (kind ``"module"``, handled by the generic
token-chunked path).
"""

from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from . import qmm


class Head(NamedTuple):
    kind: str  # "dense" | "quantized" | "module"
    weight: Optional[mx.array] = None  # [V, H] dense, or packed quantized rows
    scales: Optional[mx.array] = None
    biases: Optional[mx.array] = None  # affine quantization offsets (None for mxfp/nvfp)
    bias: Optional[mx.array] = None  # output bias [V] (nn.Linear(bias=True))
    group_size: int = 0
    bits: int = 0
    mode: str = "affine"
    # LoRA on the head: logits += (scale * dropout(h) @ a) @ b_rows.T with
    # a [H, r] and b_rows [V, r] (the low-rank factor indexed by vocab row).
    lora_a: Optional[mx.array] = None
    lora_b: Optional[mx.array] = None
    lora_scale: float = 0.0
    lora_dropout: Optional[object] = None
    module: Optional[object] = None  # the original callable
    vocab: int = 0

    @property
    def quantized(self) -> bool:
        return self.kind == "quantized"

    @property
    def has_lora(self) -> bool:
        return self.lora_a is not None


def _lora_classes():
    try:
        from mlx_lm.tuner.lora import LoRAEmbedding, LoRALinear
    except ImportError:  # mlx-lm without the tuner: no LoRA heads to recognise
        return (), ()
    return (LoRALinear,), (LoRAEmbedding,)


def _base(module):
    """Head of a plain (non-LoRA) layer, or None if it is not one we slice."""
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return Head(
            kind="quantized",
            weight=module.weight,
            scales=module.scales,
            biases=module.get("biases"),
            bias=module.get("bias") if isinstance(module, nn.QuantizedLinear) else None,
            group_size=module.group_size,
            bits=module.bits,
            mode=getattr(module, "mode", "affine"),
            module=module,
            vocab=module.weight.shape[0],
        )
    if isinstance(module, (nn.Linear, nn.Embedding)):
        return Head(
            kind="dense",
            weight=module.weight,
            bias=module.get("bias") if isinstance(module, nn.Linear) else None,
            module=module,
            vocab=module.weight.shape[0],
        )
    return None


def as_head(head: Any) -> Head:
    """Normalise ``head`` into a ``Head``; raise ``TypeError`` for nonsense."""
    if isinstance(head, mx.array):
        if head.ndim != 2:
            raise ValueError(
                f"a head weight must be [vocab, hidden], got shape {tuple(head.shape)}"
            )
        return Head(kind="dense", weight=head, vocab=head.shape[0])

    module = head
    # `embed_tokens.as_linear` (a bound method): the embedding is the head.
    owner = getattr(head, "__self__", None)
    if owner is not None and getattr(head, "__name__", "") == "as_linear":
        module = owner

    lora_linear, lora_embedding = _lora_classes()
    if isinstance(module, lora_linear):
        base = _base(module.linear)
        if base is not None:
            return base._replace(
                lora_a=module.lora_a,
                lora_b=module.lora_b.T,
                lora_scale=float(module.scale),
                lora_dropout=module.dropout,
                module=module,
            )
    elif isinstance(module, lora_embedding):
        base = _base(module.embedding)
        if base is not None:
            return base._replace(
                lora_a=module.lora_b.T,
                lora_b=module.lora_a,
                lora_scale=float(module.scale),
                lora_dropout=module.dropout,
                module=module,
            )
    else:
        base = _base(module)
        if base is not None:
            return base

    if not callable(head):
        raise TypeError(
            "head must be a weight array, nn.Linear, nn.QuantizedLinear, an embedding "
            f"(or its as_linear), a LoRA-wrapped head, or a callable; got {type(head).__name__}"
        )
    return Head(kind="module", module=head)


def head_arrays(head: Head) -> Tuple[List[str], List[mx.array]]:
    """The arrays a kernel needs, in a fixed order, and the matching names."""
    names = ["weight"]
    if head.quantized:
        names.append("scales")
        if head.biases is not None:
            names.append("biases")
    if head.bias is not None:
        names.append("bias")
    if head.has_lora:
        names.append("lora_b")
    return names, [getattr(head, n) for n in names]


def lora_input(head: Head, hidden: mx.array) -> mx.array:
    """``scale * dropout(hidden) @ a``: the low-rank activations, outside the kernel."""
    x = hidden if head.lora_dropout is None else head.lora_dropout(hidden)
    return head.lora_scale * (x @ head.lora_a)


def matmul_rows(
    head: Head,
    x: mx.array,
    arrays: Dict[str, mx.array],
    start: Optional[int] = None,
    stop: Optional[int] = None,
    transpose: bool = True,
) -> mx.array:
    """``x @ W[start:stop].T`` (transpose) or ``x @ W[start:stop]``, dense or quantized.

    ``arrays`` maps names to the (possibly traced) head arrays. Quantized
    products go through ``qmm.quantized_matmul`` (row-count 2/3 padding).
    """
    w = arrays["weight"][start:stop]
    if head.quantized:
        scales = arrays["scales"][start:stop]
        biases = arrays["biases"][start:stop] if "biases" in arrays else None
        return qmm.quantized_matmul(
            x,
            w,
            scales,
            biases,
            transpose=transpose,
            group_size=head.group_size,
            bits=head.bits,
            mode=head.mode,
        )
    w = w.astype(x.dtype)
    return x @ w.T if transpose else x @ w


def gather_rows(
    head: Head, arrays: Dict[str, mx.array], index: Union[mx.array, slice], dtype: mx.Dtype
) -> mx.array:
    """Rows ``W[index]`` as a dense ``[len(index), H]`` array of ``dtype``."""
    if head.quantized:
        biases = arrays["biases"][index] if "biases" in arrays else None
        rows = mx.dequantize(
            arrays["weight"][index],
            arrays["scales"][index],
            biases,
            group_size=head.group_size,
            bits=head.bits,
            mode=head.mode,
        )
        return rows.astype(dtype)
    return arrays["weight"][index].astype(dtype)


def full_logits(head: Head, hidden: mx.array) -> mx.array:
    """The ``[N, V]`` logits ``head(hidden)`` (the stock-style exact path)."""
    if head.kind == "module":
        return head.module(hidden)
    names, values = head_arrays(head)
    arrays = dict(zip(names, values, strict=False))
    out = matmul_rows(head, hidden, arrays)
    if head.bias is not None:
        out = out + head.bias.astype(out.dtype)
    if head.has_lora:
        u = lora_input(head, hidden)
        out = out + (u @ head.lora_b.T).astype(out.dtype)
    return out
