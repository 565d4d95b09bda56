"""GPU self-check: `python -m gpu.selfcheck [--json-out PATH] [--quick | --tiny]`.

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

Prints a table; the full report goes to --json-out. Exit 0 when every correctness check passes,
1 when one fails, 2 (one line on stderr, no traceback) when no CUDA device is usable. Each
timing section stops starting new shapes once the time budget is spent, so the whole run stays
within a few minutes on one H200; `--quick` runs a smaller set, `--tiny` the smallest shapes
(for checking the self-check itself, e.g. under the tests' CPU emulator of CuPy).

Everything takes a `Backend`, so the plumbing also runs on NumPy (the tests do that, with tiny
shapes); only the CUDA events, the copy engine and torch are CuPy-specific.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

import numpy as np

from . import numpy_backend
from .backend import Backend, get_backend
from .driver import Driver
from .dtypes import storage
from .errors import BackendUnavailable
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
    timing_budget_s: float = 150.0  # shared by the timing models
    copy_bytes: int = 1 << 30
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
    timing_budget_s=30.0, copy_bytes=1 << 20, token_dtypes=("float16",),
    token_model={"num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32}, token_prompts=(5, 9),
    new_tokens=3,
)


class _Timer:
    """Per-call seconds of a device function: CUDA events on CuPy, perf_counter on NumPy."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def measure(self, fn, repeat: int) -> list[float]:
        if self.backend.name != "cupy":
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return times
        cp = self.backend.xp
        events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(repeat)]
        for start, stop in events:
            start.record()
            fn()
            stop.record()
        events[-1][1].synchronize()
        return [cp.cuda.get_elapsed_time(start, stop) / 1e3 for start, stop in events]


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
    kernels = backend.kernels
    results = []
    for storage_name in plan.storages:
        for group, num_kv_heads, head_dim, block_size, lens in plan.kernel_cases:
            case = {"storage": storage_name, "group": group, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                    "block_size": block_size, "seq_lens": list(lens)}
            batch = random_paged_batch(rng, lens, block_size=block_size, num_kv_heads=num_kv_heads,
                                       head_dim=head_dim, storage_name=storage_name)
            host_k = _decoded(storage_name, batch.k_cache).astype(np.float32)
            host_v = _decoded(storage_name, batch.v_cache).astype(np.float32)
            k_dev, v_dev = backend.asarray(batch.k_cache), backend.asarray(batch.v_cache)
            tables, seq_lens = backend.asarray(batch.block_tables), backend.asarray(batch.seq_lens)
            num_heads = group * num_kv_heads
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
    return results


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
        import torch
        import torch.nn.functional as F
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


def _normal(backend: Backend, shape, seed: int):
    """float32 standard normal values generated on the backend's device."""
    if backend.name == "cupy":
        return backend.xp.random.RandomState(seed).standard_normal(shape, dtype=np.float32)
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def _copy_gbps(backend: Backend, timer: _Timer, nbytes: int) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    xp = backend.xp
    src = xp.ones(nbytes, dtype=np.uint8)
    dst = xp.empty_like(src)
    if backend.name == "cupy":
        def copy():
            dst.data.copy_from_device_async(src.data, nbytes)
    else:
        def copy():
            np.copyto(dst, src)
    copy()
    seconds = float(np.median(timer.measure(copy, 10)))
    return 2 * nbytes / seconds / 1e9


def time_decode(backend: Backend, plan: Plan, seed: int = 0) -> dict:
    """Decode timings for each of the plan's models over its batches x contexts; see the module
    docstring. The time budget is shared: each model gets what the ones before it left."""
    timer = _Timer(backend)
    started = time.monotonic()
    copy_gbps = _copy_gbps(backend, timer, plan.copy_bytes if backend.name == "cupy" else min(plan.copy_bytes, 1 << 24))
    sdpa = _torch_sdpa(backend)
    baseline = sdpa[0] if sdpa else f"dense {backend.name} matmul + softmax"
    models = []
    for i, (label, heads, kv_heads, head_dim) in enumerate(plan.timing_models):
        left = plan.timing_budget_s - (time.monotonic() - started)
        deadline = time.monotonic() + left / (len(plan.timing_models) - i)
        rows = _time_model(backend, plan, timer, heads, kv_heads, head_dim, deadline, copy_gbps, sdpa, seed)
        models.append({"model": label, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "rows": rows})
    return {"copy_gbps": copy_gbps, "baseline": baseline, "dtype": plan.timing_dtype, "block_size": plan.block_size,
            "models": models}


def _time_model(backend: Backend, plan: Plan, timer: _Timer, h: int, kvh: int, d: int, deadline: float,
                copy_gbps: float, sdpa, seed: int) -> list[dict]:
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
            cache[start:start + n] = st.encode(xp, _normal(backend, (n, bs, kvh, d), seed + start))
    scale = 1.0 / math.sqrt(d)
    rows = []
    for context in plan.contexts:
        for batch in plan.batches:
            row = {"batch": batch, "context": context}
            rows.append(row)
            if time.monotonic() > deadline:
                row["skipped"] = "time budget spent"
                continue
            try:
                blocks = context // bs
                ids = rng.permutation(max_blocks)[:batch * blocks].astype(np.int32).reshape(batch, blocks)
                tables = backend.asarray(ids)
                seq_lens = backend.asarray(np.full(batch, context, dtype=np.int32))
                q = backend.asarray(random_values(rng, (batch, h, d), plan.timing_dtype))
                out = xp.empty_like(q)
                options = {"max_seq_len": context} if backend.name == "cupy" else {}

                def paged():
                    backend.kernels.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, out=out, **options)
                paged()
                backend.synchronize()
                probe = float(np.median(timer.measure(paged, 3)))
                repeat = int(min(50, max(5, 0.5 / max(probe, 1e-6))))
                paged_s = float(np.median(timer.measure(paged, repeat)))
                nbytes = 2 * batch * context * kvh * d * st.itemsize + 2 * q.nbytes
                row.update(paged_ms=paged_s * 1e3, bytes=nbytes, paged_gbps=nbytes / paged_s / 1e9, repeat=repeat,
                           fraction_of_copy=nbytes / paged_s / 1e9 / copy_gbps)
                # The same K/V, contiguous per sequence: [batch, kv_heads, context, head_dim].
                k_dense = xp.ascontiguousarray(k_cache[tables].reshape(batch, context, kvh, d).transpose(0, 2, 1, 3))
                v_dense = xp.ascontiguousarray(v_cache[tables].reshape(batch, context, kvh, d).transpose(0, 2, 1, 3))
                if sdpa:
                    def dense():
                        sdpa[1](q, k_dense, v_dense)
                else:
                    def dense():
                        _dense_decode(xp, q, k_dense, v_dense, scale)
                dense()
                dense_s = float(np.median(timer.measure(dense, repeat)))
                row.update(dense_ms=dense_s * 1e3, dense_gbps=nbytes / dense_s / 1e9, ratio_to_dense=dense_s / paged_s)
                if batch * context <= 32 * 8192:  # a sanity check of the timed output, where cheap
                    ref = _dense_decode(xp, q.astype(np.float32), k_dense.astype(np.float32),
                                        v_dense.astype(np.float32), scale)
                    row["max_rel_error_vs_dense"] = _rel_error(backend.to_host(out.astype(np.float32)),
                                                               backend.to_host(ref))
                del k_dense, v_dense
            except Exception as exc:
                row["error_text"] = f"{type(exc).__name__}: {exc}"
    del k_cache, v_cache
    return rows


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

        entry = {"dtype": dtype, "model": sizes}
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


def run(backend: Backend, plan: Plan) -> dict:
    """Runs the three sections on `backend` and returns the full report."""
    report = {"device": backend.device, "backend": backend.name, "plan": asdict(plan)}
    started = time.monotonic()
    if backend.name == "cupy":
        from . import cupy_backend

        cupy_backend.set_sync_check(True)  # pin any fault on the kernel that caused it
    try:
        report["correctness"] = check_kernels(backend, plan)
    finally:
        if backend.name == "cupy":
            cupy_backend.set_sync_check(False)
    report["correctness_passed"] = all(r["passed"] for r in report["correctness"])
    report["decode_timings"] = time_decode(backend, plan)
    report["token_identity"] = check_tokens(backend, plan)
    report["seconds"] = time.monotonic() - started
    return report


def format_report(report: dict) -> str:
    """The report as text tables."""
    lines = [f"device: {report['device']}"]
    checks = report["correctness"]
    failed = [r for r in checks if not r["passed"]]
    lines.append(f"kernel correctness: {len(checks) - len(failed)}/{len(checks)} passed")
    worst: dict[tuple, float] = {}
    for r in checks:
        key = (r["kernel"], r["storage"], r.get("split_k"))
        worst[key] = max(worst.get(key, 0.0), math.inf if r["error"] is None else r["error"])
    for (kernel, storage_name, split), err in sorted(worst.items(), key=str):
        label = kernel + ({True: " split-K", False: " no split"}.get(split, ""))
        lines.append(f"  {label:<18} {storage_name:<9} max rel error {err:.2e}  (tol {TOLERANCE[storage_name]:.0e})")
    for r in failed:
        lines.append(f"  FAILED {r['kernel']} {r['storage']} group {r['group']} head_dim {r['head_dim']} "
                     f"block {r['block_size']}: {r.get('error_text', r['error'])}")
    t = report["decode_timings"]
    lines.append(f"decode attention, {t['dtype']}, block {t['block_size']}; copy bandwidth {t['copy_gbps']:.0f} GB/s; "
                 f"contiguous baseline: {t['baseline']}")
    for model in t["models"]:
        lines.append(f"{model['model']}: {model['heads']} heads / {model['kv_heads']} kv heads, "
                     f"head_dim {model['head_dim']}")
        lines.append(f"{'batch':>6} {'context':>8} {'paged ms':>9} {'GB/s':>8} {'% copy':>7} {'dense ms':>9} {'ratio':>6}")
        for r in model["rows"]:
            if "paged_ms" not in r:
                lines.append(f"{r['batch']:>6} {r['context']:>8}  {r.get('skipped') or r.get('error_text')}")
                continue
            dense = f"{r['dense_ms']:>9.3f} {r['ratio_to_dense']:>6.2f}" if "dense_ms" in r else r.get("error_text", "")
            lines.append(f"{r['batch']:>6} {r['context']:>8} {r['paged_ms']:>9.3f} {r['paged_gbps']:>8.0f} "
                         f"{100 * r['fraction_of_copy']:>6.0f}% {dense}")
    for entry in report["token_identity"]:
        if "error_text" in entry:
            lines.append(f"tokens {entry['dtype']}: {entry['error_text']}")
            continue
        invariant = all(r["batched_equals_alone"] for r in entry["requests"])
        lines.append(f"tokens {entry['dtype']}: {100 * entry['agreement']:.1f}% agree with NumPy; "
                     f"batched == alone: {invariant}; first divergence per request: "
                     f"{[r['first_divergence'] for r in entry['requests']]}")
    lines.append(f"total {report['seconds']:.0f} s")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu.selfcheck", description=__doc__.split("\n")[0])
    parser.add_argument("--json-out", help="write the full report here as JSON")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer cases and shapes")
    size.add_argument("--tiny", action="store_true", help="the smallest shapes: checks the self-check itself")
    args = parser.parse_args(argv)
    try:
        backend = get_backend("cupy")
    except BackendUnavailable as exc:
        print(f"gpu.selfcheck: {exc}", file=sys.stderr)
        return 2
    report = run(backend, TINY if args.tiny else QUICK if args.quick else FULL)
    print(format_report(report))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0 if report["correctness_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
