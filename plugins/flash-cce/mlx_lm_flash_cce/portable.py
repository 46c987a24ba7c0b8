"""The pure-MLX backend: one pass over the vocabulary per token chunk.

For each chunk of tokens the vocabulary is swept in blocks. Each block's
logits update a running max ``m`` and sum ``l`` (the log-sum-exp, rescaled
online as flash attention rescales its output) and, when a gradient is
wanted, a running ``G = sum_v exp(z_v - m) * dz_v * W_v``. At the end
``G / l`` is the softmax-weighted head row, so the hidden-state gradient
``G / l - dz_t * W_t`` comes out of the same pass: the custom VJP only
multiplies it by the incoming cotangent. Gradients for trainable head
arrays (a dense weight, an output bias, a LoRA factor) need the final
log-sum-exp of every token, so they take a second sweep that is built only
inside the VJP.

MLX is lazy: a Python loop over blocks does not bound memory by itself.
MLX 0.32 orders a graph breadth-first up to 20 nodes wide
(``MLX_BFS_MAX_WIDTH``), so independent blocks and token chunks run
interleaved and each keeps its ``[tokens, vocab]`` temporaries alive. Here
every block's matmul input is made to depend on the previous block's
accumulators (``mx.depends``, no copy), which turns the whole loss into one
chain: block k+1 runs only after block k's logits and exponentials are
consumed, in whatever order MLX evaluates the outputs. Elementwise work is
fused (``mx.compile``). What remains is the backend's dispatch-ahead (the
CPU allocates outputs for up to ~100 queued operations): about a dozen
blocks are alive at once. Tokens are processed in chunks, so a block is
``[token_chunk, vocab_chunk]`` and the accumulators ``[token_chunk,
hidden]``.
"""

from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple, Union

import mlx.core as mx

from . import heads as _heads

FILTER_BLOCK = 64  # block_masked_mm's tile size for the gradient filter


class Options(NamedTuple):
    softcap: Optional[float] = None
    logit_scale: Optional[float] = None
    token_chunk: int = 256
    vocab_chunk: int = 0  # 0: chosen from chunk_elements
    chunk_elements: int = 1 << 18  # token_chunk * vocab_chunk budget
    with_grad: bool = True
    filter_eps: Optional[float] = None  # skip 64x64 gradient tiles below eps
    block_skip_eps: Optional[float] = None  # skip 64-wide vocab blocks below eps
    compute_dtype: Optional[mx.Dtype] = None  # None: float32 on CPU, input dtype on GPU
    dequantize: Optional[bool] = None  # quantized heads: dense blocks (None: on the CPU)
    elementwise: Optional[str] = None  # cuda-gemm backend: "kernel", "mlx" or None (auto)


class Static(NamedTuple):
    """Everything the traced function depends on besides its array inputs."""

    kind: str
    names: tuple
    group_size: int
    bits: int
    mode: str
    has_lora: bool
    train_weight: bool
    train_bias: bool
    train_lora: bool
    softcap: Optional[float]
    logit_scale: Optional[float]
    token_chunk: int
    vocab_chunk: int
    with_grad: bool
    filter_eps: Optional[float]
    block_skip_eps: Optional[float]
    compute_dtype: mx.Dtype
    dequantize: bool


def vocab_chunk_for(opts: Options, n_tokens: int, vocab: int) -> Tuple[int, int]:
    token_chunk = max(1, min(opts.token_chunk, n_tokens))
    if opts.vocab_chunk:
        vc = opts.vocab_chunk
    else:
        vc = max(256, opts.chunk_elements // token_chunk)
        vc = (vc + 255) // 256 * 256
    return token_chunk, min(vc, vocab)


def compute_dtype(opts: Options, dtype: mx.Dtype) -> mx.Dtype:
    if opts.compute_dtype is not None:
        return opts.compute_dtype
    # The CPU has no fast half-precision matmul (and reduces in the input
    # dtype); accelerators do, with float32 accumulation inside the kernel.
    if mx.default_device() == mx.cpu or dtype == mx.float32:
        return mx.float32
    return dtype


def cap(r: mx.array, st: Any) -> Tuple[mx.array, Union[mx.array, float, None]]:
    """Scaled, soft-capped logits of raw ``r`` and ``d logits / d r`` (None: 1)."""
    z, dz = r, None
    if st.logit_scale is not None:
        z = z * st.logit_scale
        dz = st.logit_scale
    if st.softcap is not None:
        t = mx.tanh(z / st.softcap)
        z = st.softcap * t
        d = 1 - t * t
        dz = d if dz is None else d * dz
    return z, dz


_STEPS = {}


def online_step(st: Any, float32_in: bool = False) -> Callable[..., Tuple[mx.array, ...]]:
    """Compiled block update ``(r, m, l) -> (m', a, l', coef)``.

    ``r`` are a block's raw logits; ``m``, ``l`` the running max and sum;
    ``a = exp(m - m')`` rescales the accumulators; ``coef = exp(z - m') *
    dz`` is what multiplies the head rows for the gradient (None when no
    gradient is wanted). Compiling fuses the elementwise work, so a block
    holds two ``[tokens, vocab]`` buffers (logits and exponentials).
    ``float32_in``: logits of any dtype, computed in float32, ``coef`` back
    in their dtype (the ``cuda-gemm`` backend's bfloat16 blocks).
    """
    key = ("fwd", st.softcap, st.logit_scale, st.with_grad, float32_in)
    if key not in _STEPS:

        def step(r, m, l):
            z, dz = cap(r.astype(mx.float32) if float32_in else r, st)
            m_new = mx.maximum(m, z.max(axis=1))
            a = mx.exp(m - m_new)
            e = mx.exp(z - m_new[:, None])
            l_new = l * a + e.sum(axis=1)
            if not st.with_grad:
                return m_new, a, l_new
            coef = _times(e, dz)
            return m_new, a, l_new, (coef.astype(r.dtype) if float32_in else coef)

        _STEPS[key] = mx.compile(step)
    return _STEPS[key]


def _grad_coef(st):
    """Compiled ``(r, lse, dce, t - v0) -> d loss / d r`` for one block (the second sweep)."""
    key = ("bwd", st.softcap, st.logit_scale)
    if key not in _STEPS:

        def coef(r, lse, dce, shifted):
            z, dz = cap(r, st)
            onehot = shifted[:, None] == mx.arange(r.shape[1])[None, :]
            c = _times(mx.exp(z - lse[:, None]) - onehot, dz)
            return c * dce[:, None], mx.abs(c)

        _STEPS[key] = mx.compile(coef)
    return _STEPS[key]


def _times(x, dz):
    """``x * dz`` where ``dz`` is per element ``[n, v]``, per row ``[n]``, a number or None."""
    if dz is None:
        return x
    if isinstance(dz, mx.array) and dz.ndim == 1 and x.ndim == 2:
        return x * dz[:, None]
    return x * dz


def _block_max(x, per_vocab_block=False):
    """Max over FILTER_BLOCK tiles of a non-negative ``[n, v]`` (zero padded)."""
    b = FILTER_BLOCK
    n, v = x.shape
    pn, pv = (-n) % b, (-v) % b
    if pn or pv:
        x = mx.pad(x, [(0, pn), (0, pv)])
    x = x.reshape((n + pn) // b, b, (v + pv) // b, b).max(axis=(1, 3))
    if per_vocab_block:  # one decision per vocab block, for the whole token chunk
        x = mx.broadcast_to(x.max(axis=0, keepdims=True), x.shape)
    return x


def _filter_mask(coef, st):
    """Which 64x64 tiles of a coefficient block to keep (None: keep all)."""
    masks = []
    if st.filter_eps is not None:
        masks.append(_block_max(coef) >= st.filter_eps)
    if st.block_skip_eps is not None:
        masks.append(_block_max(coef, per_vocab_block=True) >= st.block_skip_eps)
    if not masks:
        return None
    return masks[0] if len(masks) == 1 else mx.logical_and(*masks)


def _head(st):
    return _heads.Head(kind=st.kind, group_size=st.group_size, bits=st.bits, mode=st.mode)


def _block(st, arrays, v0, v1):
    """Head rows ``[v0, v1)`` as the block's matmuls want them.

    Dense rows are cast to the compute dtype once per block. Quantized rows
    are dequantized to a dense block when ``st.dequantize`` (the CPU: MLX's
    CPU quantized_matmul is much slower than a float32 BLAS matmul,
    benchmarks/results/flash-cce-cpu.md), else
    kept packed for ``quantized_matmul``.
    """
    head = _head(st)
    if st.kind == "dense":
        return arrays["weight"][v0:v1].astype(st.compute_dtype)
    if st.dequantize:
        return _heads.gather_rows(head, arrays, slice(v0, v1), st.compute_dtype)
    return None  # sliced inside matmul_rows


def _raw_logits(st, arrays, blk, hc, uc, v0, v1):
    if blk is not None:
        r = (hc @ blk.T).astype(mx.float32)
    else:
        r = _heads.matmul_rows(_head(st), hc, arrays, v0, v1).astype(mx.float32)
    if "bias" in arrays:
        r = r + arrays["bias"][v0:v1].astype(mx.float32)
    if st.has_lora:
        r = r + uc @ arrays["lora_b"][v0:v1].astype(mx.float32).T
    return r


def _back_rows(st, arrays, blk, coef, v0, v1, probe):
    """``coef @ W[v0:v1]``: a coefficient block times the head rows.

    ``probe`` is the block's |softmax coefficient| estimate, which the
    optional filters compare with their eps (dense blocks only: MLX has no
    block-masked quantized matmul).
    """
    cd = st.compute_dtype
    mask = _filter_mask(probe, st) if blk is not None and probe is not None else None
    if mask is not None:
        return mx.block_masked_mm(coef.astype(cd), blk, FILTER_BLOCK, mask_lhs=mask).astype(
            mx.float32
        )
    if blk is not None:
        return (coef.astype(cd) @ blk).astype(mx.float32)
    return _heads.matmul_rows(_head(st), coef.astype(cd), arrays, v0, v1, transpose=False).astype(
        mx.float32
    )


def _target_terms(st, arrays, hc, uc, tc):
    """Raw target logit per token and the target head row (for the gradient)."""
    head = _head(st)
    wt = _heads.gather_rows(head, arrays, tc, mx.float32)
    rt = (hc.astype(mx.float32) * wt).sum(axis=1)
    bt = None
    if "bias" in arrays:
        rt = rt + arrays["bias"][tc].astype(mx.float32)
    if st.has_lora:
        bt = arrays["lora_b"][tc].astype(mx.float32)
        rt = rt + (uc * bt).sum(axis=1)
    return rt, wt, bt


def _forward(st, h, t, u, arrays):
    n_tok, vocab = h.shape[0], arrays["weight"].shape[0]
    cd = st.compute_dtype
    nc, vc = st.token_chunk, st.vocab_chunk
    step = online_step(st)
    ce, lses, ds, dus = [], [], [], []
    gate = []  # what the next block waits for (see the module docstring)
    for n0 in range(0, n_tok, nc):
        n1 = min(n0 + nc, n_tok)
        hc = h[n0:n1].astype(cd)
        tc = t[n0:n1]
        uc = u[n0:n1].astype(mx.float32) if st.has_lora else None
        m = mx.full((n1 - n0,), -mx.inf, dtype=mx.float32)
        l = mx.zeros((n1 - n0,), dtype=mx.float32)
        g = mx.zeros((n1 - n0, h.shape[1]), dtype=mx.float32) if st.with_grad else None
        gu = mx.zeros(uc.shape, dtype=mx.float32) if st.with_grad and st.has_lora else None
        for v0 in range(0, vocab, vc):
            v1 = min(v0 + vc, vocab)
            x = mx.depends(hc, gate) if gate else hc
            blk = _block(st, arrays, v0, v1)
            r = _raw_logits(st, arrays, blk, x, uc, v0, v1)
            if st.with_grad:
                m_new, a, l, coef = step(r, m, l)
                probe = None
                if st.filter_eps is not None or st.block_skip_eps is not None:
                    # e / l only shrinks as later blocks add to l: an upper
                    # bound on the final probability.
                    probe = mx.abs(coef) * (1 / l)[:, None]
                g = g * a[:, None] + _back_rows(st, arrays, blk, coef, v0, v1, probe)
                deps = [g]
                if st.has_lora:
                    gu = gu * a[:, None] + coef @ arrays["lora_b"][v0:v1].astype(mx.float32)
                    deps.append(gu)
                gate = [l] + deps
            else:
                m_new, a, l = step(r, m, l)
                gate = [l]
            m = m_new
        lse = m + mx.log(l)
        rt, wt, bt = _target_terms(st, arrays, hc, uc, tc)
        zt, dzt = cap(rt, st)
        ce.append(lse - zt)
        lses.append(lse)
        if st.with_grad:
            inv = (1 / l)[:, None]
            d = g * inv - _times(wt, dzt)
            ds.append(d.astype(h.dtype))
            if st.has_lora:
                dus.append(gu * inv - _times(bt, dzt))
            gate = [ds[-1]] + dus[-1:]
        else:
            gate = [ce[-1]]
    outs = [mx.concatenate(ce), mx.concatenate(lses)]
    if st.with_grad:
        outs.append(mx.concatenate(ds))
        if st.has_lora:
            outs.append(mx.concatenate(dus))
    return outs


def sweep(
    st: Static,
    h: mx.array,
    t: mx.array,
    u: mx.array,
    arrays: Dict[str, mx.array],
    lse: mx.array,
    dce: mx.array,
    need_dh: bool,
) -> Tuple[Optional[mx.array], Optional[mx.array], Optional[mx.array]]:
    """Second sweep: exact gradients that need the final log-sum-exp.

    Returns ``(dh, du, dhead)`` where ``dhead`` is ``[V, parts]`` over the
    trainable head parts (weight rows, LoRA rows, bias) concatenated along
    the last axis, or None.
    """
    n_tok, vocab = h.shape[0], arrays["weight"].shape[0]
    cd = st.compute_dtype
    nc, vc = st.token_chunk, st.vocab_chunk
    head_parts = st.train_weight or st.train_lora or st.train_bias
    acc = [None] * ((vocab + vc - 1) // vc)  # per vocab block, summed over tokens
    grad_coef = _grad_coef(st)
    dhs, dus = [], []
    gate = []
    for n0 in range(0, n_tok, nc):
        n1 = min(n0 + nc, n_tok)
        hc = h[n0:n1].astype(cd)
        tc = t[n0:n1]
        uc = u[n0:n1].astype(mx.float32) if st.has_lora else None
        scale = dce[n0:n1].astype(mx.float32)
        shift = lse[n0:n1]
        right = []
        if st.train_weight:
            right.append(hc.astype(mx.float32))
        if st.train_lora:
            right.append(uc)
        if st.train_bias:
            right.append(mx.ones((n1 - n0, 1), dtype=mx.float32))
        right = mx.concatenate(right, axis=1) if len(right) > 1 else (right[0] if right else None)
        dh = mx.zeros((n1 - n0, h.shape[1]), dtype=mx.float32) if need_dh else None
        du = mx.zeros(uc.shape, dtype=mx.float32) if need_dh and st.has_lora else None
        for k, v0 in enumerate(range(0, vocab, vc)):
            v1 = min(v0 + vc, vocab)
            x = mx.depends(hc, gate) if gate else hc
            blk = _block(st, arrays, v0, v1)
            r = _raw_logits(st, arrays, blk, x, uc, v0, v1)
            coef, probe = grad_coef(r, shift, scale, tc - v0)
            if st.filter_eps is None and st.block_skip_eps is None:
                probe = None
            part = None
            if head_parts:
                mask = _filter_mask(probe, st) if probe is not None else None
                if mask is None:
                    part = coef.T @ right
                else:
                    part = mx.block_masked_mm(coef.T, right, FILTER_BLOCK, mask_lhs=mask.T)
                acc[k] = part if acc[k] is None else acc[k] + part
            gate = [] if part is None else [acc[k]]
            if need_dh:
                dh = dh + _back_rows(st, arrays, blk, coef, v0, v1, probe)
                gate.append(dh)
                if st.has_lora:
                    du = du + coef @ arrays["lora_b"][v0:v1].astype(mx.float32)
                    gate.append(du)
        if need_dh:
            dhs.append(dh)
            if st.has_lora:
                dus.append(du)
    dh = mx.concatenate(dhs) if need_dh else None
    du = mx.concatenate(dus) if need_dh and st.has_lora else None
    dhead = mx.concatenate(acc, axis=0) if head_parts else None
    return dh, du, dhead


_CORES = {}


def _core(st):
    """The custom function for one static configuration (cached)."""
    if st in _CORES:
        return _CORES[st]

    @mx.custom_function
    def core(h, t, u, *values):
        return tuple(_forward(st, h, t, u, dict(zip(st.names, values, strict=False))))

    @core.vjp
    def core_vjp(primals, cotangents, outputs):
        h, t, u, *values = primals
        arrays = dict(zip(st.names, values, strict=False))
        dce = cotangents[0]
        if st.with_grad:
            dh = (dce[:, None].astype(mx.float32) * outputs[2]).astype(h.dtype)
            du = dce[:, None].astype(mx.float32) * outputs[3] if st.has_lora else None
            _, _, dhead = sweep(st, h, t, u, arrays, outputs[1], dce, need_dh=False)
        else:
            dh, du, dhead = sweep(st, h, t, u, arrays, outputs[1], dce, need_dh=True)
            dh = dh.astype(h.dtype)
        grads = [dh, mx.zeros_like(t), mx.zeros_like(u) if du is None else du.astype(u.dtype)]
        col = 0
        split = {}
        if dhead is not None:
            if st.train_weight:
                split["weight"] = dhead[:, col : col + h.shape[1]]
                col += h.shape[1]
            if st.train_lora:
                r = arrays["lora_b"].shape[1]
                split["lora_b"] = dhead[:, col : col + r]
                col += r
            if st.train_bias:
                split["bias"] = dhead[:, col]
        for name, value in zip(st.names, values, strict=False):
            g = split.get(name)
            grads.append(mx.zeros_like(value) if g is None else g.astype(value.dtype))
        return tuple(grads)

    _CORES[st] = core
    return core


def per_token(
    head: _heads.Head,
    hidden: mx.array,
    targets: mx.array,
    opts: Options,
    train: Optional[Dict[str, bool]] = None,
) -> mx.array:
    """Per-token cross-entropy ``[N]`` (float32) of ``head(hidden)`` vs ``targets``.

    ``hidden`` is ``[N, H]``, ``targets`` ``[N]`` integer ids in ``[0, V)``.
    ``train`` says which head parts get gradients: a dict with keys
    ``weight``, ``bias``, ``lora`` (default: all that exist, except the
    packed weight of a quantized head, which has no gradient).
    """
    names, values = _heads.head_arrays(head)
    n_tok = hidden.shape[0]
    nc, vc = vocab_chunk_for(opts, n_tok, head.vocab)
    train = train or {}
    st = Static(
        kind=head.kind,
        names=tuple(names),
        group_size=head.group_size,
        bits=head.bits,
        mode=head.mode,
        has_lora=head.has_lora,
        train_weight=head.kind == "dense" and train.get("weight", True),
        train_bias=head.bias is not None and train.get("bias", True),
        train_lora=head.has_lora and train.get("lora", True),
        softcap=opts.softcap,
        logit_scale=opts.logit_scale,
        token_chunk=nc,
        vocab_chunk=vc,
        with_grad=opts.with_grad,
        filter_eps=opts.filter_eps,
        block_skip_eps=opts.block_skip_eps,
        compute_dtype=compute_dtype(opts, hidden.dtype),
        dequantize=(mx.default_device() == mx.cpu)
        if opts.dequantize is None
        else bool(opts.dequantize),
    )
    u = (
        _heads.lora_input(head, hidden)
        if head.has_lora
        else mx.zeros((n_tok, 0), dtype=hidden.dtype)
    )
    return _core(st)(hidden, targets, u, *values)[0]
