"""The per-request summary says what happened: drafted, accepted, tokens per
forward, the drafting rounds' measured speed against the request's own plain
steps, and each time drafting switched itself off (when, why, and whether it
came back on)."""

import mlx.core as mx
import pytest
from mlx_lm import load

from mlx_lm_spec_decode import DraftModelDrafter, NGramDrafter, speculative_generate_step
from mlx_lm_spec_decode.controller import Controller
from mlx_lm_spec_decode.stats import SpecStats


def _run(model, drafter, prompt, n):
    gen = speculative_generate_step(prompt, model, drafter, max_tokens=n, num_draft_tokens=3)
    return [int(t) for t, _, _ in gen]


def test_a_switch_off_that_ended_is_not_reported_as_final():
    st = SpecStats("ngram", 3)
    st.emitted = 5
    st.switched_off("its last 4 rounds took 1.10x a plain step per token", for_good=False)
    st.plain_run(32, 1.6)  # the back-off: 32 plain steps, 20 tokens/s
    st.emitted = 37
    st.drafting_round(4, 0.1)  # drafting is back: 40 tokens/s
    st.emitted = 41
    line = st.line()
    assert "off at token 5 (its last 4 rounds took 1.10x a plain step per token)" in line
    assert "on again at token 37" in line
    assert "to the end" not in line and "rest of the request" not in line
    assert "drafting rounds 40.0 tokens/s, 2.00x this request's plain steps (20.0 tokens/s)" in line
    assert st.as_dict()["on_again_at"] == [37] and st.as_dict()["speedup"] == 2.0


def test_a_request_that_ends_off_says_so_and_since_when():
    st = SpecStats("ngram", 3)
    st.drafting_round(2, 0.1)
    st.emitted = 12
    st.switched_off("a verify forward costs too many plain steps to gain", for_good=True)
    st.plain_run(20, 1.0)
    assert not st.on_again_at
    assert "off for the rest of the request from token 12 (a verify forward" in st.line()
    back_off = SpecStats("ngram", 3)
    back_off.switched_off("x", for_good=False)
    assert "off from token 0 to the end (x)" in back_off.line()


def test_a_request_that_never_switched_off_says_drafting_stayed_on():
    st = SpecStats("ngram", 3)
    st.drafting_round(3, 0.1)
    assert "drafting stayed on" in st.line() and "switched" not in st.line()
    assert "no plain steps timed" in st.line()


@pytest.fixture(scope="module")
def smollm2(smollm2_f32_path):
    return load(str(smollm2_f32_path))


def _prompt(tok, text):
    return mx.array(
        tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    )


@pytest.mark.slow
def test_pipelined_plain_steps_reach_the_controller_at_their_real_cost(smollm2, monkeypatch):
    """Steps of a pipelined run read in pairs when timed one by one (two
    forwards, then almost nothing); the near-zero one, taken as a plain
    step's cost, made every verify look several steps dear and switched
    drafting off on prompts where it ran at 1.8x."""
    model, tok = smollm2
    plain = []
    update = Controller.update

    def spy(self, k, a, dt, trials=None):
        if k == 0:
            plain.append(dt)
        return update(self, k, a, dt, trials)

    monkeypatch.setattr(Controller, "update", spy)

    class Mute(NGramDrafter):
        def draft(self, ctx, k):
            return [], None  # never proposes: misses, then pipelined runs of 2, 4, 8

    _run(model, Mute(), _prompt(tok, "Write a haiku about autumn rain."), 24)
    # 24 plain steps: two probes and four single misses timed one by one,
    # then pipelined runs (2, 4, 8, 4) whose steps each get their run's mean.
    assert len(plain) == 24
    assert len(plain) - len(set(plain)) >= 10, [round(t * 1e3, 1) for t in plain]


@pytest.mark.slow
def test_a_drafter_as_dear_as_the_target_is_off_from_a_named_token(smollm2):
    import time

    model, tok = smollm2

    class Dearer(DraftModelDrafter):  # the target drafting for itself, and slower
        def draft(self, ctx, n):
            time.sleep(0.5 * n)  # dearer than a target step, even on a loaded machine
            return super().draft(ctx, n)

    # Off once its first timed drafts agree (Controller.DRAFT_SURE rounds).
    out = _run(model, Dearer(model), _prompt(tok, "List three uses of a paperclip."), 32)
    from mlx_lm_spec_decode import last_stats

    st = last_stats()
    assert st.emitted == len(out) == 32
    assert len(st.off_at) == 1 and st.off_at[0] < 32 and st.off_for_good and not st.on_again_at
    assert (
        f"off for the rest of the request from token {st.off_at[0]} "
        "(a draft step costs about as much as a target step)"
    ) in st.line()
    assert st.plain_tokens >= 32 - st.off_at[0]


def _watch(tokens, guess_len):
    """Feed ``tokens`` to a resume watch whose drafter always guesses the
    next ``guess_len`` of them right; the token count at which it says resume."""
    from mlx_lm_spec_decode.policy import resume_watch

    seen = []
    watch = resume_watch(lambda: tokens[len(seen) : len(seen) + guess_len], lambda: seen[-1])
    for t in tokens:
        seen.append(t)
        if watch():
            return len(seen)
    return None


def test_short_guesses_that_keep_holding_resume_drafting():
    """An n-gram drafter's guesses are often two tokens long: while they keep
    holding, drafting resumes after three kept tokens as it does for long
    guesses (before, a two-token guess could never reach three hits, and a
    copying answer stayed off for the whole back-off)."""
    tokens = list(range(100, 140))
    assert _watch(tokens, 2) is not None and _watch(tokens, 2) <= 6
    assert _watch(tokens, 8) is not None and _watch(tokens, 8) <= 6


def test_guesses_that_miss_never_resume_drafting():
    from mlx_lm_spec_decode.policy import resume_watch

    seen = []
    watch = resume_watch(lambda: [0, 0], lambda: seen[-1])
    for t in range(1, 40):
        seen.append(t)
        assert not watch()


def test_a_watch_scores_each_guess_as_a_round_would_have_kept_it():
    """Each guess that ends (a miss, or kept to its end) is reported with how
    many of its tokens were kept: what the batch's rows learn their
    acceptance from while drafting is off."""
    from mlx_lm_spec_decode.policy import resume_watch

    tokens, seen, scores = list(range(100, 130)), [], []
    watch = resume_watch(
        lambda: tokens[len(seen) : len(seen) + 2] + [0],  # two right, then wrong
        lambda: seen[-1],
        lambda k, a: scores.append((k, a)),
    )
    for t in tokens:
        seen.append(t)
        watch()
    assert scores and set(scores) == {(3, 2)}
