"""The row kernel's cubin: compiled once, kept on disk with a checksum, recompiled when damaged."""

import logging

import mlx.core as mx
import pytest

from mlx_lm_flash_cce import autotune, cuda_gemm, nvrtc, rows


@pytest.fixture
def fake_nvrtc(monkeypatch, tmp_path):
    """NVRTC stood in by a compile that counts its calls (the CPU has no NVRTC)."""
    monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(nvrtc, "_BINARIES", {})
    monkeypatch.setattr(nvrtc, "_library", lambda: object())
    monkeypatch.setattr(nvrtc, "_version", lambda lib: "13.0")
    monkeypatch.setattr(nvrtc, "architecture", lambda: "sm_90")
    calls = []

    def compile_(lib, name, source, arch):
        calls.append((name, arch))
        return f"cubin of {name} for {arch}: {len(source)}".encode()

    monkeypatch.setattr(nvrtc, "_compile", compile_)
    return calls, tmp_path / "kernels"


def test_compiled_once_then_read_from_disk(fake_nvrtc, monkeypatch):
    calls, folder = fake_nvrtc
    first = nvrtc.cubin("k", "source one")
    assert first == b"cubin of k for sm_90: 10" and len(calls) == 1
    assert nvrtc.cubin("k", "source one") == first and len(calls) == 1  # this process
    monkeypatch.setattr(nvrtc, "_BINARIES", {})  # a new process
    assert nvrtc.cubin("k", "source one") == first and len(calls) == 1  # the disk
    (path,) = folder.glob("k-sm_90-*.cubin")
    assert path.read_bytes().endswith(first)
    nvrtc.cubin("k", "source two")  # other source: another file
    assert len(calls) == 2 and len(list(folder.glob("*.cubin"))) == 2


def test_damaged_file_is_compiled_again(fake_nvrtc, monkeypatch, caplog):
    calls, folder = fake_nvrtc
    good = nvrtc.cubin("k", "src")
    (path,) = folder.glob("*.cubin")
    path.write_bytes(path.read_bytes()[:-3] + b"xyz")  # a flipped tail
    monkeypatch.setattr(nvrtc, "_BINARIES", {})
    with caplog.at_level(logging.WARNING, logger="mlx_lm_flash_cce"):
        assert nvrtc.cubin("k", "src") == good
    assert len(calls) == 2 and "damaged" in caplog.text
    assert path.read_bytes().endswith(good)  # rewritten whole


def test_failed_compile_is_none_and_the_step_is_mlx(fake_nvrtc, monkeypatch):
    def broken(lib, name, source, arch):
        raise RuntimeError("NVRTC: error: expected a ';'")

    monkeypatch.setattr(nvrtc, "_compile", broken)
    assert nvrtc.cubin("k", "src") is None
    monkeypatch.setattr(cuda_gemm, "on_cuda", lambda: True)
    opts = cuda_gemm.portable.Options(elementwise="auto")
    assert cuda_gemm.use_kernel(opts, mx.bfloat16) is False
    with pytest.raises(ValueError, match="does not compile"):
        cuda_gemm.use_kernel(opts._replace(elementwise="kernel"), mx.bfloat16)


@pytest.mark.skipif(not cuda_gemm.on_cuda(), reason="needs MLX's CUDA backend and a GPU")
def test_real_row_kernel_is_cached(monkeypatch, tmp_path):
    monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(nvrtc, "_BINARIES", {})
    body = rows.row_kernel()
    assert body and list((tmp_path / "kernels").glob("cce_rows-sm_*.cubin"))
    monkeypatch.setattr(nvrtc, "_BINARIES", {})
    assert rows.row_kernel() == body
