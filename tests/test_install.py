"""A real install of the core plus one plugin, in a fresh virtual environment."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_core_plus_one_plugin(tmp_path):
    plugin = ROOT / "plugins" / "flash-cce"
    assert (plugin / "pyproject.toml").exists()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    extra = "[cpu]" if sys.platform.startswith("linux") else ""
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "-e", f"{ROOT}{extra}", "-e", str(plugin)],
        check=True,
        timeout=1200,
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    listed = subprocess.run(
        [str(venv / "bin" / "mlx-lm-ext"), "plugins"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    names = [line.split()[0] for line in listed.splitlines()[1:]]
    assert names == ["flash-cce"]
    # The .pth start-up hook came with the editable install.
    assert (
        Path(
            subprocess.run(
                [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        )
        / "mlx_lm_ext.pth"
    ).exists()
    ok = subprocess.run(
        [str(venv / "bin" / "mlx_lm.lora"), "--plugin", "flash-cce", "--help"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert ok.returncode == 0, ok.stderr
    assert "plugin flash-cce:" in ok.stdout
    other = subprocess.run(
        [str(venv / "bin" / "mlx_lm.server"), "--plugin", "ssd-cache"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert other.returncode == 2
    assert "unknown plugin 'ssd-cache' (installed plugins: flash-cce)" in other.stderr
