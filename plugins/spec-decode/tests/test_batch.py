"""Drafting inside mlx-lm's continuous batching (``batch.SpecBatchGenerator``),
in process against mlx-lm's own ``BatchGenerator``: token identity and equal
caches for greedy rows (rows joining mid-stream, stop tokens, max_tokens,
logits processors), one row's drafter failing, a sliding-window batch
falling back, and the sampled rows' distributions (chi-square)."""

import logging
from collections import Counter

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.sample_utils import apply_top_k, make_logits_processors, make_sampler
from test_sampling import TEMP, chi2, chi2_critical, second_probs, target_probs

from mlx_lm_spec_decode import Drafter, NGramDrafter
from mlx_lm_spec_decode import ragged as ragged_mod
from mlx_lm_spec_decode.batch import SpecBatchGenerator
from mlx_lm_spec_decode.ragged import RaggedKVCache

TEXT = "one two three four five six seven eight nine ten. "


def drive(gen, prompts, max_tokens, late=None, **kw):
    """Run ``gen`` to the end: tokens, finish reasons and caches per request.
    ``late``: ``(after_calls, prompt, max_tokens)`` inserted mid-stream."""
    uids = gen.insert(prompts, max_tokens=max_tokens, **kw)
    out, done, calls = {u: [] for u in uids}, {}, 0
    while len(done) < len(out):
        _, responses = gen.next()
        calls += 1
        if late and calls == late[0]:
            (u,) = gen.insert([late[1]], max_tokens=[late[2]])
            out[u] = []
        for r in responses:
            out[r.uid].append(r.token)
            if r.finish_reason:
                done[r.uid] = (r.finish_reason, r.prompt_cache, list(r.all_tokens))
    return [(out[u], *done[u]) for u in sorted(out)]


def closed_stats(gen):
    """The figures of every row that leaves ``gen``'s generation batch, as it leaves."""
    rows, batch = [], gen._generation_batch
    close = batch._close
    batch._close = lambda i, row: rows.append(row.stats) or close(i, row)
    return rows


def assert_same(stock, ours):
    for (t1, f1, c1, a1), (t2, f2, c2, a2) in zip(stock, ours, strict=True):
        assert t1 == t2 and f1 == f2 and a1 == a2
        for x, y in zip(c1, c2, strict=True):
            assert type(x) is type(y) and x.offset == y.offset
            for u, v in ((x.keys, y.keys), (x.values, y.values)):
                u, v = u[..., : x.offset, :], v[..., : y.offset, :]
                assert u.shape == v.shape and mx.allclose(u, v, atol=1e-4).item()


@pytest.fixture(scope="module")
def llama(tiny_model):
    return load(str(tiny_model("llama")))


def prompts_of(tok):
    return [
        tok.encode(TEXT * 3),
        tok.encode("hello " + TEXT),
        tok.encode("x y " + TEXT * 5 + "one two"),
    ]


def greedy_case(model, tok):
    """Three greedy rows with a penalized row that stops on a stop token, a
    late joiner, and stock's run of them: ``(prompts, late, kw, stock)``."""
    prompts = prompts_of(tok)
    procs = [None, make_logits_processors(repetition_penalty=1.5), None]
    # Row 1 stops at the token a penalized run emits 12th.
    stop = drive(BatchGenerator(model), prompts, [40, 25, 60], logits_processors=procs)[1][0][11]
    kw = dict(
        logits_processors=procs,
        stop_sequences=[StopSequences(), StopSequences([[stop]]), StopSequences()],
    )
    late = (3, tok.encode("late " + TEXT * 2), 17)
    return prompts, late, kw, drive(BatchGenerator(model), prompts, [40, 25, 60], late, **kw)


@pytest.mark.parametrize("compact_at", [None, 1])
def test_greedy_rows_match_stock_tokens_and_caches(llama, monkeypatch, compact_at):
    """``compact_at=1``: the holes are squeezed out after every ragged rollback."""
    if compact_at:
        monkeypatch.setattr(ragged_mod, "COMPACT_HOLES", compact_at)
    model, tok = llama
    prompts, late, kw, stock = greedy_case(model, tok)
    gen = SpecBatchGenerator(model, NGramDrafter(n_min=1, auto_off=False), 4, 10)
    rows = closed_stats(gen)
    ours = drive(gen, prompts, [40, 25, 60], late, **kw)
    assert_same(stock, ours)
    assert {r[1] for r in ours} == {"length", "stop"}
    # Drafts were kept and rejected (the penalized row), so rows rolled back apart.
    assert sorted(s.emitted for s in rows) == sorted(len(r[0]) for r in ours)
    assert sum(s.accepted for s in rows) > 0
    assert any(s.drafted > s.accepted for s in rows)


def test_rounds_built_before_the_pending_tokens_are_read_match_stock(llama, monkeypatch):
    """Without logits processors or trees a round after a plain step starts
    from the pending tokens still on the device; outputs and caches stay
    stock's, and those rounds read the pending tokens only with their results."""
    from mlx_lm_spec_decode import batch as batch_mod

    model, tok = llama
    prompts = prompts_of(tok)
    stop = drive(BatchGenerator(model), prompts, [40, 25, 60])[1][0][11]
    kw = dict(stop_sequences=[StopSequences(), StopSequences([[stop]]), StopSequences()])
    late = (3, tok.encode("late " + TEXT * 2), 17)
    stock = drive(BatchGenerator(model), prompts, [40, 25, 60], late, **kw)
    reads = []
    monkeypatch.setattr(batch_mod, "read_back", lambda a: reads.append(1) or a.tolist())
    gen = SpecBatchGenerator(model, NGramDrafter(n_min=1, auto_off=False, tree=False), 4, 10)
    rows = closed_stats(gen)
    ours = drive(gen, prompts, [40, 25, 60], late, **kw)
    assert_same(stock, ours)
    assert {r[1] for r in ours} == {"length", "stop"}
    assert sum(s.accepted for s in rows) > 0 and any(s.drafted > s.accepted for s in rows)
    assert 0 < len(reads) <= sum(s.draft_rounds for s in rows)


def test_a_chosen_round_runs_where_rows_draft_again_after_the_pending_tokens(llama, monkeypatch):
    """Token trees are built on the pending token, so a round chosen behind
    a plain step reads it and drafts again: the round the controller chose
    runs (it is not asked twice), and outputs stay stock's."""
    from mlx_lm_spec_decode.batch_verify import BatchController

    calls = []

    def choose(self, B, proposed, *a):
        calls.append(1)
        return 2 if len(calls) % 2 else 0  # yes, then no, then yes ...

    monkeypatch.setattr(BatchController, "choose", choose)
    model, tok = llama
    prompts = prompts_of(tok)
    stock = drive(BatchGenerator(model), prompts, [30, 30, 30])
    gen = SpecBatchGenerator(model, NGramDrafter(n_min=1), 4, 10)
    rows = closed_stats(gen)
    assert_same(stock, drive(gen, prompts, [30, 30, 30]))
    assert sum(s.draft_rounds for s in rows) > 0


def test_declined_rounds_decode_as_stock(llama, monkeypatch):
    """Where the controller declines every round, the rows draft from the
    tokens already emitted without waiting for the pending ones (mlx-lm's
    pipeline keeps running) and decode exactly as stock, one plain step per
    token."""
    from mlx_lm_spec_decode import batch as batch_mod
    from mlx_lm_spec_decode.batch_verify import BatchController

    reads = []
    monkeypatch.setattr(batch_mod, "read_back", lambda a: reads.append(1) or a.tolist())

    decisions = []
    monkeypatch.setattr(
        BatchController, "choose", lambda self, B, proposed, *a: decisions.append(proposed) or 0
    )
    model, tok = llama
    prompts, late, kw, stock = greedy_case(model, tok)
    gen = SpecBatchGenerator(model, NGramDrafter(n_min=1), 4, 10)
    rows = closed_stats(gen)
    assert_same(stock, drive(gen, prompts, [40, 25, 60], late, **kw))
    assert any(any(p) for p in decisions)  # the rows had proposals, all declined
    assert not reads
    assert all(s.draft_rounds == 0 and s.forwards == s.emitted for s in rows)


def test_rows_drafters_are_told_the_verify_price_at_their_batch_size(llama, monkeypatch):
    """Each row's drafter reads ``ctx.verify_cost`` as the serial loop's
    does: the controller's measured price at the batch size it drafts in
    (the n-gram drafter's bar and tree breadth, the suffix drafter's draft
    length follow it). Output as stock's."""
    from mlx_lm_spec_decode.batch_verify import BatchController

    monkeypatch.setattr(BatchController, "verify_cost", lambda self, B=1: (1.0 + B / 100, 0.0))
    seen = []

    class Told(NGramDrafter):
        def draft(self, ctx, n):
            seen.append(ctx.verify_cost)
            return super().draft(ctx, n)

    model, tok = llama
    prompts, late, kw, stock = greedy_case(model, tok)
    assert_same(
        stock,
        drive(SpecBatchGenerator(model, Told(n_min=1), 4, 10), prompts, [40, 25, 60], late, **kw),
    )
    assert seen and {round(100 * (a - 1)) for a, _ in seen} <= {1, 2, 3, 4}


def test_one_drafter_failure_disables_that_row_only(llama, caplog):
    model, tok = llama
    prompts = prompts_of(tok)
    bad = prompts[1][0]

    class Flaky(NGramDrafter):
        def draft(self, ctx, n):
            if ctx.cache[0].tokens[0] == bad:
                raise RuntimeError("lookup broke")
            return super().draft(ctx, n)

    gen = SpecBatchGenerator(model, Flaky(n_min=1, auto_off=False), 4, 10)
    rows = closed_stats(gen)
    with caplog.at_level(logging.WARNING, logger="mlx_lm_spec_decode"):
        ours = drive(gen, prompts, [30, 30, 30])
    assert_same(drive(BatchGenerator(model), prompts, [30, 30, 30]), ours)
    failed = [s for s in rows if s.fallback]
    assert len(failed) == 1 and "lookup broke" in failed[0].fallback
    assert failed[0].drafted == 0 and all(s.drafted > 0 for s in rows if not s.fallback)
    assert sum("lookup broke" in r.message for r in caplog.records) == 1


def test_sliding_window_batch_decodes_plainly_with_one_warning(tiny_model, caplog):
    model, tok = load(str(tiny_model("gemma3_text")))
    prompts = prompts_of(tok)
    gen = SpecBatchGenerator(model, NGramDrafter(n_min=1, auto_off=False), 4, 10)
    with caplog.at_level(logging.WARNING, logger="mlx_lm_spec_decode"):
        ours = drive(gen, prompts, [20, 12, 16])
    assert_same(drive(BatchGenerator(model), prompts, [20, 12, 16]), ours)
    assert sum("cannot roll rows back apart" in r.message for r in caplog.records) == 1


def test_ragged_rollback_keeps_each_rows_entries(llama):
    """The cache alone: rows roll back by their own amounts, extract equals
    a cache that never held the dropped entries, and compaction keeps them."""
    model, tok = llama
    from mlx_lm.models.cache import BatchKVCache

    def batch_cache(rows):
        caches = [BatchKVCache([max(map(len, rows)) - len(r) for r in rows]) for _ in model.layers]
        width = max(map(len, rows))
        padded = [[0] * (width - len(r)) + r for r in rows]
        model(mx.array(padded), cache=caches)
        return caches

    a, b = tok.encode(TEXT * 2), tok.encode("hello there " + TEXT)
    ragged = [RaggedKVCache.of(c) for c in batch_cache([a + [5, 6, 7], b + [8, 9, 10]])]
    for c in ragged:
        c.rollback([3, 1])  # row 0 keeps a, row 1 keeps b + [8, 9]
    want = batch_cache([a, b + [8, 9]])
    for c, w in zip(ragged, want, strict=True):
        # Positions (RoPE) as mlx-lm's own: the same values, in its int32.
        assert c.offset.tolist() == w.offset.tolist() and c.offset.dtype == w.offset.dtype
        for i in range(2):
            x, y = c.extract(i), w.extract(i)
            assert x.offset == y.offset and mx.allclose(x.keys, y.keys, atol=1e-5).item()
    # Steps after the rollback attend past the holes: two plain steps (the
    # mask's slots growing past the rollback's) predict what the cache that
    # never held the dropped entries does.
    for tok_ in ([11, 12], [13, 14]):
        x = mx.array([[t] for t in tok_])
        assert mx.allclose(model(x, cache=ragged), model(x, cache=want), atol=1e-4).item()
    for c in ragged:
        c.compact()
        assert c.holes is None
    for c, w in zip(ragged, want, strict=True):
        x, y = c.extract(1), w.extract(1)
        assert mx.allclose(x.values, y.values, atol=1e-5).item()
    x = mx.array([[15], [16]])
    assert mx.allclose(model(x, cache=ragged), model(x, cache=want), atol=1e-4).item()


class Fixed(Drafter):
    name, auto_off, adaptive, batches = "fixed", False, False, True

    def __init__(self, tokens):
        self.tokens = tokens

    def draft(self, ctx, n):
        return self.tokens[:n], None


N = 500


def test_sampled_rows_match_the_target_distribution(llama):
    """Two sampled rows in one batch, drafts sometimes right: each row's second
    token (the first one the verify forward decides) follows the target."""
    model, tok = llama
    prompt = tok.encode("the cat sat on the")
    filt = lambda lp: apply_top_k(lp, 6)  # noqa: E731
    procs = make_logits_processors(repetition_penalty=2.0)
    p1 = target_probs(model, prompt, filt, None, 1)
    first = sorted(p1, key=p1.get, reverse=True)[0]
    p2 = target_probs(model, prompt + [first], filt, None, 2)
    d = sorted(p2, key=p2.get, reverse=True)[1]  # often rejected, often kept
    mx.random.seed(0)
    sampler = make_sampler(TEMP, top_k=6)
    seconds = [Counter(), Counter()]
    for _ in range(N):
        gen = SpecBatchGenerator(model, Fixed([d, d]), 2, 2)
        res = drive(gen, [prompt, prompt], [2, 2], samplers=[sampler, sampler],
                    logits_processors=[None, procs])  # fmt: skip
        for row, (toks, *_rest) in enumerate(res):
            seconds[row][toks[1]] += 1
    for row, processors in enumerate([None, procs]):
        p1 = target_probs(model, prompt, filt, processors, 1)
        stat, df = chi2(seconds[row], second_probs(model, prompt, filt, processors, p1), N)
        assert stat < chi2_critical(df), (row, stat, df)


def test_controller_picks_the_faster_option_and_borrows_a_neighbours_costs():
    from mlx_lm_spec_decode.batch_verify import BatchController

    ctl = BatchController(3, 8)
    assert ctl.needs_plain(4)  # nothing timed yet
    ctl.plain_step(4, 0.10)
    ctl.plain_step(4, 0.12)
    assert not ctl.needs_plain(4)
    assert ctl.choose(4, [3, 3, 3, 3], [0.9] * 4) == 3  # explores before it knows
    ctl.verify_round(4, 4, 0.40)
    ctl.verify_round(4, 4, 0.35)
    assert ctl.choose(4, [3, 3, 3, 3], [0.9] * 4) == 3  # two rounds: still exploring
    ctl.verify_round(4, 4, 0.30)  # medians: a plain step 0.11 s, a column 0.08 s
    assert ctl.cost(4) == pytest.approx((0.11, 0.0, 0.08))  # one width: no intercept
    # Right 9 times in 10 drafting pays; 3 in 10 it does not.
    assert ctl.choose(4, [3, 3, 3, 3], [0.9] * 4) > 0
    assert ctl.choose(4, [3, 3, 3, 3], [0.3] * 4) == 0
    assert ctl.choose(4, [3, 0, 0, 0], [0.9] * 4) == 0  # one row's drafts cannot pay for four
    # After RETRY declines in a row (two came above), one round anyway (at the
    # last γ) to renew the timings; each retry that did not win doubles the wait.
    R = BatchController.RETRY
    picks = [ctl.choose(4, [3, 3, 3, 3], [0.3] * 4) for _ in range(3 * R)]
    assert sorted(set(picks)) == [0, ctl.gamma]
    assert [i for i, g in enumerate(picks) if g] == [R - 3, R - 3 + 2 * R]
    # A caller that counts plain steps since the last round: not before
    # RETRY_STEPS, times four after two retries that lost.
    picks = [ctl.choose(4, [3] * 4, [0.3] * 4, idle=10) for _ in range(4 * R)]
    assert set(picks) == {0}
    assert ctl.choose(4, [3] * 4, [0.3] * 4, idle=2 * BatchController.RETRY_STEPS) == 0
    assert ctl.choose(4, [3] * 4, [0.3] * 4, idle=4 * BatchController.RETRY_STEPS) == ctl.gamma
    # A batch size seen for the first time decides at once from its neighbour's
    # costs (a column scaled up for more rows), then times its own plain steps.
    assert not ctl.needs_plain(6)
    assert ctl.cost(6) == pytest.approx((0.11, 0.0, 0.12))
    for _ in range(BatchController.OWN):
        ctl.verify_round(6, 2, 0.2)
    assert ctl.needs_plain(6)
    ctl.plain_step(6, 0.2)
    ctl.plain_step(6, 0.2)
    assert not ctl.needs_plain(6) and ctl.cost(6)[0] == 0.2


def test_controller_charges_a_round_the_slowdown_of_the_steps_after_it():
    """Plain steps slowed right after a round (a GPU rebuilding the step's
    graphs) count against the round, not as the plain step's cost: rounds
    that looked cheap on their own stop being chosen."""
    from mlx_lm_spec_decode.batch_verify import BatchController

    def run(after):
        ctl = BatchController(3, 8)
        ctl.plain_step(4, 0.10)
        ctl.plain_step(4, 0.10)
        picks = []
        for _ in range(6):
            ctl.verify_round(4, 4, 0.12, tokens=8)  # 8 tokens in 0.12 s: 67 tok/s
            for n in range(2, BatchController.AFTER + 1):  # the first is not timed
                ctl.plain_step(4, after, n)
            picks.append(ctl.choose(4, [3] * 4, [0.5] * 4))
        return ctl, picks

    clean, picks = run(0.10)
    assert clean.plain_cost(4) == pytest.approx(0.10) and all(picks)
    slowed, picks = run(0.16)  # each round costs 3 x 0.06 s more: 8 tokens in 0.30 s
    assert slowed.plain_cost(4) == pytest.approx(0.10)
    assert slowed.cost(4)[2] > clean.cost(4)[2]
    assert picks[2:5] == [0, 0, 0]  # once explored (then a retry round, as ever)


def test_controller_stops_drafting_where_rounds_emitted_less_than_plain_steps():
    from mlx_lm_spec_decode.batch_verify import BatchController

    def timed(tokens):
        ctl = BatchController(3, 8)
        ctl.plain_step(4, 0.10)  # 40 tokens/s
        ctl.plain_step(4, 0.10)
        for _ in range(BatchController.EXPLORE):
            # The cost model: a round costs 0.15 s, so at 90% acceptance it pays.
            ctl.verify_round(4, 4, 0.15, tokens=tokens)
        return ctl

    # 10 tokens in 0.15 s (67/s): drafting stays on.
    assert timed(10).choose(4, [3, 3, 3, 3], [0.9] * 4) == 3
    # 5 tokens in 0.15 s (33/s, the rows' estimates were too high): plain
    # steps, apart from a retry round after RETRY decisions, then twice as many.
    ctl = timed(5)
    R = BatchController.RETRY
    picks = [ctl.choose(4, [3, 3, 3, 3], [0.9] * 4) for _ in range(3 * R)]
    assert [i for i, g in enumerate(picks) if g] == [R - 1, 3 * R - 1]
    # A row joins: five rows, no rounds of their own, take four's record; so
    # do three (a row left: a third fewer at most), but two do not (far fewer
    # rows may still win), so the cost model decides.
    assert ctl.choose(5, [3] * 5, [0.9] * 5) == 0
    assert ctl.choose(3, [3, 3, 3], [0.9] * 3) == 0
    assert ctl.choose(2, [3, 3], [0.9] * 2) == 3
    # Rounds that do better refresh the figures, and drafting resumes.
    for _ in range(BatchController.SAMPLES):
        ctl.verify_round(4, 4, 0.15, tokens=12)
    assert ctl.choose(4, [3, 3, 3, 3], [0.9] * 4) == 3
    assert ctl.choose(5, [3] * 5, [0.9] * 5) == 3


def test_controller_fits_a_rounds_fixed_cost_and_times_trees_apart():
    from mlx_lm_spec_decode.batch_verify import BatchController

    ctl = BatchController(3, 8)
    ctl.plain_step(2, 0.010)
    # A GPU-like round: 8 ms beyond a plain step at any width, 0.5 ms a column.
    for w in (2, 4, 8, 8):
        ctl.verify_round(2, w, 0.018 + 0.0005 * (w - 1))
    p, extra, b = ctl.cost(2)
    assert (p, extra, b) == pytest.approx((0.010, 0.008, 0.0005))
    # Two rows at 50% gain ~0.9 tokens each a round: worth it at 0.5 ms a column
    # alone, not with the round's fixed 8 ms (the per-column reading alone,
    # 1.6 ms from the widest round, would have drafted).
    assert ctl.choose(2, [4, 4], [0.5, 0.5]) == 0
    assert ctl.choose(2, [8, 8], [0.95, 0.95]) > 0
    # Trees: free until timed; dear once three rounds cost well beyond a chain.
    assert ctl.trees_pay(2)
    for _ in range(3):
        ctl.verify_round(2, 4, 0.030, tree=True)
    assert not ctl.trees_pay(2)
    for _ in range(BatchController.TREE_RETRY):
        ctl.verify_round(2, 4, 0.0195)
    assert ctl.trees_pay(2)  # one more tree round, to see whether that changed
    cheap = BatchController(3, 8)
    cheap.plain_step(2, 0.010)
    for w in (2, 4):
        cheap.verify_round(2, w, 0.010 + 0.002 * (w - 1))
    for _ in range(3):
        cheap.verify_round(2, 4, 0.016, tree=True)
    assert cheap.trees_pay(2)
    # Rounds that all branch still give the cost model its chain figures.
    only = BatchController(3, 8)
    only.plain_step(2, 0.010)
    for _ in range(3):
        only.verify_round(2, 4, 0.016, tree=True)
    assert only.cost(2) == pytest.approx((0.010, 0.0, 0.002))


def test_rounds_wait_for_pending_tokens_only_while_they_verify_trees():
    """A batch's trees are drafted on the pending tokens, so a round behind
    a plain step that would verify one waits for those tokens; where rounds
    on known tokens hardly ever branch, rounds go ahead (chains, built
    while the step runs), and one waits now and then to look again."""
    from mlx_lm_spec_decode.batch_verify import BatchController

    ctl = BatchController(3, 8)
    ctl.plain_step(2, 0.010)
    assert ctl.trees_wait(2)  # nothing known yet: trees may pay
    for _ in range(BatchController.TREE_LOOKS):
        ctl.trees_drawn(2, False)
        ctl.verify_round(2, 4, 0.012)
    assert not ctl.trees_wait(2)
    for _ in range(BatchController.TREE_RETRY - 2):
        ctl.verify_round(2, 4, 0.012)
    assert not ctl.trees_wait(2)
    ctl.verify_round(2, 4, 0.012)
    assert ctl.trees_wait(2)  # one round waits to look again
    ctl.trees_drawn(2, False)
    assert not ctl.trees_wait(2)
    # Rounds that verify trees often enough make rounds wait for them again.
    for _ in range(2):
        ctl.trees_drawn(2, True)
    assert ctl.trees_wait(2)
    # Trees found dear are not waited for, however often rounds branch.
    for _ in range(3):
        ctl.verify_round(2, 4, 0.030, tree=True)
    assert not ctl.trees_wait(2)


def test_unverified_drafts_still_teach_the_rows_acceptance():
    """With γ 0 a row's proposal is scored against what it emitted next."""
    from mlx_lm_spec_decode.batch import Row
    from mlx_lm_spec_decode.policy import Acceptance

    def row(guess):
        r = Row.__new__(Row)
        r.acceptance, r.guess = Acceptance(), guess
        return r

    history = [1, 2, 3, 4, 5, 6]
    right, wrong, early = row((2, [3, 4, 5])), row((2, [9, 4, 5])), row((5, [6, 7, 8]))
    for r in (right, wrong, early):
        r.check(history)
        assert r.guess is None
    assert right.alpha > 0.5 > wrong.alpha  # 3 of 3 kept; a miss at once
    assert early.alpha > 0.5  # only one token emitted since: kept, no miss seen


def simulate_batch(
    steps, round_s, round_tokens, slow_steps, slow_s, plain_s=0.010, B=8, told_s=None
):
    """Drive a ``BatchController`` with synthetic timings, as the generation
    batch does (plain steps in the runs it asks for, a decision between
    them, the first plain step after a round untimed): plain steps take
    ``plain_s``, but ``slow_s`` for the ``slow_steps`` after a round (a GPU
    rebuilding the step's graphs the round evicted); a round takes
    ``round_s`` and emits ``round_tokens``, though its own timing tells the
    controller ``told_s`` (default: the same; less: a cost it cannot see
    in the round, which the caller's clock shows). Returns the share of calls that
    were rounds after the first fifth of the run, and tokens/s over a plain
    step's."""
    from mlx_lm_spec_decode.batch import COST_RUN
    from mlx_lm_spec_decode.batch_verify import BatchController

    ctl = BatchController(3, 8)
    kinds, seconds, tokens = [], 0.0, 0
    plain_left, idle, timed, rounds_run = 0, 0, False, False
    while len(kinds) < steps:
        g, on = 0, ctl.drafting(B)
        if not on:
            plain_left = 0
        elif plain_left == 0 and ctl.needs_plain(B):
            plain_left = BatchController.PROBE
        elif plain_left == 0:
            g = ctl.choose(B, [4] * B, [0.6] * B, idle)
            if g == 0:
                plain_left = min(COST_RUN, 1 << min(max(ctl.declined - 1, 0), 3))
        if g:
            ctl.verify_round(B, g + 1, told_s or round_s, tokens=round_tokens)
            ctl.call(B, round_tokens, round_s, on)
            kinds.append(1)
            seconds, tokens, idle, timed, rounds_run = (
                seconds + round_s,
                tokens + round_tokens,
                0,
                False,
                True,
            )
            continue
        plain_left = max(0, plain_left - 1)
        idle += 1
        s = slow_s if rounds_run and idle <= slow_steps else plain_s
        if timed:
            ctl.plain_step(B, s, idle)
        ctl.call(B, B, s, on)
        kinds.append(0)
        seconds, tokens, timed = seconds + s, tokens + B, True
    tail = kinds[steps // 5 :]
    return sum(tail) / len(tail), tokens / seconds / (B / plain_s)


def test_controller_settles_to_plain_steps_where_rounds_lose():
    """Rounds that emit fewer tokens per second than clean plain steps, and
    slow the dozen steps after them (so that those, timed as plain steps,
    would make plain decoding look as slow as the rounds): the batch size
    settles to plain steps, retries backing off, within 3% of plain decoding.
    Rounds that pay keep running under the same slowdown."""
    # 16 tokens in 25 ms (640/s) against 8 in 10 ms (800/s); 12 steps at 20 ms after each.
    share, speed = simulate_batch(3000, 0.025, 16, 12, 0.020)
    assert share < 0.005 and speed > 0.97, (share, speed)
    # The same without the slowdown: rounds still lose.
    share, speed = simulate_batch(3000, 0.025, 16, 0, 0.010)
    assert share < 0.005 and speed > 0.97, (share, speed)
    # Slowed for the 4 steps charged to a round: retries that lose every 120
    # steps would cost 3.5%; backing off, they cost under 1%.
    share, speed = simulate_batch(3000, 0.025, 16, 4, 0.020)
    assert share < 0.005 and speed > 0.985, (share, speed)
    # 32 tokens in 20 ms (1600/s): drafting keeps paying, slowdown and all;
    # 16 in 15 ms (1067/s) too, rounds running back to back.
    share, speed = simulate_batch(3000, 0.020, 32, 12, 0.020)
    assert share > 0.5 and speed > 1.5, (share, speed)
    share, speed = simulate_batch(3000, 0.015, 16, 12, 0.020)
    assert share > 0.5 and speed > 1.15, (share, speed)


def test_drafting_switches_off_where_the_callers_clock_shows_rounds_lose():
    """Rounds whose own timing says they pay (16 tokens in 12 ms against 8
    in 10 ms) but that take 30 ms on the caller's clock: the calls with
    drafting on lose against plain steps, so the batch size decodes plainly,
    retrying with a doubling wait, within 5% of plain decoding. Rounds that
    really pay stay on."""
    share, speed = simulate_batch(4000, 0.030, 16, 0, 0.010, told_s=0.012)
    assert share < 0.02 and speed > 0.95, (share, speed)
    share, speed = simulate_batch(4000, 0.015, 24, 0, 0.010, told_s=0.012)
    assert share > 0.5 and speed > 1.3, (share, speed)


def test_resume_needs_enough_rows_whose_guesses_hold_to_pay():
    """While drafting is off at a batch size, rows whose guesses hold retry
    it at once where their rounds would pay at their acceptance by the
    measured cost (one copying row of one; three of four) and not where
    they cannot pay for the rest (one copying row of four: a round of width
    4 costs 1.9 plain steps, and emits about 6.4 tokens where a plain step
    emits 4), nor where the guesses mostly missed (acceptance 0.1)."""
    from mlx_lm_spec_decode.batch_verify import BatchController

    ctl = BatchController(3, 8)
    for B, column in ((1, 0.02), (4, 0.03)):
        for _ in range(2):
            ctl.plain_step(B, 0.10)
        for _ in range(BatchController.EXPLORE):
            ctl.verify_round(B, 4, 0.10 + 3 * column)
        ctl.switch_off(B, "lost")
        assert not ctl.drafting(B)
    assert not ctl.resumes(1, [0.0]) and not ctl.resumes(1, [0.1])
    assert not ctl.resumes(4, [0.9, 0.0, 0.0, 0.0])
    assert not ctl.drafting(4)
    assert ctl.resumes(1, [0.9]) and ctl.drafting(1)
    assert ctl.resumes(4, [0.9, 0.9, 0.9, 0.0]) and ctl.drafting(4)


@pytest.mark.parametrize("watched", [True, False])
def test_drafting_switched_off_resumes_once_the_rows_guesses_hold(llama, monkeypatch, watched):
    """A batch size whose drafting was switched off decodes plain steps, but
    its rows' drafters keep guessing from their tokens: once a row's output
    starts repeating what it holds, drafting resumes long before the wait
    ends, with stock's tokens. Without the watch's verdict, the whole wait
    is plain steps."""
    from mlx_lm_spec_decode.batch_verify import BatchController

    if not watched:
        monkeypatch.setattr(BatchController, "resumes", lambda self, B, alphas: False)
    model, tok = llama
    prompt = [tok.encode(TEXT * 3)]
    stock = drive(BatchGenerator(model), prompt, [48])
    gen = SpecBatchGenerator(model, NGramDrafter(n_min=1), 4, 8)
    ctl = gen.spec.ctl
    for _ in range(2):
        ctl.plain_step(1, 0.010)
    for w in (2, 5):
        for _ in range(BatchController.EXPLORE):
            ctl.verify_round(1, w, 0.010 + 0.0005 * w)
    ctl.switch_off(1, "lost")
    assert ctl.switch(1).left > 48  # the wait outlasts the request
    rows = closed_stats(gen)
    assert_same(stock, drive(gen, prompt, [48]))
    if watched:
        assert rows[0].draft_rounds > 0 and rows[0].forwards < rows[0].emitted
    else:
        assert rows[0].draft_rounds == 0 and rows[0].forwards == rows[0].emitted


def test_a_long_plain_run_after_rounds_squeezes_their_holes_out(llama, monkeypatch):
    """Rounds leave holes where rows rolled back apart; once the controller
    declines long enough for a run of plain steps, the holes are squeezed
    out first (plain steps then build stock's mask) and outputs stay stock's."""
    from mlx_lm_spec_decode.batch_verify import BatchController
    from mlx_lm_spec_decode.ragged import RaggedKVCache

    def choose(self, B, proposed, *a):
        self.rounds_asked = getattr(self, "rounds_asked", 0) + 1
        if self.rounds_asked <= 6:
            return 3
        self.declined += 1
        return 0

    monkeypatch.setattr(BatchController, "choose", choose)
    holey = []  # holes in the cache at each plain step's mask
    make_mask = RaggedKVCache.make_mask

    def spy(self, N, *a, **k):
        if N == 1:
            holey.append(self.holes is not None)
        return make_mask(self, N, *a, **k)

    monkeypatch.setattr(RaggedKVCache, "make_mask", spy)
    model, tok = llama
    prompts = prompts_of(tok)
    stock = drive(BatchGenerator(model), prompts, [60, 60, 60])
    gen = SpecBatchGenerator(model, NGramDrafter(n_min=1, tree=False), 4, 10)
    rows = closed_stats(gen)
    assert_same(stock, drive(gen, prompts, [60, 60, 60]))
    assert sum(s.draft_rounds for s in rows) > 0 and any(s.drafted > s.accepted for s in rows)
    assert any(holey) and not any(holey[-20:])


def test_padded_windows_match_stock_and_stay_within_the_token_budget(llama, monkeypatch):
    """Windows padded up to a few widths (as on a GPU, here forced with
    MLX_LM_SPEC_WIDTHS): outputs and caches stay stock's, every round's
    width is one of the widths where the batch's padded windows fit
    ``PAD_TOKENS``, and its own width where they would not."""
    from mlx_lm_spec_decode import target as target_mod

    monkeypatch.setenv("MLX_LM_SPEC_WIDTHS", "4,8")
    monkeypatch.setattr(target_mod, "PAD_TOKENS", 16)  # three rows fit 4, not 8
    model, tok = llama
    prompts, late, kw, stock = greedy_case(model, tok)
    from mlx_lm_spec_decode.batch import SpecGenerationBatch

    rounds = []
    check = SpecGenerationBatch._check

    def spy(self, inputs, windows, *a):
        rounds.append((len(windows), len(windows[0])))
        return check(self, inputs, windows, *a)

    monkeypatch.setattr(SpecGenerationBatch, "_check", spy)
    gen = SpecBatchGenerator(model, NGramDrafter(n_min=1, auto_off=False), 4, 10)
    assert gen.spec.ctl.widths == (4, 8)
    ours = drive(gen, prompts, [40, 25, 60], late, **kw)
    assert_same(stock, ours)
    assert rounds
    for b, w in rounds:
        # A bucket within the budget, or its own width where the bucket above is not.
        up = next((p for p in (4, 8) if p >= w), None)
        if w == up:
            assert b * w <= target_mod.PAD_TOKENS, (b, w)
        else:
            assert up is None or b * up > target_mod.PAD_TOKENS, (b, w)
    assert any(w in (4, 8) for _, w in rounds)


@pytest.mark.parametrize("how", ["padded", "buffer"])
def test_rounds_over_the_cache_buffers_match_stock(llama, monkeypatch, how):
    """Verify attention over the caches' whole buffers (a GPU's batch
    default, forced here with MLX_LM_SPEC_ATTENTION; trees:
    ``test_batch_tree``), windows padded: outputs and caches stay stock's, every round's attention
    went over the buffer, and a squeeze of the holes kept the buffer's size."""
    from mlx_lm_spec_decode import target as target_mod

    monkeypatch.setenv("MLX_LM_SPEC_ATTENTION", how)
    monkeypatch.setenv("MLX_LM_SPEC_WIDTHS", "4,8")
    monkeypatch.setattr(ragged_mod, "COMPACT_HOLES", 1)
    model, tok = llama
    prompts, late, kw, stock = greedy_case(model, tok)
    seen, real = [], target_mod.padded_attention
    monkeypatch.setattr(
        target_mod, "padded_attention", lambda *a: seen.append(real(*a)) or seen[-1]
    )
    sizes, squeeze = [], RaggedKVCache.squeeze

    def spy(self, plan):
        before = None if self.keys is None else self.keys.shape[2]
        squeeze(self, plan)
        sizes.append((before, None if self.keys is None else self.keys.shape[2]))

    monkeypatch.setattr(RaggedKVCache, "squeeze", spy)
    gen = SpecBatchGenerator(model, NGramDrafter(n_min=1, auto_off=False, tree=False), 4, 10)
    rows = closed_stats(gen)
    assert_same(stock, drive(gen, prompts, [40, 25, 60], late, **kw))
    assert sum(s.accepted for s in rows) > 0
    assert seen and all(out is not None for out in seen)
    assert sizes and all(a == b for a, b in sizes)


def test_window_widths_follow_the_device_and_the_override(monkeypatch):
    from mlx_lm_spec_decode import target as target_mod

    monkeypatch.delenv("MLX_LM_SPEC_WIDTHS", raising=False)
    monkeypatch.setattr(target_mod, "PAD_TOKENS", 16)
    assert target_mod.window_widths() == ()  # the CPU: windows keep their width
    monkeypatch.setenv("MLX_LM_SPEC_WIDTHS", "8,4")
    assert target_mod.window_widths() == (4, 8)
    assert target_mod.padded_width(3, (4, 8), rows=2) == 8  # the widest that fits: one shape
    assert target_mod.padded_width(3, (4, 8), rows=3) == 4
    assert target_mod.padded_width(5, (4, 8), rows=2) == 8
    assert target_mod.padded_width(5, (4, 8), rows=4) == 5  # 32 tokens: past the budget
    assert target_mod.padded_width(9, (4, 8), rows=1) == 9  # past the largest
    for bad in ("1,4", "x", "0"):
        monkeypatch.setenv("MLX_LM_SPEC_WIDTHS", bad)
        with pytest.raises(ValueError, match="MLX_LM_SPEC_WIDTHS"):
            target_mod.window_widths()
