"""Compute backends (NumPy on the CPU, CuPy on a CUDA device) and dispatch on array type.

`get_backend` picks one by name; the module-level kernel functions in `gpu` pick the backend
from the type of their first array argument, so a caller holding CuPy arrays gets the CUDA
kernels and one holding NumPy arrays gets the CPU ones, with the same signatures.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType

import numpy as np

from . import numpy_backend
from .errors import BackendUnavailable, first_line

BACKEND_NAMES = ("auto", "numpy", "cupy")


@dataclass(frozen=True)
class Backend:
    """One compute backend: `name` ("numpy" or "cupy"), `device` (a human-readable device name),
    `xp` (the array module) and `kernels` (the module with the attention and KV-write functions).
    """

    name: str
    device: str
    xp: ModuleType
    kernels: ModuleType

    def asarray(self, array, dtype=None):
        """Returns `array` on this backend's device."""
        return self.xp.asarray(array, dtype=dtype)

    def to_host(self, array) -> np.ndarray:
        """Returns `array` as a NumPy array on the host."""
        return array.get() if self.name == "cupy" else np.asarray(array)

    def synchronize(self) -> None:
        """Waits for all queued device work (a no-op on the CPU)."""
        if self.name == "cupy":
            self.xp.cuda.get_current_stream().synchronize()


_NUMPY = Backend("numpy", "cpu (numpy)", np, numpy_backend)
_cupy_backend: Backend | None = None


# The CUDA libraries CuPy opens by name at run time (NVRTC for every kernel, its own included;
# cuRAND and cuBLAS for random numbers and matmuls).
CUDA_LIBRARIES = ("nvrtc", "curand", "cublas")


def cupy_cuda_major() -> int | None:
    """The CUDA major version the installed CuPy wheel is built for (cupy-cuda12x: 12), read
    from its package name without importing it; None when that says nothing."""
    for dist in ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x"):
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        return int(dist[len("cupy-cuda"):-1])
    return None


def preload_wheel_libraries(major: int, roots=None) -> list[str]:
    """Loads (RTLD_GLOBAL) each of CUDA_LIBRARIES of CUDA `major` that the dynamic linker cannot
    find by name but a pip wheel holds (`nvidia/*/lib/lib<name>.so.<major>` under `roots`,
    default sys.path): CuPy then finds it already loaded by its soname. torch's CUDA wheels
    install these without putting them on the linker's path. Returns the paths loaded."""
    loaded = []
    for name in CUDA_LIBRARIES:
        soname = f"lib{name}.so.{major}"
        try:
            ctypes.CDLL(soname)
            continue  # the linker finds it: nothing to do
        except OSError:
            pass
        for root in roots if roots is not None else sys.path:
            hits = sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", soname + "*")))
            if hits:
                try:
                    ctypes.CDLL(hits[0], mode=ctypes.RTLD_GLOBAL)
                    loaded.append(hits[0])
                except OSError:
                    continue
                break
    return loaded


def _probe_cupy() -> Backend:
    global _cupy_backend
    if _cupy_backend is not None:
        return _cupy_backend
    major = cupy_cuda_major()
    if major is not None:
        preload_wheel_libraries(major)
    try:
        import cupy  # (lazy: optional; loads only when a CUDA backend is asked for)
    except Exception as exc:  # ImportError, or a broken CUDA install failing at import
        raise BackendUnavailable(f"cupy backend unavailable: cannot import cupy ({type(exc).__name__}: {exc})") from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        if count < 1:
            raise RuntimeError("no CUDA device")
        device_id = cupy.cuda.Device().id
        props = cupy.cuda.runtime.getDeviceProperties(device_id)
        int(cupy.arange(4).sum())  # a real allocation and launch: the driver works
    except Exception as exc:
        message = first_line(exc)
        if "failed to load" in message or "cannot open shared object" in message:
            # (CuPy compiles even its own kernels with NVRTC: the device may be fine)
            raise BackendUnavailable(f"cupy backend unavailable: a CUDA library CuPy needs cannot be "
                                     f"loaded ({message}); put its folder on LD_LIBRARY_PATH") from None
        raise BackendUnavailable(f"cupy backend unavailable: no usable CUDA device ({message})") from None
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    from . import cupy_backend  # (lazy: the CUDA kernels, once CuPy has a device)

    _cupy_backend = Backend("cupy", f"{name} (cuda:{device_id})", cupy, cupy_backend)
    return _cupy_backend


def get_backend(kind: str = "auto") -> Backend:
    """Returns the backend called `kind`: "numpy", "cupy", or "auto" (CuPy when a CUDA device
    is usable, else NumPy).

    Raises:
        BackendUnavailable: "cupy" was asked for and CuPy or a CUDA device is missing.
        ValueError: `kind` is not one of BACKEND_NAMES.
    """
    if kind == "numpy":
        return _NUMPY
    if kind == "cupy":
        return _probe_cupy()
    if kind == "auto":
        try:
            return _probe_cupy()
        except BackendUnavailable:
            return _NUMPY
    raise ValueError(f"backend {kind!r}: use one of {', '.join(BACKEND_NAMES)}")


def kernels_for(array) -> ModuleType:
    """Returns the kernel module matching `array`'s type (numpy.ndarray or cupy.ndarray).

    Raises:
        TypeError: `array` is neither.
    """
    if isinstance(array, np.ndarray):
        return numpy_backend
    if type(array).__module__.split(".")[0] == "cupy":
        from . import cupy_backend  # (lazy: the CUDA kernels, for CuPy arrays only)

        return cupy_backend
    raise TypeError(f"expected a numpy or cupy array, got {type(array).__name__}")


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None, **options):
    """Decode attention: each sequence's one query token against its paged K/V.

    q: [num_seqs, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables: [num_seqs, max_blocks_per_seq] int32; seq_lens: [num_seqs] int32 (tokens in the
    cache, the query's own included). `scale` defaults to 1/sqrt(head_dim). Options: `out` (a
    buffer to fill), `max_seq_len` (saves a device sync on CuPy), `split_k` (None = decode.cu's
    per-sequence rule, False = never, True = from short lengths on; CuPy only), `partition_size`
    (CuPy: fixed split-K partitions of that many tokens instead of the rule).

    Returns [num_seqs, num_heads, head_dim] in q's dtype.
    """
    return kernels_for(q).paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, **options)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale=None, **options):
    """Causal attention of a variable-length batch of prefill chunks over the paged cache.

    q: [total_q_tokens, num_heads, head_dim], the chunks back to back; cu_seqlens_q:
    [num_seqs + 1] int32 chunk offsets into q; seq_lens: [num_seqs] int32 tokens in the cache,
    the chunk's own K/V included (written first, with write_kv). Chunk s's query j sits at
    position seq_lens[s] - q_len_s + j and sees keys 0 .. that position. Options: `out`,
    `max_q_len` (saves a device sync on CuPy).

    Returns [total_q_tokens, num_heads, head_dim] in q's dtype.
    """
    return kernels_for(q).paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                                                  scale, **options)


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Writes new K/V rows into the paged caches in place.

    k, v: [num_tokens, num_kv_heads, head_dim], same dtype as the caches; slot_mapping:
    [num_tokens] int64, slot = block_id * block_size + offset; negative slots are skipped.
    """
    kernels_for(k).write_kv(k, v, k_cache, v_cache, slot_mapping)
