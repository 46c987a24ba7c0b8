"""``profile_batch_round.py``'s decoding runs under several settings of ours, one model load.

    python benchmarks/profile_batch_variants.py --device gpu --dtype bfloat16 --standin 10B \\
        --variants "flush=off;flush=5"

Each variant (``;``-separated, ``key=value`` pairs joined by ``,``) sets,
for our generator only: ``flush`` (``MLX_LM_SPEC_FLUSH``: a verify
forward's layers per flush to the device, ``off``, or ``auto``),
``compact`` (``ragged.COMPACT_HOLES``: squeeze a batch's cache once a row
has this many holes), ``attention`` (``MLX_LM_SPEC_ATTENTION``: ``buffer``,
``padded``, ``explicit``, ``fused`` or ``auto``) and ``pad``
(``target.PAD_TOKENS``: the most tokens a batch's windows are padded up to) and ``mask``
(``host``: a holey cache's mask copied from the host at every step, as
before the device copy per rollback; ``device``: as shipped). Then, for each prompt kind and concurrency, stock
and ours decode in turn (``profile_batch_round.run``: the same tables).
Variants run one after the other on one machine, so each has its own
stock turns to compare with: the ratio, not the tokens/s, carries across.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import mlx.core as mx  # noqa: E402
import profile_batch_round as pbr  # noqa: E402
from common import (  # noqa: E402
    add_device_args,
    add_target_args,
    batch_levels,
    load_target,
    print_header,
    set_device,
)

from mlx_lm_spec_decode import target as target_mod  # noqa: E402

SETTINGS = {"flush", "compact", "attention", "pad", "mask"}


def parse(text):
    """``[(name, {key: value})]`` of ``--variants``; bad input is a ``ValueError``."""
    out = []
    for variant in text.split(";"):
        opts = dict(kv.split("=", 1) for kv in variant.split(",") if kv)
        if not opts or set(opts) - SETTINGS:
            raise ValueError(f"variant {variant!r}: give {' and/or '.join(sorted(SETTINGS))}")
        int(opts.get("compact", 0))
        int(opts.get("pad", 0))
        if opts.get("mask", "device") not in ("host", "device"):
            raise ValueError(f"variant {variant!r}: mask is host or device")
        out.append((variant, opts))
    return out


def host_holes(cache, n):
    """The holes' mask slots copied from the host at every step (``mask=host``)."""
    return mx.array(cache._holes(n))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_args(ap, "cpu")
    ap.add_argument("--concurrency", default="4")
    ap.add_argument("--kinds", default="grounded,open")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default="flush=off;flush=5")
    ap.add_argument(
        "--queue",
        type=int,
        default=0,
        metavar="K",
        help="each of C clients sends K requests in turn (profile_batch_round.py --queue)",
    )
    ap.add_argument(
        "--vary-tokens",
        type=float,
        default=0.0,
        metavar="F",
        help="per-request budgets (profile_batch_round.py --vary-tokens)",
    )
    add_target_args(ap)
    args = ap.parse_args()
    levels, kinds = batch_levels(ap, args)
    try:
        variants = parse(args.variants)
    except ValueError as e:
        ap.error(f"--variants: {e}")
    set_device(args)
    print_header()
    model, tok = load_target(args, args.dtype)
    default_compact = pbr.ragged_mod.COMPACT_HOLES
    default_pad = target_mod.PAD_TOKENS
    device_holes = pbr.ragged_mod.RaggedKVCache._device_holes
    for name, opts in variants:
        os.environ["MLX_LM_SPEC_FLUSH"] = opts.get("flush", "auto")
        os.environ["MLX_LM_SPEC_ATTENTION"] = opts.get("attention", "auto")
        pbr.ragged_mod.COMPACT_HOLES = int(opts.get("compact", default_compact))
        target_mod.PAD_TOKENS = int(opts.get("pad", default_pad))
        pbr.ragged_mod.RaggedKVCache._device_holes = (
            host_holes if opts.get("mask") == "host" else device_holes
        )
        print(f"\n# variant {name}", flush=True)
        for kind in kinds:
            for C in levels:
                pbr.run(
                    model,
                    tok,
                    C,
                    args.max_tokens,
                    True,
                    kind,
                    args.repeats,
                    queue=args.queue,
                    vary=args.vary_tokens,
                )
                sys.stdout.flush()


if __name__ == "__main__":
    main()
