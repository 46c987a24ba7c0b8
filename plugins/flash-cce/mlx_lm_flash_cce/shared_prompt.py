"""Hidden states of preference pairs with each prompt run once.

A batch of pairs is ``prompts [B, P]`` (right-padded, real lengths
``prompt_lens [B]``) and ``responses [2B, R]`` (the B chosen responses, then
the B rejected ones, right-padded). ``shared_hidden`` runs the prompts
through the model once, keeping each layer's keys and values, then runs all
2B responses in one forward that attends to its own prompt's keys: row ``b``
and row ``B + b`` both continue prompt ``b``. The hand-over is mlx-lm's own
cache interface (``update_and_fetch``, ``offset``, ``make_mask``), so no model
code changes:

- the prompt pass records each layer's keys and values and masks as mlx-lm
  would without a cache (causal, or a sliding window);
- the response pass puts the prompt's keys in front of its own, at positions
  that continue each row's real prompt (``offset`` is the ``[2B]`` array of
  prompt lengths, which RoPE and gpt2's position table take per row), and a
  mask per row hides the prompt's padding.

Nothing is written in place, so gradients flow back through the prompt's
keys and values into the prompt pass: log-probs and gradients equal two full
sequences per pair (``unshared_hidden``) to float tolerance. Models that
cannot take this (an attention that does not broadcast a per-row mask, a
state-space layer) are caught by ``check`` and run unshared.
"""

from typing import Any, Optional, Tuple

import mlx.core as mx

from mlx_lm_ext.api import backbone


class PromptCache:
    """The prompt pass: keep this layer's keys and values, mask as without a cache."""

    offset = 0

    def __init__(self):
        self.keys = self.values = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        self.keys, self.values = keys, values
        return keys, values

    def make_mask(
        self, n: int, return_array: bool = False, window_size: Optional[int] = None
    ) -> Any:
        # mlx-lm's create_attention_mask without a cache, window included
        if n == 1:
            return None
        if return_array or (window_size and n > window_size):
            from mlx_lm.models.base import create_causal_mask

            return create_causal_mask(n, window_size=window_size)
        return "causal"


class ResponseCache:
    """The response pass: the prompt's keys first, per-row positions and mask."""

    def __init__(self, prompt: PromptCache, prompt_lens: mx.array):
        self.prompt = prompt
        self.offset = mx.concatenate([prompt_lens, prompt_lens])  # [2B]
        self.prompt_len = prompt.keys.shape[2]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        pk, pv = self.prompt.keys, self.prompt.values
        keys = mx.concatenate([mx.concatenate([pk, pk]), keys], axis=2)
        values = mx.concatenate([mx.concatenate([pv, pv]), values], axis=2)
        return keys, values

    def make_mask(
        self, n: int, return_array: bool = False, window_size: Optional[int] = None
    ) -> mx.array:
        plen = self.offset[:, None]  # [2B, 1]
        cols = mx.arange(self.prompt_len)[None]
        steps = mx.arange(n)[None]
        q_pos = plen + steps  # [2B, n]
        k_pos = mx.concatenate([mx.broadcast_to(cols, (plen.shape[0], cols.shape[1])), q_pos], 1)
        k_real = mx.concatenate([cols < plen, mx.ones((plen.shape[0], n), dtype=mx.bool_)], axis=1)
        mask = k_real[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])
        if window_size:
            mask = mask & (q_pos[:, :, None] - k_pos[:, None, :] < window_size)
        return mask[:, None]  # [2B, 1, n, P + n]


def _layers(model):
    return len(model.layers)


def shared_hidden(
    model: Any,
    arch: backbone.Arch,
    prompts: mx.array,
    prompt_lens: mx.array,
    responses: mx.array,
) -> mx.array:
    """``[2B, R, H]``: the hidden state that predicts each response token.

    Position 0 is the prompt's last real position (it predicts the first
    response token); position ``t`` is response position ``t - 1``.
    """
    caches = [PromptCache() for _ in range(_layers(model))]
    hp = arch.hidden(model, prompts, caches)  # [B, P, H]
    last = mx.take_along_axis(hp, (prompt_lens - 1)[:, None, None], axis=1)  # [B, 1, H]
    follow = [ResponseCache(c, prompt_lens) for c in caches]
    hr = arch.hidden(model, responses, follow)  # [2B, R, H]
    return mx.concatenate([mx.concatenate([last, last]), hr[:, :-1]], axis=1)


def joined(prompts: mx.array, prompt_lens: mx.array, responses: mx.array) -> mx.array:
    """``[2B, P + R]``: each response after its own prompt, right-padded."""
    p, r = prompts.shape[1], responses.shape[1]
    prompts2 = mx.concatenate([prompts, prompts])
    plen = mx.concatenate([prompt_lens, prompt_lens])[:, None]
    t = mx.arange(p + r)[None]
    from_prompt = mx.take_along_axis(
        prompts2, mx.broadcast_to(mx.minimum(t, p - 1), (plen.shape[0], p + r)), 1
    )
    from_resp = mx.take_along_axis(responses, mx.clip(t - plen, 0, r - 1), 1)
    return mx.where(t < plen, from_prompt, from_resp)


def _response_positions(prompt_lens, r):
    plen = mx.concatenate([prompt_lens, prompt_lens])[:, None]
    return plen - 1 + mx.arange(r)[None]  # [2B, R]: where each response token is predicted


def unshared_hidden(
    model: Any,
    arch: backbone.Arch,
    prompts: mx.array,
    prompt_lens: mx.array,
    responses: mx.array,
) -> mx.array:
    """What ``shared_hidden`` equals: two full sequences per pair, the prompt run twice."""
    seqs = joined(prompts, prompt_lens, responses)
    hidden = arch.hidden(model, seqs)  # [2B, P + R, H]
    where = _response_positions(prompt_lens, responses.shape[1])
    return mx.take_along_axis(hidden, where[..., None], axis=1)


def stock_logps(
    model: Any, prompts: mx.array, prompt_lens: mx.array, responses: mx.array
) -> mx.array:
    """``[2B, R]`` per-token log-probs the usual way: two full sequences, full logits."""
    logits = model(joined(prompts, prompt_lens, responses)).astype(mx.float32)
    where = _response_positions(prompt_lens, responses.shape[1])
    logits = mx.take_along_axis(logits, where[..., None], axis=1)  # [2B, R, V]
    picked = mx.take_along_axis(logits, responses[..., None], axis=-1)[..., 0]
    return picked - mx.logsumexp(logits, axis=-1)


def _probe(vocab):
    key = mx.random.key(7)  # never the trainer's RNG
    k1, k2 = mx.random.split(key)
    prompts = mx.random.randint(0, vocab, (2, 6), key=k1)
    responses = mx.random.randint(0, vocab, (4, 5), key=k2)
    return prompts, mx.array([6, 3]), responses


def check(model: Any, arch: backbone.Arch, vocab: int) -> Tuple[bool, str]:
    """Whether ``shared_hidden`` equals ``unshared_hidden`` on this model (a short probe)."""
    was_training = model.training
    model.eval()
    try:
        prompts, plens, responses = _probe(vocab)
        got = shared_hidden(model, arch, prompts, plens, responses)
        want = unshared_hidden(model, arch, prompts, plens, responses)
        # Compare where responses are real in both (here: every position).
        err = (mx.abs(got - want).max() / mx.maximum(mx.abs(want).max(), 1e-6)).item()
    except Exception as e:  # a model whose attention cannot take the per-row mask
        return False, f"{type(e).__name__}: {e}"
    finally:
        model.train(was_training)
    tol = 1e-3 if want.dtype == mx.float32 else 5e-2
    if not err <= tol:
        return False, f"hidden states differ by {err:.3g} (tolerance {tol:g})"
    return True, f"matches two full sequences (max relative error {err:.2g})"
