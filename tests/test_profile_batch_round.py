"""profile_batch_round.decode: one batch, or a busy server's queue of requests."""

import contextlib
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pbr():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "profile_batch_round", ROOT / "benchmarks" / "profile_batch_round.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Counting:
    """A generator whose request i emits ``prompt[0] * 100 + k`` for its k-th
    token; ``lengths[prompt[0]]`` tokens, then it finishes. Records the most
    rows it ever decoded at once and the calls it answered."""

    def __init__(self, lengths):
        self.lengths, self.rows, self.next_uid = lengths, {}, 0
        self.most = self.calls = 0

    def insert(self, prompts, max_tokens):
        uids = []
        for p, m in zip(prompts, max_tokens, strict=True):
            self.rows[self.next_uid] = [p[0], 0, min(m, self.lengths[p[0]])]
            uids.append(self.next_uid)
            self.next_uid += 1
        return uids

    def next(self):
        self.calls += 1
        self.most = max(self.most, len(self.rows))
        out = []
        for uid, row in list(self.rows.items()):
            row[1] += 1
            done = row[1] == row[2]
            out.append(
                SimpleNamespace(
                    uid=uid, token=row[0] * 100 + row[1], finish_reason="length" if done else None
                )
            )
            if done:
                del self.rows[uid]
        return [], out


def test_one_batch_ends_with_its_slowest_row(pbr):
    gen = Counting({0: 3, 1: 5})
    tokens, calls = pbr.decode(gen, [[0], [1]], max_tokens=10)
    assert tokens == [[1, 2, 3], [101, 102, 103, 104, 105]]
    assert gen.calls == 5 and len(calls) == 4  # the call with the first tokens left out


def test_a_queue_keeps_at_most_inflight_rows_and_refills_their_slots(pbr):
    gen = Counting({0: 2, 1: 4, 2: 3, 3: 1})
    prompts = [[0], [1], [2], [3], [0]]
    tokens, calls = pbr.decode(gen, prompts, max_tokens=10, inflight=2)
    assert tokens == [[1, 2], [101, 102, 103, 104], [201, 202, 203], [301], [1, 2]]
    assert gen.most == 2 and len(calls) == gen.calls
    # Each slot refilled in the call after its row finished: the last
    # request starts once two rows finished at call 5, and ends at call 7.
    assert gen.calls == 7


def test_varied_budgets_are_seeded_spread_and_each_request_keeps_its_own(pbr):
    budgets = pbr.budgets(6, 10, 0.5)
    assert budgets == pbr.budgets(6, 10, 0.5)  # stock and ours get the same
    assert all(5 <= b <= 15 for b in budgets) and len(set(budgets)) > 1
    assert pbr.budgets(6, 10, 0.0) == 10
    gen = Counting({0: 99, 1: 99, 2: 99})
    prompts = [[0], [1], [2], [0], [1], [2]]
    tokens, _ = pbr.decode(gen, prompts, max_tokens=budgets, inflight=2)
    assert [len(t) for t in tokens] == budgets


class Timed(Counting):
    """``Counting`` with mlx-lm's ``stats()``: the calls it answered in the block."""

    @contextlib.contextmanager
    def stats(self):
        out, start = SimpleNamespace(), self.calls
        yield out
        out.generation_steps = self.calls - start


def test_a_queue_reports_its_split_where_asked(pbr):
    gen, parts = Timed({0: 2, 1: 3}), []
    _, calls = pbr.decode(gen, [[0], [1], [0]], max_tokens=10, inflight=2, parts=parts)
    assert len(parts) == 1 and parts[0].generation_steps == gen.calls == len(calls)
    assert parts[0].calls == len(calls) and parts[0].host_time >= 0


def test_the_steady_state_counts_the_calls_made_while_requests_wait(pbr):
    # Two slots, three requests: calls 1-2 run while request 2 waits (it
    # takes request 0's slot after call 2); calls 3-4 are the drain.
    gen, parts = Timed({0: 2, 1: 4, 2: 2}), []
    pbr.decode(gen, [[0], [1], [2]], max_tokens=10, inflight=2, parts=parts)
    seconds, tokens, calls = parts[0].steady
    assert (tokens, calls) == (4, 2) and gen.calls == 4 and seconds >= 0
