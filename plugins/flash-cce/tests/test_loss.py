"""make_loss: default_loss's value, mask and gradients; registry; self-check; trainer."""

import logging

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from cce_helpers import max_abs
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.tuner.callbacks import TrainingCallback
from mlx_lm.tuner.trainer import TrainingArgs, default_loss, evaluate, train
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import _get_classes

from mlx_lm_ext.testing import TINY_VARIANTS
from mlx_lm_flash_cce import loss as cce_loss
from mlx_lm_flash_cce import make_loss

FLASH = dict(impl="flash", token_chunk=32, vocab_chunk=4096, verbose=False)

_BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    vocab_size=1000,
    rope_theta=10000.0,
)
# Architectures beyond the tiny fixtures, built in memory from configs.
EXTRA = {
    "gemma2": dict(
        model_type="gemma2",
        **_BASE,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=3.0,
    ),
    "cohere": dict(
        model_type="cohere",
        **{k: v for k, v in _BASE.items() if k not in ("head_dim", "rms_norm_eps")},
        layer_norm_eps=1e-5,
        logit_scale=0.5,
    ),
    "granite": dict(
        model_type="granite",
        **_BASE,
        logits_scaling=4.0,
        embedding_multiplier=12.0,
        attention_multiplier=0.25,
        residual_multiplier=0.22,
        max_position_embeddings=2048,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(model_type="qwen2", **_BASE, tie_word_embeddings=False),
    "mistral": dict(model_type="mistral", **_BASE, tie_word_embeddings=False),
}


def _extra_model(name):
    config = EXTRA[name]
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    return model


def _batch(vocab, seed=0):
    batch = mx.random.randint(0, vocab, (3, 41), key=mx.random.key(seed))
    # offset (prompt length) and length per row; row 1 ends early, row 2 masks a prompt
    lengths = mx.array([[0, 40], [0, 17], [9, 33]])
    return batch, lengths


def _compare(model, vocab, **options):
    loss = make_loss(model, **FLASH, **options)
    assert loss.flash, loss.check
    batch, lengths = _batch(vocab)
    model.train()
    (l1, n1), g1 = nn.value_and_grad(model, loss)(model, batch, lengths)
    (l2, n2), g2 = nn.value_and_grad(model, default_loss)(model, batch, lengths)
    assert n1.item() == n2.item()
    assert abs(l1.item() - l2.item()) <= 1e-5 * abs(l2.item())
    g1, g2 = dict(tree_flatten(g1)), dict(tree_flatten(g2))
    assert g1.keys() == g2.keys()
    scale = max(mx.abs(v).max().item() for v in g2.values())
    worst = max(max_abs(g1[k], g2[k]) for k in g2)
    assert worst <= 1e-5 * scale
    return loss


@pytest.mark.parametrize("arch,quantized,tied", TINY_VARIANTS)
def test_tiny_models_match_default_loss(tiny_model, arch, quantized, tied):
    model, _ = load(str(tiny_model(arch, quantized=quantized, tied=tied)))
    loss = _compare(model, 49152)
    assert loss.arch == arch


@pytest.mark.parametrize("name", sorted(EXTRA))
def test_registry_architectures_match_default_loss(name):
    model = _extra_model(name)
    loss = _compare(model, EXTRA[name]["vocab_size"])
    assert loss.arch == ("llama" if name == "mistral" else name)


def test_registry_transforms_are_real():
    """Dropping gemma2's soft cap or cohere's scale must fail the self-check."""
    for name in ("gemma2", "cohere", "granite"):
        model = _extra_model(name)
        arch = cce_loss.ARCHS[name]
        ok, err, _ = cce_loss.self_check(model, arch, {})
        assert ok and err < 1e-4
        bare = arch._replace(softcap=lambda m: None, logit_scale=lambda m: None)
        ok, err, _ = cce_loss.self_check(model, bare, {})
        assert not ok, name


def test_mask_matches_default_loss_exactly():
    """default_loss counts one pad target after each sequence: so must we."""
    model = _extra_model("qwen2")
    loss = make_loss(model, **FLASH)
    batch, lengths = _batch(1000, seed=3)
    per_row = []
    for fn in (loss, default_loss):
        per_row.append(
            [fn(model, batch[i : i + 1], lengths[i : i + 1])[1].item() for i in range(3)]
        )
    assert per_row[0] == per_row[1] == [40, 17, 25]


def test_mismatch_falls_back_to_stock_loss_with_warning(caplog, monkeypatch):
    model = _extra_model("qwen2")
    wrong = cce_loss.ARCHS["qwen2"]._replace(softcap=lambda m: 2.0)
    monkeypatch.setitem(cce_loss.ARCHS, "qwen2", wrong)
    with caplog.at_level(logging.WARNING, logger="mlx_lm_flash_cce"):
        loss = make_loss(model, **FLASH)
    assert loss.flash is False
    assert "stock loss" in caplog.text
    batch, lengths = _batch(1000)
    assert loss(model, batch, lengths)[0].item() == default_loss(model, batch, lengths)[0].item()


# (device the report sees, options, the blocks that path runs 9000 tokens x 40000 vocab in)
REPORTED_BLOCKS = [
    (mx.cpu, {"backend": "mlx"}, "works in [256, 1024] float32 blocks (1.0 MiB each)"),
    # The pure-MLX path picks its blocks the same way on a GPU (mlx-blocks runs big ones).
    (mx.gpu, {"backend": "mlx"}, "works in [256, 1024] float32 blocks (1.0 MiB each)"),
    (mx.cpu, {"backend": "mlx-blocks"}, "runs one pass in [8192, 32768] blocks (mlx-blocks"),
    (mx.gpu, {"backend": "mlx-blocks"}, "runs one pass in [8192, 32768] blocks (mlx-blocks"),
    (
        mx.cpu,
        {"backend": "mlx-blocks", "token_chunk": 512, "vocab_chunk": 4096},
        "runs one pass in [512, 4096] blocks (mlx-blocks",
    ),
    (mx.cpu, {"impl": "chunked"}, "runs its 'chunked' path"),
]


@pytest.mark.parametrize("device,options,says", REPORTED_BLOCKS)
def test_batch_report_states_the_blocks_the_path_runs(caplog, monkeypatch, device, options, says):
    # The report only reads the device: no array is computed while it is faked.
    monkeypatch.setattr(mx, "default_device", lambda: device)
    hidden = mx.zeros((1, 9000, 16))
    head = nn.Linear(16, 40000, bias=False)
    with caplog.at_level(logging.INFO, logger="mlx_lm_flash_cce"):
        cce_loss._report("llama", hidden, head, mx.zeros((1, 9000), dtype=mx.int32), options)
    assert "batch of 9000 tokens x 40000 vocab" in caplog.text
    assert says in caplog.text, caplog.text


def test_unknown_architecture_uses_generic_rule(monkeypatch):
    model = _extra_model("qwen2")
    monkeypatch.delitem(cce_loss.ARCHS, "qwen2")
    loss = _compare(model, 1000)
    assert loss.arch == "generic"


def test_lora_on_lm_head_gets_head_gradients():
    """lora_parameters keys can name lm_head: its LoRA factors train through flash-cce."""
    model = _extra_model("qwen2")
    model.freeze()
    linear_to_lora_layers(
        model, 1, {"rank": 4, "scale": 2.0, "dropout": 0.0, "keys": ["lm_head", "self_attn.q_proj"]}
    )
    model.lm_head.lora_b = 0.05 * mx.random.normal(model.lm_head.lora_b.shape, key=mx.random.key(1))
    loss = _compare(model, 1000)
    _, grads = nn.value_and_grad(model, loss)(model, *_batch(1000))
    names = dict(tree_flatten(grads))
    assert "lm_head.lora_a" in names and "lm_head.lora_b" in names


class _Record(TrainingCallback):
    def __init__(self):
        self.train, self.val = [], []

    def on_train_loss_report(self, info):
        self.train.append(info["train_loss"])

    def on_val_loss_report(self, info):
        self.val.append(info["val_loss"])


def _train(model_path, loss_fn_for, adapter_file, iters=4):
    np.random.seed(0)  # iterate_batches shuffles with numpy's global RNG
    mx.random.seed(0)  # LoRA init
    model, _ = load(model_path)
    model.freeze()
    linear_to_lora_layers(model, 2, {"rank": 4, "scale": 10.0, "dropout": 0.0})
    data = [
        (mx.random.randint(3, 49152, (n,), key=mx.random.key(n)).tolist(), 0)
        for n in (20, 31, 45, 12, 38, 27)
    ]
    record = _Record()
    args = TrainingArgs(
        batch_size=2,
        iters=iters,
        val_batches=2,
        steps_per_report=1,
        steps_per_eval=iters,
        max_seq_length=64,
        adapter_file=str(adapter_file),
        steps_per_save=10**9,
    )
    opt = optim.Adam(learning_rate=1e-3)
    train(model, opt, data, data[:4], args=args, loss=loss_fn_for(model), training_callback=record)
    return record, evaluate(model, data[:4], batch_size=2, num_batches=2, loss=loss_fn_for(model))


def test_trainer_compiled_step_matches_default_loss(tiny_model, tmp_path):
    """mlx-lm's own train() (compiled step) and evaluate() with make_loss."""
    path = str(tiny_model("llama", quantized=True, tied=True))
    ours = _train(path, lambda m: make_loss(m, **FLASH), tmp_path / "ours.safetensors")
    stock = _train(path, lambda m: default_loss, tmp_path / "stock.safetensors")
    (rec1, final1), (rec2, final2) = ours, stock
    assert len(rec1.train) == 4 and len(rec1.val) == 2
    for a, b in zip(
        rec1.train + rec1.val + [final1], rec2.train + rec2.val + [final2], strict=False
    ):
        assert abs(a - b) <= 1e-4 * abs(b)
