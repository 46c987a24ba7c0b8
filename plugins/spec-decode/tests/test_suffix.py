"""The suffix drafter: its indexes against brute force, scoring, the corpus
cap, one corpus per model, greedy identity, the flag, and the server."""

import copy
import random

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from test_commands import run_generate, server  # noqa: F401  (the server fixture)

from mlx_lm_spec_decode import (
    DraftContext,
    SuffixCache,
    SuffixCorpus,
    SuffixDrafter,
    last_stats,
    scoring,
    speculative_generate_step,
)
from mlx_lm_spec_decode import suffix as sx


def brute_candidates(source, ctx, k, lo=0, docs=None):
    """Every position in ``source`` (a list, None = outside the corpus)
    whose k preceding tokens end ``ctx``, newest first, with match lengths."""
    out = []
    for p in range(len(source) - 1, lo - 1, -1):
        if p - k < lo or source[p] is None:
            continue
        m = 0
        while (
            m < min(sx.MAX_MATCH, len(ctx), p - lo)
            and source[p - 1 - m] is not None
            and source[p - 1 - m] == ctx[len(ctx) - 1 - m]
        ):
            m += 1
        if m >= k:
            out.append((m, p))
    return out[: sx.CHAIN]


def test_request_index_matches_brute_force_under_extend_and_trim():
    rng = random.Random(0)
    c, ref = SuffixCache(k=2), []
    for _ in range(400):
        if ref and rng.random() < 0.3:
            n = rng.randint(1, min(5, len(ref)))
            assert c.trim(n) == n
            del ref[-n:]
        else:
            toks = [rng.randint(0, 4) for _ in range(rng.randint(1, 4))]
            c.extend(toks)
            ref.extend(toks)
        assert c.tokens == ref
        got = c.candidates()
        want = [(m, p) for m, p in brute_candidates(ref, ref, 2) if p < len(ref)]
        assert got == want[: len(got)] and len(got) == min(len(want), sx.CHAIN)
    # The restored copy (state round trip) indexes the same.
    r = SuffixCache.from_state(c.state, c.meta_state)
    assert r.candidates() == c.candidates() and copy.deepcopy(c).tokens == c.tokens


def test_corpus_lookup_matches_brute_force():
    rng = random.Random(1)
    corpus = SuffixCorpus(cap=10_000, k=3)
    flat = []
    for _ in range(40):
        doc = [rng.randint(0, 5) for _ in range(rng.randint(1, 60))]
        corpus.add(doc)
        flat += [None] + doc  # the separator
    for _ in range(50):
        ctx = [rng.randint(0, 5) for _ in range(rng.randint(3, 12))]
        want = brute_candidates(flat, ctx, 3)
        # Newest first, never a wrong match; a bucket that other keys share
        # spends chain steps on them, so the newest CHAIN may be fewer.
        got = corpus.candidates(ctx)
        assert got == want[: len(got)] and len(got) >= min(len(want), sx.CHAIN // 2)


def test_scoring_follows_the_most_frequent_continuation():
    corpus = SuffixCorpus(cap=1000, k=2)
    for tail in ([7, 8, 9], [7, 8, 9], [7, 8, 9], [5, 6]):
        corpus.add([1, 2, 3, 4] + tail)
    cands = corpus.candidates([0, 1, 2, 3, 4])
    toks, m = scoring.chain_draft(cands, corpus.follow, 8, alpha=2.0, min_score=0.3)
    assert toks == [7, 8, 9] and m == 4  # 3 of 4 agree: score 0.75
    # An even split of four ways is not confident: nothing.
    split = SuffixCorpus(cap=1000, k=2)
    for t in (5, 6, 7, 8):
        split.add([1, 2, 3, 4, t])
    toks, _ = scoring.chain_draft(split.candidates([1, 2, 3, 4]), split.follow, 8, 2.0, 0.3)
    assert toks == []


def test_draft_length_grows_with_the_match():
    corpus = SuffixCorpus(cap=1000, k=2)
    corpus.add(list(range(100, 140)))
    short = scoring.chain_draft(corpus.candidates([0, 110, 111]), corpus.follow, 16, 2.0, 0.3)
    long = scoring.chain_draft(
        corpus.candidates(list(range(100, 112))), corpus.follow, 16, 2.0, 0.3
    )
    assert short == ([112, 113, 114, 115], 2)
    assert long == (list(range(112, 128)), 12)


def test_corpus_at_its_cap_evicts_oldest_first_and_never_grows():
    corpus = SuffixCorpus(cap=64, k=2)
    docs = [[d * 100 + i for i in range(20)] for d in range(10)]
    for doc in docs:
        corpus.add(doc)
        assert len(corpus) <= 64
    assert len(corpus) == 64 and corpus.nbytes == 4 * 64 + 8 * 64 + 8 * 64
    # 21 slots a document: the last three fit, the fourth from last partly.
    assert corpus.candidates(docs[0][:5]) == []
    assert corpus.candidates(docs[6][:5]) == []
    assert corpus.candidates(docs[9][:5]) == [(5, corpus.end - 15)]
    assert corpus.candidates(docs[7][:5]) != []
    # A document larger than the cap keeps its newest tokens.
    corpus.add(list(range(1000, 1200)))
    assert len(corpus) == 64 and corpus.candidates([1100, 1101]) == []
    assert corpus.follow(corpus.candidates([1190, 1191])[0][1]) == 1192


def test_one_corpus_per_model_and_tokenizer(tiny_model):
    m1, tok = load(str(tiny_model("llama")))
    m2, _ = load(str(tiny_model("llama")))
    d = SuffixDrafter(corpus_tokens=5000, tokenizer=tok)
    assert d.corpus_of(m1) is d.corpus_of(m1) is SuffixDrafter(5000, tokenizer=tok).corpus_of(m1)
    assert d.corpus_of(m1) is not d.corpus_of(m2)
    assert sx.tokenizer_key(tok) is not None
    other = SuffixDrafter(corpus_tokens=5000)
    other.tok_key = "another tokenizer"
    assert other.corpus_of(m1) is not d.corpus_of(m1)
    d.corpus_of(m1).add([1, 2, 3, 4, 5])
    assert d.corpus_of(m2).candidates([1, 2, 3, 4]) == []
    n = len(sx._CORPORA)
    del m2, d, other
    import gc

    gc.collect()
    assert len(sx._CORPORA) < n  # a model's corpus goes with it


def test_request_text_wins_over_the_corpus():
    corpus = SuffixCorpus(cap=1000)
    corpus.add([1, 2, 3, 4, 50, 51, 52])
    d = SuffixDrafter(corpus=corpus)
    cheap = (0.95, 0.05)  # a measured verify cost where wide drafts are cheap
    ctx = DraftContext(None, [], d.make_cache(), verify_cost=cheap)
    d.prefill(ctx, [1, 2, 3, 4, 60, 61, 62, 9, 1, 2, 3, 4])
    assert d.draft(ctx, 3) == ([60, 61, 62], None)
    ctx2 = DraftContext(None, [], d.make_cache(), verify_cost=cheap)
    d.prefill(ctx2, [9, 9, 1, 2, 3, 4])
    assert d.draft(ctx2, 3) == ([50, 51, 52], None)
    # The end of the request: only its new part goes into the corpus, once.
    d.accept(ctx2, [50, 51], 2)
    before = len(corpus)
    d.flush(ctx2)
    d.flush(ctx2)
    assert len(corpus) == before + 1 + 8


def test_draft_length_follows_confidence_and_verify_cost():
    shares = [1.0] * 16
    cheap, dear = (0.94, 0.065), (0.0, 1.0)  # a CPU's float32; verify costs w steps
    assert scoring.draft_length(0.95, shares, cheap, 1.05) == 16
    assert 0 < scoring.draft_length(0.6, shares, cheap, 1.05) < 8
    assert scoring.draft_length(0.1, shares, cheap, 1.05) == 0  # no evidence: nothing
    assert scoring.draft_length(0.95, shares, dear, 1.05) == 0
    # A split among the occurrences lowers the odds of what follows it.
    split = scoring.draft_length(0.6, [1.0, 0.3, 1.0, 1.0], cheap, 1.05)
    assert split < scoring.draft_length(0.6, [1.0] * 4, cheap, 1.05) == 4


def test_a_bucket_that_keeps_missing_goes_silent_and_is_still_checked():
    d = SuffixDrafter(corpus=SuffixCorpus(cap=1000))
    ctx = DraftContext(None, [], d.make_cache(), verify_cost=(0.94, 0.065))
    d.prefill(ctx, [5, 6, 7, 1, 2, 8, 9])
    misses = 0
    for t in range(100, 120):  # "1 2" keeps following something new
        d.accept(ctx, [1, 2], 0)
        if d.draft(ctx, 8)[0]:
            d.accept(ctx, [t], 0)
        else:
            misses += 1
            d.accept(ctx, [t], 0)
    assert misses > 10
    rate = ctx.state["rates"][("request", 2)]
    assert rate[1] > rate[0]  # the silent guesses were checked: rejections counted


def greedy(model, prompt, n):
    steps = (t for t, _ in generate_step(prompt, model))
    return [int(t) for t, _ in zip(steps, range(n), strict=False)]


def speculative(model, drafter, prompt, n):
    cache = make_prompt_cache(model) + drafter.make_cache()
    gen = speculative_generate_step(
        prompt, model, drafter, num_draft_tokens=3, max_tokens=n, prompt_cache=cache
    )
    return [int(t) for t, _, _ in gen]


def test_greedy_identity_and_learning_across_requests(tiny_llama):
    model, tok = tiny_llama
    drafter = SuffixDrafter(corpus_tokens=4096, tokenizer=tok, auto_off=False)
    a = mx.array(tok.encode("alpha beta gamma delta"))
    b = mx.array(tok.encode("epsilon zeta eta theta"))
    for prompt in (a, b, a, b):
        assert speculative(model, drafter, prompt, 40) == greedy(model, prompt, 40)
    assert len(drafter.corpus_of(model)) > 0
    # The second time round the answer is in the corpus (not in the prompt).
    assert last_stats().accepted > 0


@pytest.mark.slow
def test_greedy_identity_on_smollm2(smollm2_f32_path):
    model, tok = load(str(smollm2_f32_path))
    drafter = SuffixDrafter(tokenizer=tok)
    asks = [
        "Write a Python function that returns the sum of a list.",
        "Write a Python function that returns the product of a list.",
        "Write a Python function that returns the sum of a list.",
    ]
    for text in asks:
        prompt = mx.array(
            tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        )
        assert speculative(model, drafter, prompt, 48) == greedy(model, prompt, 48)
    assert last_stats().accepted > 0


def test_generate_flag_matches_stock_and_refuses_bad_values(tiny_model):
    model = tiny_model("llama")
    stock = run_generate(model, "--verbose", "True")
    ours = run_generate(
        model, "--plugin", "spec-decode", "--drafter", "suffix", "--verbose", "True"
    )
    assert ours.returncode == 0, ours.stderr
    assert "Speculative decoding (suffix): drafted" in ours.stdout
    text = lambda out: out.split("==========")[1]  # noqa: E731
    assert text(ours.stdout) == text(stock.stdout)
    for bad in ("0", "-5", "many", "1.5"):
        r = run_generate(
            model, "--plugin", "spec-decode", "--drafter", "suffix", "--suffix-corpus-tokens", bad
        )
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "--suffix-corpus-tokens" in lines[0], r.stderr


@pytest.mark.parametrize("server", [["--drafter", "suffix", "--no-auto-off"]], indirect=True)
def test_server_second_request_drafts_from_the_first(server):  # noqa: F811
    from openai import OpenAI

    base, proc = server
    client = OpenAI(base_url=base, api_key="none", timeout=120, max_retries=0)

    def ask(system):
        msgs = [
            {"role": "system", "content": system},
            {"role": "user", "content": "Write the tool call."},
        ]
        r = client.chat.completions.create(
            model="default_model", messages=msgs, max_tokens=32, temperature=0
        )
        return r.choices[0].message.content, r.usage.model_dump()["speculative_decoding"]

    first, s1 = ask("You are agent one.")
    # The same request again: the prompt cache gives back the prompt only
    # (its entry trimmed to it), so the answer is only in the corpus.
    again, s2 = ask("You are agent one.")
    assert s1["drafter"] == "suffix" and again == first
    # Same prompt, same restored history: only the corpus differs (a tiny
    # random model loops, so the first request accepts drafts of its own too).
    assert s2["accepted"] > s1["accepted"] and s2["accepted"] > 0, (s1, s2)
