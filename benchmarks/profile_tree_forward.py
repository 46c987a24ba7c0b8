"""Where a token tree's verify forward costs more than a chain's of its width.

    python benchmarks/profile_tree_forward.py --device gpu --dtype bfloat16 --standin 10B

One request's cache holds ``--prefix`` tokens; each forward over ``w``
tokens is timed synchronously (median after warm-up, the cache trimmed
back after each), as

- ``chain``: the serial loop's chain verify (``target.verify_attention``
  and ``target.staged``, as ``loop.forward`` runs it);
- ``tree``: ``tree.forward`` over a root with two branches (what a round
  runs);
- ``tree, stock rope``: the same with RoPE left as the model has it (every
  node at its index: wrong positions, the timing only);
- ``tree, stock attention``: the same with the model's own attention and a
  mask array (the ancestors' rule as the fused op takes it, no override).

The gaps between the rows are what the tree's positions and its mask cost.
"""

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    add_device_args,
    add_target_args,
    load_target,
    print_header,
    set_device,
    table,
    timed,
)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_args(p)
    add_target_args(p)
    p.add_argument("--prefix", type=int, default=400)
    p.add_argument("--widths", default="4,8,16")
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    set_device(args)
    print_header()

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from mlx_lm_ext import api as host
    from mlx_lm_spec_decode import target as target_mod
    from mlx_lm_spec_decode import tree as tree_mod

    model, _ = load_target(args, args.dtype)
    policy = target_mod.attention_policy()
    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(args.prefix)[None] % 1000, cache=cache))

    def chain(toks, parents):
        x = mx.array(toks, mx.uint32)[None]
        with target_mod.verify_attention(model, len(toks), policy):
            with target_mod.staged(model, len(toks)):
                return model(x, cache=cache)

    def tree(toks, parents):
        return tree_mod.forward(model, cache, toks, parents, policy)

    @contextlib.contextmanager
    def untouched(*_a, **_k):
        yield

    def without(override):
        """``tree`` with the host's ``override`` (``override_rope`` or
        ``override_attention``) doing nothing: the model's own there."""

        def run(toks, parents):
            real = getattr(host, override)
            setattr(host, override, untouched)
            try:
                return tree(toks, parents)
            finally:
                setattr(host, override, real)

        return run

    variants = [
        ("chain", chain),
        ("tree", tree),
        ("tree, stock rope", without("override_rope")),
        ("tree, stock attention", without("override_attention")),
    ]
    rows = []
    for w in [int(x) for x in args.widths.split(",")]:
        toks = list(range(100, 100 + w))
        half = 1 + (w - 1) // 2  # the second branch starts here
        parents = [-1] + [0 if i in (1, half) else i - 1 for i in range(1, w)]
        row = [w]
        for _, fn in variants:

            def once(fn=fn, toks=toks, parents=parents):
                mx.eval(fn(toks, parents))
                trim_prompt_cache(cache, len(toks))

            t, _ = timed(once, repeats=args.repeats, warmup=2)
            row.append(f"{1e3 * t.median:.2f}")
        rows.append(row)
    print(
        f"# forward ms over a {args.prefix}-token cache, {policy} attention; median of "
        f"{args.repeats} after 2 warm-up\n"
    )
    print(table(["width"] + [name for name, _ in variants], rows))


if __name__ == "__main__":
    main()
