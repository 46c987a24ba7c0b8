"""Speculative decoding inside mlx-lm's continuous batching (``mlx_lm.server``).

``SpecBatchGenerator`` is mlx-lm's ``BatchGenerator`` (prompt processing,
rows joining and leaving between steps, segment caches) whose generation
batch is a ``SpecGenerationBatch``: each call of ``next`` is either mlx-lm's
own plain step (every row one token, pipelined) or a drafting round:

1. each row's drafter (its own ``DraftContext``: an n-gram index or suffix
   state per row) is brought up to the row's tokens and proposes up to γ;
2. one target forward over ``[B, 1 + γ]``: row i feeds its pending token and
   its ``k_i <= γ`` drafts, padded (padding sits after the row's tokens, so
   the causal mask keeps it out of them);
3. per-row acceptance with the row's own sampler and logits processors
   (``batch_verify.verify``);
4. the row emits its pending token and its accepted drafts (stop words and
   ``max_tokens`` cut them as a plain step would), the target's token becomes
   its pending one, and the cache drops each row's rejected entries
   (``ragged.rollback``): every row holds exactly prompt + emitted tokens,
   which is what a finishing row hands the server's prompt cache.

The state between calls is mlx-lm's own (``_next_tokens``: each row's
pending token, ``tokens``: what its cache holds), so plain steps and
drafting rounds interleave freely. ``batch_verify.BatchController`` picks γ
per batch size from measured step and round times (``policy.Policy``, the
serial loop's too, at one row). Behind a plain step the
pending tokens are still on the device, so the decision drafts from the
tokens already emitted (the first draft a guess at the pending token) and
reads nothing back: a declined decision costs the drafters' lookups, which
overlap the step in flight, and mlx-lm's pipeline keeps running. A round
chosen there (rows without logits processors, chains) is built on the
pending tokens as they are on the device, so its graph is built while the
step runs and it reads them back with its own results; otherwise the round
reads them first and drafts again from them. Declined proposals are scored against
what the plain steps emit (``Row.check``), so each row's acceptance is
known without a round. When no row has anything to propose, plain steps
run in doubling runs; a plain step is mlx-lm's own with no Python work per
row.

A drafter that raises stops drafting for its row only; a batch whose caches
cannot roll rows back apart (a sliding-window layer) decodes plainly, with
one warning. Each request's figures (``SpecStats``) go to its info dict,
hence ``usage``, and to the log when it finishes.
"""

import logging
import time
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch

from . import batch_tree, policy, sampling
from . import stats as stats_mod
from . import target as target_mod
from . import tree as tree_mod
from .batch_verify import BatchController, verify
from .drafter import DraftContext
from .ragged import RaggedKVCache, ragged
from .ragged import keep as keep_rows

log = logging.getLogger("mlx_lm_spec_decode")

MISS_RUN = 4  # proposal-less decisions in a row before plain steps come in doubling runs
COST_RUN = 8  # the longest run of plain steps between drafting decisions: a decision
# reads nothing back from the device (it drafts from the tokens already emitted),
# so it costs only the drafters' lookups, which overlap the step in flight
SQUEEZE_RUN = 4  # a plain run this long after declines starts with the cache's holes squeezed out


def read_back(tokens: mx.array) -> List[int]:
    """The pending tokens on the host: waits for the step in flight (the
    only read-back a decision makes, and only for a round)."""
    return tokens.tolist()


class Row:
    """One request's drafting state in the batch."""

    def __init__(self, model: Any, drafter: Any, sampler: Any, st: stats_mod.SpecStats):
        self.rule = sampling.Rule(sampler)
        self.ctx = DraftContext(
            model, None, drafter.make_cache(), temp=self.rule.temp or 0.0, filter=self.rule.filt
        )
        self.stats = st
        self.told = 0  # tokens of the row's history the drafter holds
        self.steps = 0  # the batch's plain-step count its figures include
        self.failed: Optional[str] = None
        self.acceptance = policy.Acceptance()
        self.guess: Optional[tuple] = None  # (history index, drafts) not verified: γ was 0
        self.watch: Optional[Any] = None  # while drafting is off: its guesses scored

    @property
    def alpha(self) -> float:
        return self.acceptance.alpha

    def observe(self, k: int, a: int, rejected: Optional[bool] = None) -> None:
        self.acceptance.observe(k, a, rejected)

    def check(self, history: List[int]) -> None:
        """Score drafts no round verified against the tokens emitted since, so
        the acceptance the cost model weighs is learnt while γ is 0 too."""
        start, drafts = self.guess
        self.guess = None
        seen = history[start : start + len(drafts)]
        a = sampling.kept(drafts, seen)
        if seen:
            self.observe(len(drafts) if a < len(seen) else a, a)


class SpecState:
    """What the generator and its generation batch share: drafter, controller, figures."""

    def __init__(self, model: Any, drafter: Any, gamma: int, gmax: int):
        self.model, self.drafter = model, drafter
        self.ctl = BatchController(
            gamma,
            gmax,
            adaptive=getattr(drafter, "adaptive", True),
            auto_off=getattr(drafter, "auto_off", True),
            widths=target_mod.window_widths(),  # windows padded up to these
        )
        self.gamma_start = self.ctl.gamma
        self.stats: Dict[int, stats_mod.SpecStats] = {}
        self.no_draft: Optional[str] = None  # why the whole batch decodes plainly
        # Whether rows draft trees: the drafter proposes them and the model's
        # batched forward takes them. Checked here, when the server builds its
        # generator, not in a request's first drafting decision (a few forwards,
        # once per loaded model).
        self.trees = tree_mod.drafts_trees(drafter) and batch_tree.tree_ok(model)

    def begin(self, uid: int) -> None:
        st = stats_mod.SpecStats(
            self.drafter.name, gamma_start=self.gamma_start, gamma=self.gamma_start
        )
        stats_mod.start(st)  # into the inserted request's info dict (usage)
        self.stats[uid] = st

    def row(self, uid: int, sampler: Any) -> Row:
        st = self.stats.pop(uid, None) or stats_mod.SpecStats(
            self.drafter.name, gamma_start=self.gamma_start
        )
        return Row(self.model, self.drafter, sampler, st)


class SpecGenerationBatch(GenerationBatch):
    """mlx-lm's generation batch with drafting rounds between its plain steps."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.spec: Optional[SpecState] = None
        self.rows: List[Row] = []
        self.plain_left = 0  # plain steps to run before the next drafting decision
        self.misses = 0
        self.last_plain_b = 0  # batch size of the previous call, if it was a pipelined plain step
        self.owed: Optional[Tuple[float, Any]] = None  # the previous call's timing, unsent
        self.called: Optional[tuple] = None  # its (B, tokens, s, drafting on, round's shape)
        self.shape: Optional[tuple] = None  # this call's round's (B, W, cache buffer)
        self.on = True  # drafting is on for this call's batch size
        self.returned = 0.0  # when the previous call returned
        self.steps = 0  # plain steps run (each row's figures catch up when it leaves)
        self.idle = 0  # plain steps since the last round
        self.pending: Optional[List[int]] = None  # the rows' pending tokens, when known here
        self.watching = False  # drafting is off and the rows' guesses are scored
        super().__init__(*args, **kwargs)

    # ----------------------------------------------------- rows join and leave

    def extend(self, batch: GenerationBatch) -> None:
        rows = [self.spec.row(u, s) for u, s in zip(batch.uids, batch.samplers, strict=True)]
        for row in rows:
            row.steps = self.steps
        super().extend(batch)
        self.rows.extend(rows)
        self.last_plain_b, self.owed, self.called, self.pending = 0, None, None, None

    def filter(self, keep: List[int]) -> None:
        kept = set(keep)
        for i, row in enumerate(self.rows):
            if i not in kept:
                self._close(i, row)
        super().filter(keep)
        self.rows = [self.rows[i] for i in keep]
        self.last_plain_b, self.owed = 0, None
        if self.pending is not None:
            self.pending = [self.pending[i] for i in keep]

    def _close(self, i: int, row: Row) -> None:
        """The row leaves: its drafter holds exactly its tokens, then flushes."""
        # Each plain step was one forward and one token for every row in it.
        row.stats.forwards += self.steps - row.steps
        row.stats.emitted += self.steps - row.steps
        if row.told and not row.failed:
            self._guard(row, self._sync, row, self.tokens[i])
            self._guard(row, self.spec.drafter.flush, row.ctx)
        row.stats.gamma = self.spec.ctl.gamma
        log.info(row.stats.line())

    # ------------------------------------------------------------ the drafter

    def _guard(self, row: Row, fn: Any, *args: Any) -> Any:
        """Call the drafter for one row; a failure stops drafting for that row only."""
        if row.failed:
            return None
        try:
            return fn(*args)
        except Exception as e:
            row.failed = f"drafter failed: {type(e).__name__}: {e}"
            row.stats.fallback = row.failed
            log.warning(f"spec-decode: plain decoding for one request: {row.failed}")
            return None

    def _sync(self, row: Row, history: List[int]) -> None:
        """Make the drafter's history ``history`` (it only ever lags or overshoots)."""
        d = self.spec.drafter
        if row.told == 0:
            d.prefill(row.ctx, list(history))
        elif row.told > len(history):
            d.trim(row.ctx, row.told - len(history))
        elif row.told < len(history):
            d.accept(row.ctx, list(history[row.told :]), 0)
        row.told = len(history)

    def _watch(self) -> None:
        """While drafting is off: each row's drafter keeps guessing from its
        tokens and the guesses are scored against the tokens emitted
        (``policy.resume_watch``, after the step was started: the lookups
        overlap it; the rows' acceptance learns from them); drafting is
        retried at this batch size as soon as the rows whose guesses hold,
        at their acceptance, would make a round pay
        (``BatchController.resumes``): the text has started to copy."""
        self.watching, hot = True, []
        for i, row in enumerate(self.rows):
            if row.watch is None:
                # The row's token list: every step appends to it in place,
                # and rows leaving or joining keep it.
                tokens = self.tokens[i]
                row.watch = policy.resume_watch(
                    lambda row=row, tokens=tokens: self._guess(row, tokens),
                    lambda tokens=tokens: tokens[-1],
                    row.observe,  # the row's acceptance learns from its guesses
                )
            hot.append(bool(self._guard(row, row.watch)))
        alphas = [r.alpha if h else 0.0 for r, h in zip(self.rows, hot, strict=True)]
        if any(hot) and self.spec.ctl.resumes(len(self.rows), alphas):
            self._unwatch()

    def _unwatch(self) -> None:
        """Drafting is on again: the watches end (a later switch-off starts fresh ones)."""
        self.watching = False
        for row in self.rows:
            row.watch = None

    def _guess(self, row: Row, tokens: List[int]) -> List[int]:
        """The row's drafter's proposal after ``tokens``, its tokens so far."""
        self._sync(row, tokens)
        drafts = self.spec.drafter.draft(row.ctx, self.spec.ctl.gmax)
        return [int(t) for t in drafts[0]] if drafts else []

    def _propose(
        self, pending: Optional[List[int]], use_trees: bool
    ) -> Tuple[List[List[int]], List[Any]]:
        """Each row's chain of drafts and, with a tree drafter, its trie
        (``batch_tree.RowTree``) when it holds more than the chain. Without
        ``pending`` (the pending tokens are still on the device) the drafts
        continue the tokens emitted so far: the first is a guess at the
        pending token."""
        out, trees = [], []
        gmax, d = self.spec.ctl.gmax, self.spec.drafter
        # What a verify costs at this batch size, as the serial loop tells
        # its drafter (``DraftContext.verify_cost``): the n-gram drafter's
        # bar and tree breadth, the suffix drafter's draft length.
        price = self.spec.ctl.verify_cost(len(self.rows))
        for i, row in enumerate(self.rows):
            row.ctx.verify_cost = price
            room = min(gmax, self.max_tokens[i] - self._num_tokens[i] - 1)
            room += pending is None  # the guess at the pending token comes first
            history = self.tokens[i] + ([pending[i]] if pending is not None else [])
            if row.guess:
                row.check(history)
            self._guard(row, self._sync, row, history)
            tree = None
            if room <= 0:
                drafts = None
            elif use_trees and pending is not None:
                paths = self._guard(row, d.draft_tree, row.ctx, room)
                tree = batch_tree.RowTree(paths, row.alpha, room) if paths else None
                drafts = (tree.chain,) if tree else None
            else:
                drafts = self._guard(row, d.draft, row.ctx, room)
            out.append([int(t) for t in drafts[0]][:room] if drafts else [])
            trees.append(tree if tree and len(tree.tokens) > len(out[-1]) + 1 else None)
        return out, trees

    # ------------------------------------------------------------ one call

    def next(self) -> List[GenerationBatch.Response]:
        self._settle()
        B, t = len(self.uids), time.perf_counter()
        self.on, self.shape = True, None
        out = self._next()
        self.returned = time.perf_counter()
        if self.spec is not None and B:
            self.called = (B, len(out), self.returned - t, self.on, self.shape)
        return out

    def _settle(self) -> None:
        """Hand the controller the previous call's time plus the caller's since
        (a server's work on each emitted token): behind a pipelined step that
        time overlaps the forward, behind a round nothing runs, so a round's
        price is what the caller sees. A batch that changed in between (rows
        joining: their prompts were processed) discards it."""
        after = time.perf_counter() - self.returned
        if self.owed is not None:
            seconds, record = self.owed
            self.owed = None
            record(seconds + after)
        if self.called is not None:
            B, n, seconds, on, shape = self.called
            self.called = None
            self.spec.ctl.call(B, n, seconds + after, on, shape)

    def _next(self) -> List[GenerationBatch.Response]:
        if not self.uids:
            return []
        spec, B = self.spec, len(self.uids)
        if spec is not None and not spec.no_draft and not spec.ctl.drafting(B):
            # Drafting lost at this size: mlx-lm's own steps, on a cache
            # without holes; the rows' guesses are only scored.
            self.on, self.plain_left = False, 0
            if self.last_plain_b != B:
                self._squeeze()
            out = self._plain()
            self._watch()
            return out
        if self.watching:
            self._unwatch()
        if spec is None or spec.no_draft or self.plain_left > 0 or spec.ctl.needs_plain(B):
            if spec is not None and self.plain_left == 0 and spec.ctl.needs_plain(B):
                self.plain_left = BatchController.PROBE
            return self._plain()
        caches = ragged(self.prompt_cache)
        if caches is None:
            kinds = ", ".join(sorted({type(c).__name__ for c in self.prompt_cache}))
            spec.no_draft = f"the batch's caches cannot roll rows back apart ({kinds})"
            log.warning(f"spec-decode: plain batched decoding: {spec.no_draft}")
            for row in self.rows:
                row.stats.fallback = spec.no_draft
            return self._plain()
        use_trees = spec.trees
        # Behind a plain step the pending tokens are still being computed:
        # the decision drafts from the tokens emitted so far and reads
        # nothing back, so a declined one leaves mlx-lm's pipeline running.
        pending, t0 = self.pending, time.perf_counter()
        drafts, trees = self._propose(pending, use_trees and pending is not None)
        gamma = self._decide(B, drafts, pending is None)
        if gamma == 0:
            return self._plain()
        self.prompt_cache = caches
        if pending is None and self._ahead_ok(use_trees):
            # The round's window starts with the pending tokens as they are
            # on the device: its graph is built while the step in flight
            # runs, and the drafts after each row's guess are verified
            # whether or not the guess was right (a wrong one rejects them).
            # The call's time less a plain step's is the round's.
            t0 += spec.ctl.plain_cost(B) or 0.0
            return self._round(None, [d[1 : 1 + gamma] for d in drafts], [None] * B, t0)
        if pending is None:
            pending = read_back(self._next_tokens)
            t0 = time.perf_counter()
            self.last_plain_b = 0  # the next plain step does not overlap this one's forward
            # Drafted again after the pending tokens: where the proposals'
            # length bounded γ, they now reach one token further.
            gamma += gamma == max(len(d) for d in drafts) - 1
            drafts, trees = self._propose(pending, use_trees)
            if not any(drafts):
                return self._plain()
        return self._round(pending, [d[:gamma] for d in drafts], trees, t0)

    def _ahead_ok(self, use_trees: bool) -> bool:
        """Whether a round may start before the pending tokens are read:
        not for rows whose logits processors read each window's tokens,
        nor while rounds verify token trees (built on the pending tokens)
        often enough to wait for them (``Policy.trees_wait``)."""
        if any(self.logits_processors):
            return False
        return not (use_trees and self.spec.ctl.trees_wait(len(self.uids)))

    def _decide(self, B: int, drafts: List[List[int]], ahead: bool) -> int:
        """The round's draft length from the rows' proposals (0: plain steps,
        and how many before the next decision). ``ahead``: the proposals
        start at the pending token (their first is a guess at it)."""
        lengths = [max(0, len(d) - ahead) for d in drafts]
        if not any(lengths):
            # Nothing to propose: a plain step, and after a few in a row
            # (open text) pipelined runs that double (2, 4, 8 steps).
            self.misses += 1
            self.plain_left = 1 if self.misses <= MISS_RUN else 1 << min(self.misses - MISS_RUN, 3)
            if self.plain_left >= SQUEEZE_RUN:
                self._squeeze()
            return 0
        self.misses = 0
        spec = self.spec
        gamma = spec.ctl.choose(B, lengths, [r.alpha for r in self.rows], self.idle)
        if gamma == 0:
            # Scored against what the plain steps emit (``Row.check``).
            for i, row in enumerate(self.rows):
                if drafts[i]:
                    row.guess = (len(self.tokens[i]) + (0 if ahead else 1), drafts[i])
            # Doubling while the decisions stay 0 (the controller counts them).
            self.plain_left = min(COST_RUN, 1 << min(max(spec.ctl.declined - 1, 0), 3))
            if self.plain_left >= SQUEEZE_RUN:
                self._squeeze()
        return gamma

    def _squeeze(self) -> None:
        """Squeeze the rounds' holes out of the cache (one gather), so that the
        plain steps of a long run are mlx-lm's own: a holey cache adds a mask
        built on the host to every step, which on a GPU costs a few ms."""
        caches = self.prompt_cache
        if caches and isinstance(caches[0], RaggedKVCache) and caches[0].hole_count():
            plan = caches[0].squeeze_plan()
            for c in caches:
                c.squeeze(plan)

    def _plain(self) -> List[GenerationBatch.Response]:
        """mlx-lm's own step (each row feeds its pending token, one emitted),
        with no Python work per row: rows count plain steps when they leave."""
        self.plain_left = max(0, self.plain_left - 1)
        B = len(self.uids)
        self.steps += 1  # before the step: finished rows settle on filter
        self.idle += 1
        self.pending = None
        t0 = time.perf_counter()
        out = super().next()
        if self.spec is not None and self.last_plain_b == B:
            # Pipelined: this call waited for the previous step's forward
            # (on a GPU the forward it starts runs on after it returns).
            ctl = self.spec.ctl
            n = self.idle
            self.owed = (time.perf_counter() - t0, lambda s: ctl.plain_step(B, s, n))
        self.last_plain_b = len(self.uids) if len(self.uids) == B else 0
        return out

    def _round(
        self,
        pending: Optional[List[int]],
        drafts: List[List[int]],
        trees: List[Any],
        t0: float,
    ) -> List[GenerationBatch.Response]:
        """One verify forward over every row's window, then per-row emission.
        Without ``pending`` the windows start with the pending tokens still
        on the device, read back with the round's results."""
        B = len(self.uids)
        self.idle = 0
        ahead = pending is None
        windows, parents, sizes = self._windows(pending or [0] * B, drafts, trees)
        W = len(windows[0])
        inputs = mx.array(windows, mx.uint32)
        if ahead:
            first = self._next_tokens.reshape(B, 1).astype(mx.uint32)
            inputs = mx.concatenate([first, inputs[:, 1:]], axis=1)
        branching = [not tree_mod.is_chain(p[:n]) for p, n in zip(parents, sizes, strict=True)]
        if not ahead and self.spec.trees:
            self.spec.ctl.trees_drawn(B, any(branching))
        lps, paths, targets, rejected = self._check(inputs, windows, parents, sizes, branching)
        # A new buffer size is a new shape too: attention runs over the buffer.
        self.shape = (B, W, self.prompt_cache[0].keys.shape[2])
        if ahead:
            pending = read_back(self._next_tokens)  # evaluated with the round
            for w, tok in zip(windows, pending, strict=True):
                w[0] = tok
        accepted = [len(p) - 1 for p in paths]
        emitted, finish = self._cut(windows, paths)
        keep_rows(self.prompt_cache, W, [p[: len(t)] for p, t in zip(paths, emitted, strict=True)])
        responses, keep = [], []
        prev_lps = self._next_logprobs
        for i, row in enumerate(self.rows):
            toks, k, a = emitted[i], sizes[i] - 1, accepted[i]
            self._count(i, row, toks, k, a, branching[i], rejected[i])
            row_lps = [prev_lps[i]] + [lps[i][j] for j in range(len(toks) - 1)]
            cache = None
            if finish[i] is not None:
                t = time.perf_counter()
                cache = self.extract_cache(i)
                t0 += time.perf_counter() - t  # a leaving row's cache: not the round's cost
            responses.extend(self._responses(i, toks, row_lps, finish[i], cache))
            if finish[i] is None:
                keep.append(i)
                # Ahead, the drafter holds the tokens before the pending one.
                kept = [windows[i][j] for j in paths[i][0 if ahead else 1 :]] + [targets[i]]
                self._guard(row, self.spec.drafter.accept, row.ctx, kept, a)
                row.told = len(self.tokens[i]) + 1
        self._current_tokens = mx.array(pending, mx.uint32)
        self._current_logprobs = list(prev_lps)
        self._next_tokens = mx.array(targets, mx.uint32)
        self.pending = list(targets)
        self._next_logprobs = [lps[i][accepted[i]] for i in range(B)]
        # Read now (the round's logits are there): a plain step next evaluates
        # them with its own inputs, and on a GPU it would wait for its forward.
        mx.eval(self._next_logprobs)
        ctl, tree, n = self.spec.ctl, any(branching), sum(len(t) for t in emitted)
        self.owed = (time.perf_counter() - t0, lambda s: ctl.verify_round(B, W, s, tree, n))
        self.last_plain_b = 0
        if len(keep) < B:
            self.filter(keep)
        return responses

    def _windows(
        self, pending: List[int], drafts: List[List[int]], trees: List[Any]
    ) -> Tuple[List[List[int]], List[List[int]], List[int]]:
        """Each row's window (pending token, drafts or tree nodes, padding to
        the widest), its parents (a chain: i - 1) and its size before padding."""
        B = len(drafts)
        W = target_mod.padded_width(1 + max(len(d) for d in drafts), self.spec.ctl.widths, B)
        windows, parents, sizes = [], [], []
        trees_pay = any(t is not None for t in trees) and self.spec.ctl.trees_pay(B)
        for i, d in enumerate(drafts):
            par = list(range(-1, len(d)))
            if trees[i] is not None and trees_pay:
                nodes, tpar = trees[i].fill(W)
                if not tree_mod.is_chain(tpar):
                    d, par = nodes, tpar
            sizes.append(1 + len(d))
            window, par = tree_mod.pad([pending[i]] + d, par, W)
            windows.append(window)
            parents.append(par)
        return windows, parents, sizes

    def _check(
        self,
        inputs: mx.array,
        windows: List[List[int]],
        parents: List[List[int]],
        sizes: List[int],
        branching: List[bool],
    ) -> Tuple[List[mx.array], List[List[int]], List[int], List[bool]]:
        """The verify forward and each row's acceptance: log-probs, the
        accepted path (window positions from 0), next token, and whether a
        draft was rejected."""
        B, W = len(windows), len(windows[0])
        contexts = [
            self._token_context[i].tokens if self.logits_processors[i] else None for i in range(B)
        ]
        rules = [r.rule for r in self.rows]
        # The rows' windows without their padding (the pending token first).
        wins = [
            sampling.Window(w[:n], p[:n]) for w, p, n in zip(windows, parents, sizes, strict=True)
        ]
        # On a CUDA GPU the window's attention runs over the caches' whole
        # buffers (``target.padded_attention``): the fused op there builds a
        # cuDNN graph per cache length.
        how = target_mod.attention_policy(batch=True)
        if any(branching):
            # Trees are built on known pending tokens: the windows are the inputs.
            logits = tree_mod.batch_forward(self.model, self.prompt_cache, windows, parents, how)
        else:
            with (
                target_mod.verify_attention(self.model, W, how),
                target_mod.staged(self.model, W),
            ):
                logits = self.model(inputs, cache=self.prompt_cache)
        return verify(logits, wins, rules, self.logits_processors, contexts)

    def _cut(
        self, windows: List[List[int]], paths: List[List[int]]
    ) -> Tuple[List[List[int]], List[Optional[str]]]:
        """Each row's tokens to emit, cut at a stop word or ``max_tokens`` as
        plain steps would, and why it finished (None: it goes on)."""
        emitted, finish = [], []
        for i, path in enumerate(paths):
            toks = [windows[i][j] for j in path]
            reason = None
            for n, tok in enumerate(toks):
                self._num_tokens[i] += 1
                if self._num_tokens[i] >= self.max_tokens[i]:
                    reason = "length"
                if self._matchers[i].advance(tok):
                    reason = "stop"
                if reason:
                    toks = toks[: n + 1]
                    break
            emitted.append(toks)
            finish.append(reason)
        return emitted, finish

    def _count(
        self, i: int, row: Row, toks: List[int], k: int, a: int, tree: bool, rejected: bool
    ) -> None:
        """Row i emitted ``toks`` from a round that verified ``k`` drafts and
        accepted ``a``: its history, its figures and its acceptance estimate."""
        self.tokens[i].extend(toks)
        if self.logits_processors[i]:
            self._token_context[i].update_and_fetch(mx.array(toks, mx.int32))
        st = row.stats
        st.forwards += 1
        st.emitted += len(toks)
        if k:
            st.draft_rounds += 1
            st.drafted += k
            st.accepted += min(a, len(toks) - 1)
            st.tree_rounds += tree
            row.observe(k, a, rejected)

    def _responses(
        self, i: int, toks: List[int], lps: List[Any], finish: Optional[str], cache: Any
    ) -> List[GenerationBatch.Response]:
        """Row i's responses, one per emitted token; the last carries the finish."""
        out = []
        for n, tok in enumerate(toks):
            done = finish if n == len(toks) - 1 else None
            out.append(
                self.Response(
                    uid=self.uids[i],
                    token=tok,
                    logprobs=lps[n],
                    finish_reason=done,
                    prompt_cache=cache if done else None,
                    all_tokens=self.tokens[i] if done else None,
                )
            )
        return out


class SpecBatchGenerator(BatchGenerator):
    """mlx-lm's continuous batching with a drafter: see the module docstring."""

    def __init__(self, model: Any, drafter: Any, gamma: int, gmax: int, **kwargs: Any):
        super().__init__(model, **kwargs)
        with mx.stream(self.stream):  # its tree check runs forwards, as steps do
            self.spec = SpecState(model, drafter, gamma, gmax)
        self._generation_batch = SpecGenerationBatch.empty(self.model, self.sampler)
        self._generation_batch.spec = self.spec

    def _next(self) -> Any:
        prompt_responses, responses = super()._next()
        if prompt_responses:
            # Prompts were processed after the step: the caller's time until
            # the next call is theirs, not the step's.
            batch = self._generation_batch
            batch.owed = batch.called = None
        return prompt_responses, responses

    def insert_segments(self, segments: List[List[List[int]]], *args: Any, **kwargs: Any):
        uids = super().insert_segments(segments, *args, **kwargs)
        for uid in uids:
            self.spec.begin(uid)
        return uids

    def remove(self, uids: List[int], return_prompt_caches: bool = False) -> Any:
        for uid in uids:
            self.spec.stats.pop(uid, None)
        return super().remove(uids, return_prompt_caches)
