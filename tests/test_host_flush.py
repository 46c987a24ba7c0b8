"""host.flush_layers: a forward's layers start evaluating in stages; the
result is the same forward, and the model's layers come back after the block."""

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlx_lm_ext import host, patching


def test_flush_layers_stages_the_forward_and_restores(tiny_model, monkeypatch):
    model, _ = load(str(tiny_model("llama", num_hidden_layers=4)))
    x = mx.array([[1, 2, 3, 4, 5]])
    before = model(x, cache=make_prompt_cache(model))
    layers = list(model.layers)
    flushed = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: flushed.append(a) or real(*a))
    with host.flush_layers(model, 2):
        assert any(p.owner == "flush" for p in patching.patches())
        during = model(x, cache=make_prompt_cache(model))
    # Layers 2 of 4 flushes (the last layer's output is the caller's to evaluate).
    assert len(flushed) == 1
    assert mx.array_equal(during, before).item()
    assert list(model.layers) == layers
    assert not any(p.owner == "flush" for p in patching.patches())


def test_flush_layers_of_zero_changes_nothing(tiny_model):
    model, _ = load(str(tiny_model("llama")))
    layers = list(model.layers)
    with host.flush_layers(model, 0):
        assert list(model.layers) == layers
