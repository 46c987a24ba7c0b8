"""What makes a stored prompt cache valid for a server: fingerprint and namespace.

Entries live in ``<dir>/<fingerprint>/<namespace>/``. The fingerprint covers
everything that changes the KV values a token sequence produces: the model's
weights and config, its tokenizer files, the cache layout of its architecture,
the KV quantization settings, and the mlx / mlx-lm / file-format versions.
The namespace separates caches of one model that must never mix: a LoRA
adapter, or a draft model whose caches ride along in the same list.

The server's model key is ``(model_path, adapter_path, draft_model_path)`` as
given on the command line or in a request (a local path or a Hugging Face repo
id). Repo ids resolve through the local Hugging Face cache only: nothing is
downloaded here.
"""

import hashlib
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

FORMAT_VERSION = "1"
SAMPLES = 16  # sampled 64 KiB windows per weight file
WINDOW = 64 << 10
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "tiktoken.model",
)


class Unidentifiable(ValueError):
    """A model key whose files cannot be found locally: no disk tier for it."""


def resolve(path_or_repo: Union[str, os.PathLike]) -> Path:
    """The local directory of a model path or a cached Hugging Face repo id."""
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path.resolve()
    try:
        from mlx_lm.utils import hf_repo_to_path

        path = hf_repo_to_path(str(path_or_repo))  # local_files_only=True
    except Exception as e:
        raise Unidentifiable(f"{path_or_repo}: not a local model ({e})") from e
    if not path.is_dir():
        raise Unidentifiable(f"{path_or_repo}: not a local model")
    return path.resolve()


def _sample_file(h, path):
    """Size, safetensors header and evenly spaced windows of a weight file.

    Reading every byte of a large model at start-up would cost minutes;
    changed weights (a fine-tune, a re-quantization, another model copied over)
    change the header or the sampled bytes.
    """
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        if 0 < n < (64 << 20):
            h.update(f.read(n))
        start = 8 + n
        span = max(size - start - WINDOW, 0)
        for i in range(SAMPLES):
            f.seek(start + span * i // max(SAMPLES - 1, 1))
            h.update(f.read(WINDOW))


def files_identity(path: Union[str, os.PathLike]) -> str:
    """A hash of a model or adapter directory's config, weights and tokenizer."""
    path = Path(path)
    h = hashlib.sha256()
    names = sorted(p.name for p in path.iterdir() if p.is_file())
    for name in names:
        p = path / name
        if name.endswith(".safetensors"):
            _sample_file(h, p)
        elif name.endswith(".json") or name in TOKENIZER_FILES or name.endswith(".tiktoken"):
            h.update(f"{name}:".encode())
            h.update(p.read_bytes())
    if not any(n.endswith(".safetensors") for n in names):
        raise Unidentifiable(f"{path}: no .safetensors weights")
    return h.hexdigest()


def describe_layout(caches: Iterable[Any]) -> str:
    """A short text of cache classes and their shape-defining settings."""
    parts = []
    for c in caches:
        name = type(c).__name__
        if name == "RotatingKVCache":
            name += f"({c.max_size},{c.keep})"
        elif name == "ChunkedKVCache":
            name += f"({c.chunk_size})"
        elif name == "ArraysCache":
            name += f"({len(c.cache)})"
        elif name == "CacheList":
            name += "[" + describe_layout(c.caches) + "]"
        if parts and parts[-1][0] == name:
            parts[-1][1] += 1
        else:
            parts.append([name, 1])
    return ",".join(n if k == 1 else f"{n}*{k}" for n, k in parts)


def lazy_model(path: Union[str, os.PathLike]) -> Any:
    """The architecture in ``path`` built from its config with lazy random
    parameters that are never evaluated: it costs no memory. None for a model
    with its own code file."""
    from mlx_lm.utils import _get_classes, load_config

    config = load_config(Path(path))
    if config.get("model_file"):
        return None
    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(config))


def lazy_models(model_key: Any) -> List[Any]:
    """Lazy copies of the key's target (and mlx-lm draft) model, for their cache layout."""
    model, _, draft = split_key(model_key)
    out = []
    for p in (model, draft):
        if p is not None:
            m = lazy_model(resolve(p))
            if m is None:
                raise Unidentifiable(
                    f"{p}: custom model code; its cache layout is known "
                    "once the server has loaded it"
                )
            out.append(m)
    return out


def layout(path: Union[str, os.PathLike]) -> Tuple[str, Optional[int]]:
    """``(text, n)``: the cache layout of the architecture in ``path`` and its
    number of caches (None when unknown), without loading the weights."""
    from mlx_lm.models.cache import make_prompt_cache

    try:
        model = lazy_model(path)
        if model is None:
            from mlx_lm.utils import load_config

            code = (Path(path) / load_config(Path(path))["model_file"]).read_bytes()
            return "custom:" + hashlib.sha256(code).hexdigest()[:16], None
        caches = make_prompt_cache(model)
        return describe_layout(caches), len(caches)
    except Exception as e:  # an architecture that needs more than its config
        return f"unknown:{type(e).__name__}", None


def versions() -> Dict[str, str]:
    return {
        "mlx": importlib.metadata.version("mlx"),
        "mlx-lm": importlib.metadata.version("mlx-lm"),
        "format": FORMAT_VERSION,
    }


def split_key(model_key: Any) -> Tuple[str, Optional[str], Optional[str]]:
    """``(model, adapter, draft)`` from the server's key or a plain path."""
    if isinstance(model_key, (str, os.PathLike)):
        return str(model_key), None, None
    if isinstance(model_key, tuple) and len(model_key) == 3 and model_key[0]:
        return tuple(None if k is None else str(k) for k in model_key)
    raise Unidentifiable(f"model key {model_key!r} is not (model, adapter, draft)")


def _hash(obj, n=16):
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:n]


def identify(
    model_key: Any, settings: Optional[Dict[str, Any]] = None
) -> Tuple[str, str, Dict[str, Any]]:
    """``(fingerprint, namespace, info)`` for a model key.

    ``settings`` are the server options that change cache contents
    (``kv_bits``, ``kv_group_size``, ``quantized_kv_start``).
    Raises ``Unidentifiable`` when the files cannot be found.
    """
    model, adapter, draft = split_key(model_key)
    path = resolve(model)
    text, n_caches = layout(path)
    info = {
        "model": str(model),
        "path": str(path),
        "weights": files_identity(path),
        "layout": text,
        "settings": dict(sorted((settings or {}).items())),
        **versions(),
    }
    extra = {}
    if adapter is not None:
        apath = Path(adapter).expanduser()
        if not apath.is_dir():
            raise Unidentifiable(f"adapter {adapter}: not a local directory")
        extra["adapter"] = files_identity(apath)
    if draft is not None:
        dpath = resolve(draft)
        extra["draft"] = files_identity(dpath)
        extra["draft_layout"], n_draft = layout(dpath)
        # mlx-lm appends the draft model's caches to the same list
        n_caches = None if n_caches is None or n_draft is None else n_caches + n_draft
    namespace = "base" if not extra else "ns-" + _hash(extra, 16)
    info["namespace"] = {"adapter": adapter, "draft": draft, **extra}
    info["n_caches"] = n_caches
    # The resolved path is informative only: a copied model dir keeps its entries.
    ident = {k: v for k, v in info.items() if k not in ("path", "model", "namespace", "n_caches")}
    return _hash(ident), namespace, info
