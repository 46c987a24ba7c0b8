"""The memory-bound stand-in: SmolLM2 made larger without changing what it predicts.

Fast tests use the tiny random-weight models and the GGUF's metadata; the
tests that build or run the real stand-in are marked slow (float32, CPU,
a few hundred MB).
"""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import generate, load

from mlx_lm_ext import gguf, models, standin

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


def _n_params(model):
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def _greedy(model, tokenizer, question, max_tokens=16):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True
    )
    return generate(model, tokenizer, prompt=prompt, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def base_config():
    return models.model_config(gguf.read_gguf(gguf.gguf_path())[1])


# -- sizes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,count",
    [
        ("500M", 500 * 10**6),
        ("1B", 10**9),
        ("3b", 3 * 10**9),
        ("1.5B", 15 * 10**8),
        ("10B", 10**10),
    ],
)
def test_parse_size(text, count):
    assert standin.parse_size(text) == count


@pytest.mark.parametrize("text", ["", "ten", "1X", "-1B", "0B", "1e9", "B", "1 B B"])
def test_bad_size_is_a_clear_error(text):
    with pytest.raises(models.ModelError, match="bad size .* such as 500M, 1B"):
        standin.parse_size(text)


@pytest.mark.parametrize("size", ["500M", "1B", "3B", "10B"])
@pytest.mark.parametrize("layers", [0, 4])
def test_plan_hits_the_size(base_config, size, layers):
    # The width is a multiple of 64 solved for the size: within 0.5% of it.
    config = standin.plan(base_config, size, layers=layers)
    assert config["num_hidden_layers"] == base_config["num_hidden_layers"] + layers
    assert config["intermediate_size"] % standin.WIDTH_MULTIPLE == 0
    assert config["intermediate_size"] > base_config["intermediate_size"]
    target = standin.parse_size(size)
    assert abs(standin.param_count(config) - target) <= 0.005 * target
    # Unchanged: what the model predicts depends on these.
    for key in ("hidden_size", "num_attention_heads", "vocab_size", "rope_theta"):
        assert config[key] == base_config[key]


def test_plan_rejects_sizes_below_the_base(base_config):
    assert standin.param_count(base_config) == 134_515_008  # SmolLM2-135M
    with pytest.raises(models.ModelError, match=r"below the base model \(134.5M parameters\)"):
        standin.plan(base_config, "100M")
    with pytest.raises(models.ModelError, match="with 30 added layers"):
        standin.plan(base_config, "200M", layers=30)
    with pytest.raises(models.ModelError, match="added layers"):
        standin.plan(base_config, "1B", layers=-1)
    with pytest.raises(models.ModelError, match="intermediate size"):
        standin.plan(base_config, intermediate_size=100)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "mlx_lm_ext", "model", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["smollm2-standin", "--size", "1X"], "bad size '1X'"),
        (["smollm2-standin"], "needs --size"),
        (["smollm2-standin", "--size", "50M"], "below the base model"),
        (["smollm2-standin", "--size", "1B", "--seed", "-1"], "bad seed"),
        (["smollm2-135m-f32", "--size", "1B"], "--size: only for smollm2-standin"),
    ],
)
def test_cli_bad_input_exits_2(args, message, tmp_path):
    r = _cli(*args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""


def test_cli_lists_the_standin():
    r = _cli("--list")
    assert r.returncode == 0 and "smollm2-standin" in r.stdout.split()


# -- in memory, tiny models ----------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_widen_keeps_a_tiny_models_predictions(tiny_model, arch):
    path = tiny_model(arch)
    base, tokenizer = load(str(path))
    wide, _ = load(str(path))
    width = base.args.intermediate_size
    standin.widen(wide, intermediate_size=2 * width, layers=2)
    assert len(wide.layers) == len(base.layers) + 2
    assert wide.layers[0].mlp.gate_proj.weight.shape[0] == 2 * width
    if arch == "llama":  # param_count is llama's (qwen3 adds q/k norms)
        assert _n_params(wide) == standin.param_count(
            standin.plan(vars(base.args), intermediate_size=2 * width, layers=2)
        )
    tokens = mx.array(tokenizer.encode("The quick brown fox jumps over the lazy dog."))[None]
    assert mx.allclose(base(tokens), wide(tokens), atol=1e-5).item()
    assert _greedy(base, tokenizer, PROMPTS[0]) == _greedy(wide, tokenizer, PROMPTS[0])


def test_widen_rejects_quantized_models(tiny_model):
    model, _ = load(str(tiny_model("llama", quantized=True)))
    with pytest.raises(models.ModelError, match="float weights"):
        standin.widen(model, intermediate_size=1024)


# -- the real stand-in (slow) -----------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A float32 stand-in on disk (MLP width 2048, 2 added layers, 170M parameters), in shards."""
    root = tmp_path_factory.mktemp("standin-cache")
    path = standin.build(
        intermediate_size=2048,
        layers=2,
        dtype="float32",
        cache_dir=root,
        progress=False,
        shard_bytes=200 << 20,
    )
    return root, path


@pytest.mark.slow
def test_standin_predicts_what_smollm2_does(built, smollm2_f32_path):
    _, path = built
    config = json.loads((path / "config.json").read_text())
    assert config["intermediate_size"] == 2048 and config["num_hidden_layers"] == 32
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 4  # sharded
    wide, tokenizer = load(str(path))
    assert _n_params(wide) == config[standin.RECORD]["parameters"] == 169_906_752
    base, _ = load(str(smollm2_f32_path))
    for question in PROMPTS:
        assert _greedy(wide, tokenizer, question) == _greedy(base, tokenizer, question)


@pytest.mark.slow
def test_standin_is_deterministic_and_cached(built, tmp_path):
    root, path = built
    manifest = json.loads((path / "manifest.json").read_text())
    stamp = (path / "config.json").stat().st_mtime_ns
    assert standin.build(intermediate_size=2048, layers=2, dtype="float32", cache_dir=root) == path
    assert (path / "config.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    # A second build elsewhere writes the same bytes.
    again = standin.build(
        intermediate_size=2048,
        layers=2,
        dtype="float32",
        cache_dir=tmp_path,
        progress=False,
        shard_bytes=200 << 20,
    )
    assert json.loads((again / "manifest.json").read_text())["files"] == manifest["files"]
    # In memory: the same tensors as on disk for the same seed, others for another.
    on_disk = dict(tree_flatten(load(str(path))[0].parameters()))
    memory, _ = standin.load(intermediate_size=2048, layers=2)
    other, _ = standin.load(intermediate_size=2048, layers=2, seed=1)
    memory, other = dict(tree_flatten(memory.parameters())), dict(tree_flatten(other.parameters()))
    for name in ("model.layers.7.mlp.gate_proj.weight", "model.layers.31.self_attn.q_proj.weight"):
        assert np.array(memory[name]).tobytes() == np.array(on_disk[name]).tobytes()
        assert not mx.array_equal(memory[name], other[name]).item()
    assert mx.array_equal(
        memory["model.layers.7.mlp.gate_proj.weight"][:1536],
        other["model.layers.7.mlp.gate_proj.weight"][:1536],
    ).item()
    assert not mx.any(memory["model.layers.7.mlp.down_proj.weight"][:, 1536:]).item()


@pytest.mark.slow
def test_in_memory_standin_has_the_requested_size(base_config):
    model, _ = standin.load("250M", layers=1)
    assert len(model.layers) == 31
    count = _n_params(model)
    assert count == standin.param_count(standin.plan(base_config, "250M", layers=1))
    assert abs(count - 250e6) <= 0.005 * 250e6
