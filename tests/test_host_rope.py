"""host.override_rope: each attention module's rotary embedding is swapped
for the length of a block, through the ledger, and put back after it."""

import mlx.core as mx
from mlx_lm import load

from mlx_lm_ext import host, patching


def test_override_rope_swaps_and_restores(tiny_model):
    model, _ = load(str(tiny_model("llama")))
    x = mx.array([[1, 2, 3, 4]])
    before = model(x)
    mods = host.rope_modules(model)
    assert len(mods) == len(model.layers)
    originals = [m["rope"] for m in mods]
    calls = []

    def make(orig):
        def shifted(v, offset=0):
            calls.append(offset)
            return orig(v[..., ::-1, :], offset=offset)[..., ::-1, :]  # positions reversed

        return shifted

    with host.override_rope(mods, make):
        assert any(p.owner == "rope" for p in patching.patches())
        during = model(x)
    assert len(calls) == 2 * len(mods)  # queries and keys of every layer
    assert not mx.allclose(during, before, atol=1e-4).item()  # the swapped rope ran
    assert [m["rope"] for m in mods] == originals
    assert not any(p.owner == "rope" for p in patching.patches())
    assert mx.allclose(model(x), before).item()
