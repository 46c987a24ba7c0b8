"""Start-up hook, imported from ``mlx_lm_ext.pth`` by every Python process.

It only installs an import finder: when ``mlx_lm.generate``, ``mlx_lm.server``
or ``mlx_lm.lora`` is imported, the module runs as usual and is then patched
by ``mlx_lm_ext.integration``. Nothing here imports mlx or pluggy, because
pip and every other interpreter of the environment pay for this module.
Set ``MLX_LM_EXT_DISABLE=1`` to leave mlx-lm untouched.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec
    from types import CodeType, ModuleType

TARGETS = ("mlx_lm.generate", "mlx_lm.server", "mlx_lm.lora")

# What `python -m mlx_lm.<command>` runs instead of a second copy of the
# module: runpy asks the loader for code, and this code runs the patched main.
_SHIM = (
    "import importlib, sys\n"
    "print('Calling `python -m {name}...` directly is deprecated. Use "
    "`{name}...` or `python -m mlx_lm {short} ...` instead.', file=sys.stderr)\n"
    "sys.exit(importlib.import_module('{name}').main())\n"
)


def _patch(module):
    # A broken extension must never break mlx-lm itself.
    try:
        from . import integration

        integration.patch(module)
    except Exception as e:
        print(f"mlx-lm-ext: could not extend {module.__name__}: {e!r}", file=sys.stderr)


class _Loader:
    """Wraps the real loader: run the module, then patch it."""

    def __init__(self, inner: Loader, name: str) -> None:
        self._inner = inner
        self._name = name

    def __getattr__(self, attr):
        return getattr(self._inner, attr)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _patch(module)

    def get_code(self, fullname: str) -> CodeType:
        short = fullname.rsplit(".", 1)[-1]
        src = _SHIM.format(name=fullname, short=short)
        return compile(src, f"<mlx_lm_ext shim for {fullname}>", "exec")


class _Finder:
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        if fullname not in TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and not isinstance(spec.loader, _Loader):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


def install() -> None:
    """Install the finder once, and patch targets that were imported already."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
    for name in TARGETS:
        if name in sys.modules:
            _patch(sys.modules[name])


def active() -> bool:
    return any(isinstance(f, _Finder) for f in sys.meta_path)


def disabled() -> bool:
    """``MLX_LM_EXT_DISABLE`` set to anything but empty or 0: leave mlx-lm alone."""
    return os.environ.get("MLX_LM_EXT_DISABLE", "") not in ("", "0")


if not disabled():
    try:
        install()
    except Exception:  # never break an interpreter's start-up
        pass
