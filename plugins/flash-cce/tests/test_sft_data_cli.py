"""``mlx_lm.lora --loss flash-cce`` on a text dataset with a bad line: exit 2 with the
file and line, never a traceback (tiny random model, fast)."""

import json
import re
import subprocess
import sys

from cce_helpers import openblas_env

ANSI = re.compile(r"\x1b\[[0-9;]*m")
ROW = json.dumps({"text": "The river ran past the mill."}).encode() + b"\n"


def _lora(model, tmp_path, train, valid=ROW * 2):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_bytes(train)
    (data / "valid.jsonl").write_bytes(valid)
    cmd = [sys.executable, "-m", "mlx_lm", "lora", "--model", str(model), "--train"]
    cmd += ["--data", str(data), "--iters", "1", "--batch-size", "2", "--num-layers", "2"]
    cmd += ["--val-batches", "1", "--adapter-path", str(tmp_path / "adapters")]
    cmd += ["--loss", "flash-cce"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=openblas_env())


def _last_line(proc):
    return ANSI.sub("", proc.stderr).strip().splitlines()[-1]


def test_a_broken_json_line_exits_2_with_file_and_line(tiny_model, tmp_path):
    proc = _lora(tiny_model("llama"), tmp_path, ROW * 3 + b'{"text": "cut off\n' + ROW)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert _last_line(proc) == (
        "mlx-lm-ext: error: train.jsonl line 4, column 18: not valid JSON "
        "(Invalid control character at)"
    )


def test_a_line_not_utf8_in_valid_exits_2(tiny_model, tmp_path):
    proc = _lora(tiny_model("llama"), tmp_path, ROW * 4, valid=ROW + b'{"text": "caf\xe9"}\n')
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert _last_line(proc) == (
        "mlx-lm-ext: error: valid.jsonl line 2, column 14: not UTF-8 text (byte 0xe9)"
    )


def test_a_data_folder_that_does_not_exist_exits_2(tiny_model, tmp_path):
    missing = tmp_path / "no-such-data"
    for loss in ("flash-cce", "orpo"):
        cmd = [sys.executable, "-m", "mlx_lm", "lora", "--model", str(tiny_model("llama"))]
        cmd += ["--train", "--data", str(missing), "--iters", "1", "--loss", loss]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=openblas_env())
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert _last_line(proc) == f"mlx-lm-ext: error: --data {missing}: no such folder"
