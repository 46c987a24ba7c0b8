"""A batch KV cache whose rows each roll back by their own amount.

After a verify forward over ``[B, W]`` every row of mlx-lm's
``BatchKVCache`` has W new entries, and row i keeps only its first
``1 + a_i``. ``BatchKVCache.trim`` drops the same number from every row, and
``prepare(right_padding=...)`` / ``finalize()`` shift each row with a roll
of the whole buffer (a copy of the cache every round). Here the entries
common to all rows go with ``trim``, and the rest become *holes*: slots the
attention mask hides (``make_mask``) and the row's ``offset`` no longer
counts, so positions (RoPE) stay those of the kept tokens. Nothing is
copied per round; ``compact`` squeezes the holes out once they are many, and
``extract`` (what a finished request hands the prompt cache) gathers only
kept entries, so the stored cache equals mlx-lm's.

The holes live on the host (a NumPy array): every question about them
(how many, which entries a finished row keeps, which rows stay) is
answered without reading the GPU back, which on a GPU would wait for every
queued kernel. The batch's layers move in lockstep (the same tokens enter
each), so the module's ``rollback`` and ``compact`` work out the
bookkeeping once, on the first layer, and hand it to the others: per round
a handful of small ops, not a handful per layer.

``keep`` is the rollback of both drivers: a batch through the above, one
request's plain caches (``keep_plain``: a tree's accepted path gathered
into place, a chain's prefix trimmed).

Only plain ``BatchKVCache`` layers are converted (``of``); a sliding-window
``BatchRotatingKVCache`` rotates its slots, so a batch with one decodes
without drafts.
"""

from typing import Any, List, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache

# Squeeze the holes out once a row has this many (a gather of the whole cache).
COMPACT_HOLES = 64


class RaggedKVCache(BatchKVCache):
    """``BatchKVCache`` plus ``holes`` (``[B, <= _idx]`` bool on the host, True:
    masked out; slots past its width are not holes). Never changed in place:
    layers may share one array."""

    holes: Optional[np.ndarray] = None
    _shown: Optional[Tuple[np.ndarray, mx.array]] = None  # (holes, its device copy)

    @classmethod
    def of(cls, cache: BatchKVCache) -> "RaggedKVCache":
        """The same rows and buffers as ``cache`` (shared, not copied), with no holes."""
        if isinstance(cache, cls):
            return cache
        out = cls.__new__(cls)
        out.__dict__.update(cache.__dict__)
        out.holes = None
        return out

    def _holes(self, n: int) -> np.ndarray:
        """``holes`` over the first ``n`` slots."""
        h = self.holes
        if h.shape[1] >= n:
            return h[:, :n]
        return np.concatenate([h, np.zeros((h.shape[0], n - h.shape[1]), bool)], axis=1)

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        mask = super().make_mask(N, return_array=return_array, **kwargs)
        if self.holes is None:
            return mask
        return mask & ~self._device_holes(self._idx + N)[:, None, None, :]

    def _device_holes(self, n: int) -> mx.array:
        """``holes`` over the first ``n`` slots, on the device. Copied from the
        host once per change of ``holes`` (a rollback, once a round), not per
        step: the plain steps between rounds make their masks on the device,
        as mlx-lm's own are made, padding the slots added since."""
        if self._shown is None or self._shown[0] is not self.holes:
            self._shown = (self.holes, mx.array(self.holes))
        h = self._shown[1]
        w = h.shape[1]
        return h[:, :n] if w >= n else mx.pad(h, [(0, 0), (0, n - w)])

    def trim(self, n: int) -> int:
        n = super().trim(n)
        if self.holes is not None and n:
            # Trimmed slots are free again: they must not stay holes.
            h = self.holes[:, : self._idx]
            self.holes = h if h.any() else None
        return n

    def rollback(self, drop: List[int]) -> None:
        """Row i forgets its last ``drop[i]`` entries."""
        common = min(drop)
        if common:
            self.trim(common)
        rest = np.array([d - common for d in drop])
        if not rest.any():
            return
        # int32 as mlx-lm's own offsets (NumPy's default int64 would promote them).
        self.offset = self.offset - mx.array(rest, mx.int32)
        new = np.arange(self._idx)[None] >= (self._idx - rest)[:, None]
        self.holes = new if self.holes is None else (self._holes(self._idx) | new)

    def gather_window(self, width: int, order: mx.array) -> None:
        """Reorder each row's last ``width`` entries: slot j takes entry
        ``order[i, j]`` (a token tree's accepted path moves to the front)."""
        s, e = self._idx - width, self._idx
        take = order[:, None, :, None]
        self.keys[..., s:e, :] = mx.take_along_axis(self.keys[..., s:e, :], take, axis=2)
        self.values[..., s:e, :] = mx.take_along_axis(self.values[..., s:e, :], take, axis=2)

    def hole_count(self) -> int:
        return 0 if self.holes is None else int(self.holes.sum(axis=1).max())

    def squeeze_plan(self) -> Optional[Tuple[mx.array, mx.array, int]]:
        """What ``compact`` does to every layer: ``(gather indices, left
        padding, length)``, or ``None`` when there are no holes. The indices
        span the whole buffer (slots past ``length`` take any entry: nothing
        reads them), so the buffer keeps its size, and a verify forward's
        attention over it (``target.padded_attention``) its shapes."""
        if self.holes is None or self.keys is None:
            return None
        holes = self._holes(self._idx)
        left = self.left_padding.tolist()
        rows = [np.flatnonzero(~holes[i, left[i] :]) + left[i] for i in range(len(left))]
        length = max(len(r) for r in rows)
        idx = np.zeros((len(rows), self.keys.shape[2]), np.int32)
        for i, r in enumerate(rows):
            if len(r):
                idx[i, length - len(r) : length] = r
        pad = mx.array([length - len(r) for r in rows])
        return mx.array(idx)[:, None, :, None], pad, length

    def squeeze(self, plan: Optional[Tuple[mx.array, mx.array, int]]) -> None:
        """Apply a ``squeeze_plan`` (one gather of the kept entries, left-padded again)."""
        if plan is not None:
            take, self.left_padding, length = plan
            self.keys = mx.take_along_axis(self.keys, take, axis=2)
            self.values = mx.take_along_axis(self.values, take, axis=2)
            self._idx = length
        self.holes = None

    def compact(self) -> None:
        """Squeeze the holes out of this layer."""
        self.squeeze(self.squeeze_plan())

    def filter(self, batch_indices: List[int]) -> None:
        holes, before = None, self._idx
        if self.holes is not None and batch_indices:
            holes = self._holes(before)[batch_indices]
        super().filter(batch_indices)
        if holes is not None:
            holes = holes[:, before - self._idx :]
            self.holes = holes if holes.any() else None
        else:
            self.holes = None

    def extend(self, other: Any) -> None:
        mine = None if self.holes is None else self._holes(self._idx)
        theirs = other._holes(other._idx) if getattr(other, "holes", None) is not None else None
        n_self, n_other = self.offset.shape[0], other.offset.shape[0]
        idx_self, idx_other = self._idx, other._idx
        super().extend(other)
        if mine is None and theirs is None:
            return

        def padded(h, rows, idx):
            h = np.zeros((rows, idx), bool) if h is None else h[:, :idx]
            left = self._idx - idx
            return np.concatenate([np.zeros((rows, left), bool), h], axis=1) if left else h

        self.holes = np.concatenate(
            [padded(mine, n_self, idx_self), padded(theirs, n_other, idx_other)], axis=0
        )

    def extract(self, idx: int) -> KVCache:
        if self.holes is None:
            return super().extract(idx)
        pad = self.left_padding.tolist()[idx]
        keep = np.flatnonzero(~self._holes(self._idx)[idx, pad:]) + pad
        sel = mx.array(keep.astype(np.int32))
        cache = KVCache()
        cache.keys = mx.contiguous(mx.take(self.keys[idx : idx + 1], sel, axis=2))
        cache.values = mx.contiguous(mx.take(self.values[idx : idx + 1], sel, axis=2))
        cache.offset = cache.keys.shape[2]
        return cache


def ragged(caches: List[Any]) -> Optional[List[RaggedKVCache]]:
    """The batch's caches as ``RaggedKVCache`` (same buffers), or ``None`` when
    some layer is not a plain ``BatchKVCache`` (its rows cannot roll back apart)."""
    if not all(type(c) in (BatchKVCache, RaggedKVCache) for c in caches):
        return None
    return [RaggedKVCache.of(c) for c in caches]


def keep_paths(caches: List[RaggedKVCache], width: int, paths: List[List[int]]) -> None:
    """Row i's window entries ``paths[i]`` (window indices, increasing) move
    to the front of its window, in order; the rollback then drops the rest."""
    if all(p == list(range(len(p))) for p in paths):
        return
    order = mx.array([p + [j for j in range(width) if j not in set(p)] for p in paths], mx.int32)
    for c in caches:
        c.gather_window(width, order)


def rollback(caches: List[RaggedKVCache], drop: List[int]) -> None:
    """Every layer's row i forgets its last ``drop[i]`` entries; compact when holey.
    The first layer works the bookkeeping out; the others take it."""
    if not any(drop):
        return
    first = caches[0]
    first.rollback(drop)
    # Sharing the arrays is safe: mlx-lm rebinds a BatchKVCache's offset,
    # never updates it in place (its in-place updates of left_padding are
    # for a prompt batch's fresh caches, before they join this batch).
    for c in caches[1:]:
        c._idx, c.offset, c.holes = first._idx, first.offset, first.holes
    if first.hole_count() >= COMPACT_HOLES:
        plan = first.squeeze_plan()
        for c in caches:
            c.squeeze(plan)


def keep(caches: List[Any], width: int, paths: List[List[int]]) -> None:
    """The one rollback of both drivers: of the last ``width`` entries fed,
    row b keeps ``paths[b]`` (window indices, increasing, 0 first), moved
    to the front in order, and forgets the rest. A batch's caches roll rows
    back apart (``keep_paths``, ``rollback``); one request's plain caches
    are row 0 (``keep_plain``)."""
    if type(caches[0]) in (BatchKVCache, RaggedKVCache):
        keep_paths(caches, width, paths)
        rollback(caches, [width - len(p) for p in paths])
    else:
        keep_plain(caches, width, paths[0])


def keep_plain(caches: List[Any], width: int, path: List[int]) -> None:
    """One request's caches, ``width`` entries fed last, keep ``path``'s
    (a tree's accepted path: gathered into place right after the prefix,
    where their keys are already rotated at the path's depths); a chain's
    prefix is a trim, which every trimmable cache takes."""
    m = len(path)
    if path != list(range(m)):
        start = caches[0].offset - width
        idx = mx.array(path, mx.int32) + start
        for c in caches:
            c.keys[..., start : start + m, :] = c.keys[..., idx, :]
            c.values[..., start : start + m, :] = c.values[..., idx, :]
    if width > m:
        for c in caches:
            c.trim(width - m)
