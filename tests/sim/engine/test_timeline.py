import numpy as np
import pytest

from sim.engine import timeline as tlmod
from sim.errors import EngineError
from sim.engine.timeline import NAMES, Timeline


def _rows(n, seed=0):
    rng = np.random.default_rng(seed)
    dur = rng.uniform(0.01, 0.05, n)
    return {"end": np.cumsum(dur), "dur": dur, "tokens": rng.integers(1, 500, n),
            "prefill_tokens": rng.integers(0, 100, n), "batch": rng.integers(1, 64, n),
            "sampled": rng.integers(0, 64, n), "itl_count": rng.integers(0, 64, n),
            "kv_used": rng.integers(0, 900, n), "kv_empty": rng.integers(0, 300, n),
            "energy": rng.uniform(1, 9, n), "waiting": rng.integers(0, 40, n),
            "out": np.cumsum(dur) + rng.uniform(0.0, 0.02, n)}


def _fill(tl, cols, n):
    """Rows 0..n-1, some one at a time and some in runs, as the engine writes them."""
    i = 0
    while i < n:
        k = 1 if (i // 7) % 2 else min(13, n - i)
        if k == 1:
            tl.add_row(*(cols[c][i].item() for c in NAMES))
        else:
            tl.append(**{c: cols[c][i:i + k] for c in NAMES})
        i += k


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(tlmod, "CHUNK", 64)
    monkeypatch.setattr(tlmod, "_STAGE", 5)


def test_chunked_columns_and_totals_equal_the_whole_columns(small_chunks):
    n = 1000
    cols = _rows(n)
    tl = Timeline()
    tl.client = True  # (behind an API server: its clients' gaps too, from `out`)
    _fill(tl, cols, n)
    assert tl.n == n
    for c in NAMES:
        assert np.array_equal(tl.column(c), cols[c]), c
    assert np.array_equal(tl.rows("end", 100, 300), cols["end"][100:300])
    t = tl.totals()
    assert t.rows == n and t.batch_sum == cols["batch"].sum()
    assert t.batch_max == cols["batch"].max() and t.used_max == cols["kv_used"].max()
    assert t.energy == pytest.approx(cols["energy"].sum(), rel=1e-12)
    assert t.used_dur == pytest.approx((cols["kv_used"] * cols["dur"]).sum(), rel=1e-12)
    gaps, counts = tl.itl.arrays()
    tg, tc = tl.tail_itl()
    assert np.array_equal(np.concatenate((gaps, tg)), np.diff(cols["end"]))
    assert np.array_equal(np.concatenate((counts, tc)), cols["itl_count"][1:])
    gaps, counts = tl.client_itl.arrays()
    tg, tc = tl.tail_itl(client=True)
    assert np.array_equal(np.concatenate((gaps, tg)), np.diff(cols["out"]))
    assert np.array_equal(np.concatenate((counts, tc)), cols["itl_count"][1:])
    for t_ in (0.0, cols["end"][0], cols["end"][500], cols["end"][-1], 1e9):
        for side in ("left", "right"):
            assert tl.index(t_, side) == np.searchsorted(cols["end"], t_, side), (t_, side)


def test_columns_given_as_lists_are_split_where_a_chunk_fills(small_chunks):
    """A decode run's times may come as lists (the scalar path's); a run that fills a chunk
    midway writes each list's rows on both sides of the seal."""
    n = 150
    cols = _rows(n)
    tl = Timeline()
    tl.append(**{c: cols[c][:60] for c in NAMES})
    tl.append(**{c: cols[c][60:].tolist() for c in NAMES})  # crosses row 64
    for c in NAMES:
        assert np.array_equal(tl.column(c), cols[c]), c


def test_a_decode_run_staged_at_once_equals_its_steps_one_by_one(small_chunks):
    """`add_decodes` (the engine's decode runs) writes the rows `add_row` would, each column
    in its place, across stage flushes and sealed chunks."""
    rng = np.random.default_rng(3)
    one, runs = Timeline(), Timeline()
    t = 0.0
    for r in range(40):
        k = int(rng.integers(1, 30))
        b, itl0, waiting = int(rng.integers(1, 64)), int(rng.integers(0, 64)), r % 5
        durs = rng.uniform(0.01, 0.02, k).tolist()
        ends = np.cumsum([t] + durs)[1:].tolist()
        t = ends[-1]
        used = np.sort(rng.integers(0, 900, k)).tolist()
        bs, base, first = int(rng.integers(1, 33)), int(rng.integers(0, 300)), r % 7
        # (step j's empty slots: base - b*j + bs*used_j, `first` more in step 0)
        empty = [base - b * j + bs * used[j] + (first if j == 0 else 0) for j in range(k)]
        energy = rng.uniform(1, 9, k).tolist()
        outs = (np.array(ends) + rng.uniform(0.0, 0.005, k)).tolist()
        runs.add_decodes(ends, durs, b, itl0, used, base, bs, first, energy, waiting, outs)
        for j in range(k):
            one.add_row(ends[j], durs[j], b, 0, b, b, itl0 if j == 0 else b, used[j],
                        empty[j], energy[j], waiting, outs[j])
        if r % 9 == 0:  # a single step in between
            t += 0.03
            for tl in (one, runs):
                tl.add_row(t, 0.03, 700, 600, 9, 3, 2, 11, 5, 4.5, 1)
    assert runs.n == one.n > 64
    for c in NAMES:
        assert np.array_equal(runs.column(c), one.column(c)), c


def test_without_history_rows_are_dropped_unless_pinned(small_chunks):
    cols = _rows(1000)
    pin = [300]
    tl = Timeline(keep=False, pinned=lambda: pin[0])
    _fill(tl, cols, 600)
    assert tl.first == 256  # the chunks before the one holding row 300 are gone
    assert np.array_equal(tl.ends(300, 10), cols["end"][300:310])
    with pytest.raises(EngineError, match="folded"):
        tl.ends(200, 10)
    with pytest.raises(EngineError, match="folded"):
        tl.rows("kv_used", 300, 310)  # a sealed chunk keeps only its end times
    pin[0] = float("inf")
    _fill(tl, {c: v[600:] for c, v in cols.items()}, 400)
    assert tl.first == 960 and tl.n == 1000
    whole = Timeline()
    _fill(whole, cols, 1000)
    a, b = tl.totals(), whole.totals()
    assert all(getattr(a, k) == getattr(b, k) for k in tlmod.TOTALS)


def test_without_history_the_rolling_window_stays_readable_and_bounded(small_chunks):
    # Rows end every 0.01-0.05 s: a 3 s window spans 60-300 rows, a few chunks of 64. At each
    # point, what `sim.rolling` reads (the ROLLING columns of the rows ending in the window,
    # the end time of the row before) is there, and what is held does not grow with the run.
    n, window = 4000, 3.0
    cols = _rows(n)
    tl = Timeline(keep=False, pinned=lambda: float("inf"), window_s=window)
    held = []
    for upto in range(200, n + 1, 200):
        _fill(tl, {c: v[upto - 200:] for c, v in cols.items()}, 200)
        now = cols["end"][upto - 1]
        lo = tl.index(now - window, "left")
        assert lo == np.searchsorted(cols["end"], now - window, "left")
        for c in tlmod.ROLLING:
            assert np.array_equal(tl.rows(c, lo, upto), cols[c][lo:upto]), (upto, c)
        assert tl.ends(lo - 1, 1)[0] == cols["end"][lo - 1]
        held.append(upto - tl.first)
    assert max(held) <= 320 + 3 * 64  # (the window's rows, and the chunks they straddle)
    with pytest.raises(EngineError, match="folded"):
        tl.rows("batch", 0, 10)
    with pytest.raises(EngineError, match="folded"):
        tl.rows("kv_used", n - 100, n)  # (a sealed chunk keeps only what rolling reads)


def test_a_run_with_the_collector_paused_makes_no_garbage_cycles(monkeypatch):
    # Runs pause the cyclic collector (sim/gcpause.py), so a reference cycle made per flush
    # or per step stays, with whatever it holds, until the run ends: compiled nested functions
    # made one per flush (their shared environment), holding the flush's arrays.
    import gc

    from sim import Engine, load_scenario

    from sim.engine import timeline
    monkeypatch.setattr(timeline, "_STAGE", 64)  # (a flush every 64 rows)
    sc = load_scenario("chat", ["workload.num_requests=300", "workload.duration_s=0"])
    e = Engine(sc, record_events=False, keep_history=False)
    gc.collect()
    gc.disable()
    try:
        e.run()
        assert e.step_count > 64 * 100
        assert gc.collect() < 100
    finally:
        gc.enable()
