"""sim/_rows.c, the compiled build's writer of a decode run's per-step rows, against the Python
it stands in for (CostModel.decode_times, stepping._used_by_step): the same numbers, bit for
bit. (tests/test_compiled.py compares whole runs, compiled and pure.)"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sim import _compiled, stepping
from sim.costmodel import CostModel
from sim.scenario import load_scenario

rows = stepping._ROWS
pytestmark = pytest.mark.skipif(rows is None, reason="no compiled build (pure Python)")


def test_the_compiled_build_uses_it():
    assert _compiled.COMPILED and rows is not None


@settings(max_examples=80, deadline=None)
@given(preset=st.sampled_from(["vllm-v1", "vllm-0.6-multistep", "sglang-0.3", "tensorrt-llm-0.6"]),
       b=st.integers(1, 300), c0=st.integers(0, 2_000_000), n=st.integers(1, 300),
       t0=st.floats(0, 1e6), cut=st.floats(0, 1.0), tp=st.sampled_from([1, 2, 8]),
       hw=st.sampled_from(["h100-sxm", "a100-80gb", "l40s"]), at=st.integers(0, 50))
def test_decode_rows_equal_decode_times(preset, b, c0, n, t0, cut, tp, hw, at):
    cm = CostModel(load_scenario("chat", [f'engine.preset="{preset}"', f"model.tensor_parallel={tp}",
                                          f'hardware.preset="{hw}"']))
    t_ext = t0 + cut
    want = cm.decode_times(b, c0, n, t0, t_ext)
    cols = [np.full(at + n + 3, -1.0) for _ in range(3)]
    k, first, last = rows.decode_rows(*cols, at, n, t0, t_ext, b, c0, *cm._decode_shared(b),
                                      cm._overlap, cm._idle, cm._dyn)
    assert k == len(want[0])
    assert (first, last) == (want[0][0], want[0][-1])
    for col, w in zip(cols, want):
        assert col[at:at + k].tolist() == w  # (== on floats: the same bits)
        assert (col[:at] == -1).all() and (col[at + k:] == -1).all()  # nothing else written


@settings(max_examples=80, deadline=None)
@given(k=st.integers(1, 300), bs=st.sampled_from([1, 4, 16, 32]), used=st.integers(0, 10**6),
       data=st.data(), at=st.integers(0, 20))
def test_used_rows_equal_used_by_step(k, bs, used, data, at):
    steps = sorted(data.draw(st.lists(st.integers(0, k - 1), max_size=60)))
    e = type("E", (), {"SCALAR_STEPS": 1 << 20})()  # (the scalar path of _used_by_step)
    want = stepping._used_by_step(e, steps, k, bs, used)
    col = np.full(at + k + 2, -7, dtype=np.int64)
    assert rows.used_rows(col, at, steps, k, bs, used, -5) == want[-1]
    assert col[at] == -5 and col[at + 1:at + k].tolist() == want[1:]  # (row 0 given)
    assert (col[:at] == -7).all() and (col[at + k:] == -7).all()


def test_bad_arguments_raise_not_crash():
    col = np.zeros(4)
    with pytest.raises(ValueError):  # too short for the rows asked
        rows.decode_rows(col, col, col, 2, 5, 0.0, 1.0, 1, 0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0,
                         False, 1.0, 1.0)
    with pytest.raises(ValueError):  # the wrong item size
        rows.used_rows(np.zeros(8, dtype=np.int32), 0, [0], 4, 16, 0, 0)
    with pytest.raises(ValueError):  # a crossing outside the run
        rows.used_rows(np.zeros(8, dtype=np.int64), 0, [5], 4, 16, 0, 0)
    with pytest.raises(BufferError):  # read-only: not a writable column
        rows.used_rows(b"\0" * 64, 0, [0], 4, 16, 0, 0)
