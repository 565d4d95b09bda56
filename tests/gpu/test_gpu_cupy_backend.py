"""CUDA kernels against the NumPy backend; skipped cleanly without CuPy or a CUDA device."""

import numpy as np
import pytest

import gpu
from gpu import selfcheck
from gpu.executor import CPU_MODEL
from gpu.synthetic import random_paged_batch, random_values

cupy = pytest.importorskip("cupy")
try:
    CUDA = gpu.get_backend("cupy")
except gpu.BackendUnavailable as exc:
    pytest.skip(str(exc), allow_module_level=True)

PLAN = selfcheck.Plan(kernel_cases=[(4, 2, 128, 16, [1, 16, 100, 1500]), (2, 1, 64, 8, [9, 64]),
                                    (16, 2, 32, 16, [3, 700])])


@pytest.mark.parametrize("storage_name", PLAN.storages)
def test_kernels_match_numpy(storage_name):
    plan = selfcheck.Plan(storages=(storage_name,), kernel_cases=PLAN.kernel_cases)
    failed = [r for r in selfcheck.check_kernels(CUDA, plan) if not r["passed"]]
    assert not failed, failed


def test_dispatch_follows_the_array_type():
    q = cupy.zeros((1, 2, 32), dtype=cupy.float32)
    cache = cupy.zeros((2, 8, 1, 32), dtype=cupy.float32)
    out = gpu.paged_decode_attention(q, cache, cache, cupy.zeros((1, 1), cupy.int32), cupy.ones(1, cupy.int32))
    assert isinstance(out, cupy.ndarray)


def test_decode_is_batch_invariant_on_cuda():
    rng = np.random.default_rng(0)
    batch = random_paged_batch(rng, [300, 1200, 40], block_size=16, num_kv_heads=2, head_dim=64,
                                             storage_name="float16")
    q = random_values(rng, (3, 8, 64), "float16")
    k, v = cupy.asarray(batch.k_cache), cupy.asarray(batch.v_cache)
    tables, lens = cupy.asarray(batch.block_tables), cupy.asarray(batch.seq_lens)
    together = gpu.paged_decode_attention(cupy.asarray(q), k, v, tables, lens)  # split-K on (1200 > 512)
    alone = gpu.paged_decode_attention(cupy.asarray(q[:1]), k, v, tables[:1], lens[:1])  # split-K off
    assert bool((together[:1] == alone).all())


def test_tiny_model_tokens_match_numpy():
    plan = selfcheck.Plan(token_dtypes=("float32",), token_model=dict(CPU_MODEL), token_prompts=(5, 30),
                          new_tokens=8)
    (entry,) = selfcheck.check_tokens(CUDA, plan)
    assert "error_text" not in entry, entry
    assert all(r["batched_equals_alone"] for r in entry["requests"])
