import copy
import random

import pytest

from mlx_lm_spec_decode import NGramCache, NGramDrafter


def brute_index(tokens, n_min, n_max):
    index = {}
    for i in range(1, len(tokens)):
        for n in range(n_min, min(n_max, i) + 1):
            index[tuple(tokens[i - n : i])] = i
    return index


def test_longest_match_first_and_copy():
    c = NGramCache(n_min=1, n_max=3)
    # "5 6 7" occurs before with continuation 8; "7" alone last continued with 1.
    c.extend([5, 6, 7, 8, 9, 7, 1, 2, 5, 6, 7])
    assert c.lookup(3) == [8, 9, 7]
    c2 = NGramCache(n_min=1, n_max=1)
    c2.extend([5, 6, 7, 8, 9, 7, 1, 2, 5, 6, 7])
    assert c2.lookup(2) == [1, 2]  # most recent occurrence of "7"


def test_no_match_and_min_n():
    c = NGramCache(n_min=2, n_max=4)
    c.extend([1, 2, 3, 4])
    assert c.lookup(4) == []
    c.extend([9, 3])  # "3" seen before, but n_min is 2
    assert c.lookup(4) == []


def test_periodic_copy_runs_past_the_present():
    c = NGramCache(n_min=2, n_max=2)
    c.extend([1, 2, 3, 1, 2])
    assert c.lookup(6) == [3, 1, 2, 3, 1, 2]


def test_incremental_index_and_trim_match_brute_force():
    rng = random.Random(0)
    c = NGramCache(n_min=1, n_max=4)
    ref = []
    for _ in range(300):
        if ref and rng.random() < 0.3:
            n = rng.randint(1, min(5, len(ref)))
            assert c.trim(n) == n
            del ref[-n:]
        else:
            toks = [rng.randint(0, 6) for _ in range(rng.randint(1, 6))]
            c.extend(toks)
            ref += toks
        assert c.tokens == ref
        assert c.index == brute_index(ref, 1, 4)
        assert len(c.undo) == len(ref)
        for n in range(1, min(4, len(ref)) + 1):  # every occurrence, the latest first
            key = ref[len(ref) - n :]
            seen = [i + n for i in range(len(ref) - n - 1, -1, -1) if ref[i : i + n] == key]
            assert c.starts(n, 99) == seen and c.starts(n, 2) == seen[:2]


def test_copy_state_roundtrip_and_cache_interface():
    c = NGramCache(2, 3)
    c.extend([1, 2, 3, 1, 2])
    d = copy.deepcopy(c)
    d.extend([3])
    assert c.tokens == [1, 2, 3, 1, 2] and c.offset == 5 and d.offset == 6
    r = NGramCache.from_state(c.state, c.meta_state)
    assert r.tokens == c.tokens and r.index == c.index and (r.n_min, r.n_max) == (2, 3)
    assert c.is_trimmable() and not c.empty() and c.nbytes > 0
    assert c.trim(10) == 5 and c.empty() and c.index == {}


def test_drafter_validation_and_cache_check():
    with pytest.raises(ValueError):
        NGramDrafter(n_max=1, n_min=2)
    with pytest.raises(ValueError):
        NGramDrafter(max_draft=0)
    d = NGramDrafter(n_max=3, n_min=2)
    assert d.cache_ok(d.make_cache())
    assert not d.cache_ok([])
    assert not d.cache_ok(NGramDrafter(n_max=4).make_cache())


def test_match_length_that_keeps_failing_is_silenced_and_heard_again():
    from mlx_lm_spec_decode import DraftContext

    d = NGramDrafter(n_max=3, n_min=2)
    ctx = DraftContext(None, [], d.make_cache())
    d.prefill(ctx, [1, 2, 3, 9, 1, 2])  # "1 2" matched before: propose 3
    proposed = []
    for i in range(6):
        assert ctx.cache[0].match()[0] == 2
        tokens, _ = d.draft(ctx, 2)
        proposed.append(bool(tokens))
        d.accept(ctx, [20 + i, 1, 2], 0)  # the target said 20+i: the guess was wrong
    assert proposed[:3] == [True] * 3 and not proposed[-1]  # silenced
    fresh = DraftContext(None, [], ctx.cache)  # a new request starts afresh
    assert d.draft(fresh, 2)[0]
    # Silent guesses are still checked: once they come true, drafting resumes.
    for _ in range(8):
        tokens, _ = d.draft(ctx, 1)
        guess = ctx.state["guess"][1]
        d.accept(ctx, [guess, 1, 2], 1 if tokens else 0)
    assert d.draft(ctx, 1)[0]


def test_short_match_proposes_its_whole_copy_only_where_columns_are_free():
    from mlx_lm_spec_decode import DraftContext

    d = NGramDrafter(n_max=4, n_min=2)
    history = [1, 2, 3, 4, 5, 6, 7, 9, 1, 2]  # "1 2" matched before: a short match
    lengths = {}
    for name, cost in (("unmeasured", None), ("dear", (1.0, 0.2)), ("free", (1.0, 0.0))):
        ctx = DraftContext(None, [], d.make_cache(), verify_cost=cost)
        d.prefill(ctx, history)
        lengths[name] = d.draft(ctx, 6)[0]
    assert lengths["unmeasured"] == lengths["dear"] == [3, 4]  # about as many as matched
    assert lengths["free"] == [3, 4, 5, 6, 7, 9]  # the whole copy: it costs no more


def _tree(d, history, cost, n=4):
    from mlx_lm_spec_decode import DraftContext

    ctx = DraftContext(None, [], d.make_cache(), verify_cost=cost)
    d.prefill(ctx, history)
    return ctx, sorted(d.draft_tree(ctx, n), key=lambda p: -p[1])


def test_a_free_tree_copies_earlier_occurrences_and_one_token_contexts():
    """Where verify columns cost nothing, the tree holds, beside the latest
    match of each length, earlier occurrences and one-token contexts (a
    longer context weighted more); where they cost, the latest match of
    each length of two tokens or more, as a chain drafter sees."""
    d = NGramDrafter(n_max=3, n_min=2)
    # "1 2" went on as 3 4 and, earlier, as 5 6; "2" alone, once, as 7 8.
    history = [1, 2, 5, 6, 9, 2, 7, 8, 9, 1, 2, 3, 4, 0, 1, 2]
    _, dear = _tree(d, history, (1.0, 0.2), 2)
    assert [p for p, _ in dear] == [[3, 4]]
    _, free = _tree(d, history, (1.0, 0.0), 2)
    assert [p for p, _ in free] == [[3, 4], [5, 6], [7, 8]]
    assert free[0][1] == free[1][1] > free[2][1]  # two tokens of context, then one
    # The index holds single tokens for the trees; chains still need n_min.
    ctx, _ = _tree(d, [5, 2, 7, 8, 9, 2], (1.0, 0.0))
    assert ctx.cache[0].match()[0] == 1 and d.draft(ctx, 2)[0] == []


def test_a_silent_length_rides_only_in_a_round_a_heard_one_makes():
    """A length silenced for guessing wrong proposes nothing on its own,
    but where columns are free its copies join a tree a heard length
    proposes."""
    d = NGramDrafter(n_max=3, n_min=2)
    history = [1, 2, 5, 6, 9, 2, 7, 8, 9, 1, 2, 3, 4, 0, 1, 2]
    ctx, _ = _tree(d, history, (1.5, 0.0), 2)  # free columns, a round at 1.5 steps
    ctx.state["hits"] = {2: (5.0, 0.0)}  # two tokens of context: always wrong
    assert [p for p, _ in d.draft_tree(ctx, 2)] == [[7, 8], [3, 4], [5, 6]]
    ctx.state["hits"] = {2: (5.0, 0.0), 1: (5.0, 0.0)}  # every length silent
    assert d.draft_tree(ctx, 2) == []


def test_the_bar_to_be_heard_is_what_a_round_costs_over_a_step():
    """A length right a fifth of the time is silent where columns cost or a
    round costs 1.5 steps, and heard where a round costs about a step: a
    fifth of a token more per round pays for a tenth of a step."""
    d = NGramDrafter(n_max=3, n_min=2)
    history = [1, 2, 5, 6, 9, 1, 2]
    heard = {}
    for name, cost in (("dear", (1.0, 0.2)), ("free, 1.5", (1.5, 0.0)), ("free, 1.1", (1.1, 0.0))):
        ctx, _ = _tree(d, history, cost, 2)
        ctx.state["hits"] = {2: (5.0, 1.0)}  # right a fifth of the time
        heard[name] = bool(d.draft(ctx, 2)[0]), bool(d.draft_tree(ctx, 2))
    assert heard == {
        "dear": (False, False),
        "free, 1.5": (False, False),
        "free, 1.1": (True, True),
    }
