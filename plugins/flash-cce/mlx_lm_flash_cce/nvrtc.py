"""CUDA source to a cubin once per machine, for ``mx.fast.precompiled_cuda_kernel``.

MLX 0.32 compiles an ``mx.fast.cuda_kernel`` with NVRTC in every process
(its disk cache holds only MLX's own fused kernels), and its default header
(``utils.cuh``, cooperative groups) makes even a small kernel cost seconds
at the first call of each process and dtype, as much as a whole trial of
``auto`` (benchmarks/results/flash-cce-h200.md). Here a self-contained source (no headers) is compiled
through NVRTC with ``ctypes`` (the library MLX's CUDA backend already
loaded), and the cubin is kept under the flash-cce cache folder per
(source, GPU architecture, NVRTC version), with a checksum: a later process
loads it in microseconds; a file that does not match is compiled again.

``cubin(name, source)`` returns the bytes, or None where NVRTC or the
precompiled-kernel API is missing or the compile fails (path ``cuda-gemm``
then cannot run here, ``backends``).
"""

import ctypes
import ctypes.util
import glob
import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx

from .paths import cache_dir

log = logging.getLogger(__name__)

_LIB = []  # [ctypes.CDLL or None], loaded once
_BINARIES: Dict[Tuple[str, str], Optional[bytes]] = {}  # (name, source) -> cubin, this process


def _library() -> Optional[ctypes.CDLL]:
    if _LIB:
        return _LIB[0]
    names = ["libnvrtc.so.13", "libnvrtc.so.12", ctypes.util.find_library("nvrtc")]
    for root in sys.path:  # the pip wheels: nvidia/cu13/lib, nvidia/cuda_nvrtc/lib
        names += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so*")))
    lib = None
    for name in filter(None, names):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    _LIB.append(lib)
    return lib


def architecture() -> Optional[str]:
    """``sm_XY`` of the default GPU, from MLX's device info (None: not known)."""
    try:
        info = mx.device_info()
    except Exception:  # noqa: BLE001 (an MLX without device_info)
        return None
    arch = str(info.get("architecture", ""))
    if arch.startswith("sm_"):
        return arch
    major, minor = info.get("compute_capability_major"), info.get("compute_capability_minor")
    if major is not None and minor is not None:
        return f"sm_{major}{minor}"
    return None


def _compile(lib: ctypes.CDLL, name: str, source: str, arch: str) -> bytes:
    prog = ctypes.c_void_p()
    check = _checker(lib)
    check(
        lib.nvrtcCreateProgram(
            ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None
        )
    )
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
        argv = (ctypes.c_char_p * len(opts))(*opts)
        if lib.nvrtcCompileProgram(prog, len(opts), argv) != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            text = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetProgramLog(prog, text)
            raise RuntimeError(f"NVRTC: {text.value.decode(errors='replace').strip()}")
        size = ctypes.c_size_t()
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
        out = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(prog, out))
        return out.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _checker(lib):
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def check(code: int) -> None:
        if code != 0:
            raise RuntimeError(f"NVRTC: {lib.nvrtcGetErrorString(code).decode()}")

    return check


def _version(lib: ctypes.CDLL) -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def _folder() -> Path:
    return cache_dir() / "kernels"


def _read(path: Path) -> Optional[bytes]:
    """The cubin in ``path`` if its checksum (the first 32 bytes) matches."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    body = data[32:]
    if len(data) <= 32 or hashlib.sha256(body).digest() != data[:32]:
        log.warning("flash-cce: cached kernel %s is damaged; compiling it again", path.name)
        return None
    return body


def _write(path: Path, body: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(hashlib.sha256(body).digest() + body)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache costs a compile next time, nothing else
        log.debug("flash-cce: cannot write %s: %s", path, e)


def cubin(name: str, source: str) -> Optional[bytes]:
    """The compiled ``source`` for this GPU: from this process, the disk, or NVRTC.

    Called for every block the row kernel runs on, so after the first call it
    is one dict lookup (no device query, hashing or file access).
    """
    if (name, source) not in _BINARIES:
        _BINARIES[name, source] = _load(name, source)
    return _BINARIES[name, source]


def _load(name: str, source: str) -> Optional[bytes]:
    if not hasattr(mx.fast, "precompiled_cuda_kernel"):
        return None
    lib, arch = _library(), architecture()
    if lib is None or arch is None:
        log.debug("flash-cce: NVRTC (%s) or the GPU architecture (%s) not found", lib, arch)
        return None
    digest = hashlib.sha256(f"{source}\0{arch}\0{_version(lib)}".encode()).hexdigest()[:24]
    path = _folder() / f"{name}-{arch}-{digest}.cubin"
    body = _read(path) if path.exists() else None
    if body is None:
        try:
            body = _compile(lib, name, source, arch)
        except (RuntimeError, OSError, AttributeError) as e:
            log.debug("flash-cce: %s does not compile here: %s", name, e)
            return None
        _write(path, body)
    return body
