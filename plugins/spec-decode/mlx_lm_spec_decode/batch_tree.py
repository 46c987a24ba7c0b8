"""Token trees in the batched server: each row's drafted alternatives fill
the verify window that the batch pays for anyway.

A batched round verifies ``[B, W]`` windows, W set by the controller from
the rows' chains (``batch_verify.BatchController``). A row whose chain is
shorter than ``W - 1`` would feed padding in the rest of its window: with a
tree drafter (``draft_tree``: n-gram, suffix) those slots carry the row's
next most likely nodes instead (by estimated acceptance: the drafter's
share of the node times the row's acceptance per level, a parent before its
children). A branch therefore costs the batch nothing it was not already
paying; a row with nothing else to propose keeps its chain.

The forward is ``tree.batch_forward``, the one tree forward of both drivers
(a request is B = 1): mlx-lm's batched forward with two things swapped for
its duration:

- rope: row b's node j sits at ``offset[b] + depth[b][j]`` (the nodes move
  into the batch axis, where mlx-lm's rope takes one offset per row);
- attention: node j of row b sees the cache and its own ancestors (the
  batch's mask, itself ragged, and an ancestor mask over the window).

Acceptance follows each row's target down its tree (``batch_verify.verify``,
the rules of ``sampling.accept``: greedy, the request's own sampler, or
recursive rejection over siblings at temperature > 0), and ``ragged.RaggedKVCache.gather_window``
moves the accepted path's entries to the front of the row's window before
the usual ragged rollback drops the rest.
"""

import logging
import weakref
from typing import Any, List, Tuple

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from mlx_lm_ext import api as host

from . import tree as tree_mod

log = logging.getLogger("mlx_lm_spec_decode")


class RowTree:
    """One row's drafted trie: ``tokens``/``parents`` (root = the pending
    token, unset here), each node's estimated acceptance, and its chain."""

    def __init__(self, paths: List[Tuple[List[int], float]], alpha: float, room: int):
        self.tokens, self.parents, shares = tree_mod.trie(paths)
        self.probs = tree_mod.estimates(self.parents, shares, alpha)
        chain = tree_mod.select(self.parents, self.probs, room, None)
        self.chain = [self.tokens[i] for i in chain[1:]]

    def fill(self, width: int) -> Tuple[List[int], List[int]]:
        """The ``width - 1`` most likely nodes (closed under parents), as
        ``(drafted tokens, parents)`` with the root at index 0 of parents."""
        order = sorted(range(1, len(self.parents)), key=lambda i: (-self.probs[i], i))
        keep = {0}
        for i in order:
            if len(keep) >= width:
                break
            if self.parents[i] in keep and self.probs[i] > 0:
                keep.add(i)
        tokens, parents = tree_mod.subtree(self.tokens, self.parents, sorted(keep))
        return tokens[1:], parents


# ------------------------------------------------- does this model fit

_CHECKED: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def tree_ok(model: Any) -> bool:
    """Whether a batched tree forward of ``model`` equals chain forwards over
    its paths (checked once per loaded model: two rows, one left-padded)."""
    try:
        return _CHECKED[model]
    except KeyError:
        pass
    except TypeError:
        return _check(model)
    ok = _CHECKED[model] = _check(model)
    if not ok:
        log.info(
            "spec-decode: this model's attention does not take a batched token tree; "
            "the batched server drafts chains"
        )
    return ok


def _check(model: Any) -> bool:
    if not host.rope_modules(model):
        return False
    prompts = [[1, 2, 3, 4], [7, 3]]
    windows = [[5, 9, 6, 8, 7, 3], [4, 6, 2, 0, 0, 0]]
    parents = [[-1, 0, 0, 2, 2, 1], [-1, 0, 1, 2, 3, 4]]
    try:
        caches = _batch_cache(model, prompts)
        logits = tree_mod.batch_forward(model, caches, windows, parents, "fused")
        for b, leaf in ((0, 4), (0, 5), (1, 2)):
            path = tree_mod.path_to(parents[b], leaf)
            seq = prompts[b] + [windows[b][i] for i in path]
            ref = model(mx.array(seq, mx.uint32)[None])[0, len(prompts[b]) :]
            got = logits[b][mx.array(path)]
            scale = mx.abs(ref).max().item() + 1e-6
            if mx.abs(got - ref).max().item() > 1e-2 * scale:
                return False
        return True
    except Exception as e:  # an architecture the tree forward cannot run: chains
        log.debug(f"spec-decode: batched tree check failed: {e}")
        return False


def _batch_cache(model: Any, prompts: List[List[int]]) -> List[BatchKVCache]:
    """A batch cache holding ``prompts`` left-padded, as mlx-lm's batching does."""
    n = max(len(p) for p in prompts)
    pad = [n - len(p) for p in prompts]
    caches = [BatchKVCache(pad) for _ in make_prompt_cache(model)]
    model(
        mx.array([[0] * k + p for k, p in zip(pad, prompts, strict=True)], mx.uint32), cache=caches
    )
    return caches
