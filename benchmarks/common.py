"""Picking the target model of the spec-decode benchmarks: SmolLM2-135M or a stand-in.

``--standin SIZE`` makes the target the memory-bound stand-in (``mlx_lm_ext.standin``):
SmolLM2-135M with its MLPs widened to SIZE parameters by rows whose output is
zero, so it costs what a large model costs per forward and predicts exactly
what SmolLM2 does (in float32). In-process benchmarks build it in memory
(``load_target``); those that start servers build the cached folder
(``target_path``). Drafters made from SmolLM2 (its 4-bit copy, an assistant
trained on it) predict the stand-in unrealistically well: see the README.
"""

import argparse

from mlx_lm_ext import models, standin

BASE = "smollm2-135m-f32"


def _size(text):
    try:
        standin.parse_size(text)
    except models.ModelError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return text


def add_target_args(p: argparse.ArgumentParser, dtype: bool = False) -> None:
    """``--standin SIZE`` and ``--standin-layers N`` (and ``--standin-dtype`` if ``dtype``)."""
    g = p.add_argument_group("target model (default: SmolLM2-135M float32)")
    g.add_argument(
        "--standin",
        metavar="SIZE",
        type=_size,
        default=None,
        help="target the memory-bound stand-in of SIZE parameters (e.g. 1B, 10B): a large "
        "model's cost with SmolLM2's predictions",
    )
    g.add_argument(
        "--standin-layers",
        type=int,
        default=0,
        metavar="N",
        help="zero-output layers the stand-in adds before widening its MLPs (default 0)",
    )
    if dtype:
        g.add_argument(
            "--standin-dtype",
            choices=tuple(standin.DTYPES),
            default="float32",
            help="the stand-in's dtype (default float32: exactly SmolLM2's predictions)",
        )


def target_name(args: argparse.Namespace, dtype: str = "float32") -> str:
    """How tables name the target, e.g. ``SmolLM2-135M stand-in 10B (bfloat16)``."""
    dtype = getattr(args, "standin_dtype", dtype) if args.standin else dtype
    if not args.standin:
        return f"SmolLM2-135M {dtype}"
    n = args.standin_layers
    layers = f" +{n} layer{'s' if n != 1 else ''}" if n else ""
    return f"SmolLM2-135M stand-in {args.standin}{layers} ({dtype})"


def load_target(args: argparse.Namespace, dtype: str = "float32"):
    """``(model, tokenizer)``: SmolLM2 float32 cast to ``dtype``, widened in memory if asked."""
    import mlx.core as mx
    from mlx_lm import load

    if args.standin:
        dtype = getattr(args, "standin_dtype", dtype)
        return standin.load(args.standin, layers=args.standin_layers, dtype=dtype)
    model, tokenizer = load(str(models.build(BASE, progress=False)))
    if dtype != "float32":
        model.set_dtype(getattr(mx, dtype))
    return model, tokenizer


def target_path(args: argparse.Namespace, dtype: str = "float32"):
    """The target's folder: SmolLM2 float32, or the stand-in built (once, cached) in ``dtype``."""
    if not args.standin:
        return models.build(BASE, progress=False)
    return standin.build(args.standin, layers=args.standin_layers, dtype=dtype)


def load_assistant(args: argparse.Namespace, path, target, **options):
    """``assistant.load(path, target, **options)``; for a stand-in, checked against SmolLM2.

    A drafter trained on SmolLM2 is refused for the stand-in (its config
    differs), yet reads the same thing from it: the stand-in's first layers'
    K/V (the donors) and its final hidden state are SmolLM2's. So the drafter
    is checked against SmolLM2 and then drives the stand-in.
    """
    from mlx_lm import load

    from mlx_lm_spec_decode import assistant
    from mlx_lm_spec_decode import target as target_mod

    if not args.standin:
        return assistant.load(path, target, **options)
    cfg = assistant.read_config(path)
    base, _ = load(str(models.build(BASE, progress=False)))
    assistant.check_fingerprint(cfg.target, assistant.fingerprint(base), where=str(path))
    if max(cfg.donors) >= len(base.layers):
        raise assistant.AssistantError(f"{path}: donor layers {cfg.donors} outside SmolLM2's")
    net = assistant.load_net(path, cfg)
    split = target_mod.split(target)
    return assistant.AssistantDrafter(target, net, cfg, split=split, **options)
