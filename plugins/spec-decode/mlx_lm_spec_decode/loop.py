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
  doubling back-off) while it measures slower than plain decoding.
"""

import logging
import time
from collections import deque

import mlx.core as mx
from mlx_lm.generate import generation_stream, maybe_quantize_kv_cache
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from . import sampling
from . import stats as stats_mod
from . import target as target_mod
from .drafter import DraftContext

log = logging.getLogger("mlx_lm_spec_decode")

# Drafting rounds in a row with nothing proposed before plain steps come in
# pipelined runs: a copy's short gaps (a renamed word) stay single steps.
MISS_RUN = 4


def n_target_caches(model):
    return len(model.make_cache()) if hasattr(model, "make_cache") else len(model.layers)


def window_room(caches):
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


class Controller:
    """Adaptive draft length and the measured on/off switch."""

    WINDOW = 16  # recent drafting rounds compared against plain steps
    MIN_ROUNDS = 4  # drafting rounds measured before the first decision
    RETRY_ROUNDS = 3  # ... and after each retry
    SLACK = 1.03  # drafting must be at least this much slower to switch off
    BACKOFF = 32  # tokens decoded plainly before drafting is tried again
    # A draft step costing this fraction of a plain target step or more cannot
    # pay off: a verify over 2+ tokens already costs more than one step.
    DRAFT_COST = 0.8
    # The verify side of the same question: where a forward over w tokens
    # costs nearly w plain steps (MLX's CPU kernel for quantized weights),
    # even a drafter that is right this often gains nothing, so drafting
    # stays off for the request instead of retrying after each back-off.
    BEST_ACCEPT = 0.9
    VERIFY_SAMPLES = 2  # verify rounds timed before this is judged

    def __init__(self, gamma, gmax, adaptive=True, auto_off=True):
        self.gmax = max(1, gmax)
        self.gamma = max(1, min(gamma, self.gmax))
        self.adaptive, self.auto_off = adaptive, auto_off
        self.spec = deque(maxlen=self.WINDOW)  # (seconds, tokens)
        self.verify = deque(maxlen=8)  # (window width, seconds of the verify forward)
        self.plain = deque(maxlen=5)  # seconds per plain step
        # Time two plain steps first: every decision compares against them.
        self.probe = 2 if auto_off else 0
        self.draft_step = None  # seconds per draft token, when measurable
        self.timed = 0  # drafting rounds whose draft was timed on its own
        self.rounds = 0
        self.backoff = self.BACKOFF
        self.off_for = 0
        self.switched_off = False
        self.need = self.MIN_ROUNDS

    def want(self):
        if self.probe > 0:
            self.probe -= 1
            return 0
        if self.auto_off and self.draft_step is None and self.timed == 0:
            return 1  # the first timed draft: one step tells its cost
        return self.gamma

    def time_draft(self):
        """Whether to evaluate this round's (lazy) drafts on their own, to time them."""
        return self.auto_off and self.timed < 2

    def free_drafts(self):
        """The drafter computes nothing on the device (n-gram lookup)."""
        self.timed = 2

    def drafted(self, k, seconds):
        self.timed += 1
        self.draft_step = seconds / k

    def _switch_off(self, for_good=False):
        # Too costly a drafter stays off (the machine will not change within
        # a request); too little acceptance is retried after a back-off.
        self.off_for = (1 << 30) if for_good else self.backoff
        self.backoff *= 2
        self.switched_off = True
        self.spec.clear()
        self.need = self.RETRY_ROUNDS
        self.timed = min(self.timed, 1)  # time one more draft on retry
        self.probe = 1

    def best_gain(self, accept):
        """Best tokens/s of drafting relative to plain decoding, over draft
        lengths 1..gmax, if each draft token is right with probability
        ``accept``; ``None`` until enough steps are timed.

        The cost of a verify over w tokens is modelled as ``a + b * w`` plain
        seconds, with b the cheapest marginal cost seen (other processes only
        ever make a forward slower, so the fastest samples are the truest).
        """
        if len(self.plain) < 2 or len([w for w, _ in self.verify if w > 1]) < self.VERIFY_SAMPLES:
            return None
        p = min(self.plain)
        b = max(0.0, min((t - p) / (w - 1) for w, t in self.verify if w > 1))
        a = p - b
        d = self.draft_step or 0.0
        best = 0.0
        for g in range(1, self.gmax + 1):
            tokens = (1 - accept ** (g + 1)) / (1 - accept)
            best = max(best, tokens * p / (a + b * (g + 1) + d * g))
        return best

    def verify_cannot_pay(self):
        gain = self.best_gain(self.BEST_ACCEPT)
        return gain is not None and gain < self.SLACK

    def update(self, k, a, dt):
        if k == 0:
            self.plain.append(dt)
            return
        self.rounds += 1
        self.spec.append((dt, a + 1))
        self.verify.append((k + 1, dt - k * (self.draft_step or 0.0)))
        if self.adaptive:
            # No growth before the verify cost is judged: a wide first window
            # is what costs most where windows are not cheap.
            grow = 2 if not self.auto_off or self.best_gain(self.BEST_ACCEPT) is not None else 0
            self.gamma = min(self.gamma + grow, self.gmax) if a == k else max(1, self.gamma - 1)
        if not self.auto_off:
            return
        # Measure a plain step now and then: a draft model never yields one,
        # and other processes on the machine change both figures over time.
        if self.rounds == 2:
            self.probe = 2
        elif self.rounds % 12 == 0:
            self.probe = 1
        if not self.plain:
            return
        plain = sorted(self.plain)[(len(self.plain) - 1) // 2]
        if self.draft_step is not None and self.draft_step >= self.DRAFT_COST * plain:
            self._switch_off(for_good=True)
        elif self.verify_cannot_pay():
            self._switch_off(for_good=True)
        elif len(self.plain) >= 2 and len(self.spec) >= self.need:
            spec = sum(t for t, _ in self.spec) / sum(n for _, n in self.spec)
            if spec > plain * self.SLACK:
                self._switch_off()


def speculative_generate_step(
    prompt,
    model,
    drafter,
    stream=generation_stream,
    *,
    num_draft_tokens=2,
    max_tokens=256,
    sampler=None,
    logits_processors=None,
    prompt_cache=None,
    prefill_step_size=512,
    kv_bits=None,
    kv_group_size=64,
    quantized_kv_start=5000,
):
    """Yield ``(token, logprobs[V], from_draft)`` as mlx-lm's speculative loop does."""
    tokens = prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
    if not tokens:
        raise ValueError("speculative decoding needs a non-empty prompt")
    n_t = n_target_caches(model)
    if prompt_cache is None:
        prompt_cache = make_prompt_cache(model) + drafter.make_cache()
    target_cache = prompt_cache[:n_t]
    dcache = prompt_cache[n_t:]
    if not drafter.cache_ok(dcache):
        if dcache:
            log.info("spec-decode: drafter caches in the prompt cache do not fit; rebuilt")
        dcache = drafter.make_cache()
        prompt_cache[n_t:] = dcache
    kind, temp, filt = sampling.describe(sampler)
    sampler = sampler or greedy_sampler
    split = None
    if drafter.needs_hidden:
        split = target_mod.split(model)
        if split is None:
            raise ValueError(f"the {drafter.name} drafter needs the target's hidden states, "
                             f"which this architecture does not expose in mlx-lm's usual layout")
    attention = target_mod.attention_policy()  # a bad MLX_LM_SPEC_ATTENTION fails here
    ctx = DraftContext(model, target_cache, dcache, temp=temp or 0.0, filter=filt)
    ctl = Controller(
        num_draft_tokens,
        max(num_draft_tokens, drafter.max_draft),
        adaptive=getattr(drafter, "adaptive", True),
        auto_off=getattr(drafter, "auto_off", True),
    )
    st = stats_mod.SpecStats(drafter.name, gamma_start=ctl.gamma, gamma=ctl.gamma)
    stats_mod.start(st)

    def quantize(caches):
        maybe_quantize_kv_cache(caches, quantized_kv_start, kv_group_size, kv_bits)
        if kv_bits is not None:
            # The caller's list must see the quantized caches (mlx-lm's own
            # loop quantizes a slice copy, and the server stores stale ones).
            prompt_cache[:n_t] = caches

    context = list(tokens) if logits_processors else None
    match_checked = False

    def forward(y_and_drafts):
        x = y_and_drafts[None]
        with target_mod.verify_attention(model, x.shape[1], attention):
            if split is None:
                return model(x, cache=target_cache)[0], None
            h = split[0](x, target_cache)
        return split[1](h)[0], h[0]

    def step(tok):
        logits, hidden = forward(mx.array([tok], mx.uint32))
        quantize(target_cache)
        lp = _logprobs(logits, logits_processors, context, None)[0]
        return sampler(lp[None]).reshape(-1), lp, hidden

    def plain(n, t0=None):
        """Plain decoding of n tokens, pipelined as mlx-lm's generate_step.

        Each token is fed before it is yielded, except the last one, which
        stays pending in ``y`` (as after a verify round)."""
        nonlocal y
        nxt = step(y)
        mx.async_eval(nxt[:2])
        for i in range(n):
            tok_arr, lp, hidden = nxt
            tok = tok_arr.item()
            if t0 is not None:
                now = time.perf_counter()
                ctl.update(0, 0, now - t0)
                t0 = now
            if context is not None:
                context.append(tok)
            if hidden is not None:
                ctx.hidden = hidden[-1:]
            if i + 1 < n:
                nxt = step(tok)
                mx.async_eval(nxt[:2])
            st.forwards += 1
            st.emitted += 1
            counts["emitted"] += 1
            counts["told"] += 1
            y = tok
            drafter.accept(ctx, [tok], 0)
            yield tok, lp, False

    counts = {"emitted": 0, "told": 0}
    warned = False
    misses = 0  # drafting rounds in a row with nothing proposed
    start = _offset(target_cache)
    with mx.stream(stream):
        for s in range(0, len(tokens) - 1, prefill_step_size):
            chunk = mx.array(tokens[s : min(s + prefill_step_size, len(tokens) - 1)], mx.uint32)[None]
            if split is None:
                model(chunk, cache=target_cache)
            else:
                # A drafter reading hidden states gets the state at the last
                # prompt position (the one that predicts the pending token),
                # so it drafts from the first step; nobody reads the prompt's
                # logits, so the lm-head is skipped.
                ctx.hidden = split[0](chunk, target_cache)[0, -1:]
            quantize(target_cache)
            mx.eval([c.state for c in target_cache] + ([ctx.hidden] if ctx.hidden is not None else []))
        drafter.prefill(ctx, tokens)
        y = tokens[-1]
        try:
            while max_tokens < 0 or counts["emitted"] < max_tokens:
                remaining = max_tokens - counts["emitted"] if max_tokens >= 0 else 1 << 30
                room = window_room(target_cache)
                if room < 2:
                    if not warned:
                        reason = ("the prompt cache cannot be rolled back "
                                  f"({', '.join(sorted({type(c).__name__ for c in target_cache}))}"
                                  f"{', past its window' if room == 1 else ''})")
                        log.warning(f"spec-decode: plain decoding for the rest of this request: {reason}")
                        st.fallback = reason
                        warned = True
                    yield from plain(remaining)
                    break
                if ctl.off_for > 0:
                    st.auto_off = True
                    n = min(ctl.off_for, remaining)
                    ctl.off_for = 0
                    yield from plain(n)
                    continue
                limit = min(remaining - 1, room - 1)
                if kv_bits is not None and start is not None:
                    off = _offset(target_cache)
                    if off < quantized_kv_start:
                        # Never straddle the switch to a quantized cache: plain
                        # decoding quantizes right at quantized_kv_start.
                        limit = min(limit, quantized_kv_start - off - 1)
                k_req = min(ctl.want(), limit)
                t0 = time.perf_counter()
                if k_req <= 0:
                    yield from plain(1, t0)
                    continue
                drafts, q = drafter.draft(ctx, k_req)
                if not isinstance(drafts, mx.array):
                    ctl.free_drafts()
                    drafts = mx.array(drafts, mx.uint32)
                elif drafts.size and ctl.time_draft():
                    # A drafter that computes (a draft model): time its steps.
                    mx.eval(drafts)
                    ctl.drafted(drafts.size, time.perf_counter() - t0)
                k = drafts.size
                if k == 0:
                    # Nothing to propose: one plain step, and after a few in
                    # a row (open text, not the short gaps of a copy) a
                    # pipelined run that doubles (2, 4, 8 tokens), so open
                    # text costs what mlx-lm's loop costs. (A drafter reading
                    # hidden states is asked every step.)
                    misses = 0 if drafter.needs_hidden else misses + 1
                    run = 1 if misses <= MISS_RUN else 1 << min(misses - MISS_RUN, 3)
                    yield from plain(min(run, remaining), t0)
                    continue
                misses = 0
                window = mx.concatenate([mx.array([y], mx.uint32), drafts.astype(mx.uint32)])
                logits, hidden = forward(window)
                quantize(target_cache)
                lp = _logprobs(logits, logits_processors, context, drafts)
                if kind == "explicit":
                    keep, res, bonus = sampling.verify_explicit(lp, drafts, q, temp, filt)
                    mx.eval(keep, res, bonus, drafts)
                    keep = keep.tolist()
                    a = keep.index(False) if False in keep else k
                    target_tok = res.tolist()[a] if a < k else bonus.item()
                else:
                    t = sampling.verify_greedy(lp, drafts) if kind == "greedy" else _match(lp, sampler, match_checked)
                    match_checked = True
                    # The logprobs rows stay lazy: only a consumer that reads them pays.
                    mx.eval(t, drafts)
                    t = t.tolist()
                    d = drafts.tolist()
                    a = 0
                    while a < k and t[a] == d[a]:
                        a += 1
                    target_tok = t[a]
                d = drafts.tolist()
                dt = time.perf_counter() - t0
                if k - a:
                    trim_prompt_cache(target_cache, k - a)
                out = d[:a] + [target_tok]
                st.forwards += 1
                st.draft_rounds += 1
                st.drafted += k
                st.accepted += a
                ctl.update(k, a, dt)
                st.gamma = ctl.gamma
                if hidden is not None:
                    ctx.hidden = hidden[a : a + 1]
                drafter.accept(ctx, out, a)
                counts["told"] += len(out)
                if context is not None:
                    context.extend(out)
                y = target_tok
                for i, tok in enumerate(out):
                    st.emitted += 1
                    counts["emitted"] += 1
                    yield tok, lp[i], i < a
        finally:
            _settle(model, target_cache, drafter, ctx, start, len(tokens), counts, y, quantize)
            st.gamma = ctl.gamma
            log.info(st.line())


def _logprobs(logits, logits_processors, context, drafts):
    if not logits_processors:
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    rows = []
    ctx_arr = mx.array(context, mx.uint32)
    for i in range(logits.shape[0]):
        toks = mx.concatenate([ctx_arr, drafts[:i].astype(mx.uint32)]) if i and drafts is not None else ctx_arr
        row = logits[i : i + 1]
        for proc in logits_processors:
            row = proc(toks, row)
        rows.append(row)
    logits = mx.concatenate(rows, axis=0)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _match(lp, sampler, checked):
    if not checked:
        sampling.check_sampler(sampler, lp.shape[-1])
    return sampling.verify_match(lp, sampler)


def _settle(model, target_cache, drafter, ctx, start, n_prompt, counts, y, quantize):
    """Leave target and drafter caches holding exactly prompt + yielded tokens."""
    emitted = counts["emitted"]
    actual = _offset(target_cache)
    if start is not None and actual is not None:
        extra = actual - (start + n_prompt + emitted)
        if extra > 0:
            trim_prompt_cache(target_cache, extra)
        elif extra == -1:
            # The last yielded token came from the target and was never fed.
            model(mx.array([[y]], mx.uint32), cache=target_cache)
            quantize(target_cache)
            mx.eval([c.state for c in target_cache])
        elif extra < -1:
            log.warning(f"spec-decode: target cache is {-extra} tokens short of the sequence")
    told = counts["told"]
    if told > emitted:
        drafter.trim(ctx, told - emitted)
    drafter.flush(ctx)
