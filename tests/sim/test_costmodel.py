import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sim.costmodel import CostModel
from sim.scenario import load_scenario


def model(*o):
    return CostModel(load_scenario("chat", list(o)))


def test_decode_step_is_memory_bound_and_matches_the_formula():
    m = model("hardware.step_overhead_ms=0")
    # one decode token with 1000 cached tokens, Llama-3.1-8B on an H100
    dur, energy = m.step(1, 1001, 1000)
    bytes_ = 8.03e9 * 2 + 131072 * (1000 + 1)
    assert dur == pytest.approx(bytes_ / (3350e9 * 0.85))
    assert energy == pytest.approx(90 * dur + (700 - 90) * dur)


def test_big_prefill_is_compute_bound():
    m = model("hardware.step_overhead_ms=0")
    n = 8192
    dur, _ = m.step(n, n * (n + 1) // 2, 0)
    flops = 2 * 8.03e9 * n + 4 * 32 * 32 * 128 * (n * (n + 1) // 2)
    assert dur == pytest.approx(flops / (989e12 * 0.6))


def test_tensor_parallel_divides_work_and_adds_communication():
    tp1 = model("model.preset=\"llama-3.1-70b\"", "kv.num_blocks=1000")
    tp4 = model("model.preset=\"llama-3.1-70b\"", "model.tensor_parallel=4")
    assert tp4._comm == pytest.approx(2 * 80 * 2 * 0.75 * 8192 * 2 / 450e9)
    d1, _ = tp1.step(64, 64 * 500, 64 * 500)
    d4, _ = tp4.step(64, 64 * 500, 64 * 500)
    assert d4 < d1 / 2  # weights and KV are read four ways in parallel
    assert d4 > (d1 - tp1.overhead) / 4 + tp4.overhead  # ...but the all-reduces cost time


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4096), st.integers(0, 10**7), st.integers(0, 10**7)),
                min_size=1, max_size=20))
def test_scalar_and_array_paths_are_bit_identical(rows):
    m = model()
    t = np.array([r[0] for r in rows], dtype=np.int64)
    a = np.array([r[1] for r in rows], dtype=np.int64)
    k = np.array([r[2] for r in rows], dtype=np.int64)
    dv, ev = m.steps(t, a, k)
    for i, (ti, ai, ki) in enumerate(rows):
        ds, es = m.step(ti, ai, ki)
        assert ds == dv[i] and es == ev[i]


def test_presets_change_speed():
    h100 = model("hardware.preset=\"h100-sxm\"").step(32, 32 * 1001, 32 * 1000)[0]
    a100 = model("hardware.preset=\"a100-80gb\"").step(32, 32 * 1001, 32 * 1000)[0]
    h200 = model("hardware.preset=\"h200\"").step(32, 32 * 1001, 32 * 1000)[0]
    assert h200 < h100 < a100


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 300), c0=st.integers(0, 500_000), n=st.integers(1, 30),
       t0=st.floats(0, 1e5), cut=st.floats(0, 0.5),
       tp=st.sampled_from([1, 2, 8]), hw=st.sampled_from(["h100-sxm", "a100-80gb", "l40s"]))
def test_decode_times_equal_steps_one_at_a_time(b, c0, n, t0, cut, tp, hw):
    # The engine times the scalar part of decode runs with decode_times: one call, no call a
    # step; it must give the very floats step() gives, and stop at the step ending at t_ext.
    m = model(f"model.tensor_parallel={tp}", f'hardware.preset="{hw}"',
              "hardware.interconnect_gbps=450")
    t_ext = t0 + cut
    ends, durs, ens = m.decode_times(b, c0, n, t0, t_ext)
    t, want = t0, []
    for j in range(n):
        d, en = m.step(b, c0 + b * j + b, c0 + b * j)
        t = t + d
        want.append((t, d, en))
        if t >= t_ext:
            break
    assert list(zip(ends, durs, ens)) == want
