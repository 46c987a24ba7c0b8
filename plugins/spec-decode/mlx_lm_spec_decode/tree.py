"""Token trees: several drafted continuations verified in one target forward.

A tree is plain data: ``tokens[i]`` and ``parents[i]`` for nodes in
topological order (a parent before its children). Node 0 is the root, the
pending token ``y`` (parent -1); every other node is a drafted token. A
chain is the tree whose every node has at most one child.

The verify forward feeds the nodes in index order. Two things make that
equal to feeding each root-to-leaf path on its own:

- attention: node ``i`` sees the cache and its own ancestors (itself
  included), never its siblings' branches (``ancestors``);
- positions: node ``i`` sits at ``offset + depth[i]``, not ``offset + i``.
  mlx-lm's attention modules rotate queries and keys with
  ``self.rope(x, offset=cache.offset)``; for the tree forward the host swaps
  each module's ``rope`` for one that rotates node ``i`` at its depth (the
  nodes moved into the batch axis, where mlx-lm's rope modules take one
  offset per row, as its batched generation needs).

A model that does not follow that layout is caught by ``tree_ok``: the
first time a model is seen, a small tree forward is compared with chain
forwards over the same paths; where they differ, the request drafts chains.
"""

import contextlib
import logging
import weakref
from typing import Any, Iterator, Optional

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_lm_ext import api as host

from . import target as target_mod

log = logging.getLogger("mlx_lm_spec_decode")

MAX_NODES = target_mod.EXPLICIT_MAX_QUERIES  # the root included


# ------------------------------------------------------------ plain data


def depths(parents: list[int]) -> list[int]:
    out = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def estimates(parents: list[int], shares: list[float], rate: float) -> list[float]:
    """Each node's chance of ending on the accepted path: its share of the
    drafted weight (``trie``) times ``rate`` per level below the root."""
    return [s * rate**d for s, d in zip(shares, depths(parents), strict=True)]


def children(parents: list[int]) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p >= 0:
            out[p].append(i)
    return out


def is_chain(parents: list[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def path_to(parents: list[int], i: int) -> list[int]:
    """Node indices from the root to ``i``."""
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def trie(paths: list[tuple[list[int], float]]) -> tuple[list[int], list[int], list[float]]:
    """Merge weighted drafted paths into a trie under a root: ``(tokens,
    parents, shares)``, the root's token ``-1``; a node's share is the weight
    of the paths through it over all the weight (an estimate of how often
    the text goes that way)."""
    tokens, parents, weight = [-1], [-1], [0.0]
    kids: list[dict[int, int]] = [{}]
    for path, w in paths:
        node = 0
        weight[0] += w
        for t in path:
            nxt = kids[node].get(t)
            if nxt is None:
                nxt = kids[node][t] = len(tokens)
                tokens.append(int(t))
                parents.append(node)
                weight.append(0.0)
                kids.append({})
            weight[nxt] += w
            node = nxt
    total = weight[0] or 1.0
    return tokens, parents, [w / total for w in weight]


def select(
    parents: list[int], probs: list[float], limit: int, cost: Optional[tuple[float, float]]
) -> list[int]:
    """The nodes worth verifying (root first, parents before children).

    ``probs[i]`` estimates the chance node ``i`` ends on the accepted path.
    A verify over ``w`` tokens costs ``a + b * w`` plain steps (``cost``):
    nodes are taken most likely first while one more raises the expected
    tokens per second, i.e. while its probability exceeds ``b`` times the
    tokens per plain step the tree reaches so far. Without a measured cost,
    the most likely path only (a chain), as far as ``limit`` nodes.
    """
    order = sorted(range(1, len(parents)), key=lambda i: (-probs[i], i))
    keep, expect = {0}, 1.0
    if cost is None:
        node = 0
        kids = children(parents)
        while kids[node] and len(keep) <= limit:
            node = max(kids[node], key=lambda c: (probs[c], -c))
            keep.add(node)
        return sorted(keep)
    a, b = cost
    spent = a + b
    for i in order:
        if len(keep) > limit or parents[i] not in keep:
            continue
        if probs[i] <= b * expect / spent:
            break
        keep.add(i)
        expect += probs[i]
        spent += b
    return sorted(keep)


def best_chain(
    parents: list[int], probs: list[float], limit: int, cost: Optional[tuple[float, float]]
) -> list[int]:
    """What ``select`` keeps of the most likely path alone: the chain to
    verify instead of a tree that does not pay."""
    path = set(select(parents, probs, len(parents), None))
    return select(parents, [p if i in path else 0.0 for i, p in enumerate(probs)], limit, cost)


def window_cost(cost: tuple[float, float], width: int) -> float:
    """Plain steps a chain's verify over ``width`` tokens costs, at the
    measured ``cost = (a, b)``: ``a + b * width``."""
    return cost[0] + cost[1] * width


def tree_pays(
    probs: list[float], tree: list[int], chain: list[int], cost: tuple[float, float], extra: float
) -> bool:
    """Whether ``tree`` (node indices, the root included) yields more tokens
    per plain step than ``chain`` when a tree's verify costs ``extra`` plain
    steps more than a chain of its width (``Controller.tree_surcharge``)."""

    def rate(nodes, more):
        return (1.0 + sum(probs[i] for i in nodes if i)) / (window_cost(cost, len(nodes)) + more)

    return rate(tree, extra) > rate(chain, 0.0)


def pad(tokens: list[int], parents: list[int], width: int) -> tuple[list[int], list[int]]:
    """``tokens``/``parents`` padded to ``width`` nodes: a chain of zeros hanging
    off the last node, after every real node, so that none attends to it."""
    n = len(tokens)
    return tokens + [0] * (width - n), parents + list(range(n - 1, width - 1))


def subtree(tokens: list[int], parents: list[int], keep: list[int]) -> tuple[list[int], list[int]]:
    """The kept nodes renumbered (``keep`` sorted, closed under parents)."""
    where = {old: new for new, old in enumerate(keep)}
    return [tokens[i] for i in keep], [where.get(parents[i], -1) for i in keep]


def ancestors(parents: list[int]) -> mx.array:
    """``[n, n]`` boolean: row ``i`` is true at ``i`` and its ancestors."""
    n = len(parents)
    rows = []
    for i in range(n):
        row = [False] * n
        for j in path_to(parents, i):
            row[j] = True
        rows.append(row)
    return mx.array(rows)


def _owner(cls: type, name: str) -> type:
    return next((k for k in cls.__mro__ if name in vars(k)), object)


def drafts_trees(drafter: Any) -> bool:
    """Whether ``drafter`` proposes trees: the option is on, it has
    ``draft_tree`` (not only inherited past a subclass that changed
    ``draft()`` alone: that subclass's chains)."""
    if not getattr(drafter, "tree", False) or not callable(getattr(drafter, "draft_tree", None)):
        return False
    return issubclass(_owner(type(drafter), "draft_tree"), _owner(type(drafter), "draft"))


# ------------------------------------------------------- the tree forward


@contextlib.contextmanager
def attention(model: Any, parents: list[list[int]], policy: str = "fused") -> Iterator[None]:
    """Within the block, a forward of ``model`` over ``[B, W]`` tokens is a
    tree forward per row (``parents[b]``: W entries, a parent before its
    child): row b's node j at position ``offset[b] + depth[b][j]``, seeing
    the cache (as the cache's own mask allows: a batch's left padding and
    holes) and its own ancestors. One request is B = 1 on a plain cache
    (an int offset, no mask array); a batch, mlx-lm's batch caches (one
    offset per row, a mask array). ``policy``: the fused op, matmuls
    (``explicit``), or either over the cache's buffer (``padded``,
    ``buffer``), as ``target`` says."""
    B, W = len(parents), len(parents[0])
    depth = mx.array([depths(p) for p in parents], mx.int32)
    anc = mx.stack([ancestors(p) for p in parents])[:, None]
    positions: dict = {}  # a request's node positions, per cache offset (the same in each layer)

    def rope(orig):
        def rotate(x, offset=0):
            if not (x.ndim == 4 and x.shape[0] == B and x.shape[2] == W):
                return orig(x, offset=offset)
            if isinstance(offset, int):
                if offset not in positions:
                    positions[offset] = (offset + depth).reshape(-1)
                pos = positions[offset]
            elif isinstance(offset, mx.array) and offset.size == B:
                pos = (offset.reshape(B, 1) + depth).reshape(-1)
            else:
                return orig(x, offset=offset)
            if B == 1:  # one request: the nodes into the batch axis as a view, no copy
                return mx.swapaxes(orig(mx.swapaxes(x, 0, 2), offset=pos), 0, 2)
            H, D = x.shape[1], x.shape[3]
            flat = x.transpose(0, 2, 1, 3).reshape(B * W, H, 1, D)
            return orig(flat, offset=pos).reshape(B, W, H, D).transpose(0, 2, 1, 3)

        return rotate

    combined: dict = {}  # one mask per forward and cache length, shared by its layers
    padded: dict = {}  # the same for ``target.padded_attention``

    def sdpa(orig):
        def tree_sdpa(queries, keys, values, cache, scale, mask, sinks=None):
            ours = queries.shape[0] == B and queries.shape[2] == W
            if (
                sinks is not None
                or not ours
                or not (mask is None or isinstance(mask, (str, mx.array)))
            ):
                return orig(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
            s = keys.shape[2]
            key = (id(mask) if isinstance(mask, mx.array) else None, s)
            if key not in combined:
                full = mx.concatenate([mx.ones((B, 1, W, s - W), mx.bool_), anc], axis=-1)
                # A mask array is held with its combination: its id stays its own.
                both = mask & full if isinstance(mask, mx.array) else full
                combined[key] = (mask, both)
            both = combined[key][1]
            if policy in ("padded", "buffer") and s == target_mod.filled(cache):
                # On a GPU: over the cache's buffer, the graphs of a chain of this width.
                out = target_mod.padded_attention(
                    queries, cache, scale, padded, both, policy == "padded"
                )
                if out is not None:
                    return out
            if policy == "fused":
                return orig(queries, keys, values, cache=cache, scale=scale, mask=both)
            return target_mod.explicit_attention(queries, keys, values, scale, both)

        return tree_sdpa

    with host.override_rope(host.rope_modules(model), rope):
        with host.override_attention(model, sdpa):
            yield


def batch_forward(
    model: Any,
    caches: list[Any],
    windows: list[list[int]],
    parents: list[list[int]],
    policy: str,
    split: Optional[tuple] = None,
) -> Any:
    """Logits ``[B, W, V]`` of one tree forward per row (the caches grow by
    W); with ``split`` (``target.split``), ``(logits, final hidden states
    [B, W, D])``, for a drafter that reads them."""
    x = mx.array(windows, mx.uint32)
    with attention(model, parents, policy), target_mod.staged(model, len(windows[0])):
        if split is None:
            return model(x, cache=caches)
        h = split[0](x, caches)
    return split[1](h), h


def forward(
    model: Any,
    cache: list[Any],
    tokens: list[int],
    parents: list[int],
    policy: str,
    split: Optional[tuple] = None,
) -> Any:
    """Logits ``[n, V]`` of one request's tree forward (the caches grow by
    ``n``); with ``split``, ``(logits, hidden states [n, D])``."""
    out = batch_forward(model, cache, [tokens], [parents], policy, split)
    # squeeze, not [0]: an integer index is a gather, a copy on the device.
    return out.squeeze(0) if split is None else (out[0].squeeze(0), out[1].squeeze(0))


# ------------------------------------------------- does this model fit

_CHECKED: dict[int, bool] = {}


def tree_ok(model: Any, policy: str) -> bool:
    """Whether a tree forward of ``model`` equals chain forwards over its
    paths (checked once per loaded model, on a five-token prompt)."""
    key = id(model)
    if key not in _CHECKED:
        _CHECKED[key] = _check(model, policy)
        try:
            weakref.finalize(model, _CHECKED.pop, key, None)
        except TypeError:
            pass
        if not _CHECKED[key]:
            log.info(
                "spec-decode: this model's attention does not take a token tree "
                "(positions or mask differ from chains); drafting chains"
            )
    return _CHECKED[key]


def _check(model, policy):
    if not host.rope_modules(model):
        return False
    prompt, root = [1, 2, 3, 4], 5
    tokens, parents = [root, 9, 6, 8, 7, 3], [-1, 0, 0, 2, 2, 1]
    try:
        cache = make_prompt_cache(model)
        model(mx.array(prompt, mx.uint32)[None], cache=cache)
        tree_logits = forward(model, cache, tokens, parents, policy)
        for leaf in (4, 5):
            path = path_to(parents, leaf)
            ref = make_prompt_cache(model)
            seq = prompt + [tokens[i] for i in path]
            chain = model(mx.array(seq, mx.uint32)[None], cache=ref)[0, len(prompt) :]
            got = tree_logits[mx.array(path)]
            scale = mx.abs(chain).max().item() + 1e-6
            if mx.abs(got - chain).max().item() > 1e-2 * scale:
                return False
        return True
    except Exception as e:  # an architecture the tree forward cannot run: chains
        log.debug(f"spec-decode: tree check failed: {e}")
        return False
