"""The draft-length rule both drivers share (policy), and the serial
controller following it: long windows where a verify's width is free, short
ones where each column costs a step."""

import pytest

from mlx_lm_spec_decode import policy
from mlx_lm_spec_decode.batch_verify import BatchController
from mlx_lm_spec_decode.controller import Controller


def test_best_length_follows_the_cost_of_a_column():
    flat = (1.0, 0.3, 0.0)  # a memory-bound GPU: a verify costs 1.3 steps at any width
    steep = (1.0, 0.0, 0.8)  # a CPU: each column costs most of a step
    assert policy.best_length([0.9], [12], flat, 12)[0] == 12
    assert policy.best_length([0.9], [12], steep, 12)[0] <= 2
    # Rows that propose fewer drafts than γ bound what a longer γ buys.
    assert policy.best_length([0.9, 0.9], [2, 3], flat, 12)[0] == 3
    # Nothing beats the floor (plain steps' rate): no round.
    assert policy.best_length([0.1], [8], flat, 8, floor=1.0) == (0, 1.0)


def test_fit_separates_a_verify_from_its_columns():
    samples = [(w, 1.3 + 0.05 * (w - 1)) for w in (2, 4, 8) for _ in range(3)]
    extra, b = policy.fit(samples, 1.0)
    assert extra == pytest.approx(0.3) and b == pytest.approx(0.05)
    # One width: no intercept to fit, the excess is all columns.
    assert policy.fit([(4, 1.6)] * 3, 1.0) == pytest.approx((0.0, 0.2))


def test_acceptance_is_geometric_and_recent():
    acc = policy.Acceptance()
    for _ in range(10):
        acc.observe(4, 4)  # all kept: successes, no failure
    assert acc.alpha > 0.95
    for _ in range(20):
        acc.observe(4, 0)  # the first draft rejected at once
    assert acc.alpha < 0.1


@pytest.mark.parametrize("column, long_", [(0.0, True), (0.8, False)])
def test_the_serial_draft_length_is_the_batch_rule_for_one_row(column, long_):
    """A verify costing 1.3 steps at any width drafts long windows even
    though some rounds end on a rejection (which used to shrink γ by one
    each time); one whose columns cost most of a step stays short. The
    serial controller and a one-row batch agree."""
    ctl = Controller(3, 12)
    ctl.update(0, 0, 1.0)
    ctl.update(0, 0, 1.0)
    batch = BatchController(3, 12)
    for _ in range(3):
        batch.plain_step(1, 1.0)
    acc = policy.Acceptance()
    for i in range(16):
        k = ctl.gamma
        a = k - 1 if i % 3 == 0 else k  # every third round ends on a rejection
        ctl.update(k, a, 1.3 + column * k)
        batch.verify_round(1, k + 1, 1.3 + column * k)
        acc.observe(k, a)
    assert (ctl.gamma >= 8) == long_
    # Where no length beats plain steps the batch runs none; the serial loop
    # keeps γ 1 and leaves it to its switch-off.
    assert max(1, batch.choose(1, [12], [acc.alpha])) == ctl.gamma


def test_padded_windows_at_one_width_price_their_excess_as_the_verify_not_its_columns():
    """Where windows are padded (a GPU), rounds timed at one width alone
    must not make the columns look dear, or γ stays inside that width and a
    second width is never timed: the serial controller drafts past it."""
    assert policy.fit([(4, 1.6)] * 3, 1.0, padded=True) == pytest.approx((0.6, 0.0))
    for widths, long_ in (((4, 8, 12, 16), True), ((), False)):
        ctl = Controller(3, 12, widths=widths)
        ctl.update(0, 0, 1.0)
        ctl.update(0, 0, 1.0)
        for _ in range(4):
            ctl.update(3, 2, 1.6)  # window 4: 0.6 steps more than a plain step
        assert (ctl.gamma > 3) == long_, (widths, ctl.gamma)


def test_a_draft_models_steps_are_paid_per_draft_not_per_padded_column():
    """A window padded to one width costs the same at any draft length, but
    each token a draft model drafts costs its step: the length stops where
    another draft costs more than it is expected to keep, and drafting
    stays on (pricing the step per padded column, every round looked like
    fifteen draft steps, and a draft model that paid was switched off)."""
    flat = (1.0, 0.3, 0.0)
    width16 = lambda w: 16  # noqa: E731
    g, rate = policy.best_length([0.9], [15], flat, 15, width16, draft=0.3)
    assert 2 <= g <= 8 and rate > 1.0
    assert policy.best_length([0.9], [15], flat, 15, width16)[0] == 15
    ctl = Controller(3, 15, widths=(16,))
    ctl.update(0, 0, 1.0)
    ctl.update(0, 0, 1.0)
    ctl.drafted(1, 0.5)
    ctl.drafted(1, 0.5)  # a draft step: half a plain step (a small model, host-bound)
    for _ in range(6):
        ctl.update(3, 2, 1.3 + 3 * 0.5)  # two of three kept; the verify 1.3 steps
    assert ctl.off_for == 0 and 1 <= ctl.gamma < 15
