"""mlx-lm-ext hooks: ``mlx_lm.lora --loss flash-cce`` (and ``--loss orpo|dpo``) and ``mlx-lm-ext doctor``.

Flags (lora; all default to None so a YAML config can set them, the real
defaults are applied in ``activate``):

``--cce-impl``          auto | flash | stock | chunked (default auto)
``--cce-backend``       the flash path: auto, mlx, mlx-blocks, cuda-gemm or cuda (default auto)
``--cce-token-chunk``   tokens per pass (default 256)
``--cce-vocab-chunk``   vocabulary rows per block (default: 2**18 / token chunk)
``--cce-filter-eps``    approximate: skip gradient tiles below eps (default off)
``--cce-block-skip-eps`` approximate: skip vocabulary blocks below eps (default off)
``--cce-crossover``     logits (tokens x vocab) below which the stock-style
                        head runs (default: api.MIN_FLASH_ELEMENTS)
``--cce-no-check``      skip the one-time self-check against the model's logits
``--cce-memory-budget`` most working memory of the loss head above its inputs,
                        e.g. 512M, 2G (default: budget.default_for the batch)
``--beta``              preference strength (default 0.1; simpo 2.0)
``--simpo-gamma``       SimPO's target margin (default 0.5)
``--reference-model``   DPO / IPO / hinge: the reference checkpoint (default:
                        the model without its adapters)
``--apply-chat-template`` render string prompts (and ``system``) with the
                        tokenizer's chat template

``--loss orpo|dpo|ipo|hinge|simpo|cpo`` (``loss_names``) train on preference
pairs: this plugin loads the rows (``pairs.py``), batches them by pairs and
computes the loss from shared-prompt log-probs (``preference.py``,
``objectives.py``).
"""

import argparse
import logging
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

from mlx_lm_ext.api import PluginError, hookimpl

NAME = "flash-cce"
PREFERENCE = ("orpo", "dpo", "ipo", "hinge", "simpo", "cpo")  # objectives.LOSSES
REFERENCE = ("dpo", "ipo", "hinge")  # objectives.REFERENCE
MAX_STRENGTH = 100.0  # objectives.MAX_STRENGTH
PREF_KEY = "preference"

DEFAULTS = {
    "cce_impl": "auto",
    "cce_backend": "auto",
    "cce_token_chunk": 256,
    "cce_vocab_chunk": 0,
    "cce_filter_eps": None,
    "cce_block_skip_eps": None,
    "cce_crossover": None,
    "cce_no_check": False,
    "cce_memory_budget": None,
}

log = logging.getLogger("mlx_lm_flash_cce")
_handler = []


@hookimpl
def commands() -> List[str]:
    return ["lora"]


@hookimpl
def loss_names() -> List[str]:
    return list(PREFERENCE)


@hookimpl
def add_arguments(command: str, group: argparse._ArgumentGroup) -> None:
    if command != "lora":
        return
    group.add_argument(
        "--beta",
        type=float,
        default=None,
        metavar="BETA",
        help="preference losses: strength of the preference term, in (0, 100] "
        "(default 0.1; simpo 2.0)",
    )
    group.add_argument(
        "--simpo-gamma",
        type=float,
        default=None,
        metavar="GAMMA",
        help="--loss simpo: target reward margin, in [0, 100] (default 0.5)",
    )
    group.add_argument(
        "--reference-model",
        default=None,
        metavar="PATH",
        help="--loss dpo / ipo / hinge: the reference checkpoint, e.g. an SFT model with "
        "the same tokenizer (default: the model being trained, without its adapters)",
    )
    group.add_argument(
        "--apply-chat-template",
        action="store_true",
        default=None,
        help="preference losses: render string prompts as a user message (with the row's "
        "'system' field) and the responses as the assistant's, by the chat template",
    )
    group.add_argument(
        "--cce-impl",
        choices=("auto", "flash", "stock", "chunked"),
        default=None,
        help="auto: stock-style head for short batches, flash otherwise (default auto)",
    )
    group.add_argument(
        "--cce-backend",
        default=None,
        metavar="NAME",
        help="the flash path when one runs: auto (measured) or mlx, mlx-blocks, cuda-gemm, "
        "cuda (default auto; see selection.select)",
    )
    group.add_argument(
        "--cce-token-chunk",
        type=int,
        default=None,
        metavar="N",
        help="tokens per pass over the vocabulary (default 256)",
    )
    group.add_argument(
        "--cce-vocab-chunk",
        type=int,
        default=None,
        metavar="N",
        help="vocabulary rows per block (default: 2**18 / token chunk)",
    )
    group.add_argument(
        "--cce-filter-eps",
        type=float,
        default=None,
        metavar="EPS",
        help="approximate gradient: skip 64x64 tiles whose softmax coefficients are all "
        "below EPS (dense heads; default off, see the README's measurement)",
    )
    group.add_argument(
        "--cce-block-skip-eps",
        type=float,
        default=None,
        metavar="EPS",
        help="approximate gradient: skip 64-wide vocabulary blocks whose probabilities "
        "are all below EPS (dense heads; default off)",
    )
    group.add_argument(
        "--cce-crossover",
        type=int,
        default=None,
        metavar="ELEMENTS",
        help="use the stock-style head below this many logits per batch (tokens x vocab)",
    )
    group.add_argument(
        "--cce-no-check",
        action="store_true",
        default=None,
        help="skip the one-time check against the model's own logits",
    )
    group.add_argument(
        "--cce-memory-budget",
        default=None,
        metavar="SIZE",
        help="most working memory the loss head may use above its inputs, e.g. 512M or 2G; "
        "the auto backend keeps the fastest path within it (default: half of what "
        "the stock loss would hold, at most 2G)",
    )


def options_from(args: argparse.Namespace) -> Dict[str, Any]:
    """Validated ``make_loss`` keyword options from parsed flags (None -> default)."""
    get = lambda key: DEFAULTS[key] if getattr(args, key, None) is None else getattr(args, key)
    for key in ("cce_token_chunk", "cce_vocab_chunk", "cce_crossover"):
        value = get(key)
        if value is not None and (
            not isinstance(value, int) or value < 0 or (key == "cce_token_chunk" and value == 0)
        ):
            raise PluginError(
                f"--{key.replace('_', '-')} must be a positive integer, got {value!r}"
            )
    for key in ("cce_filter_eps", "cce_block_skip_eps"):
        value = get(key)
        if value is not None and not (0 < value < 1):
            raise PluginError(f"--{key.replace('_', '-')} must be between 0 and 1, got {value!r}")
    impl = get("cce_impl")
    if impl not in ("auto", "flash", "stock", "chunked"):
        raise PluginError(f"--cce-impl must be auto, flash, stock or chunked, got {impl!r}")
    from . import backends, budget

    size = get("cce_memory_budget")
    try:
        memory_budget = budget.resolve(size)
    except ValueError as e:
        raise PluginError(f"--cce-memory-budget: {e}") from None
    backend = get("cce_backend")
    if backend != "auto" and backend not in backends.available():
        raise PluginError(
            f"--cce-backend {backend!r} is not available here (have: {', '.join(backends.available())})"
        )
    return {
        "impl": impl,
        "backend": backend,
        "token_chunk": get("cce_token_chunk"),
        "vocab_chunk": get("cce_vocab_chunk"),
        "filter_eps": get("cce_filter_eps"),
        "block_skip_eps": get("cce_block_skip_eps"),
        "min_flash_elements": get("cce_crossover"),
        "check": not get("cce_no_check"),
        "memory_budget": memory_budget,
    }


def _strength(args, key, default, low_open):
    value = getattr(args, key, None)
    if value is None:
        return default
    low = "(0" if low_open else "[0"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and math.isfinite(value) and (value > 0 if low_open else value >= 0)
    if not ok or value > MAX_STRENGTH:
        flag = "--" + key.replace("_", "-")
        raise PluginError(
            f"{flag} must be a finite number in {low}, {MAX_STRENGTH:g}], got {value!r}"
        )
    return float(value)


def preference_options(args: Any) -> Dict[str, Any]:
    """Validated options of the preference losses (``preference.make_loss``)."""
    loss = getattr(args, "loss", None)
    ref = getattr(args, "reference_model", None)
    if ref is not None and loss in PREFERENCE and loss not in REFERENCE:
        raise PluginError(
            f"--reference-model: --loss {loss} uses no reference model "
            f"(those that do: {', '.join(REFERENCE)})"
        )
    return {
        "beta": _strength(args, "beta", None, True),
        "gamma": _strength(args, "simpo_gamma", 0.5, False),
        "reference_model": None if ref is None else str(ref),
        "sets": (),
        "tokenizer": None,
    }


@hookimpl
def activate(command: str, args: argparse.Namespace) -> Any:
    options = options_from(args if args is not None else argparse.Namespace())
    # Preference losses' own options; make_loss leaves them out of the cce ones.
    options[PREF_KEY] = preference_options(args)
    if command == "lora" and not log.handlers:
        # mlx_lm.lora configures no logging: show the auto backend's one line.
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        _handler.append(handler)
    return options  # validated: handed back to make_loss


@hookimpl
def deactivate() -> None:
    from . import budget

    budget.LIMIT.release()  # the memory limit a GPU path held during training
    while _handler:
        log.removeHandler(_handler.pop())


@hookimpl
def make_loss(name: str, model: Any, args: argparse.Namespace, options: Any) -> Optional[Callable]:
    if name != NAME and name not in PREFERENCE:
        return None
    if options is None:
        options = dict(options_from(args), **{PREF_KEY: preference_options(args)})
    cce = {k: v for k, v in options.items() if k != PREF_KEY}
    if name in PREFERENCE:
        return _preference_loss(name, model, args, options[PREF_KEY], cce)
    from .loss import make_loss as build

    # A PluginError raised on the first batch (a memory budget no path fits)
    # reaches the host, which exits 2 with its message.
    return build(model, **cce)


def _preference_loss(name, model, args, pref, cce):
    from . import preference

    reference_model = None
    if name in REFERENCE and pref["reference_model"] is not None:
        reference_model = _reference_model(pref["reference_model"], pref["tokenizer"])
    elif name in REFERENCE and not getattr(args, "train", True) and _full_weights(args):
        raise PluginError(
            f"--loss {name} --test without --train: the adapter folder holds fully "
            "fine-tuned weights, so the base model that the reference log-probs need is "
            "gone; test with the same command that trained (--train --test), or name the "
            "base with --reference-model"
        )
    loss = preference.make_loss(
        model,
        name,
        beta=pref["beta"],
        gamma=pref["gamma"],
        sets=pref["sets"],
        batch_size=args.batch_size,
        share_prompt=not getattr(args, "grad_checkpoint", False),
        reference_model=reference_model,
        **cce,
    )
    pref["harvest"] = loss.harvest  # for the batches (iterate_batches)
    return loss  # the reference model's log-probs are in the pairs; its weights can go


def _reference_model(path, tokenizer):
    """The ``--reference-model`` checkpoint, frozen; its tokenizer must be the model's."""
    from mlx_lm.utils import load

    try:
        model, ref_tok = load(path)
    except Exception as e:  # a missing folder, a broken config: one line, exit 2
        raise PluginError(
            f"--reference-model {path}: cannot load ({type(e).__name__}: {e})"
        ) from None
    if tokenizer is not None and not _same_tokenizer(tokenizer, ref_tok):
        raise PluginError(
            f"--reference-model {path}: its tokenizer differs from the model's (vocabulary "
            "or special tokens), so its log-probs would score other tokens"
        )
    model.freeze()
    model.eval()
    return model


def _same_tokenizer(a, b):
    try:
        same = a.get_vocab() == b.get_vocab()
    except AttributeError:  # a tokenizer without get_vocab: compare what it does
        probe = "The reference model, 0123 ünïcode."
        same = list(a.encode(probe)) == list(b.encode(probe))
    return same and a.eos_token_id == b.eos_token_id and a.bos_token_id == b.bos_token_id


def _full_weights(args):
    import json
    from pathlib import Path

    path = Path(str(getattr(args, "adapter_path", "") or "")) / "adapter_config.json"
    try:
        return json.loads(path.read_text()).get("fine_tune_type") == "full"
    except (OSError, ValueError, AttributeError):
        return False


@hookimpl
def load_dataset(name: str, args: argparse.Namespace, tokenizer: Any, options: Any) -> Any:
    if name not in PREFERENCE:
        return None
    from . import pairs

    sets = pairs.load(args, tokenizer)
    if options is not None:
        # the reference log-probs cover the splits this run reads, no more
        options[PREF_KEY]["sets"] = pairs.read_by(args, sets)
        options[PREF_KEY]["tokenizer"] = tokenizer
    return sets


@hookimpl
def iterate_batches(name: str, args: argparse.Namespace, options: Any) -> Optional[Callable]:
    if name not in PREFERENCE:
        return None
    import functools

    from . import pairs

    def harvest():  # looked up per batch: mlx-lm asks for the batches after the loss
        pref = (options or {}).get(PREF_KEY) or {}
        return pref["harvest"]() if "harvest" in pref else 0

    return functools.partial(pairs.iterate_batches, harvest=harvest)


@hookimpl
def doctor() -> List[Tuple[str, str]]:
    import mlx.core as mx

    from . import backends, qmm

    lines = [("backends", ", ".join(backends.available()))]
    try:
        result = qmm.probe()
        worst = max(result["rows"].values())
        verdict = "BUG: wrong values (flash-cce pads these to 4 rows)" if result["buggy"] else "ok"
        lines.append(
            (
                "quantized_matmul M=2,3",
                f"{verdict} on {result['device']} (max rel. error {worst:.1e}, mlx {mx.__version__})",
            )
        )
    except Exception as e:  # the probe must never break doctor
        lines.append(("quantized_matmul M=2,3", f"probe failed: {e!r}"))
    return lines
