"""Prompt lookup: propose what followed the last occurrence of the current
suffix in the prompt and the generated text. No model, no forward pass.

The history and its n-gram index live in an ``NGramCache`` that rides in the
prompt cache list, so a server prompt cache restores the lookup table with
the target's KV cache. Appending a token updates the index in O(n_max)
(independent of the history length), proposals cost one dict lookup per
n-gram length, and an undo log makes ``trim`` exact.
"""

from typing import Any

from . import policy
from .drafter import DraftContext, Drafter, TokenHistory


class NGramCache(TokenHistory):
    """Token history plus ``{n-gram: position after its latest occurrence}``."""

    def __init__(self, n_min: int = 2, n_max: int = 4):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {n_min}, {n_max}")
        self.n_min = n_min
        self.n_max = n_max
        self.reset()

    def reset(self) -> None:
        self.tokens = []
        self.index = {}
        # One entry per position: the index values it replaced, for trim().
        self.undo = []

    def extend(self, tokens: list[int]) -> None:
        toks, index, undo = self.tokens, self.index, self.undo
        for t in tokens:
            i = len(toks)
            changes = []
            # n-grams ending just before position i now have a continuation.
            for n in range(self.n_min, min(self.n_max, i) + 1):
                key = tuple(toks[i - n : i])
                changes.append((key, index.get(key)))
                index[key] = i
            toks.append(int(t))
            undo.append(changes)

    def match(self, floor: int = 1):
        """``(n, start)``: the longest suffix seen before (of ``floor``
        tokens or more) and where its continuation starts, or ``(0, None)``."""
        toks = self.tokens
        size = len(toks)
        for n in range(min(self.n_max, size), max(self.n_min, floor) - 1, -1):
            start = self.index.get(tuple(toks[size - n :]))
            if start is not None:
                return n, start
        return 0, None

    def starts(self, n: int, most: int) -> list[int]:
        """Where the continuations of the history's last ``n`` tokens start,
        the latest occurrence first, at most ``most`` of them. Each
        occurrence's undo entry holds the index's value before it: the
        occurrence before."""
        toks = self.tokens
        if not self.n_min <= n <= min(self.n_max, len(toks)):
            return []
        out, start = [], self.index.get(tuple(toks[len(toks) - n :]))
        while start is not None and len(out) < most:
            out.append(start)
            start = self.undo[start][n - self.n_min][1]
        return out

    def copy(self, start, n_tokens):
        # Copy LZ77-style: a match running into the present repeats.
        toks, size, out = self.tokens, len(self.tokens), []
        for k in range(n_tokens):
            src = start + k
            out.append(toks[src] if src < size else out[src - size])
        return out

    def lookup(self, n_tokens: int) -> list[int]:
        """Continue the longest suffix seen before, copying what followed it."""
        n, start = self.match()
        return self.copy(start, n_tokens) if n else []

    # -- mlx-lm cache interface (trim, copy, size, save) -----------------------
    def trim(self, n: int) -> int:
        n = min(n, len(self.tokens))
        for _ in range(n):
            self.tokens.pop()
            for key, old in reversed(self.undo.pop()):
                if old is None:
                    del self.index[key]
                else:
                    self.index[key] = old
        return n

    @property
    def nbytes(self):
        # int32 ids plus one key per indexed n-gram length (an estimate:
        # Python objects are larger, but this is what the data amounts to).
        return 4 * len(self.tokens) * (2 + self.n_max - self.n_min)

    @property
    def meta_state(self):
        return (str(self.n_min), str(self.n_max))

    @meta_state.setter
    def meta_state(self, v):
        self.n_min, self.n_max = int(v[0]), int(v[1])

    MAX_N = 64  # a stored index may come from an untrusted file: bound its work

    @classmethod
    def from_state(cls, state, meta_state=("2", "4")):
        n_min, n_max = int(meta_state[0]), int(meta_state[1])
        if n_max > cls.MAX_N:
            raise ValueError(f"ngram_max {n_max} is over {cls.MAX_N}")
        cls.check_history(state, "n-gram")
        obj = cls(n_min, n_max)
        obj.state = state
        return obj


class NGramDrafter(Drafter):
    """Prompt-lookup drafter: longest n-gram match first, ``n_max`` down to ``n_min``.

    Within a request it keeps, per match length, a decaying count of how often
    the first token it would propose was right, and stays silent for a length
    that is right less than ``MIN_HIT`` of the time: on open text short
    matches mostly guess wrong, and a wrong guess costs a wider verify
    forward. Where the verify's columns cost nothing (a memory-bound
    device) the bar is what a round costs over a plain step, at most
    ``MIN_HIT``: a round about as cheap as a step pays at any hit rate.
    Guesses are checked against the emitted tokens even while a length is
    silent (no model work), so a length that starts to fit (the
    answer starts quoting its input) is heard again.
    """

    name = "ngram"
    batches = True  # per-row state only: the server batches it
    DECAY = 0.8
    MIN_TRIES = 3.0  # decayed tries before a length may be silenced
    MIN_HIT = 0.34
    TREE_MIN = 1  # the shortest context a tree copies after, where columns are free
    OCCURRENCES = 4  # occurrences of each context a tree copies, where columns are free

    def __init__(
        self,
        n_max: int = 4,
        n_min: int = 2,
        max_draft: int = 10,
        adaptive: bool = True,
        auto_off: bool = True,
        tree: bool = True,
    ):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {n_min}, {n_max}")
        if max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {max_draft}")
        self.n_max, self.n_min, self.max_draft = n_max, n_min, max_draft
        self.adaptive, self.auto_off, self.tree = adaptive, auto_off, tree

    def __repr__(self):
        return f"NGramDrafter(n_max={self.n_max}, n_min={self.n_min}, max_draft={self.max_draft})"

    def _indexed(self) -> int:
        """The shortest n-gram the index holds: a tree's contexts go shorter."""
        return min(self.n_min, self.TREE_MIN) if self.tree else self.n_min

    def make_cache(self) -> list[Any]:
        return [NGramCache(self._indexed(), self.n_max)]

    def cache_ok(self, caches: list[Any]) -> bool:
        return (
            len(caches) == 1
            and isinstance(caches[0], NGramCache)
            and (caches[0].n_min, caches[0].n_max) == (self._indexed(), self.n_max)
        )

    def prefill(self, ctx: DraftContext, tokens: list[int]) -> None:
        ctx.cache[0].extend(tokens)

    def draft(self, ctx: DraftContext, n: int) -> tuple[list[int], None]:
        cache = ctx.cache[0]
        length, start = cache.match(self.n_min)
        if not length:
            return [], None
        tokens = cache.copy(start, self._length(ctx, n, length))
        ctx.state["guess"] = (length, tokens[0])
        if self._silent(ctx, length):
            return [], None  # the guess is only checked
        return tokens, None

    def _silent(self, ctx: DraftContext, length: int) -> bool:
        """Whether matches of ``length`` have guessed their first token
        right less often than pays for a round (``_min_hit``) over their
        (decayed) tries this request."""
        tries, right = ctx.state.setdefault("hits", {}).get(length, (0.0, 0.0))
        return tries >= self.MIN_TRIES and right < self._min_hit(ctx) * tries

    def _min_hit(self, ctx: DraftContext) -> float:
        """The hit rate a length needs to be heard: ``MIN_HIT``, or where
        the verify's columns cost nothing (``ctx.verify_cost`` ``a + b·w``
        plain steps, ``b`` about 0) what a round costs over the plain step it
        replaces, ``a - 1``: a round whose first guess is right that often
        yields at least ``1 + (a - 1)`` tokens for its ``a`` steps."""
        cost = ctx.verify_cost
        if not policy.free_columns(cost):
            return self.MIN_HIT
        return min(self.MIN_HIT, max(0.0, cost[0] - 1.0))

    def _length(self, ctx: DraftContext, n: int, length: int) -> int:
        """Tokens to copy after a match of ``length``: a short match is a
        weak guess, so about as many as matched, unless the verify's columns
        cost nothing (``ctx.verify_cost``), where a longer guess only adds
        chances; a full-length match gets the whole draft length."""
        if length >= self.n_max or policy.free_columns(ctx.verify_cost):
            return n
        return min(n, length)

    def draft_tree(self, ctx: DraftContext, n: int) -> list[tuple[list[int], float]]:
        """The continuations of the latest match of each heard length (a
        shorter n-gram may have occurred later, elsewhere). Where the
        verify's columns cost nothing (``ctx.verify_cost``: a memory-bound
        device), also up to ``OCCURRENCES`` earlier ones of each length,
        down to ``TREE_MIN`` tokens of context, and a silent length's once a
        heard one proposes: the window is paid for anyway, and the round
        keeps the longest path that holds. A token tree's paths, a longer
        context's weighted more (it is likelier to go on as before)."""
        cache = ctx.cache[0]
        toks = cache.tokens
        free = policy.free_columns(ctx.verify_cost)
        floor, most = (self._indexed(), self.OCCURRENCES) if free else (self.n_min, 1)
        heard, silent, seen = [], [], set()
        for length in range(min(self.n_max, len(toks)), floor - 1, -1):
            quiet = self._silent(ctx, length)
            for start in cache.starts(length, most):
                if start in seen:
                    continue  # the same occurrence, found with a longer context
                tokens = cache.copy(start, self._length(ctx, n, length))
                if not seen:
                    ctx.state["guess"] = (length, tokens[0])  # the longest: checked in accept
                seen.add(start)
                (silent if quiet else heard).append((tokens, 2.0 ** (length - self.n_max)))
        # A silent length never makes a round (it guesses wrong too often to
        # be worth a wider window), but rides free in one that is made.
        return heard + silent if heard and free else heard

    def accept(self, ctx: DraftContext, tokens: list[int], n_drafted: int) -> None:
        guess = ctx.state.pop("guess", None)
        if guess is not None:
            length, first = guess
            tries, hits = ctx.state["hits"].get(length, (0.0, 0.0))
            ctx.state["hits"][length] = (
                self.DECAY * tries + 1,
                self.DECAY * hits + (tokens[0] == first),
            )
        ctx.cache[0].extend(tokens)

    def trim(self, ctx: DraftContext, n: int) -> None:
        ctx.cache[0].trim(n)
