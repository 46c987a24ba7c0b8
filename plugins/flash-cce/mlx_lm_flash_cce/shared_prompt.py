"""Hidden states of preference pairs with each prompt run once.

A batch of pairs is ``prompts [B, P]`` (right-padded, real lengths
``prompt_lens [B]``) and ``responses [2B, R]`` (the B chosen responses, then
the B rejected ones, right-padded). ``shared_hidden`` runs the prompts but
their last real token through the model once, keeping each layer's keys and
values, then runs all 2B responses in one forward that attends to its own
prompt's keys: row ``b`` and row ``B + b`` both continue prompt ``b``, each
from the prompt's last token to its own last but one, so every position it
computes predicts a response token and the prompt pass's output is never
read (MLX then runs its last layer only as far as the keys and values, and
the head only on response tokens). The hand-over is mlx-lm's own
cache interface (``update_and_fetch``, ``offset``, ``make_mask``), so no model
code changes:

- the prompt pass records each layer's keys and values and masks as mlx-lm
  would without a cache (causal, or a sliding window);
- the response pass puts the prompt's keys in front of its own, at positions
  that continue each row's prompt (``offset`` is the ``[2B]`` array of
  prompt lengths less one, which RoPE and gpt2's position table take per
  row), and a mask per row hides the prompt's padding.

Nothing is written in place, so gradients flow back through the prompt's
keys and values into the prompt pass: log-probs and gradients equal two full
sequences per pair (``unshared_hidden``) to float tolerance. Models that
cannot take this (an attention that does not broadcast a per-row mask, a
state-space layer) are caught by ``check`` and run unshared.

The reference in the step (``top``): when every trained weight lies in
adapters of the top ``k`` layers (``adapted_top``; mlx-lm's ``--num-layers``),
the lower layers compute the same for the policy and for the base model.
Both passes then run them once and the top ``k`` twice, through ``Twin``
layers put in the model's layer list for the call: rows ``[:n]`` with the
adapters (the policy), rows ``[n:]`` with them off (the reference, no
gradient), each with its own caches (``TwinCache``). The hidden states come
back stacked, the policy's ``[2B]`` rows then the reference's; the
reference costs the top ``k`` layers and the head, not a forward.
``check_reference`` compares both halves with the whole model on a probe.
"""

import contextlib
from typing import Any, Iterator, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

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


class TwinCache:
    """A twin layer's two caches; the mask and positions are the policy's (the same rows)."""

    def __init__(self, policy: Any, ref: Any):
        self.policy, self.ref = policy, ref

    @property
    def offset(self):
        return self.policy.offset

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return self.policy.make_mask(*args, **kwargs)


def _follow(cache, prompt_lens):
    if isinstance(cache, TwinCache):
        return TwinCache(_follow(cache.policy, prompt_lens), _follow(cache.ref, prompt_lens))
    return ResponseCache(cache, prompt_lens)


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[int]:
    """The base model: every LoRA/DoRA layer swapped for the layer it wraps, then back."""
    swapped = []
    for path, module in model.named_modules():
        if "lora_a" in module:
            base = module.get("linear", module.get("embedding"))
            if isinstance(base, nn.Module):
                swapped.append((path, module, base))
    model.update_modules(tree_unflatten([(p, b) for p, _, b in swapped]))
    try:
        yield len(swapped)
    finally:
        model.update_modules(tree_unflatten([(p, m) for p, m, _ in swapped]))


class Twin:
    """An adapted layer run twice: with its adapters on rows ``[:n]`` (the policy)
    and without them on rows ``[n:]`` (the reference, no gradient). The first
    twin (``first``) takes the frozen lower layers' rows once and doubles them."""

    def __init__(self, layer: nn.Module, first: bool):
        self.layer, self.first = layer, first

    def __getattr__(self, name: str) -> Any:  # what the model's loop reads (use_sliding, ...)
        return getattr(self.__dict__["layer"], name)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if self.first:
            policy = ref = mx.stop_gradient(x)  # nothing below is trained
        else:
            n = x.shape[0] // 2
            policy, ref = x[:n], x[n:]
        pc, rc = (None, None) if cache is None else (cache.policy, cache.ref)
        out = self.layer(policy, mask, pc)
        with adapters_off(self.layer):
            base = self.layer(mx.stop_gradient(ref), mask, rc)
        return mx.concatenate([out, mx.stop_gradient(base)])


@contextlib.contextmanager
def _twins(model, top):
    """The top ``top`` layers as ``Twin`` layers for the call, in the model's own list."""
    layers = model.layers
    n = len(layers)
    kept = layers[n - top :] if top else []
    for i, layer in enumerate(kept):
        layers[n - top + i] = Twin(layer, first=i == 0)
    try:
        yield
    finally:
        if top:
            layers[n - top :] = kept


def _layers(model):
    return len(model.layers)


def _rows(hidden, rows, top):
    if hidden.shape[0] != rows * (2 if top else 1):  # a layer list the model does not run
        raise ValueError("the model's forward does not run the layers of model.layers")


def shared_hidden(
    model: Any,
    arch: backbone.Arch,
    prompts: mx.array,
    prompt_lens: mx.array,
    responses: mx.array,
    top: int = 0,
) -> mx.array:
    """``[2B, R, H]``: the hidden state that predicts each response token.

    Position 0 is the prompt's last real position (it predicts the first
    response token); position ``t`` is response position ``t - 1``. With
    ``top``, ``[4B, R, H]``: the policy's rows, then the reference's.

    The prompt's last real token runs with the responses (the response pass
    reads ``[last, response[:-1]]`` from ``prompt_lens - 1`` on), so the
    prompt pass's output is never read: MLX computes its last layer only as
    far as that layer's keys and values, and no position runs for nothing.
    """
    n, b = _layers(model), prompts.shape[0]
    caches: List[Any] = [PromptCache() for _ in range(n - top)]
    caches += [TwinCache(PromptCache(), PromptCache()) for _ in range(top)]
    before = prompt_lens - 1  # real prompt tokens in the prompt pass
    last = mx.take_along_axis(prompts, before[:, None], axis=1)  # [B, 1]
    inputs = mx.concatenate([mx.concatenate([last, last]), responses[:, :-1]], axis=1)
    with _twins(model, top):
        # keys and values only; column P - 1 holds at most a row's ``last``
        arch.hidden(model, prompts[:, : max(prompts.shape[1] - 1, 1)], caches)
        follow = [_follow(c, before) for c in caches]
        hidden = arch.hidden(model, inputs, follow)  # [2B, R, H] (twins: [4B, R, H])
    _rows(hidden, 2 * b, top)
    return hidden


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
    top: int = 0,
) -> mx.array:
    """What ``shared_hidden`` equals: two full sequences per pair, the prompt run twice."""
    seqs = joined(prompts, prompt_lens, responses)[:, :-1]  # the last token predicts nothing
    with _twins(model, top):
        hidden = arch.hidden(model, seqs)  # [2B, P + R, H] (twins: [4B, P + R, H])
    _rows(hidden, seqs.shape[0], top)
    where = _response_positions(prompt_lens, responses.shape[1])
    if top:
        where = mx.concatenate([where, where])
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
        err = _error(got, want)
    except Exception as e:  # a model whose attention cannot take the per-row mask
        return False, f"{type(e).__name__}: {e}"
    finally:
        model.train(was_training)
    return _verdict(err, want.dtype, "matches two full sequences")


def _error(got, want):
    return (mx.abs(got - want).max() / mx.maximum(mx.abs(want).max(), 1e-6)).item()


def _verdict(err, dtype, what):
    tol = 1e-3 if dtype == mx.float32 else 5e-2
    if not err <= tol:
        return False, f"hidden states differ by {err:.3g} (tolerance {tol:g})"
    return True, f"{what} (max relative error {err:.2g})"


def check_reference(
    model: Any, arch: backbone.Arch, vocab: int, top: int, hidden_of: Any = shared_hidden
) -> Tuple[bool, str]:
    """Whether ``hidden_of(..., top)`` gives the model's hidden states, then the
    model's without its adapters, on a short probe."""
    was_training = model.training
    model.eval()
    try:
        prompts, plens, responses = _probe(vocab)
        got = hidden_of(model, arch, prompts, plens, responses, top)
        policy = hidden_of(model, arch, prompts, plens, responses)
        with adapters_off(model):
            base = hidden_of(model, arch, prompts, plens, responses)
        want = mx.concatenate([policy, base])
        err = _error(got, want)
    except Exception as e:  # a layer loop the twins do not fit
        return False, f"{type(e).__name__}: {e}"
    finally:
        model.train(was_training)
    return _verdict(err, want.dtype, "matches the model with and without its adapters")


def adapted_top(model: nn.Module) -> Tuple[int, str]:
    """``(k, why)``: every trained weight lies in adapters of the top ``k`` layers
    and none below, so the base model's lower layers are the policy's; ``k`` is
    0 (with the reason) when the model does not split so."""
    layers = list(model.layers)
    index = {id(layer): i for i, layer in enumerate(layers)}
    owner, adapters = {}, []
    for path, module in model.named_modules():
        if id(module) in index:
            owner[path] = index[id(module)]
        if "lora_a" in module:
            adapters.append(path)
    if not adapters:
        return 0, "no adapters: the trained weights are the reference's own"
    trained = [k for k, _ in tree_flatten(model.trainable_parameters())]
    outside = [k for k in trained if not any(k.startswith(a + ".") for a in adapters)]
    if outside:
        return 0, f"weights outside the adapters are trained ({outside[0]})"
    where = []
    for a in adapters:
        at = [i for p, i in owner.items() if a.startswith(p + ".")]
        if not at:
            return 0, f"an adapter outside the layers ({a})"
        where.append(at[0])
    top = len(layers) - min(where)
    if top == len(layers):
        return 0, "adapters on every layer"
    return top, f"adapters on the top {top} of {len(layers)} layers"


def _dense_size(module):
    """Weights a token multiplies by (a quantized matrix counted unpacked)."""
    n = 0
    for _, m in module.named_modules():
        w = m.get("weight")
        if isinstance(w, mx.array) and w.ndim == 2:
            n += w.size * (32 // m.bits if "scales" in m else 1)
    return n


def reference_share(model: nn.Module, vocab: int, top: int) -> float:
    """About what the reference in the step costs against a forward: the top
    ``top`` layers and the head (``vocab`` x hidden) against all layers and the head."""
    layer = _dense_size(model.layers[0])  # a lower layer: no adapters
    hidden = mx.zeros((1, 1), mx.int32)
    _, arch = backbone.resolve(model)
    head = vocab * arch.hidden(model, hidden).shape[-1]
    return (top * layer + head) / (len(model.layers) * layer + head)
