"""The assistant drafter vs stock, n-gram and draft-model decoding, same run.

    # a drafter trained by the command in plugins/spec-decode/README.md
    # (results: benchmarks/results/assistant-cpu.md, assistant-h200.md):
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/bench_assistant.py --drafter-path DIR

Target: SmolLM2-135M-Instruct (float32 by default; ``--dtype bfloat16`` on a
GPU). Methods, each on the same prompts, greedy, one after the other:

- ``stock``: mlx-lm's plain decoding (``stream_generate`` without a draft model);
- ``ngram``: spec-decode's prompt lookup;
- ``draft-model``: spec-decode with the native 4-bit copy of the model drafting;
- ``assistant``: spec-decode with the trained assistant drafter (``--drafter-path``);
- ``assistant-tree`` (only when named in ``--methods``): the same drafter
  growing token trees (``AssistantDrafter(tree=True)``);
- ``ngram+assistant`` (only when named): prompt lookup's copy where the
  text matches, the assistant's drafts elsewhere (``--draft-lookup``,
  ``LookupFirst``);
- ``ngram+assistant-tree`` (only when named): the two in one token tree
  per round, the lookup's copies beside the assistant's branches
  (``LookupFirst`` over ``AssistantDrafter(tree=True)``).

Prompts: input-grounded (edit a function from CPython's stdlib; answer with
quotes from a given passage) and open-ended chat (held out: not the
trainer's prompt templates). Tokens/s is generation only (mlx-lm's
``generation_tps``), the median of ``--repeats`` runs after a warm-up run
of every method on a short prompt and ``--warmup`` untimed runs of each
prompt (on a GPU its first runs build kernels and graphs for its shapes). ``same`` says whether the text equals stock greedy's;
``accept`` is accepted/drafted, ``tok/fwd`` tokens per target forward.
``--json FILE`` also writes every row and the summary.

``--check``: per prompt, the assistant decodes once more drafting every
round (γ fixed, no auto-off), and every state it drafted is recomputed by
the training graph (``Assistant.unrolled`` over the decoded sequence, the
drafter's weights in float32 as ``train-drafter`` holds them). The table
gives the graph's top-1 agreement with the target on the answer (what
training measures, per draft step), the decode's first-draft acceptance,
and how many drafted tokens differ from the graph's (0 unless decoding
and training compute different things on this backend or dtype).
"""

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx
from bench_spec_decode import passage, stdlib_function  # the same grounded prompts
from common import add_target_args, load_assistant, load_target, print_header, target_name
from mlx_lm import load, stream_generate

import mlx_lm_ext
import mlx_lm_spec_decode as sd
from mlx_lm_spec_decode import assistant
from mlx_lm_spec_decode.assistant.recording import RecordingDrafter
from mlx_lm_spec_decode.training.distill import Target


def prompts():
    return [
        (
            "grounded",
            "edit code",
            "Here is a function from Python's standard library:\n\n"
            + stdlib_function("textwrap", "indent")
            + "\nRewrite this function, renaming the parameter `prefix` to `margin`."
            " Output the complete code only.",
        ),
        (
            "grounded",
            "quote passage",
            "Read this passage:\n\n"
            + passage()
            + "\n\nWho created Python, and where? Answer with exact quotes from the passage.",
        ),
        (
            "open",
            "story",
            "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        ),
        ("open", "explain", "Explain to a child why the sky is blue and why sunsets are red."),
        ("open", "advice", "I am starting to learn to cook. What should I learn first, and why?"),
        (
            "open",
            "letter",
            "Write a friendly letter to a neighbour inviting them to a garden party.",
        ),
    ]


def run(model, tok, prompt, max_tokens, draft=None, k=3):
    mx.random.seed(0)
    text, last = "", None
    for r in stream_generate(
        model, tok, prompt, max_tokens=max_tokens, draft_model=draft, num_draft_tokens=k
    ):
        text += r.text
        last = r
    stats = sd.last_stats() if isinstance(draft, sd.Drafter) else None
    return text, last.generation_tps, stats


def measure(model, tok, prompt, max_tokens, make, k, repeats, warmup=0):
    """``(text, median tok/s, stats)`` of ``repeats`` runs after ``warmup`` untimed ones."""
    for _ in range(warmup):
        run(model, tok, prompt, max_tokens, make() if make else None, k)
    runs = [
        run(model, tok, prompt, max_tokens, make() if make else None, k) for _ in range(repeats)
    ]
    tps = statistics.median(r[1] for r in runs)
    return runs[0][0], tps, runs[0][2]


def table(rows):
    head = (
        f"| {'prompt':<22} | {'method':<12} | {'tok/s':>7} | {'vs stock':>8} | {'accept':>6} | "
        f"{'tok/fwd':>7} | same |"
    )
    out = [head, "|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|"]
    for r in rows:
        out.append(
            f"| {r['prompt']:<22} | {r['method']:<12} | {r['tps']:7.1f} | {r['ratio']:7.2f}x | "
            f"{r['accept']:>6} | {r['tpf']:>7} | {r['same']:<4} |"
        )
    return "\n".join(out)


def summary(rows, methods):
    """Per category: geometric-mean speed ratio and pooled acceptance."""
    out = [
        "| category | method | speed vs stock (geo. mean) | acceptance | tok/fwd | all same |",
        "|---|---|---|---|---|---|",
    ]
    result = {}
    for cat in ("grounded", "open"):
        for m in methods:
            rs = [r for r in rows if r["category"] == cat and r["method"].rstrip("*") == m]
            if not rs:
                continue
            geo = statistics.geometric_mean([r["ratio"] for r in rs])
            drafted = sum(r.get("drafted", 0) for r in rs)
            accepted = sum(r.get("accepted", 0) for r in rs)
            forwards = sum(r.get("forwards", 0) for r in rs)
            emitted = sum(r.get("emitted", 0) for r in rs)
            acc = f"{100 * accepted / drafted:.0f}%" if drafted else "-"
            tpf = f"{emitted / forwards:.2f}" if forwards else "1.00"
            same = all(r["same"] in ("yes", "-") for r in rs)
            out.append(f"| {cat} | {m} | {geo:.2f}x | {acc} | {tpf} | {'yes' if same else 'NO'} |")
            result[f"{cat}/{m}"] = dict(
                speed=geo,
                acceptance=accepted / drafted if drafted else None,
                tokens_per_forward=emitted / forwards if forwards else 1.0,
                same=same,
            )
    return "\n".join(out), result


def graph_check(model, made, path, prompt, max_tokens, k):
    """Decode drafting every round; recompute each drafted state with the training graph."""
    rec = RecordingDrafter(made, max_draft=k, adaptive=False, auto_off=False)
    out = [
        t
        for t, _, _ in sd.speculative_generate_step(
            mx.array(prompt), model, rec, num_draft_tokens=k, max_tokens=max_tokens
        )
    ]
    st = sd.last_stats()
    seq = list(prompt) + out
    cfg = made.cfg
    net = assistant.load_net(path, cfg)
    net.set_dtype(mx.float32)  # as train-drafter holds it
    target = Target(model, cfg)
    h, emb, kv, _, top = target.run(mx.array([seq], mx.uint32))
    graph = net.unrolled(h, emb, [(a, b, None) for a, b in kv], target.ropes, cfg.windows, k)
    preds = [mx.argmax(target.head(g.astype(h.dtype)), axis=-1)[0].tolist() for g in graph]
    model.unfreeze()
    top = top[0].tolist()
    agree = []
    for s in range(k):  # rows whose next token is an answer token, from chains based in the answer
        rows = range(len(prompt) - 1 + s, len(seq) - 1)
        agree.append(sum(preds[s][r] == top[r] for r in rows) / max(1, len(rows)))
    first_ok = compared = differ = 0
    dmax = 0.0
    for base, _, outs, toks in rec.rounds:
        toks = toks.tolist()
        first_ok += toks[0] == seq[base + 1]
        for s, o in enumerate(outs):
            if toks[:s] != seq[base + 1 : base + 1 + s] or base + s >= len(seq) - 1:
                break
            compared += 1
            differ += toks[s] != preds[s][base + s]
            dmax = max(
                dmax,
                mx.abs(o.astype(mx.float32) - graph[s][:, base + s : base + s + 1]).max().item(),
            )
    n = len(rec.rounds)
    return dict(
        graph_top1=agree,
        rounds=n,
        first_accept=first_ok / n if n else None,
        accept=st.acceptance,
        compared=compared,
        differ=differ,
        max_state_diff=dmax,
    )


def check_table(rows):
    out = [
        "| prompt | graph top-1 (step 1, 2, 3) | decode: first draft accepted "
        "| decode: accepted/drafted "
        "| drafts compared | differ from graph | max state diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r["check"]
        fa = f"{100 * c['first_accept']:.0f}% of {c['rounds']}" if c["rounds"] else "-"
        out.append(
            f"| {r['prompt']} | "
            + ", ".join(f"{100 * a:.0f}%" for a in c["graph_top1"])
            + f" | {fa} | {100 * c['accept']:.0f}% | {c['compared']} | {c['differ']}"
            + f" | {c['max_state_diff']:.2g} |"
        )
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--drafter-path", required=True, help="A trained assistant drafter folder for the target."
    )
    p.add_argument(
        "--model",
        default=None,
        help="Target model folder. Default: SmolLM2-135M float32 (built offline).",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="Draft model for 'draft-model'. Default: SmolLM2-135M native 4-bit; 'none' to skip.",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="Cast the target (e.g. bfloat16 on a GPU). Default: as loaded.",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=3,
        help="Starting draft length (all drafters). Default: 3.",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="Timed runs per method and prompt (median). Default: 1.",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="Untimed runs per method and prompt first (a GPU builds kernels and graphs "
        "for each new shape on first use). Default: 0.",
    )
    p.add_argument("--only", nargs="*", help="Substrings of prompt names or categories to run.")
    p.add_argument(
        "--methods",
        default="ngram,draft-model,assistant",
        help="Comma-separated drafters to compare.",
    )
    p.add_argument("--json", default=None, help="Write the rows and summary to this file.")
    p.add_argument(
        "--show-stats",
        action="store_true",
        help="Print each timed request's spec-decode summary line (rounds, trees, switch-offs).",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="Also decode drafting every round and compare each draft with the training graph's.",
    )
    add_target_args(p)
    args = p.parse_args()
    print_header()
    if args.standin and args.model:
        p.error("give --model or --standin, not both")

    from mlx_lm_ext import models

    mlx_lm_ext.enable("spec-decode")  # on a GPU machine: scripts/gpu-env.sh registers it
    target_path = args.model or models.build("smollm2-135m-f32", progress=False)
    if args.standin:
        target_path = target_name(args, args.dtype or "float32")
        target, tok = load_target(args, args.dtype or "float32")
    else:
        target, tok = load(str(target_path))
    if args.dtype:
        target.set_dtype(getattr(mx, args.dtype))
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    drafters = {}
    if "ngram" in methods:
        drafters["ngram"] = lambda: sd.NGramDrafter()
    if "draft-model" in methods and args.draft_model != "none":
        q4, _ = load(str(args.draft_model or models.build("smollm2-135m", progress=False)))
        drafters["draft-model"] = lambda: sd.DraftModelDrafter(q4)
    if "assistant" in methods:
        made = load_assistant(args, args.drafter_path, target)
        drafters["assistant"] = lambda: made
    if "ngram+assistant" in methods:  # --drafter assistant --draft-lookup
        paired = sd.LookupFirst(
            load_assistant(args, args.drafter_path, target), sd.NGramDrafter(tree=False)
        )
        drafters["ngram+assistant"] = lambda: paired
    if "assistant-tree" in methods:  # the same drafter growing token trees
        trees = load_assistant(args, args.drafter_path, target, tree=True)
        drafters["assistant-tree"] = lambda: trees
    if "ngram+assistant-tree" in methods:  # one tree of the copies and the assistant's guesses
        both = sd.LookupFirst(
            load_assistant(args, args.drafter_path, target, tree=True), sd.NGramDrafter(tree=True)
        )
        drafters["ngram+assistant-tree"] = lambda: both
    cfg = assistant.read_config(args.drafter_path)
    state = Path(args.drafter_path, "checkpoint", "state.json")
    trained = json.loads(state.read_text())["step"] if state.is_file() else "?"
    print(
        f"# {Path(str(target_path)).name} ({args.dtype or 'as loaded'}) on {mx.default_device()}, "
        f"{platform.machine()}; {args.max_tokens} tokens, greedy, k={args.num_draft_tokens}, "
        f"median of {args.repeats} after {args.warmup} warm-up; assistant: {cfg.num_layers} "
        f"layer(s), donors {cfg.donors}, "
        f"{trained} training steps\n",
        flush=True,
    )

    # Warm-up: first calls of each shape compile kernels (GPU) and fill caches.
    warm = tok.apply_chat_template(
        [{"role": "user", "content": "Say hello."}], add_generation_prompt=True
    )
    run(target, tok, warm, 16)
    for make in drafters.values():
        run(target, tok, warm, 16, make(), args.num_draft_tokens)

    rows, checks = [], []
    t0 = time.perf_counter()
    for cat, name, text in prompts():
        label = f"{cat}: {name}"
        if args.only and not any(s in label for s in args.only):
            continue
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        base_text, base_tps, _ = measure(
            target,
            tok,
            prompt,
            args.max_tokens,
            None,
            args.num_draft_tokens,
            args.repeats,
            args.warmup,
        )
        rows.append(
            dict(
                category=cat,
                prompt=label,
                method="stock",
                tps=base_tps,
                ratio=1.0,
                accept="",
                tpf="1.00",
                same="-",
            )
        )
        for m, make in drafters.items():
            text_m, tps, st = measure(
                target,
                tok,
                prompt,
                args.max_tokens,
                make,
                args.num_draft_tokens,
                args.repeats,
                args.warmup,
            )
            row = dict(
                category=cat,
                prompt=label,
                method=m + ("*" if st.auto_off else ""),
                tps=tps,
                ratio=tps / base_tps,
                same="yes" if text_m == base_text else "NO",
                accept=f"{100 * st.acceptance:.0f}%",
                tpf=f"{st.tokens_per_forward:.2f}",
                drafted=st.drafted,
                accepted=st.accepted,
                forwards=st.forwards,
                emitted=st.emitted,
                tree_rounds=st.tree_rounds,
                stats=st.line(),
            )
            rows.append(row)
            if args.show_stats:
                print(f"  {m}: {st.line()}", flush=True)
        print(table(rows[-1 - len(drafters) :]) + "\n", flush=True)
        if args.check and "assistant" in drafters:
            c = graph_check(
                target, made, args.drafter_path, prompt, args.max_tokens, args.num_draft_tokens
            )
            checks.append(dict(category=cat, prompt=label, check=c))
            print(check_table(checks[-1:]) + "\n", flush=True)
    text, result = summary(rows, list(drafters))
    print(
        "# all prompts\n\n"
        + table(rows)
        + "\n\n# summary (* = drafting switched itself off)\n\n"
        + text
    )
    if checks:
        print(
            "\n# decode vs training graph (--check; drafting every round, k fixed)\n\n"
            + check_table(checks)
        )
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                dict(
                    rows=rows,
                    summary=result,
                    checks=checks,
                    device=str(mx.default_device()),
                    dtype=args.dtype,
                    max_tokens=args.max_tokens,
                    drafter=dict(layers=cfg.num_layers, donors=cfg.donors, steps=trained),
                ),
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
