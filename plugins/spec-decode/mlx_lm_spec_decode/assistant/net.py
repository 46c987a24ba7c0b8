"""The assistant drafter's own network: a 1-4 layer transformer that
attends over the target's cache.

Each of its layers attends to

- the K/V of one *donor* layer of the target (``donors.donor_view``: slices
  of the cache's own arrays, never copied or stored), and
- its own K/V for the positions it is drafting, which the target has not
  seen yet. These live only while a draft chain is being built: after the
  target verifies, every kept token is in the target's cache, so the
  drafter's own entries are dropped, exactly where the target's cache ends.

Its input at the first drafted position is the target's final hidden state
(the state that produced the last emitted token) and the embedding of that
token (the target's embedding table); at later positions, its own output
state and the drafted token. It scores with the target's own lm-head and
drafts autoregressively, as EAGLE-style heads do. Its own keys are rotated
with the donor layer's RoPE at their absolute positions, so they sit in the
donor's key space.

``Assistant.step`` is one drafted position (decoding); ``Assistant.unrolled``
is the same computation for every position and chained step at once
(training), and the tests hold the two equal.
"""

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from .config import AssistantConfig
from .donors import output_scale


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: AssistantConfig):
        super().__init__()
        D, H, K = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads
        self.n_heads, self.n_kv = H, K
        self.head_dim, self.v_head_dim = cfg.head_dim, cfg.v_head_dim
        self.scale = cfg.head_dim**-0.5
        self.input_layernorm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.q_proj = nn.Linear(D, H * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(D, K * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(D, K * cfg.v_head_dim, bias=False)
        self.o_proj = nn.Linear(H * cfg.v_head_dim, D, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.mlp = MLP(D, cfg.intermediate_size)

    def qkv(self, x, rope, offset):
        B, L, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(h).reshape(B, L, self.n_kv, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(h).reshape(B, L, self.n_kv, -1).transpose(0, 2, 1, 3)
        if rope is not None:
            q, k = rope(q, offset=offset), rope(k, offset=offset)
        return q, k, v

    def finish(self, x, attn):
        B, H, L, _ = attn.shape
        x = x + self.o_proj(attn.transpose(0, 2, 1, 3).reshape(B, L, -1))
        return x + self.mlp(self.post_attention_layernorm(x))


def attend(
    q: mx.array,
    donor: tuple,
    own_k: list[mx.array],
    own_v: list[mx.array],
    scale: float,
    donor_mask: Optional[mx.array] = None,
) -> mx.array:
    """Attention of ``q`` over a donor's K/V and the drafter's own entries.

    ``q``: ``[B, H, L, d]``. ``donor``: ``(keys, values, quant)`` from
    ``donor_view`` (``[B, Hkv, T, d]``, read in place by the matmuls).
    ``own_k``/``own_v``: lists of ``[B, Hkv, L, d]``, row ``i`` of each
    being one more key for query row ``i`` (the drafter's own positions).
    ``donor_mask``: ``[L, T]`` booleans (training), or None (all visible).
    One softmax over the union, in float32.
    """
    B, H, L, d = q.shape
    keys, values, quant = donor
    n_kv = (keys[0] if quant else keys).shape[1]
    rep = H // n_kv
    # A quantized cache is (packed uint32, scales, biases): compute in the scales' dtype.
    q = (q * scale).astype(keys[1].dtype if quant else keys.dtype)
    q2 = q.reshape(B, n_kv, rep * L, d)
    if quant:
        gs, bits = quant
        s_d = mx.quantized_matmul(q2, *keys, transpose=True, group_size=gs, bits=bits)
    else:
        s_d = q2 @ keys.swapaxes(-1, -2)
    T = s_d.shape[-1]
    s_d = s_d.reshape(B, n_kv, rep, L, T).astype(mx.float32)
    if donor_mask is not None:
        s_d = mx.where(donor_mask, s_d, -mx.inf)
    if L == 1:
        # Drafting: the chain's own entries are a few more keys of the one
        # query row (concatenated: they are the chain's, not the cache's).
        k_o, v_o = mx.concatenate(own_k, axis=2), mx.concatenate(own_v, axis=2)
        s_o = (
            (q2.astype(k_o.dtype) @ k_o.swapaxes(-1, -2))
            .reshape(B, n_kv, rep, 1, -1)
            .astype(mx.float32)
        )
    else:
        # Training: row i's own keys are row i of each array.
        q5 = q.reshape(B, n_kv, rep, L, d).astype(mx.float32)
        s_o = mx.stack([(q5 * k[:, :, None].astype(mx.float32)).sum(-1) for k in own_k], axis=-1)
    scores = mx.concatenate([s_d, s_o], axis=-1)
    p = mx.softmax(scores, axis=-1, precise=True)
    p_d = p[..., :T].reshape(B, n_kv, rep * L, T)
    vdt = values[1].dtype if quant else values.dtype
    if quant:
        o_d = mx.quantized_matmul(
            p_d.astype(vdt), *values, transpose=False, group_size=gs, bits=bits
        )
    else:
        o_d = p_d.astype(vdt) @ values
    out = o_d.reshape(B, n_kv, rep, L, -1).astype(mx.float32)
    if L == 1:
        p_o = p[..., T:].reshape(B, n_kv, rep, -1)
        out = out + (p_o.astype(v_o.dtype) @ v_o).reshape(B, n_kv, rep, 1, -1).astype(mx.float32)
    else:
        for j, v in enumerate(own_v):
            out = out + p[..., T + j, None] * v[:, :, None].astype(mx.float32)
    return out.reshape(B, H, L, -1).astype(q.dtype)


class Assistant(nn.Module):
    """The drafter's own weights. Target modules (embedding, lm-head, RoPE)
    are passed in at call time and never become part of this module."""

    def __init__(self, cfg: AssistantConfig):
        super().__init__()
        D = cfg.hidden_size
        self.hidden_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.embed_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * D, D, bias=False)
        self.layers = [Layer(cfg) for _ in range(cfg.num_layers)]
        self.norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)

    def inputs(self, hidden: mx.array, emb: mx.array) -> mx.array:
        dt = self.fc.weight.dtype
        x = mx.concatenate(
            [self.hidden_norm(hidden.astype(dt)), self.embed_norm(emb.astype(dt))], axis=-1
        )
        return self.fc(x)

    def step(
        self,
        hidden: mx.array,
        emb: mx.array,
        donors: list[tuple],
        ropes: list[Any],
        own: list[list[tuple[mx.array, mx.array]]],
        pos: Any,
        masks: Optional[list] = None,
    ) -> mx.array:
        """One drafted position (``L == 1``) at absolute position ``pos``
        (an int, or a lazy scalar).

        ``own[i]`` is layer ``i``'s list of ``(k, v)`` from earlier steps of
        this chain; this step's entries are appended to it. ``masks[i]``:
        which of donor ``i``'s entries layer ``i`` attends (``[1, T]``
        booleans; None: all)."""
        x = self.inputs(hidden, emb)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(x, ropes[i], pos)
            own[i].append((k, v))
            a = attend(
                q,
                donors[i],
                [e[0] for e in own[i]],
                [e[1] for e in own[i]],
                layer.scale,
                None if masks is None else masks[i],
            )
            x = layer.finish(x, a)
        return self.norm(x)

    def unrolled(
        self,
        hidden: mx.array,
        emb: mx.array,
        donors: list[tuple],
        ropes: list[Any],
        windows: list[Optional[int]],
        steps: int,
    ) -> list[mx.array]:
        """Training: ``steps`` chained draft steps from every position at once.

        ``hidden``: the target's final states ``[B, T, D]``; ``emb``: the
        embeddings of the tokens ``[B, T, D]``; ``donors``: per layer the
        donor's K/V over the same ``T`` tokens. Step ``s`` at row ``p``
        drafts from a target cache holding tokens ``0..p-1-s``: it sees the
        donor keys up to ``p-1-s``, its own keys of the chain's earlier
        steps (rows ``p-s..p-1``) and its own; its input state is the
        target's ``hidden[p-1]`` at step 0 and its own output of row
        ``p-1`` after. Returns the output states of each step (row ``p``
        predicts token ``p+1``; rows ``p < s+1`` have no valid chain).
        """
        B, T, _ = hidden.shape
        rows = mx.arange(T)[:, None]
        cols = mx.arange(T)[None]
        feat = shift(hidden.astype(self.fc.weight.dtype), 1)
        own = [[] for _ in self.layers]
        outs = []
        for s in range(steps):
            x = self.inputs(feat, emb)
            for i, layer in enumerate(self.layers):
                q, k, v = layer.qkv(x, ropes[i], 0)
                own[i].append((k, v))
                last = rows - 1 - s
                mask = cols <= last
                if windows[i]:
                    mask = mask & (cols > last - windows[i])
                ks = [shift(kk, s - j) for j, (kk, _) in enumerate(own[i])]
                vs = [shift(vv, s - j) for j, (_, vv) in enumerate(own[i])]
                a = attend(q, donors[i], ks, vs, layer.scale, donor_mask=mask)
                x = layer.finish(x, a)
            out = self.norm(x)
            outs.append(out)
            feat = shift(out, 1)
        return outs


def shift(a: mx.array, n: int) -> mx.array:
    """Rows moved ``n`` down along axis -2, zeros in front."""
    if n == 0:
        return a
    pad = mx.zeros(a.shape[:-2] + (n, a.shape[-1]), a.dtype)
    return mx.concatenate([pad, a[..., : a.shape[-2] - n, :]], axis=-2)


def init_from_target(net: Assistant, model: nn.Module) -> None:
    """Start training from "draft what the target just predicted": the
    input projection passes the target's (normalized) hidden state through,
    the attention and MLP branches start at zero, and the final norm restores
    the hidden state's scale. The first predictions are then the target's
    own (calibrated) distribution one position back, not random and
    saturated ones; measured on SmolLM2, better top-1 agreement after the
    same steps than a random start."""
    D = net.fc.weight.shape[0]
    net.fc.weight = mx.concatenate([mx.eye(D), mx.zeros((D, D))], axis=1).astype(
        net.fc.weight.dtype
    )
    for layer in net.layers:
        layer.o_proj.weight = mx.zeros_like(layer.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    s = output_scale(model)
    if s is not None:
        net.norm.weight = mx.full((D,), mx.sqrt((s * s).mean()).item(), net.norm.weight.dtype)
