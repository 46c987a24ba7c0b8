"""``SSDPromptCache``: mlx-lm's ``LRUPromptCache`` with a disk tier underneath.

In memory it is the stock class: same trie, same eviction order and byte
accounting, because every eviction still goes through ``PromptTrie.pop`` and
the counters of the parent class. The disk tier hooks in at three points:

* ``insert_cache`` hands the new entry to the writer thread (write-behind);
* the trie's ``pop`` (every eviction) hands over an entry that is not on
  disk yet, e.g. one the writer had to skip;
* ``fetch_nearest_cache`` restores from disk when a stored entry covers more
  of the prompt than the best memory entry.

One deliberate difference: mlx-lm returns an exact memory hit with no tokens
left to process, which makes generation raise ("empty prompt"). Here an exact
hit is trimmed by one token (or, if it cannot be trimmed, a shorter entry is
used): at least one token is always left.
"""

import copy
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

from mlx_lm.models.cache import (
    LRUPromptCache,
    PromptTrie,
    can_trim_prompt_cache,
    trim_prompt_cache,
)

from .disk import DiskTier


class _SpillingTrie(PromptTrie):
    """mlx-lm's trie; evictions (``pop``) are reported to the disk tier."""

    def __init__(self, on_pop: Callable[[Any, List[int], Any], None]) -> None:
        super().__init__()
        self._on_pop = on_pop

    def pop(self, model: Any, tokens: List[int]) -> Any:
        value = super().pop(model, tokens)
        self._on_pop(model, tokens, value)
        return value


@dataclass
class _Plan:
    key: Optional[List[int]]  # stored tokens to copy, None for a miss
    length: int  # prompt tokens the copy provides
    trim: int  # tokens to trim off the copy


class SSDPromptCache(LRUPromptCache):
    def __init__(
        self,
        max_size: int = 10,
        max_bytes: int = 1 << 63,
        *,
        directory: Union[str, os.PathLike],
        disk_bytes: int = 8 << 30,
        verify: bool = True,
        writable: bool = True,
        settings: Optional[dict] = None,
        tier: Optional[DiskTier] = None,
        live_models: Optional[Callable[[Any], Optional[List[Any]]]] = None,
        extra_classes: Optional[Callable[[], Iterable[type]]] = None,
    ) -> None:
        super().__init__(max_size, max_bytes)
        self._trie = _SpillingTrie(self._spill)
        self.disk = tier or DiskTier(
            directory,
            disk_bytes,
            verify=verify,
            writable=writable,
            settings=settings,
            live_models=live_models,
            extra_classes=extra_classes,
        )

    # ---------------------------------------------------------------- fetch

    def _memory_plan(self, model, tokens) -> _Plan:
        """What the stock fetch would return, decided without copying."""
        miss = _Plan(None, 0, 0)
        if len(tokens) < 2:
            return miss
        result = self._trie.search(model, tokens)
        if result.exact is not None:
            entry = self._trie.get(model, result.exact)
            if can_trim_prompt_cache(entry.prompt_cache):
                return _Plan(result.exact, len(tokens) - 1, 1)
            result = self._trie.search(model, tokens[:-1])
            if result.exact is not None:
                return _Plan(result.exact, len(tokens) - 1, 0)
        short = len(result.shorter) if result.shorter is not None else 0
        if result.longer is not None and result.common_prefix > short:
            entry = self._trie.get(model, result.longer)
            if can_trim_prompt_cache(entry.prompt_cache):
                prefix = min(len(tokens) - 1, result.common_prefix)
                return _Plan(result.longer, prefix, len(result.longer) - prefix)
        if short > 0:
            return _Plan(result.shorter, short, 0)
        return miss

    def fetch_nearest_cache(
        self, model: Any, tokens: List[int]
    ) -> Tuple[Optional[List[Any]], List[int]]:
        plan = self._memory_plan(model, tokens)
        restored = self.disk.fetch(model, tokens, at_least=plan.length)
        if restored is not None:
            cache, n = restored
            return cache, tokens[n:]
        if plan.key is None:
            return None, tokens
        cache = copy.deepcopy(self._trie.get(model, plan.key).prompt_cache)
        if plan.trim:
            trim_prompt_cache(cache, plan.trim)
        return cache, tokens[plan.length :]

    # --------------------------------------------------------------- insert

    def insert_cache(
        self,
        model: Any,
        tokens: List[int],
        prompt_cache: List[Any],
        *,
        cache_type: str = "assistant",
    ) -> None:
        # Hand over first: the parent may evict this very entry at once.
        self.disk.put(model, tokens, prompt_cache, cache_type)
        super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)

    def _spill(self, model, tokens, entry):
        # Usually a no-op: the entry was written behind when it was inserted.
        self.disk.put(model, tokens, entry.prompt_cache, entry.cache_type, touch=False)

    # ---------------------------------------------------------------- admin

    def disk_stats(self) -> Dict[str, Any]:
        return self.disk.stats()

    def flush(self, timeout: Optional[float] = None) -> bool:
        return self.disk.flush(timeout)

    def close(self, timeout: Optional[float] = None) -> bool:
        return self.disk.close(timeout)
