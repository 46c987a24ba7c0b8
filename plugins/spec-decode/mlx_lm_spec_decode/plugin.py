"""Hooks of the ``spec-decode`` plugin, and the few mlx-lm patches it needs.

Which draft models this plugin handles: only ``Drafter`` objects. With
``--plugin spec-decode`` the host asks ``make_drafter`` for one, so on the
command line the plugin's loop always runs (``--drafter`` defaults to
``draft-model`` when ``--draft-model`` is given, else ``ngram``). A plain
``nn.Module`` draft model that reaches ``speculative_generate_step`` without
being wrapped (Python API: ``stream_generate(..., draft_model=module)``) is
left to mlx-lm's own loop: wrap it in ``DraftModelDrafter`` to use this one.

It patches nothing: the loop records each request's figures in the host's
``request_info()``, and the host asks ``report_lines`` (``--verbose``
output of ``mlx_lm.generate``) and ``usage_fields`` (the server's
``usage``) for them. The log line comes from the loop itself (logger
``mlx_lm_spec_decode``, INFO).
"""

import argparse
import logging
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from mlx_lm_ext.api import PluginError, hookimpl

from .draft_model import DraftModelDrafter, VocabularyMismatch
from .drafter import Drafter
from .lookup import LookupFirst
from .ngram import NGramDrafter
from .suffix import DEFAULT_CORPUS_TOKENS, SuffixDrafter

log = logging.getLogger("mlx_lm_spec_decode")

DRAFTERS = ("ngram", "suffix", "draft-model", "assistant")
LOOKUPS = ("ngram", "suffix")  # drafters that look up, free to ask: --draft-lookup adds nothing


@hookimpl
def commands() -> List[str]:
    return ["generate", "server"]


@hookimpl
def add_arguments(command: str, group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--drafter",
        choices=DRAFTERS,
        default=None,
        help="Drafter for speculative decoding: prompt lookup ('ngram'), a suffix index over "
        "this request and this process's past requests ('suffix'), a smaller "
        "model ('draft-model', from --draft-model) or a trained assistant that reads the target's "
        "cache ('assistant', from --drafter-path). Default: draft-model when "
        "--draft-model is given, else ngram. --num-draft-tokens is the starting draft length.",
    )
    group.add_argument(
        "--drafter-path",
        default=None,
        help="Folder of a trained assistant drafter (--drafter assistant), made for this "
        "model by 'mlx-lm-ext train-drafter'.",
    )
    group.add_argument(
        "--ngram-max",
        type=int,
        default=4,
        help="Longest n-gram the ngram drafter matches (tried first). Default: 4.",
    )
    group.add_argument(
        "--ngram-min",
        type=int,
        default=2,
        help="Shortest n-gram the ngram drafter matches. Default: 2.",
    )
    group.add_argument(
        "--draft-max",
        type=int,
        default=None,
        help="Upper bound of the adaptive draft length. "
        "Default: 10 (ngram), 16 (suffix), 6 (draft-model).",
    )
    group.add_argument(
        "--fixed-draft",
        action="store_true",
        help="Keep the draft length at --num-draft-tokens (no adaptation).",
    )
    group.add_argument(
        "--suffix-corpus-tokens",
        default=str(DEFAULT_CORPUS_TOKENS),
        help="Tokens of past prompts and outputs the suffix drafter keeps per model "
        f"(oldest dropped first; about 20 bytes each). Default: {DEFAULT_CORPUS_TOKENS}.",
    )
    group.add_argument(
        "--suffix-corpus-dir",
        default=None,
        help="Keep the suffix drafter's corpus across restarts in this folder "
        "(DIR/<model fingerprint>/suffix-corpus.npz, saved at most every 30 s and at exit; "
        "a damaged file is ignored with a warning). Default: not kept.",
    )
    group.add_argument(
        "--draft-tree",
        choices=("auto", "off"),
        default="auto",
        help="Token trees (ngram, suffix; the assistant beside --draft-lookup): verify "
        "several drafted continuations in one forward where the measured cost of a wider "
        "forward pays for them ('auto'), or only ever one chain ('off'). Default: auto.",
    )
    group.add_argument(
        "--draft-lookup",
        action="store_true",
        help="With a model drafter (draft-model, assistant): propose the prompt lookup's "
        "copy where an n-gram of the text matches (--ngram-min/--ngram-max), and the "
        "model's drafts only where none does.",
    )
    group.add_argument(
        "--no-auto-off",
        action="store_true",
        help="Keep drafting even when it measures slower than plain decoding.",
    )


def _corpus_tokens(args):
    v = getattr(args, "suffix_corpus_tokens", DEFAULT_CORPUS_TOKENS)
    try:
        n = int(v) if not isinstance(v, float) else None
    except (TypeError, ValueError):
        n = None
    if n is None or n < 2:
        raise PluginError(f"--suffix-corpus-tokens must be an integer >= 2, got {v!r}")
    return n


def _corpus_dir(args):
    d = getattr(args, "suffix_corpus_dir", None)
    if d is None:
        return None
    path = Path(str(d)).expanduser()
    if not str(d).strip() or (path.exists() and not path.is_dir()):
        raise PluginError(f"--suffix-corpus-dir must be a folder, got {d!r}")
    return str(path)


def _check(args):
    _corpus_tokens(args)
    _corpus_dir(args)
    nmin, nmax = getattr(args, "ngram_min", 2), getattr(args, "ngram_max", 4)
    if not (isinstance(nmin, int) and isinstance(nmax, int) and 1 <= nmin <= nmax):
        raise PluginError(f"--ngram-min/--ngram-max: need 1 <= min <= max, got {nmin}, {nmax}")
    dmax = getattr(args, "draft_max", None)
    if dmax is not None and (not isinstance(dmax, int) or dmax < 1):
        raise PluginError(f"--draft-max must be a positive integer, got {dmax}")
    if getattr(args, "draft_tree", "auto") not in ("auto", "off"):
        raise PluginError(f"--draft-tree must be auto or off, got {args.draft_tree!r}")
    drafter = getattr(args, "drafter", None)
    if drafter is not None and drafter not in DRAFTERS:
        raise PluginError(f"--drafter must be one of {', '.join(DRAFTERS)}, got {drafter!r}")
    n = getattr(args, "num_draft_tokens", None)
    if n is not None and (not isinstance(n, int) or n < 1):
        raise PluginError(f"--num-draft-tokens must be a positive integer, got {n}")
    if drafter == "draft-model" and hasattr(args, "draft_model") and not args.draft_model:
        raise PluginError(
            "--drafter draft-model needs --draft-model PATH "
            "(a smaller model with the same tokenizer)"
        )
    which = _which(args, getattr(args, "draft_model", None))
    if getattr(args, "draft_lookup", False) and which in LOOKUPS:
        raise PluginError(
            "--draft-lookup adds prompt lookup to a model drafter: use it with "
            "--drafter draft-model or --drafter assistant"
        )
    if drafter == "assistant" and not getattr(args, "drafter_path", None):
        raise PluginError(
            "--drafter assistant needs --drafter-path DIR "
            "(train one with: mlx-lm-ext train-drafter)"
        )
    if drafter == "assistant":
        from .assistant import AssistantError, read_config

        try:  # the folder now; whether it fits the model once it is loaded
            read_config(args.drafter_path)
        except AssistantError as e:
            raise PluginError(f"--drafter-path: {e}") from e


@hookimpl
def activate(command: str, args: argparse.Namespace) -> argparse.Namespace:
    _check(args)
    return args  # the validated flags: handed back as ``options``


@hookimpl
def deactivate() -> None:
    from . import corpus_store

    corpus_store.flush(forget=True)  # suffix corpora kept on disk: saved now


@hookimpl
def usage_fields(info: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    s = info.get("spec-decode")
    if s is None:
        return None
    return {
        "completion_tokens_details": {
            "accepted_prediction_tokens": s.accepted,
            "rejected_prediction_tokens": s.drafted - s.accepted,
        },
        "speculative_decoding": s.as_dict(),
    }


@hookimpl
def report_lines(command: str, source: Any) -> Optional[List[str]]:
    if command != "generate" or source.get("spec-decode") is None:
        return None
    return [source["spec-decode"].line()]


def _options(args, which):
    return dict(
        max_draft=getattr(args, "draft_max", None) or {"ngram": 10, "suffix": 16}.get(which, 6),
        adaptive=not getattr(args, "fixed_draft", False),
        auto_off=not getattr(args, "no_auto_off", False),
    )


@hookimpl
def status_options(options: argparse.Namespace) -> Dict[str, Any]:
    """What the unset flags resolve to, for ``/status`` (as ``make_drafter`` resolves them)."""
    which = _which(options, getattr(options, "draft_model", None))
    lookup = getattr(options, "draft_lookup", False) and which not in LOOKUPS
    return {
        "drafter": f"ngram+{which}" if lookup else which,
        "draft_max": _options(options, which)["max_draft"],
        "num_draft_tokens": getattr(options, "num_draft_tokens", None) or 3,
    }


@hookimpl
def make_drafter(
    command: str,
    model: Any,
    tokenizer: Any,
    draft_model: Any,
    args: Optional[argparse.Namespace],
    options: argparse.Namespace,
) -> Drafter:
    args = args if args is not None else options
    if command == "python" and _callers_own(draft_model, args):
        return None  # the draft_model the caller passed, as it is
    which = _which(args, draft_model)
    drafter = _drafter(command, which, model, tokenizer, draft_model, args)
    if not getattr(args, "draft_lookup", False) or which in LOOKUPS:
        return drafter
    # Trees where the model drafter grows them (the assistant): one tree of
    # the lookup's copies and the model's branches a round.
    tree = getattr(drafter, "tree", False)
    lookup = NGramDrafter(
        n_max=args.ngram_max, n_min=args.ngram_min, tree=tree, **_options(args, "ngram")
    )
    return LookupFirst(drafter, lookup)


def _which(args, draft_model):
    """The drafter's name: ``--drafter``, else draft-model where there is one, else ngram."""
    return getattr(args, "drafter", None) or ("draft-model" if draft_model is not None else "ngram")


def _drafter(command, which, model, tokenizer, draft_model, args):
    opts = _options(args, which)
    tree = getattr(args, "draft_tree", "auto") != "off"
    if which == "assistant":
        # Chains alone (its trees measured slower on a GPU); trees beside a
        # lookup, which grow only where the assistant's rounds pay.
        return _assistant(
            model, args, {**opts, "tree": tree and getattr(args, "draft_lookup", False)}
        )
    if which == "suffix":
        return SuffixDrafter(
            _corpus_tokens(args),
            tokenizer=tokenizer,
            tree=tree,
            corpus_dir=_corpus_dir(args),
            **opts,
        )
    if which == "ngram":
        if draft_model is not None:
            log.warning("spec-decode: --drafter ngram ignores the --draft-model")
        return NGramDrafter(n_max=args.ngram_max, n_min=args.ngram_min, tree=tree, **opts)
    if draft_model is None:
        if command == "python":
            raise PluginError('drafter="draft-model" needs draft_model=MODEL in each call')
        raise PluginError("--drafter draft-model needs --draft-model PATH")
    if isinstance(draft_model, Drafter):
        return draft_model
    try:
        draft_tokenizer = _load_tokenizer(getattr(args, "draft_model", None))
        return DraftModelDrafter(
            draft_model,
            tokenizer=draft_tokenizer,
            target_tokenizer=tokenizer if draft_tokenizer is not None else None,
            target_vocab_size=getattr(getattr(model, "args", None), "vocab_size", None),
            **opts,
        )
    except (VocabularyMismatch, ValueError) as e:
        raise PluginError(f"spec-decode: {e}") from e


def _callers_own(draft_model, args):
    """From Python (``mlx_lm_ext.enable``), a ``draft_model`` passed to the
    call wins over the enabled drafter; only ``drafter="draft-model"`` wraps
    a plain model in this plugin's ``DraftModelDrafter`` (otherwise a plain
    model runs mlx-lm's own loop, as documented)."""
    if draft_model is None:
        return False
    return isinstance(draft_model, Drafter) or getattr(args, "drafter", None) != "draft-model"


def _assistant(model, args, opts):
    from .assistant import AssistantError, load

    try:
        return load(args.drafter_path, model, **opts)
    except AssistantError as e:
        raise PluginError(f"spec-decode: {e}") from e


@hookimpl
def prompt_cache_classes() -> List[type]:
    # The n-gram index rides after the target's caches; a prompt-cache store
    # (ssd-cache) may keep it, so a restored prompt drafts from its own text.
    from .ngram import NGramCache
    from .suffix import SuffixCache

    return [NGramCache, SuffixCache]


@hookimpl
def add_subcommands(subparsers: Any) -> None:
    from .training.cli import add_subcommand

    add_subcommand(subparsers)


def _load_tokenizer(path):
    if not path:
        return None
    try:
        from mlx_lm.utils import _download, load_tokenizer

        return load_tokenizer(Path(_download(path)))
    except Exception as e:  # checked by vocab size only, as mlx-lm does
        log.warning(
            f"spec-decode: could not load the draft model's tokenizer for the vocabulary check: {e}"
        )
        return None


@hookimpl
def batch_generator(
    model: Any,
    tokenizer: Any,
    drafter: Any,
    args: Optional[argparse.Namespace],
    options: argparse.Namespace,
) -> Optional[Callable[..., Any]]:
    """The server's batched path for drafters with per-row state (ngram, suffix)."""
    if not getattr(drafter, "batches", False):
        log.info(
            f"spec-decode: the {getattr(drafter, 'name', 'drafter')} drafter does not batch; "
            "the server serves one request at a time"
        )
        return None
    args = args if args is not None else options
    gamma = getattr(args, "num_draft_tokens", None) or 3
    gmax = max(gamma, drafter.max_draft)
    from .batch import SpecBatchGenerator

    def make(model: Any, **kwargs: Any) -> SpecBatchGenerator:
        return SpecBatchGenerator(model, drafter, gamma, gmax, **kwargs)

    return make


@hookimpl
def speculative_generate_step(
    prompt: Any, model: Any, drafter: Any, kwargs: Dict[str, Any]
) -> Optional[Iterator[Tuple[int, Any, bool]]]:
    if not isinstance(drafter, Drafter):
        return None  # mlx-lm's own draft model: mlx-lm's own loop
    from .loop import speculative_generate_step as loop

    return loop(prompt, model, drafter, **kwargs)


@hookimpl
def request_finished(info: Dict[str, Any]) -> None:
    from . import metrics as series

    series.fold(info)


@hookimpl
def metrics() -> Optional[List[Any]]:
    """Drafted, accepted, rounds, auto-off... per drafter, for /metrics and /status."""
    from . import metrics as series

    return series.families()


@hookimpl
def status_charts() -> List[Tuple[str, str, str]]:
    from . import metrics as series

    return series.CHARTS
