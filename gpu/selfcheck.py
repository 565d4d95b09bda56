"""GPU self-check: `python -m gpu.selfcheck [--json-out PATH] [--quick | --tiny] [--time-budget S]`.

Needs only NumPy, CuPy (cupy-cuda12x or cupy-cuda13x: `pip install -e ".[gpu-cuda13]"` or a
plain `pip install cupy-cuda13x numpy`) and this repository: `gpu` imports nothing else, and the
full run stays under 5 minutes on one H200.

1. Correctness: every CUDA kernel (decode with split-K by the default rule, off, and with fixed
   partitions; prefill; write_kv, including sources at a 2-byte offset) against the NumPy
   backend on random scattered batches, in float32, float16 and bfloat16.
2. Decode timings at Llama-3-8B (32 query heads, 8 kv heads) and Llama-3-70B (64 query heads,
   8 kv heads) shapes, head_dim 128, float16, block_size 16, for batch 1/32/128/256 x context
   512/2k/8k: CUDA-event medians, achieved GB/s
   (K/V read plus q and out) against a device-to-device copy measured in the same run, and
   against the same attention over a contiguous layout (torch SDPA when torch imports, else a
   dense CuPy matmul/softmax version).
3. Token identity: tiny-model greedy tokens on CuPy against NumPy, and CuPy alone vs batched.

Timing: each figure is the median over rounds of back-to-back calls between one pair of CUDA
events, every round queued behind a spin kernel (kernels/timing.cu) so that the host's launch
overhead is not timed; consecutive calls read different blocks of a large pool, at least four
times the device's L2 cache apart, so that small shapes are timed from HBM, not from L2.

Prints a table; the full report goes to --json-out, rewritten (write then rename) after each
section, so a run that fails or is killed part way leaves what it measured. Exit 0 when every
check passes (kernels against NumPy, the timed outputs against the contiguous baseline, batched
tokens equal to alone), 1 when one fails or a section raised, 2 (one line on stderr, no
traceback; the JSON says why) when no CUDA device is usable or --json-out cannot be written.
After a section that leaves the CUDA context broken (a kernel fault is sticky), the later
sections are skipped and the report says why. Each timing section stops starting new shapes
once the time budget is spent (--time-budget overrides it; `inf` times every shape), so the
whole run stays within a few minutes on one H200;
`--quick` runs a smaller set, `--tiny` the smallest shapes (for checking the self-check itself,
e.g. under the tests' CPU emulator of CuPy).

Everything takes a `Backend`, so the plumbing also runs on NumPy (the tests do that, with tiny
shapes); only the CUDA events, the copy engine and torch are CuPy-specific.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import stat
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from . import numpy_backend
from .backend import Backend, get_backend
from .driver import Driver
from .dtypes import storage
from .errors import BackendUnavailable, describe
from .executor import GPU_MODEL, ModelExecutor
from .synthetic import random_paged_batch, random_values

# Error relative to max |reference|: accumulation-order noise plus rounding the output to the
# storage dtype (2**-11 for float16, 2**-8 for bfloat16).
TOLERANCE = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 2e-2}


@dataclass
class Plan:
    """What one run checks and times."""

    storages: tuple[str, ...] = ("float32", "float16", "bfloat16")
    # (group, num_kv_heads, head_dim, block_size, seq_lens)
    kernel_cases: list = field(default_factory=lambda: [
        (4, 2, 128, 16, [1, 16, 100, 513, 1500, 37]),
        (1, 4, 64, 32, [64, 1, 700, 1025]),
        (8, 1, 128, 16, [5, 4096, 16]),
        (2, 2, 32, 8, [3, 8, 250]),
        (16, 2, 64, 16, [200, 1]),       # group 16: two thread blocks per kv head
        (4, 1, 256, 16, [40, 600]),
    ])
    split_partitions: tuple[int, ...] = (512, 128)
    # Decode timing shapes: (label, query heads, kv heads, head_dim).
    timing_models: tuple = (("llama-3-8b", 32, 8, 128), ("llama-3-70b", 64, 8, 128))
    block_size: int = 16
    timing_dtype: str = "float16"
    batches: tuple[int, ...] = (1, 32, 128, 256)
    contexts: tuple[int, ...] = (512, 2048, 8192)
    # Seconds shared by the timing models: once spent, the remaining shapes are skipped (their
    # rows say "time budget spent"). math.inf: no budget, every shape is timed (the tests set it,
    # so that what a run checks does not depend on how fast the machine is); 0: none is.
    timing_budget_s: float = 150.0
    copy_bytes: int = 1 << 30
    rounds: int = 5  # timed rounds per figure (the median is reported)
    round_s: float = 0.05  # a round's target length on the device
    # Consecutive timed calls read K/V sets spread over at least this many bytes (None: four
    # times the device's L2 cache, 0 on NumPy), so that no call finds its K/V in the cache.
    rotate_bytes: int | None = None
    token_dtypes: tuple[str, ...] = ("float16", "float32")
    token_model: dict = field(default_factory=lambda: dict(GPU_MODEL))
    token_prompts: tuple[int, ...] = (7, 40, 130, 300)
    new_tokens: int = 32


FULL = Plan()
QUICK = Plan(
    kernel_cases=[(4, 2, 128, 16, [1, 16, 100, 1500]), (1, 4, 64, 32, [64, 700]), (16, 2, 64, 16, [200, 1])],
    batches=(1, 32), contexts=(512, 2048), timing_budget_s=30.0, token_dtypes=("float16",),
    token_prompts=(7, 40), new_tokens=16,
)
TINY = Plan(
    kernel_cases=[(4, 2, 64, 16, [1, 9, 300]), (8, 1, 32, 8, [70, 3])], split_partitions=(128,),
    timing_models=(("tiny-gqa4", 8, 2, 64), ("tiny-gqa8", 8, 1, 64)), batches=(1, 3), contexts=(64, 256),
    timing_budget_s=30.0, copy_bytes=1 << 20, rounds=3, token_dtypes=("float16",),
    token_model={"num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32}, token_prompts=(5, 9),
    new_tokens=3,
)


class _Timer:
    """Per-call seconds of a device function, the median over rounds of back-to-back calls.

    On CuPy each round is one pair of CUDA events around `repeat` calls, queued behind a spin
    kernel that lasts longer than the host takes to queue the round (measured on the round
    before), so the events time the kernels, not the launches; on NumPy, perf_counter around
    each round. `fn(i)` gets a call counter that runs on across rounds (for rotating inputs)."""

    def __init__(self, backend: Backend, rounds: int) -> None:
        self.backend, self.rounds = backend, rounds
        self.spin = None
        if backend.name != "cupy":
            self.method = "perf_counter around each round (synchronous NumPy)"
            return
        from . import cupy_backend  # (lazy: the CUDA kernels, on the cupy backend only)

        try:
            cupy_backend.spin(1e-5)
            backend.synchronize()
            self.spin = cupy_backend.spin
            self.method = "CUDA events around each round, queued behind a spin kernel"
        except Exception as exc:  # timings then include launch overhead: say so in the report
            self.method = (f"CUDA events around each round, no spin kernel ({describe(exc)}): "
                           "small shapes include the host's launch time")

    def measure(self, fn, repeat: int) -> dict:
        """{"seconds": median per call, "host_seconds": the host's per-call queueing time (CuPy),
        "spin_covered": the fraction of rounds the spin outlasted the host's queueing}."""
        counter = itertools.count()
        per_call, host = [], []
        if self.backend.name != "cupy":
            for _ in range(self.rounds):
                t0 = time.perf_counter()
                for _ in range(repeat):
                    fn(next(counter))
                per_call.append((time.perf_counter() - t0) / repeat)
            return {"seconds": float(np.median(per_call)), "host_seconds": None, "spin_covered": None}
        cp = self.backend.xp
        t0 = time.perf_counter()  # an untimed round: warms up, and measures the host's queueing
        for _ in range(repeat):
            fn(next(counter))
        queued = time.perf_counter() - t0
        self.backend.synchronize()
        covered = 0
        for _ in range(self.rounds):
            spin_s = min(1.0, 1.5 * queued + 1e-3)
            if self.spin is not None:
                self.spin(spin_s)
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            t0 = time.perf_counter()
            for _ in range(repeat):
                fn(next(counter))
            queued = time.perf_counter() - t0
            stop.record()
            stop.synchronize()
            covered += self.spin is not None and queued < spin_s
            per_call.append(cp.cuda.get_elapsed_time(start, stop) / 1e3 / repeat)
            host.append(queued / repeat)
        return {"seconds": float(np.median(per_call)), "host_seconds": float(np.median(host)),
                "spin_covered": covered / self.rounds}


def device_error(backend: Backend) -> str | None:
    """None while the device still works; else why not (a kernel fault leaves the CUDA context
    broken for good, and every later call fails)."""
    if backend.name != "cupy":
        return None
    try:
        backend.synchronize()
        int(backend.xp.arange(4).sum())
        return None
    except Exception as exc:
        return describe(exc)


def _rel_error(got, ref) -> float:
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if not np.isfinite(got).all():
        return math.inf
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30)) if ref.size else 0.0


def _decoded(storage_name: str, a) -> np.ndarray:
    return storage(storage_name).decode(np, a).astype(np.float64)


def check_kernels(backend: Backend, plan: Plan, seed: int = 0) -> list[dict]:
    """Runs every kernel on `backend` against the NumPy backend (float64 queries). One dict per
    check: kernel, storage, shape, error, tolerance, passed (and `error_text` if it raised)."""
    rng = np.random.default_rng(seed)
    results: list[dict] = []
    for storage_name in plan.storages:
        for group, num_kv_heads, head_dim, block_size, lens in plan.kernel_cases:
            case = {"storage": storage_name, "group": group, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                    "block_size": block_size, "seq_lens": list(lens)}
            try:
                _check_case(backend, plan, rng, case, results)
            except Exception as exc:  # the case's inputs could not even be set up on the device
                results.append({"kernel": "setup", **case, "error": None, "passed": False,
                                "error_text": describe(exc),
                                "traceback": traceback.format_exc(limit=4)})
            broken = device_error(backend)
            if broken:
                results.append({"kernel": "device", **case, "error": None, "passed": False,
                                "error_text": f"the CUDA context is broken after this case; the remaining "
                                              f"cases were not run ({broken})"})
                return results
    return results


def _check_case(backend: Backend, plan: Plan, rng, case: dict, results: list) -> None:
    """One kernel case: decode (each split mode), prefill and write_kv, appended to `results`."""
    storage_name, group, num_kv_heads = case["storage"], case["group"], case["num_kv_heads"]
    head_dim, block_size, lens = case["head_dim"], case["block_size"], case["seq_lens"]
    batch = random_paged_batch(rng, lens, block_size=block_size, num_kv_heads=num_kv_heads,
                               head_dim=head_dim, storage_name=storage_name)
    host_k = _decoded(storage_name, batch.k_cache).astype(np.float32)
    host_v = _decoded(storage_name, batch.v_cache).astype(np.float32)
    k_dev, v_dev = backend.asarray(batch.k_cache), backend.asarray(batch.v_cache)
    tables, seq_lens = backend.asarray(batch.block_tables), backend.asarray(batch.seq_lens)
    num_heads = group * num_kv_heads
    kernels = backend.kernels
    tol = TOLERANCE[storage_name]

    def record(kernel: str, fn, **extra):
        entry = {"kernel": kernel, **case, **extra, "tolerance": tol}
        try:
            entry["error"] = fn()
            entry["passed"] = entry["error"] <= tol
        except Exception as exc:  # a failing kernel must not hide the others
            entry.update(error=None, passed=False, error_text=f"{type(exc).__name__}: {exc}",
                         traceback=traceback.format_exc(limit=4))
        results.append(entry)

    q = random_values(rng, (len(lens), num_heads, head_dim), storage_name)
    ref = numpy_backend.paged_decode_attention(_decoded(storage_name, q), host_k, host_v,
                                               batch.block_tables, batch.seq_lens)
    modes = [(None, None), (False, None)] + [(True, p) for p in plan.split_partitions]
    for split, partition in modes:
        def decode(split=split, partition=partition):
            # The NumPy backend accepts and ignores split_k / partition_size.
            out = kernels.paged_decode_attention(backend.asarray(q), k_dev, v_dev, tables, seq_lens,
                                                 split_k=split, partition_size=partition)
            return _rel_error(_decoded(storage_name, backend.to_host(out)), ref)
        record("decode", decode, split_k=split, partition_size=partition)

    q_lens = [int(rng.integers(1, n + 1)) for n in lens]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    qp = random_values(rng, (int(cu[-1]), num_heads, head_dim), storage_name)
    ref_p = numpy_backend.paged_prefill_attention(_decoded(storage_name, qp), host_k, host_v,
                                                  batch.block_tables, cu, batch.seq_lens)

    def prefill():
        out = kernels.paged_prefill_attention(backend.asarray(qp), k_dev, v_dev, tables,
                                              backend.asarray(cu), seq_lens)
        return _rel_error(_decoded(storage_name, backend.to_host(out)), ref_p)
    record("prefill", prefill)

    def write(offset=0):
        n = 9
        slots = rng.permutation(batch.k_cache.shape[0] * block_size)[:n].astype(np.int64)
        slots[::3] = -1
        k_new = random_values(rng, (n, num_kv_heads, head_dim), storage_name)
        v_new = random_values(rng, (n, num_kv_heads, head_dim), storage_name)
        expect_k, expect_v = batch.k_cache.copy(), batch.v_cache.copy()
        keep = slots >= 0
        expect_k.reshape(-1, num_kv_heads, head_dim)[slots[keep]] = k_new[keep]
        expect_v.reshape(-1, num_kv_heads, head_dim)[slots[keep]] = v_new[keep]
        kc, vc = backend.asarray(batch.k_cache), backend.asarray(batch.v_cache)
        k_dev_new, v_dev_new = backend.asarray(k_new), backend.asarray(v_new)
        if offset:  # sources that start `offset` elements into a buffer (2-byte aligned)
            def shifted(a):
                flat = backend.xp.zeros(a.size + offset, dtype=a.dtype)
                flat[offset:] = a.reshape(-1)
                return flat[offset:].reshape(a.shape)
            k_dev_new, v_dev_new = shifted(k_dev_new), shifted(v_dev_new)
        kernels.write_kv(k_dev_new, v_dev_new, kc, vc, backend.asarray(slots))
        same = [np.array_equal(backend.to_host(got).view(np.uint8), want.view(np.uint8))
                for got, want in ((kc, expect_k), (vc, expect_v))]
        return 0.0 if all(same) else math.inf
    record("write_kv", write)
    if storage_name != "float32":
        record("write_kv", lambda: write(offset=1), source_offset=1)


def _dense_decode(xp, q, k, v, scale):
    """Decode attention over contiguous k, v [batch, kv_heads, context, head_dim] on `xp`:
    batched matmuls and a float32 softmax. The contiguous baseline when torch is absent."""
    batch, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    qg = q.reshape(batch, kv_heads, num_heads // kv_heads, head_dim)
    s = xp.matmul(qg, k.transpose(0, 1, 3, 2)).astype(xp.float32) * scale
    s -= s.max(axis=-1, keepdims=True)
    p = xp.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return xp.matmul(p.astype(q.dtype), v).reshape(batch, num_heads, head_dim)


def _torch_sdpa(backend: Backend):
    """Returns (name, fn(q, k, v) -> None) for torch SDPA on the same device, or None."""
    if backend.name != "cupy":
        return None
    try:
        import torch  # (lazy: optional, a reference on the same GPU)
        import torch.nn.functional as F  # (lazy: as torch)
        if not torch.cuda.is_available():
            return None
    except Exception:
        return None

    def run(q, k, v):
        tq, tk, tv = (torch.from_dlpack(a) for a in (q, k, v))
        batch, num_heads, head_dim = tq.shape
        F.scaled_dot_product_attention(tq.view(batch, num_heads, 1, head_dim), tk, tv, enable_gqa=True)

    try:  # enable_gqa needs torch >= 2.5
        xp = backend.xp
        run(xp.zeros((1, 4, 64), np.float16), xp.zeros((1, 2, 8, 64), np.float16), xp.zeros((1, 2, 8, 64), np.float16))
    except Exception:
        return None
    return f"torch {torch.__version__} sdpa", run


class _Filler:
    """float32 standard normal values on the backend's device: cuRAND on CuPy; if cuRAND
    cannot be loaded, one host-made chunk of values copied over and over (timings do not
    depend on the values, and the timed outputs are still checked against the same K/V)."""

    def __init__(self, backend: Backend) -> None:
        self.backend, self.note = backend, "curand" if backend.name == "cupy" else "numpy"
        self.host_chunk: Any = None

    def __call__(self, shape, seed: int):
        backend = self.backend
        if backend.name != "cupy":
            return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
        if self.host_chunk is None:
            try:
                return backend.xp.random.RandomState(seed).standard_normal(shape, dtype=np.float32)
            except Exception as exc:
                self.note = f"host values (cuRAND failed: {describe(exc)})"
                self.host_chunk = backend.asarray(np.random.default_rng(seed).standard_normal(1 << 24, dtype=np.float32))
        n = int(np.prod(shape))
        reps = -(-n // self.host_chunk.size)
        return backend.xp.tile(self.host_chunk, reps)[:n].reshape(shape)


def _copy_gbps(backend: Backend, timer: _Timer, nbytes: int) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    xp = backend.xp
    src = xp.ones(nbytes, dtype=np.uint8)
    dst = xp.empty_like(src)
    if backend.name == "cupy":
        def copy(_):
            dst.data.copy_from_device_async(src.data, nbytes)
    else:
        def copy(_):
            np.copyto(dst, src)
    copy(0)
    seconds = timer.measure(copy, 10)["seconds"]
    return 2 * nbytes / seconds / 1e9


def _l2_bytes(backend: Backend) -> int:
    """The device's L2 cache size in bytes (0 on NumPy, or if the device does not say)."""
    if backend.name != "cupy":
        return 0
    from . import cupy_backend  # (lazy: the CUDA kernels, on the cupy backend only)

    try:
        return int(cupy_backend.device_property("l2CacheSize", 0))
    except Exception:
        return 0


def time_decode(backend: Backend, plan: Plan, seed: int = 0) -> dict:
    """Decode timings for each of the plan's models over its batches x contexts; see the module
    docstring. The time budget is shared: each model gets what the ones before it left."""
    timer = _Timer(backend, plan.rounds)
    started = time.monotonic()
    copy_gbps = _copy_gbps(backend, timer, plan.copy_bytes if backend.name == "cupy" else min(plan.copy_bytes, 1 << 24))
    sdpa = _torch_sdpa(backend)
    baseline = sdpa[0] if sdpa else f"dense {backend.name} matmul + softmax"
    l2 = _l2_bytes(backend)
    rotate = plan.rotate_bytes if plan.rotate_bytes is not None else 4 * l2
    filler = _Filler(backend)
    models = []
    for i, (label, heads, kv_heads, head_dim) in enumerate(plan.timing_models):
        left = plan.timing_budget_s - (time.monotonic() - started)
        deadline = time.monotonic() + left / (len(plan.timing_models) - i)
        rows = _time_model(backend, plan, timer, filler, heads, kv_heads, head_dim, deadline, copy_gbps, sdpa,
                           rotate, seed)
        models.append({"model": label, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "rows": rows})
    return {"copy_gbps": copy_gbps, "baseline": baseline, "dtype": plan.timing_dtype, "block_size": plan.block_size,
            "timing_method": timer.method, "l2_bytes": l2, "rotate_bytes": rotate, "values": filler.note,
            "tolerance": TOLERANCE[plan.timing_dtype], "models": models}


def _num_splits(backend: Backend, heads: int, kv_heads: int, context: int) -> int:
    """The split-K partitions the CUDA decode uses for one sequence of `context` tokens."""
    if backend.name != "cupy":
        return 1
    from . import cupy_backend  # (lazy: the CUDA kernels, on the cupy backend only)

    return cupy_backend.split_plan(context, kv_heads, cupy_backend.decode_tiles(heads, kv_heads)[1])[0]


def _time_model(backend: Backend, plan: Plan, timer: _Timer, filler: _Filler, h: int, kvh: int, d: int,
                deadline: float, copy_gbps: float, sdpa, rotate_bytes: int, seed: int) -> list[dict]:
    xp = backend.xp
    rng = np.random.default_rng(seed)
    st = storage(plan.timing_dtype)
    bs = plan.block_size
    max_blocks = max(plan.batches) * max(plan.contexts) // bs
    shape = (max_blocks, bs, kvh, d)
    k_cache = xp.empty(shape, dtype=st.array_dtype)
    v_cache = xp.empty(shape, dtype=st.array_dtype)
    chunk = max(1, (1 << 26) // (bs * kvh * d))  # fill 64M elements at a time: bounded scratch
    for start in range(0, max_blocks, chunk):
        n = min(chunk, max_blocks - start)
        for cache in (k_cache, v_cache):
            cache[start:start + n] = st.encode(xp, filler((n, bs, kvh, d), seed + start))
    rows: list[dict[str, Any]] = []
    for context in plan.contexts:
        for batch in plan.batches:
            row: dict[str, Any] = {"batch": batch, "context": context}
            rows.append(row)
            if time.monotonic() >= deadline:  # (never with an infinite budget, always with 0)
                row["skipped"] = "time budget spent"
                continue
            try:
                _time_row(backend, plan, timer, row, rng, k_cache, v_cache, h, kvh, d, copy_gbps, sdpa,
                          rotate_bytes)
            except Exception as exc:
                row["error_text"] = describe(exc)
                broken = device_error(backend)
                if broken:
                    row["error_text"] += f"; the CUDA context is broken, the remaining shapes were not run ({broken})"
                    return rows
    del k_cache, v_cache
    return rows


def _time_row(backend: Backend, plan: Plan, timer: _Timer, row: dict, rng, k_cache, v_cache, h: int, kvh: int,
              d: int, copy_gbps: float, sdpa, rotate_bytes: int) -> None:
    """Times one (batch, context) of one model into `row`: paged, then contiguous, then checks
    the paged output against a float32 contiguous reference."""
    xp = backend.xp
    st = storage(plan.timing_dtype)
    scale = 1.0 / math.sqrt(d)
    tol = TOLERANCE[plan.timing_dtype]
    batch, context = row["batch"], row["context"]
    blocks = context // plan.block_size
    kv_bytes = 2 * batch * context * kvh * d * st.itemsize
    # Sets of disjoint blocks, one per call in turn, spread over at least rotate_bytes of K/V.
    sets = max(1, min(-(-rotate_bytes // kv_bytes), k_cache.shape[0] // (batch * blocks), 256))
    ids = rng.permutation(k_cache.shape[0])[:sets * batch * blocks].astype(np.int32)
    tables = [backend.asarray(t) for t in ids.reshape(sets, batch, blocks)]
    seq_lens = backend.asarray(np.full(batch, context, dtype=np.int32))
    q = backend.asarray(random_values(rng, (batch, h, d), plan.timing_dtype))
    out = xp.empty_like(q)
    options = {"max_seq_len": context} if backend.name == "cupy" else {}

    def paged(i):
        backend.kernels.paged_decode_attention(q, k_cache, v_cache, tables[i % sets], seq_lens, out=out, **options)
    paged(0)
    backend.synchronize()
    probe = timer.measure(paged, 3)["seconds"]
    repeat = int(min(200, max(5, plan.round_s / max(probe, 1e-7))))
    timed = timer.measure(paged, repeat)
    paged_s = timed["seconds"]
    nbytes = kv_bytes + 2 * q.nbytes
    row.update(paged_ms=paged_s * 1e3, bytes=nbytes, paged_gbps=nbytes / paged_s / 1e9, repeat=repeat,
               rounds=timer.rounds, kv_sets=sets, num_splits=_num_splits(backend, h, kvh, context),
               fraction_of_copy=nbytes / paged_s / 1e9 / copy_gbps, spin_covered=timed["spin_covered"],
               host_us_per_call=None if timed["host_seconds"] is None else timed["host_seconds"] * 1e6)

    # The same K/V, contiguous per sequence: [batch, kv_heads, context, head_dim], one copy per set.
    def contiguous(cache, t):
        return xp.ascontiguousarray(cache[t].reshape(batch, context, kvh, d).transpose(0, 2, 1, 3))
    k_dense = [contiguous(k_cache, t) for t in tables]
    v_dense = [contiguous(v_cache, t) for t in tables]
    if sdpa:
        def dense(i):
            sdpa[1](q, k_dense[i % sets], v_dense[i % sets])
    else:
        def dense(i):
            _dense_decode(xp, q, k_dense[i % sets], v_dense[i % sets], scale)
    dense(0)
    dense_s = timer.measure(dense, repeat)["seconds"]
    row.update(dense_ms=dense_s * 1e3, dense_gbps=nbytes / dense_s / 1e9, ratio_to_dense=dense_s / paged_s)
    if batch * context <= 32 * 8192:  # a check of the timed kernel's output, where cheap
        paged(0)
        ref = _dense_decode(xp, q.astype(np.float32), k_dense[0].astype(np.float32), v_dense[0].astype(np.float32),
                            scale)
        row["max_rel_error_vs_dense"] = _rel_error(backend.to_host(out.astype(np.float32)), backend.to_host(ref))
        row["passed"] = row["max_rel_error_vs_dense"] <= tol


def check_tokens(backend: Backend, plan: Plan, seed: int = 0) -> list[dict]:
    """Greedy tokens of a few requests: `backend` vs NumPy (same model, same storage dtype), and
    `backend` alone vs batched. One dict per dtype with per-request agreement."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, plan.token_model.get("vocab_size", 256), n).tolist() for n in plan.token_prompts]
    blocks = sum(-(-(n + plan.new_tokens) // 16) for n in plan.token_prompts) + 8
    results = []
    for dtype in plan.token_dtypes:
        sizes = {**plan.token_model, "dtype": dtype}

        def generate(on: Backend, which):
            driver = Driver(ModelExecutor(blocks, 16, backend=on, **sizes),
                            block_order=np.random.default_rng(1).permutation(blocks).tolist())
            for i in which:
                driver.add(prompts[i], req_id=i)
            return driver.run(plan.new_tokens)

        entry: dict[str, Any] = {"dtype": dtype, "model": sizes}
        try:
            device = generate(backend, range(len(prompts)))
            host = generate(get_backend("numpy"), range(len(prompts)))
            alone = {i: generate(backend, [i])[i] for i in range(len(prompts))}
            per_request = []
            for i in range(len(prompts)):
                a, b = np.array(device[i]), np.array(host[i])
                diverged = np.flatnonzero(a != b)
                per_request.append({
                    "prompt_len": len(prompts[i]), "tokens": len(a),
                    "agree_with_numpy": float(np.mean(a == b)),
                    "first_divergence": int(diverged[0]) if diverged.size else None,
                    "batched_equals_alone": device[i] == alone[i],
                })
            entry["requests"] = per_request
            entry["agreement"] = float(np.mean([r["agree_with_numpy"] for r in per_request]))
        except Exception as exc:
            entry["error_text"] = f"{type(exc).__name__}: {exc}"
        results.append(entry)
    return results


def versions() -> dict:
    """What the run ran on: Python, NumPy, CuPy and the CUDA runtime, driver and NVRTC it found."""
    found: dict[str, Any] = {"python": sys.version.split()[0], "numpy": np.__version__}
    try:
        import cupy  # (lazy: optional; its versions where it is installed)
    except Exception as exc:
        found["cupy"] = f"unavailable: {describe(exc)}"
        return found
    probes = {"cupy": lambda: cupy.__version__,
              "cuda_runtime": lambda: cupy.cuda.runtime.runtimeGetVersion(),
              "cuda_driver": lambda: cupy.cuda.runtime.driverGetVersion(),
              "nvrtc": lambda: ".".join(map(str, cupy.cuda.nvrtc.getVersion()))}
    for name, probe in probes.items():
        try:
            found[name] = probe()
        except Exception as exc:
            found[name] = f"unavailable: {describe(exc)}"
    return found


SECTIONS = ("correctness", "decode_timings", "token_identity")


def _check_correctness(backend: Backend, plan: Plan) -> list[dict]:
    if backend.name != "cupy":
        return check_kernels(backend, plan)
    from . import cupy_backend  # (lazy: the CUDA kernels, on the cupy backend only)

    cupy_backend.set_sync_check(True)  # pin any fault on the kernel that caused it
    try:
        return check_kernels(backend, plan)
    finally:
        cupy_backend.set_sync_check(False)


def run(backend: Backend, plan: Plan, on_section=None) -> dict:
    """Runs the three sections on `backend` and returns the full report; `on_section(report)`
    after each. A section that raises is recorded (status, error, traceback) and the next one
    runs, unless the device is broken, which skips the rest with the reason."""
    report: dict[str, Any] = {"device": backend.device, "backend": backend.name, "versions": versions(),
                              "plan": asdict(plan), "sections": {}}
    started = time.monotonic()
    steps = {"correctness": lambda: _check_correctness(backend, plan),
             "decode_timings": lambda: time_decode(backend, plan),
             "token_identity": lambda: check_tokens(backend, plan)}
    broken = None
    for name in SECTIONS:
        if broken:
            report["sections"][name] = {"status": "skipped", "reason": broken}
            continue
        t0 = time.monotonic()
        try:
            report[name] = steps[name]()
            status: dict[str, Any] = {"status": "ok"}
        except Exception as exc:
            status = {"status": "failed", "error_text": describe(exc),
                      "traceback": traceback.format_exc(limit=6)}
        status["seconds"] = time.monotonic() - t0
        report["sections"][name] = status
        error = device_error(backend)
        if error:
            broken = f"the CUDA context broke during {name}: {error}"
        report["seconds"] = time.monotonic() - started
        _verdicts(report)
        if on_section is not None:
            on_section(report)
    report["seconds"] = time.monotonic() - started
    _verdicts(report)
    return report


def _verdicts(report: dict) -> None:
    """Sets correctness_passed, timing_outputs_passed, tokens_passed and passed (all three)."""
    ran = {name for name, s in report["sections"].items() if s["status"] == "ok"}
    checks = report.get("correctness", [])
    report["correctness_passed"] = "correctness" in ran and bool(checks) and all(r["passed"] for r in checks)
    rows = [r for m in report.get("decode_timings", {}).get("models", []) for r in m["rows"]]
    report["timing_outputs_passed"] = "decode_timings" in ran and all(
        "skipped" in r or ("error_text" not in r and r.get("passed", True)) for r in rows)
    tokens = report.get("token_identity", [])
    report["tokens_passed"] = "token_identity" in ran and bool(tokens) and all(
        "error_text" not in e and all(r["batched_equals_alone"] for r in e["requests"]) for e in tokens)
    report["passed"] = (report["correctness_passed"] and report["timing_outputs_passed"] and report["tokens_passed"]
                        and len(ran) == len(SECTIONS))


def format_report(report: dict) -> str:
    """The report as text tables (what ran: a failed or skipped section is one line)."""
    lines = [f"device: {report['device']}"]
    v = report.get("versions", {})
    lines.append("versions: " + ", ".join(f"{k} {v[k]}" for k in ("numpy", "cupy", "cuda_runtime", "cuda_driver",
                                                                  "nvrtc") if k in v and "unavailable" not in str(v[k])))
    for name, s in report["sections"].items():
        if s["status"] != "ok":
            lines.append(f"{name}: {s['status'].upper()}: {s.get('error_text') or s.get('reason')}")
    if "correctness" in report:
        lines += _format_correctness(report["correctness"])
    if "decode_timings" in report:
        lines += _format_timings(report["decode_timings"])
    for entry in report.get("token_identity", []):
        if "error_text" in entry:
            lines.append(f"tokens {entry['dtype']}: {entry['error_text']}")
            continue
        invariant = all(r["batched_equals_alone"] for r in entry["requests"])
        lines.append(f"tokens {entry['dtype']}: {100 * entry['agreement']:.1f}% agree with NumPy; "
                     f"batched == alone: {invariant}; first divergence per request: "
                     f"{[r['first_divergence'] for r in entry['requests']]}")
    lines.append(f"total {report['seconds']:.0f} s; {'PASSED' if report['passed'] else 'FAILED'}")
    return "\n".join(lines)


def _format_correctness(checks: list[dict]) -> list[str]:
    failed = [r for r in checks if not r["passed"]]
    lines = [f"kernel correctness: {len(checks) - len(failed)}/{len(checks)} passed"]
    worst: dict[tuple, float] = {}
    for r in checks:
        if r["kernel"] in ("setup", "device"):
            continue
        key = (r["kernel"], r["storage"], r.get("split_k"))
        worst[key] = max(worst.get(key, 0.0), math.inf if r["error"] is None else r["error"])
    for (kernel, storage_name, split), err in sorted(worst.items(), key=str):
        label = kernel + ({True: " split-K", False: " no split"}.get(split, ""))
        lines.append(f"  {label:<18} {storage_name:<9} max rel error {err:.2e}  (tol {TOLERANCE[storage_name]:.0e})")
    for r in failed:
        lines.append(f"  FAILED {r['kernel']} {r['storage']} group {r['group']} head_dim {r['head_dim']} "
                     f"block {r['block_size']}: {r.get('error_text', r['error'])}")
    return lines


def _format_timings(t: dict) -> list[str]:
    lines = [f"decode attention, {t['dtype']}, block {t['block_size']}; device-to-device copy {t['copy_gbps']:.0f} GB/s "
             f"(read + write); contiguous baseline: {t['baseline']}",
             f"  timing: {t['timing_method']}; consecutive calls over >= {_size(t['rotate_bytes'])} of K/V "
             f"(L2 {_size(t['l2_bytes'])}); values: {t['values']}"]
    for model in t["models"]:
        lines.append(f"{model['model']}: {model['heads']} heads / {model['kv_heads']} kv heads, "
                     f"head_dim {model['head_dim']}")
        lines.append(f"{'batch':>6} {'context':>8} {'splits':>6} {'paged ms':>9} {'GB/s':>8} {'% copy':>7} "
                     f"{'dense ms':>9} {'ratio':>6} {'error':>8}")
        for r in model["rows"]:
            if "paged_ms" not in r:
                lines.append(f"{r['batch']:>6} {r['context']:>8}  {r.get('skipped') or r.get('error_text')}")
                continue
            dense = f"{r['dense_ms']:>9.3f} {r['ratio_to_dense']:>6.2f}" if "dense_ms" in r else r.get("error_text", "")
            error = f" {r['max_rel_error_vs_dense']:>8.1e}" if "max_rel_error_vs_dense" in r else ""
            if r.get("passed") is False:
                error += " FAILED"
            lines.append(f"{r['batch']:>6} {r['context']:>8} {r['num_splits']:>6} {r['paged_ms']:>9.3f} "
                         f"{r['paged_gbps']:>8.0f} {100 * r['fraction_of_copy']:>6.0f}% {dense}{error}")
    return lines


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.0f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def _json_safe(value):
    """`value` with NumPy scalars as Python numbers and inf / nan as strings (strict JSON)."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class ReportFile:
    """--json-out: each write replaces the file whole (a temporary file beside it, renamed over
    it), so a reader never sees half a report; a path that is not a regular file (a FIFO,
    /dev/stdout) is written in place, once, at the end, and never replaced."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.regular = True
        try:
            mode = os.stat(path).st_mode
            self.regular = stat.S_ISREG(mode)
            if stat.S_ISDIR(mode):
                raise ValueError("is a directory")
        except FileNotFoundError:
            pass
        if self.regular:  # fail now, not after minutes of work, if the folder is not writable
            fd, probe = tempfile.mkstemp(prefix=".selfcheck-", dir=os.path.dirname(os.path.abspath(path)))
            os.close(fd)
            os.unlink(probe)

    def write(self, report: dict, final: bool = False) -> None:
        text = json.dumps(_json_safe(report), indent=1, default=str, allow_nan=False) + "\n"
        if not self.regular:
            if final:
                with open(self.path, "w") as f:
                    f.write(text)
            return
        folder, name = os.path.split(os.path.abspath(self.path))
        tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
        try:
            # (the mode open() would give a new file, the umask applied; an existing one's kept)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666)
            try:
                os.fchmod(fd, stat.S_IMODE(os.stat(self.path).st_mode))
            except FileNotFoundError:
                pass
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


def _seconds(text: str) -> float:
    """--time-budget: a number of seconds, 0 or more ('inf': no budget)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number of seconds (0 or more, or 'inf')")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu.selfcheck", description=__doc__.split("\n")[0])
    parser.add_argument("--json-out", help="write the full report here as JSON (after each section)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer cases and shapes")
    size.add_argument("--tiny", action="store_true", help="the smallest shapes: checks the self-check itself")
    parser.add_argument("--time-budget", type=_seconds, metavar="SECONDS",
                        help="seconds for the decode timings, after which the remaining shapes are skipped "
                             "(default: the plan's; 'inf': time every shape)")
    args = parser.parse_args(argv)
    out = None
    if args.json_out:
        try:
            out = ReportFile(args.json_out)
        except (OSError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            print(f"gpu.selfcheck: --json-out {args.json_out}: cannot write there ({reason})", file=sys.stderr)
            return 2
    try:
        backend = get_backend("cupy")
    except BackendUnavailable as exc:
        print(f"gpu.selfcheck: {exc}", file=sys.stderr)
        if out is not None:
            out.write({"backend": None, "error": str(exc), "versions": versions(), "passed": False}, final=True)
        return 2
    write_error: list[str] = []

    def write(report: dict, final: bool = False) -> None:
        if out is not None and not write_error:
            try:
                out.write(report, final=final)
            except OSError as exc:  # (a full disk): the run goes on, and says so at the end
                write_error.append(f"{type(exc).__name__}: {exc.strerror or exc}")

    plan = TINY if args.tiny else QUICK if args.quick else FULL
    if args.time_budget is not None:
        plan = replace(plan, timing_budget_s=args.time_budget)
    report = run(backend, plan, on_section=write)
    try:
        print(format_report(report))
    finally:  # a report the table cannot show is still written
        write(report, final=True)
    if write_error:
        print(f"gpu.selfcheck: --json-out {args.json_out}: cannot write there ({write_error[0]})", file=sys.stderr)
        return 2
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
