"""Preference training: the shared-prompt forward, the losses, the pair data."""

import json
import logging
import math
import re

import mlx.core as mx
import mlx.nn as nn
import pytest
from cce_helpers import near
from mlx.utils import tree_flatten, tree_map
from mlx_lm.utils import _get_classes

from mlx_lm_ext import PluginError, backbone
from mlx_lm_ext.testing import tiny_config
from mlx_lm_flash_cce import objectives, pairs, preference, shared_prompt

VOCAB = 512
# The tiny llama's shape, for the architectures mlx_lm_ext.testing has none of.
_BASE = {
    k: v
    for k, v in tiny_config("llama", vocab_size=VOCAB, max_position_embeddings=512).items()
    if k != "model_type"
}
# Every architecture flash-cce's registry names (mlx_lm_ext.backbone.ARCHS).
CONFIGS = {
    "llama": tiny_config("llama", vocab_size=VOCAB),
    "qwen2": {"model_type": "qwen2", **_BASE},
    "qwen3": tiny_config("qwen3", vocab_size=VOCAB),
    "phi3": tiny_config("phi3", vocab_size=VOCAB),
    # sliding window 8: the probe and the batch below are longer than that
    "gemma3_text": tiny_config("gemma3_text", vocab_size=VOCAB),
    "gemma2": {
        "model_type": "gemma2",
        **_BASE,
        "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "gpt2": tiny_config("gpt2", vocab_size=VOCAB),
    "cohere": {
        "model_type": "cohere",
        **_BASE,
        "layer_norm_eps": 1e-5,
        "logit_scale": 0.5,
        "use_qk_norm": False,
    },
    "granite": {
        "model_type": "granite",
        **_BASE,
        "logits_scaling": 4.0,
        "attention_multiplier": 0.25,
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_bias": False,
        "mlp_bias": False,
    },
}
# gemma2's own attention reshapes queries per KV group, which a per-row mask
# [B, 1, N, K] does not broadcast against: it runs unshared (logged).
UNSHARED = {"gemma2"}


def _model(arch, quantized=False, **overrides):
    config = dict(CONFIGS[arch], **overrides)
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    if arch == "gemma3_text":
        model.sanitize({})  # tie the head as mlx-lm does for a checkpoint without lm_head
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def _batch(b_prompts=(9, 4), r_lens=(6, 3, 2, 7)):
    """Pairs of different prompt and response lengths, right-padded."""
    key = mx.random.key(3)
    k1, k2 = mx.random.split(key)
    p, r = max(b_prompts), max(r_lens)
    prompts = mx.random.randint(1, VOCAB, (len(b_prompts), p), key=k1)
    responses = mx.random.randint(1, VOCAB, (len(r_lens), r), key=k2)
    plens, rlens = mx.array(b_prompts), mx.array(r_lens)
    # padding holds other tokens than the real ones: it must not matter
    prompts = mx.where(mx.arange(p)[None] < plens[:, None], prompts, 0)
    responses = mx.where(mx.arange(r)[None] < rlens[:, None], responses, 0)
    return prompts, plens, responses, rlens


def _seq_logps(hidden_of, arch_):
    def f(model, prompts, plens, responses, rlens):
        hidden = hidden_of(model, arch_, prompts, plens, responses)
        from mlx_lm_flash_cce import api

        ce = api.linear_cross_entropy(
            hidden,
            arch_.head(model),
            responses,
            softcap=arch_.softcap(model),
            logit_scale=arch_.logit_scale(model),
            reduction="none",
            impl="flash",
            backend="mlx",
        )
        return preference.sequence_logps(-ce, rlens)

    return f


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_shared_prompt_equals_two_full_sequences(arch):
    """Log-probs and every gradient: prompt once == prompt per response == the model's logits."""
    model = _model(arch)
    _, arch_ = backbone.resolve(model)
    ok, why = shared_prompt.check(model, arch_, VOCAB)
    assert ok == (arch not in UNSHARED), why
    batch = _batch()
    model.train()
    results = {}
    for name, hidden_of in (
        ("shared", shared_prompt.shared_hidden),
        ("unshared", shared_prompt.unshared_hidden),
    ):
        f = _seq_logps(hidden_of, arch_)

        def objective(model, *batch, f=f):
            seq = f(model, *batch)
            return (seq * mx.array([1.0, -0.5, 0.3, 2.0])).sum()  # every row counts

        if name == "shared" and not ok:
            with pytest.raises(ValueError):
                mx.eval(nn.value_and_grad(model, objective)(model, *batch))
            continue
        value, grads = nn.value_and_grad(model, objective)(model, *batch)
        results[name] = (f(model, *batch), dict(tree_flatten(grads)))
    want = shared_prompt.stock_logps(model, *batch[:3])
    mask = mx.arange(want.shape[1])[None] < batch[3][:, None]
    stock = (want * mask).sum(axis=1)
    seq_u, grads_u = results["unshared"]
    assert near(seq_u, stock, 1e-5)
    if ok:
        seq_s, grads_s = results["shared"]
        assert near(seq_s, seq_u, 1e-5)
        assert grads_s.keys() == grads_u.keys()
        for key in grads_u:
            assert near(grads_s[key], grads_u[key], 1e-4), key


def test_quantized_head_and_two_rows():
    """A 4-bit model (quantized head) with one pair of one-token responses:
    2 rows for the head's quantized matmul, the case flash-cce pads."""
    model = _model("llama", quantized=True)
    model.eval()
    prompts, plens, responses, rlens = _batch(b_prompts=(5,), r_lens=(1, 1))
    token_logps = preference.make_token_logps(model, backend="mlx")
    assert token_logps.shared and token_logps.flash
    got = token_logps(model, prompts, plens, responses)
    want = shared_prompt.stock_logps(model, prompts, plens, responses)
    assert got.shape == (2, 1)
    assert near(got, want, 1e-4)


def test_fallback_is_exact_where_the_prompt_cannot_be_shared(caplog):
    model = _model("gemma2")
    with caplog.at_level(logging.INFO, logger="mlx_lm_flash_cce"):
        token_logps = preference.make_token_logps(model, backend="mlx")
    assert not token_logps.shared
    assert "cannot share the prompt" in caplog.text
    batch = _batch()
    got = preference.sequence_logps(token_logps(model, *batch[:3]), batch[3])
    want = preference.sequence_logps(shared_prompt.stock_logps(model, *batch[:3]), batch[3])
    assert near(got, want, 1e-5)


def test_grad_checkpoint_runs_unshared_with_exact_gradients():
    """mlx-lm's --grad-checkpoint recomputes each layer: the prompt's keys would
    reach the responses without their gradient, so pairs run unshared."""
    from mlx_lm.tuner import trainer

    model = _model("qwen3")
    batch = _batch() + (mx.zeros((2, 2)),)
    model.train()

    def grads(loss):
        f = lambda m, *b: loss(m, *b)[0]  # noqa: E731
        return dict(tree_flatten(nn.value_and_grad(model, f)(model, *batch)[1]))

    want = grads(preference.make_loss(model, "orpo", backend="mlx"))
    loss = preference.make_loss(model, "orpo", backend="mlx", share_prompt=False)
    assert not loss.shared
    cls = type(model.layers[0])
    original = cls.__call__
    try:
        trainer.grad_checkpoint(model.layers[0])  # patches the class, as mlx-lm does
        got = grads(loss)
    finally:
        cls.__call__ = original
    for key in want:
        assert near(got[key], want[key], 1e-4), key


# ------------------------------------------------------------------ losses


def _log_sigmoid(x):
    return -math.log1p(math.exp(-x))


def test_orpo_against_its_formula():
    chosen, rejected = [-0.4, -1.7, -2.5], [-0.9, -1.2, -3.0]  # mean per-token log-probs
    nll, beta = 1.3, 0.25
    loss, cr, rr = preference.orpo(mx.array(chosen), mx.array(rejected), mx.array(nll), beta)
    terms = []
    for c, r in zip(chosen, rejected, strict=True):
        log_odds = (c - r) - (math.log(1 - math.exp(c)) - math.log(1 - math.exp(r)))
        terms.append(_log_sigmoid(log_odds))
    assert loss.item() == pytest.approx(nll - beta * sum(terms) / 3, rel=1e-5)
    assert cr.tolist() == pytest.approx([beta * c for c in chosen], rel=1e-6)
    assert rr.tolist() == pytest.approx([beta * r for r in rejected], rel=1e-6)
    # near 0 (a response of probability ~1) the odds term stays finite
    assert math.isfinite(preference.log1m_exp(mx.array(-1e-9)).item())


def test_dpo_against_its_formula():
    chosen, rejected = [-10.0, -22.5, -7.0], [-12.0, -20.0, -7.5]  # summed log-probs
    ref_c, ref_r = [-11.0, -21.0, -7.2], [-11.5, -20.5, -7.1]
    beta = 0.1
    loss, cr, rr = preference.dpo(*(mx.array(x) for x in (chosen, rejected, ref_c, ref_r)), beta)
    margins = [
        (c - r) - (c0 - r0) for c, r, c0, r0 in zip(chosen, rejected, ref_c, ref_r, strict=True)
    ]
    assert loss.item() == pytest.approx(-sum(_log_sigmoid(beta * m) for m in margins) / 3)
    want_cr = [beta * (c - c0) for c, c0 in zip(chosen, ref_c, strict=True)]
    want_rr = [beta * (r - r0) for r, r0 in zip(rejected, ref_r, strict=True)]
    assert cr.tolist() == pytest.approx(want_cr, rel=1e-5)
    assert rr.tolist() == pytest.approx(want_rr, rel=1e-5)
    m = preference.metrics(cr, rr, mx.array(chosen), mx.array(rejected)).tolist()
    diffs = [a - b for a, b in zip(want_cr, want_rr, strict=True)]
    assert m[0] == pytest.approx(sum(diffs) / 3, rel=1e-5)
    assert m[1] == pytest.approx(sum(d > 0 for d in diffs) / 3)
    assert m[2:] == pytest.approx([sum(chosen) / 3, sum(rejected) / 3])


def test_dpo_reference_is_the_model_without_its_adapters():
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = _model("llama")
    batch = _batch()
    token_logps = preference.make_token_logps(model, backend="mlx")
    base = preference.sequence_logps(token_logps(model, *batch[:3]), batch[3])
    linear_to_lora_layers(model, 2, {"rank": 4, "dropout": 0.0, "scale": 10.0})
    wrapped = [m for _, m in model.named_modules() if "lora_b" in m]
    for m in wrapped:  # adapters that change the output
        m.lora_b = mx.full(m.lora_b.shape, 0.05)
    tuned = preference.sequence_logps(token_logps(model, *batch[:3]), batch[3])
    assert not near(tuned, base, 1e-3)
    with preference.adapters_off(model) as n:
        off = preference.sequence_logps(token_logps(model, *batch[:3]), batch[3])
    assert n == len(wrapped) > 0 and near(off, base, 1e-6)
    again = preference.sequence_logps(token_logps(model, *batch[:3]), batch[3])
    assert near(again, tuned, 1e-6)  # the adapters are back


# -------------------------------------------------------------------- data


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(smollm2_tokenizer_dir)


def _write(folder, name, rows):
    folder.mkdir(parents=True, exist_ok=True)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


def test_rows_strings_and_chat_messages(tokenizer, tmp_path):
    chat = {
        "prompt": [{"role": "user", "content": "Name a colour."}],
        "chosen": [{"role": "assistant", "content": "Blue."}],
        "rejected": "Seven.",
    }
    plain = {"prompt": "Name a colour:", "chosen": " Blue.", "rejected": " Seven."}
    prompt, chosen, rejected = pairs.render(chat, tokenizer)
    assert prompt == list(
        tokenizer.apply_chat_template(chat["prompt"], add_generation_prompt=True, return_dict=False)
    )
    full = tokenizer.apply_chat_template(chat["prompt"] + chat["chosen"], return_dict=False)
    assert prompt + chosen == list(full)
    assert tokenizer.decode(rejected).startswith("Seven.")
    prompt, chosen, rejected = pairs.render(plain, tokenizer)
    assert prompt == tokenizer.encode("Name a colour:")
    assert chosen[-1] == rejected[-1] == tokenizer.eos_token_id


@pytest.mark.parametrize(
    "row, message",
    [
        ({"text": "hello"}, r"train.jsonl line 2: not a preference row.*\['text'\]"),
        ({"prompt": "a", "chosen": "b"}, "train.jsonl line 2: not a preference row"),
        ({"prompt": "a", "chosen": ["b"], "rejected": "c"}, "line 2: with a string prompt"),
        ({"prompt": "a", "chosen": "", "rejected": "c"}, "line 2: 'chosen' is empty"),
        (
            "{not json",
            r"^train.jsonl line 2, column 2: not valid JSON \(Expecting property name "
            r"enclosed in double quotes\)$",
        ),
        (
            {"prompt": [{"role": "user", "content": 7}], "chosen": "a", "rejected": "b"},
            r"^train.jsonl line 2: 'prompt' message 1: 'content' must be a string \(got int\)$",
        ),
        (
            {
                "prompt": [{"role": "user", "content": "q"}],
                "chosen": [{"role": "assistant", "content": ["x"]}],
                "rejected": "b",
            },
            "line 2: 'chosen' message 1: 'content' must be a string",
        ),
        (
            {"prompt": "q", "chosen": "a", "rejected": "b", "system": "Be brief."},
            "line 2: a 'system' field needs a prompt of chat messages or --apply-chat-template",
        ),
    ],
)
def test_bad_rows_name_file_and_line(tokenizer, tmp_path, row, message):
    good = {"prompt": "p", "chosen": "c", "rejected": "r"}
    _write(tmp_path, "train", [good, row])
    with pytest.raises(PluginError, match=message):
        pairs.load_split(tmp_path / "train.jsonl", tokenizer, 64)


def test_long_rows_are_cut_or_dropped_and_said(tokenizer, tmp_path, caplog):
    long = " ".join(["word"] * 40)
    rows = [
        {"prompt": "short", "chosen": long, "rejected": "no"},  # response cut
        {"prompt": long, "chosen": "a", "rejected": "b"},  # prompt alone too long: dropped
        {"prompt": "short", "chosen": "a", "rejected": "b"},
    ]
    _write(tmp_path, "train", rows)
    with caplog.at_level(logging.WARNING, logger="mlx_lm_flash_cce"):
        data = pairs.load_split(tmp_path / "train.jsonl", tokenizer, 16)
    assert len(data) == 2
    assert "dropped 1 of 3 rows" in caplog.text and "cut the responses of 1 rows" in caplog.text
    assert all(len(p.prompt) + max(len(p.chosen), len(p.rejected)) <= 16 for p in data.pairs)
    assert data[0].prompt == tokenizer.encode("short")  # the prompt is never cut


def test_batches_by_pairs(tokenizer, tmp_path):
    rows = [{"prompt": "q" * (i + 1), "chosen": "yes", "rejected": "no no"} for i in range(5)]
    _write(tmp_path, "train", rows)
    data = pairs.load_split(tmp_path / "train.jsonl", tokenizer, 64)
    data.pairs[0].ref = (-1.5, -2.5)
    batches = list(pairs.iterate_batches(data, 2, 64, seed=0))
    assert len(batches) == 2  # 5 pairs, batches of 2, the rest left out as mlx-lm does
    for prompts, _, responses, rlens, refs in batches:
        # a pair without its reference log-probs in each: zeros and the pairs' indices
        assert refs.tolist() == [[0.0, 0.0, -1.0]] * 2
        assert prompts.shape[0] == 2 and responses.shape[0] == 4
        assert prompts.shape[1] == pairs.padded(prompts.shape[1]) and responses.shape[1] % 8 == 0
        for i in range(2):
            assert rlens[i].item() < rlens[2 + i].item()  # chosen rows, then rejected rows
    for i, p in enumerate(data.pairs):
        p.ref = (-1.0 - i, -2.0 - i)
    for batch in pairs.iterate_batches(data, 2, 64, seed=0):  # all known: [B, 2]
        assert batch[4].shape == (2, 2) and batch[4][0, 1].item() == batch[4][0, 0].item() - 1
    with pytest.raises(ValueError, match="at least batch_size=8"):
        next(pairs.iterate_batches(data, 8, 64))


def test_row_that_is_not_utf8_names_file_line_and_column(tokenizer, tmp_path):
    good = json.dumps({"prompt": "p", "chosen": "c", "rejected": "r"}).encode()
    bad = b'{"prompt": "caf\xe9", "chosen": "c", "rejected": "r"}'
    (tmp_path / "train.jsonl").write_bytes(good + b"\n" + bad + b"\n")
    with pytest.raises(PluginError, match=r"^train.jsonl line 2, column 16: not UTF-8 text"):
        pairs.load_split(tmp_path / "train.jsonl", tokenizer, 64)


def test_chat_template_failure_names_file_and_line(smollm2_tokenizer_dir, tmp_path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(smollm2_tokenizer_dir)  # its own copy: the template changes
    tok._tokenizer.chat_template = "{{ raise_exception('this template takes no system') }}"
    row = {"prompt": [{"role": "system", "content": "s"}], "chosen": "a", "rejected": "b"}
    _write(tmp_path, "train", [row])
    with pytest.raises(
        PluginError,
        match=r"^train.jsonl line 1: the chat template fails on "
        r"this row \(TemplateError: this template takes no system\)$",
    ):
        pairs.load_split(tmp_path / "train.jsonl", tok, 64)


def test_system_field_and_string_prompt_with_the_chat_template(tokenizer):
    row = {
        "prompt": "Name a colour.",
        "chosen": "Blue.",
        "rejected": "Seven.",
        "system": "Be brief.",
    }
    as_messages = {
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour."},
        ],
        "chosen": [{"role": "assistant", "content": "Blue."}],
        "rejected": [{"role": "assistant", "content": "Seven."}],
    }
    got = pairs.render(row, tokenizer, chat_template=True)
    assert got == pairs.render(as_messages, tokenizer)
    assert "Be brief." in tokenizer.decode(got[0]) and "<|im_start|>user" in tokenizer.decode(
        got[0]
    )
    # on a prompt of messages, ``system`` goes in front
    system_row = {
        "prompt": as_messages["prompt"][1:],
        "chosen": "Blue.",
        "rejected": "Seven.",
        "system": "Be brief.",
    }
    assert pairs.render(system_row, tokenizer) == got
    with pytest.raises(ValueError, match="a 'system' field and its prompt a system message"):
        pairs.render(dict(as_messages, system="Be long."), tokenizer)


def test_padding_keeps_short_rows_short():
    assert [pairs.padded(n) for n in (1, 9, 48, 65, 100, 129, 300)] == [
        8,
        16,
        48,
        72,
        104,
        144,
        320,
    ]
    for n in range(1, 3000):
        assert n <= pairs.padded(n) <= max(n + 7, n * 9 / 8)
    rows = [pairs.Pair(list(range(1, 49)), list(range(1, 49)), list(range(1, 48)))]
    prompts, _, responses, _, _ = pairs.collate(rows)
    assert prompts.shape == (1, 48) and responses.shape == (2, 48)  # not 64


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"beta": math.inf}, r"--beta must be a finite number in \(0, 100\], got inf"),
        ({"beta": 1e308}, r"--beta must be a finite number in \(0, 100\], got 1e\+308"),
        ({"beta": math.nan}, "--beta must be a finite number"),
        ({"beta": 0.0}, "--beta must be"),
        ({"beta": -1.0}, "--beta must be"),
        ({"beta": True}, "--beta must be"),
        ({"beta": "0.1"}, "--beta must be"),
        ({"simpo_gamma": -0.5}, r"--simpo-gamma must be a finite number in \[0, 100\]"),
        ({"simpo_gamma": math.inf}, "--simpo-gamma must be"),
        ({"loss": "orpo", "reference_model": "sft"}, "--loss orpo uses no reference model"),
    ],
)
def test_preference_options_refused_outside_their_range(flags, message):
    import argparse

    from mlx_lm_flash_cce import plugin

    with pytest.raises(PluginError, match=message):
        plugin.preference_options(argparse.Namespace(**flags))


def test_preference_options_defaults_and_values():
    import argparse

    from mlx_lm_flash_cce import plugin

    opts = plugin.preference_options(argparse.Namespace(loss="dpo"))
    assert opts["beta"] is None and opts["gamma"] == 0.5 and opts["reference_model"] is None
    opts = plugin.preference_options(argparse.Namespace(beta=100, simpo_gamma=0, loss="simpo"))
    assert opts["beta"] == 100.0 and opts["gamma"] == 0.0
    assert plugin.PREFERENCE == preference.LOSSES
    assert plugin.REFERENCE == objectives.REFERENCE


# ------------------------------------------------------------- objectives

C, R = [-10.0, -22.5, -7.0], [-12.0, -20.0, -7.5]  # summed log-probs
C0, R0 = [-11.0, -21.0, -7.2], [-11.5, -20.5, -7.1]
LC, LR = [4, 9, 3], [5, 8, 3]  # their token counts


def _run(name, beta, gamma=0.5):
    seq = mx.array(C + R)
    lens = mx.array(LC + LR)
    refs = mx.array([list(x) for x in zip(C0, R0, strict=True)])
    return [x.tolist() for x in objectives.objective(name, seq, lens, refs, beta, gamma)]


def test_ipo_against_its_formula():
    beta = 0.2
    loss, cr, rr, c, r = _run("ipo", beta)
    mean = lambda s, n: [a / b for a, b in zip(s, n, strict=True)]  # noqa: E731
    mc, mr, m0c, m0r = mean(C, LC), mean(R, LR), mean(C0, LC), mean(R0, LR)
    h = [(a - b) - (a0 - b0) for a, b, a0, b0 in zip(mc, mr, m0c, m0r, strict=True)]
    assert loss == pytest.approx(sum((x - 1 / (2 * beta)) ** 2 for x in h) / 3, rel=1e-5)
    assert cr == pytest.approx([beta * (a - a0) for a, a0 in zip(mc, m0c, strict=True)], rel=1e-5)
    assert c == pytest.approx(mc, rel=1e-6) and r == pytest.approx(mr, rel=1e-6)


def test_hinge_against_its_formula():
    beta = 0.5
    loss, cr, rr, c, r = _run("hinge", beta)
    h = [(a - b) - (a0 - b0) for a, b, a0, b0 in zip(C, R, C0, R0, strict=True)]
    assert loss == pytest.approx(sum(max(0.0, 1 - beta * x) for x in h) / 3, rel=1e-5)
    assert rr == pytest.approx([beta * (b - b0) for b, b0 in zip(R, R0, strict=True)], rel=1e-5)
    assert c == pytest.approx(C)


def test_simpo_against_its_formula():
    beta, gamma = 2.0, 0.7
    loss, cr, rr, c, r = _run("simpo", beta, gamma)
    mc = [a / n for a, n in zip(C, LC, strict=True)]
    mr = [b / n for b, n in zip(R, LR, strict=True)]
    want = -sum(_log_sigmoid(beta * (a - b) - gamma) for a, b in zip(mc, mr, strict=True)) / 3
    assert loss == pytest.approx(want, rel=1e-5)
    assert cr == pytest.approx([beta * a for a in mc], rel=1e-5)
    assert rr == pytest.approx([beta * b for b in mr], rel=1e-5)
    # no reference: other reference log-probs change nothing
    seq, lens = mx.array(C + R), mx.array(LC + LR)
    other = objectives.objective("simpo", seq, lens, mx.zeros((3, 2)), beta, gamma)[0]
    assert other.item() == pytest.approx(loss)


def test_cpo_against_its_formula():
    beta = 0.1
    loss, cr, rr, c, r = _run("cpo", beta)
    nll = -sum(C) / sum(LC)
    want = -sum(_log_sigmoid(beta * (a - b)) for a, b in zip(C, R, strict=True)) / 3 + nll
    assert loss == pytest.approx(want, rel=1e-5)
    assert cr == pytest.approx([beta * a for a in C], rel=1e-5)


def test_orpo_and_dpo_through_objective_match_their_formulas():
    beta = 0.25
    mc = mx.array([a / n for a, n in zip(C, LC, strict=True)])
    mr = mx.array([b / n for b, n in zip(R, LR, strict=True)])
    want = preference.orpo(mc, mr, mx.array(-sum(C) / sum(LC)), beta)[0].item()
    assert _run("orpo", beta)[0] == pytest.approx(want, rel=1e-6)
    want = preference.dpo(*(mx.array(x) for x in (C, R, C0, R0)), beta)[0].item()
    assert _run("dpo", beta)[0] == pytest.approx(want, rel=1e-6)


# ------------------------------------------------- reference and validation


def _pair_set(n, seed=0, name="train.jsonl"):
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, c, r = rng.randint(2, 12), rng.randint(1, 9), rng.randint(1, 9)
        tok = lambda k: [rng.randint(1, VOCAB - 1) for _ in range(k)]  # noqa: E731
        out.append(pairs.Pair(tok(p), tok(c), tok(r)))
    return pairs.PairDataset(out, name)


def test_reference_pass_reads_only_the_given_splits_in_batches_by_length(monkeypatch):
    model = _model("llama")
    token_logps = preference.make_token_logps(model, backend="mlx")
    batches, collate = [], pairs.collate

    def recording(chunk):
        batches.append([len(p.prompt) for p in chunk])
        return collate(chunk)

    monkeypatch.setattr(pairs, "collate", recording)
    train, other = _pair_set(7), _pair_set(3, seed=1, name="test.jsonl")
    assert preference.reference(model, token_logps, [train], batch_size=3) == 7
    monkeypatch.setattr(pairs, "collate", collate)
    assert all(p.ref is not None for p in train.pairs)
    assert all(p.ref is None for p in other.pairs)  # not given: not computed
    assert [len(c) for c in batches] == [3, 3, 1]
    flat = [n for c in batches for n in c]
    assert flat == sorted(flat)  # pairs of similar length share a batch
    # each pair's reference equals its own log-probs computed alone, without adapters
    for pair in train.pairs[:3]:
        prompts, plens, responses, rlens, _ = pairs.collate([pair])
        seq = preference.sequence_logps(token_logps(model, prompts, plens, responses), rlens)
        assert seq.tolist() == pytest.approx(list(pair.ref), rel=1e-4, abs=1e-4)


def test_read_by_names_the_splits_a_run_reads():
    import argparse

    sets = [_pair_set(1, name=n) for n in ("train", "valid", "test")]
    names = lambda **kw: [s.name for s in pairs.read_by(argparse.Namespace(**kw), sets)]  # noqa: E731
    assert names(train=True, test=False, val_batches=25) == ["train", "valid"]
    assert names(train=True, test=False, val_batches=0) == ["train"]
    assert names(train=False, test=True, test_batches=-1) == ["test"]
    assert names(train=True, test=True, val_batches=-1, test_batches=5) == [
        "train",
        "valid",
        "test",
    ]


def test_reference_model_gives_the_reference_log_probs():
    model = _model("llama")
    mx.random.seed(1)
    other = _model("llama")
    mx.random.seed(5)  # other weights than the policy's
    other.update(
        tree_map(lambda x: x + 0.05 * mx.random.normal(x.shape, x.dtype), other.parameters())
    )
    data = _pair_set(4)
    preference.make_loss(
        model, "dpo", sets=[data], batch_size=2, backend="mlx", reference_model=other
    )
    want_fn = preference.make_token_logps(other, backend="mlx")
    prompts, plens, responses, rlens, _ = pairs.collate(data.pairs)
    want = preference.sequence_logps(want_fn(other, prompts, plens, responses), rlens).tolist()
    got = [p.ref[0] for p in data.pairs] + [p.ref[1] for p in data.pairs]
    assert got == pytest.approx(want, rel=1e-4, abs=1e-4)
    mine = preference.sequence_logps(
        preference.make_token_logps(model, backend="mlx")(model, prompts, plens, responses), rlens
    ).tolist()
    assert not got == pytest.approx(mine, rel=1e-3)  # not the policy's own


@pytest.mark.parametrize("name", ["dpo", "orpo"])
def test_validation_is_a_mean_over_pairs(name):
    from mlx_lm.tuner.trainer import evaluate

    model = _model("llama")
    data = _pair_set(6)
    for i, p in enumerate(data.pairs):  # one batch of long prompts, the others short
        p.prompt = p.prompt * (8 if i < 2 else 1)
    loss = preference.make_loss(model, name, sets=[data], batch_size=2, backend="mlx")
    model.eval()
    per_batch = [loss(model, *b)[0].item() for b in pairs.iterate_batches(data, 2, 512)]
    got = evaluate(
        model,
        data,
        2,
        -1,
        loss=lambda m, *b: loss(m, *b)[:2],
        iterate_batches=pairs.iterate_batches,
    )
    assert got == pytest.approx(sum(per_batch) / 3, rel=1e-4)


# ------------------------------------------------ the reference in the step


def _adapted(model, layers, seed=2, **params):
    """``model`` frozen, with LoRA (or DoRA) on its top ``layers`` layers that change
    its output (random ``lora_b``, as training leaves them)."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model.freeze()
    config = {"rank": 4, "dropout": 0.0, "scale": 10.0}
    linear_to_lora_layers(model, layers, config, use_dora=params.get("dora", False))
    mx.random.seed(seed)
    for _, m in model.named_modules():
        if "lora_b" in m:
            m.lora_b = 0.02 * mx.random.normal(m.lora_b.shape)
    mx.eval(model.parameters())
    return model


def _both_ways(model, data, caplog, **kw):
    """``(in-step loss, precomputed loss)`` of DPO on ``data``, and what the log said."""
    with caplog.at_level(logging.INFO, logger="mlx_lm_flash_cce"):
        caplog.clear()
        in_step = preference.make_loss(model, "dpo", sets=[data], batch_size=2, **kw)
        said = caplog.text
    pre = preference.make_loss(model, "dpo", sets=[data], batch_size=2, precompute=True, **kw)
    return in_step, pre, said


def _grads(model, loss, batch):
    value, grads = nn.value_and_grad(model, lambda m, *b: loss(m, *b)[0])(model, *batch)
    return value, tree_flatten(grads)


@pytest.fixture(scope="module")
def smollm2_top4(smollm2_f32_path):
    """The real SmolLM2-135M float32, LoRA on its top 4 of 30 layers."""
    from mlx_lm import load

    model, _ = load(str(smollm2_f32_path))
    return _adapted(model, 4)


def test_reference_in_the_step_equals_the_precomputed_pass(smollm2_top4, caplog):
    """SmolLM2, LoRA on the top 4 layers: the step's reference log-probs, loss,
    metrics and gradients equal those of the pass before training, in training
    and in evaluation, and the reference is not the policy."""
    model, data = smollm2_top4, _pair_set(4, seed=3)
    in_step, pre, said = _both_ways(model, data, caplog, backend="mlx")
    assert "reference log-probs in the step" in said, said
    assert "adapters on the top 4 of 30 layers" in said
    assert all(p.ref is not None for p in data.pairs)  # filled by the precomputed loss only
    prompts, plens, responses, rlens, refs = pairs.collate(data.pairs)
    token_logps = preference.make_token_logps(model, check=False, backend="mlx")
    model.eval()
    policy, ref = token_logps(model, prompts, plens, responses, top=4)
    ref = preference.sequence_logps(ref, rlens)
    assert near(ref, mx.concatenate([refs[:, 0], refs[:, 1]]), 1e-6)
    assert not near(preference.sequence_logps(policy, rlens), ref, 1e-3)  # adapters matter
    batch = (prompts, plens, responses, rlens, refs)
    for training in (False, True):  # validation / test, then the training step
        model.train(training)
        a, b = in_step(model, *pairs.unread(batch)), pre(model, *batch)
        assert a[0].item() == pytest.approx(b[0].item(), rel=1e-5, abs=1e-6)
        assert near(a[2], b[2], 1e-5) and a[1].item() == b[1].item()
    (va, ga), (vb, gb) = _grads(model, in_step, pairs.unread(batch)), _grads(model, pre, batch)
    assert va.item() == pytest.approx(vb.item(), rel=1e-5) and len(ga) == len(gb) > 0
    for (ka, xa), (kb, xb) in zip(ga, gb, strict=True):
        assert ka == kb and near(xa, xb, 1e-5), ka
    model.train(False)


@pytest.mark.parametrize(
    "arch, share_prompt, dora",
    [("llama", True, False), ("gpt2", True, False), ("llama", False, False), ("qwen3", True, True)],
)
def test_reference_in_the_step_across_layouts(arch, share_prompt, dora, caplog):
    """Other layer loops, two full sequences per pair (``--grad-checkpoint``), DoRA:
    the step's reference equals the pass's."""
    layers = {"gpt2": {"n_layer": 3}}.get(arch, {"num_hidden_layers": 3})
    model = _adapted(_model(arch, **layers), 2, dora=dora)
    data = _pair_set(4, seed=4)
    in_step, pre, said = _both_ways(model, data, caplog, backend="mlx", share_prompt=share_prompt)
    assert "reference log-probs in the step" in said and "top 2 of 3 layers" in said, said
    batch = pairs.collate(data.pairs)
    model.train()
    (va, ga), (vb, gb) = _grads(model, in_step, pairs.unread(batch)), _grads(model, pre, batch)
    assert va.item() == pytest.approx(vb.item(), rel=1e-5)
    for (_, xa), (_, xb) in zip(ga, gb, strict=True):
        assert near(xa, xb, 1e-5)


def _precomputed_because(model, caplog, **kw):
    with caplog.at_level(logging.INFO, logger="mlx_lm_flash_cce"):
        caplog.clear()
        loss = preference.make_loss(
            model, "dpo", sets=[_pair_set(4)], batch_size=2, backend="mlx", **kw
        )
    assert "reference log-probs in the step" not in caplog.text
    assert "reference log-probs of 4 pairs" in caplog.text  # the pass ran
    return loss, caplog.text


def test_the_pass_runs_where_the_step_cannot_compute_the_reference(caplog):
    every = _adapted(_model("llama"), 2)  # 2 of 2 layers
    _, said = _precomputed_because(every, caplog)
    assert "precomputed before training (adapters on every layer)" in said
    top = _adapted(_model("llama", num_hidden_layers=3), 1)
    top.layers[1].unfreeze()  # a full fine-tune of a layer below the adapters
    _, said = _precomputed_because(top, caplog)
    assert "weights outside the adapters are trained (model.layers.1." in said
    mx.random.seed(1)
    other = _model("llama", num_hidden_layers=3)
    _, said = _precomputed_because(
        _adapted(_model("llama", num_hidden_layers=3), 1), caplog, reference_model=other
    )
    assert "precomputed before training (--reference-model" in said


def _matmuls(tmp_path, *arrays):
    """How many matrix products MLX would run to evaluate ``arrays`` (their graph)."""
    dot = tmp_path / "graph.dot"
    mx.export_to_dot(str(dot), *arrays)
    return len(re.findall(r'label ="Matmul"', dot.read_text()))


def _per_layer(tmp_path, model, arch_):
    """A plain forward's products per layer (a llama layer: its 7 projections, and
    the attention's 2 where the device runs attention as matmuls)."""
    hidden = arch_.hidden(model, mx.zeros((2, 5), mx.int32))
    return _matmuls(tmp_path, hidden) // len(model.layers)


def test_no_layer_runs_for_nothing(tmp_path):
    """Every position the shared forward computes predicts a response token: the
    prompt pass's output is never read, so its last layer runs only its key and
    value projections."""
    layers = 3
    model = _model("llama", num_hidden_layers=layers)
    _, arch_ = backbone.resolve(model)
    per_layer = _per_layer(tmp_path, model, arch_)
    prompts, plens, responses, _ = _batch()
    hidden = shared_prompt.shared_hidden(model, arch_, prompts, plens, responses)
    # responses: every layer; prompts: every layer but the last, then its k and v
    assert _matmuls(tmp_path, hidden) == (2 * layers - 1) * per_layer + 2


def test_reference_in_the_step_costs_base_layers_and_no_backward(tmp_path):
    """The reference half runs the top ``k`` layers without their adapters (no LoRA
    product at all), and the step's backward pass does nothing for it: it adds as
    many products to the step as to the forward."""
    model = _model("llama", num_hidden_layers=3)
    _, arch_ = backbone.resolve(model)
    per_layer = _per_layer(tmp_path, model, arch_)
    model = _adapted(model, 2)
    batch = _batch()
    with_ref = shared_prompt.shared_hidden(model, arch_, *batch[:3], top=2)
    policy = shared_prompt.shared_hidden(model, arch_, *batch[:3])
    # the top 2 base layers on the responses, the one below the last on the prompt, k and v
    assert _matmuls(tmp_path, with_ref) - _matmuls(tmp_path, policy) == 3 * per_layer + 2
    data = _pair_set(4, seed=4)
    in_step = preference.make_loss(model, "dpo", sets=[data], batch_size=2, backend="mlx")
    pre = preference.make_loss(
        model, "dpo", sets=[data], batch_size=2, backend="mlx", precompute=True
    )
    assert in_step.reference_layers == 2
    batch = pairs.collate(data.pairs)
    model.train()
    forward, step = [], []
    for loss, b in ((in_step, pairs.unread(batch)), (pre, batch)):
        forward.append(_matmuls(tmp_path, loss(model, *b)[0]))
        value, grads = nn.value_and_grad(model, lambda m, *x, f=loss: f(m, *x)[0])(model, *b)
        step.append(_matmuls(tmp_path, value, *(g for _, g in tree_flatten(grads))))
    assert forward[0] > forward[1] and step[0] - step[1] == forward[0] - forward[1]
    model.train(False)


def test_reference_kept_from_the_step_that_first_reads_each_pair(tmp_path, caplog):
    """Through a step compiled as mlx-lm compiles its own and the batches over two
    epochs: each pair's reference log-probs come out of the step that first reads
    it, equal to the pass's, and a batch read again runs the policy alone (the
    products of the precomputed loss). Evaluation keeps them at once."""
    from functools import partial

    import mlx.optimizers as optim

    model = _adapted(_model("llama", num_hidden_layers=3), 2)
    want = _pair_set(6, seed=5)
    preference.make_loss(model, "dpo", sets=[want], batch_size=2, backend="mlx", precompute=True)
    data, valid = _pair_set(6, seed=5), _pair_set(2, seed=6, name="valid.jsonl")
    with caplog.at_level(logging.INFO, logger="mlx_lm_flash_cce"):
        loss = preference.make_loss(model, "dpo", sets=[data, valid], batch_size=2, backend="mlx")
        optimizer = optim.Adam(learning_rate=1e-3)
        value_and_grad = nn.value_and_grad(model, lambda m, *b: loss(m, *b)[0])
        state = [model.state, optimizer.state]

        @partial(mx.compile, inputs=state, outputs=state)
        def step(*batch):
            value, grad = value_and_grad(model, *batch)
            optimizer.update(model, grad)
            return value

        model.train()
        widths = []
        batches = pairs.iterate_batches(data, 2, 96, loop=True, seed=0, harvest=loss.harvest)
        for _, batch in zip(range(6), batches, strict=False):
            widths.append(batch[4].shape[1])
            mx.eval(step(*batch), state)
    assert widths == [3, 3, 3, 2, 2, 2]  # the second epoch's batches carry their refs
    for got, ref in zip(data.pairs, want.pairs, strict=True):
        assert got.ref == pytest.approx(ref.ref, rel=1e-5, abs=1e-5)
    assert "reference log-probs of all 6 pairs of train.jsonl kept" in caplog.text
    batch = pairs.collate(data.pairs[:2])
    pre = preference.make_loss(model, "dpo", backend="mlx", precompute=True)
    assert _matmuls(tmp_path, loss(model, *batch)[0]) == _matmuls(tmp_path, pre(model, *batch)[0])
    assert _matmuls(tmp_path, loss(model, *pairs.unread(batch))[0]) > _matmuls(
        tmp_path, pre(model, *batch)[0]
    )
    model.train(False)
    assert all(p.ref is None for p in valid.pairs)
    loss(model, *pairs.collate(valid.pairs))  # evaluation: not compiled
    assert all(p.ref is not None for p in valid.pairs)
