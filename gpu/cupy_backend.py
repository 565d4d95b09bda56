"""CuPy backend: the CUDA kernels of `gpu/kernels/*.cu`, compiled by NVRTC through cupy.RawModule.

CuPy is imported on first use, never at module import, so this module (and its source helpers,
which the tests use to compile the kernels with nvcc) loads on a machine without CUDA.

Kernels are templates instantiated per (storage, head_dim, block_size): `name_expressions` lists
them, and one RawModule per triple is compiled the first time a kernel of it is needed, once per
process (CuPy does not read its on-disk cache for modules with `name_expressions`, so a new process
compiles again: about 1-4 s a module). A compile that fails is not tried again: later calls raise
the same `KernelError` at once. block_size must be a power of two (BLOCK_SIZES): the decode kernel's position
arithmetic is a shift and a mask.
Every launch goes through `_launch`, which checks the grid against CUDA's limits and turns a
launch failure into a `KernelError` naming the kernel; with `set_sync_check(True)` (or
SERVESIM_CUDA_SYNC=1) it also synchronises after each launch so that a fault is pinned on the
kernel that caused it.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import numpy as np

from .dtypes import storage_of
from .errors import BackendUnavailable, KernelError

KERNEL_DIR = Path(__file__).parent / "kernels"
KERNEL_FILES = ("decode.cu", "prefill.cu", "write_kv.cu")
TIMING_FILE = "timing.cu"  # the spin kernel timed benchmarks queue ahead of a round (its own module)
SPIN_KERNEL = "servesim_spin"
HEAD_DIMS = (32, 64, 128, 256)
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Query heads one decode block serves; the largest that divides the GQA group is used.
HEADS_PER_BLOCK = (8, 4, 2, 1)
# Split-K (see decode.cu): a sequence is cut into at most target_splits partitions of at least
# MIN_PARTITION tokens, rounded up to PARTITION_GRANULE; target_splits is sized so that one
# sequence alone keeps SPLIT_BLOCKS_PER_SM thread blocks per SM busy. The rule reads only the
# sequence's own length and the device, so a sequence's result never depends on its batch.
MIN_PARTITION = 256
PARTITION_GRANULE = 64
SPLIT_BLOCKS_PER_SM = 2
MAX_SPLITS = 64
DECODE_THREADS = 128
# fp32 decode runs on tensor cores (3xTF32) from this many heads per block on, by head_dim:
# below it the CUDA-core kernel issues fewer instructions per byte loaded (`servesim bench
# kernel --static`), as 3xTF32's splits and its 16-row products cost the same at 1 head as at 8.
FP32_MMA_MIN_HEADS = {32: 4, 64: 4, 128: 2, 256: 2}
PREFILL_THREADS = 128
LOG2E = 1.4426950408889634
_NO_SPLIT_PARTITION = 1 << 30
_TAGS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.MULTILINE)

_sync_check = os.environ.get("SERVESIM_CUDA_SYNC", "") == "1"
_modules: dict[tuple, object] = {}
_functions: dict[tuple, object] = {}  # (module key, kernel name) -> the compiled kernel
_compile_errors: dict[tuple, str] = {}  # module key -> why it did not compile
_device_info: dict = {}  # (device_property: the current device's properties)


def set_sync_check(enabled: bool) -> None:
    """Synchronise after every launch (slow, exact fault attribution) when `enabled`."""
    global _sync_check
    _sync_check = enabled


def timing_source() -> str:
    """The spin kernel's CUDA source (kernels/timing.cu: the self-check's timing only)."""
    return (KERNEL_DIR / TIMING_FILE).read_text()


def kernel_source() -> str:
    """Returns the kernels as one self-contained CUDA source (local includes inlined).

    Inlining, rather than passing an include path to NVRTC, makes the source text the whole
    input: nothing the compile reads can differ from what a cache keyed by the text saw.
    """

    def inline(text: str) -> str:
        return _INCLUDE.sub(lambda m: (KERNEL_DIR / m.group(1)).read_text(), text)

    return "\n".join(inline((KERNEL_DIR / name).read_text()) for name in KERNEL_FILES)


def decode_kernel_name(storage_name: str, head_dim: int, heads_per_block: int, block_size: int) -> str:
    """The decode instantiation for a storage: tensor cores (mma.sync) for fp16 / bf16, and for
    fp32 from FP32_MMA_MIN_HEADS heads per block on (in 3xTF32, decode.cu: fp32's accuracy where
    plain tf32 would round K and V); CUDA cores for fp32 below that."""
    cuda_cores = storage_name == "float32" and heads_per_block < FP32_MMA_MIN_HEADS[head_dim]
    kernel = "paged_decode_kernel" if cuda_cores else "paged_decode_mma_kernel"
    return f"{kernel}<{_TAGS[storage_name]}, {head_dim}, {heads_per_block}, {block_size}>"


def name_expressions(storage_name: str, head_dim: int, block_size: int = 16) -> list[str]:
    """Returns the template instantiations compiled for one (storage, head_dim, block_size) module."""
    tag = _TAGS[storage_name]
    names = [decode_kernel_name(storage_name, head_dim, g, block_size) for g in HEADS_PER_BLOCK]
    names.append(f"paged_decode_reduce_kernel<{tag}>")
    names.append(f"paged_prefill_kernel<{tag}, {head_dim}>")
    return names


WRITE_KV_WORDS = {16: "uint4", 4: "unsigned int", 2: "unsigned short"}


def write_kv_name_expressions() -> list[str]:
    """Returns the write_kv instantiations, one per copy word size."""
    return [f"write_kv_kernel<{w}>" for w in WRITE_KV_WORDS.values()]


def module_keys(block_sizes=(16,)) -> list[tuple]:
    """The modules a run may compile: write_kv, and (storage, head_dim, block_size) for each
    storage and head_dim and the given block sizes (the static bench and the tests list
    every instantiation from here)."""
    keys: list[tuple] = [("write_kv", 0, 0)]
    for storage_name in _TAGS:
        keys += [(storage_name, hd, bs) for hd in HEAD_DIMS for bs in block_sizes]
    return keys


def _cupy():
    try:
        import cupy  # (lazy: optional; loads only when a CUDA kernel runs)
    except ImportError as exc:
        raise BackendUnavailable(f"cupy backend unavailable: cupy is not installed ({exc})") from None
    return cupy


def _module(key: tuple[str, int, int]):
    module = _modules.get(key)
    if module is None:
        cp = _cupy()
        if key[0] == "spin":
            code, names = timing_source(), [SPIN_KERNEL]
        else:
            code = kernel_source()
            names = write_kv_name_expressions() if key[0] == "write_kv" else name_expressions(*key)
        module = cp.RawModule(code=code, name_expressions=names)
        _modules[key] = module
    return module


def _kernel(key: tuple[str, int, int], name: str):
    """The compiled kernel `name` of module `key`, looked up once (a `get_function` call builds a
    new kernel object each time). A module that failed to compile raises at once: CuPy keeps
    no record of a failure and would compile the whole source again on every call."""
    function = _functions.get((key, name))
    if function is not None:
        return function
    if key in _compile_errors:
        raise KernelError(f"{name}: compile failed (earlier in this process): {_compile_errors[key]}")
    try:
        function = _module(key).get_function(name)
    except Exception as exc:  # NVRTC compile errors surface here, with the log in the message
        _compile_errors[key] = f"{type(exc).__name__}: {exc}"
        raise KernelError(f"{name}: compile failed: {exc}") from exc
    _functions[(key, name)] = function
    return function


def _launch(kernel, name: str, grid: tuple[int, int, int], block: int, args: tuple) -> None:
    if min(grid) <= 0:
        return  # nothing to do (an empty batch)
    if grid[0] >= 2**31 or grid[1] > 65535 or grid[2] > 65535:
        raise KernelError(f"{name}: grid {grid} exceeds CUDA's limits")
    try:
        kernel(grid, (block,), args)
    except Exception as exc:
        raise KernelError(f"{name} grid={grid} block={block}: launch failed: {exc}") from exc
    if _sync_check:
        try:
            _cupy().cuda.get_current_stream().synchronize()
        except Exception as exc:
            raise KernelError(f"{name} grid={grid} block={block}: faulted: {exc}") from exc


def spin(seconds: float) -> None:
    """Queues a kernel that keeps the device busy for `seconds` (kernels/timing.cu): launches
    queued behind it start back to back once it ends, however slowly the host queued them."""
    ns = np.uint64(max(0, int(seconds * 1e9)))
    _launch(_kernel(("spin", 0, 0), SPIN_KERNEL), SPIN_KERNEL, (1, 1, 1), 1, (ns,))


def device_property(name: str, default=None):
    """A property of the current device (CUDA's cudaDeviceProp field `name`), read once."""
    if not _device_info:
        cp = _cupy()
        _device_info.update(cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id))
    value = _device_info.get(name, default)
    if value is None:
        raise KernelError(f"the device does not report {name}")
    return value


def _num_sms() -> int:
    """The current device's SM count: sizes split-K so one sequence fills the GPU."""
    return int(device_property("multiProcessorCount"))


def _check_cache(k_cache, v_cache) -> None:
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.shape} {k_cache.dtype} and v_cache {v_cache.shape} {v_cache.dtype} differ")
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not a.flags.c_contiguous or a.data.ptr % 16:
            raise ValueError(f"{name} must be C-contiguous and 16-byte aligned")
    if k_cache.ndim != 4 or k_cache.shape[3] not in HEAD_DIMS or k_cache.shape[1] not in BLOCK_SIZES:
        raise ValueError(f"cache shape {k_cache.shape}: want [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"head_dim in {HEAD_DIMS}, block_size a power of two up to {BLOCK_SIZES[-1]}")


def _device(cp, a, dtype=None):
    """`a` (host or device) as a C-contiguous device array of `dtype`."""
    return cp.ascontiguousarray(cp.asarray(a, dtype=dtype))


def _prepare_out(cp, out, q):
    if out is None:
        return cp.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous {q.shape} {q.dtype} array")
    return out


def _attention_inputs(cp, q, k_cache, v_cache, block_tables):
    _check_cache(k_cache, v_cache)
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} differs from the cache's {k_cache.dtype}")
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if q.shape[2] != k_cache.shape[3] or num_heads % num_kv_heads:
        raise ValueError(f"q {q.shape} does not fit cache {k_cache.shape} (head_dim, or heads not a multiple of kv heads)")
    q = _device(cp, q)
    if q.data.ptr % 16:  # the kernels read q rows as 16-byte vectors
        q = q.copy()
    return q, _device(cp, block_tables, cp.int32), storage_of(k_cache).name


def decode_tiles(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """(query heads per decode thread block, thread blocks per kv head): the largest of
    HEADS_PER_BLOCK that divides the GQA group, and the group's count of them."""
    group = num_heads // num_kv_heads
    per_block = next(g for g in HEADS_PER_BLOCK if group % g == 0)
    return per_block, group // per_block


def split_plan(max_seq_len: int, num_kv_heads: int, tiles_per_kv: int, *, split_k=None,
               partition_size=None) -> tuple[int, int, int, int]:
    """Returns (num_splits, target_splits, min_partition, granule) for decode.cu's split rule.

    num_splits (the grid's z) bounds every sequence's partition count when max_seq_len is at
    least the longest sequence. Default: target_splits from the SM count; partition_size: fixed
    partitions of that many tokens; split_k=False: one partition per sequence.
    """
    if split_k is False:
        return 1, 1, _NO_SPLIT_PARTITION, 1
    if partition_size is not None:
        if partition_size < 1:
            raise ValueError(f"partition_size {partition_size} must be >= 1")
        target, min_part, granule = _NO_SPLIT_PARTITION, int(partition_size), 1
    else:
        blocks = max(1, num_kv_heads * tiles_per_kv)
        target = max(1, min(MAX_SPLITS, -(-SPLIT_BLOCKS_PER_SM * _num_sms() // blocks)))
        min_part, granule = MIN_PARTITION, PARTITION_GRANULE
        if split_k is True:
            min_part = granule = PARTITION_GRANULE
    num_splits = max(1, min(target, -(-max(max_seq_len, 1) // min_part)))
    return num_splits, target, min_part, granule


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None, *, out=None,
                           max_seq_len=None, split_k=None, partition_size=None):
    """Decode attention over the paged cache; see `gpu` for shapes. Returns `out`.

    `max_seq_len` (at least max(seq_lens)) saves a device sync when given; a smaller value
    still gives right results (the kernels clamp) but may not be batch-invariant, and raises
    ValueError when sync checks are on. `split_k`: None splits long sequences as decode.cu's
    rule says, False never splits, True splits from PARTITION_GRANULE tokens on;
    `partition_size` fixes the partition length instead.
    """
    cp = _cupy()
    q, block_tables, sname = _attention_inputs(cp, q, k_cache, v_cache, block_tables)
    seq_lens = _device(cp, seq_lens, cp.int32)
    out = _prepare_out(cp, out, q)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    elif _sync_check and int(seq_lens.max()) > max_seq_len:
        raise ValueError(f"max_seq_len {max_seq_len} is below the longest sequence ({int(seq_lens.max())})")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    per_block, tiles = decode_tiles(num_heads, num_kv_heads)
    num_splits, target, min_part, granule = split_plan(max_seq_len, num_kv_heads, tiles, split_k=split_k,
                                                       partition_size=partition_size)
    if num_splits > 1:
        part_acc = cp.empty((num_seqs, num_heads, num_splits, head_dim), dtype=cp.float32)
        part_ml = cp.empty((num_seqs, num_heads, num_splits, 2), dtype=cp.float32)
    else:
        part_acc = part_ml = cp.empty((1,), dtype=cp.float32)
    key = (sname, head_dim, block_size)
    name = decode_kernel_name(sname, head_dim, per_block, block_size)
    grid = (num_seqs, num_kv_heads * tiles, num_splits)
    split_args = (np.int32(num_splits), np.int32(target), np.int32(min_part), np.int32(granule))
    args = (q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_ml,
            np.int32(num_heads), np.int32(num_kv_heads), np.int32(block_tables.shape[1]), *split_args,
            np.float32(scale * LOG2E))
    _launch(_kernel(key, name), name, grid, DECODE_THREADS, args)
    if num_splits > 1:
        name = f"paged_decode_reduce_kernel<{_TAGS[sname]}>"
        args = (part_acc, part_ml, seq_lens, out, np.int32(num_heads), np.int32(head_dim), *split_args)
        _launch(_kernel(key, name), name, (num_seqs, num_heads, 1), head_dim, args)
    return out


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale=None, *,
                            out=None, max_q_len=None):
    """Causal prefill attention over the paged cache; see `gpu` for shapes. Returns `out`.

    `max_q_len` (at least the longest chunk) saves a device sync when given.
    """
    cp = _cupy()
    q, block_tables, sname = _attention_inputs(cp, q, k_cache, v_cache, block_tables)
    cu_seqlens_q = _device(cp, cu_seqlens_q, cp.int32)
    seq_lens = _device(cp, seq_lens, cp.int32)
    out = _prepare_out(cp, out, q)
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    if max_q_len is None:
        max_q_len = int(cp.diff(cu_seqlens_q).max())
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    rows_per_block = 4 * min(8, 512 // head_dim)  # mirrors ROWS in prefill.cu
    group = num_heads // num_kv_heads
    grid = (-(-max_q_len * group // rows_per_block), num_kv_heads, num_seqs)
    name = f"paged_prefill_kernel<{_TAGS[sname]}, {head_dim}>"
    args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out,
            np.int32(num_heads), np.int32(num_kv_heads), np.int32(block_size),
            np.int32(block_tables.shape[1]), np.float32(scale * LOG2E))
    _launch(_kernel((sname, head_dim, block_size), name), name, grid, PREFILL_THREADS, args)
    return out


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Writes rows of `k` / `v` to their slots in the caches, in place; negative slots are skipped."""
    cp = _cupy()
    _check_cache(k_cache, v_cache)
    num_tokens = k.shape[0]
    row = k_cache.shape[2] * k_cache.shape[3]
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:] or k.dtype != k_cache.dtype or v.dtype != k.dtype:
        raise ValueError(f"k/v {k.shape} {k.dtype} do not fit cache {k_cache.shape} {k_cache.dtype}")
    if num_tokens == 0:
        return
    k, v = _device(cp, k), _device(cp, v)
    slot_mapping = _device(cp, slot_mapping, cp.int64)
    row_bytes = row * k.itemsize
    # The widest word that divides the row and to which both sources are aligned (the caches are
    # 16-byte aligned): a view at an odd element offset of fp16 data is only 2-byte aligned, and
    # a wider word there is a misaligned-address fault that kills the CUDA context.
    word = next(w for w in WRITE_KV_WORDS
                if row_bytes % w == 0 and all(a.data.ptr % w == 0 for a in (k, v)))
    name = f"write_kv_kernel<{WRITE_KV_WORDS[word]}>"
    row_words = row_bytes // word
    block = min(256, 32 * -(-row_words // 32))
    args = (k, v, k_cache, v_cache, slot_mapping, np.int32(row_words))
    _launch(_kernel(("write_kv", 0, 0), name), name, (num_tokens, 1, 1), block, args)
