"""A memory-bound stand-in: SmolLM2-135M made larger without changing what it predicts.

Speculative decoding pays where decoding is memory-bound: a large model on a
GPU reads all its weights per forward, so a forward over 8 tokens costs about
what one over a single token does. SmolLM2-135M is too small for that, so its
benchmarks cannot show what users of large models get. The stand-in has the
cost of a large model and SmolLM2's predictions:

- **Wider MLPs.** Each layer's ``gate_proj`` and ``up_proj`` get extra rows
  (seeded random), and ``down_proj`` gets the matching columns, all zero: the
  extra hidden units are computed and then multiplied by zero, so the layer's
  output is unchanged.
- **Added layers** (``layers=N``, default none): full decoder layers appended
  after the last one, with random attention and MLP inputs and zero
  ``o_proj`` and ``down_proj``: their output adds zero to the residual. They
  add per-layer work and KV cache like a deeper model's.

``size`` (a parameter count, ``"500M"``, ``"1B"``, ``"10B"``) sets the MLP
width: the added layers first, then the width (a multiple of 64) that brings
the total closest to ``size``. The default widens the MLP only; 30 layers
with width 191,872 make the 10B stand-in.

In float32 the extra terms are exact zeros, so the stand-in's greedy output
equals ``smollm2-135m-f32``'s (the logits agree up to how the matmuls sum
the longer rows). In bfloat16 it predicts what SmolLM2 cast to bfloat16
does. Built deterministically from the offline GGUF (the same seed gives the
same bytes), never shipped as weights:

    from mlx_lm_ext import standin
    path = standin.build("10B", dtype="bfloat16")    # a cached mlx-lm folder, ~20 GB
    model = standin.widen(model, "1B")               # or in memory, from a loaded SmolLM2

It is a stand-in for the *cost* of a large model only: a draft model of the
same family (the 4-bit SmolLM2) or a drafter trained on SmolLM2 predicts it
unrealistically well, and its KV cache stays SmolLM2's size (3 KV heads).
"""

import hashlib
import json
import logging
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from . import models
from .gguf import ModelError, gguf_path, read_gguf, save_tokenizer

logger = logging.getLogger(__name__)

NAME = "smollm2-standin"
DESCRIPTION = (
    "SmolLM2-135M widened to a given parameter count (--size 1B|3B|10B): "
    "a large model's cost with SmolLM2's predictions"
)
DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
WIDTH_MULTIPLE = 64
SHARD_BYTES = 2 << 30
# Bump when the tensors a given request produces change: cached folders whose
# config records another format are rebuilt.
FORMAT = 1
RECORD = "mlx_lm_ext_standin"  # config.json key; mlx-lm ignores unknown keys

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmbgt]?)\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_size(text: Union[str, int]) -> int:
    """A parameter count from ``"500M"``, ``"1B"``, ``"1.5b"``, ``"10B"`` or an integer."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    m = _SIZE.match(text) if isinstance(text, str) else None
    count = round(float(m.group(1)) * _SCALE[m.group(2).lower()]) if m else 0
    if count <= 0:
        raise ModelError(f"bad size {text!r}: give a parameter count such as 500M, 1B, 3B or 10B")
    return count


def size_tag(count: int) -> str:
    """``1_000_000_000`` -> ``"1b"``, ``500_000_000`` -> ``"500m"``: for folder names."""
    if count >= 10**9:
        return f"{count / 10**9:.4g}b"
    return f"{count / 10**6:.4g}m"


# -- shapes and counts ----------------------------------------------------------


def param_count(config: Dict[str, Any]) -> int:
    """The parameters of an mlx-lm llama model with ``config`` (no biases)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    embed = config["vocab_size"] * hidden
    if not config.get("tie_word_embeddings", True):
        embed *= 2
    return embed + hidden + config["num_hidden_layers"] * per_layer


def plan(
    base: Dict[str, Any],
    size: Optional[Union[str, int]] = None,
    *,
    intermediate_size: Optional[int] = None,
    layers: int = 0,
) -> Dict[str, Any]:
    """The stand-in's config: ``base`` with ``layers`` added and the MLP widened.

    Give ``size`` (the width is solved for it) or ``intermediate_size``.
    """
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 0:
        raise ModelError(f"bad number of added layers {layers!r}: give 0 or more")
    config = dict(base, num_hidden_layers=base["num_hidden_layers"] + layers)
    base_width = base["intermediate_size"]
    if (size is None) == (intermediate_size is None):
        raise ModelError("give one of a size (e.g. 1B) and an intermediate size")
    if intermediate_size is None:
        target = parse_size(size)
        fixed = param_count(dict(config, intermediate_size=0))
        per_unit = 3 * config["hidden_size"] * config["num_hidden_layers"]
        width = round((target - fixed) / per_unit / WIDTH_MULTIPLE) * WIDTH_MULTIPLE
        if width < base_width:
            smallest = param_count(dict(config, intermediate_size=base_width))
            raise ModelError(
                f"size {size!r} is below the base model"
                + (f" with {layers} added layers" if layers else "")
                + f" ({size_tag(smallest).upper()} parameters)"
            )
        intermediate_size = width
    if not isinstance(intermediate_size, int) or intermediate_size < base_width:
        raise ModelError(f"intermediate size must be an integer >= {base_width}")
    config["intermediate_size"] = intermediate_size
    if "layer_types" in config:
        config["layer_types"] = list(config["layer_types"]) + ["full_attention"] * layers
    return config


# -- tensors ----------------------------------------------------------------------


def _key(name, seed):
    import mlx.core as mx

    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return mx.random.key(int.from_bytes(digest[:8], "little"))


def _random(name, shape, seed, dtype):
    # nn.Linear's own init range; the values never reach the output.
    import mlx.core as mx

    bound = 1.0 / math.sqrt(shape[-1])
    return mx.random.uniform(-bound, bound, shape, key=_key(name, seed)).astype(dtype)


def make_tensor(name: str, shape: Tuple[int, ...], base, seed: int, dtype):
    """Stand-in tensor ``name`` of ``shape`` from the base's (``None`` for an added layer).

    Output projections (``down_proj``, and ``o_proj`` of added layers) are
    zero where the base has nothing; every other new entry is seeded random,
    except norm weights (ones) and biases (zeros) of added layers.
    """
    import mlx.core as mx

    zero_out = name.endswith(("mlp.down_proj.weight", "self_attn.o_proj.weight"))
    if base is not None and tuple(base.shape) == tuple(shape):
        return base.astype(dtype)
    if base is not None:
        extra = shape[0] - base.shape[0], shape[1] - base.shape[1]
        if name.endswith("mlp.down_proj.weight") and extra[0] == 0:
            pad = mx.zeros((shape[0], extra[1]), dtype=dtype)
            return mx.concatenate([base.astype(dtype), pad], axis=1)
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")) and extra[1] == 0:
            rows = _random(name, (extra[0], shape[1]), seed, dtype)
            return mx.concatenate([base.astype(dtype), rows], axis=0)
        raise ModelError(f"cannot widen {name} from {tuple(base.shape)} to {tuple(shape)}")
    if len(shape) == 1:
        return (mx.ones if name.endswith("norm.weight") else mx.zeros)(shape, dtype=dtype)
    if zero_out:
        return mx.zeros(shape, dtype=dtype)
    return _random(name, shape, seed, dtype)


def tensor_shapes(base: Dict[str, Any], config: Dict[str, Any]) -> Dict[str, Tuple[int, ...]]:
    """Every stand-in tensor's shape, from the base weights' shapes (name -> shape)."""
    base_layers = sum(1 for k in base if k.endswith(".input_layernorm.weight"))
    width = config["intermediate_size"]
    shapes = {}
    for name, value in base.items():
        shape = tuple(value.shape)
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            shape = (width, shape[1])
        elif name.endswith("mlp.down_proj.weight"):
            shape = (shape[0], width)
        shapes[name] = shape
    layer0 = {
        k[len("model.layers.0.") :]: s for k, s in shapes.items() if k.startswith("model.layers.0.")
    }
    for i in range(base_layers, config["num_hidden_layers"]):
        for leaf, shape in layer0.items():
            shapes[f"model.layers.{i}.{leaf}"] = shape
    return shapes


def _layer_order(name):
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        return (1, int(parts[2]), name)
    return (0 if name.startswith("model.embed") else 2, 0, name)


def _shards(shapes, itemsize, shard_bytes):
    # Whole layers in name order, a new file once one passes shard_bytes.
    shards, current, used = [], [], 0
    for name in sorted(shapes, key=_layer_order):
        nbytes = math.prod(shapes[name]) * itemsize
        if current and used + nbytes > shard_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    return shards + [current]


# -- in memory --------------------------------------------------------------------


def widen(
    model,
    size: Optional[Union[str, int]] = None,
    *,
    intermediate_size: Optional[int] = None,
    layers: int = 0,
    seed: int = 0,
):
    """Turn a loaded float SmolLM2-like model into its stand-in, in place; returns it.

    Any mlx-lm llama-family model with float weights works (``layers[i].mlp``
    with ``gate_proj``/``up_proj``/``down_proj``). The new tensors take the
    dtype of the weights they extend, and are the bytes ``build`` writes for
    the same arguments, seed and dtype.
    """
    import copy

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten

    args, blocks = getattr(model, "args", None), getattr(model, "layers", None)
    mlp = getattr(blocks[0], "mlp", None) if blocks else None
    if args is None or not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
        raise ModelError("widen needs an mlx-lm llama-family model (layers with a gated MLP)")
    if any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules()):
        raise ModelError("widen needs float weights: load smollm2-135m-f32, not the 4-bit model")
    config = plan(vars(args), size, intermediate_size=intermediate_size, layers=layers)
    base = dict(tree_flatten(model.parameters()))
    shapes = tensor_shapes(base, config)
    dtype = mlp.gate_proj.weight.dtype
    block_args = copy.copy(args)  # added blocks start at the base width: a cheap init
    for _ in range(layers):
        model.model.layers.append(type(blocks[0])(block_args))
    for field in ("intermediate_size", "num_hidden_layers", "layer_types"):
        if hasattr(args, field):
            setattr(args, field, config[field])
    model.model.num_hidden_layers = config["num_hidden_layers"]
    by_layer: Dict[int, List[str]] = {}
    for name in shapes:
        if base.get(name) is None or tuple(base[name].shape) != shapes[name]:
            by_layer.setdefault(_layer_order(name)[1], []).append(name)
    for names in by_layer.values():  # one layer at a time: bounded memory
        new = {n: make_tensor(n, shapes[n], base.get(n), seed, dtype) for n in names}
        mx.eval(list(new.values()))
        model.update(tree_unflatten(list(new.items())))
    return model


def load(
    size: Optional[Union[str, int]] = None,
    *,
    intermediate_size: Optional[int] = None,
    layers: int = 0,
    dtype: str = "float32",
    seed: int = 0,
):
    """``(model, tokenizer)``: SmolLM2-135M float32 loaded and widened in memory, in ``dtype``."""
    import mlx.core as mx
    from mlx_lm import load as mlx_load

    _check_dtype(dtype)
    model, tokenizer = mlx_load(str(models.build("smollm2-135m-f32", progress=False)))
    if dtype != "float32":
        model.set_dtype(getattr(mx, dtype))
    widen(model, size, intermediate_size=intermediate_size, layers=layers, seed=seed)
    return model, tokenizer


# -- on disk ------------------------------------------------------------------------


def build(
    size: Optional[Union[str, int]] = None,
    *,
    intermediate_size: Optional[int] = None,
    layers: int = 0,
    dtype: str = "bfloat16",
    seed: int = 0,
    cache_dir: Optional[Union[str, os.PathLike]] = None,
    progress: bool = True,
    verify: bool = False,
    shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Return the path of a ready mlx-lm folder for the stand-in, building it once.

    Cached next to the base models (``models.models_dir``) under a name that
    says the request, e.g. ``smollm2-standin-10b-bf16``. A cached folder is
    checked for its file set and sizes and for the request its config
    records; with ``verify`` also every file's sha256 (about a minute for
    10B). The build streams shards of ``shard_bytes`` and shows a tqdm bar
    on stderr unless ``progress`` is false.
    """
    source = gguf_path()
    tensors, meta = read_gguf(source)
    name, config = request(
        size, intermediate_size=intermediate_size, layers=layers, dtype=dtype, seed=seed, meta=meta
    )

    def write(folder):
        _write_folder(folder, name, source, (tensors, meta), config, seed, progress, shard_bytes)

    def same_request(folder):
        try:
            recorded = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            return f"unreadable config.json ({e.__class__.__name__})"
        keys = ("intermediate_size", "num_hidden_layers", "torch_dtype", RECORD)
        if any(recorded.get(k) != config[k] for k in keys):
            return "config.json records another stand-in"
        return None

    return models.build_cached(name, source, write, cache_dir, verify, same_request)


def request(
    size: Optional[Union[str, int]] = None,
    *,
    intermediate_size: Optional[int] = None,
    layers: int = 0,
    dtype: str = "bfloat16",
    seed: int = 0,
    meta: Optional[Dict[str, Any]] = None,
) -> Tuple[str, Dict[str, Any]]:
    """``(folder name, config.json)`` of the stand-in ``build`` makes for these arguments.

    Raises ``ModelError`` for bad input (size, layers, dtype, seed). ``meta``
    is the base GGUF's metadata, read from the offline package when ``None``.
    """
    _check_dtype(dtype)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ModelError(f"bad seed {seed!r}: give an integer >= 0")
    if meta is None:
        meta = read_gguf(gguf_path())[1]
    config = plan(
        models.model_config(meta), size, intermediate_size=intermediate_size, layers=layers
    )
    tag = size_tag(parse_size(size)) if intermediate_size is None else f"w{intermediate_size}"
    name = f"{NAME}-{tag}" + (f"-l{layers}" if layers else "") + f"-{DTYPES[dtype]}"
    name += f"-s{seed}" if seed else ""
    record = {
        "format": FORMAT,
        "base": "smollm2-135m-f32",
        "added_layers": layers,
        "seed": seed,
        "parameters": param_count(config),
    }
    config.update({"torch_dtype": dtype, RECORD: record})
    return name, config


def _write_folder(folder, name, source, gguf, config, seed, progress, shard_bytes):
    import mlx.core as mx
    from mlx_lm.utils import save_config
    from tqdm import tqdm

    tensors, meta = gguf
    base, _ = models.convert_weights(tensors, meta, "float32")
    shapes = tensor_shapes(base, config)
    dtype = getattr(mx, config["torch_dtype"])
    shards = _shards(shapes, dtype.size, shard_bytes)
    files = [
        "model.safetensors"
        if len(shards) == 1
        else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        for i in range(1, len(shards) + 1)
    ]
    total = sum(math.prod(s) for s in shapes.values()) * dtype.size
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=f"building {name}",
        file=sys.stderr,
        disable=not progress,
    )
    weight_map = {}
    with bar:
        for fname, names in zip(files, shards, strict=True):
            arrays = {}
            for n in names:
                arrays[n] = make_tensor(n, shapes[n], base.get(n), seed, dtype)
                mx.eval(arrays[n])
                bar.update(arrays[n].nbytes)
            mx.save_safetensors(str(folder / fname), arrays, metadata={"format": "mlx"})
            weight_map.update(dict.fromkeys(names, fname))
            del arrays
    index = {
        "metadata": {"total_size": total, "total_parameters": config[RECORD]["parameters"]},
        "weight_map": dict(sorted(weight_map.items())),
    }
    models._write_json(folder / "model.safetensors.index.json", index)
    save_config(dict(config), config_path=folder / "config.json")
    save_tokenizer(folder, meta)
    models._write_manifest(folder, name, source)


def _check_dtype(dtype):
    if dtype not in DTYPES:
        raise ModelError(f"bad dtype {dtype!r}: one of {', '.join(DTYPES)}")
