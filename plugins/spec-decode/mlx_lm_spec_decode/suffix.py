"""Suffix drafting: propose what followed the current suffix in this request
and in the past requests of this process for this model.

Two sources, both searched the same way (hash chains, as zlib finds its
matches): every position is indexed by the ``K`` tokens before it, and each
entry points to the previous position with the same key, so a lookup walks
the occurrences of the current ``K``-gram newest first, extends each match
backwards token by token, and keeps the longest. The work per lookup is
O(match length) per occurrence with at most ``CHAIN`` occurrences walked:
independent of how much text is indexed. Plain dicts, lists and numpy
arrays: in Python a hash lookup and a few list reads are the cheapest
operations there are, where a suffix tree or automaton would cost a Python
object per node (hundreds of bytes a token) and cannot forget old text.

- The request (``SuffixCache``): the history of this prompt cache, exact
  under ``trim`` (each key's previous head is on the chain). It rides in the
  prompt cache list, as the n-gram drafter's ``NGramCache`` does.
- The corpus (``SuffixCorpus``): past prompts and outputs in a ring of
  ``cap`` tokens (numpy), a fixed bucket table and a chain array: about 20
  bytes per token of capacity, allocated on first use. New text overwrites
  the oldest, so the corpus never holds more than ``cap`` tokens. A request
  goes in when it ends (the loop's ``flush``), never per token.

Scoring (``scoring``): the occurrences that match longest continue the
draft, each token weighted by the share of them that agree; the drafter
keeps as much of it as its measured acceptance and the verify cost say
pays (long when the sources agree and have been right, nothing when not).
"""

import hashlib
import logging
import weakref
from typing import Any, Callable, Optional

import numpy as np

from . import corpus_store
from .drafter import DraftContext, Drafter, TokenHistory
from .scoring import continuations, draft_length, walk

log = logging.getLogger("mlx_lm_spec_decode")

SEP = -(1 << 31)  # between documents in the corpus: never a token id
CHAIN = 32  # occurrences walked per lookup (the newest)
MAX_MATCH = 64  # a match is extended backwards at most this far
DEFAULT_CORPUS_TOKENS = 1_000_000

_M64 = (1 << 64) - 1
_P = 0x100000001B3  # FNV prime: the rolling multiplier
_MIX = 0x9E3779B97F4A7C15


# ----------------------------------------------------------- shared lookup


def _match_len(at: Callable[[int], int], p: int, ctx: list[int], lo: int) -> int:
    """How many tokens before position ``p`` equal the end of ``ctx`` (``at``
    reads the source; nothing below ``lo``)."""
    n, m = len(ctx), 0
    limit = min(MAX_MATCH, n, p - lo)
    while m < limit and at(p - 1 - m) == ctx[n - 1 - m]:
        m += 1
    return m


# ------------------------------------------------------------ the request


class SuffixCache(TokenHistory):
    """One request's token history and its chains: ``head[key]`` is the
    newest position whose ``K`` preceding tokens are ``key``, ``prev[pos]``
    the one before it (``-1``: none)."""

    def __init__(self, k: int = 2):
        if k < 1:
            raise ValueError(f"suffix key length must be >= 1, got {k}")
        self.k = k
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.prev: list[int] = []
        self.head: dict[tuple, int] = {}

    def extend(self, tokens: list[int]) -> None:
        toks, prev, head, k = self.tokens, self.prev, self.head, self.k
        for t in tokens:
            i = len(toks)
            if i >= k:
                key = tuple(toks[i - k : i])
                prev.append(head.get(key, -1))
                head[key] = i
            else:
                prev.append(-1)
            toks.append(int(t))

    def candidates(self) -> list[tuple[int, int]]:
        """``(match length, position after it)`` of the newest occurrences
        of the history's own suffix."""
        toks, k = self.tokens, self.k
        if len(toks) < k:
            return []
        p = self.head.get(tuple(toks[-k:]), -1)
        at = toks.__getitem__
        out = []
        while p >= 0 and len(out) < CHAIN:
            out.append((_match_len(at, p, toks, 0), p))
            p = self.prev[p]
        return out

    def follow(self, q: int) -> Optional[int]:
        return self.tokens[q] if q < len(self.tokens) else None

    # -- mlx-lm cache interface (trim, copy, size, save) -----------------------
    def trim(self, n: int) -> int:
        n = min(n, len(self.tokens))
        toks, prev, head, k = self.tokens, self.prev, self.head, self.k
        for _ in range(n):
            toks.pop()
            i, old = len(toks), prev.pop()
            if i >= k:
                key = tuple(toks[i - k : i])
                if old < 0:
                    del head[key]
                else:
                    head[key] = old
        return n

    @property
    def nbytes(self):
        return 4 * len(self.tokens) * 3  # ids, chain links, keys: the data, not Python's objects

    @property
    def meta_state(self):
        return (str(self.k),)

    @meta_state.setter
    def meta_state(self, v):
        self.k = int(v[0])

    MAX_K = 64  # a stored cache may come from an untrusted file: bound its work

    @classmethod
    def from_state(cls, state, meta_state=("2",)):
        k = int(meta_state[0])
        if not 1 <= k <= cls.MAX_K:
            raise ValueError(f"suffix key length {k} is out of 1..{cls.MAX_K}")
        cls.check_history(state, "suffix")
        obj = cls(k)
        obj.state = state
        return obj


# ------------------------------------------------------------- the corpus


def _key_hash(tokens: list[int]) -> int:
    h = 0
    for t in tokens:
        h = (h * _P + (t & 0xFFFFFFFF)) & _M64
    h ^= h >> 29
    return (h * _MIX) & _M64


def _key_hashes(toks: np.ndarray, k: int) -> np.ndarray:
    """``_key_hash`` of every ``k`` consecutive tokens, vectorized (uint64 wraps
    as the Python version masks)."""
    u = toks.astype(np.uint32).astype(np.uint64)
    n = len(u) - k + 1
    h = np.zeros(n, np.uint64)
    with np.errstate(over="ignore"):
        for i in range(k):
            h = h * np.uint64(_P) + u[i : i + n]
        h ^= h >> np.uint64(29)
        return h * np.uint64(_MIX)


class SuffixCorpus:
    """Past prompts and outputs, at most ``cap`` tokens, oldest overwritten
    first. Positions are global (they only grow); position ``g`` lives in
    slot ``g % cap`` while ``g >= end - cap``."""

    SEP = SEP

    # k = 3: on the replayed agent workload 3 drafted better than 4 or 6
    # (benchmarks/results/spec-decode-suffix-cpu.md): a skeleton's short spans count.
    def __init__(self, cap: int = DEFAULT_CORPUS_TOKENS, k: int = 3):
        if cap < 2 or k < 1:
            raise ValueError(f"need a corpus of at least 2 tokens and k >= 1, got {cap}, {k}")
        self.cap, self.k = cap, k
        self.bits = max(4, (cap - 1).bit_length())  # >= cap buckets
        self.after_add: Optional[Callable[[], None]] = None  # corpus_store: save when due
        self.reset()

    def reset(self) -> None:
        self.end = 0  # the next global position
        self.docs = 0
        self.toks: Optional[np.ndarray] = None  # allocated on first add

    def _alloc(self):
        self.toks = np.full(self.cap, SEP, np.int32)
        self.prev = np.full(self.cap, -1, np.int64)
        self.head = np.full(1 << self.bits, -1, np.int64)

    def __len__(self) -> int:
        """Tokens held (separators included)."""
        return min(self.end, self.cap)

    @property
    def base(self) -> int:
        return max(0, self.end - self.cap)

    @property
    def nbytes(self) -> int:
        if self.toks is None:
            return 0
        return self.toks.nbytes + self.prev.nbytes + self.head.nbytes

    def add(self, tokens: list[int]) -> None:
        """Append a document (a separator first), overwriting the oldest text."""
        doc = np.asarray(tokens, np.int64)[-(self.cap - 1) :]
        if len(doc) == 0:
            return
        if self.toks is None:
            self._alloc()
        start = self.end + 1
        pos = np.arange(start - 1, start + len(doc))
        self.toks[pos % self.cap] = np.concatenate([[SEP], doc]).astype(np.int32)
        self.end = start + len(doc)
        self.docs += 1
        if len(doc) > self.k:
            self._index(doc, start)
        if self.after_add is not None:
            self.after_add()

    def tokens_in_order(self) -> np.ndarray:
        """The tokens held, oldest first (a separator before each document)."""
        if self.toks is None:
            return np.zeros(0, np.int32)
        return self.toks[np.arange(self.base, self.end) % self.cap]

    def _index(self, doc, start):
        # Position start+i+k follows doc[i:i+k]; same bucket: chain newest first.
        buckets = (_key_hashes(doc[:-1], self.k) >> np.uint64(64 - self.bits)).astype(np.int64)
        gs = start + self.k + np.arange(len(buckets))
        order = np.argsort(buckets, kind="stable")
        b, g = buckets[order], gs[order]
        first = np.ones(len(b), bool)
        first[1:] = b[1:] != b[:-1]
        prev = np.empty_like(g)
        prev[1:] = g[:-1]
        prev[first] = self.head[b[first]]
        self.prev[g % self.cap] = prev
        last = np.ones(len(b), bool)
        last[:-1] = b[:-1] != b[1:]
        self.head[b[last]] = g[last]

    def _at(self, g: int) -> int:
        return int(self.toks[g % self.cap])

    def follow(self, g: int) -> Optional[int]:
        if g >= self.end:
            return None
        t = self._at(g)
        return None if t == SEP else t

    def candidates(self, ctx: list[int]) -> list[tuple[int, int]]:
        """``(match length, position after it)`` of the newest occurrences of
        the end of ``ctx`` (at least ``k`` tokens long)."""
        if self.toks is None or len(ctx) < self.k:
            return []
        b = _key_hash(ctx[-self.k :]) >> (64 - self.bits)
        p, base, out, walked = int(self.head[b]), self.base, [], 0
        while p >= base and walked < CHAIN:
            walked += 1
            m = _match_len(self._at, p, ctx, base)
            if m >= self.k:  # a bucket may hold other keys
                out.append((m, p))
            p = int(self.prev[p % self.cap])
        return out


# ---------------------------------------------- one corpus per model+tokenizer

_CORPORA: dict[tuple, SuffixCorpus] = {}


def tokenizer_key(tokenizer: Any) -> Optional[str]:
    """A fingerprint of a tokenizer's vocabulary (None if it has none)."""
    try:
        items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    except Exception:  # no vocabulary to read: keyed by the vocabulary size
        return None
    return hashlib.sha256(repr(items).encode()).hexdigest()[:16]


def corpus_for(model: Any, tok_key: Any, cap: int, store: Optional[str] = None) -> SuffixCorpus:
    """This process's corpus for ``model`` (the loaded object) and a
    tokenizer; forgotten when the model is. ``store``: a folder where it is
    kept across restarts (``corpus_store``: held and saved until the model
    goes, the plugin is deactivated or the process exits)."""
    key = (id(model), tok_key, cap, store)
    corpus = _CORPORA.get(key)
    if corpus is None:
        corpus = _CORPORA[key] = SuffixCorpus(cap)
        if store is not None:
            corpus_store.attach(corpus, store, model, tok_key)
        try:
            weakref.finalize(model, _forget, key)
        except TypeError:  # not weak-referenceable: kept for the process
            pass
    return corpus


def _forget(key: tuple) -> None:
    corpus = _CORPORA.pop(key, None)
    if corpus is not None:
        corpus_store.detach(corpus)  # saved now; not kept for the exit


def _bucket(m: int) -> int:
    """Match lengths that share a rate: 1..7 each, then 8-15, 16-31, 32+."""
    return m if m < 8 else min(32, 8 << ((m // 8).bit_length() - 1))


# ------------------------------------------------------------ the drafter


class SuffixDrafter(Drafter):
    """Suffix drafting over this request, then this process's past requests.

    The request's own text is searched first (the most specific source); the
    corpus only when the request proposes nothing. Each draft is sized by
    its expected worth: per source and match length (``bucket``) a decayed
    rate of drafted tokens kept (a prior that grows with the match length
    until measured), times each token's share among the occurrences, against
    the loop's measured verify cost. Long where the match is long and has
    been right, nothing where no length beats a plain step (the guess is
    still checked, so a source that starts to fit is heard again).
    """

    name = "suffix"
    batches = True  # per-row state only: the server batches it
    sizes_drafts = True
    ALPHA = 2.0  # draft at most this many times the match length
    MIN_SCORE = 0.3  # stop when the continuation's share falls under this
    DECAY = 0.8
    PRIOR = 2.0  # the prior's weight, in drafted tokens
    # A verify over w tokens costs a + b * w plain steps: this until the
    # loop has measured it (near what a CPU's float32 forward measures),
    # and b is taken at most B_MAX: a measurement taken while other work
    # slowed a verify must not silence the drafter for good (no draft, no
    # new measurement). Where verifies are truly dear, the loop's own
    # switch turns drafting off.
    COST = (0.9, 0.1)
    B_MAX = 0.25
    GAIN = 1.05  # a draft must promise this many tokens per plain step

    def __init__(
        self,
        corpus_tokens: int = DEFAULT_CORPUS_TOKENS,
        tokenizer: Any = None,
        corpus: Optional[SuffixCorpus] = None,
        max_draft: int = 16,
        adaptive: bool = True,
        auto_off: bool = True,
        tree: bool = True,
        corpus_dir: Optional[str] = None,
    ):
        if corpus_tokens < 2:
            raise ValueError(f"corpus_tokens must be >= 2, got {corpus_tokens}")
        if max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {max_draft}")
        self.corpus_tokens, self.max_draft = corpus_tokens, max_draft
        self.adaptive, self.auto_off, self.tree = adaptive, auto_off, tree
        self.corpus = corpus  # fixed; else the process's corpus for the model
        self.corpus_dir = corpus_dir  # where that corpus is kept across restarts
        self.tok_key = tokenizer_key(tokenizer) if tokenizer is not None else None

    def __repr__(self):
        return f"SuffixDrafter(corpus_tokens={self.corpus_tokens}, max_draft={self.max_draft})"

    def corpus_of(self, model: Any) -> SuffixCorpus:
        if self.corpus is not None:
            return self.corpus
        vocab = getattr(getattr(model, "args", None), "vocab_size", None)
        return corpus_for(model, self.tok_key or vocab, self.corpus_tokens, self.corpus_dir)

    def make_cache(self) -> list[Any]:
        return [SuffixCache()]

    def cache_ok(self, caches: list[Any]) -> bool:
        return len(caches) == 1 and isinstance(caches[0], SuffixCache)

    def prefill(self, ctx: DraftContext, tokens: list[int]) -> None:
        cache = ctx.cache[0]
        ctx.state["start"] = len(cache.tokens)  # restored from a prompt cache before it
        ctx.state["corpus"] = self.corpus_of(ctx.model)
        cache.extend(tokens)

    def _length(self, ctx, m, bucket, shares):
        """Tokens worth verifying of a draft resting on a match of ``m``."""
        acc, rej = ctx.state.setdefault("rates", {}).get(bucket, (0.0, 0.0))
        prior = m / (m + 1.5)
        p = (acc + self.PRIOR * prior) / (acc + rej + self.PRIOR)
        a, b = ctx.verify_cost or self.COST
        return draft_length(p, shares, (min(a, 1.0), min(b, self.B_MAX)), self.GAIN)

    def _sources(self, ctx):
        cache = ctx.cache[0]
        yield "request", cache.candidates(), cache.follow, len(cache.tokens)
        corpus = ctx.state.get("corpus")
        corpus = corpus if corpus is not None else self.corpus_of(ctx.model)
        yield "corpus", corpus.candidates(cache.tokens), corpus.follow, None

    def _guess(self, ctx, n):
        """Per source: its bucket, its draft (for ``accept`` to check) and
        how much of it is worth verifying."""
        for source, cands, follow, present in self._sources(ctx):
            tokens, shares, m = walk(cands, follow, n, self.ALPHA, self.MIN_SCORE, present)
            if tokens:
                bucket = (source, _bucket(m))
                ctx.state["guesses"].append((bucket, tokens))
                yield cands, follow, present, tokens, self._length(ctx, m, bucket, shares)

    def draft(self, ctx: DraftContext, n: int) -> tuple[list[int], None]:
        ctx.state["guesses"] = []
        for *_, tokens, g in self._guess(ctx, n):
            if g:
                return tokens[:g], None
        return [], None  # nothing, or nothing worth a verify (checked in accept)

    def draft_tree(self, ctx: DraftContext, n: int) -> list[tuple[list[int], float]]:
        """Every continuation of the longest matches of both sources, each
        as deep as its source's draft is worth (the loop merges them into a
        tree, weighted by frequency)."""
        ctx.state["guesses"] = []
        paths: list[tuple[list[int], float]] = []
        for cands, follow, present, _, g in self._guess(ctx, n):
            if g:
                paths += continuations(cands, follow, g, self.ALPHA, present)
        return paths

    def accept(self, ctx: DraftContext, tokens: list[int], n_drafted: int) -> None:
        # Each source's guess against what the target emitted: tokens kept
        # until the first that differs (a rejection, if within what was seen).
        rates = ctx.state.setdefault("rates", {})
        for bucket, guess in ctx.state.pop("guesses", ()):
            seen = min(len(guess), len(tokens))
            kept = next((i for i in range(seen) if guess[i] != tokens[i]), seen)
            acc, rej = rates.get(bucket, (0.0, 0.0))
            d = self.DECAY
            rates[bucket] = (d * acc + kept, d * rej + (kept < seen))
        ctx.cache[0].extend(tokens)

    def trim(self, ctx: DraftContext, n: int) -> None:
        ctx.cache[0].trim(n)

    def flush(self, ctx: DraftContext) -> None:
        # The end of the request: its text goes into the corpus, once. What
        # a restored prompt cache held came from an earlier request, which
        # added it then: only the new part (with k tokens of context) goes in.
        if "start" not in ctx.state or ctx.state.get("flushed"):
            return
        ctx.state["flushed"] = True
        corpus = ctx.state["corpus"]
        toks = ctx.cache[0].tokens
        corpus.add(toks[max(0, ctx.state["start"] - corpus.k) :])
