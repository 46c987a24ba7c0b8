"""mlx-lm-ext hooks: ``mlx_lm.lora --loss flash-cce`` (and ``--loss orpo|dpo``) and ``mlx-lm-ext doctor``.

Flags (lora; all default to None so a YAML config can set them, the real
defaults are applied in ``activate``):

``--cce-impl``          auto | flash | stock | chunked (default auto)
``--cce-backend``       auto or a backend name (default auto)
``--cce-token-chunk``   tokens per pass (default 256)
``--cce-vocab-chunk``   vocabulary rows per block (default: 2**18 / token chunk)
``--cce-filter-eps``    approximate: skip gradient tiles below eps (default off)
``--cce-block-skip-eps`` approximate: skip vocabulary blocks below eps (default off)
``--cce-crossover``     logits (tokens x vocab) below which the stock-style
                        head runs (default: api.MIN_FLASH_ELEMENTS)
``--cce-no-check``      skip the one-time self-check against the model's logits
``--cce-memory-budget`` most working memory of the loss head above its inputs,
                        e.g. 512M, 2G (default: budget.default_for the batch)
``--beta``              ORPO / DPO strength (default 0.1)

``--loss orpo`` and ``--loss dpo`` (``loss_names``) train on preference
pairs: this plugin loads the rows (``pairs.py``), batches them by pairs and
computes the loss from shared-prompt log-probs (``preference.py``).
"""

import argparse
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

from mlx_lm_ext import PluginError, hookimpl

NAME = "flash-cce"
PREFERENCE = ("orpo", "dpo")  # the extra --loss names (preference.LOSSES)
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
        help="--loss orpo / dpo: strength of the preference term (default 0.1)",
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
        help="loss backend: auto or a registered name, e.g. mlx (default auto)",
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


def _beta(args):
    beta = getattr(args, "beta", None)
    beta = 0.1 if beta is None else beta
    if not isinstance(beta, (int, float)) or not beta > 0:
        raise PluginError(f"--beta must be a positive number, got {beta!r}")
    return float(beta)


@hookimpl
def activate(command: str, args: argparse.Namespace) -> Any:
    options = options_from(args if args is not None else argparse.Namespace())
    # Preference losses' own options; make_loss leaves them out of the cce ones.
    options[PREF_KEY] = {"beta": _beta(args), "sets": ()}
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
        options = dict(options_from(args), **{PREF_KEY: {"beta": _beta(args), "sets": ()}})
    cce = {k: v for k, v in options.items() if k != PREF_KEY}
    if name in PREFERENCE:
        return _preference_loss(name, model, args, options[PREF_KEY], cce)
    from .loss import make_loss as build

    # A PluginError raised on the first batch (a memory budget no path fits)
    # reaches the host, which exits 2 with its message.
    return build(model, **cce)


def _preference_loss(name, model, args, pref, cce):
    from . import preference

    if name == "dpo" and not getattr(args, "train", True) and _full_weights(args):
        raise PluginError(
            "--loss dpo --test without --train: the adapter folder holds fully fine-tuned "
            "weights, so the base model that DPO's reference log-probs need is gone; "
            "test with the same command that trained (--train --test)"
        )
    return preference.make_loss(
        model,
        name,
        beta=pref["beta"],
        sets=pref["sets"],
        batch_size=args.batch_size,
        share_prompt=not getattr(args, "grad_checkpoint", False),
        **cce,
    )


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
        options[PREF_KEY]["sets"] = sets  # DPO's reference covers every split
    return sets


@hookimpl
def iterate_batches(name: str, args: argparse.Namespace, options: Any) -> Optional[Callable]:
    if name not in PREFERENCE:
        return None
    from . import pairs

    return pairs.iterate_batches


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
