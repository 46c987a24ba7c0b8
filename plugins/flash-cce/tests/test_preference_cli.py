"""``mlx_lm.lora`` with a preference loss: bad input is exit 2 with one line, never a
traceback or NaN adapters; the console's train lines (tiny random models, fast)."""

import json
import re
import shutil
import subprocess
import sys

import pytest
from cce_helpers import openblas_env

ANSI = re.compile(r"\x1b\[[0-9;]*m")
GOOD = {"prompt": "Name a colour.", "chosen": " Blue.", "rejected": " Seven, or a dog."}


def _data(tmp_path, rows=None, raw=None, n=4):
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in (rows or [GOOD] * n)).encode()
    (data / "train.jsonl").write_bytes(raw if raw is not None else text)
    (data / "valid.jsonl").write_bytes(text if rows is None and raw is None else b"")
    return data


def _lora(model, data, *extra, adapters=None):
    cmd = [sys.executable, "-m", "mlx_lm", "lora", "--model", str(model), "--train"]
    cmd += ["--data", str(data), "--iters", "2", "--batch-size", "2", "--num-layers", "2"]
    cmd += ["--steps-per-report", "1", "--val-batches", "1", "--max-seq-length", "64"]
    cmd += ["--adapter-path", str(adapters or data.parent / "adapters"), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=openblas_env())
    return proc, ANSI.sub("", proc.stdout)


def _last_line(proc):
    return proc.stderr.strip().splitlines()[-1]


def test_row_not_utf8_exits_2_with_file_line_and_column(tiny_model, tmp_path):
    good = json.dumps(GOOD).encode() + b"\n"
    data = _data(tmp_path, raw=good + b'{"prompt": "caf\xe9", "chosen": "a", "rejected": "b"}\n')
    proc, _ = _lora(tiny_model("llama"), data, "--loss", "orpo")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert _last_line(proc) == (
        "mlx-lm-ext: error: train.jsonl line 2, column 16: not UTF-8 text (byte 0xe9)"
    )


def test_message_content_that_is_a_number_exits_2(tiny_model, tmp_path):
    row = {"prompt": [{"role": "user", "content": 42}], "chosen": "a", "rejected": "b"}
    proc, _ = _lora(tiny_model("llama"), _data(tmp_path, rows=[GOOD, row]), "--loss", "dpo")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert _last_line(proc) == (
        "mlx-lm-ext: error: train.jsonl line 2: 'prompt' message 1: 'content' must be a "
        "string (got int)"
    )


def test_bad_json_is_one_level(tiny_model, tmp_path):
    proc, _ = _lora(
        tiny_model("llama"),
        _data(tmp_path, raw=json.dumps(GOOD).encode() + b"\n{'a': 1}\n"),
        "--loss",
        "orpo",
    )
    assert proc.returncode == 2
    assert _last_line(proc) == (
        "mlx-lm-ext: error: train.jsonl line 2, column 2: not valid JSON (Expecting property "
        "name enclosed in double quotes)"
    )


@pytest.mark.parametrize("beta", ["inf", "1e308", "nan", "0"])
def test_beta_outside_its_range_exits_2(tiny_model, tmp_path, beta):
    proc, _ = _lora(tiny_model("llama"), _data(tmp_path), "--loss", "dpo", "--beta", beta)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert _last_line(proc).startswith(
        "mlx-lm-ext: error: --beta must be a finite number in (0, 100]"
    )
    assert not (tmp_path / "adapters" / "adapters.safetensors").exists()


def test_non_finite_loss_stops_training_without_nan_adapters(tiny_model, tmp_path):
    proc, _ = _lora(
        tiny_model("llama"),
        _data(tmp_path),
        "--loss",
        "orpo",
        "--learning-rate",
        "1e30",
        "--iters",
        "4",
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert re.fullmatch(
        r"mlx-lm-ext: error: the training loss is (nan|inf|-inf) at iteration [234]: training "
        r"stopped before saving adapters from this step .*",
        _last_line(proc),
    ), _last_line(proc)
    assert not (tmp_path / "adapters" / "adapters.safetensors").exists()


def test_train_lines_show_it_per_second_and_peak_memory(tiny_model, tmp_path):
    proc, out = _lora(tiny_model("llama"), _data(tmp_path), "--loss", "simpo")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [x for x in out.splitlines() if re.match(r"^\s+\d+\s+train reward margin", x)]
    assert len(lines) == 2, out
    for line in lines:
        assert re.search(r", accuracy [0-9.]+, .*, [0-9.]+ it/s, peak mem [0-9.]+ GB$", line), line


def test_reference_model_with_another_tokenizer_exits_2(tiny_model, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_model("llama"), other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|im_start|>"  # another end-of-sequence token
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    proc, _ = _lora(
        tiny_model("llama"), _data(tmp_path), "--loss", "dpo", "--reference-model", str(other)
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert _last_line(proc) == (
        f"mlx-lm-ext: error: --reference-model {other}: its tokenizer differs from the model's "
        "(vocabulary or special tokens), so its log-probs would score other tokens"
    )


def test_reference_model_that_does_not_load_exits_2(tiny_model, tmp_path):
    missing = tmp_path / "no-such-model"
    proc, _ = _lora(
        tiny_model("llama"), _data(tmp_path), "--loss", "ipo", "--reference-model", str(missing)
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert _last_line(proc).startswith(
        f"mlx-lm-ext: error: --reference-model {missing}: cannot load"
    )


def test_reference_pass_covers_only_the_splits_read(tiny_model, tmp_path):
    data = _data(tmp_path)  # 4 train, 4 valid
    (data / "test.jsonl").write_text("".join(json.dumps(GOOD) + "\n" for _ in range(3)))
    proc, out = _lora(tiny_model("llama"), data, "--loss", "hinge")
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = out + ANSI.sub("", proc.stderr)
    assert re.search(r"reference log-probs of 8 pairs \(\d+ adapter layers off\)", text), text
    assert "reference log-probs:" in text  # its progress bar
    proc, out = _lora(tiny_model("llama"), data, "--loss", "hinge", "--val-batches", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "reference log-probs of 4 pairs" in out + proc.stderr
