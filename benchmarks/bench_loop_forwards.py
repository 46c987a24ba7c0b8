"""The serial loop's forwards at a memory-bound device's price, on the CPU.

    python benchmarks/bench_loop_forwards.py
    python benchmarks/bench_loop_forwards.py --verify 1.05 --only quote

On a memory-bound device (the stand-ins, a 1-70B model on Apple silicon)
a verify forward over up to 16 tokens costs about one plain step, so a
serial n-gram run's speed-up is the tokens it emits per forward. This
script counts those forwards with the real verify loop (``--plugin
spec-decode``'s ``mlx_lm.generate`` path) on SmolLM2 float32 on the CPU,
whose greedy outputs are the stand-ins': every verify is priced at
``--verify`` plain steps (``Policy.cost``; a token tree at a chain's
price), windows are padded to the GPU's widths, and the wall-clock
verdict that switches drafting off is left out (on the CPU a window's
columns cost compute, which the given price stands for). What the loop
decides from those prices (draft lengths, trees, plain runs through the
text's gaps, probes) is what it decides on such a device.

Beside each count: the speed-up over plain decoding at that price
(tokens over plain steps plus ``--verify`` per round), and the bound the
n-gram drafter's own token trees allow at that price
(``bench_drafting_ceiling.py --flat-verify``'s "n-gram tree" column: a
round wherever the drafter proposes, on the same output).
"""

import argparse
import os

from bench_drafting_ceiling import flat_costs, simulate, tree_lengths
from bench_spec_decode import prompts
from common import add_target_args, load_target, print_header, target_name
from mlx_lm import stream_generate

import mlx_lm_ext
import mlx_lm_spec_decode as sd
from mlx_lm_spec_decode import policy
from mlx_lm_spec_decode import target as target_mod

METHODS = {
    "ngram": lambda: sd.NGramDrafter(),
    "ngram-chains": lambda: sd.NGramDrafter(tree=False),
}


def price(verify: float) -> None:
    """Every verify at ``verify`` plain steps, trees at a chain's price, no
    wall-clock verdict (see the module's docstring)."""

    def cost(self, B):
        p = self.plain_cost(B)
        return None if p is None else (p, (verify - 1.0) * p, 0.0)

    policy.Policy.cost = cost
    policy.Policy.tree_surcharge = lambda self, B=1: 0.0
    policy.Policy.judge = lambda self, *args, **kwargs: False


def run(model, tok, prompt, method, max_tokens):
    """``(stats, output ids)`` of one request through the verify loop."""
    out = [
        r.token
        for r in stream_generate(
            model, tok, prompt, max_tokens=max_tokens, draft_model=METHODS[method]()
        )
    ]
    return sd.last_stats(), out


def bound(prompt, out, verify):
    """``(speed-up, tokens per forward)`` of rounds wherever the n-gram
    drafter's trees propose, at ``verify`` plain steps a round."""
    lengths = tree_lengths(list(prompt), out, max(target_mod.GPU_WIDTHS) - 1, verify)
    return simulate([lengths], 1, flat_costs([1], verify), own=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verify", type=float, default=1.0, help="plain steps a verify costs")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--only", nargs="*", help="substrings of prompt names to run")
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    add_target_args(p)
    args = p.parse_args()
    print_header()
    os.environ["MLX_LM_SPEC_WIDTHS"] = ",".join(str(w) for w in target_mod.GPU_WIDTHS)
    price(args.verify)
    mlx_lm_ext.enable("spec-decode")
    model, tok = load_target(args)
    print(f"# {target_name(args)}, verify at {args.verify} plain steps, greedy\n")
    print(
        "| prompt | method | tokens | forwards | rounds | tok/fwd | speed-up at price "
        "| trees | tree bound: tok/fwd, speed-up |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, text in prompts():
        if args.only and not any(s in name for s in args.only):
            continue
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        for method in args.methods:
            st, out = run(model, tok, prompt, method, args.max_tokens)
            steps = st.forwards - st.draft_rounds + args.verify * st.draft_rounds
            print(
                f"| {name} | {method} | {st.emitted} | {st.forwards} | {st.draft_rounds} | "
                f"{st.tokens_per_forward:.2f} | {st.emitted / steps:.2f}x | {st.tree_rounds} | "
                "{1:.2f}, {0:.2f}x |".format(*bound(prompt, out, args.verify)),
                flush=True,
            )


if __name__ == "__main__":
    main()
