"""Compile flash-cce's CUDA kernels with NVRTC on a machine without a GPU.

Builds each kernel's source the way MLX 0.32's ``mx.fast.cuda_kernel`` does
(default header, our header, the generated signature, the body) and compiles
it for sm_90a as MLX does on an H100/H200, printing registers, spills and
shared memory (``ptxas -v``). Catches compile errors before device time is
spent. Needs NVRTC and CUDA headers (pip ``nvidia-cuda-nvrtc==13.0.*``,
``nvidia-cuda-runtime==13.0.*``, unpacked anywhere) and MLX's device headers
(``mlx/backend/cuda/device/*.cuh`` from MLX's source, and the mlx-cuda
wheel's ``mlx/include`` with ``cccl``):

    LD_LIBRARY_PATH=$NV/lib python plugins/flash-cce/scripts/nvrtc_check.py \\
        --nvrtc $NV/lib/libnvrtc.so.13 --device-headers DIR \\
        -I $NV/include -I $WHEEL/mlx/include -I $WHEEL/mlx/include/cccl
"""

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_lm_flash_cce import cuda  # noqa: E402

DEFAULT_HEADER = (
    '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
)
CUDA_TYPES = {
    "bfloat16": "__nv_bfloat16",
    "float16": "__half",
    "float32": "float",
    "int32": "int32_t",
    "uint32": "uint32_t",
}


def kernel_source(kind, quantized, dtype, bits):
    """The full source MLX generates for one of our kernels (see custom_kernel.cpp)."""
    inputs = ["hid", "tgt"] + (["lse", "gco"] if kind == "bwd" else []) + ["w"]
    types = [dtype, "int32"] + (["float32", "float32"] if kind == "bwd" else [])
    types.append("uint32" if quantized else dtype)
    if quantized:
        inputs += ["scales", "biases"]
        types += [dtype, dtype]
    inputs.append("prm")
    types.append("float32")
    outputs = ["m_out", "l_out", "zt_out"] if kind == "fwd" else ["dh"]
    body = _body(kind, quantized)
    name = f"custom_kernel_flash_cce_{kind}_{'q' if quantized else 'dense'}_{CUDA_TYPES[dtype]}"
    if quantized:
        name += f"_{bits}"
    src = (
        DEFAULT_HEADER
        + cuda.HEADER
        + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    )
    src += f"__global__ void {name}(\n"
    for n, t in zip(inputs, types, strict=False):
        src += f"    const {CUDA_TYPES[t]}* {n},\n"
        if n + "_shape" in body:
            src += f"    const __grid_constant__ Shape {n}_shape,\n"
    src += ",\n".join(f"    float* {o}" for o in outputs) + ") {\n"
    src += f"  using T = {CUDA_TYPES[dtype]};\n"
    if quantized:
        src += f"  constexpr int QB = {bits};\n"
    src += "\n" + body + "\n}\n\n} // namespace mlx::core::cu\n"
    return name, src


def _body(kind, quantized):
    captured = {}
    real = cuda.mx.fast.cuda_kernel

    def fake(**kw):
        captured.update(kw)
        return None

    cuda.mx.fast.cuda_kernel = fake
    try:
        cuda._KERNELS.pop((kind, quantized), None)
        cuda._kernel(kind, quantized)
        cuda._KERNELS.pop((kind, quantized), None)
    finally:
        cuda.mx.fast.cuda_kernel = real
    return captured["source"]


def compile_source(lib, src, headers, includes, arch):
    names = sorted(os.listdir(headers))
    hs = [Path(headers, n).read_bytes() for n in names]
    hn = [("mlx/backend/cuda/device/" + n).encode() for n in names]
    prog = ctypes.c_void_p()
    r = lib.nvrtcCreateProgram(
        ctypes.byref(prog),
        src.encode(),
        b"k.cu",
        len(hs),
        (ctypes.c_char_p * len(hs))(*hs),
        (ctypes.c_char_p * len(hn))(*hn),
    )
    assert r == 0, r
    opts = [
        b"--device-as-default-execution-space",
        f"--gpu-architecture={arch}".encode(),
        b"--ptxas-options=-v",
    ]
    opts += [f"--include-path={i}".encode() for i in includes]
    tic = time.time()
    r = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    dt = time.time() - tic
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value + 1)
    lib.nvrtcGetProgramLog(prog, buf)
    return r, buf.value.decode(errors="replace"), dt


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nvrtc", required=True)
    p.add_argument(
        "--device-headers", required=True, help="folder with MLX's mlx/backend/cuda/device/*.cuh"
    )
    p.add_argument("-I", dest="includes", action="append", default=[])
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--only", default=None, help="fwd or bwd")
    p.add_argument("--dump", default=None, help="write each generated source into this folder")
    a = p.parse_args()
    lib = ctypes.CDLL(a.nvrtc)
    failed = 0
    for kind in ("fwd", "bwd"):
        if a.only and kind != a.only:
            continue
        for quantized, bits in ((False, 0), (True, 4), (True, 8)):
            for dtype in ("bfloat16", "float16"):
                name, src = kernel_source(kind, quantized, dtype, bits)
                if a.dump:
                    Path(a.dump).mkdir(parents=True, exist_ok=True)
                    Path(a.dump, name + ".cu").write_text(src)
                r, log, dt = compile_source(lib, src, a.device_headers, a.includes, a.arch)
                usage = [
                    ln.strip() for ln in log.splitlines() if "registers" in ln or "spill" in ln
                ]
                print(f"{name}: {'ok' if r == 0 else 'FAILED'} in {dt:.1f}s; " + "; ".join(usage))
                if r != 0:
                    failed += 1
                    print(log)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
