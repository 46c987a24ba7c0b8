"""The policy both drivers share (policy): the draft-length rule (long
windows where a verify's width is free, short ones where each column costs
a step), and one object keyed by batch size that the serial controller (B =
1) and the batch's controller both are: the same γ, the same verdict and
one switch with a doubling back-off for the same timings."""

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


# ------------------------------------------------ one policy, two drivers


def one_row(ctl, batch, acc, rounds, seconds, kept, k=3):
    """The same timings to the serial controller and to a one-row batch:
    two plain steps of a second, then ``rounds`` rounds of ``k`` drafts
    that keep ``kept`` each and take ``seconds`` (the batch's calls too)."""
    for _ in range(2):
        ctl.update(0, 0, 1.0)
        batch.plain_step(1, 1.0)
    for _ in range(rounds):
        ctl.update(k, kept, seconds)
        batch.verify_round(1, k + 1, seconds, tokens=kept + 1)
        batch.call(1, kept + 1, seconds, True)
        acc.observe(k, kept)


def test_the_serial_controller_and_a_one_row_batch_reach_the_same_length_and_verdict():
    """One policy keyed by batch size: the serial loop is its B = 1. Rounds
    that pay (four tokens in 1.3 plain steps) keep drafting on in both, at
    the same γ; rounds whose drafts all miss (one token in 1.5 plain steps,
    though the cost model would let a good drafter pay) switch it off in
    both, for the same reason. The serial loop judges its rounds, the batch
    its calls (more of them: a call may be a plain step), by one rule."""
    ctl, batch, acc = Controller(3, 8), BatchController(3, 8), policy.Acceptance()
    one_row(ctl, batch, acc, BatchController.JUDGE, 1.3, 3)
    assert ctl.verify_cost() == pytest.approx(batch.verify_cost(1))
    assert not ctl.switched_off and batch.drafting(1)
    assert batch.choose(1, [8], [acc.alpha]) == ctl.gamma > 3

    ctl, batch, acc = Controller(3, 8), BatchController(3, 8), policy.Acceptance()
    one_row(ctl, batch, acc, BatchController.JUDGE, 1.5, 0)
    assert not ctl.cannot_pay(1) and not batch.cannot_pay(1)  # the verify could pay
    assert ctl.switched_off and not ctl.for_good and not batch.drafting(1)
    why = "took 1.50x a plain step per token"
    assert why in ctl.why and why in batch.switch(1).why, (ctl.why, batch.switch(1).why)
    assert batch.choose(1, [8], [acc.alpha]) == 0  # the rounds' record declines too


def test_a_size_whose_rounds_lose_is_switched_off_and_retried_after_a_doubling_back_off():
    """Drafting judged against plain steps' tokens per second: a batch size
    whose calls lose is off for WAIT calls (the last retries), twice as
    many after each loss in a row; a size with no verdict of its own takes
    a smaller one's; a win ends the doubling. The serial loop's back-off
    (in tokens) is the same switch."""
    ctl = BatchController(3, 8)
    ctl.plain_step(4, 0.1)  # 40 tokens/s
    ctl.plain_step(4, 0.1)

    def lose_then_wait(B=4):
        """Losing calls until drafting is off, then calls until it is back:
        how many of each."""
        calls = off = 0
        while ctl.switch(B).left == 0:
            assert ctl.drafting(B)
            ctl.call(B, 4, 0.2, True)  # 20 tokens/s
            calls += 1
        while not ctl.drafting(B):
            off += 1
        return calls, off

    J, W = BatchController.JUDGE_AGAIN, BatchController.WAIT
    assert [lose_then_wait() for _ in range(3)] == [(J, W - 1), (J, 2 * W - 1), (J, 4 * W - 1)]
    assert "calls took 2.00x a plain step per token" in ctl.switch(4).why
    for _ in range(J):
        ctl.call(4, 4, 0.08, True)  # 50 tokens/s: drafting pays again
    assert lose_then_wait()[1] == W - 1  # (the calls that won still weigh in at first)
    for _ in range(J):
        ctl.call(4, 4, 0.2, True)
    assert not ctl.drafting(5)  # five rows take four's verdict while it is off

    serial = Controller(3, 8)
    serial.update(0, 0, 1.0)
    serial.update(0, 0, 1.0)
    waits = []
    for _ in range(3):
        while not serial.switched_off:
            serial.update(3, 0, 1.5)  # one token in 1.5 plain steps
        waits.append(serial.off_for)
        serial.resume()  # the loop spent the back-off on plain steps
    assert waits == [Controller.WAIT, 2 * Controller.WAIT, 4 * Controller.WAIT]


def test_a_verify_or_a_draft_step_that_can_never_pay_switches_off_for_good():
    """Where a verify over w tokens costs about w plain steps (a CPU's
    quantized kernel), no drafter could pay: a back-off first (two verifies
    may have been slowed by other work), then off for the request once
    VERIFY_SURE verifies agree. A draft step as dear as a target step is
    off for good once DRAFT_SURE timed drafts agree."""
    ctl = Controller(3, 8)
    ctl.update(0, 0, 1.0)
    ctl.update(0, 0, 1.0)
    offs = []
    for _ in range(Controller.VERIFY_SURE):
        ctl.update(3, 3, 0.1 + 0.95 * 4)  # every draft kept, still no gain
        offs.append((ctl.switched_off, ctl.for_good))
        if not ctl.for_good:
            ctl.resume()  # the loop spent the back-off on plain steps
    assert ctl.cannot_pay(1)
    assert offs[0] == (False, False) and offs[1] == (True, False) and offs[-1] == (True, True)
    assert ctl.why == "a verify forward costs too many plain steps to gain"

    dear = Controller(3, 8)
    dear.update(0, 0, 1.0)
    dear.update(0, 0, 1.0)
    for _ in range(Controller.DRAFT_SURE):
        assert not dear.switched_off and dear.time_draft()
        dear.drafted(1, 0.9)  # a draft step: 0.9 of a target step
        dear.update(1, 1, 1.0 + 0.9)
    assert dear.for_good and dear.off_for >= policy.FOREVER // 2
    assert dear.why == "a draft step costs about as much as a target step"


def test_one_slow_timing_does_not_make_a_cheap_draft_step_dear():
    """Two timed drafts, one built kernels and one was slowed by other
    work: the step looks as dear as a target step, but drafting stays on
    and more drafts are timed; the first cheap one ends it. Carried to the
    drafter's next request, the step is timed again the same way."""
    for carried in (False, True):
        ctl = Controller(3, 8)
        ctl.update(0, 0, 1.0)
        ctl.update(0, 0, 1.0)
        if carried:
            ctl.carry(((1.0, 1.0), (), (0.9, 2)))
        else:
            ctl.drafted(1, 5.0)  # its kernels built
            ctl.drafted(3, 2.7)  # slowed: 0.9 of a target step a token
        for _ in range(3):
            ctl.update(3, 3, 1.5 + 3 * 0.9)  # every draft kept
        assert not ctl.switched_off and ctl.time_draft()
        ctl.drafted(3, 0.03)  # its real cost
        ctl.update(3, 3, 1.5 + 3 * 0.01)
        assert not ctl.switched_off and not ctl.time_draft()
        assert ctl.draft_cost() == pytest.approx(0.01)


def test_a_plain_step_is_probed_only_after_rounds_with_none_among_them():
    """The serial controller times a plain step after ``PROBE_EVERY``
    drafting rounds in a row; where the text's gaps ran plain steps between
    rounds (a lookup's misses), those are its timings, and no round's
    forward is spent on a probe."""
    for gaps in (False, True):
        ctl = Controller(3, 8)
        ctl.carry(((1.0, 1.0), (), None))  # plain steps known: no first probe
        wants = []
        for r in range(3 * Controller.PROBE_EVERY):
            k = ctl.want()
            wants.append(k)
            ctl.update(k, k, 1.0 if k == 0 else 1.2)
            if gaps and r % 5 == 4:
                ctl.update(0, 0, 1.0)  # a miss: one plain step
        probes = wants.count(0)
        assert probes == (0 if gaps else 2), wants
