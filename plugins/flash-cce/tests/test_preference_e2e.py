"""``mlx_lm.lora --loss orpo`` and ``--loss dpo`` end to end on the real SmolLM2.

The preference set is built from the model's own outputs. The rule for
"chosen": the model's greedy answer to the prompt is chosen, and the same
answer with its words in reverse order is rejected (a response no fluent
model should prefer, yet made of the same tokens).
"""

import json
import re
import subprocess
import sys

import pytest
from cce_helpers import openblas_env

ANSI = re.compile(r"\x1b\[[0-9;]*m")
METRIC_LINE = re.compile(
    r"^\s*(\d+)\s+(train|val) reward margin (-?[0-9.]+), accuracy ([0-9.]+), "
    r"chosen logp (-?[0-9.]+), rejected logp (-?[0-9.]+)"
)
LOSS_LINE = re.compile(r"^\s*(\d+)\s+(?:(val) )?(-?[0-9.]+)(?: [▼▲]|\s+[0-9.]+s$)")
TOPICS = [
    "cats",
    "rivers",
    "winter",
    "bread",
    "music",
    "trains",
    "gardens",
    "the moon",
    "libraries",
    "bicycles",
]


@pytest.fixture(scope="module")
def own_pairs(smollm2_f32_path, tmp_path_factory):
    """``(chat folder, plain folder)``: the same pairs as chat messages and as strings."""
    from mlx_lm import generate, load

    model, tokenizer = load(str(smollm2_f32_path))
    rows = []
    for topic in TOPICS:
        messages = [{"role": "user", "content": f"Write one short sentence about {topic}."}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        answer = generate(model, tokenizer, prompt, max_tokens=14).strip()
        reversed_answer = " ".join(reversed(answer.split()))
        rows.append((messages, answer, reversed_answer))
    root = tmp_path_factory.mktemp("pairs")
    folders = []
    for kind in ("chat", "plain"):
        folder = root / kind
        folder.mkdir()
        out = []
        for messages, answer, rejected in rows:
            if kind == "chat":
                out.append(
                    {
                        "prompt": messages,
                        "chosen": [{"role": "assistant", "content": answer}],
                        "rejected": [{"role": "assistant", "content": rejected}],
                    }
                )
            else:
                out.append(
                    {
                        "prompt": messages[0]["content"],
                        "chosen": " " + answer,
                        "rejected": " " + rejected,
                    }
                )
        for name, part in (("train", out[:6]), ("valid", out[6:8]), ("test", out[8:])):
            (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
        folders.append(folder)
    return tuple(folders)


def _lora(model, data, adapters, *extra):
    cmd = [
        sys.executable,
        "-m",
        "mlx_lm",
        "lora",
        "--model",
        str(model),
        "--train",
        "--test",
        "--data",
        str(data),
        "--iters",
        "6",
        "--batch-size",
        "2",
        "--num-layers",
        "4",
        "--val-batches",
        "1",
        "--test-batches",
        "1",
        "--steps-per-report",
        "2",
        "--steps-per-eval",
        "6",
        "--max-seq-length",
        "96",
        "--learning-rate",
        "5e-4",
        "--seed",
        "0",
        "--adapter-path",
        str(adapters),
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=openblas_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = ANSI.sub("", proc.stdout)
    lines = {"train": {}, "val": {}, "loss": {}}
    for line in out.splitlines():
        if m := METRIC_LINE.match(line):
            lines[m[2]][int(m[1])] = [float(m[k]) for k in (3, 4, 5, 6)]
        elif m := LOSS_LINE.match(line):
            lines["loss"][(int(m[1]), m[2] or "train")] = float(m[3])
    assert (adapters / "adapters.safetensors").is_file()
    return lines, out + ANSI.sub("", proc.stderr)


@pytest.mark.slow
def test_orpo_chat_pairs_margin_rises(smollm2_f32_path, own_pairs, tmp_path):
    chat, _ = own_pairs
    lines, out = _lora(smollm2_f32_path, chat, tmp_path / "orpo", "--loss", "orpo", "--beta", "0.5")
    assert "prompt run once per pair" in out
    train = lines["train"]
    assert sorted(train) == [2, 4, 6] and sorted(lines["val"]) == [1, 6], out[-2000:]
    assert train[6][0] > train[2][0]  # reward margin rises over the run
    assert lines["val"][6][0] > lines["val"][1][0]
    assert re.search(r"^Test reward margin -?[0-9.]+, accuracy", out, re.M)
    config = json.loads((tmp_path / "orpo" / "adapter_config.json").read_text())
    assert config["loss"] == "orpo" and config["beta"] == 0.5


@pytest.fixture(scope="module")
def dpo_runs(smollm2_f32_path, own_pairs, tmp_path_factory):
    """DPO from a YAML config as a user runs it (LoRA on the top 4 layers: the
    reference in the step), and the same run against the same checkpoint
    loaded apart (``--reference-model``: the reference pass before training)."""
    _, plain = own_pairs
    root = tmp_path_factory.mktemp("dpo")
    yaml = root / "dpo.yaml"
    yaml.write_text("loss: dpo\nbeta: 0.1\n")
    in_step = _lora(smollm2_f32_path, plain, root / "in-step", "-c", str(yaml))
    extra = ["--loss", "dpo", "--beta", "0.1", "--reference-model", str(smollm2_f32_path)]
    return in_step, _lora(smollm2_f32_path, plain, root / "pass", *extra), root


@pytest.mark.slow
def test_dpo_reference_in_the_step_trains_as_the_pass_does(dpo_runs):
    """The same loss, metrics, and adapters at the end, whichever computes the reference."""
    import mlx.core as mx

    (lines, out), (want, pass_out), root = dpo_runs
    assert "reference log-probs in the step" in out and "top 4 of 30 layers" in out, out[-3000:]
    assert not re.search(r"reference log-probs of \d+ pairs \(", out)  # no pass ran
    # 6 pairs in batches of 2 over 6 steps: the second epoch's steps run the policy alone
    assert "reference log-probs of all 6 pairs of train.jsonl kept" in out, out[-3000:]
    assert "reference log-probs of 10 pairs (the reference model)" in pass_out
    assert sorted(lines["loss"]) == sorted(want["loss"]) and len(lines["loss"]) == 5
    for key, value in want["loss"].items():  # printed to 3 decimals
        assert lines["loss"][key] == pytest.approx(value, abs=2e-3), key
    for split in ("train", "val"):
        for it, values in want[split].items():
            # not the accuracy: at the first step each reward is 0 give or take
            # float noise, whose sign it counts
            got = [lines[split][it][k] for k in (0, 2, 3)]
            want_ = [values[k] for k in (0, 2, 3)]
            assert got == pytest.approx(want_, rel=1e-2, abs=2e-3), (split, it)
    got = mx.load(str(root / "in-step" / "adapters.safetensors"))
    ref = mx.load(str(root / "pass" / "adapters.safetensors"))
    assert sorted(got) == sorted(ref)
    # Adam's first steps move each weight by about the learning rate whatever its
    # gradient's size, so float noise in a near-zero gradient moves single entries
    # that far: compare each matrix as a whole
    for k in ref:
        diff = mx.sqrt(mx.square(got[k] - ref[k]).sum()).item()
        assert diff <= 1e-2 * mx.sqrt(mx.square(ref[k]).sum()).item(), k


@pytest.mark.slow
def test_dpo_from_yaml_margin_rises(dpo_runs):
    (lines, out), _, _ = dpo_runs
    val, train = lines["val"], lines["train"]
    # before the first step the model is its own reference: every reward is 0
    assert val[1][0] == 0.0
    assert train[6][0] > train[2][0] and val[6][0] > val[1][0]
    assert val[6][1] > 0.5  # most pairs ranked right after six steps


def test_bad_row_exits_2_naming_file_and_line(tiny_model, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    good = {"prompt": "p", "chosen": "c", "rejected": "r"}
    rows = [good, good, {"messages": [{"role": "user", "content": "hi"}]}]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "-m", "mlx_lm", "lora", "--model", str(tiny_model("llama"))]
    cmd += ["--train", "--data", str(data), "--loss", "orpo", "--iters", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "mlx-lm-ext: error: train.jsonl line 3: not a preference row: needs 'prompt', "
        "'chosen' and 'rejected' as strings, or a prompt of chat messages (got ['messages'])"
    )


def test_unknown_loss_lists_the_preference_losses(tiny_model, tmp_path):
    cmd = [sys.executable, "-m", "mlx_lm", "lora", "--model", str(tiny_model("llama"))]
    cmd += ["--train", "--data", str(tmp_path), "--loss", "kto"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert re.search(r"unknown loss 'kto' \(losses: default, .*flash-cce, orpo, dpo", proc.stderr)


def _with_system(folder, out):
    """``folder``'s string rows with a ``system`` field, in ``out``."""
    out.mkdir()
    for f in folder.iterdir():
        rows = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        rows = [dict(r, system="You answer in one short sentence.") for r in rows]
        (out / f.name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "loss, extra",
    [
        # the same checkpoint, loaded apart; IPO's squared loss wants a gentler step
        ("ipo", ["--reference-model", "MODEL", "--beta", "0.5", "--learning-rate", "1e-4"]),
        ("hinge", []),
        ("simpo", ["--apply-chat-template"]),  # string prompts with a system field
        ("cpo", []),
    ],
)
def test_objectives_margin_rises(smollm2_f32_path, own_pairs, tmp_path, loss, extra):
    chat, plain = own_pairs
    data = chat
    if "--apply-chat-template" in extra:
        data = _with_system(plain, tmp_path / "system")
    extra = [str(smollm2_f32_path) if x == "MODEL" else x for x in extra]
    lines, out = _lora(smollm2_f32_path, data, tmp_path / loss, "--loss", loss, *extra)
    assert "prompt run once per pair" in out
    val, train = lines["val"], lines["train"]
    assert sorted(train) == [2, 4, 6] and sorted(val) == [1, 6], out[-2000:]
    assert train[6][0] > train[2][0] and val[6][0] > val[1][0], out[-3000:]
    if loss == "ipo":  # before the first step the model is its own reference
        assert val[1][0] == 0.0
        assert "reference log-probs of 10 pairs (the reference model)" in out, out[-3000:]
    elif loss == "hinge":  # LoRA on the top 4 of 30 layers: the reference in the step
        assert val[1][0] == 0.0
        assert "reference log-probs in the step" in out, out[-3000:]
    else:
        assert "reference log-probs" not in out
    assert re.search(
        r"^\s+6\s+train reward margin .*, [0-9.]+ it/s, peak mem [0-9.]+ GB$", out, re.M
    )
    config = json.loads((tmp_path / loss / "adapter_config.json").read_text())
    assert config["loss"] == loss
