"""A request's K/V handed from one executor's pool to another's (prefill/decode disaggregation):
the receiving executor continues exactly as the sending one would, from other block ids, and can
still verify the request. NumPy always; CuPy when a CUDA device is there."""

import numpy as np
import pytest

import gpu
from gpu.executor import ModelExecutor
from sim.engine.executor import SeqWork, StepWork

BLOCK_SIZE = 8
SIZES = {"num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "head_dim": 32}


def backends():
    out = ["numpy"]
    try:
        gpu.get_backend("cupy")
        out.append("cupy")
    except gpu.BackendUnavailable:
        pass
    return out


def decode(ex, rid, tokens, table, n):
    """Greedy decoding of `n` tokens after `tokens` (whose K/V is in `table`)."""
    out = []
    for _ in range(n):
        pos = len(tokens) - 1
        if pos // BLOCK_SIZE >= len(table):
            raise AssertionError("table too short")
        tok = ex.execute(StepWork(0, [SeqWork(rid, np.array([tokens[-1]]), pos, table, True)]))
        tokens.append(tok[rid])
        out.append(tok[rid])
    return out


@pytest.mark.parametrize("backend", backends())
def test_handed_off_kv_continues_exactly(backend):
    prompt = np.random.default_rng(3).integers(0, 256, 37).tolist()
    table = [5, 2, 9, 0, 7, 11]  # the prefill side's blocks
    results = []
    for handoff in (False, True):
        a = ModelExecutor(16, BLOCK_SIZE, backend=backend, **SIZES)
        first = a.execute(StepWork(0, [SeqWork(1, np.array(prompt), 0, table[:5], True)]))[1]
        tokens = prompt + [first]
        if handoff:
            b = ModelExecutor(16, BLOCK_SIZE, backend=backend, verify_every=1, **SIZES)
            dst = [14, 3, 8, 1, 12]  # other ids in the decode side's pool
            b.import_kv(1, dst, a.export_kv(1, table[:5]))
            a = b  # the prefill side's pool is no longer read
            table = dst + [6]
        results.append(decode(a, 1, tokens, table, 6))
        if handoff:
            b.verify_request(1, table, None)
    assert results[0] == results[1]


def test_import_refuses_a_different_block_count():
    a = ModelExecutor(8, BLOCK_SIZE, backend="numpy", **SIZES)
    b = ModelExecutor(8, BLOCK_SIZE, backend="numpy", **SIZES)
    with pytest.raises(ValueError, match="2 blocks for 3"):
        b.import_kv(1, [0, 1], a.export_kv(1, [4, 5, 6]))
    with pytest.raises(ValueError, match="outside"):
        a.export_kv(1, [8])
