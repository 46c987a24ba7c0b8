"""The copying oracle of ``benchmarks/bench_drafting_ceiling.py``: its copy
lengths against brute force, and its closed loop against hand-worked cases
(the ceilings quoted for the suffix and batched-server targets rest on them)."""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import bench_drafting_ceiling as ceiling  # noqa: E402


def brute_lengths(context, output, n, cap):
    full = list(context) + list(output)
    out = []
    for i in range(len(output)):
        j = len(context) + i
        best = 0
        for s in range(j):
            if s < n or any(full[s - b] != full[j - b] for b in range(1, n + 1)):
                continue
            k = 0
            while k < cap and j + k < len(full) and full[s + k] == full[j + k]:
                k += 1
            best = max(best, k)
        out.append(best)
    return out


@pytest.mark.parametrize("n", [0, 1, 2])
def test_copy_lengths_match_brute_force(n):
    rng = random.Random(n)
    for _ in range(30):
        vocab = rng.choice([2, 3, 5])
        context = [rng.randrange(vocab) for _ in range(rng.randrange(0, 30))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(1, 25))]
        cap = rng.choice([1, 3, 15])
        assert ceiling.copy_lengths(context, output, n, cap) == brute_lengths(
            context, output, n, cap
        )


def test_copy_runs_into_the_output_and_needs_its_context():
    # "1 2 3" then the output repeats it twice: the second copy may read the first.
    assert ceiling.copy_lengths([1, 2, 3], [1, 2, 3, 1, 2, 3], 0, 15) == [6, 5, 4, 3, 2, 1]
    # With two tokens of context, position 0 has none that occurred before "1".
    assert ceiling.copy_lengths([7, 1, 2, 3], [1, 2, 3], 2, 15)[0] == 0
    assert ceiling.copy_lengths([7, 1, 2, 3], [1, 2, 3], 1, 15)[:2] == [0, 2]


def test_ngram_lengths_score_the_drafters_own_proposal():
    # "1 2 3 4" then "1 2": the drafter proposes "3 4 1 2" (what followed
    # "1 2"); the output goes "3 9": one right. After "1 2 3" it proposes "4",
    # wrong; "3 9" and "9 1" never occurred, so nothing. At the output's
    # "1 2" the latest occurrence is the one the output continued ("3 9"):
    # two right, and after "1 2 3" now "9": one.
    context, output = [1, 2, 3, 4, 1, 2], [3, 9, 1, 2, 3, 9]
    assert ceiling.ngram_lengths(context, output, 4) == [1, 0, 0, 0, 2, 1]
    # Where the latest occurrence is the wrong one: after "1 2" the drafter
    # proposes "6" (the latest), the oracle copies "5" (an earlier one).
    context, output = [7, 1, 2, 5, 8, 1, 2, 6, 9], [1, 2, 5]
    assert ceiling.ngram_lengths(context, output, 4)[2] == 0
    assert ceiling.copy_lengths(context, output, 2, 4)[2] == 1


def test_tree_lengths_hold_earlier_occurrences_and_one_token_contexts():
    # The latest "1 2" went on as "6", an earlier one as "5 8": the chain
    # drafter gets none of "5 8", its tree on free columns both.
    context, output = [7, 1, 2, 5, 8, 1, 2, 6, 9, 1, 2], [5, 8]
    assert ceiling.ngram_lengths(context, output, 4)[0] == 0
    assert ceiling.tree_lengths(context, output, 15)[0] == 2
    # "2 3" never occurred, "3" alone did, followed by "5".
    context, output = [4, 3, 5, 9, 2, 3], [5, 1]
    assert ceiling.ngram_lengths(context, output, 4)[0] == 0
    assert ceiling.tree_lengths(context, output, 15)[0] == 1


def flat(batches, per_step=1.0, per_column=0.0):
    return {(B, w): per_step + per_column * (w - 1) for B in batches for w in ceiling.WIDTHS}


def test_nothing_to_copy_is_stock():
    lengths = [[0] * 10, [0] * 7]
    for C in (1, 2):
        ratio, tpf = ceiling.simulate(lengths, C, flat(range(1, 3), per_column=0.1))
        assert (ratio, tpf) == (1.0, 1.0)


def test_free_columns_take_whole_copies():
    # A forward costs the same at every width: each round keeps 1 + the copy length.
    lengths = [[5, 4, 3, 2, 1, 0]]  # one round for the first 6 tokens
    ratio, tpf = ceiling.simulate(lengths, 1, flat([1]))
    assert tpf == 6.0 and ratio == 6.0


def test_dear_columns_are_not_bought():
    # A column costs a whole step: a window never beats a plain step.
    lengths = [[3, 2, 1, 0]]
    ratio, tpf = ceiling.simulate(lengths, 1, flat([1], per_column=1.0))
    assert ratio == pytest.approx(1.0) and tpf >= 1.0


def test_batched_rounds_share_one_width():
    # Row 0 could copy 3 tokens, row 1 nothing: a width-4 window costs 1.3
    # steps for 5 tokens against 2 tokens a plain step.
    lengths = [[3, 2, 1, 0], [0, 0, 0, 0]]
    cost = flat([1, 2], per_column=0.1)
    ratio, tpf = ceiling.simulate(lengths, 2, cost)
    # Round 1 (width 4): 4 + 1 tokens at 1.3; then row 1 alone runs 3 plain
    # steps at 1.0 (row 0 finished): 8 tokens in 4.3 steps, stock 8 in 4.
    assert ratio == pytest.approx((8 / 4.3) / (8 / 4))
    assert tpf == pytest.approx(8 / 5)


def test_a_flat_verify_prices_every_width_alike():
    # A memory-bound device: a round costs 1.5 steps at any width, so one
    # round over a 6-token copy (7 tokens) beats 7 plain steps 7 / 1.5 to 1.
    cost = ceiling.flat_costs([1], 1.5)
    assert cost[1, 1] == 1.0 and {cost[1, w] for w in ceiling.WIDTHS[1:]} == {1.5}
    ratio, tpf = ceiling.simulate([[6, 5, 4, 3, 2, 1, 0]], 1, cost)
    assert tpf == 7.0 and ratio == pytest.approx(7 / 1.5)


def test_a_drafters_own_rounds_pay_for_wrong_guesses():
    # Position 0: a proposal that held for 2 tokens; 3: one that failed; 1,
    # 2 (covered by the first round) and 4: nothing proposed, plain steps.
    lengths = [[2, None, None, 0, None]]
    cost = ceiling.flat_costs([1], 1.5)
    ratio, tpf = ceiling.simulate(lengths, 1, cost, own=True)
    # A round of 3 tokens at 1.5, a failed round of 1 at 1.5, a plain step.
    assert tpf == pytest.approx(5 / 3)
    assert ratio == pytest.approx((5 / 4.0) / 1.0)
    # The oracle may not skip the failed round, nor run one where none was proposed.
    assert ceiling.simulate([[None] * 4], 1, cost, own=True) == (1.0, 1.0)
