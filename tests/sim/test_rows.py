"""sim/_rows.c, the compiled build's writer of a decode run's per-step rows, against the Python
it stands in for (CostModel.decode_times, stepping._used_by_step): the same numbers, bit for
bit. (tests/test_compiled.py compares whole runs, compiled and pure.)"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sim import _compiled

from sim.engine import stepping
from sim.model.costmodel import CostModel
from sim.inputs.scenario import load_scenario

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
    e = type("E", (), {"_scalar_steps": 1 << 20})()  # (the scalar path of _used_by_step)
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


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_expand_equals_the_numpy_flush(data):
    # The timeline's flush: staged runs (single steps and decode runs) onto their rows, by
    # sim/_rows.c and by NumPy, give the same columns.
    from sim.engine import timeline as tlmod
    from sim.engine.timeline import COLUMNS, Timeline

    steps = data.draw(st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 500),
                                         st.integers(0, 10**6), st.integers(0, 64)),
                               min_size=1, max_size=30))
    lines = []
    for c_flush in (True, False):
        saved = tlmod._ROWS
        tlmod._ROWS = saved if c_flush else None
        try:
            tl, t = Timeline(), 0.0
            for single, k, b, base, per_block in steps:
                if single:
                    t += 0.01
                    tl.add_row(t, 0.01, b + k, k, b + 1, b, b // 2, base % 977, base, 0.5,
                               per_block)
                else:
                    ends = [t + 0.01 * (j + 1) for j in range(k)]
                    t = ends[-1]
                    tl.add_decodes(ends, [0.01] * k, b, b // 3, [base % 977 + j for j in range(k)],
                                   base, per_block, b % 7, [0.2] * k, per_block)
            tl.flush()
            lines.append({name: tl.column(name).tolist() for name in COLUMNS})
        finally:
            tlmod._ROWS = saved
    assert lines[0] == lines[1]


def test_expand_rejects_runs_that_do_not_fit():
    used = np.zeros(4, dtype=np.int64)
    out = [np.zeros(4, dtype=np.int64) for _ in range(7)]
    runs = [[5]] + [[0]] * 9  # a run of 5 rows, 4 staged
    with pytest.raises(ValueError):
        rows.expand(runs, used, 4, out)
    with pytest.raises(ValueError):
        rows.expand([[3]] + [[0]] * 9, used, 4, out)  # 3 of 4
    with pytest.raises(TypeError):
        rows.expand(runs[:9], used, 4, out)


def test_hostile_arguments_raise_not_crash():
    # Sizes that overflow C arithmetic and values that would run Python code: an exception.
    col = np.zeros(1, dtype=np.int64)
    with pytest.raises(ValueError):
        rows.used_rows(col, 2**62, [], 2**62, 1, 0, 0)
    cols = [np.zeros(4) for _ in range(3)]
    with pytest.raises(ValueError):
        rows.decode_rows(*cols, 2**62, 2**62, 0.0, 1.0, 1, 0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0,
                         False, 1.0, 1.0)

    class Bool:
        def __bool__(self):
            raise RuntimeError("ran")

    with pytest.raises(TypeError):  # a string time, then an object: TypeError, nothing run
        rows.decode_rows(*cols, 0, 1, "x", 1.0, 1, 0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, Bool(),
                         1.0, 1.0)
    out = [np.zeros(2, dtype=np.int64) for _ in range(7)]
    with pytest.raises(TypeError):
        rows.expand([[1], [1.5]] + [[0]] * 8, np.zeros(1, dtype=np.int64), 1, out)
