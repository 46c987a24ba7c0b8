"""The verify loop: a drop-in for ``mlx_lm.generate.speculative_generate_step``.

Each round the drafter proposes up to γ tokens; the target runs one forward
over ``[y, d1..dk]`` (one batched lm-head matmul inside the model); the
acceptance rule (``sampling``) keeps the longest acceptable prefix and adds
the target's own token; the target cache is trimmed back to exactly the
kept tokens and the drafter is told what was kept.

Differences from mlx-lm's loop, each on purpose:

- On close the target cache holds exactly prompt + yielded tokens, whatever
  stopped the consumer (mlx-lm leaves it one short after a target token).
- Trimmability is checked every round: a ``RotatingKVCache`` is verified only
  while the window still fits, and a cache that cannot be rolled back
  (past the window, ``ArraysCache``) switches the request to plain decoding
  with one warning instead of silently diverging.
- Missing or foreign drafter caches in a restored prompt cache are rebuilt in
  place (the caller's list gets them), not an ``IndexError``.
- γ adapts to the running acceptance, and drafting is switched off (with
  doubling back-off) while it measures slower than plain decoding
  (``controller``: the batch's ``policy.Policy`` at one row).

One request is one ``VerifyLoop``: ``prefill`` (the prompt into the target's
cache), ``rounds`` (draft and verify, or plain steps), ``settle`` (caches
left holding exactly what was yielded, whatever stopped the consumer).
"""

import logging
import time
import weakref
from typing import Any, Callable, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream, maybe_quantize_kv_cache
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from . import policy, ragged, sampling, tree_verify
from . import stats as stats_mod
from . import target as target_mod
from .controller import Controller
from .drafter import DraftContext, DrafterProtocol
from .policy import resume_watch

log = logging.getLogger("mlx_lm_spec_decode")

Step = tuple[int, mx.array, bool]  # (token, logprobs [V], from_draft)


# Drafting rounds in a row with nothing proposed before plain steps come in
# runs (a free drafter's from the first miss where steps are pipelined):
# a copy's short gaps (a renamed word) stay single steps.
MISS_RUN = 4


# Per drafter: its target (a weak reference), the widths its windows were
# padded to and what its last request timed (``Controller.timings``); the
# next request of the same pair starts from it (``Controller.carry``).
_TIMINGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# Per target (by id: a module is not hashable; forgotten with it): the round
# shapes (fed width, tree) it has verified in this process. The first of
# each built its kernels and graphs (on a GPU, several plain steps): priced
# on those rounds, a verify looked too dear to ever pay, and the verdict,
# carried, kept drafting off for every later request.
_BUILT: dict[int, set] = {}


def _built_shapes(model: nn.Module) -> set:
    """The round shapes ``model`` has verified in this process (``_BUILT``)."""
    key = id(model)
    if key not in _BUILT:
        _BUILT[key] = set()
        try:
            weakref.finalize(model, _BUILT.pop, key, None)
        except TypeError:  # not weak-referenceable: kept for the process
            pass
    return _BUILT[key]


def n_target_caches(model: nn.Module) -> int:
    return len(model.make_cache()) if hasattr(model, "make_cache") else len(model.layers)


def window_room(caches: list[Any]) -> int:
    """How many tokens a forward may add and still be rolled back exactly."""
    room = 1 << 30
    for c in caches:
        if isinstance(c, RotatingKVCache):
            # trim() needs offset < max_size after the forward (is_trimmable).
            room = min(room, c.max_size - c.offset - 1)
        elif not c.is_trimmable():
            return 0
    return room


def _offset(caches):
    for c in caches:
        off = getattr(c, "offset", None)
        if isinstance(off, int):
            return off
    return None


def speculative_generate_step(
    prompt: Any,
    model: nn.Module,
    drafter: DrafterProtocol,
    stream: Any = generation_stream,
    *,
    num_draft_tokens: int = 2,
    max_tokens: int = 256,
    sampler: Optional[Callable] = None,
    logits_processors: Optional[list[Callable]] = None,
    prompt_cache: Optional[list[Any]] = None,
    prefill_step_size: int = 512,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 5000,
) -> Iterator[Step]:
    """Yield ``(token, logprobs[V], from_draft)`` as mlx-lm's speculative loop does."""
    # Built inside the generator: as in mlx-lm, nothing runs before the first next().
    loop = VerifyLoop(
        prompt,
        model,
        drafter,
        num_draft_tokens=num_draft_tokens,
        max_tokens=max_tokens,
        sampler=sampler,
        logits_processors=logits_processors,
        prompt_cache=prompt_cache,
        prefill_step_size=prefill_step_size,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
    )
    yield from loop.run(stream)


class VerifyLoop:
    """One request's decoding: the target, its caches, the drafter and the
    figures, from the prompt to the last token yielded."""

    def __init__(
        self,
        prompt: Any,
        model: nn.Module,
        drafter: DrafterProtocol,
        *,
        num_draft_tokens: int,
        max_tokens: int,
        sampler: Optional[Callable],
        logits_processors: Optional[list[Callable]],
        prompt_cache: Optional[list[Any]],
        prefill_step_size: int,
        kv_bits: Optional[int],
        kv_group_size: int,
        quantized_kv_start: int,
    ):
        tokens = prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
        if not tokens:
            raise ValueError("speculative decoding needs a non-empty prompt")
        self.tokens, self.model, self.drafter = tokens, model, drafter
        self.max_tokens, self.prefill_step_size = max_tokens, prefill_step_size
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.quantized_kv_start = quantized_kv_start
        self.n_t = n_target_caches(model)
        if prompt_cache is None:
            prompt_cache = make_prompt_cache(model) + drafter.make_cache()
        self.prompt_cache = prompt_cache
        self.target_cache = prompt_cache[: self.n_t]
        dcache = self._drafter_caches()
        self.rule = sampling.Rule(sampler)  # the acceptance rule, described once
        self.sampler = sampler or greedy_sampler
        self.logits_processors = logits_processors
        self.split = self._split()
        self.attention = target_mod.attention_policy()  # a bad MLX_LM_SPEC_ATTENTION fails here
        self.widths = target_mod.window_widths()  # chains padded up to these (a GPU)
        self.behind = target_mod.drafts_behind()  # next drafts queued behind a verify (opt-in)
        self.ctx = DraftContext(
            model, self.target_cache, dcache, temp=self.rule.temp or 0.0, filter=self.rule.filt
        )
        self.ctl = Controller(
            num_draft_tokens,
            max(num_draft_tokens, drafter.max_draft),
            adaptive=getattr(drafter, "adaptive", True),
            auto_off=getattr(drafter, "auto_off", True),
            widths=self.widths,
            lookup=callable(getattr(drafter, "guess", None)),
        )
        self._carry_timings()
        self.st = stats_mod.SpecStats(
            drafter.name, gamma_start=self.ctl.gamma, gamma=self.ctl.gamma
        )
        stats_mod.start(self.st)
        # The token history for logits processors (only when there are some).
        self.context = list(tokens) if logits_processors else None
        self.emitted = 0  # tokens yielded
        # Tokens the drafter was told of: more than yielded if the consumer stops early.
        self.told = 0
        # The pending token: emitted (or the prompt's last), not yet fed to the target.
        self.y = tokens[-1]
        self.warned = False
        self.misses = 0  # drafting rounds in a row with nothing proposed
        self.free = False  # the drafter computes nothing on the device (lists of ids)
        self.computed = False  # it drafted on the device at least once (an array)
        self.round_free = False  # this round's drafts cost nothing to draft (a list)
        self.start = _offset(self.target_cache)
        self.trees = tree_verify.TreeRounds.start(self)  # None: chains only
        self.built = _built_shapes(model)  # round shapes whose kernels exist

    def _carry_timings(self):
        try:
            seen = _TIMINGS.get(self.drafter)
        except TypeError:  # a drafter without weak references: timed per request
            return
        if seen is not None and seen[0]() is self.model and seen[1] == self.widths:
            self.ctl.carry(seen[2])

    def _keep_timings(self):
        try:
            _TIMINGS[self.drafter] = (weakref.ref(self.model), self.widths, self.ctl.timings())
        except TypeError:
            pass

    def _drafter_caches(self):
        """The drafter's caches from the prompt cache, rebuilt in place
        (the caller's list gets them) if missing or not the drafter's."""
        dcache = self.prompt_cache[self.n_t :]
        if not self.drafter.cache_ok(dcache):
            if dcache:
                log.info("spec-decode: drafter caches in the prompt cache do not fit; rebuilt")
            dcache = self.drafter.make_cache()
            self.prompt_cache[self.n_t :] = dcache
        return dcache

    def _split(self):
        """``(backbone, head)`` of the target for a drafter that reads hidden states, else None."""
        if not self.drafter.needs_hidden:
            return None
        split = target_mod.split(self.model)
        if split is None:
            raise ValueError(
                f"the {self.drafter.name} drafter needs the target's hidden states, "
                f"which this architecture does not expose in mlx-lm's usual layout"
            )
        return split

    # ------------------------------------------------------------ the whole

    def run(self, stream: Any) -> Iterator[Step]:
        with mx.stream(stream):
            self.prefill()
            try:
                yield from self.rounds()
            finally:
                self.settle()
                self._keep_timings()
                self.st.gamma = self.ctl.gamma
                log.info(self.st.line())

    def prefill(self) -> None:
        """All prompt tokens but the last into the target's cache; the last
        one is pending, fed with the first drafts."""
        tokens, ctx = self.tokens, self.ctx
        for s in range(0, len(tokens) - 1, self.prefill_step_size):
            chunk = mx.array(
                tokens[s : min(s + self.prefill_step_size, len(tokens) - 1)], mx.uint32
            )[None]
            if self.split is None:
                self.model(chunk, cache=self.target_cache)
            else:
                # A drafter reading hidden states gets the state at the last
                # prompt position (the one that predicts the pending token),
                # so it drafts from the first step; nobody reads the prompt's
                # logits, so the lm-head is skipped.
                ctx.hidden = self.split[0](chunk, self.target_cache)[0, -1:]
            self.quantize()
            mx.eval(
                [c.state for c in self.target_cache]
                + ([ctx.hidden] if ctx.hidden is not None else [])
            )
        self.drafter.prefill(ctx, tokens)

    def rounds(self) -> Iterator[Step]:
        """Rounds until ``max_tokens`` (or the consumer) stops them: a
        drafting round where the caches can be rolled back and drafting
        pays, plain steps where not."""
        while self.max_tokens < 0 or self.emitted < self.max_tokens:
            remaining = self.max_tokens - self.emitted if self.max_tokens >= 0 else 1 << 30
            room = window_room(self.target_cache)
            if room < 2:
                self._fall_back(room)
                yield from self.plain(remaining)
                break
            if self.ctl.off_for > 0:
                n = min(self.ctl.off_for, remaining)
                for_good = self.ctl.for_good  # drafting cannot pay here
                self.st.switched_off(self.ctl.why, for_good)
                self.ctl.resume()
                # A drafter that costs nothing to ask (n-gram, suffix, a
                # paired lookup) keeps guessing, and drafting resumes as
                # soon as its guesses hold.
                guess, watch = self._free_guess(), None
                if guess is not None and not for_good:
                    watch = resume_watch(
                        lambda guess=guess: guess(self.ctx, self.ctl.gamma), lambda: self.y
                    )
                yield from self.plain(n, watch=watch)
                continue
            yield from self.draft_round(remaining, room)

    def _free_guess(self) -> Optional[Callable[[DraftContext, int], list]]:
        """What the drafter proposes at no cost, ``(ctx, n) -> drafts``: a
        free drafter's drafts, or a paired lookup's (``guess``); None."""
        if self.free:
            return lambda ctx, n: self.drafter.draft(ctx, n)[0]
        return getattr(self.drafter, "guess", None)

    def settle(self) -> None:
        """Leave target and drafter caches holding exactly prompt + yielded tokens."""
        actual = _offset(self.target_cache)
        if self.start is not None and actual is not None:
            extra = actual - (self.start + len(self.tokens) + self.emitted)
            if extra > 0:
                trim_prompt_cache(self.target_cache, extra)
            elif extra == -1:
                # The last yielded token came from the target and was never fed.
                self.model(mx.array([[self.y]], mx.uint32), cache=self.target_cache)
                self.quantize()
                mx.eval([c.state for c in self.target_cache])
            elif extra < -1:
                log.warning(f"spec-decode: target cache is {-extra} tokens short of the sequence")
        if self.told > self.emitted:
            self.drafter.trim(self.ctx, self.told - self.emitted)
        self.drafter.flush(self.ctx)

    # ------------------------------------------------------- one round

    def draft_round(self, remaining: int, room: int) -> Iterator[Step]:
        """Draft up to γ tokens, verify them in one target forward, keep the
        accepted prefix and the target's own next token."""
        limit = self._draft_limit(remaining, room)
        k_req = min(self.ctl.want(), limit)
        t0 = time.perf_counter()
        if k_req <= 0:
            yield from self.plain(1, t0)
            return
        if getattr(self.drafter, "sizes_drafts", False):
            k_req = min(self.ctl.gmax, limit)
        self.ctx.verify_cost = self.ctl.verify_cost()
        self.ctx.draft_cost = self.ctl.draft_cost()
        self.round_free = False
        if self.trees is not None and self.trees.grows(self.ctx.verify_cost):
            # A branching tree is verified there.
            drafts, q = self.trees.draft(k_req, limit)
            if drafts is None:
                self.misses = 0
                lp, out, a, k, trials = self.trees.verify()
                yield from self._emit(lp, out, a, k, t0, trials)
                return
        else:
            drafts, q = self._draft(k_req)
        k = drafts.size
        if k == 0:
            yield from self._nothing_drafted(remaining, t0)
            return
        self.misses = 0
        queued = self._queue(self.y, drafts, q, self._pad_room(room))
        yield from self._kept(self._check(queued, self._draft_behind(queued)), drafts.tolist(), t0)

    def _draft_behind(self, queued) -> Optional[tuple]:
        """The next round's drafts, queued behind this round's verify before
        the host reads it, where the drafter drafts from the device's own
        state (``draft_after``: the assistant) and the target's greedy
        tokens decide what is kept: the device runs them while the host
        reads this round and builds the next one's forward, instead of
        waiting for the host to build them after the read. The drafter
        proposes them next if that round starts where this one leaves off.
        Returns the window's log-probabilities and draws for ``_check``
        (None: not built here)."""
        # Not while the controller times fresh drafts: drafts made behind
        # would read as free.
        if not self.behind or self.ctl.time_draft():
            return None
        win, logits, hidden, fed = queued
        after = getattr(self.drafter, "draft_after", None)
        end = _offset(self.target_cache)
        if after is None or hidden is None or end is None or self.rule.kind != "greedy":
            return None
        lp = sampling.window_logprobs(logits, self.logits_processors, self._before(), win.tokens)
        drawn = sampling.draws(win, lp, self.rule)
        a, token = sampling.kept_on_device(win, drawn[0])
        # γ as it stands (a round that wants more since proposes these).
        drafts = after(self.ctx, a, token, hidden[a][None], end - fed + a + 1, self.ctl.gamma)
        if drafts is not None:
            # The count on its own, so reading it waits for the verify only.
            mx.async_eval(a)
            mx.async_eval(drafts)
        return lp, drawn

    def _kept(self, checked, d: list[int], t0: float, timed: bool = True) -> Iterator[Step]:
        """A checked chain over drafts ``d`` (``_check``): the caches cut to
        what was kept, the tokens emitted."""
        lp, hidden, a, target_tok, fed = checked
        ragged.keep(self.target_cache, fed, [list(range(a + 1))])
        if self.trees is not None:
            self.trees.update(len(d), a)
        if hidden is not None:
            self.ctx.hidden = hidden[a : a + 1]
        yield from self._emit(lp, d[:a] + [target_tok], a, len(d), t0, timed=timed)

    def _emit(
        self,
        lp: mx.array,
        out: list[int],
        a: int,
        k: int,
        t0: float,
        trials: Optional[int] = None,
        timed: bool = True,
    ) -> Iterator[Step]:
        """A verified round: ``k`` drafted, ``a`` kept, ``out`` emitted
        (``lp`` their logprobs rows; ``trials``: a token tree's, the drafts
        its accepted path met; ``timed``: False where the forward ran behind
        a plain step, its seconds not a verify's); figures, controller,
        drafter, tokens."""
        dt = time.perf_counter() - t0
        target_tok = out[-1]
        st = self.st
        st.forwards += 1
        st.draft_rounds += 1
        st.drafted += k
        st.accepted += a
        st.drafting_round(len(out), dt)
        built = not self._first_of_shape(k, trials is not None)
        self.ctl.update(k, a, dt, trials, timed, free=self.round_free, built=built)
        st.gamma = self.ctl.gamma
        self.drafter.accept(self.ctx, out, a)
        self.told += len(out)
        if self.context is not None:
            self.context.extend(out)
        self.y = target_tok
        for i, tok in enumerate(out):
            st.emitted += 1
            self.emitted += 1
            yield tok, lp[i], i < a

    def _first_of_shape(self, k: int, tree: bool) -> bool:
        """Whether a round over ``k`` drafts is this process's first of its
        shape on the target: its seconds built kernels, neither a verify's
        cost nor drafting's rate."""
        shape = (self.ctl.width(k + 1), tree)
        if shape in self.built:
            return False
        self.built.add(shape)
        return True

    def _draft_limit(self, remaining, room):
        """Most tokens a round may draft: within ``max_tokens``, the caches'
        rollback room, the widest padded width, and short of the switch to a
        quantized cache."""
        limit = min(remaining - 1, room - 1)
        if self.widths:
            # Past the widest padded width a window runs at its own width,
            # and its attention through kernels built per cache length.
            limit = min(limit, self.widths[-1] - 1)
        if self.kv_bits is not None and self.start is not None:
            off = _offset(self.target_cache)
            if off < self.quantized_kv_start:
                # Never straddle the switch to a quantized cache: plain
                # decoding quantizes right at quantized_kv_start.
                limit = min(limit, self.quantized_kv_start - off - 1)
        return limit

    def _pad_room(self, room):
        """The widest window a round may feed: the caches' rollback room,
        and short of the switch to a quantized cache (padding included)."""
        if self.kv_bits is not None and self.start is not None:
            room = min(room, self.quantized_kv_start - _offset(self.target_cache))
        return room

    def _draft(self, k_req):
        """The drafter's proposal as an array, and its probabilities (or None).
        A list of ids cost nothing to draft (a lookup); an array was computed
        on the device, and once one was, the drafter is never taken for a
        free one (``LookupFirst`` returns both kinds)."""
        t0 = time.perf_counter()  # the draft's own time, not the round's set-up
        drafts, q = self.drafter.draft(self.ctx, k_req)
        self.round_free = not isinstance(drafts, mx.array)
        if self.round_free:
            if not self.computed:
                self.ctl.free_drafts()
                self.free = True
            return mx.array(drafts, mx.uint32), q
        if not self.computed:
            self.computed, self.free = True, False
            self.ctl.computed_drafts()
        if drafts.size and self.ctl.time_draft():
            # A drafter that computes (a draft model): time its steps.
            mx.eval(drafts)
            self.ctl.drafted(drafts.size, time.perf_counter() - t0)
        return drafts, q

    def _nothing_drafted(self, remaining, t0):
        # Nothing to propose: pipelined plain steps, so open text costs what
        # mlx-lm's loop costs. A free drafter (a lookup, no forward) is asked
        # after each token of one run that lasts until it proposes again;
        # with logits processors (steps read one by one), or where verify
        # columns cost compute, that run starts after a few single steps
        # in a row (the short gaps of a copy stay single steps). Another drafter doubles its runs (2, 4, 8 tokens).
        # (A drafter reading hidden states is asked every step, unless it
        # has a free guess: a paired lookup whose model declined.)
        guess = self._free_guess()
        self.misses = 0 if self.drafter.needs_hidden and guess is None else self.misses + 1
        if self.free and self.context is None and policy.free_columns(self.ctl.verify_cost()):
            # Pipelined from the first miss: the round that ends the run is
            # queued behind its last step (``plain``'s ``early``). Only where
            # verify columns cost nothing: a wrong guess wastes the window's.
            yield from self.plain(remaining, t0, early=self._proposal)
            return
        k = max(1, self.ctl.gamma)
        watch = None if guess is None else lambda: len(guess(self.ctx, k)) > 0
        if self.free and self.misses > MISS_RUN:
            yield from self.plain(remaining, t0, watch=watch)
            return
        if watch is not None and not self.free:
            # A paired lookup whose model declined to draft (its rounds do
            # not pay): pipelined runs from the first miss, doubling (2, 4,
            # 8 tokens), each ended as soon as the lookup proposes; between
            # them the drafter is asked again (its model's probe comes due).
            yield from self.plain(min(1 << min(self.misses, 3), remaining), t0, watch=watch)
            return
        run = 1 if self.misses <= MISS_RUN else 1 << min(self.misses - MISS_RUN, 3)
        yield from self.plain(min(run, remaining), t0)

    def _proposal(self) -> list:
        """A free drafter's proposal now, one token longer than a round's
        drafts: its first guesses the token a queued step is computing.
        Where it proposes no chain but would draft a token tree (a shorter
        context, an earlier occurrence: guesses too weak to queue a window
        on), the tree's first guess alone: the run ends there, and the next
        round drafts the tree on the known token, as the tree's rounds do
        wherever it proposes, instead of plain steps through the gap.
        ``ctx.verify_cost`` stays as the round that found nothing set it: no
        round is timed within a run, and this runs after every token."""
        k = self.ctl.gmax if getattr(self.drafter, "sizes_drafts", False) else self.ctl.gamma
        n = max(1, k) + 1
        drafts = list(self.drafter.draft(self.ctx, n)[0])
        if not drafts and self.trees is not None:
            return self.trees.guess(n)
        return drafts

    def _queue(self, first, drafts, q, room):
        """The verify forward over ``[first, drafts]`` built, padded up to one
        of ``widths`` (within ``room``); ``first``: the pending token, or a
        plain step's lazy token (``_early``). Returns what ``_check`` reads.

        Padding comes after the window, so causal attention keeps the
        window's rows what they were; it costs nothing where a forward is
        memory-bound, and a request meets a few widths instead of one per
        draft length, each with kernels and graphs built on first use."""
        if isinstance(first, mx.array):
            win = sampling.Window(
                mx.concatenate([first.astype(mx.uint32), drafts]), list(range(-1, drafts.size)), q
            )
        else:
            win = sampling.chain(first, drafts, q)
        n = 1 + drafts.size
        fed = target_mod.padded_width(n, self.widths)
        fed = fed if fed <= room else n
        tokens = win.tokens
        if fed > n:
            tokens = mx.concatenate([tokens, mx.zeros((fed - n,), mx.uint32)])
        logits, hidden = self.forward(tokens)
        self.quantize()
        if fed > n:
            logits = logits[:n]
            hidden = hidden[:n] if hidden is not None else None
        return win, logits, hidden, fed

    def _check(self, queued, built=None):
        """The accepted path of a queued verify (``_queue``; ``built``: its
        log-probabilities and draws, where ``_draft_behind`` made them):
        waits for it. Returns the logprobs rows, the hidden states (or
        None), the accepted count, the target's token and the width fed."""
        win, logits, hidden, fed = queued
        lp, drawn = built or (None, None)
        if lp is None:
            lp = sampling.window_logprobs(
                logits, self.logits_processors, self._before(), win.tokens
            )
        # The logprobs rows stay lazy: only a consumer that reads them pays.
        path, target_tok = sampling.accept(win, lp, self.rule, drawn)
        return lp, hidden, len(path) - 1, target_tok, fed

    def _fall_back(self, room):
        """Warn once that the caches cannot be rolled back, and why."""
        if self.warned:
            return
        kinds = ", ".join(sorted({type(c).__name__ for c in self.target_cache}))
        past = ", past its window" if room == 1 else ""
        reason = f"the prompt cache cannot be rolled back ({kinds}{past})"
        log.warning(f"spec-decode: plain decoding for the rest of this request: {reason}")
        self.st.fallback = reason
        self.warned = True

    # ------------------------------------------------------ plain steps

    def plain(
        self,
        n: int,
        t0: Optional[float] = None,
        watch: Optional[Callable[[], bool]] = None,
        early: Optional[Callable[[], list]] = None,
    ) -> Iterator[Step]:
        """Plain decoding of n tokens, pipelined as mlx-lm's generate_step.

        Each token is fed before it is yielded, except the last one, which
        stays pending in ``y`` (as after a verify round). With ``t0``, each
        step is timed for the controller. ``watch`` is asked after each
        token; True ends the run one token later (that token's forward is
        already queued). ``early`` (a free drafter's proposal after the
        last token read) does the same where it proposes, and where it
        proposes two tokens or more queues a verify window behind that last
        step (``_early``), checked once the step's token is read: no
        read-back between the run and the round.

        As in mlx-lm, the next step's graph is built from the lazy token
        before this one is read, so Python's graph building overlaps the
        forward (logits processors need the token itself first)."""
        t_run = time.perf_counter() if t0 is None else t0
        nxt = self.step(self.y, waited=True)
        mx.async_eval(nxt[:2])
        lazy = self.context is None
        queued = None
        i = -1
        while i + 1 < n:
            i += 1
            tok_arr, lp, hidden = nxt
            if lazy and i + 1 < n:
                nxt = self.step(tok_arr)
                mx.async_eval(nxt[:2])
            tok = tok_arr.item()
            if t0 is not None and (n == 1 or not lazy):
                now = time.perf_counter()
                self.ctl.update(0, 0, now - t0)
                t0 = now
            if i + 1 == n:
                self._timed_run(n, time.perf_counter() - t_run, t0 is not None and lazy and n > 1)
            if self.context is not None:
                self.context.append(tok)
            if hidden is not None:
                self.ctx.hidden = hidden[-1:]
            if not lazy and i + 1 < n:
                nxt = self.step(tok, waited=True)
                mx.async_eval(nxt[:2])
            self.st.forwards += 1
            self.st.emitted += 1
            self.emitted += 1
            self.told += 1
            self.y = tok
            self.drafter.accept(self.ctx, [tok], 0)
            if watch is not None and i + 1 < n and watch():
                n = i + 2
            elif early is not None and lazy and i + 1 < n:
                proposal = early()
                # Past a rotating cache's window the run ends too: ``rounds`` falls back.
                if proposal or window_room(self.target_cache) < 2:
                    queued = self._early(nxt[0], proposal, n - i - 2)
                    n = i + 2
            yield tok, lp, False
        if queued is not None:
            yield from self._kept(self._check(queued[0]), queued[1], time.perf_counter(), False)

    def _early(self, first: mx.array, proposal: list, remaining: int) -> Optional[tuple]:
        """A verify window queued behind the plain step whose token ``first``
        is still on the device, where the drafter's ``proposal`` after the
        token before it holds two tokens or more: its first is a guess at
        ``first``, the rest the window's drafts, ``[first, proposal[1:]]``.
        A wrong guess leaves drafts that the target rejects: the window
        then yields one token, as the plain step it replaces would. Returns
        the queued forward and its drafts, or None (nothing to verify, or
        caches that cannot take the window: ``rounds`` decides then)."""
        room = window_room(self.target_cache)
        limit = self._draft_limit(remaining, room)
        d = [int(t) for t in proposal[1 : 1 + max(0, limit)]]
        if not d or room < 2:
            return None
        return self._queue(first, mx.array(d, mx.uint32), None, self._pad_room(room)), d

    def _timed_run(self, n: int, seconds: float, per_step: bool) -> None:
        """A run of ``n`` plain steps took ``seconds``: into the figures, and
        with ``per_step`` into the controller as ``n`` steps of the run's mean.
        Pipelined steps cannot be timed one by one: waiting on a token also
        runs the forward queued behind it, so they read in pairs (two
        forwards, then almost nothing) and the near-zero one, taken as what
        a step costs, made every verify look several steps dear."""
        self.st.plain_run(n, seconds)
        for _ in range(n if per_step else 0):
            self.ctl.update(0, 0, seconds / n)

    def step(self, tok: Any, waited: bool = False) -> tuple[mx.array, mx.array, Optional[mx.array]]:
        """The target's next token (lazy), its logprobs and hidden state after
        ``tok`` (an id, or a lazy one-token array); ``waited``: the device has
        nothing queued before it (``target.staged``)."""
        x = tok.astype(mx.uint32) if isinstance(tok, mx.array) else mx.array([tok], mx.uint32)
        logits, hidden = self.forward(x, waited)
        self.quantize()
        lp = sampling.window_logprobs(logits, self.logits_processors, self._before(), x)
        return self.sampler(lp).reshape(-1), lp.squeeze(0), hidden

    def _before(self) -> Optional[list[int]]:
        """The tokens before the pending one, for logits processors (the
        context ends with the pending token, the window's first)."""
        return self.context[:-1] if self.context is not None else None

    # ----------------------------------------------------- the target

    def forward(
        self, tokens: mx.array, waited: bool = False
    ) -> tuple[mx.array, Optional[mx.array]]:
        """Logits ``[L, V]`` over ``tokens``, and the final hidden states
        ``[L, D]`` when a drafter reads them (else None); ``waited``: as
        ``step`` says."""
        x = tokens[None]
        with (
            target_mod.verify_attention(self.model, x.shape[1], self.attention),
            target_mod.staged(self.model, x.shape[1], waited),
        ):
            # squeeze, not [0]: an integer index is a gather, a copy on the device.
            if self.split is None:
                return self.model(x, cache=self.target_cache).squeeze(0), None
            h = self.split[0](x, self.target_cache)
        return self.split[1](h).squeeze(0), h.squeeze(0)

    def quantize(self) -> None:
        maybe_quantize_kv_cache(
            self.target_cache, self.quantized_kv_start, self.kv_group_size, self.kv_bits
        )
        if self.kv_bits is not None:
            # The caller's list must see the quantized caches (mlx-lm's own
            # loop quantizes a slice copy, and the server stores stale ones).
            self.prompt_cache[: self.n_t] = self.target_cache
