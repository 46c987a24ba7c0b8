"""The start-up hook is cheap and inert."""

import subprocess
import sys


def test_startup_hook_imports_no_mlx_and_no_pluggy():
    code = (
        "import sys\n"
        "names = [type(f).__name__ for f in sys.meta_path]\n"
        "assert '_Finder' in names, names\n"
        "heavy = [m for m in ('mlx', 'mlx.core', 'pluggy', 'mlx_lm', 'importlib.metadata')\n"
        "         if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_disable_env_leaves_mlx_lm_untouched():
    code = (
        "import sys, mlx_lm.generate\n"
        "mod = sys.modules['mlx_lm.generate']\n"
        "assert not getattr(mod, '_mlx_lm_ext_patched', False)\n"
        "assert '--plugin' not in mod.setup_arg_parser().format_help()\n"
    )
    env = {"MLX_LM_EXT_DISABLE": "1", "PATH": ""}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_without_pth_python_m_mlx_lm_ext_wires_plugins():
    # python -S processes no .pth file: mlx-lm runs unpatched, and
    # python -m mlx_lm_ext <command> gives the same command with --plugin.
    import os
    import sysconfig

    import mlx_lm_ext

    root = os.path.dirname(os.path.dirname(mlx_lm_ext.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, sysconfig.get_paths()["purelib"]]))
    plain = subprocess.run(
        [sys.executable, "-S", "-m", "mlx_lm", "generate", "--help"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    assert "--plugin" not in plain
    wired = subprocess.run(
        [sys.executable, "-S", "-m", "mlx_lm_ext", "generate", "--help"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    assert "--plugin NAME" in wired
