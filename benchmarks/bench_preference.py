"""Preference training step and DPO reference pass: flash-cce against two full sequences
with logits and against mlx-lm-lora, in one run.

One ``mlx_lm.lora``-style training step (a compiled step, LoRA, Adam) per
method, each in a fresh process (time and peak memory of one never touch
another's):

- ``orpo stock``: each pair as two full sequences ``[prompt, chosen]``,
  ``[prompt, rejected]``, the model's full ``[tokens, vocab]`` logits,
  log-softmax, gather;
- ``orpo mlx-lm-lora``: mlx-lm-lora's ``orpo_loss_from_model`` (two full
  sequences, full logits, its own batches padded to 8) in the step its
  ``train_orpo`` compiles (the same value-and-grad, optimizer update and
  state), when the package is installed;
- ``orpo flash-cce``: ``--loss orpo`` as shipped (each prompt once,
  log-probs from flash-cce, no logits);
- ``dpo mlx-lm-lora``: its ``dpo_loss`` with a reference model (a second
  copy of the weights) run inside every step, as its ``train_dpo`` does;
- ``dpo flash-cce``: ``--loss dpo`` with its reference log-probs
  precomputed (the step computes no reference: it reads them from the
  batch). In the same process, interleaved with its steps: the step with
  the reference in the step (``--loss dpo`` as shipped where the adapters
  sit on the top layers only: the layers below run once, the adapted ones
  twice, with and without the adapters, given the batch as the step that
  first reads its pairs gets it), so that the reference's cost is that
  step less the step without it (a batch read again, its pairs' log-probs
  kept, runs the step without it); the reference pass (``preference.
  fill_reference`` from scratch over one training batch's pairs: forward
  only, adapters off; as shipped where the step cannot compute the
  reference); and the bare forward of the same batch (the same log-probs:
  shared prompt, no logits, compiled once, nothing around it), the floor of
  a pass. These rows run at each ``--dpo-layers`` value (LoRA on the top 16
  layers, mlx-lm's default, and on all, where only the pass applies): the
  step's backward runs through the adapted layers only, the forward through
  all of them.

At prompt:response token ratios 1:1 and 4:1 (``--response`` tokens per
response). Times are the median over ``--repeats`` rounds after a compiling
one, wall and the process's CPU time (all threads; it counts OpenBLAS
threads spinning between calls). On a shared machine CPU time is the one
that compares across processes; within one process, where the three of DPO
share each round's load, both do. Peak memory is ``mx.get_peak_memory()``
during the step minus the memory held before it (weights, optimizer state,
batch). Ratios are against ``orpo stock`` (and mlx-lm-lora where it ran)
from the same run. ``--figures NAME`` prints the DPO ratios as a README
figures block.

    env LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/bench_preference.py
    python benchmarks/bench_preference.py --model random-llama-1b --dtype bfloat16 \\
        --pairs 4 --response 256    # a GPU: ~1B llama, random weights, V=151936
"""

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import common
import mlx.core as mx
import mlx.nn as nn

METHODS = ("orpo stock", "orpo mlx-lm-lora", "orpo flash-cce", "dpo mlx-lm-lora", "dpo flash-cce")
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def _load(model_name, dtype, standin=None):
    """``(model, token ids of real text or None)``; ``standin``: the arguments of
    ``common.add_target_args``, whose stand-in replaces ``model_name`` if given."""
    if standin is not None and standin.standin:
        model, tok = common.load_target(standin, dtype)
        return model, tok.encode(_text())
    if model_name == "random-llama-1b":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_flash_cce import random_llama  # noqa: E402  (a sibling script)

        model = random_llama()
        model.set_dtype(DTYPES[dtype])
        return model, None
    from mlx_lm import load

    from mlx_lm_ext import models

    model, tok = load(str(models.build(model_name, progress=False)))
    if dtype != "float32":
        model.set_dtype(DTYPES[dtype])
    return model, tok.encode(_text())


def _text():
    """Real text the pairs are cut from: CPython's ``LICENSE.txt``."""
    import sysconfig
    from pathlib import Path

    return (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()


def _pairs(ids, vocab, n_pairs, prompt, response):
    from mlx_lm_flash_cce import pairs

    if ids is None:
        key = mx.random.key(0)
        ids = mx.random.randint(0, vocab, (n_pairs * (prompt + 2 * response),), key=key).tolist()
    per = prompt + 2 * response
    rows = []
    for i in range(n_pairs):
        x = ids[i * per : (i + 1) * per]
        rows.append(pairs.Pair(x[:prompt], x[prompt : prompt + response], x[prompt + response :]))
    return rows


def _lora_lora_batch(rows, dpo):
    """mlx-lm-lora's batch of these pairs (its iterate_*_batches: full sequences, pad to 8)."""
    import numpy as np

    seqs = [(p.prompt + p.chosen, p.prompt + p.rejected, len(p.prompt)) for p in rows]
    width = max(max(len(c), len(r)) for c, r, _ in seqs)
    width = 8 * ((width + 7) // 8)
    arrays = [np.zeros((len(rows), width), t) for t in (np.int32, np.int32, np.float32, np.float32)]
    for j, (c, r, plen) in enumerate(seqs):
        arrays[0][j, : len(c)], arrays[1][j, : len(r)] = c, r
        arrays[2][j, plen : len(c)], arrays[3][j, plen : len(r)] = 1.0, 1.0
    batch = [mx.array(a) for a in arrays]
    return batch if dpo else batch + [mx.ones((len(rows),))]


def _loss(method, model, rows):
    """``(loss(model, *batch) -> (value, ntokens), batch)`` for ``method``."""
    from mlx_lm_flash_cce import pairs, preference, shared_prompt

    kind, how = method.split(" ")
    if how == "flash-cce":
        data = [pairs.PairDataset(rows, "b")]
        fn = preference.make_loss(model, kind, beta=0.1, sets=data, precompute=True)
        return (lambda m, *b: fn(m, *b)[:2]), pairs.collate(rows)
    if how == "stock":

        def stock(model, prompts, plens, responses, rlens, refs):
            b = prompts.shape[0]
            tok = shared_prompt.stock_logps(model, prompts, plens, responses)
            seq = preference.sequence_logps(tok, rlens)
            mean = seq / rlens.astype(mx.float32)
            nll = -seq[:b].sum() / rlens[:b].astype(mx.float32).sum()
            value, _, _ = preference.orpo(mean[:b], mean[b:], nll, 0.1)
            return value, plens.sum() + rlens.sum()

        return stock, pairs.collate(rows)
    if kind == "orpo":
        from mlx_lm_lora.trainer import orpo_trainer

        def lora_orpo(model, *batch):
            value, _, toks, _ = orpo_trainer.orpo_loss_from_model(model, *batch, beta=0.1)
            return value, toks

        return lora_orpo, _lora_lora_batch(rows, dpo=False)
    from mlx_lm_lora.trainer import dpo_trainer as d

    ref = copy.deepcopy(model)  # its train_dpo's ref_model: the base weights, run each step
    ref.freeze()

    def lora_dpo(model, chosen, rejected, cm, rm):
        score = lambda m, x, mask: d.compute_score(  # noqa: E731
            d.get_token_scores(m, x, mask), mask, "sigmoid"
        )
        rc = mx.stop_gradient(score(ref, chosen, cm))
        rr = mx.stop_gradient(score(ref, rejected, rm))
        value, _, toks, _ = d.dpo_loss(
            score(model, chosen, cm), score(model, rejected, rm), rc, rr, cm, rm, 0.1, 50.0
        )
        return value, toks

    lora_dpo.state = ref.state  # an input of the compiled step, as the model's
    return lora_dpo, _lora_lora_batch(rows, dpo=True)


def _timed(fn):
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    if mx.default_device() == mx.gpu:
        mx.synchronize()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall, cpu, mx.get_peak_memory() - base, out


def _reference_pass(model, rows):
    """The shipped DPO reference pass over one training batch's pairs (its own batches
    are twice that: one call here), from scratch as a run starts it: it compiles anew."""
    from mlx_lm_flash_cce import preference

    token_logps = preference.make_token_logps(model, check=False)

    def run():
        for p in rows:
            p.ref = None
        with preference.adapters_off(model):
            preference.fill_reference(model, token_logps, rows, 2 * len(rows))

    return run


def _bare_forward(model, batch):
    """The floor of the reference pass: the same log-probs of the same batch (shared
    prompt, no logits, adapters off), compiled once, nothing around it."""
    from mlx_lm_flash_cce import preference

    token_logps = preference.make_token_logps(model, check=False)
    forward = mx.compile(lambda *b: preference.sequence_logps(token_logps(model, *b[:3]), b[3]))

    def run():
        model.eval()
        with preference.adapters_off(model):
            mx.eval(forward(*batch[:4]))
        model.train()

    return run


def _in_step_loss(model):
    """``--loss dpo`` with the reference in the step, or None where it does not apply."""
    from mlx_lm_flash_cce import preference

    fn = preference.make_loss(model, "dpo", beta=0.1, check=False)
    return (lambda m, *b: fn(m, *b)[:2]) if fn.reference_layers else None


def _compiled_step(model, loss):
    from functools import partial

    import mlx.optimizers as optim

    opt = optim.Adam(learning_rate=1e-5)
    lvg = nn.value_and_grad(model, loss)
    state = [model.state, opt.state, mx.random.state, getattr(loss, "state", [])]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(*batch):
        (value, toks), grad = lvg(model, *batch)
        opt.update(model, grad)
        return value, toks

    def run(batch):
        model.train()
        value, toks = step(*batch)
        mx.eval(state, value, toks)
        return value.item()

    return run


def one_method(method, model_name, dtype, n_pairs, prompt, response, layers, repeats, standin=None):
    """In a fresh process: the compiled step's time and peak memory; for ``dpo flash-cce``
    the step with the reference in it, the reference pass and the bare forward too,
    interleaved with the steps (each round: pass, forward, in-step reference step, step),
    so that the machine's load falls on all four."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, ids = _load(model_name, dtype, standin)
    vocab = model(mx.zeros((1, 1), mx.int32)).shape[-1]
    rows = _pairs(ids, vocab, n_pairs, prompt, response)
    model.freeze()
    loss, batch = _loss(method, model, rows)  # mlx-lm-lora's reference: the base weights
    mx.random.seed(0)
    linear_to_lora_layers(model, layers, {"rank": 8, "scale": 20.0, "dropout": 0.0})
    result = {"method": method, "steps": [], "reference": [], "forward": [], "in_step": []}
    extra = []
    if method == "dpo flash-cce":
        from mlx_lm_flash_cce import pairs

        reference = _reference_pass(model, rows)
        reference()
        batch = pairs.collate(rows)  # with the reference log-probs
        extra = [("reference", reference), ("forward", _bare_forward(model, batch))]
        in_step = _in_step_loss(model)
        if in_step is not None:
            first = pairs.unread(batch)  # as the step that first reads its pairs gets it
            model.train()  # the same loss both ways, before any step
            result["losses"] = [loss(model, *batch)[0].item(), in_step(model, *first)[0].item()]
            in_step_step = _compiled_step(model, in_step)
            extra.append(("in_step", lambda: in_step_step(first)))
    step = _compiled_step(model, loss)
    mx.eval(batch)
    for i in range(repeats + 1):  # the first round compiles
        for key, fn in extra:
            wall, cpu, peak, _ = _timed(fn)
            if i:
                result[key].append((wall, cpu, peak))
        timed = _timed(lambda: step(batch))
        if i:
            result["steps"].append(timed)
    return result


def _mib(b):
    return f"{b / 2**20:,.0f}"


def _have_mlx_lm_lora():
    try:
        import mlx_lm_lora.trainer.dpo_trainer  # noqa: F401
        import mlx_lm_lora.trainer.orpo_trainer  # noqa: F401
    except ImportError as e:
        return f"mlx-lm-lora not importable ({e}); its rows are skipped"
    from importlib.metadata import version

    return f"mlx-lm-lora {version('mlx-lm-lora')}"


def _run_one(a, method, prompt, layers):
    cmd = [sys.executable, __file__, "--_one", method, str(prompt), str(a.response)]
    cmd += ["--model", a.model, "--dtype", a.dtype, "--pairs", str(a.pairs)]
    cmd += ["--layers", str(layers), "--repeats", str(a.repeats)]
    if a.standin:
        cmd += ["--standin", str(a.standin), "--standin-layers", str(a.standin_layers)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-2000:])
        raise SystemExit(f"{method} at {prompt}:{a.response} failed")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median(runs, k):
    return statistics.median(x[k] for x in runs)


def _layers_name(layers):
    return "all" if layers < 0 else str(layers)


def _in_step_line(key, d):
    if "in_step" not in d:
        return f"{key}: reference in the step: does not apply (adapters on every layer)"
    (iw, ic, ipeak), (rw, rc) = d["in_step"], d["reference"]
    return (
        f"{key}: reference in the step {(ic - d['cpu']) / d['cpu']:.2f}x a training step per "
        f"batch (CPU time; wall {(iw - d['wall']) / d['wall']:.2f}x; its step "
        f"{ic / d['cpu']:.2f}x the step without a reference, peak memory "
        f"{ipeak / d['peak']:.2f}x); against the reference pass per batch "
        f"{(ic - d['cpu']) / rc:.2f}x (wall {(iw - d['wall']) / rw:.2f}x); loss "
        f"{d['losses'][1]:.6f} in the step, {d['losses'][0]:.6f} precomputed; kept per "
        f"pair, so over a run that reads each pair E times, per step: "
        + ", ".join(f"E={e} {(ic - d['cpu']) / d['cpu'] / e:.2f}x" for e in (1, 2, 4))
    )


def _summary(ratio, res):
    lines = []
    base = res.get("orpo stock")
    for m in ("orpo flash-cce", "orpo mlx-lm-lora"):
        if m in res and base is not None:
            w, c, p = (res[m][k] / base[k] for k in ("wall", "cpu", "peak"))
            lines.append(
                f"{ratio}:1 {m} / orpo stock: {w:.2f}x wall, {c:.2f}x CPU time, {p:.2f}x peak memory"
            )
    if "orpo mlx-lm-lora" in res and "orpo flash-cce" in res:
        o, f = res["orpo mlx-lm-lora"], res["orpo flash-cce"]
        lines.append(
            f"{ratio}:1 orpo flash-cce / mlx-lm-lora: {f['wall'] / o['wall']:.2f}x wall, "
            f"{f['cpu'] / o['cpu']:.2f}x CPU time, {f['peak'] / o['peak']:.2f}x peak memory"
        )
    for key, d in res.items():
        if not key.startswith("dpo flash-cce"):
            continue
        lines.append(f"{ratio}:1 {_in_step_line(key, d)}")
        (rw, rc), (fw, fc) = d["reference"], d["forward"]
        lines.append(
            f"{ratio}:1 {key}: reference pass {rc / d['cpu']:.2f}x a training step per batch "
            f"(CPU time; wall {rw / d['wall']:.2f}x); bare forward (the floor) "
            f"{fc / d['cpu']:.2f}x (wall {fw / d['wall']:.2f}x); reference pass / bare "
            f"forward {rc / fc:.2f}x (wall {rw / fw:.2f}x)"
        )
    d, o = res.get("dpo flash-cce, LoRA 16"), res.get("dpo mlx-lm-lora")
    if d is not None and o is not None:
        line = (
            f"{ratio}:1 dpo flash-cce step / mlx-lm-lora step (its reference in every step): "
            f"{d['wall'] / o['wall']:.2f}x wall, {d['cpu'] / o['cpu']:.2f}x CPU time, "
            f"{d['peak'] / o['peak']:.2f}x peak memory; with the reference pass added per "
            f"batch: {(d['cpu'] + d['reference'][1]) / o['cpu']:.2f}x CPU time"
        )
        if "in_step" in d:
            i = d["in_step"]
            line += (
                f"; with the reference in the step: {i[1] / o['cpu']:.2f}x CPU time, "
                f"{i[2] / o['peak']:.2f}x peak memory"
            )
        lines.append(line)
    return lines


def _figure_rows(ratio, prompt, response, res):
    rows = []
    for key, d in res.items():
        if key.startswith("dpo flash-cce"):
            (_, rc), (_, fc) = d["reference"], d["forward"]
            in_step = "n/a (the pass runs)"
            if "in_step" in d:
                in_step = f"{(d['in_step'][1] - d['cpu']) / d['cpu']:.2f}x"
            rows.append(
                [
                    f"{ratio}:1 ({prompt}:{response})",
                    key.split("LoRA ")[1],
                    in_step,
                    f"{rc / d['cpu']:.2f}x",
                    f"{fc / d['cpu']:.2f}x",
                    f"{rc / fc:.2f}x",
                ]
            )
    return rows


FIGURE_COLUMNS = (
    "prompt:response",
    "LoRA layers",
    "reference in the step / step",
    "reference pass / step",
    "bare forward / step (the floor)",
    "reference pass / bare forward",
)


def _runs(a, have_lora):
    """``(method, label, layers)`` in the order the table runs them."""
    for method in a.methods:
        if "mlx-lm-lora" in method and not have_lora:
            continue
        if method == "dpo flash-cce":
            for layers in a.dpo_layers:
                yield method, f"{method}, LoRA {_layers_name(layers)}", layers
        else:
            yield method, method, a.layers


def _row(r):
    """A run's medians: ``wall``, ``cpu``, ``peak`` of the step, then each timed extra."""
    steps = r["steps"]
    d = {"wall": _median(steps, 0), "cpu": _median(steps, 1), "peak": max(s[2] for s in steps)}
    for key in ("reference", "forward"):
        if r[key]:
            d[key] = (_median(r[key], 0), _median(r[key], 1))
    if r["in_step"]:
        d["in_step"] = (_median(r["in_step"], 0), _median(r["in_step"], 1))
        d["in_step"] += (max(x[2] for x in r["in_step"]),)
        d["losses"] = r["losses"]
    return d


def _cell(d, key):
    return f"{d[key][0]:.3f}/{d[key][1]:.3f}c" if key in d else ""


def _table(a, ratios, have_lora):
    print(
        f"{'p:r':>5} | {'method':>24} | {'step s':>7} | {'cpu s':>7} | {'peak MiB':>9} | "
        f"{'in-step s':>13} | {'ref s':>13} | {'forward s':>13} | {'loss':>8}"
    )
    summary, figures = [], []
    for ratio in ratios:
        prompt = ratio * a.response
        res = {}
        for method, label, layers in _runs(a, have_lora):
            r = _run_one(a, method, prompt, layers)
            d = res[label] = _row(r)
            cells = [_cell(d, k) for k in ("in_step", "reference", "forward")]
            print(
                f"{f'{ratio}:1':>5} | {label:>24} | {d['wall']:7.3f} | {d['cpu']:7.3f} | "
                f"{_mib(d['peak']):>9} | {cells[0]:>13} | {cells[1]:>13} | {cells[2]:>13} | "
                f"{r['steps'][0][3]:8.4f}",
                flush=True,
            )
        summary += _summary(ratio, res)
        figures += _figure_rows(ratio, prompt, a.response, res)
    print("\nratios (same run):")
    for line in summary:
        print("  " + line)
    if a.figures and figures:
        print()
        print(common.figures_block(a.figures, FIGURE_COLUMNS, figures, note=FIGURE_NOTE))


FIGURE_NOTE = (
    "CPU time, medians, each ratio within one process (pass, forward and both steps "
    "interleaved); the reference in the step: the step with it less the step without."
)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", default="smollm2-135m-f32", help="offline model name or random-llama-1b"
    )
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--pairs", type=int, default=4, help="pairs per batch")
    p.add_argument("--response", type=int, default=48, help="tokens per response")
    p.add_argument("--ratios", default="1,4", help="prompt:response ratios, e.g. 1,4")
    p.add_argument(
        "--layers", type=int, default=16, help="layers with LoRA (mlx-lm's --num-layers)"
    )
    p.add_argument(
        "--dpo-layers",
        default="16,-1",
        help="comma-separated --num-layers values the dpo flash-cce rows run at (-1: all)",
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timed rounds after the compiling one (median)"
    )
    p.add_argument("--figures", default=None, help="name of a README figures block to print")
    p.add_argument(
        "--methods", default=",".join(METHODS), help="comma-separated, of: " + ", ".join(METHODS)
    )
    p.add_argument(
        "--_one", nargs=3, metavar=("METHOD", "PROMPT", "RESPONSE"), help=argparse.SUPPRESS
    )
    common.add_target_args(p)
    a = p.parse_args()
    common.print_header()
    if a.standin and a.model != p.get_default("model"):
        p.error("give --model or --standin, not both")
    if a.pairs < 1 or a.response < 1 or a.repeats < 1:
        p.error("--pairs, --response and --repeats must be positive")
    if a.layers == 0 or a.layers < -1:
        p.error(f"--layers: a positive count or -1 (all), got {a.layers}")
    try:
        ratios = [int(r) for r in a.ratios.split(",")]
        a.dpo_layers = [int(n) for n in a.dpo_layers.split(",")]
    except ValueError:
        p.error("--ratios and --dpo-layers must be integers separated by commas")
    if any(n == 0 or n < -1 for n in a.dpo_layers):
        p.error(f"--dpo-layers: positive counts or -1 (all), got {a.dpo_layers}")
    a.methods = [m.strip() for m in a.methods.split(",")]
    if any(m not in METHODS for m in a.methods):
        p.error(f"--methods: each of {', '.join(METHODS)}, got {a.methods}")
    if a._one:
        method, prompt, response = a._one[0], int(a._one[1]), int(a._one[2])
        r = one_method(method, a.model, a.dtype, a.pairs, prompt, response, a.layers, a.repeats, a)
        r["steps"] = [list(s[:3]) + [s[3]] for s in r["steps"]]
        print(json.dumps(r))
        return
    lora = _have_mlx_lm_lora()
    name = common.target_name(a, a.dtype) if a.standin else f"{a.model} {a.dtype}"
    print(
        f"preference step (LoRA on {_layers_name(a.layers)} layers, dpo flash-cce at "
        f"{', '.join(map(_layers_name, a.dpo_layers))}; Adam, compiled): {name}, "
        f"{a.pairs} pairs per batch, {a.response} tokens per response, device "
        f"{mx.default_device()}; {lora}; fresh process per method, median of {a.repeats} "
        "rounds after a compiling one; in-step s: the DPO step with the reference in the "
        "step (step s: without any), ref s: the DPO reference pass per batch, forward s: the "
        "bare forward of the same batch (its floor), wall/CPU, interleaved with the steps of "
        "the same process"
    )
    _table(a, ratios, not lora.startswith("mlx-lm-lora not"))


if __name__ == "__main__":
    main()
