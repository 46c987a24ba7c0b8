"""The drafter protocol: what the verify loop asks of a drafter.

A drafter proposes tokens that the target model then verifies in one forward
pass. The loop (``loop.speculative_generate_step``) owns the target model and
its caches; a drafter owns only its own state, kept in the caches it makes,
which ride along in the prompt cache list after the target's (as mlx-lm lays
out a draft model's caches), so a server prompt cache stores and restores them
with the target's.

The history a drafter sees is the token sequence the target has consumed or
emitted in this prompt cache: the cached prefix (as far as the drafter's own
caches remember it), then ``prefill(ctx, prompt)``, then every
``accept(ctx, tokens, n_drafted)``. A drafter must keep that history exactly:

- ``make_cache() -> list``: fresh drafter caches (may be ``[]``). Each must be
  trimmable (``is_trimmable``/``trim``) and deep-copyable, and report
  ``nbytes``: the server's LRU prompt cache copies, trims and sizes them.
- ``cache_ok(caches) -> bool``: whether ``caches`` (from a restored prompt
  cache) are this drafter's; if not, the loop makes fresh ones in place.
- ``prefill(ctx, tokens)``: extend the history by the prompt tokens.
- ``draft(ctx, n) -> (tokens, probs)``: propose up to ``n`` tokens that
  continue the history (fewer, even none, is fine). ``probs`` is ``None``
  when the proposal is deterministic, else a ``[len(tokens), V]`` array: the
  distribution each token was sampled from (used by the lossless acceptance
  rule at temperature > 0). Drafting must not change the history.
- ``accept(ctx, tokens, n_drafted)``: the target emitted ``tokens``; the first
  ``n_drafted`` of them are the drafter's own proposals from the last
  ``draft`` call, in order. Roll back anything speculative beyond them.
- ``trim(ctx, n)``: drop the last ``n`` tokens of the history (the consumer
  stopped before taking all accepted tokens).
- ``flush(ctx)``: make the caches hold the whole history (a drafter may
  defer work, e.g. a draft model feeds its last tokens on the next draft).
  Called when the generator closes, so a stored prompt cache is exact.

``ctx`` is a ``DraftContext``: the target model, the target's caches, the
drafter's caches, the sampling temperature and filters (``ctx.filter``), and,
for drafters that set ``needs_hidden = True``, ``ctx.hidden``: the target's
final hidden state (before the lm-head, ``[1, D]``) at the position that
produced the last emitted token (after the prefill: the last prompt position
but one, whose state predicts the pending last prompt token; ``None`` for a
one-token prompt). That, with read access to
``ctx.target_cache``, is what a KV-borrowing assistant drafter needs.

Class attributes: ``name`` (shown in stats), ``max_draft`` (upper bound for
the adaptive draft length), ``needs_hidden``, ``adaptive`` and ``auto_off``
(the loop's draft-length adaptation and measured switch-off, both on by
default), ``sizes_drafts`` (the loop asks for up to ``max_draft`` tokens
and the drafter chooses each draft's length, e.g. from its confidence and
``ctx.verify_cost``; ``ctx.draft_cost`` is what one of its drafted tokens
cost, in plain steps, where it computes them), and ``batches``: whether the server's batched path may run it,
one ``DraftContext`` per row with ``target_cache`` ``None`` and no
``hidden`` (a drafter that reads neither, and proposes without ``probs``).

Optional: ``draft_after(ctx, kept, token, hidden, pos, n)`` for a drafter
that drafts from the device's own state (the assistant): the loop calls it
right after queuing a greedy verify, before reading it, with that round's
outcome as lazy arrays (``kept`` drafts held, the target's ``token`` after
them, the ``hidden`` state that produced it, the cache length ``pos`` once
the rejected entries are cut), so the device runs the next round's draft
steps behind the verify. The drafter returns the lazy drafts (or None) and
proposes them from its next ``draft`` if ``accept`` is told of exactly
that round.

Optional: ``draft_tree(ctx, n) -> [(path, weight), ...]`` for a drafter
with ``tree = True``: about ``n`` nodes of a token tree as weighted paths
(``tree.trie`` merges them; a node's share of the weight estimates how
often the text goes through it), which the loop verifies in one forward
where that pays (``tree_verify``). ``accept`` then gets the accepted path.
A tree that mixes free nodes with computed ones (``LookupFirst``) sets
``ctx.computed`` to the number it computed, which the loop times.

Optional: ``guess(ctx, n) -> list of ids`` for a drafter that computes but
also proposes for free (``LookupFirst``: its lookup's proposal): while
drafting is switched off the loop scores these guesses against the emitted
tokens, as it does a free drafter's own drafts, and resumes drafting where
they hold; such a drafter prices its computed drafts itself, so the loop
never switches drafting off for good for their cost.

``DrafterProtocol`` states this contract for type checkers; ``Drafter`` is a
base class that meets it by proposing nothing, to subclass.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Protocol, runtime_checkable

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache


@dataclass
class DraftContext:
    model: Any
    target_cache: list
    cache: list
    temp: float = 0.0
    # logprobs -> filtered logprobs (top-p/top-k/min-p), or None
    filter: Optional[Callable] = None
    hidden: Any = None
    # (a, b): a verify over w tokens costs about a + b * w plain steps, as
    # measured by the loop, or by the server at the row's batch size (None:
    # not yet)
    verify_cost: Optional[tuple] = None
    # plain steps a drafted token of a computing drafter costs (None: not timed)
    draft_cost: Optional[float] = None
    # set by a ``draft_tree`` whose tree mixes free nodes (a lookup's) with
    # computed ones: how many it computed (None: every node, or none for a
    # drafter that computes nothing)
    computed: Optional[int] = None
    # per-request scratch space for the drafter (pending tokens etc.)
    state: dict = field(default_factory=dict)


@runtime_checkable
class DrafterProtocol(Protocol):
    """What the verify loop asks of a drafter (see the module docstring)."""

    name: str
    max_draft: int
    needs_hidden: bool
    adaptive: bool
    auto_off: bool

    def make_cache(self) -> List[Any]: ...

    def cache_ok(self, caches: List[Any]) -> bool: ...

    def prefill(self, ctx: DraftContext, tokens: List[int]) -> None: ...

    def draft(self, ctx: DraftContext, n: int) -> "tuple[Any, Optional[Any]]": ...

    def accept(self, ctx: DraftContext, tokens: List[int], n_drafted: int) -> None: ...

    def trim(self, ctx: DraftContext, n: int) -> None: ...

    def flush(self, ctx: DraftContext) -> None: ...


class Drafter:
    """Base class: a stateless drafter that never proposes anything."""

    name = "drafter"
    max_draft = 8
    needs_hidden = False
    adaptive = True  # let the loop adapt the draft length
    auto_off = True  # let the loop switch drafting off when it measures slower
    batches = False  # the server's batched path may run it (one context per row)
    sizes_drafts = False  # asked for up to max_draft tokens; sizes each draft itself

    def make_cache(self) -> List[Any]:
        return []

    def cache_ok(self, caches: List[Any]) -> bool:
        return len(caches) == len(self.make_cache())

    def prefill(self, ctx: DraftContext, tokens: List[int]) -> None:
        pass

    def draft(self, ctx: DraftContext, n: int) -> "tuple[Any, Optional[Any]]":
        return [], None

    def accept(self, ctx: DraftContext, tokens: List[int], n_drafted: int) -> None:
        pass

    def trim(self, ctx: DraftContext, n: int) -> None:
        pass

    def flush(self, ctx: DraftContext) -> None:
        pass


class TokenHistory(_BaseCache):
    """A drafter's cache that is a token history plus an index ``extend`` builds.

    It rides in the prompt cache after the model's caches; mlx-lm's cache
    interface and the stored state (the history as int32) follow from the
    history alone. Subclasses define ``reset`` (empty history and index),
    ``extend`` and ``trim``.
    """

    tokens: List[int]

    def reset(self) -> None:
        raise NotImplementedError

    def extend(self, tokens: List[int]) -> None:
        raise NotImplementedError

    @property
    def offset(self) -> int:
        return len(self.tokens)

    def size(self) -> int:
        return len(self.tokens)

    def empty(self) -> bool:
        return not self.tokens

    def is_trimmable(self) -> bool:
        return True

    @property
    def state(self) -> mx.array:
        return mx.array(self.tokens, dtype=mx.int32)

    @state.setter
    def state(self, v: Any) -> None:
        self.reset()
        self.extend(v.tolist() if isinstance(v, mx.array) else v)

    @staticmethod
    def check_history(state: Any, what: str) -> None:
        """A stored history may come from an untrusted file: one int32 row only."""
        if isinstance(state, mx.array) and (state.ndim != 1 or state.dtype != mx.int32):
            raise ValueError(f"{what} history of shape {state.shape} and {state.dtype}")
