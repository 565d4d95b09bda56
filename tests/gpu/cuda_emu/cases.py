"""The emulator's case matrix: servesim's CUDA kernels, run through gpu/cupy_backend.py itself
(with the fake CuPy of `emulator.py`), against a float64 dense reference and the NumPy backend.

Each case runs under every requested schedule (thread and block orders forward / reverse /
random) and must give bit-identical results under all of them. Suites: `ci` (every
instantiation family once, the findings' regressions: a few seconds once built), `sweep`,
`special`, `write_kv`, `chain`, `misuse` (the last four plus `sweep` make the full matrix).
Run them with `run.py`; a case that faults ends the process (see `emulator.py`).
"""

from __future__ import annotations

import math
import time
import traceback
from contextlib import contextmanager

import numpy as np

from gpu import cupy_backend, numpy_backend
from gpu.dtypes import storage
from gpu.reference import dense_attention
from gpu.selfcheck import TOLERANCE
from gpu.synthetic import random_paged_batch, random_values

from .emulator import Emulator, install

STORAGES = ("float32", "float16", "bfloat16")
# fp32 decode with unit-scale inputs must stay within this of the float64 reference (relative
# to its largest value), besides the self-check's tolerance: measured on the ci suite, at most
# 6e-7 on tensor cores (3xTF32) and 1e-7 on CUDA cores; plain tf32 anywhere (a lo part of Q,
# K, V or P dropped) gives 2e-4 or more.
FP32_ACCURACY = 5e-6


def ulp(storage_name: str, x: np.ndarray) -> np.ndarray:
    """Spacing of the storage format at |x| (float64)."""
    a = np.abs(x)
    if storage_name == "float16":
        return np.spacing(a.astype(np.float16)).astype(np.float64)
    if storage_name == "bfloat16":
        e = np.floor(np.log2(np.maximum(a, 2.0 ** -126)))
        return 2.0 ** (e - 7)
    return np.spacing(a.astype(np.float32)).astype(np.float64)


class Runner:
    def __init__(self, emu: Emulator, schedules=(0,), verbose=True):
        self.emu = emu
        self.cp = install(cupy_backend, emu)
        self.schedules = schedules
        self.results: list[dict] = []
        self.verbose = verbose

    # -- helpers ------------------------------------------------------------------------------
    def _run_schedules(self, fn):
        """Runs fn() under each schedule; returns (first output, identical across schedules)."""
        outs = []
        for i, sched in enumerate(self.schedules):
            self.emu.set_options(schedule=sched, block_order=sched, seed=1234 + i)
            outs.append(np.array(fn()))
        self.emu.set_options()
        same = all(np.array_equal(outs[0].view(np.uint8), o.view(np.uint8)) for o in outs[1:])
        return outs[0], same

    def _metrics(self, storage_name, got_raw, ref64, ref_np):
        st = storage(storage_name)
        got = st.decode(np, got_raw).astype(np.float64)
        finite = bool(np.isfinite(got).all())
        scale = max(float(np.abs(ref64).max()), 1e-30) if ref64.size else 1.0
        d = np.abs(got - ref64)
        err = float(d.max() / scale) if d.size else 0.0
        err_np = float(np.abs(got - ref_np).max() / scale) if d.size else 0.0
        # Error in units of the storage format's spacing at each reference value (values below
        # 1e-3 * max |ref| use the spacing there, so near-zero outputs do not dominate).
        floor = 1e-3 * scale
        ulps = float((d / ulp(storage_name, np.maximum(np.abs(ref64), floor))).max()) if d.size else 0.0
        if storage_name == "float32":
            ulps = float("nan")  # float32 output vs float64 reference: not meaningful
        return dict(finite=finite, max_abs=float(d.max()) if d.size else 0.0, err=err if finite else math.inf,
                    err_vs_numpy=err_np if finite else math.inf, max_ulps=ulps if finite else math.inf,
                    nonfinite=int((~np.isfinite(got)).sum()))

    def _judge(self, entry: dict, storage_name, got, same, ref64, ref_np) -> None:
        """Passed: finite, within the self-check's tolerance, identical under every schedule."""
        entry.update(self._metrics(storage_name, got, ref64, ref_np))
        entry["schedules_identical"] = same
        entry["passed"] = entry["finite"] and entry["err"] <= TOLERANCE[storage_name] and same

    @contextmanager
    def _case(self, entry: dict):
        """Time the block, record an exception in it as the case's failure, then record it."""
        t0 = time.time()
        try:
            yield
        except Exception as exc:  # noqa: BLE001
            entry.update(passed=False, error_text=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(limit=3))
        entry["seconds"] = time.time() - t0
        self._record(entry)

    def _record(self, entry: dict):
        self.results.append(entry)
        if self.verbose:
            keys = ("kind", "storage", "head_dim", "group", "kv_heads", "block_size", "label")
            desc = " ".join(f"{k}={entry[k]}" for k in keys if k in entry)
            status = "PASS" if entry.get("passed") else "FAIL"
            extra = f"err={entry.get('err', float('nan')):.2e} np={entry.get('err_vs_numpy', float('nan')):.2e} " \
                    f"ulps={entry.get('max_ulps', float('nan')):.2f} sched_same={entry.get('schedules_identical')} " \
                    f"t={entry.get('seconds', 0):.2f}s"
            if entry.get("error_text"):
                extra += " ERROR: " + entry["error_text"][:400]
            print(f"{status} {desc} {extra}", flush=True)

    # -- decode -------------------------------------------------------------------------------
    def decode(self, rng, storage_name, group, kv_heads, head_dim, block_size, lens, *, split_k=None,
               partition_size=None, max_seq_len=None, label="", q_scale=1.0, scale=None, shared_prefix=False):
        """max_seq_len: passed to the backend as given (a value below max(lens) is API misuse
        the backend must survive: right results, no access outside the partial buffers)."""
        entry = dict(kind="decode", storage=storage_name, group=group, kv_heads=kv_heads, head_dim=head_dim,
                     block_size=block_size, seq_lens=list(map(int, lens)), split_k=split_k,
                     partition_size=partition_size, max_seq_len=max_seq_len, label=label)
        options = {k: v for k, v in (("split_k", split_k), ("partition_size", partition_size),
                                     ("max_seq_len", max_seq_len)) if v is not None}
        with self._case(entry):
            st = storage(storage_name)
            batch = random_paged_batch(rng, lens, block_size=block_size, num_kv_heads=kv_heads, head_dim=head_dim,
                                       storage_name=storage_name)
            if shared_prefix and len(lens) > 1:
                # Sequences 1.. reuse sequence 0's first full blocks (prefix caching): same ids.
                shared = min(int(lens[0]), *map(int, lens[1:])) // block_size
                for s in range(1, len(lens)):
                    for b in range(shared):
                        src = batch.block_tables[0, b]
                        dst = batch.block_tables[s, b]
                        batch.k_cache[dst] = batch.k_cache[src]
                        batch.v_cache[dst] = batch.v_cache[src]
                        batch.block_tables[s, b] = src
            num_heads = group * kv_heads
            q = st.encode(np, rng.standard_normal((len(lens), num_heads, head_dim), dtype=np.float32) * q_scale)
            qf = st.decode(np, q).astype(np.float64)
            # Oracles: dense float64 per sequence; the NumPy backend in the storage dtype
            # (bfloat16: float32 inputs, output rounded to bfloat16).
            ref64 = np.zeros((len(lens), num_heads, head_dim))
            for s in range(len(lens)):
                if lens[s] > 0:
                    k, v = batch.contiguous(s)
                    ref64[s] = dense_attention(qf[s:s + 1], k, v, scale)[0]
            if storage_name == "bfloat16":
                o = numpy_backend.paged_decode_attention(st.decode(np, q), st.decode(np, batch.k_cache),
                                                         st.decode(np, batch.v_cache), batch.block_tables,
                                                         batch.seq_lens, scale)
                ref_np = st.decode(np, st.encode(np, o)).astype(np.float64)
            else:
                ref_np = numpy_backend.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables,
                                                              batch.seq_lens, scale).astype(np.float64)
            cp = self.cp
            dq, dk, dv = cp.asarray(q), cp.asarray(batch.k_cache), cp.asarray(batch.v_cache)
            dt, dl = cp.asarray(batch.block_tables), cp.asarray(batch.seq_lens)
            n_launch = len(self.emu.launch_log)

            def run():
                return cupy_backend.paged_decode_attention(dq, dk, dv, dt, dl, scale, **options)
            got, same = self._run_schedules(run)
            launches = self.emu.launch_log[n_launch:]
            launches = launches[:len(launches) // len(self.schedules)]  # the first schedule's
            entry["launches"] = [(l["name"], l["grid"]) for l in launches]
            self._judge(entry, storage_name, got, same, ref64, ref_np)
            if storage_name == "float32" and q_scale == 1.0 and scale is None and entry["err"] > FP32_ACCURACY:
                entry.update(passed=False, error_text=f"fp32 accuracy: err {entry['err']:.2e} > {FP32_ACCURACY:.0e}")
        return entry

    # -- batch invariance -------------------------------------------------------------------
    def batch_invariance(self, rng, storage_name, group, kv_heads, head_dim, block_size, lens, *, label=""):
        """Each sequence decoded alone must give the very bits it gets inside the batch
        (decode.cu's claim: a sequence's result depends only on its own length)."""
        entry = dict(kind="batch_invariance", storage=storage_name, group=group, kv_heads=kv_heads,
                     head_dim=head_dim, block_size=block_size, seq_lens=list(map(int, lens)), label=label)
        with self._case(entry):
            cp = self.cp
            b = random_paged_batch(rng, lens, block_size=block_size, num_kv_heads=kv_heads, head_dim=head_dim,
                                   storage_name=storage_name)
            q = random_values(rng, (len(lens), group * kv_heads, head_dim), storage_name)
            dk, dv = cp.asarray(b.k_cache), cp.asarray(b.v_cache)

            def decode(rows):
                return np.array(cupy_backend.paged_decode_attention(
                    cp.asarray(q[rows]), dk, dv, cp.asarray(b.block_tables[rows]), cp.asarray(b.seq_lens[rows])))
            full = decode(slice(None))
            differing = [int(lens[s]) for s in range(len(lens))
                         if not np.array_equal(decode(slice(s, s + 1)).view(np.uint8), full[s:s + 1].view(np.uint8))]
            entry.update(differing_lens=differing, passed=not differing and bool(np.isfinite(
                storage(storage_name).decode(np, full)).all()), err=0.0 if not differing else math.inf)
        return entry

    # -- prefill ------------------------------------------------------------------------------
    def prefill(self, rng, storage_name, group, kv_heads, head_dim, block_size, chunks, *, label="", q_scale=1.0,
                scale=None):
        """chunks: [(q_len, seq_len)]: the last q_len of seq_len cached tokens are the queries."""
        entry = dict(kind="prefill", storage=storage_name, group=group, kv_heads=kv_heads, head_dim=head_dim,
                     block_size=block_size, chunks=[list(map(int, c)) for c in chunks], label=label)
        with self._case(entry):
            st = storage(storage_name)
            lens = [c[1] for c in chunks]
            q_lens = [c[0] for c in chunks]
            batch = random_paged_batch(rng, lens, block_size=block_size, num_kv_heads=kv_heads, head_dim=head_dim,
                                       storage_name=storage_name)
            num_heads = group * kv_heads
            cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
            q = st.encode(np, rng.standard_normal((int(cu[-1]), num_heads, head_dim), dtype=np.float32) * q_scale)
            qf = st.decode(np, q).astype(np.float64)
            ref64 = np.zeros(q.shape)
            for s, (ql, sl) in enumerate(chunks):
                if ql:
                    k, v = batch.contiguous(s)
                    ref64[cu[s]:cu[s + 1]] = dense_attention(qf[cu[s]:cu[s + 1]], k, v, scale, q_start=sl - ql)
            if storage_name == "bfloat16":
                o = numpy_backend.paged_prefill_attention(st.decode(np, q), st.decode(np, batch.k_cache),
                                                          st.decode(np, batch.v_cache), batch.block_tables, cu,
                                                          batch.seq_lens, scale)
                ref_np = st.decode(np, st.encode(np, o)).astype(np.float64)
            else:
                ref_np = numpy_backend.paged_prefill_attention(q, batch.k_cache, batch.v_cache, batch.block_tables,
                                                               cu, batch.seq_lens, scale).astype(np.float64)
            cp = self.cp
            dq, dk, dv = cp.asarray(q), cp.asarray(batch.k_cache), cp.asarray(batch.v_cache)
            dt, dcu, dl = cp.asarray(batch.block_tables), cp.asarray(cu), cp.asarray(batch.seq_lens)
            n_launch = len(self.emu.launch_log)

            def run():
                return cupy_backend.paged_prefill_attention(dq, dk, dv, dt, dcu, dl, scale)
            got, same = self._run_schedules(run)
            entry["launches"] = [(l["name"], l["grid"]) for l in self.emu.launch_log[n_launch:n_launch + 1]]
            self._judge(entry, storage_name, got, same, ref64, ref_np)
        return entry

    # -- write_kv -----------------------------------------------------------------------------
    def write_kv(self, rng, storage_name, kv_heads, head_dim, block_size, n_tokens, *, misalign=0, label=""):
        """misalign: element offset of k / v inside their allocation (exercises 4- and 2-byte words)."""
        entry = dict(kind="write_kv", storage=storage_name, kv_heads=kv_heads, head_dim=head_dim,
                     block_size=block_size, n_tokens=n_tokens, misalign=misalign, label=label)
        with self._case(entry):
            st = storage(storage_name)
            num_blocks = max(2, -(-n_tokens // block_size) + 3)
            shape = (num_blocks, block_size, kv_heads, head_dim)
            k_cache = random_values(rng, shape, storage_name)
            v_cache = random_values(rng, shape, storage_name)
            slots = rng.permutation(num_blocks * block_size)[:n_tokens].astype(np.int64)
            slots[::3] = -1
            slots[1::7] = -5
            k_new = random_values(rng, (n_tokens, kv_heads, head_dim), storage_name)
            v_new = random_values(rng, (n_tokens, kv_heads, head_dim), storage_name)
            expect_k, expect_v = k_cache.copy(), v_cache.copy()
            # The NumPy backend as the oracle (bfloat16 bits viewed as float16: a bit copy).
            as_np = (lambda a: a.view(np.float16)) if storage_name == "bfloat16" else (lambda a: a)
            numpy_backend.write_kv(as_np(k_new), as_np(v_new), as_np(expect_k), as_np(expect_v), slots)
            cp = self.cp
            kc, vc = cp.asarray(k_cache), cp.asarray(v_cache)
            if misalign:
                # Views whose address is misalign * itemsize (mod 16) past a 16-byte boundary.
                item = k_new.dtype.itemsize
                views = []
                for a, nm in ((k_new, "k_new+pad"), (v_new, "v_new+pad")):
                    big = cp._new((a.size + 16,), a.dtype, nm, fill=None)
                    base = big.data.ptr
                    o = next(o for o in range(16) if (base + o * item) % 16 == (misalign * item) % 16)
                    view = big[o:o + a.size].reshape(a.shape)
                    np.copyto(np.asarray(view), a)
                    views.append(view)
                dk, dv = views
                entry["k_ptr_mod16"] = dk.data.ptr % 16
            else:
                dk, dv = cp.asarray(k_new), cp.asarray(v_new)
            n_launch = len(self.emu.launch_log)
            cupy_backend.write_kv(dk, dv, kc, vc, cp.asarray(slots))
            entry["launches"] = [(l["name"], l["grid"], l["block"]) for l in self.emu.launch_log[n_launch:]]
            same = (np.array_equal(np.asarray(kc).view(np.uint8), expect_k.view(np.uint8))
                    and np.array_equal(np.asarray(vc).view(np.uint8), expect_v.view(np.uint8)))
            entry.update(err=0.0 if same else math.inf, max_abs=0.0 if same else math.inf, bitwise_equal=same,
                         passed=same, schedules_identical=None)
        return entry

    # -- end to end: write_kv, then prefill, then one decode step -------------------------------
    def chain(self, rng, storage_name, group, kv_heads, head_dim, block_size, prompt_lens, *, label=""):
        entry = dict(kind="chain", storage=storage_name, group=group, kv_heads=kv_heads, head_dim=head_dim,
                     block_size=block_size, seq_lens=list(prompt_lens), label=label)
        with self._case(entry):
            st = storage(storage_name)
            cp = self.cp
            num_heads = group * kv_heads
            n = len(prompt_lens)
            total = [p + 1 for p in prompt_lens]  # prompt then one decoded token
            blocks = [-(-t // block_size) for t in total]
            num_blocks = sum(blocks) + 3
            shape = (num_blocks, block_size, kv_heads, head_dim)
            nan = st.encode(np, np.float32(np.nan))
            k_cache = cp.asarray(np.full(shape, nan))
            v_cache = cp.asarray(np.full(shape, nan))
            order = rng.permutation(num_blocks)
            width = max(blocks) + 1
            tables = np.full((n, width), num_blocks + 3, dtype=np.int32)
            start = 0
            for s in range(n):
                tables[s, :blocks[s]] = order[start:start + blocks[s]]
                start += blocks[s]
            ks = [st.encode(np, rng.standard_normal((t, kv_heads, head_dim), dtype=np.float32)) for t in total]
            vs = [st.encode(np, rng.standard_normal((t, kv_heads, head_dim), dtype=np.float32)) for t in total]
            qs = [st.encode(np, rng.standard_normal((t, num_heads, head_dim), dtype=np.float32)) for t in total]

            def slot(s, pos):
                return int(tables[s, pos // block_size]) * block_size + pos % block_size
            # Prefill step: write every prompt's K/V (plus two padding rows with slot -1).
            rows_k = np.concatenate([ks[s][:prompt_lens[s]] for s in range(n)] + [ks[0][:2]])
            rows_v = np.concatenate([vs[s][:prompt_lens[s]] for s in range(n)] + [vs[0][:2]])
            slots = np.array([slot(s, p) for s in range(n) for p in range(prompt_lens[s])] + [-1, -1], dtype=np.int64)
            cupy_backend.write_kv(cp.asarray(rows_k), cp.asarray(rows_v), k_cache, v_cache, cp.asarray(slots))
            cu = np.concatenate([[0], np.cumsum(prompt_lens)]).astype(np.int32)
            qp = np.concatenate([qs[s][:prompt_lens[s]] for s in range(n)])
            out_p = np.array(cupy_backend.paged_prefill_attention(cp.asarray(qp), k_cache, v_cache, cp.asarray(tables),
                                                                  cp.asarray(cu), cp.asarray(np.array(prompt_lens, np.int32))))
            # Decode step.
            slots_d = np.array([slot(s, prompt_lens[s]) for s in range(n)], dtype=np.int64)
            cupy_backend.write_kv(cp.asarray(np.stack([ks[s][-1] for s in range(n)])),
                                  cp.asarray(np.stack([vs[s][-1] for s in range(n)])), k_cache, v_cache,
                                  cp.asarray(slots_d))
            qd = np.stack([qs[s][-1] for s in range(n)])
            out_d = np.array(cupy_backend.paged_decode_attention(cp.asarray(qd), k_cache, v_cache, cp.asarray(tables),
                                                                 cp.asarray(np.array(total, np.int32))))
            errs, finite = [], True
            for s in range(n):
                k64, v64 = st.decode(np, ks[s]).astype(np.float64), st.decode(np, vs[s]).astype(np.float64)
                q64 = st.decode(np, qs[s]).astype(np.float64)
                ref = dense_attention(q64, k64, v64)  # rows 0..t-1 causal: prefill rows then decode row
                got_p = st.decode(np, out_p[cu[s]:cu[s + 1]]).astype(np.float64)
                got_d = st.decode(np, out_d[s:s + 1]).astype(np.float64)
                got = np.concatenate([got_p, got_d])
                finite &= bool(np.isfinite(got).all())
                errs.append(float(np.abs(got - ref).max() / np.abs(ref).max()))
            err = max(errs)
            entry.update(err=err if finite else math.inf, finite=finite, passed=finite and err <= TOLERANCE[storage_name])
        return entry


# ---------------------------------------------------------------------------------------------
# Suites.
LONG_LENS = [1, 13, 16, 517, 1100]  # max 1100 > 512: split-K with 3 partitions; short ones empty
PREFILL_CHUNKS = [(1, 1), (5, 5), (17, 40), (33, 33), (70, 100)]  # (q_len, seq_len): 2 with a cached prefix


def suite_sweep(r: Runner, rng, storages=STORAGES, head_dims=(32, 64, 128, 256), groups=(1, 4, 8),
                block_sizes=(8, 16, 32)):
    for sn in storages:
        for hd in head_dims:
            for g in groups:
                for bs in block_sizes:
                    r.decode(rng, sn, g, 2, hd, bs, LONG_LENS, label="sweep")
                    r.prefill(rng, sn, g, 2, hd, bs, PREFILL_CHUNKS, label="sweep")


def suite_special(r: Runner, rng):
    # Group sizes that tile differently (HEADS_PER_BLOCK picks 8, 4, 2 or 1; tiles per kv head).
    for g in (2, 3, 6, 16, 32):
        r.decode(rng, "float16", g, 2, 128, 16, [1, 50, 600], label=f"group{g}")
        r.prefill(rng, "float16", g, 2, 128, 16, [(7, 20), (40, 40)], label=f"group{g}")
    # Llama-3-8B decode shape: 32 q heads, 8 kv heads, head_dim 128, fp16, block 16.
    r.decode(rng, "float16", 4, 8, 128, 16, [1, 100, 777, 2048, 4100], label="llama3-8b")
    r.decode(rng, "bfloat16", 4, 8, 128, 16, [3, 2049], label="llama3-8b")
    # Split-K forced, odd partition sizes (not multiples of the block or of tokens per iteration).
    for part in (128, 100, 16, 7, 1):
        lens = [1, 5, 33, 130, 257] if part > 1 else [1, 5, 33, 70]
        for sn in ("float32", "float16"):
            r.decode(rng, sn, 4, 2, 64, 16, lens, split_k=True, partition_size=part, label=f"split_part{part}")
    r.decode(rng, "float16", 8, 1, 128, 16, [4097, 5], split_k=False, label="long_nosplit")
    r.decode(rng, "float32", 1, 2, 256, 32, [4097, 5], split_k=False, label="long_nosplit")
    r.decode(rng, "float16", 8, 1, 128, 16, [512, 1024, 1536, 511, 513], label="partition_edges")
    r.decode(rng, "float32", 8, 2, 256, 16, [1535, 2], label="hd256_split")
    r.decode(rng, "bfloat16", 1, 2, 32, 8, [2000, 1, 1, 1], label="hd32_split")
    # Block sizes outside the usual set.
    for bs in (1, 2, 64):
        r.decode(rng, "float16", 4, 2, 128, bs, [1, 63, 64, 65, 600], label=f"bs{bs}")
        r.prefill(rng, "float16", 4, 2, 128, bs, [(10, 63), (64, 64), (3, 65)], label=f"bs{bs}")
    # Blocks of 1-4 tokens (a lookup per row) in every tile shape: 16- and 8-token tiles,
    # partitions starting mid-tile, fp32 on tensor cores (8-byte V loads), head_dim 256.
    for bs in (1, 2, 4):
        for sn, hd in (("float16", 32), ("float16", 128), ("float32", 64)):
            r.decode(rng, sn, 4, 2, hd, bs, [1, 5, 33, 130], split_k=True, partition_size=7,
                     label=f"rows_bs{bs}_split")
        r.decode(rng, "bfloat16", 2, 2, 256, bs, [3, 517], label=f"rows_bs{bs}")
    # kv heads 1 and 8.
    for kvh in (1, 8):
        r.decode(rng, "float32", 4, kvh, 64, 16, [9, 700], label=f"kvh{kvh}")
        r.prefill(rng, "float32", 4, kvh, 64, 16, [(9, 20), (30, 30)], label=f"kvh{kvh}")
    # Shared prefix blocks (two tables point at the same physical blocks).
    r.decode(rng, "float16", 4, 2, 128, 16, [100, 90, 70], shared_prefix=True, label="shared_blocks")
    # Peaky softmax (large q): the running max must be right; and an explicit scale.
    r.decode(rng, "float32", 4, 2, 128, 16, [300, 1000], q_scale=20.0, label="peaky")
    r.decode(rng, "float16", 4, 2, 128, 16, [300, 1000], q_scale=8.0, label="peaky")
    r.prefill(rng, "float32", 4, 2, 128, 16, [(50, 300)], q_scale=20.0, label="peaky")
    r.decode(rng, "float32", 4, 2, 64, 16, [300, 9], scale=0.05, label="scale")
    # Prefill: long chunks and long prefixes, q_len 1 with a long prefix.
    r.prefill(rng, "float16", 4, 2, 128, 16, [(300, 300), (257, 1000), (1, 600)], label="long_prefill")
    r.prefill(rng, "bfloat16", 8, 1, 256, 16, [(65, 65), (40, 200)], label="long_prefill")
    r.prefill(rng, "float32", 1, 2, 32, 8, [(200, 200), (1, 1), (33, 500)], label="long_prefill")
    # Prefill: empty chunk in the batch (q_len 0).
    r.prefill(rng, "float16", 4, 2, 64, 16, [(5, 5), (0, 30), (8, 8)], label="empty_chunk")
    # Decode: a single sequence of length 1, and a batch of many short ones.
    r.decode(rng, "float16", 8, 1, 128, 16, [1], label="single_len1")
    r.decode(rng, "float16", 4, 2, 64, 16, list(range(1, 41)), label="many_short")


def suite_write_kv(r: Runner, rng):
    for sn in STORAGES:
        for hd in (32, 64, 128, 256):
            for kvh in (1, 2, 8):
                r.write_kv(rng, sn, kvh, hd, 16, 23, label="aligned")
        for mis in (1, 2):
            r.write_kv(rng, sn, 2, 64, 16, 11, misalign=mis, label=f"misaligned{mis}")


def suite_chain(r: Runner, rng):
    for sn in STORAGES:
        r.chain(rng, sn, 4, 2, 128, 16, [1, 15, 16, 40], label="write+prefill+decode")
    r.chain(rng, "float16", 8, 1, 64, 8, [600, 3], label="write+prefill+decode(split)")


def suite_quick(r: Runner, rng):
    for sn in STORAGES:
        r.decode(rng, sn, 4, 2, 128, 16, LONG_LENS, label="quick")
        r.prefill(rng, sn, 4, 2, 128, 16, PREFILL_CHUNKS, label="quick")
        r.write_kv(rng, sn, 2, 128, 16, 10, label="quick")


def suite_misuse(r: Runner, rng):
    """What a caller can get wrong, and batch invariance."""
    for sn in STORAGES:
        r.batch_invariance(rng, sn, 4, 2, 128, 16, [300, 37, 5000, 512, 513, 1], label="batch_invariance")
    r.batch_invariance(rng, "float16", 8, 1, 64, 8, [2049, 3, 700], label="batch_invariance")
    # max_seq_len below the real maximum: all tokens still count, nothing read out of bounds.
    for lens, given in (([2000, 10], 600), ([5000, 7, 4000], 1), ([1500], 513)):
        r.decode(rng, "float32", 4, 1, 64, 16, lens, max_seq_len=given, label="max_seq_len_too_small")
    r.decode(rng, "float16", 4, 2, 128, 16, [3000, 9], max_seq_len=100, label="max_seq_len_too_small")
    r.decode(rng, "float32", 4, 1, 64, 16, [0, 5], label="seq_len_zero")
    r.decode(rng, "float32", 4, 1, 64, 16, [0, 900], label="seq_len_zero")
    for sn in ("float16", "bfloat16"):
        for mis in (1, 2, 3):
            r.write_kv(rng, sn, 2, 64, 16, 11, misalign=mis, label=f"misaligned{mis}")


def suite_ci(r: Runner, rng):
    """A CI-sized subset: every (storage, head_dim) once, the heads-per-block variants, block
    sizes 1 and 64, split-K with empty partitions and odd partition sizes, prefix prefill,
    write_kv aligned and at 2-byte offsets, batch invariance, a too-small max_seq_len, a chain."""
    for sn in STORAGES:
        for hd in (32, 64, 128, 256):
            r.decode(rng, sn, 4, 2, hd, 16, LONG_LENS, label="ci")
            r.prefill(rng, sn, 4, 2, hd, 16, PREFILL_CHUNKS, label="ci")
        for g in (1, 2, 8):
            r.decode(rng, sn, g, 2, 128, 8, [1, 40, 600], label="ci")
        r.write_kv(rng, sn, 2, 128, 16, 10, label="ci")
        r.write_kv(rng, sn, 2, 64, 16, 11, misalign=1, label="ci-misaligned1")
    # Tensor-core tiles of 16 tokens over 8-token blocks (head_dim <= 64): a lookup per group
    # of 8 rows, kept from K's load for V's; partial tiles at both ends of split partitions.
    for sn in STORAGES:
        r.decode(rng, sn, 4, 2, 32, 8, [1, 13, 16, 40, 517], label="ci-bs8-groups")
    r.decode(rng, "bfloat16", 2, 2, 64, 8, [1, 5, 33, 130], split_k=True, partition_size=7,
             label="ci-bs8-groups-split")
    # every sequence within one block: a tile's second group has no row (its lookup is skipped:
    # a table no wider than its blocks would end before it)
    r.decode(rng, "float16", 4, 2, 32, 8, [5, 3], label="ci-bs8-groups-one-block")
    r.decode(rng, "float16", 4, 2, 64, 1, [1, 7, 300], label="ci-bs1")
    # 16-token tiles over 2- and 4-token blocks: a lookup per row (V's rows 2t, 2t + 1 share one)
    r.decode(rng, "float16", 2, 2, 32, 4, [1, 13, 16, 40, 517], label="ci-bs4-rows")
    r.decode(rng, "bfloat16", 4, 2, 64, 2, [1, 5, 33, 130], split_k=True, partition_size=7,
             label="ci-bs2-rows-split")
    # ... partitions starting mid-tile at 4-token blocks (a pair's first row masked, its second
    # not), and 8-token tiles (head_dim 128) over 4-token blocks
    r.decode(rng, "float16", 2, 2, 32, 4, [1, 5, 33, 130], split_k=True, partition_size=7,
             label="ci-bs4-rows-split")
    r.decode(rng, "float16", 4, 2, 128, 4, [1, 5, 33, 130], split_k=True, partition_size=7,
             label="ci-bs4-rows-tok8-split")
    r.decode(rng, "float32", 4, 2, 64, 64, [1, 63, 64, 65, 600], label="ci-bs64")
    # fp32 with 1 head per block runs on CUDA cores: a partial last tile (13, 517) and splits.
    r.decode(rng, "float32", 1, 2, 64, 16, [13, 517, 2], label="ci-cuda-cores")
    r.decode(rng, "float16", 4, 2, 64, 16, [1, 5, 33, 130], split_k=True, partition_size=7, label="ci")
    r.batch_invariance(rng, "float16", 4, 2, 128, 16, [300, 37, 2500, 512, 1], label="ci")
    r.decode(rng, "float32", 4, 1, 64, 16, [2000, 10], max_seq_len=600, label="ci-max_seq_len_too_small")
    r.chain(rng, "float16", 4, 2, 128, 16, [1, 15, 16, 40], label="ci")


SUITES = {"ci": suite_ci, "sweep": suite_sweep, "special": suite_special, "write_kv": suite_write_kv,
          "chain": suite_chain, "misuse": suite_misuse, "quick": suite_quick}
FULL = "sweep,special,write_kv,chain,misuse"
