"""``mlx-lm-ext train-drafter`` on a tiny random target: the loss falls, a
stopped run resumes to exactly the weights of an uninterrupted one, bad
input is a clear error, and the output folder is a working drafter."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from argparse import Namespace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from mlx_lm_spec_decode import assistant as A
from mlx_lm_spec_decode import last_stats, speculative_generate_step
from mlx_lm_spec_decode import target as target_mod
from mlx_lm_spec_decode.training.chat import greedy_batch
from mlx_lm_spec_decode.training.checkpoint import CKPT, EVAL_FILE, LOG_FILE
from mlx_lm_spec_decode.training.cli import main
from mlx_lm_spec_decode.training.data import DATA_FILE, make_batches


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Real text: two modules of CPython's standard library."""
    d = tmp_path_factory.mktemp("drafter-data")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("json/decoder.py", "textwrap.py"):
        shutil.copy(stdlib / name, d / Path(name).name)
    (d / "blob.bin").write_bytes(bytes(range(256)) * 8)  # not text: skipped
    return d


def flags(model, data, out, *extra):
    return [
        "--model",
        str(model),
        "--data",
        str(data),
        "--out",
        str(out),
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--draft-steps",
        "2",
        "--lr",
        "1e-2",
        "--warmup",
        "1",
        "--steps",
        "8",
        "--max-data-tokens",
        "4000",
        "--quiet",
        "--no-compile",
        *extra,
    ]


def records(out):
    return [json.loads(x) for x in (Path(out) / LOG_FILE).read_text().splitlines()]


def test_loss_falls(tiny_model, data, tmp_path):
    """Two sequences of data, so every step sees the same batch: the loss
    must fall step after step and agreement rise."""
    model = tiny_model("llama")
    assert main(flags(model, data, tmp_path / "a", "--max-data-tokens", "64", "--lr", "3e-3")) == 0
    recs = records(tmp_path / "a")
    losses = [r["loss"] for r in recs]
    assert losses[-1] < losses[0] - 0.3 and all(
        b <= a + 0.02 for a, b in zip(losses, losses[1:], strict=False)
    )
    assert recs[-1]["top1"][0] > recs[0]["top1"][0]


def test_resume_is_exact(tiny_model, data, tmp_path):
    model = tiny_model("llama")
    assert main(flags(model, data, tmp_path / "a")) == 0
    full = records(tmp_path / "a")
    assert [r["step"] for r in full] == list(range(1, 9))

    # Stopped after 3 steps, then the same command again: the same run.
    assert main(flags(model, data, tmp_path / "b", "--stop-after", "3")) == 0
    assert json.loads((tmp_path / "b" / CKPT / "state.json").read_text())["step"] == 3
    assert (tmp_path / "b" / A.WEIGHTS_FILE).is_file()  # a usable drafter at every checkpoint
    with open(tmp_path / "b" / LOG_FILE, "a") as f:  # as if killed after logging step 4, mid-line
        f.write(json.dumps({"step": 4, "loss": 0.0}) + '\n{"step": 5, "lo')
    assert main(flags(model, data, tmp_path / "b")) == 0
    resumed = records(tmp_path / "b")
    assert [r["step"] for r in resumed] == list(range(1, 9))
    for a, b in zip(full, resumed, strict=False):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
    wa = mx.load(str(tmp_path / "a" / CKPT / "weights.safetensors"))
    wb = mx.load(str(tmp_path / "b" / CKPT / "weights.safetensors"))
    assert wa.keys() == wb.keys()
    assert all(mx.allclose(wa[k], wb[k], atol=1e-5).item() for k in wa)

    # A finished run rerun is a no-op; the folder is a drafter for this model.
    assert main(flags(model, data, tmp_path / "a")) == 0
    assert len(records(tmp_path / "a")) == 8
    target, tok = load(str(model))
    d = A.load(tmp_path / "a", target)
    prompt = mx.array(tok.encode("def decode(self, s):"))
    out = [
        t
        for t, _, _ in speculative_generate_step(
            prompt, target, d, num_draft_tokens=3, max_tokens=12
        )
    ]
    assert len(out) == 12 and last_stats().drafter == "assistant"


def test_held_out_rows_are_never_trained_on(tiny_model, data, tmp_path):
    args = Namespace(seq_len=4, eval_rows=3, batch_size=4, chat_fraction=0.5, seed=0)
    corpus = np.arange(200, dtype=np.uint32)  # 50 rows of text
    chat = np.arange(1000, 1120, dtype=np.uint32)  # 30 rows of chats
    mask = (np.arange(120) % 10 >= 4).astype(np.uint8)  # 4 prompt tokens, then 6 answer tokens
    batch, n_text, n_chat, evals = make_batches(args, corpus, chat, mask)
    assert (n_text, n_chat) == (47, 27) and evals["text"][0].shape == evals["chat"][0].shape == (
        3,
        4,
    )
    held = {tuple(r) for x, _ in evals.values() for r in x.tolist()}
    seen = set()
    for i in range(100):
        x, w = batch(i)
        for r, rw in zip(x.tolist(), w.tolist(), strict=False):
            seen.add(tuple(r))
            # A row position counts where the next token is an answer token (text: everywhere).
            want = (
                [1.0] * 4
                if r[0] < 1000
                else [float(mask[t - 1000 + 1 if j < 3 else t - 1000]) for j, t in enumerate(r)]
            )
            assert rw == want, (r, rw)
    assert len(held) == 6 and not held & seen and len(seen) == 47 + 27
    assert evals["text"][1].tolist() == [[1.0] * 4] * 3
    # Too little data: nothing held out rather than most of it.
    assert make_batches(Namespace(**{**vars(args), "seq_len": 40}), corpus, None)[3] == {}

    # A run evaluates them at its checkpoints (and at its end) and says so.
    assert main(flags(tiny_model("llama"), data, tmp_path / "a", "--save-every", "4")) == 0
    evs = [json.loads(x) for x in (tmp_path / "a" / EVAL_FILE).read_text().splitlines()]
    assert [e["step"] for e in evs] == [4, 8]
    assert evs[-1]["text"]["rows"] == 8 and len(evs[-1]["text"]["top1"]) == 2


def test_changed_settings_and_bad_data_are_clear_errors(tiny_model, data, tmp_path, capsys):
    model = tiny_model("llama")
    assert main(flags(model, data, tmp_path / "a", "--stop-after", "1")) == 0
    assert main(flags(model, data, tmp_path / "a", "--seq-len", "16")) == 2
    assert "other settings (--seq-len 32 -> 16)" in capsys.readouterr().err
    # Another target for the same folder: refused by fingerprint.
    assert main(flags(tiny_model("llama", seed=3), data, tmp_path / "a")) == 2
    assert "other weights" in capsys.readouterr().err
    assert main(flags(model, tmp_path / "nothing", tmp_path / "b")) == 2
    assert "no such file or directory" in capsys.readouterr().err
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "x.txt").write_bytes(b"\xff\xfe\x00\x00" * 64)
    assert main(flags(model, binary, tmp_path / "c")) == 2
    assert "no readable text files" in capsys.readouterr().err
    assert main(flags(model, data, tmp_path / "d", "--seq-len", "2")) == 2
    assert main(flags(model, data, tmp_path / "d", "--steps", "auto")) == 2
    assert "--steps auto needs --time-limit" in capsys.readouterr().err
    # --restart discards the old run.
    assert (
        main(
            flags(model, data, tmp_path / "a", "--seq-len", "16", "--stop-after", "1", "--restart")
        )
        == 0
    )
    assert [r["step"] for r in records(tmp_path / "a")] == [1]


def test_generated_chat_data(tiny_model, data, tmp_path):
    model = tiny_model("llama")
    (tmp_path / "a").mkdir()
    shutil.copy(
        data / "textwrap.py", tmp_path / "a" / DATA_FILE
    )  # stale, unreadable, no checkpoint: remade
    assert (
        main(
            flags(
                model,
                data,
                tmp_path / "a",
                "--generate",
                "3",
                "--generate-tokens",
                "6",
                "--stop-after",
                "1",
            )
        )
        == 0
    )
    d = mx.load(str(tmp_path / "a" / DATA_FILE))
    _, tok = load(str(model))
    text = tok.decode(d["chat"].tolist())
    assert text.count("<|im_start|>assistant") == 3 and d["corpus"].size == 4000
    # The answer mask: the tokens after each "<|im_start|>assistant\n", through the EOS.
    ids, mask = d["chat"].tolist(), d["chat_mask"].tolist()
    answers = tok.decode([t for t, m in zip(ids, mask, strict=False) if m])
    assert (
        len(mask) == len(ids) and "<|im_start|>" not in answers and answers.count("<|im_end|>") == 3
    )
    assert sum(mask) < len(mask) / 2


def test_batched_greedy_answers_are_greedy_answers(tiny_model):
    """The chat data generator: prompts of different lengths left-padded in
    one batch give each prompt's own greedy answer, cut before a stop token."""
    from mlx_lm.generate import generate_step

    model, tok = load(str(tiny_model("llama", seed=2)))
    prompts = [
        tok.encode(t) for t in ("a", "one two three four five six seven", "the quick brown fox")
    ]
    ref = [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=10)] for p in prompts]
    split = target_mod.split(model)
    assert greedy_batch(model, split, prompts, 10, {2}) == ref
    stop = ref[1][3]
    want = [r[: r.index(stop)] if stop in r else r for r in ref]
    assert greedy_batch(model, split, prompts, 10, {stop}) == want


def test_the_mlx_lm_ext_command(tiny_model, data, tmp_path):
    """The subcommand as users run it, through the host's plugin discovery."""
    exe = Path(sys.executable).with_name("mlx-lm-ext")
    cmd = [
        str(exe),
        "train-drafter",
        *flags(tiny_model("llama"), data, tmp_path / "a", "--steps", "2"),
    ]
    cmd.remove("--quiet")
    r = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert r.returncode == 0, r.stderr
    assert "train-drafter" in r.stderr and "top1" in r.stderr  # the progress bar
    assert "--drafter assistant --drafter-path" in r.stderr
    assert A.read_config(tmp_path / "a").num_layers == 1
