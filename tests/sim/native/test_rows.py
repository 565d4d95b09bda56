"""sim/native/_rows.c, the compiled build's writer of a decode run's per-step rows, against the Python
it stands in for (stepping._used_by_step, the timeline's flush): the same numbers, bit for bit.
(Its decode step times: tests/sim/model/test_costmodel.py, against CostModel.step; whole runs,
compiled and pure: tests/test_compiled.py.)"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sim import load_scenario
from sim.model.costmodel import CostModel
from sim.native import compiled

from sim.engine import stepping
rows = stepping._ROWS
pytestmark = pytest.mark.skipif(rows is None, reason="no compiled build (pure Python)")


# CostModel.kernel_coefficients: 29, `overlap` (an int) 13th
COEFFICIENTS = (1.0,) * 12 + (False,) + (1.0,) * 16


def test_the_compiled_build_uses_it():
    assert compiled.COMPILED and rows is not None


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
    assert len(COEFFICIENTS) == len(CostModel(load_scenario("chat")).kernel_coefficients)
    col = np.zeros(4)
    with pytest.raises(ValueError):  # too short for the rows asked
        rows.decode_rows(col, col, col, 2, 5, 0.0, 1.0, 1, 0, COEFFICIENTS, 1.0, 0.0)
    with pytest.raises(TypeError):  # coefficients one short
        rows.decode_rows(col, col, col, 0, 1, 0.0, 1.0, 1, 0, COEFFICIENTS[:-1], 1.0, 0.0)
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
    # sim/native/_rows.c and by NumPy, give the same columns.
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
        rows.decode_rows(*cols, 2**62, 2**62, 0.0, 1.0, 1, 0, COEFFICIENTS, 1.0, 0.0)

    class Bool:
        def __bool__(self):
            raise RuntimeError("ran")

    with pytest.raises(TypeError):  # a string time, then an object: TypeError, nothing run
        rows.decode_rows(*cols, 0, 1, "x", 1.0, 1, 0, COEFFICIENTS, 1.0, 0.0)
    with pytest.raises(TypeError):
        rows.decode_rows(*cols, 0, 1, 0.0, 1.0, 1, 0, (*COEFFICIENTS[:12], Bool(), *COEFFICIENTS[13:]), 1.0, 0.0)
    out = [np.zeros(2, dtype=np.int64) for _ in range(7)]
    with pytest.raises(TypeError):
        rows.expand([[1], [1.5]] + [[0]] * 8, np.zeros(1, dtype=np.int64), 1, out)


def _misaligned(dtype, n: int) -> np.ndarray:
    """A writable C-contiguous column of `n` items starting 1 byte past an 8-byte boundary."""
    raw = np.zeros(n * 8 + 16, dtype=np.uint8)
    start = (-raw.ctypes.data) % 8 + 1
    col = raw[start:start + n * 8].view(dtype)
    assert col.ctypes.data % 8 == 1 and col.flags.c_contiguous and col.flags.writeable
    return col


def test_misaligned_or_mistyped_columns_are_refused_before_any_write():
    # A column 1 byte off its alignment (a view into a byte buffer) is a misaligned 8-byte
    # load or store in C: refused, the memory untouched.
    ok = [np.zeros(4) for _ in range(3)]
    for i in range(3):
        cols = list(ok)
        cols[i] = _misaligned(np.float64, 4)
        with pytest.raises(ValueError, match="aligned"):
            rows.decode_rows(*cols, 0, 2, 0.0, 1.0, 1, 0, COEFFICIENTS, 1.0, 0.0)
        assert not cols[i].any()
    bad = _misaligned(np.int64, 8)
    with pytest.raises(ValueError, match="aligned"):
        rows.used_rows(bad, 0, [0], 4, 16, 0, 0)
    assert not bad.any()
    out = [np.zeros(2, dtype=np.int64) for _ in range(7)]
    for where in range(8):
        used, outs = np.zeros(2, dtype=np.int64), list(out)
        if where == 0:
            used = _misaligned(np.int64, 2)
        else:
            outs[where - 1] = _misaligned(np.int64, 2)
        with pytest.raises(ValueError, match="aligned"):
            rows.expand([[2]] + [[1]] * 9, used, 2, outs)
        assert not any(o.any() for o in outs)
    # 8-byte items of the other kind: int64 where float64 is written, and the reverse
    with pytest.raises(ValueError, match="float64"):
        rows.decode_rows(np.zeros(4, dtype=np.int64), *ok[1:], 0, 2, 0.0, 1.0, 1, 0, COEFFICIENTS, 1.0, 0.0)
    with pytest.raises(ValueError, match="int64"):
        rows.used_rows(np.zeros(8), 0, [0], 4, 16, 0, 0)


INT64_MAX = 2**63 - 1


def test_values_that_overflow_int64_raise_overflow_error():
    # Signed overflow is undefined in C: each sum and product is checked.
    col = np.zeros(4, dtype=np.int64)
    with pytest.raises(OverflowError):  # the blocks used, summed along the run
        rows.used_rows(col, 0, [0, 1], 4, 1, INT64_MAX, 0)
    with pytest.raises(OverflowError):
        rows.used_rows(col, 0, [0, 0, 0], 4, 1, INT64_MAX - 2, 0)
    cols = [np.zeros(4) for _ in range(3)]
    with pytest.raises(OverflowError):  # the context grows by the batch each step
        rows.decode_rows(*cols, 0, 4, 0.0, 1e300, 2**62, 2**62, COEFFICIENTS, 1.0, 0.0)
    with pytest.raises(ValueError):  # a negative batch or context
        rows.decode_rows(*cols, 0, 4, 0.0, 1.0, -1, 0, COEFFICIENTS, 1.0, 0.0)
    with pytest.raises(ValueError):
        rows.decode_rows(*cols, 0, 4, 0.0, 1.0, 1, -5, COEFFICIENTS, 1.0, 0.0)
    used = np.array([2**62, 0], dtype=np.int64)
    out = [np.zeros(2, dtype=np.int64) for _ in range(7)]
    runs = [[2], [1], [0], [1], [1], [0], [1], [0], [4], [0]]  # e_block 4 x used 2**62
    with pytest.raises(OverflowError):
        rows.expand(runs, used, 2, out)
    runs = [[2], [1], [0], [2**62], [1], [0], [1], [-(2**62) - 1], [0], [0]]  # - batch x row
    with pytest.raises(OverflowError):
        rows.expand(runs, used, 2, out)
    # the largest values that fit are served, not refused
    assert rows.used_rows(col, 0, [], 4, 1, INT64_MAX, 0) == INT64_MAX
    rows.expand([[1], [1], [0], [1], [1], [0], [1], [INT64_MAX - 1], [0], [1]],
                np.zeros(1, dtype=np.int64), 1, out)
    assert out[5][0] == INT64_MAX

