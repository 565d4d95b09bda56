"""The CUDA sources compile: with nvcc for sm_90 and sm_80, and with NVRTC (what CuPy uses) when
libnvrtc can be found. Every template instantiation the CuPy backend asks for is compiled."""

import ctypes
import ctypes.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpu import cupy_backend
from gpu.dtypes import STORAGE_NAMES


def all_instantiations() -> list[str]:
    names = set(cupy_backend.write_kv_name_expressions())
    for storage_name in STORAGE_NAMES:
        for head_dim in cupy_backend.HEAD_DIMS:
            names.update(cupy_backend.name_expressions(storage_name, head_dim))
    return sorted(names)


def test_kernel_source_is_self_contained():
    source = cupy_backend.kernel_source()
    assert '#include "' not in source  # local headers are inlined for NVRTC and CuPy's cache key
    assert "#include <" not in source  # NVRTC has no host headers


@pytest.mark.slow  # (10-20 s each: nvcc compiles every instantiation)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_kernels_compile_with_nvcc(tmp_path: Path, arch: str):
    # Taking each instantiation's address forces nvcc to compile it, as NVRTC name
    # expressions do for CuPy.
    names = all_instantiations()
    instances = ",\n".join(f"(void*)&{name}" for name in names)
    source = tmp_path / "kernels.cu"
    source.write_text(cupy_backend.kernel_source() + f"\nvoid* servesim_instances[] = {{\n{instances}\n}};\n")
    ptx = tmp_path / "kernels.ptx"
    result = subprocess.run(["nvcc", "--ptx", f"-arch={arch}", str(source), "-o", str(ptx)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    entries = ptx.read_text().count(".entry")
    assert entries == len(names)


@pytest.mark.slow  # (nvcc)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_spin_kernel_compiles_with_nvcc(tmp_path: Path):
    # The self-check's timing queues it ahead of each round (kernels/timing.cu, its own module).
    source = tmp_path / "timing.cu"
    source.write_text(cupy_backend.timing_source())
    ptx = tmp_path / "timing.ptx"
    result = subprocess.run(["nvcc", "--ptx", "-arch=sm_90", str(source), "-o", str(ptx)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    text = ptx.read_text()
    assert f".entry {cupy_backend.SPIN_KERNEL}(" in text and "%globaltimer" in text


def find_libnvrtc() -> str | None:
    candidates = [os.environ.get("SERVESIM_NVRTC"), ctypes.util.find_library("nvrtc")]
    try:
        import nvidia.cuda_nvrtc  # the pip package CuPy wheels pair with

        lib_dir = Path(list(nvidia.cuda_nvrtc.__path__)[0]) / "lib"
        candidates += sorted(str(p) for p in lib_dir.glob("libnvrtc.so*"))
    except ImportError:
        pass
    return next((c for c in candidates if c), None)


@pytest.mark.slow  # (NVRTC compiles every instantiation, as nvcc does)
@pytest.mark.skipif(find_libnvrtc() is None, reason="libnvrtc not found (set SERVESIM_NVRTC to its path)")
@pytest.mark.parametrize("storage_name", STORAGE_NAMES)
def test_kernels_compile_with_nvrtc_name_expressions(storage_name):
    lib = ctypes.CDLL(find_libnvrtc())

    def compile_module(names: list[str], code: str | None = None) -> tuple[int, str]:
        prog = ctypes.c_void_p()
        source = (code or cupy_backend.kernel_source()).encode()
        assert lib.nvrtcCreateProgram(ctypes.byref(prog), source, b"servesim.cu", 0, None, None) == 0
        for name in names:
            assert lib.nvrtcAddNameExpression(prog, name.encode()) == 0
        options = (ctypes.c_char_p * 1)(b"--gpu-architecture=compute_80")
        status = lib.nvrtcCompileProgram(prog, 1, options)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if status == 0:
            for name in names:
                lowered = ctypes.c_char_p()
                assert lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(lowered)) == 0
                assert lowered.value
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        return status, log.value.decode(errors="replace")

    for head_dim in cupy_backend.HEAD_DIMS:
        status, log = compile_module(cupy_backend.name_expressions(storage_name, head_dim))
        assert status == 0, log
    status, log = compile_module(cupy_backend.write_kv_name_expressions())
    assert status == 0, log
    status, log = compile_module([cupy_backend.SPIN_KERNEL],
                                 cupy_backend.timing_source())
    assert status == 0, log
