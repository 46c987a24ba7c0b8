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

Only plain ``BatchKVCache`` layers are converted (``of``); a sliding-window
``BatchRotatingKVCache`` rotates its slots, so a batch with one decodes
without drafts.
"""

from typing import Any, List, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache

# Squeeze the holes out once a row has this many (a gather of the whole cache).
COMPACT_HOLES = 64


class RaggedKVCache(BatchKVCache):
    """``BatchKVCache`` plus ``holes`` (``[B, >= _idx]`` bool, True: masked out)."""

    holes: Optional[mx.array] = None

    @classmethod
    def of(cls, cache: BatchKVCache) -> "RaggedKVCache":
        """The same rows and buffers as ``cache`` (shared, not copied), with no holes."""
        if isinstance(cache, cls):
            return cache
        out = cls.__new__(cls)
        out.__dict__.update(cache.__dict__)
        out.holes = None
        return out

    def _holes(self, n: int) -> mx.array:
        """``holes`` over the first ``n`` slots. The array may be wider than
        ``_idx``: slots past ``_idx`` are never holes, so a plain step reads a
        slice and only every ``step`` slots pays a concatenate."""
        h = self.holes
        if h.shape[1] < n:
            grow = max(n - h.shape[1], self.step)
            h = mx.concatenate([h, mx.zeros((h.shape[0], grow), mx.bool_)], axis=1)
            self.holes = h
        return h[:, :n]

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        mask = super().make_mask(N, return_array=return_array, **kwargs)
        if self.holes is None:
            return mask
        return mask & ~self._holes(self._idx + N)[:, None, None, :]

    def trim(self, n: int) -> int:
        n = super().trim(n)
        if self.holes is not None and n:
            # Trimmed slots are free again: they must not stay holes.
            self.holes = self.holes & (mx.arange(self.holes.shape[1]) < self._idx)
        return n

    def rollback(self, drop: List[int]) -> None:
        """Row i forgets its last ``drop[i]`` entries."""
        common = min(drop)
        if common:
            self.trim(common)
        rest = [d - common for d in drop]
        if not any(rest):
            return
        rest_arr = mx.array(rest)
        self.offset = self.offset - rest_arr
        new = mx.arange(self._idx)[None] >= (self._idx - rest_arr)[:, None]
        self.holes = new if self.holes is None else (self._holes(self._idx) | new)

    def gather_window(self, width: int, order: mx.array) -> None:
        """Reorder each row's last ``width`` entries: slot j takes entry
        ``order[i, j]`` (a token tree's accepted path moves to the front)."""
        s, e = self._idx - width, self._idx
        take = order[:, None, :, None]
        self.keys[..., s:e, :] = mx.take_along_axis(self.keys[..., s:e, :], take, axis=2)
        self.values[..., s:e, :] = mx.take_along_axis(self.values[..., s:e, :], take, axis=2)

    def hole_count(self) -> int:
        if self.holes is None:
            return 0
        return int(self._holes(self._idx).sum(axis=1).max().item())

    def compact(self) -> None:
        """Squeeze the holes out: one gather of the kept entries, left-padded again."""
        if self.holes is None or self.keys is None:
            self.holes = None
            return
        holes = np.array(self._holes(self._idx))
        left = self.left_padding.tolist()
        rows = [np.flatnonzero(~holes[i, left[i] :]) + left[i] for i in range(len(left))]
        length = max(len(r) for r in rows)
        idx = np.zeros((len(rows), length), np.int32)
        for i, r in enumerate(rows):
            if len(r):
                idx[i, length - len(r) :] = r
        take = mx.array(idx)[:, None, :, None]
        self.keys = mx.take_along_axis(self.keys[..., : self._idx, :], take, axis=2)
        self.values = mx.take_along_axis(self.values[..., : self._idx, :], take, axis=2)
        self.left_padding = mx.array([length - len(r) for r in rows])
        self._idx = length
        self.holes = None

    def filter(self, batch_indices: List[int]) -> None:
        holes, before = None, self._idx
        if self.holes is not None and batch_indices:
            holes = self._holes(before)[mx.array(batch_indices, mx.int32)]
        super().filter(batch_indices)
        if holes is not None:
            holes = holes[:, before - self._idx :]
            self.holes = holes if bool(holes.any().item()) else None
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
            h = mx.zeros((rows, idx), mx.bool_) if h is None else h[:, :idx]
            left = self._idx - idx
            if left:
                h = mx.concatenate([mx.zeros((rows, left), mx.bool_), h], axis=1)
            return h

        self.holes = mx.concatenate(
            [padded(mine, n_self, idx_self), padded(theirs, n_other, idx_other)], axis=0
        )

    def extract(self, idx: int) -> KVCache:
        if self.holes is None:
            return super().extract(idx)
        pad = self.left_padding.tolist()[idx]
        keep = np.flatnonzero(~np.array(self._holes(self._idx)[idx, pad:])) + pad
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
    """Every layer's row i forgets its last ``drop[i]`` entries; compact when holey."""
    if not any(drop):
        return
    for c in caches:
        c.rollback(drop)
    if caches[0].holes is not None and caches[0].hole_count() >= COMPACT_HOLES:
        for c in caches:
            c.compact()
