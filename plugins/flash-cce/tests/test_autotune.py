"""The memory budget and the measuring ``auto`` backend, on real computation.

Each test's choices go to its own cache folder (``conftest._autotune_cache``).
The data-parallel test launches two local processes with MLX's ring backend.
"""

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_lm_ext import PluginError
from mlx_lm_flash_cce import autotune, backends, budget, linear_cross_entropy, plugin
from mlx_lm_flash_cce.candidate import Candidate
from mlx_lm_flash_cce.candidate import Path as P

HERE = Path(__file__).parent
# The candidates and floors these tests name are the CPU's (a GPU measures more paths).
cpu_only = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="asserts the CPU's candidates")


def _case(n=512, v=3000, h=64, seed=0):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    hidden = mx.random.normal((n, h), key=k1)
    weight = mx.random.normal((v, h), key=k2) * h**-0.5
    targets = mx.random.randint(0, v, (n,), key=k3)
    return hidden, weight, targets


def _stock(hidden, weight, targets):
    return nn.losses.cross_entropy(hidden @ weight.T, targets, reduction="mean")


def _loss_and_grad(fn, hidden):
    value, grad = mx.value_and_grad(fn)(hidden)
    mx.eval(value, grad)
    return value, grad


# ------------------------------------------------------------------ budget


@pytest.mark.parametrize(
    "text,want",
    [
        ("512M", 512 << 20),
        ("2G", 2 << 30),
        ("1.5G", 3 << 29),
        ("64k", 64 << 10),
        ("1048576", 1 << 20),
        ("3 GiB", 3 << 30),
        (4096, 4096),
    ],
)
def test_parse_size(text, want):
    assert budget.parse_size(text) == want


@pytest.mark.parametrize("text", ["lots", "2X", "-1G", "", "1.2.3M"])
def test_parse_size_rejects_nonsense(text):
    with pytest.raises(ValueError, match="not a memory size"):
        budget.parse_size(text)


def test_format_size_rounds_up_to_mib():
    assert budget.format_size(2 << 30) == "2G"
    assert budget.format_size((1 << 20) + 1) == "2M"
    assert budget.format_size(1536 << 20) == "1536M"


def test_default_budget_is_half_the_stock_head_within_floor_and_cap():
    assert budget.default_for(100 << 30) == budget.DEFAULT_CAP
    assert budget.default_for(1 << 30) == 512 << 20
    assert budget.default_for(1 << 20) == budget.DEFAULT_FLOOR


@cpu_only
def test_a_budget_no_path_fits_names_the_smallest():
    hidden, weight, targets = _case(n=4096, v=3000, h=64)
    # the pure-MLX path keeps [N, H] float32 accumulators and its output: 2 MiB here
    with pytest.raises(PluginError, match=r"--cce-memory-budget 1M is below .* the smallest is 2M"):
        linear_cross_entropy(hidden, weight, targets, memory_budget="1M")
    value = linear_cross_entropy(hidden, weight, targets, memory_budget="2M")
    assert abs(value.item() - _stock(hidden, weight, targets).item()) < 1e-4


@cpu_only
def test_budget_too_small_is_bad_input_at_the_first_batch(tiny_model):
    """A PluginError: the host turns it into exit 2 around mlx-lm's train()."""
    from mlx_lm import load

    model, _ = load(str(tiny_model("llama")))
    args = plugin.argparse.Namespace(cce_memory_budget="1M")
    opts = plugin.activate("lora", args)
    try:
        loss = plugin.make_loss("flash-cce", model, args, opts)
        batch = mx.random.randint(0, 1000, (4, 1025), key=mx.random.key(0))
        lengths = mx.array([[0, 1024]] * 4)
        model.train()
        with pytest.raises(PluginError, match="below what any flash-cce path needs"):
            loss(model, batch, lengths)
    finally:
        plugin.deactivate()


def test_memory_limit_is_held_and_restored():
    before = mx.set_memory_limit(10 << 30)
    try:
        held = budget.LIMIT.hold(0, floor=12 << 30)
        assert held == budget.LIMIT.limit == 12 << 30
        assert mx.set_memory_limit(12 << 30) == 12 << 30  # what MLX holds now
        assert budget.LIMIT.hold(0, floor=11 << 30) == 12 << 30  # never lowered
        assert budget.LIMIT.hold(0, floor=13 << 30) == 13 << 30  # raised
        above = budget.LIMIT.hold(14 << 30)  # active memory + 14 GiB: above the 13 GiB floor
        assert above >= (14 << 30) and mx.set_memory_limit(above) == above
        plugin.deactivate()  # the end of mlx_lm.lora
        assert budget.LIMIT.limit is None
        assert mx.set_memory_limit(10 << 30) == 10 << 30  # the limit from before the first hold
    finally:
        budget.LIMIT.release()
        mx.set_memory_limit(before)


# -------------------------------------------------------------------- auto


def test_auto_trial_picks_the_fastest_within_budget_and_caches_it(caplog, monkeypatch):
    hidden, weight, targets = _case()
    trials = []
    real_trial = autotune.trial
    monkeypatch.setattr(autotune, "trial", lambda *a, **k: trials.append(1) or real_trial(*a, **k))
    fn = lambda x: linear_cross_entropy(x, weight, targets, memory_budget="1G")  # noqa: E731
    with caplog.at_level(logging.INFO, logger="mlx_lm_flash_cce"):
        value, grad = _loss_and_grad(fn, hidden)
    want, want_grad = _loss_and_grad(lambda x: _stock(x, weight, targets), hidden)
    assert abs(value.item() - want.item()) < 1e-4 and mx.allclose(grad, want_grad, atol=1e-5)
    assert trials == [1]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("flash-cce auto:")]
    assert len(lines) == 1 and "tried stock" in lines[0] and "chose " in lines[0]
    # the winner is the fastest within the budget, as the line reports them
    tried = re.findall(
        r"(?:tried |, )([a-z-]+(?: \d+x\d+)?(?: \+\d+M)?) ([0-9.]+) ms/\d+ MiB( \(over budget\))?",
        lines[0].split("; chose")[0],
    )
    times = {label: float(ms) for label, ms, over in tried if not over}
    # stock and a flash path (on CUDA the MLX step is spared by the row kernel's same blocks)
    assert "stock" in times and len(times) >= 2
    chosen = lines[0].split("chose ")[1].split(" (")[0]
    assert chosen == min(times, key=times.get)
    data = json.loads(autotune.cache_path().read_text())
    ((key, entry),) = data["choices"].items()
    assert entry["mlx"] == mx.__version__ and entry["device"] == autotune.device_name()
    assert autotune._cached(key).candidate.label == chosen
    # a new process (empty memory) reuses the disk cache: no second trial
    autotune._MEMORY.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mlx_lm_flash_cce"):
        again, _ = _loss_and_grad(fn, hidden)
    assert trials == [1] and abs(again.item() - want.item()) < 1e-4
    assert any("(cached)" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("field,value", [("mlx", "0.0.1"), ("device", "gpu:Some Other GPU")])
def test_cached_choice_from_another_mlx_or_device_is_ignored(field, value, monkeypatch):
    hidden, weight, targets = _case()
    trials = []
    real_trial = autotune.trial
    monkeypatch.setattr(autotune, "trial", lambda *a, **k: trials.append(1) or real_trial(*a, **k))
    linear_cross_entropy(hidden, weight, targets, memory_budget="1G")
    path = autotune.cache_path()
    data = json.loads(path.read_text())
    (key,) = data["choices"]
    data["choices"][key][field] = value
    path.write_text(json.dumps(data))
    autotune._MEMORY.clear()
    linear_cross_entropy(hidden, weight, targets, memory_budget="1G")
    assert trials == [1, 1]  # measured again
    entry = json.loads(path.read_text())["choices"][key]
    assert entry["mlx"] == mx.__version__ and entry["device"] == autotune.device_name()


def test_a_failing_candidate_is_dropped_and_training_goes_on(caplog, monkeypatch):
    def broken(head, hidden, targets, opts, train=None):
        raise RuntimeError("[malloc] Unable to allocate 1099511627776 bytes")

    entry = backends.REGISTRY[P.MLX_BLOCKS]
    monkeypatch.setitem(backends.REGISTRY, P.MLX_BLOCKS, entry._replace(per_token=broken))
    real = autotune.candidates
    monkeypatch.setattr(
        autotune,
        "candidates",
        lambda *a, **k: real(*a, **k) + [Candidate(P.MLX_BLOCKS, 512, 1024)],
    )
    hidden, weight, targets = _case()
    with caplog.at_level(logging.DEBUG, logger="mlx_lm_flash_cce"):
        value, grad = _loss_and_grad(
            lambda x: linear_cross_entropy(x, weight, targets, memory_budget="1G"), hidden
        )
    want, want_grad = _loss_and_grad(lambda x: _stock(x, weight, targets), hidden)
    assert abs(value.item() - want.item()) < 1e-4 and mx.allclose(grad, want_grad, atol=1e-5)
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        "mlx-blocks 512x1024 failed in the trial (RuntimeError" in m and "dropped" in m
        for m in messages
    )
    line = next(m for m in messages if m.startswith("flash-cce auto:") and "chose" in m)
    assert "mlx-blocks 512x1024 failed" in line and "chose mlx-blocks" not in line


@cpu_only
def test_only_one_path_within_the_default_budget_runs_no_trial(caplog, monkeypatch):
    hidden, weight, targets = _case(n=2048, v=49152, h=64)  # the stock head would need ~1.5 GiB
    monkeypatch.setattr(autotune, "trial", lambda *a, **k: pytest.fail("no trial expected"))
    with caplog.at_level(logging.INFO, logger="mlx_lm_flash_cce"):
        linear_cross_entropy(hidden, weight, targets)
    assert any(
        "mlx (the only path within the budget 768M" in r.getMessage() for r in caplog.records
    )


def test_forced_backend_skips_the_trial(monkeypatch):
    hidden, weight, targets = _case()
    monkeypatch.setattr(autotune, "trial", lambda *a, **k: pytest.fail("no trial expected"))
    for backend in ("mlx", "mlx-blocks"):
        value = linear_cross_entropy(hidden, weight, targets, backend=backend, memory_budget="1G")
        assert abs(value.item() - _stock(hidden, weight, targets).item()) < 1e-4
    assert not autotune.cache_path().exists()


def _auto_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("flash-cce auto")]


def test_a_flash_only_run_never_feeds_auto(caplog, monkeypatch):
    """``impl="flash"`` then ``impl="auto"`` (same process, then a new one): auto measures."""
    hidden, weight, targets = _case()  # the stock head needs ~188M: within the 1G budget
    trials = []
    real_trial = autotune.trial
    monkeypatch.setattr(autotune, "trial", lambda *a, **k: trials.append(1) or real_trial(*a, **k))
    with caplog.at_level(logging.INFO, logger="mlx_lm_flash_cce"):
        linear_cross_entropy(hidden, weight, targets, impl="flash", memory_budget="1G")
    (forced,) = _auto_lines(caplog)
    # true reasons: stock fits the budget, the request left it out
    assert "the only path within the budget" not in forced
    assert "stock: not asked for (flash paths only)" in forced and "no trial" in forced
    for fresh in (False, True):
        if fresh:  # a new process: only the disk cache is left
            autotune._MEMORY.clear()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="mlx_lm_flash_cce"):
            value = linear_cross_entropy(hidden, weight, targets, memory_budget="1G")
        assert abs(value.item() - _stock(hidden, weight, targets).item()) < 1e-4
        (line,) = _auto_lines(caplog)
        # one trial, auto's own; the new process reuses that decision from the disk cache
        assert trials == [1] and "tried stock" in line and ("(cached)" in line) == fresh
    # the flash-only request keeps its own decision too
    autotune._MEMORY.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mlx_lm_flash_cce"):
        linear_cross_entropy(hidden, weight, targets, impl="flash", memory_budget="1G")
    (again,) = _auto_lines(caplog)
    assert trials == [1] and "(cached)" in again and "stock: not asked for" in again


@cpu_only
def test_the_only_path_line_gives_each_other_paths_true_reason(caplog):
    """A quantized head on the CPU: stock fits the budget but is not timed; the line says so."""
    hidden, weight, targets = _case(n=256, v=2048, h=64)
    layer = nn.QuantizedLinear(64, 2048, bias=False, group_size=32, bits=8)
    layer.weight, layer.scales, layer.biases = mx.quantize(weight, group_size=32, bits=8)
    with caplog.at_level(logging.INFO, logger="mlx_lm_flash_cce"):
        linear_cross_entropy(hidden, layer, targets, memory_budget="1G")
    (line,) = _auto_lines(caplog)
    assert ": mlx (the only path left (budget 1G); stock: not timed" in line
    assert "within the budget" not in line


def test_a_named_path_runs_itself_or_says_why_not():
    hidden, weight, targets = _case(n=64)
    lin = nn.Linear(64, 3000, bias=True)
    for impl, backend in (("flash", "mlx-blocks"), ("auto", "mlx-blocks")):
        with pytest.raises(PluginError, match="'mlx-blocks' cannot run this call here"):
            linear_cross_entropy(
                hidden, lin, targets, impl=impl, backend=backend, min_flash_elements=0
            )
    with pytest.raises(
        PluginError, match="'chunked' cannot run this call here: a head given as a weight array"
    ):
        linear_cross_entropy(hidden, weight, targets, impl="chunked")
    with pytest.raises(ValueError, match="unknown flash-cce path 'metal'"):
        linear_cross_entropy(hidden, weight, targets, backend="metal")


# ---------------------------------------------------------- data parallel


@cpu_only
def test_ranks_agree_on_auto_choice(tmp_path):
    launch = shutil.which("mlx.launch") or str(Path(sys.executable).with_name("mlx.launch"))
    if not os.path.exists(launch):
        pytest.skip("mlx.launch (MLX's distributed launcher) is not installed")
    out = tmp_path / "out"
    out.mkdir()
    cmd = [
        launch,
        "-n",
        "2",
        "--backend",
        "ring",
        "--python",
        sys.executable,
        str(HERE / "dp_worker.py"),
        str(tmp_path),
        str(out),
    ]
    # its own process group: a hang (ranks pairing the wrong collectives) ends with every rank
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail("the ranks did not finish (mismatched collectives?):\n" + output[-2000:])
    assert proc.returncode == 0, output[-3000:]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    # rank 1's own cache says "stock"; rank 0 measured, and its trial prefers the pure-MLX path
    assert results[1]["own_cache"] == "stock"
    assert results[0]["choice"] == results[1]["choice"] == results[0]["measured"] == "mlx"
    assert results[0]["loss"] == pytest.approx(results[1]["loss"], abs=1e-6)
    # later batches of other (per-rank) shapes keep it, without collective calls
    assert (
        results[0]["later"] == results[1]["later"] == "mlx"
        and results[0]["paired"] == results[1]["paired"] == 2
    )
    # only rank 0 writes its cache; rank 1's stays as it was
    assert results[0]["cached"] == results[0]["choice"] and results[1]["cached"] == "stock"


# ------------------------------------------------------------- the trial's own cost


def test_a_fitting_big_block_path_spares_the_trials_it_dominates(monkeypatch):
    C = Candidate
    big, small = (
        C(P.CUDA_GEMM, 8192, 16384, 1024),
        C(P.CUDA_GEMM, 2048, 8192, 128),
    )
    mlx_big = C(P.MLX_BLOCKS, 8192, 16384, 1024)
    assert autotune.dominates(big, small) and autotune.dominates(big, mlx_big)
    assert not autotune.dominates(small, big) and not autotune.dominates(mlx_big, big)
    assert not autotune.dominates(mlx_big, small)  # another step at other blocks: measured
    # ... but blocks 16x the size win whatever the step (measured on the H200)
    assert autotune.dominates(C(P.MLX_BLOCKS, 8192, 32768, 1024), small)
    assert not autotune.dominates(small, C(P.MLX_BLOCKS, 8192, 32768, 1024))
    assert not autotune.dominates(C(P.STOCK), small)

    peaks = {big: 100 << 20, small: 50 << 20, mlx_big: 60 << 20}
    timed = []

    def measure(run, cand, hidden):
        timed.append(cand)
        return autotune.Result(cand, 1.0, peaks[cand])

    monkeypatch.setattr(autotune, "_measure", measure)
    hidden, weight, targets = _case()
    spec = autotune._heads.as_head(weight)
    run = lambda *a: None  # noqa: E731 (never called: _measure is replaced)
    # big fits 200 MiB: the two it dominates are not run
    results, _ = autotune.trial([big, mlx_big, small], spec, 512, 64, mx.float32, 200 << 20, run)
    assert timed == [big] and [r.candidate for r in results] == [big]
    # big is over a 80 MiB budget: the others are measured
    timed.clear()
    results, _ = autotune.trial([big, mlx_big, small], spec, 512, 64, mx.float32, 80 << 20, run)
    assert timed == [big, mlx_big, small]


def test_the_trial_measures_a_quantized_head_with_the_real_scales_dtype():
    weight = mx.random.normal((1024, 128)).astype(mx.bfloat16)
    layer = nn.QuantizedLinear(128, 1024, bias=False, group_size=64, bits=4)
    layer.weight, layer.scales, layer.biases = mx.quantize(weight, group_size=64, bits=4)
    spec = autotune._heads.as_head(layer)
    assert spec.kind == "quantized" and spec.scales.dtype == mx.bfloat16
    _, head, _ = autotune._synthetic(spec, 16, 128, mx.bfloat16)
    assert head.scales.dtype == mx.bfloat16 and head.biases.dtype == mx.bfloat16
