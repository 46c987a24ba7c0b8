"""Preference training step: prompt once + flash-cce log-probs vs two full sequences with logits.

One ``mlx_lm.lora``-style training step (the trainer's compiled step, LoRA,
Adam) with the ORPO loss, its log-probs computed three ways, each in a fresh
process (time and peak memory of one method never touch another's):

- ``stock``: what preference trainers on MLX do today: each pair as two full
  sequences ``[prompt, chosen]``, ``[prompt, rejected]``, the model's full
  ``[tokens, vocab]`` logits, log-softmax, gather;
- ``unshared+flash``: two full sequences, log-probs from flash-cce (no
  logits): the memory saved by the loss head alone;
- ``shared+flash``: ``--loss orpo`` as shipped: each prompt through the
  model once (``shared_prompt``), log-probs from flash-cce.

At prompt:response token ratios 1:1 and 4:1 (``--response`` tokens per
response), ratios against ``stock`` measured in the same run. Peak memory is
``mx.get_peak_memory()`` during the step minus the memory held before it
(weights, optimizer state, batch).

    env LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/bench_preference.py
    python benchmarks/bench_preference.py --model random-llama-1b --dtype bfloat16 \\
        --pairs 4 --response 512    # a GPU: ~1B llama, random weights, V=151936
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import mlx.core as mx
import mlx.nn as nn

METHODS = ("stock", "unshared+flash", "shared+flash")
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def _load(model_name, dtype):
    """``(model, token ids of real text or None)``."""
    if model_name == "random-llama-1b":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_flash_cce import random_llama  # noqa: E402  (a sibling script)

        model = random_llama()
        model.set_dtype(DTYPES[dtype])
        return model, None
    import sysconfig
    from pathlib import Path

    from mlx_lm import load

    from mlx_lm_ext import models

    model, tok = load(str(models.build(model_name, progress=False)))
    if dtype != "float32":
        model.set_dtype(DTYPES[dtype])
    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    return model, tok.encode(text)


def _batch(ids, vocab, n_pairs, prompt, response):
    from mlx_lm_flash_cce import pairs

    if ids is None:
        key = mx.random.key(0)
        ids = mx.random.randint(0, vocab, (n_pairs * (prompt + 2 * response),), key=key).tolist()
    per = prompt + 2 * response
    rows = []
    for i in range(n_pairs):
        x = ids[i * per : (i + 1) * per]
        rows.append(pairs.Pair(x[:prompt], x[prompt : prompt + response], x[prompt + response :]))
    return pairs.collate(rows)


def one_step(method, model_name, dtype, n_pairs, prompt, response, layers, steps):
    """In a fresh process: time and peak memory of the compiled ORPO step."""
    from functools import partial

    import mlx.optimizers as optim
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from mlx_lm_flash_cce import preference, shared_prompt

    model, ids = _load(model_name, dtype)
    vocab = model(mx.zeros((1, 1), mx.int32)).shape[-1]
    batch = _batch(ids, vocab, n_pairs, prompt, response)
    model.freeze()
    mx.random.seed(0)
    linear_to_lora_layers(model, layers, {"rank": 8, "scale": 20.0, "dropout": 0.0})
    if method == "shared+flash":
        loss = preference.make_loss(model, "orpo", beta=0.1)
    else:
        if method == "stock":

            def token_logps(model, prompts, plens, responses):
                return shared_prompt.stock_logps(model, prompts, plens, responses)
        else:
            from mlx_lm_ext import backbone
            from mlx_lm_flash_cce import api

            _, arch = backbone.resolve(model)

            def token_logps(model, prompts, plens, responses):
                h = shared_prompt.unshared_hidden(model, arch, prompts, plens, responses)
                ce = api.linear_cross_entropy(
                    h, arch.head(model), responses, reduction="none", with_grad=model.training
                )
                return -ce

        def loss(model, prompts, plens, responses, rlens, refs):
            b = prompts.shape[0]
            seq = preference.sequence_logps(token_logps(model, prompts, plens, responses), rlens)
            lens = rlens.astype(mx.float32)
            mean = seq / lens
            value, _, _ = preference.orpo(mean[:b], mean[b:], -seq[:b].sum() / lens[:b].sum(), 0.1)
            return value, plens.sum() + rlens.sum(), mx.zeros((4,))

    opt = optim.Adam(learning_rate=1e-5)
    lvg = nn.value_and_grad(model, lambda m, *b: loss(m, *b)[:2])
    state = [model.state, opt.state, mx.random.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(*batch):
        (value, toks), grad = lvg(model, *batch)
        opt.update(model, grad)
        return value, toks

    model.train()
    out = []
    for _ in range(steps + 1):  # the first step compiles
        gc.collect()
        mx.clear_cache()
        mx.eval(batch)
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        tic = time.perf_counter()
        value, toks = step(*batch)
        mx.eval(state, value, toks)
        if mx.default_device() == mx.gpu:
            mx.synchronize()
        out.append((time.perf_counter() - tic, mx.get_peak_memory() - base, value.item()))
    return {"method": method, "first": out[0][0], "steps": out[1:]}


def _mib(b):
    return f"{b / 2**20:,.0f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", default="smollm2-135m-f32", help="offline model name or random-llama-1b"
    )
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--pairs", type=int, default=4, help="pairs per batch")
    p.add_argument("--response", type=int, default=64, help="tokens per response")
    p.add_argument("--ratios", default="1,4", help="prompt:response ratios, e.g. 1,4")
    p.add_argument("--layers", type=int, default=16, help="layers with LoRA")
    p.add_argument("--repeats", type=int, default=2, help="timed steps after the compiling one")
    p.add_argument(
        "--_one", nargs=3, metavar=("METHOD", "PROMPT", "RESPONSE"), help=argparse.SUPPRESS
    )
    a = p.parse_args()
    if a.pairs < 1 or a.response < 1 or a.layers < 1 or a.repeats < 1:
        p.error("--pairs, --response, --layers and --repeats must be positive")
    try:
        ratios = [int(r) for r in a.ratios.split(",")]
    except ValueError:
        p.error(f"--ratios must be integers separated by commas, got {a.ratios!r}")
    if a._one:
        method, prompt, response = a._one[0], int(a._one[1]), int(a._one[2])
        r = one_step(method, a.model, a.dtype, a.pairs, prompt, response, a.layers, a.repeats)
        print(json.dumps(r))
        return
    print(
        f"preference step (ORPO, LoRA on {a.layers} layers, Adam, compiled): {a.model} {a.dtype}, "
        f"{a.pairs} pairs per batch, {a.response} tokens per response, device {mx.default_device()}; "
        f"fresh process per method, min of {a.repeats} steps after a compiling one"
    )
    print(f"{'prompt:resp':>11} | {'method':>14} | {'step s':>7} | {'peak MiB':>9} | {'loss':>8}")
    summary = []
    for ratio in ratios:
        prompt = ratio * a.response
        results = {}
        for method in METHODS:
            cmd = [sys.executable, __file__, "--_one", method, str(prompt), str(a.response)]
            cmd += ["--model", a.model, "--dtype", a.dtype, "--pairs", str(a.pairs)]
            cmd += ["--layers", str(a.layers), "--repeats", str(a.repeats)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr[-2000:])
                raise SystemExit(f"{method} at {ratio}:1 failed")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            t = min(s[0] for s in r["steps"])
            m = max(s[1] for s in r["steps"])
            results[method] = (t, m)
            print(
                f"{f'{ratio}:1':>11} | {method:>14} | {t:7.3f} | {_mib(m):>9} | "
                f"{r['steps'][0][2]:8.4f}",
                flush=True,
            )
        st, sm = results["stock"]
        for method in METHODS[1:]:
            t, m = results[method]
            summary.append(
                f"{ratio}:1 {method}: {t / st:.2f}x step time, {m / sm:.2f}x peak memory"
            )
    print("\nratios against stock (same run):")
    for line in summary:
        print("  " + line)


if __name__ == "__main__":
    main()
