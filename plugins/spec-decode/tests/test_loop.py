"""The verify loop on tiny random models: parity with plain greedy decoding,
exact caches after every way a request can stop, rebuilt drafter caches,
fallback on caches that cannot be rolled back."""

import logging

import mlx.core as mx
import pytest
from mlx_lm import load, stream_generate
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

import mlx_lm_ext
from mlx_lm_spec_decode import (
    Drafter,
    DraftModelDrafter,
    NGramDrafter,
    last_stats,
    speculative_generate_step,
)
from mlx_lm_spec_decode.controller import Controller
from mlx_lm_spec_decode.loop import n_target_caches


def stock(model, prompt, n, cache=None):
    return [
        t
        for t, _ in zip(
            (int(t) for t, _ in generate_step(prompt, model, max_tokens=n, prompt_cache=cache)),
            range(n),
            strict=False,
        )
    ]


def spec(model, drafter, prompt, n, k=3, cache=None, **kw):
    return [
        t
        for t, _, _ in speculative_generate_step(
            prompt, model, drafter, num_draft_tokens=k, max_tokens=n, prompt_cache=cache, **kw
        )
    ]


def assert_exact(model, cache, seq):
    """The target part of ``cache`` holds exactly ``seq``: same offset and the
    same next-token logits as a fresh prefill."""
    n_t = n_target_caches(model)
    assert cache[0].offset == len(seq)
    probe = mx.array([[7]])
    got = model(probe, cache=cache[:n_t])[0, -1]
    fresh = model(mx.array(seq + [7])[None])[0, -1]
    assert mx.allclose(got, fresh, atol=1e-4).item()


@pytest.mark.parametrize("which", ["ngram", "draft-model", "self"])
def test_greedy_parity_with_stock(tiny_llama, tiny_draft, which, repetitive_prompt):
    model, tok = tiny_llama
    drafter = {
        "ngram": lambda: NGramDrafter(n_min=1),
        "draft-model": lambda: DraftModelDrafter(tiny_draft),
        "self": lambda: DraftModelDrafter(model, auto_off=False),
    }[which]()
    prompt = repetitive_prompt(tok)
    ref = stock(model, prompt, 40)
    assert spec(model, drafter, prompt, 40) == ref
    s = last_stats()
    assert s.emitted == 40 and s.forwards <= 40 and s.drafted > 0
    if which == "self":  # a drafter that is the target agrees every time
        assert s.accepted == s.drafted and s.tokens_per_forward > 2


@pytest.mark.parametrize("stop_after", [1, 2, 3, 5, 8, 13, 21])
@pytest.mark.parametrize("which", ["ngram", "self"])
def test_cache_exact_after_consumer_close(tiny_llama, which, stop_after, repetitive_prompt):
    model, tok = tiny_llama
    drafter = NGramDrafter(n_min=1) if which == "ngram" else DraftModelDrafter(model)
    prompt = repetitive_prompt(tok)
    cache = make_prompt_cache(model) + drafter.make_cache()
    gen = speculative_generate_step(
        prompt, model, drafter, num_draft_tokens=4, max_tokens=100, prompt_cache=cache
    )
    out = [next(gen)[0] for _ in range(stop_after)]
    gen.close()
    seq = prompt.tolist() + out
    assert_exact(model, cache, seq)
    dcache = cache[n_target_caches(model) :]
    if which == "ngram":
        assert dcache[0].tokens == seq
    else:  # the draft model's cache holds the same tokens as the target's
        assert_exact(model, dcache, seq)


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 16])
def test_cache_exact_after_max_tokens(tiny_llama, max_tokens, repetitive_prompt):
    model, tok = tiny_llama
    drafter = DraftModelDrafter(model)
    prompt = repetitive_prompt(tok)
    cache = make_prompt_cache(model) + drafter.make_cache()
    out = spec(model, drafter, prompt, max_tokens, k=4, cache=cache)
    assert len(out) == max_tokens
    assert_exact(model, cache, prompt.tolist() + out)


@pytest.fixture
def enabled():
    mlx_lm_ext.enable("spec-decode")
    yield
    mlx_lm_ext.disable("spec-decode")


@pytest.mark.parametrize("eos_at", [0, 3, 6, 9])
def test_cache_exact_after_eos_through_stream_generate(
    tiny_llama, enabled, eos_at, repetitive_prompt
):
    model, tok = tiny_llama
    prompt = repetitive_prompt(tok)
    ref = stock(model, prompt, 20)
    eos = ref[eos_at]
    wrapper = TokenizerWrapper(tok._tokenizer, eos_token_ids=[eos])
    drafter = NGramDrafter(n_min=1)
    cache = make_prompt_cache(model) + drafter.make_cache()
    got = [
        r.token
        for r in stream_generate(
            model,
            wrapper,
            prompt,
            max_tokens=50,
            draft_model=drafter,
            num_draft_tokens=4,
            prompt_cache=cache,
        )
    ]
    first = ref.index(eos)
    assert got == ref[: first + 1]
    # mlx-lm's server keys the cache by prompt + every token it got, EOS included.
    assert_exact(model, cache, prompt.tolist() + got)


def test_missing_drafter_caches_are_rebuilt_in_place(tiny_llama, tiny_draft, repetitive_prompt):
    model, tok = tiny_llama
    prompt = repetitive_prompt(tok)
    for drafter in (NGramDrafter(), DraftModelDrafter(tiny_draft)):
        cache = make_prompt_cache(model)  # e.g. a prompt cache saved without them
        out = spec(model, drafter, prompt, 12, cache=cache)
        assert out == stock(model, prompt, 12)
        assert len(cache) == n_target_caches(model) + len(drafter.make_cache())
        # A second turn reuses the stored caches.
        nxt = mx.array(tok.encode(" again one two three"))
        more = spec(model, drafter, nxt, 8, cache=cache)
        assert_exact(model, cache, prompt.tolist() + out + nxt.tolist() + more)


def test_plain_module_left_to_mlx_lm(tiny_llama, tiny_draft, enabled, repetitive_prompt):
    model, tok = tiny_llama
    prompt = repetitive_prompt(tok)
    from mlx_lm_spec_decode import plugin

    assert plugin.speculative_generate_step(prompt, model, tiny_draft, {}) is None
    got = [
        r.token for r in stream_generate(model, tok, prompt, max_tokens=6, draft_model=tiny_draft)
    ]
    assert len(got) == 6


class Wrong(Drafter):
    """Always proposes token 0: every round ends in a rejection and a trim."""

    name = "wrong"
    auto_off = False

    def draft(self, ctx, n):
        return [0] * n, None


@pytest.mark.parametrize("n_prompt", [2, 3, 4, 5, 6, 7])
@pytest.mark.parametrize("which", ["ngram", "wrong"])
def test_rotating_cache_falls_back_with_one_warning(tiny_model, caplog, which, n_prompt):
    model, tok = load(str(tiny_model("gemma3_text")))  # sliding window 8
    prompt = mx.array(tok.encode("one two three one two three one two"))[:n_prompt]
    # While the window fits, the loop verifies (never filling the window: a
    # full RotatingKVCache cannot be trimmed); past it, it decodes plainly.
    ref = stock(model, prompt, 24, cache=make_prompt_cache(model))
    drafter = NGramDrafter(n_min=1) if which == "ngram" else Wrong()
    with caplog.at_level(logging.WARNING, logger="mlx_lm_spec_decode"):
        out = spec(model, drafter, prompt, 24, k=3)
    assert out == ref
    warnings = [r for r in caplog.records if "plain decoding" in r.getMessage()]
    assert len(warnings) == 1
    assert "RotatingKVCache" in last_stats().fallback


class ArraysModel:
    """A wrapper whose cache list looks like an SSM's: not trimmable."""

    def __init__(self, model):
        self.model, self.layers = model, model.layers

    def make_cache(self):
        from mlx_lm.models.cache import ArraysCache

        return make_prompt_cache(self.model) + [ArraysCache(1)]

    def __call__(self, x, cache=None):
        return self.model(x, cache=cache[:-1])


def test_untrimmable_cache_decodes_plainly(tiny_llama, caplog, repetitive_prompt):
    model, tok = tiny_llama
    prompt = repetitive_prompt(tok)
    with caplog.at_level(logging.WARNING, logger="mlx_lm_spec_decode"):
        out = spec(ArraysModel(model), NGramDrafter(n_min=1), prompt, 10)
    assert out == stock(model, prompt, 10)
    assert "ArraysCache" in last_stats().fallback and last_stats().drafted == 0
    assert sum("plain decoding" in r.getMessage() for r in caplog.records) == 1


class HiddenProbe(Drafter):
    """Records the hidden state the loop hands over; proposes the target's own argmax."""

    name = "probe"
    needs_hidden = True
    auto_off = False  # no timing probes: draft() is asked before every step

    def __init__(self):
        self.seen = []

    def draft(self, ctx, n):
        self.seen.append(ctx.hidden)
        return [], None


def test_hidden_state_reaches_drafters_that_ask(tiny_llama, repetitive_prompt):
    model, tok = tiny_llama
    prompt = repetitive_prompt(tok)
    d = HiddenProbe()
    out = spec(model, d, prompt, 4, k=2)
    # Before the first draft: the prefill's state at the last prompt position
    # but one (it predicts the pending last prompt token); before the second,
    # the state at the last prompt position, whose logits produced out[0];
    # before the third, out[0]'s position.
    seqs = (prompt.tolist()[:-1], prompt.tolist(), prompt.tolist() + out[:1])
    assert len(d.seen) >= 3
    for seen, seq in zip(d.seen, seqs, strict=False):
        want = model.model(mx.array(seq)[None])[0, -1:]
        assert mx.allclose(seen, want, atol=1e-4).item()
    one = HiddenProbe()  # a one-token prompt has no state before its token
    assert spec(model, one, prompt[:1], 3, k=2) == stock(model, prompt[:1], 3)
    assert one.seen[0] is None and one.seen[1] is not None


def test_gamma_adapts_and_auto_off_switches(tiny_llama, repetitive_prompt):
    model, tok = tiny_llama
    prompt = repetitive_prompt(tok, 6)
    spec(model, NGramDrafter(n_min=1, max_draft=12), prompt, 60, k=2)
    s = last_stats()
    assert s.gamma_start == 2 and s.gamma != 2

    class Slow(NGramDrafter):  # a drafter that is always wrong costs a full verify
        def draft(self, ctx, n):
            return [0] * n, None

    out = spec(model, Slow(), prompt, 60, k=8)
    assert out == stock(model, prompt, 60)
    s = last_stats()
    # Verifying 9 tokens to keep 1 is slower than one plain step, even tiny.
    assert s.auto_off and s.forwards < 60 + 1


def test_kv_quantization_switches_where_plain_decoding_does(tiny_model, repetitive_prompt):
    from mlx_lm.models.cache import QuantizedKVCache

    model, tok = load(str(tiny_model("llama", head_dim=32)))  # quantizable by groups of 32
    prompt = repetitive_prompt(tok)
    start = prompt.size + 5
    kw = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=start)
    ref = [
        int(t)
        for t, _ in zip(
            (t for t, _ in generate_step(prompt, model, max_tokens=20, **kw)),
            range(20),
            strict=False,
        )
    ]
    drafter = NGramDrafter(n_min=1)
    cache = make_prompt_cache(model) + drafter.make_cache()
    out = spec(model, drafter, prompt, 20, k=4, cache=cache, **kw)
    assert out == ref
    n_t = n_target_caches(model)
    assert all(isinstance(c, QuantizedKVCache) for c in cache[:n_t])  # the caller's list
    assert cache[0].offset == prompt.size + 20


def test_costly_drafter_is_switched_off_after_its_first_timed_drafts(tiny_llama, repetitive_prompt):
    import time as _time

    model, tok = tiny_llama
    prompt = repetitive_prompt(tok)

    class Costly(Drafter):  # right every time, but a step costs more than the target's
        name = "costly"

        def draft(self, ctx, n):
            _time.sleep(0.3 * n)
            return mx.array(
                stock(model, mx.array(ctx.state.setdefault("seq", prompt.tolist())), n)
            ), None

        def accept(self, ctx, tokens, n_drafted):
            ctx.state["seq"] = ctx.state.get("seq", prompt.tolist()) + tokens

    out = spec(model, Costly(), prompt, 40, k=3)
    assert out == stock(model, prompt, 40)
    s = last_stats()  # off for good once DRAFT_SURE timed drafts agree
    assert s.auto_off and s.off_for_good and s.accepted == s.drafted
    assert s.draft_rounds <= Controller.DRAFT_SURE


@pytest.mark.parametrize(
    "verify_cost, off",
    [
        (lambda w: 0.7 + 0.3 * w, False),  # float32 on a CPU: 2 tokens cost 1.3 steps
        (lambda w: 1.0, False),  # a GPU: the window is free
        (lambda w: 0.1 + 0.95 * w, True),  # 4-bit on a CPU: w tokens cost ~w steps
    ],
)
def test_verify_cost_model_switches_off_where_drafting_cannot_pay(verify_cost, off):
    from mlx_lm_spec_decode.controller import Controller

    ctl = Controller(3, 10)
    ctl.update(0, 0, 1.0)
    ctl.update(0, 0, 1.02)
    for k, a in ((3, 3), (3, 1)):  # rounds that accept well
        assert not ctl.switched_off
        ctl.update(k, a, verify_cost(k + 1))
    assert ctl.switched_off == off
    if off:
        # Two timed verifies may have been slowed by other work: a back-off
        # first; off for good once enough verifies agree.
        assert ctl.off_for == Controller.WAIT
        while ctl.off_for < 1 << 30:
            ctl.update(3, 3, verify_cost(4))
        assert len(ctl.verify[1]) <= ctl.VERIFY_SURE + 1
    gain = ctl.best_gain(0.9)
    assert (gain < ctl.SLACK) == off


def test_nothing_to_propose_decodes_in_pipelined_runs(tiny_llama, repetitive_prompt):
    """Open text (no proposals) decodes as stock in one pipelined run, the
    free drafter asked after each token; drafting starts the token after it
    proposes again, not at the end of a run."""
    model, tok = tiny_llama
    prompt = repetitive_prompt(tok)
    n, from_pos = 40, 20
    ref = stock(model, prompt, n)

    class Mute(NGramDrafter):  # no match (open text), then an oracle
        rounds = []

        def draft(self, ctx, k):
            pos = len(ctx.cache[0].tokens) - len(prompt)
            return (ref[pos : pos + k] if pos >= from_pos else []), None

        def accept(self, ctx, tokens, n_drafted):
            if n_drafted:
                Mute.rounds.append(len(ctx.cache[0].tokens) - len(prompt))
            super().accept(ctx, tokens, n_drafted)

    out = spec(model, Mute(auto_off=False), prompt, n, k=3)
    assert out == ref
    s = last_stats()
    assert s.emitted == n and s.accepted > 0
    assert Mute.rounds[0] <= from_pos + 2  # the first round's drafts were accepted


def test_a_steps_graph_is_handed_over_in_stages_only_where_nothing_runs_before_it(
    tiny_llama, repetitive_prompt, monkeypatch
):
    """With staged forwards on (``MLX_LM_SPEC_FLUSH``), a plain step whose
    token is waited for with nothing queued before it (a run's first step;
    every step where logits processors read the tokens) is handed to the
    device layer by layer, as a verify forward is; the steps built behind
    a running one are not. Output as stock's either way."""
    from mlx_lm_ext import api

    model, tok = tiny_llama
    prompt = repetitive_prompt(tok)
    n = 30
    ref = stock(model, prompt, n)
    monkeypatch.setenv("MLX_LM_SPEC_FLUSH", "1")
    stages = []
    real = api.flush_layers
    monkeypatch.setattr(
        api, "flush_layers", lambda m, every: stages.append(every) or real(m, every)
    )

    class Silent(NGramDrafter):  # free, never proposes: plain steps only
        def draft(self, ctx, k):
            return [], None

    assert spec(model, Silent(auto_off=False), prompt, n) == ref
    staged, whole = sum(1 for e in stages if e), sum(1 for e in stages if not e)
    assert staged and whole > staged  # the runs' first steps only
    stages.clear()
    keep = [lambda toks, logits: logits]  # a logits processor: each step waits for the last
    assert spec(model, Silent(auto_off=False), prompt, n, logits_processors=keep) == ref
    assert stages and all(stages)


class GuessFirst(NGramDrafter):
    """An oracle in stretches: nothing to propose at three positions of
    every six, elsewhere a wrong guess at the next token followed by the
    true tokens after it."""

    def __init__(self, ref, n_prompt, **kw):
        super().__init__(**kw)
        self.ref, self.n_prompt = ref, n_prompt

    def draft(self, ctx, k):
        pos = len(ctx.cache[0].tokens) - self.n_prompt
        if pos % 6 < 3 or pos >= len(self.ref):
            return [], None
        return [self.ref[pos] + 1] + self.ref[pos + 1 : pos + k], None


def test_a_run_ends_in_a_round_queued_behind_its_last_step(
    tiny_llama, repetitive_prompt, monkeypatch
):
    """Where verify columns cost nothing (a memory-bound GPU) and a plain
    run meets a proposal, the round is queued behind the step still
    computing the next token: the drafts after the drafter's guess at that
    token are verified from the token itself, so they hold even where the
    guess is wrong (a round that fed the guess keeps nothing, as where
    columns cost compute); output as stock's, and the caches exact
    wherever the consumer stops."""
    from mlx_lm_spec_decode import policy

    model, tok = tiny_llama
    prompt = repetitive_prompt(tok)
    n = 40
    ref = stock(model, prompt, n)
    # Columns priced as costing (the tiny model's measured price may read
    # free on some machines): rounds feed the guess.
    monkeypatch.setattr(policy, "free_columns", lambda cost: False)
    assert spec(model, GuessFirst(ref, prompt.size, auto_off=False), prompt, n, k=4) == ref
    assert last_stats().accepted == 0
    monkeypatch.setattr(policy, "free_columns", lambda cost: True)
    assert spec(model, GuessFirst(ref, prompt.size, auto_off=False), prompt, n, k=4) == ref
    assert last_stats().accepted > 0
    for stop_after in range(1, 16):
        drafter = GuessFirst(ref, prompt.size, auto_off=False)
        cache = make_prompt_cache(model) + drafter.make_cache()
        gen = speculative_generate_step(
            prompt, model, drafter, num_draft_tokens=4, max_tokens=n, prompt_cache=cache
        )
        out = [next(gen)[0] for _ in range(stop_after)]
        gen.close()
        assert out == ref[:stop_after]
        assert_exact(model, cache, prompt.tolist() + out)


class TreeOnly(NGramDrafter):
    """A drafter of token trees whose chains never propose (its contexts
    too short for them): an oracle's tree from ``from_pos`` on."""

    def __init__(self, ref, n_prompt, from_pos, **kw):
        super().__init__(**kw)
        self.ref, self.n_prompt, self.from_pos, self.rounds = ref, n_prompt, from_pos, []

    def draft(self, ctx, k):
        return [], None

    def draft_tree(self, ctx, n):
        pos = len(ctx.cache[0].tokens) - self.n_prompt
        if pos < self.from_pos or pos >= len(self.ref):
            return []
        return [(self.ref[pos : pos + n], 1.0), ([self.ref[pos] + 1], 0.5)]

    def accept(self, ctx, tokens, n_drafted):
        if n_drafted:
            self.rounds.append(len(ctx.cache[0].tokens) - self.n_prompt)
        super().accept(ctx, tokens, n_drafted)


def test_a_run_ends_where_only_a_token_tree_proposes(tiny_llama, repetitive_prompt, monkeypatch):
    """Where verify columns cost nothing, a plain run through text the
    drafter's chains cannot copy ends as soon as its token tree proposes
    (a shorter context, an earlier occurrence), and the next round drafts
    the tree: not plain steps to the end of the request. Output as stock's."""
    from mlx_lm_spec_decode import policy

    model, tok = tiny_llama
    prompt = repetitive_prompt(tok)
    n, from_pos = 40, 16
    ref = stock(model, prompt, n)
    monkeypatch.setattr(policy, "free_columns", lambda cost: True)
    drafter = TreeOnly(ref, prompt.size, from_pos, auto_off=False)
    assert spec(model, drafter, prompt, n, k=4) == ref
    assert last_stats().accepted > 0
    assert drafter.rounds and drafter.rounds[0] <= from_pos + 3, drafter.rounds


def test_drafting_resumes_when_guesses_start_to_hold(tiny_llama, repetitive_prompt, monkeypatch):
    """Switched off by wrong drafts, a free drafter keeps guessing while the
    back-off runs; once its guesses hold, drafting resumes before the
    back-off would have ended (greedy output unchanged)."""
    from mlx_lm_spec_decode import policy

    model, tok = tiny_llama
    prompt = repetitive_prompt(tok)
    n, right_from = 90, 14
    ref = stock(model, prompt, n)

    class Late(NGramDrafter):  # wrong for the first tokens, then an oracle
        def draft(self, ctx, k):
            pos = len(ctx.cache[0].tokens) - len(prompt)
            return ([0] * k if pos < right_from else ref[pos : pos + k]), None

    runs = {}
    for mode, hits in (("guessing", policy.RESUME_HITS), ("back-off only", 1 << 30)):
        monkeypatch.setattr(policy, "RESUME_HITS", hits)
        assert spec(model, Late(), prompt, n, k=8) == ref
        runs[mode] = last_stats()
        print(mode, runs[mode].line())
    assert runs["guessing"].auto_off and runs["back-off only"].auto_off
    assert runs["guessing"].accepted > runs["back-off only"].accepted
    assert runs["guessing"].forwards < runs["back-off only"].forwards


@pytest.mark.parametrize("which", ["ngram", "draft-model"])
def test_padded_chain_windows_match_stock_and_leave_exact_caches(
    tiny_llama, tiny_draft, which, repetitive_prompt, monkeypatch
):
    """Chain windows padded up to a few widths (as on a GPU, forced here with
    MLX_LM_SPEC_WIDTHS): the outputs are stock's, the caches hold exactly
    the sequence, and every verify forward runs at one of the widths (a
    draft is never longer than the widest holds)."""
    monkeypatch.setenv("MLX_LM_SPEC_WIDTHS", "4,8")
    model, tok = tiny_llama
    prompt = repetitive_prompt(tok)
    ref = stock(model, prompt, 40)
    spec(model, NGramDrafter(n_min=1), prompt, 4)  # the model's one-off tree check first
    widths, call = [], type(model).__call__

    def spy(self, inputs, *a, **kw):
        if self is model:
            widths.append(inputs.shape[1])
        return call(self, inputs, *a, **kw)

    if which == "ngram":
        drafter = NGramDrafter(n_min=1, max_draft=10)
    else:
        drafter = DraftModelDrafter(tiny_draft, auto_off=False)
    cache = make_prompt_cache(model) + drafter.make_cache()
    monkeypatch.setattr(type(model), "__call__", spy)
    out = spec(model, drafter, prompt, 40, k=4, cache=cache)
    monkeypatch.setattr(type(model), "__call__", call)
    assert out == ref
    assert_exact(model, cache, prompt.tolist() + out)
    verifies = [w for w in widths[1:] if w > 1]  # the first call is the prompt
    assert verifies and all(w in (4, 8) for w in verifies), verifies  # never past the widest
    assert last_stats().drafted > 0


def test_padding_never_crosses_the_switch_to_a_quantized_cache(
    tiny_model, repetitive_prompt, monkeypatch
):
    monkeypatch.setenv("MLX_LM_SPEC_WIDTHS", "8,16")
    model, tok = load(str(tiny_model("llama", head_dim=32)))
    prompt = repetitive_prompt(tok)
    kw = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=prompt.size + 5)
    ref = [int(t) for t, _ in generate_step(prompt, model, max_tokens=20, **kw)]
    drafter = NGramDrafter(n_min=1)
    cache = make_prompt_cache(model) + drafter.make_cache()
    assert spec(model, drafter, prompt, 20, k=4, cache=cache, **kw) == ref
    assert cache[0].offset == prompt.size + 20


def test_a_drafters_next_request_starts_from_its_timings(tiny_llama, repetitive_prompt):
    """The same drafter on the same target: the second request drafts from
    its first token instead of timing plain steps again (the same tokens);
    a new drafter times them afresh."""
    model, tok = tiny_llama
    prompt = repetitive_prompt(tok)
    ref = stock(model, prompt, 40)

    class Watched(NGramDrafter):  # how many tokens each request emitted before its first draft
        def prefill(self, ctx, tokens):
            super().prefill(ctx, tokens)
            self.first.append(None)

        def draft(self, ctx, n):
            if self.first[-1] is None:
                self.first[-1] = len(ctx.cache[0].tokens) - prompt.size
            return super().draft(ctx, n)

    drafter, fresh = Watched(n_min=1), Watched(n_min=1)
    drafter.first, fresh.first = [], []
    for d in (drafter, drafter, fresh):
        assert spec(model, d, prompt, 40) == ref
    assert drafter.first == [2, 0] and fresh.first == [2], (drafter.first, fresh.first)


def test_a_slow_first_draft_does_not_switch_a_cheap_drafter_off(tiny_llama, repetitive_prompt):
    """A computing drafter whose first draft is slow (a process's first
    builds its kernels) and later ones cheap is not switched off for the
    request as too dear a drafter, nor is its next request, which carries
    the draft step."""
    import time as _time

    model, tok = tiny_llama
    prompt = repetitive_prompt(tok)
    ref = stock(model, prompt, 60)

    class FirstSlow(Drafter):  # the right tokens as an array, the first call slow
        name = "first-slow"
        calls = 0

        def draft(self, ctx, n):
            FirstSlow.calls += 1
            if FirstSlow.calls == 1:
                _time.sleep(0.5)
            pos = len(ctx.state.setdefault("seq", [])) if "seq" in ctx.state else 0
            return mx.array(ref[pos : pos + n] or [0], mx.uint32)[:n], None

        def accept(self, ctx, tokens, n_drafted):
            ctx.state.setdefault("seq", []).extend(tokens)

    drafter = FirstSlow()
    assert spec(model, drafter, prompt, 60, k=3) == ref
    first = last_stats()  # its slow round may cost a back-off, not the request
    assert not first.off_for_good and first.drafted > 0, first
    assert spec(model, drafter, prompt, 60, k=3) == ref
    again = last_stats()  # the carried draft step: cheap, never judged too dear
    assert not again.off_for_good and again.accepted == again.drafted > 0, again


@pytest.mark.parametrize("pair", [False, True])
def test_slow_first_verifies_of_each_width_leave_drafting_on(
    tiny_model, repetitive_prompt, monkeypatch, pair
):
    """A process's first verify of each width builds its kernels (on a GPU,
    several plain steps): judged on those, the verify looked too dear to
    ever pay, drafting went off for good and every later request of the
    drafter inherited the verdict. Those rounds time nothing, neither the
    verify's cost nor drafting's rate: drafting stays on, in this request
    and the next ones."""
    import time as _time

    from mlx_lm_spec_decode import LookupFirst
    from mlx_lm_spec_decode.loop import VerifyLoop

    model, tok = load(str(tiny_model("llama")))  # a fresh target: no shape built yet
    prompt = repetitive_prompt(tok, 6)
    ref = stock(model, prompt, 120)
    built, forward = set(), VerifyLoop.forward

    def building(self, tokens, *a):
        if tokens.size > 1 and tokens.size not in built:
            built.add(tokens.size)
            _time.sleep(0.05)
        return forward(self, tokens, *a)

    monkeypatch.setattr(VerifyLoop, "forward", building)

    class Wrong(Drafter):  # a model drafter that reads hidden states, never right
        name = "wrong"
        needs_hidden = True

        def draft(self, ctx, n):
            return mx.array([0] * n, mx.uint32), None

    lookup = NGramDrafter(n_min=1)
    drafter = LookupFirst(Wrong(), lookup) if pair else lookup
    for _ in range(3):
        assert spec(model, drafter, prompt, 120) == ref
        s = last_stats()
        assert not s.off_for_good and s.accepted >= 80, s
