"""Test fixtures for mlx-lm-ext and its plugins (a pytest plugin).

The root ``pyproject.toml`` loads this module for every test run
(``addopts = "-p mlx_lm_ext.testing"``), so plugin tests use these fixtures
without importing anything:

``smollm2_path`` (session)
    Path of the real SmolLM2-135M-Instruct folder, native 4-bit weights,
    built once by ``mlx_lm_ext.models.build("smollm2-135m")`` into the model
    cache (``MLX_LM_EXT_CACHE`` overrides it). Real-model tests must be
    marked ``@pytest.mark.slow``.
``smollm2_f32_path`` (session)
    The same model dequantized to float32 (``"smollm2-135m-f32"``): the
    reference for parity tests. Run float32 work with OpenBLAS preloaded.
``smollm2_tokenizer_dir`` (session)
    A folder holding only the real SmolLM2 tokenizer (``tokenizer.json``,
    ``tokenizer_config.json`` with the ChatML template; vocab 49,152).
``tiny_model`` (session)
    Factory ``tiny_model(arch, *, quantized=False, tied=True, **overrides)
    -> Path``: a tiny random-weight mlx-lm model folder (hidden 64, 2-4
    layers, seeded, loads in well under a second) saved with the real
    SmolLM2 tokenizer. ``arch`` is one of ``TINY_ARCHS``: ``"llama"``,
    ``"qwen3"``, ``"phi3"``, ``"gemma3_text"`` (sliding window 8, so
    ``RotatingKVCache`` engages after 8 tokens), ``"gpt2"`` (always tied).
    ``quantized=True`` gives 4-bit affine weights (mlx-lm's
    ``quantize_model``, group size 32). ``overrides`` replace config keys
    (e.g. ``num_hidden_layers=4``; ``seed=``, ``group_size=``, ``bits=`` are
    also accepted). Folders are cached per argument set for the session.

``TINY_VARIANTS`` lists every ``(arch, quantized, tied)`` combination the
factory supports, for ``pytest.mark.parametrize``.

Scripts and benchmarks can use the same models without pytest:
``build_tiny_model(path, arch, ...)`` and ``tiny_config(arch, ...)``.
``resolve(path)`` is the object a dotted path names (tests that check the
names a table or a document gives). ``default_sigint`` is a ``preexec_fn``
for servers a test stops with Ctrl-C (SIGINT restored to its default).
"""

import contextlib
import copy
import importlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Union

try:
    import pytest
except ImportError:  # scripts may use build_tiny_model without pytest installed
    pytest = None

TINY_ARCHS = ("llama", "qwen3", "phi3", "gemma3_text", "gpt2")

# Small enough to load in milliseconds; the 49,152-row embedding of the real
# tokenizer is most of the weight (3.1M parameters at hidden 64).
_VOCAB = 49152
_BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": _VOCAB,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
}
_CONFIGS = {
    "llama": {"model_type": "llama", **_BASE},
    "qwen3": {"model_type": "qwen3", **_BASE},
    "phi3": {"model_type": "phi3", **{k: v for k, v in _BASE.items() if k != "head_dim"}},
    "gemma3_text": {
        "model_type": "gemma3_text",
        **_BASE,
        "num_hidden_layers": 4,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 16,
        # Layers 0 and 2 slide over the last 8 tokens, 1 and 3 attend globally.
        "sliding_window": 8,
        "sliding_window_pattern": 2,
        "rope_local_base_freq": 10000.0,
    },
    "gpt2": {
        "model_type": "gpt2",
        "n_ctx": 1024,
        "n_embd": 64,
        "n_head": 4,
        "n_layer": 2,
        "n_positions": 1024,
        "layer_norm_epsilon": 1e-5,
        "vocab_size": _VOCAB,
    },
}

TINY_VARIANTS = [
    (arch, quantized, tied)
    for arch in TINY_ARCHS
    for quantized in (False, True)
    for tied in ((True,) if arch == "gpt2" else (True, False))
]


def default_sigint() -> None:
    """``subprocess.Popen(..., preexec_fn=default_sigint)``: the child takes
    SIGINT as Ctrl-C. A test run started in the background ignores SIGINT,
    and an ignored signal stays ignored across exec, so a server it starts
    would never see the Ctrl-C a test sends it."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def resolve(path: str) -> Any:
    """The object a dotted path names (``mlx_lm.server.APIHandler.do_GET``):
    its longest importable module prefix, then attributes. ``ImportError``
    when no prefix imports, ``AttributeError`` when an attribute is missing."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def tiny_config(arch: str, *, tied: bool = True, **overrides: Any) -> Dict[str, Any]:
    """The mlx-lm ``config.json`` dict of a tiny ``arch`` model."""
    if arch not in _CONFIGS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {', '.join(TINY_ARCHS)}")
    if arch == "gpt2" and not tied:
        raise ValueError("mlx-lm's gpt2 always ties its output head to the embedding")
    config = copy.deepcopy(_CONFIGS[arch])
    config["tie_word_embeddings"] = tied
    config.update(
        bos_token_id=1, eos_token_id=2
    )  # the SmolLM2 tokenizer's <|im_start|>, <|im_end|>
    config.update(overrides)
    return config


def build_tiny_model(
    path: Union[str, os.PathLike],
    arch: str,
    *,
    quantized: bool = False,
    tied: bool = True,
    seed: int = 0,
    group_size: int = 32,
    bits: int = 4,
    tokenizer_dir: Optional[Union[str, os.PathLike]] = None,
    **overrides: Any,
) -> Path:
    """Write a tiny random-weight mlx-lm model folder at ``path`` and return it.

    Weights are drawn from MLX's default initializers after
    ``mx.random.seed(seed)``, so the same arguments give the same model.
    The tokenizer is copied from ``tokenizer_dir``, or built from the
    SmolLM2 GGUF when it is ``None``.
    """
    import mlx.core as mx
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    config = tiny_config(arch, tied=tied, **overrides)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    if arch == "gemma3_text" and tied:
        # mlx-lm's gemma3_text ties when the checkpoint has no lm_head.
        model.sanitize({})
    if quantized:
        with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints bits per weight
            model, config = quantize_model(model, config, group_size, bits)
    mx.eval(model.parameters())

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config(config, config_path=path / "config.json")
    if tokenizer_dir is None:
        from . import models

        models.save_tokenizer(path)
    else:
        for f in Path(tokenizer_dir).iterdir():
            shutil.copy(f, path / f.name)
    return path


if pytest is not None:

    @pytest.fixture(scope="session")
    def smollm2_path() -> Path:
        from . import models

        return models.build("smollm2-135m", progress=False)

    @pytest.fixture(scope="session")
    def smollm2_f32_path() -> Path:
        from . import models

        return models.build("smollm2-135m-f32", progress=False)

    @pytest.fixture(scope="session")
    def smollm2_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
        from . import models

        return models.save_tokenizer(tmp_path_factory.mktemp("smollm2-tokenizer"))

    @pytest.fixture(scope="session")
    def tiny_model(
        tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: Path
    ) -> Callable[..., Path]:
        built = {}

        def make(arch, *, quantized=False, tied=True, **overrides):
            key = json.dumps([arch, quantized, tied, overrides], sort_keys=True, default=str)
            if key not in built:
                tag = f"tiny-{arch}-{'q4' if quantized else 'f32'}-{'tied' if tied else 'untied'}"
                folder = tmp_path_factory.mktemp(tag)
                built[key] = build_tiny_model(
                    folder,
                    arch,
                    quantized=quantized,
                    tied=tied,
                    tokenizer_dir=smollm2_tokenizer_dir,
                    **overrides,
                )
            return built[key]

        return make
