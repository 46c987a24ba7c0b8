"""Find the stored entry that shares the longest prefix with a prompt.

Entries are indexed by hashes of their token prefixes: one at every ``block``
tokens and one at the entry's end. A lookup hashes the prompt's prefixes once
(numpy, O(prompt length)), walks the block boundaries from the deepest down
and checks candidates token by token, so a hash collision costs a comparison,
never a wrong answer. Memory per entry is its tokens plus len/block keys, far
less than a token trie node per token.
"""

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import numpy as np

_P = np.uint64(0x9E3779B97F4A7C15)  # odd multiplier (golden ratio)


def prefix_hashes(tokens: Union[Sequence[int], np.ndarray]) -> np.ndarray:
    """``h[i]`` = hash of ``tokens[:i]`` for i in 0..len (uint64, wrapping).

    A polynomial hash: ``sum(mix(t_j) * P**j)``. It is weak against crafted
    collisions, which only cost a token comparison here.
    """
    t = np.asarray(tokens, dtype=np.int64).astype(np.uint64)
    powers = np.full(len(t), _P, dtype=np.uint64)
    h = np.zeros(len(t) + 1, dtype=np.uint64)
    if len(t):
        powers[0] = 1
        with np.errstate(over="ignore"):
            np.multiply.accumulate(powers, out=powers)
            mixed = (t * np.uint64(0xBF58476D1CE4E5B9) + np.uint64(1)) * powers
            np.cumsum(mixed, out=h[1:])
    return h


def common_length(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@dataclass(eq=False)
class Entry:
    """One stored prompt cache, as the index sees it."""

    name: str  # file name
    tokens: np.ndarray  # int64
    trimmable: bool
    nbytes: int
    recency: float  # file mtime: the byte cap evicts the smallest
    extra: dict = field(default_factory=dict)


@dataclass
class Match:
    entry: Entry
    length: int  # tokens of the prompt the entry provides (after trimming)


class PrefixIndex:
    def __init__(self, block: int = 32) -> None:
        self.block = block
        self._blocks = {}  # (i, h[i]) -> {Entry} for i = block, 2*block, ...
        self._ends = {}  # (len, h[len]) -> {Entry}
        self._end_hashes = {}  # h[len] -> count, for a fast scan of the prompt
        self.entries = {}  # name -> Entry

    def __len__(self):
        return len(self.entries)

    def _keys(self, entry):
        h = prefix_hashes(entry.tokens)
        n = len(entry.tokens)
        blocks = [(i, int(h[i])) for i in range(self.block, n + 1, self.block)]
        return blocks, (n, int(h[n]))

    def add(self, entry: Entry) -> None:
        if entry.name in self.entries:
            self.remove(entry.name)
        self.entries[entry.name] = entry
        blocks, end = self._keys(entry)
        for k in blocks:
            self._blocks.setdefault(k, set()).add(entry)
        self._ends.setdefault(end, set()).add(entry)
        self._end_hashes[end[1]] = self._end_hashes.get(end[1], 0) + 1

    def remove(self, name: str) -> Optional[Entry]:
        entry = self.entries.pop(name, None)
        if entry is None:
            return None
        blocks, end = self._keys(entry)
        for table, keys in ((self._blocks, blocks), (self._ends, [end])):
            for k in keys:
                group = table.get(k)
                if group is not None:
                    group.discard(entry)
                    if not group:
                        del table[k]
        left = self._end_hashes[end[1]] - 1
        if left:
            self._end_hashes[end[1]] = left
        else:
            del self._end_hashes[end[1]]
        return entry

    def prefixes_of(self, tokens: Union[Sequence[int], np.ndarray]) -> List[Entry]:
        """Entries whose tokens are a proper prefix of ``tokens``."""
        tokens = np.asarray(tokens, dtype=np.int64)
        h = prefix_hashes(tokens)
        found = []
        for i, hi in enumerate(h[: len(tokens)].tolist()):
            if hi in self._end_hashes:
                for e in self._ends.get((i, hi), ()):
                    if np.array_equal(e.tokens, tokens[:i]):
                        found.append(e)
        return found

    def best(self, tokens: Union[Sequence[int], np.ndarray], at_least: int = 0) -> Optional[Match]:
        """The entry that gives the most tokens of ``tokens``, leaving one.

        A trimmable entry gives its common prefix with the prompt; any entry
        gives its whole length when it is a prefix of the prompt. Only matches
        longer than ``at_least`` count; ties go to the smallest file.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        n = len(tokens)
        cap = n - 1  # leave at least one token to process
        if cap <= at_least:
            return None
        h = prefix_hashes(tokens)
        best = None

        def offer(entry, length):
            nonlocal best
            if length <= at_least:
                return
            if best is None or (length, -entry.nbytes) > (best.length, -best.entry.nbytes):
                best = Match(entry, length)

        # Trimmable entries: the deepest block boundary one shares with the prompt.
        for i in range((n // self.block) * self.block, 0, -self.block):
            if i + self.block - 1 <= at_least:
                break  # nothing found from here on can beat at_least
            group = self._blocks.get((i, int(h[i])))
            if not group:
                continue
            real = [e for e in group if e.trimmable and np.array_equal(e.tokens[:i], tokens[:i])]
            for e in real:
                offer(e, min(i + common_length(e.tokens[i:], tokens[i:]), cap))
            if real:
                break  # shallower boundaries give fewer than i tokens

        # Entries that are a prefix of the prompt (any cache type, any length).
        hl = h[: cap + 1].tolist()
        for i in range(cap, max(at_least, 0), -1):
            if best is not None and i < best.length:
                break
            if hl[i] not in self._end_hashes:
                continue
            for e in self._ends.get((i, hl[i]), ()):
                if np.array_equal(e.tokens, tokens[:i]):
                    offer(e, i)
        return best
