"""Which offline model is fast here: the float32 SmolLM2 on a CPU (MLX's CPU
kernels for 4-bit weights are much slower than float32 BLAS matmuls), the
4-bit one on a GPU; ``mlx-lm-ext doctor`` says which."""

import subprocess
import sys
from pathlib import Path

from mlx_lm_ext import models


def test_the_float32_model_on_a_cpu_and_the_4bit_one_on_a_gpu():
    assert models.fast_model("CPU") == "smollm2-135m-f32"
    assert models.fast_model("Metal") == models.fast_model("CUDA") == "smollm2-135m"
    assert models.fast_model() == models.fast_model(models.backend())
    assert {models.fast_model(b) for b in ("CPU", "Metal", "CUDA")} <= set(models.NAMES)


def test_doctor_names_the_fast_model_for_this_backend():
    cli = Path(sys.executable).parent / "mlx-lm-ext"
    r = subprocess.run([str(cli), "doctor"], capture_output=True, text=True, timeout=300)
    line = next(x for x in r.stdout.splitlines() if x.startswith("fast offline model"))
    assert f" {models.fast_model()} (" in line and f"mlx-lm-ext model {models.fast_model()}" in line
