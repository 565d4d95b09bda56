"""CPU emulation of gpu/kernels/*.cu behind a NumPy-backed stand-in for CuPy.

`install(cupy_backend)` points `gpu.cupy_backend` at a `FakeCupy`, so the backend's own host code
(grids, split-K choice, argument packing, write_kv word choice) runs unchanged. Its `RawModule`
does what NVRTC does for CuPy: it compiles the very source text and name expressions it is given,
here with g++ and `cuda_emu.h` into a shared library (cached on disk by a hash of everything that
goes into it), and launches kernels in the fiber runtime of `emu_runtime.cpp`.

"Device" arrays live in guarded memory: each sits against a PROT_NONE page (its end by default,
its start with guard_mode=1), so a kernel that reads or writes outside an array faults and the
runtime names the array and the CUDA thread, then exits the process with status 86: run cases
that may fault in a subprocess (`run.py` does). `empty` / `empty_like` fill with 0xff bytes (NaN
for floats), as uninitialised device memory could hold, so unwritten outputs show.

Needs x86-64 Linux, g++ >= 12 (`_Float16`, `__builtin_bit_cast`) and `nm`; `unavailable()` says
why not when they are missing. Build outputs go to $SERVESIM_EMU_BUILD (default: the temp dir).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

HERE = Path(__file__).resolve().parent
BUILD = Path(os.environ.get("SERVESIM_EMU_BUILD") or Path(tempfile.gettempdir()) / f"servesim-cuda-emu-{os.getuid()}")

FLAGS = ["-std=c++17", "-fPIC", "-shared", "-march=x86-64-v2", "-fno-strict-aliasing", "-DSERVESIM_CPU_EMULATION",
         "-Wall", "-Wno-unknown-pragmas", "-Wno-unused-variable", "-Wno-unused-but-set-variable",
         "-Wno-unused-function", "-I", str(HERE)]
VARIANTS = {
    "opt": ["-O2", "-g"],
    "ubsan": ["-O1", "-g", "-fsanitize=undefined,bounds-strict,float-cast-overflow,float-divide-by-zero",
              "-fno-sanitize=vptr", "-fsanitize-recover=all", "-fno-omit-frame-pointer"],
}

_SCALAR_CODES = {
    np.dtype(np.int32): ("i", ctypes.c_int32), np.dtype(np.uint32): ("I", ctypes.c_uint32),
    np.dtype(np.int64): ("q", ctypes.c_int64), np.dtype(np.uint64): ("Q", ctypes.c_uint64),
    np.dtype(np.float32): ("f", ctypes.c_float), np.dtype(np.float64): ("d", ctypes.c_double),
    np.dtype(np.bool_): ("?", ctypes.c_bool), np.dtype(np.int16): ("h", ctypes.c_int16),
    np.dtype(np.uint16): ("H", ctypes.c_uint16),
}


class EmulatorError(RuntimeError):
    """A launch the emulator refused or a kernel that failed at run time (deadlock, divergence...)."""


def unavailable() -> str | None:
    """Why the emulator cannot be built here, or None when it can."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the CUDA emulator needs x86-64 Linux (this is {platform.system()} {platform.machine()})"
    for tool in ("g++", "nm"):
        if shutil.which(tool) is None:
            return f"the CUDA emulator needs {tool} on PATH"
    try:
        major = int(subprocess.run(["g++", "-dumpversion"], capture_output=True, text=True,
                                   timeout=30).stdout.split(".")[0])
    except (ValueError, OSError, subprocess.SubprocessError):
        return "the CUDA emulator needs g++ >= 12 (g++ -dumpversion failed)"
    if major < 12:
        return f"the CUDA emulator needs g++ >= 12 (found {major})"
    return None


def _compiler_id() -> str:
    return subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout.splitlines()[0]


def _compile(cpp_text: str, out: Path, flags: list[str], extra_sources=()) -> Path:
    """Compiles `cpp_text` (+ extra sources) into the shared library `out`, atomically."""
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(".cpp")
    src.write_text(cpp_text)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    cmd = ["g++", *FLAGS, *flags, "-include", "cuda_emu.h", str(src), *map(str, extra_sources), "-o", str(tmp)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise EmulatorError(f"g++ failed for {out.name}:\n{r.stderr[-6000:]}")
    os.replace(tmp, out)
    return out


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


class Emulator:
    """The loaded runtime (one per process) and the modules compiled against it."""

    def __init__(self, variant: str = "opt", guard_mode: int = 0, build_dir: Path | None = None):
        reason = unavailable()
        if reason:
            raise EmulatorError(reason)
        self.variant = variant
        self.build_dir = Path(build_dir or BUILD)
        self.compiler = _compiler_id()
        runtime = (HERE / "emu_runtime.cpp").read_text()
        header = (HERE / "cuda_emu.h").read_text()
        key = _digest(runtime, header, " ".join(FLAGS + VARIANTS[variant]), self.compiler)
        path = self.build_dir / f"libemu_rt_{variant}_{key}.so"
        if not path.exists():
            _compile("", path, VARIANTS[variant], [HERE / "emu_runtime.cpp"])
        # RTLD_GLOBAL: modules leave the runtime's symbols undefined and find them here.
        lib = self.lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        lib.emu_guard_alloc.restype = ctypes.c_void_p
        lib.emu_guard_alloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_char_p]
        lib.emu_guard_free.argtypes = [ctypes.c_void_p]
        lib.emu_launch.restype = ctypes.c_int
        lib.emu_launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [ctypes.POINTER(ctypes.c_void_p),
                                                                              ctypes.c_char_p]
        for f in ("emu_errors", "emu_warnings", "emu_entry_name", "emu_entry_sig"):
            getattr(lib, f).restype = ctypes.c_char_p
        lib.emu_entry_name.argtypes = lib.emu_entry_sig.argtypes = [ctypes.c_void_p]
        lib.emu_set_options.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_ulonglong]
        lib.emu_register_shared.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.emu_stat.restype = ctypes.c_longlong
        lib.emu_stat.argtypes = [ctypes.c_int]
        lib.emu_install_fault_handler()
        self.guard_mode = guard_mode
        self.warning_log: list[str] = []
        self.launch_log: list[dict] = []
        self.modules_built = 0
        self._modules: dict[str, EmuModule] = {}
        self.set_options()

    def set_options(self, schedule: int = 0, block_order: int = 0, poison: bool = True, seed: int = 1) -> None:
        """schedule (thread order within a block) / block_order: 0 forward, 1 reverse, 2 random."""
        self.lib.emu_set_options(schedule, block_order, int(poison), seed)

    def module(self, code: str, names: list[str]) -> "EmuModule":
        """The module for `code` and its name expressions, compiled on first use (cached on disk)."""
        key = _digest(code, "\n".join(names), (HERE / "cuda_emu.h").read_text(),
                      " ".join(FLAGS + VARIANTS[self.variant]), self.compiler)
        module = self._modules.get(key)
        if module is None:
            path = self.build_dir / f"module_{self.variant}_{key}.so"
            if not path.exists():
                table = ",\n".join(f'    EMU_KERNEL("{n}", {n})' for n in names)
                _compile(code + f"\n\nEMU_MODULE_TABLE(\n{table}\n)\n", path, VARIANTS[self.variant])
                self.modules_built += 1
            module = self._modules[key] = EmuModule(self, path)
        return module

    def launch(self, entry: int, name: str, shared_bytes: int, grid, block, args) -> None:
        if shared_bytes > 48 * 1024:  # CUDA's limit for static __shared__
            raise EmulatorError(f"{name}: {shared_bytes} bytes of static shared memory exceed 48 KiB")
        holders, sig = [], ""
        for a in args:
            if isinstance(a, DeviceArray):
                holders.append(ctypes.c_void_p(a.data.ptr))
                sig += "p"
            elif isinstance(a, np.ndarray):
                raise TypeError(f"{name}: a host numpy array was passed to a kernel")
            elif isinstance(a, np.generic):
                code, ctype = _SCALAR_CODES[a.dtype]
                holders.append(ctype(a.item()))
                sig += code
            elif isinstance(a, bool):
                holders.append(ctypes.c_bool(a))
                sig += "?"
            elif isinstance(a, int):  # CuPy passes a Python int as int64
                holders.append(ctypes.c_int64(a))
                sig += "q"
            elif isinstance(a, float):
                holders.append(ctypes.c_double(a))
                sig += "d"
            else:
                raise TypeError(f"{name}: unsupported kernel argument {type(a)}")
        params = (ctypes.c_void_p * max(1, len(holders)))(*[ctypes.addressof(h) for h in holders])
        g = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
        b = tuple(int(x) for x in block) + (1,) * (3 - len(block))
        rc = self.lib.emu_launch(entry, *g, *b, params, sig.encode())
        warnings = self.lib.emu_warnings().decode()
        self.launch_log.append({"name": name, "grid": g, "block": b, "switches": self.lib.emu_stat(0),
                                "collectives": self.lib.emu_stat(1), "barriers": self.lib.emu_stat(2)})
        if warnings:
            self.warning_log.append(f"{name} grid={g} block={b}: {warnings.strip()}")
        if rc:
            raise EmulatorError(f"{name} grid={g} block={b}: {self.lib.emu_errors().decode().strip()}")


class EmuModule:
    """One compiled module: its kernels by name expression, and their __shared__ variables
    registered with the runtime (found with nm: a kernel's static locals), so that the runtime
    fills them with NaN bytes before every block."""

    def __init__(self, emu: Emulator, path: Path):
        self.emu = emu
        lib = self.lib = ctypes.CDLL(str(path))
        lib.emu_module_entry.restype = ctypes.c_void_p
        lib.emu_module_entry.argtypes = [ctypes.c_int]
        self.entries = {}
        for i in range(lib.emu_module_count()):
            entry = lib.emu_module_entry(i)
            self.entries[emu.lib.emu_entry_name(entry).decode()] = entry
        self.shared_bytes: dict[str, int] = {}

        def nm(*flags):
            out = subprocess.run(["nm", "-S", "--defined-only", *flags, str(path)], capture_output=True, text=True,
                                 check=True).stdout
            return out.splitlines()

        raw, demangled = nm(), nm("-C")
        addr_of = {p[-1]: int(p[0], 16) for p in (line.split() for line in raw) if len(p) >= 3}
        base = ctypes.cast(lib.emu_module_entry, ctypes.c_void_p).value - addr_of["emu_module_entry"]
        for line in demangled:
            m = re.match(r"^([0-9a-f]+) ([0-9a-f]+) ([uUbBdD]) (\w+<.*>)\(.*\)::(\w+)$", line)
            if m and m.group(4) in self.entries:
                kernel = m.group(4)
                emu.lib.emu_register_shared(self.entries[kernel], base + int(m.group(1), 16), int(m.group(2), 16))
                self.shared_bytes[kernel] = self.shared_bytes.get(kernel, 0) + int(m.group(2), 16)


class _Data:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def copy_from_device_async(self, src: "_Data", nbytes: int) -> None:
        ctypes.memmove(self.ptr, src.ptr, nbytes)


class DeviceArray(np.ndarray):
    """A NumPy array (in guarded memory when the fake allocated it), with CuPy's `.data.ptr`."""

    @property
    def data(self):  # noqa: D401 - CuPy's MemoryPointer has .ptr
        return _Data(self.__array_interface__["data"][0])

    def get(self) -> np.ndarray:
        return np.array(self)


class _Mem:
    """Guarded allocation; freed when the last array viewing it goes."""

    def __init__(self, emu: Emulator, nbytes: int, align: int, name: str):
        self.emu = emu
        self.ptr = emu.lib.emu_guard_alloc(nbytes, align, emu.guard_mode, name.encode())
        if not self.ptr:
            raise MemoryError(f"guarded allocation of {nbytes} bytes failed")
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}

    def __del__(self):
        self.emu.lib.emu_guard_free(self.ptr)


class _Event:
    """perf_counter stand-in for cupy.cuda.Event (kernels run synchronously here)."""

    def __init__(self):
        self.t = 0.0

    def record(self, stream=None):
        import time

        self.t = time.perf_counter()

    def synchronize(self):
        pass


class FakeCupy:
    """The `cupy` names gpu/ uses; anything else falls through to NumPy (results of NumPy
    operations on device arrays stay `DeviceArray`s, in ordinary memory)."""

    float16, float32, float64 = np.float16, np.float32, np.float64
    int32, int64, uint16, uint32 = np.int32, np.int64, np.uint16, np.uint32
    ndarray = DeviceArray
    __name__ = "cupy"
    __version__ = "emulator"

    def __init__(self, emu: Emulator, num_sms: int = 8):
        self.emu = emu
        stream = SimpleNamespace(synchronize=lambda: None)
        # A small "L2" so that the self-check's cold-cache rotation is exercised at tiny shapes.
        props = {"name": b"CPU emulator (servesim tests)", "multiProcessorCount": num_sms, "l2CacheSize": 1 << 16}
        runtime = SimpleNamespace(getDeviceCount=lambda: 1, getDeviceProperties=lambda i: dict(props))
        self.cuda = SimpleNamespace(get_current_stream=lambda: stream, Event=_Event, runtime=runtime,
                                    Device=lambda *a: SimpleNamespace(id=0),
                                    get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3)
        self.random = SimpleNamespace(RandomState=lambda seed: _RandomState(self, seed))

    def __getattr__(self, name):
        return getattr(np, name)

    # -- allocation -------------------------------------------------------------------------
    def _new(self, shape, dtype, name: str = "array", fill: int | None = 0xFF) -> DeviceArray:
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        n = int(np.prod(shape, dtype=np.int64))
        nbytes = n * dtype.itemsize
        mem = _Mem(self.emu, nbytes, 16 if nbytes % 16 == 0 else dtype.itemsize, name)
        flat = np.asarray(mem)
        if fill is not None:
            flat[...] = fill
        return flat[:nbytes].view(dtype).reshape(shape).view(DeviceArray)

    def _from_host(self, a, name="array") -> DeviceArray:
        a = np.ascontiguousarray(a)
        out = self._new(a.shape, a.dtype, name, fill=None)
        np.copyto(np.asarray(out).view(a.dtype), a, casting="no")
        return out

    def empty(self, shape, dtype=np.float64) -> DeviceArray:
        return self._new(shape, dtype, "empty")

    def empty_like(self, a) -> DeviceArray:
        return self._new(a.shape, a.dtype, "empty_like")

    def zeros(self, shape, dtype=np.float64) -> DeviceArray:
        return self._new(shape, dtype, "zeros", fill=0)

    def ones(self, shape, dtype=np.float64) -> DeviceArray:
        out = self._new(shape, dtype, "ones", fill=0)
        out[...] = 1
        return out

    def arange(self, *args, **kwargs) -> DeviceArray:
        return self._from_host(np.arange(*args, **kwargs))

    def asarray(self, a, dtype=None) -> DeviceArray:
        if isinstance(a, DeviceArray) and (dtype is None or np.dtype(dtype) == a.dtype):
            return a
        return self._from_host(np.asarray(np.asarray(a), dtype=dtype))

    def ascontiguousarray(self, a, dtype=None) -> DeviceArray:
        if isinstance(a, DeviceArray) and a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
            return a
        return self._from_host(np.ascontiguousarray(np.asarray(a), dtype=dtype))

    # -- kernels ------------------------------------------------------------------------------
    def RawModule(self, code: str, name_expressions=(), options=(), **_):  # noqa: N802 - CuPy's name
        return FakeRawModule(self.emu, code, list(name_expressions))


class _RandomState:
    def __init__(self, fake: FakeCupy, seed: int):
        self.fake, self.rng = fake, np.random.default_rng(seed)

    def standard_normal(self, shape, dtype=np.float64):
        return self.fake._from_host(self.rng.standard_normal(shape, dtype=dtype))


class FakeRawModule:
    """cupy.RawModule: compiles `code` with exactly `names` as NVRTC would, but with g++."""

    def __init__(self, emu: Emulator, code: str, names: list[str]):
        self.emu, self.names = emu, names
        self.module = emu.module(code, names)

    def get_function(self, name: str):
        if name not in self.names:
            raise EmulatorError(f"{name} is not among the module's name_expressions")
        emu, entry, shared = self.emu, self.module.entries[name], self.module.shared_bytes.get(name, 0)

        def kernel(grid, block, args, **_):
            emu.launch(entry, name, shared, grid, block, args)
        return kernel


def install(cupy_backend, emu: Emulator, num_sms: int = 8) -> FakeCupy:
    """Points cupy_backend at a FakeCupy over `emu` (and forgets modules compiled before)."""
    fake = FakeCupy(emu, num_sms)
    cupy_backend._cupy = lambda: fake
    for cache in ("_modules", "_functions", "_compile_errors", "_device_info"):
        getattr(cupy_backend, cache, {}).clear()
    return fake
