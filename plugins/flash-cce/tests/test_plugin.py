"""The mlx-lm-ext hooks: flags, validation, make_loss, doctor."""

import argparse

import mlx.core as mx
import pytest

from mlx_lm_ext import PluginError
from mlx_lm_flash_cce import plugin


def _parse(*argv):
    parser = argparse.ArgumentParser()
    group = parser.add_argument_group("flash-cce")
    plugin.add_arguments("lora", group)
    return parser.parse_args(list(argv))


def test_commands_and_flags_default_to_none():
    assert plugin.commands() == ["lora"]
    args = _parse()
    flags = {k: v for k, v in vars(args).items() if k.startswith("cce_")}
    assert flags and all(v is None for v in flags.values())  # lora's YAML merge fills None only
    parser = argparse.ArgumentParser()
    plugin.add_arguments("generate", parser.add_argument_group("x"))
    assert not [a for a in parser._actions if a.dest.startswith("cce_")]


def test_options_apply_defaults_and_flags():
    opts = plugin.options_from(_parse())
    assert opts == {
        "impl": "auto",
        "backend": "auto",
        "token_chunk": 256,
        "vocab_chunk": 0,
        "filter_eps": None,
        "block_skip_eps": None,
        "min_flash_elements": None,
        "check": True,
        "memory_budget": None,
    }
    opts = plugin.options_from(
        _parse("--cce-token-chunk", "256", "--cce-filter-eps", "1e-5", "--cce-no-check")
    )
    assert opts["token_chunk"] == 256 and opts["filter_eps"] == 1e-5 and opts["check"] is False


@pytest.mark.parametrize(
    "argv,message",
    [
        (("--cce-token-chunk", "0"), "positive integer"),
        (("--cce-vocab-chunk", "-5"), "positive integer"),
        (("--cce-filter-eps", "2"), "between 0 and 1"),
        (("--cce-backend", "metal-fused"), "not available"),
        (("--cce-memory-budget", "lots"), "not a memory size"),
        (("--cce-memory-budget", "100K"), "below what any flash-cce path needs"),
    ],
)
def test_bad_flags_are_plugin_errors(argv, message):
    with pytest.raises(PluginError, match=message):
        plugin.activate("lora", _parse(*argv))


def test_yaml_values_are_validated_too():
    # A YAML config can put any value into args: activate must still check it.
    with pytest.raises(PluginError, match="--cce-impl"):
        plugin.activate("lora", argparse.Namespace(cce_impl="fast"))


def test_make_loss_only_for_its_name(tiny_model):
    from mlx_lm import load
    from mlx_lm.tuner.trainer import default_loss

    model, _ = load(str(tiny_model("llama")))
    opts = plugin.activate("lora", _parse("--cce-impl", "flash"))
    try:
        assert plugin.make_loss("other-loss", model, None, opts) is None
        loss = plugin.make_loss("flash-cce", model, None, opts)
        assert loss.flash and loss.arch == "llama"
        batch = mx.random.randint(0, 49152, (2, 9), key=mx.random.key(0))
        lengths = mx.array([[0, 8], [0, 5]])
        value, ntoks = loss(model, batch, lengths)
        want, want_ntoks = default_loss(model, batch, lengths)
        assert ntoks.item() == want_ntoks.item() == 13
        assert abs(value.item() - want.item()) <= 1e-5 * want.item()
    finally:
        plugin.deactivate()


def test_doctor_reports_backend_and_probe():
    lines = dict(plugin.doctor())
    from mlx_lm_flash_cce import cuda

    # the flash paths this machine runs: the CUDA ones only on a CUDA GPU
    on_gpu = "mlx, mlx-blocks, cuda-gemm, cuda"
    assert lines["backends"] == (on_gpu if cuda.available() else "mlx, mlx-blocks")
    assert lines["quantized_matmul M=2,3"].startswith("ok on")
