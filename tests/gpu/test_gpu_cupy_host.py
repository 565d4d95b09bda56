"""The CuPy backend's host side without CUDA: how it compiles and looks up kernels (a stand-in
for cupy.RawModule counts the compiles)."""

import ctypes
import shutil
import subprocess
from types import SimpleNamespace

import pytest

from gpu import cupy_backend
from gpu.errors import KernelError


@pytest.fixture
def fake_cupy(monkeypatch):
    log = SimpleNamespace(modules=[], lookups=[], fail=False)

    class RawModule:
        def __init__(self, code, name_expressions):
            log.modules.append((code, list(name_expressions)))

        def get_function(self, name):  # where CuPy compiles, on the first lookup
            log.lookups.append(name)
            if log.fail:
                raise RuntimeError("nvrtc: error: identifier \"__nope\" is undefined")
            return SimpleNamespace(name=name)

    monkeypatch.setattr(cupy_backend, "_cupy", lambda: SimpleNamespace(RawModule=RawModule))
    for cache in ("_modules", "_functions", "_compile_errors"):
        monkeypatch.setattr(cupy_backend, cache, {})
    return log


def test_a_module_that_failed_to_compile_fails_at_once_after(fake_cupy):
    # CuPy keeps no record of a failed compile: each lookup would compile the whole source again
    # (seconds each, for every launch of the self-check's remaining cases).
    fake_cupy.fail = True
    key = ("float16", 128, 16)
    for _ in range(3):
        with pytest.raises(KernelError, match="is undefined"):
            cupy_backend._kernel(key, "paged_prefill_kernel<F16, 128>")
    assert len(fake_cupy.lookups) == 1


def test_each_kernel_is_looked_up_once(fake_cupy):
    key = ("float16", 128, 16)
    names = cupy_backend.name_expressions(*key)
    for _ in range(3):
        for name in names:
            assert cupy_backend._kernel(key, name).name == name
    assert fake_cupy.lookups == names and len(fake_cupy.modules) == 1


def test_the_spin_kernel_is_its_own_module(fake_cupy):
    launched = []
    cupy_backend._functions[(("spin", 0, 0), cupy_backend.SPIN_KERNEL)] = (
        lambda grid, block, args: launched.append((grid, block, [int(a) for a in args])))
    cupy_backend.spin(0.0025)
    assert launched == [((1, 1, 1), (1,), [2_500_000])]
    cupy_backend._functions.clear()
    cupy_backend._kernel(("spin", 0, 0), cupy_backend.SPIN_KERNEL)
    ((code, names),) = fake_cupy.modules
    assert names == ["servesim_spin"] and "globaltimer" in code and "paged_decode" not in code


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build a stand-in library")
def test_a_cuda_library_from_a_pip_wheel_is_preloaded_by_its_soname(tmp_path):
    # CuPy opens libnvrtc.so.<major> by name; torch's wheels install it under
    # site-packages/nvidia/*/lib, where the dynamic linker does not look.
    from gpu.backend import preload_wheel_libraries

    lib = tmp_path / "site" / "nvidia" / "cu97" / "lib"
    lib.mkdir(parents=True)
    src = tmp_path / "x.c"
    src.write_text("int servesim_probe(void) { return 7; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libnvrtc.so.97", "-o",
                    str(lib / "libnvrtc.so.97.1"), str(src)], check=True)
    with pytest.raises(OSError):
        ctypes.CDLL("libnvrtc.so.97")
    assert preload_wheel_libraries(97, roots=[str(tmp_path / "site")]) == [str(lib / "libnvrtc.so.97.1")]
    assert ctypes.CDLL("libnvrtc.so.97").servesim_probe() == 7  # found by name now
    assert preload_wheel_libraries(97, roots=[str(tmp_path / "site")]) == []  # already there
