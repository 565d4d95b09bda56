import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.stats import quantiles
from sim.stats.quantiles import PCTS, distribution_ms, weighted_quantiles
from sim.stats.quantiles import ALPHA, LogHistogram, Samples, pooled_distribution_ms

values = st.lists(st.one_of(st.just(0.0), st.floats(1e-7, 1e4)), min_size=1, max_size=300)


@settings(max_examples=200, deadline=None)
@given(values, st.data())
def test_sketch_percentiles_are_within_the_stated_bound(vals, data):
    v = np.array(vals)
    w = np.array(data.draw(st.lists(st.integers(0, 50), min_size=len(v), max_size=len(v))))
    if w.sum() == 0:
        w[0] = 1
    h = LogHistogram()
    h.add(v, w)
    live = v[w > 0]
    exact = weighted_quantiles(v, w, (0, *PCTS, 100))
    got = h.quantiles((0, *PCTS, 100), float(live.min()), float(live.max()))
    for e, g in zip(exact, got):
        assert abs(g - e) <= ALPHA * e * (1 + 1e-9), (e, g)
    assert h.total == w.sum()


def test_histograms_merge_as_one():
    rng = np.random.default_rng(1)
    a, b = rng.lognormal(-3, 1, 5000), rng.lognormal(-2, 2, 3000)
    one, two, both = LogHistogram(), LogHistogram(), LogHistogram()
    one.add(a)
    two.add(b)
    both.add(np.concatenate((a, b)))
    one.merge(two)
    assert one.offset == both.offset and np.array_equal(one.counts, both.counts)


def test_samples_are_exact_up_to_the_limit_then_bounded():
    rng = np.random.default_rng(2)
    v = rng.lognormal(-3, 1, 1000)
    s = Samples(limit=1000)
    for x in v:
        s.add(float(x))
    assert s.exact and pooled_distribution_ms([s]) == distribution_ms(v)
    s.add(0.5)  # one past the limit: folded into the sketch
    v = np.append(v, 0.5)
    assert not s.exact
    got, want = pooled_distribution_ms([s]), distribution_ms(v)
    assert got["count"] == want["count"] and got["max"] == want["max"]
    assert got["mean"] == pytest.approx(want["mean"], rel=1e-12)
    for q in PCTS:
        assert abs(got[f"p{q}"] - want[f"p{q}"]) <= ALPHA * want[f"p{q}"] * (1 + 1e-9)
    assert got != want  # (the bound is not exactness: this data shows the difference)


def test_pooling_mixes_exact_and_sketched_sources(monkeypatch):
    monkeypatch.setattr(quantiles, "EXACT_LIMIT", 100)
    rng = np.random.default_rng(3)
    big, small = Samples(), Samples()
    vb, vs = rng.exponential(0.05, 400), rng.exponential(0.02, 50)
    big.extend(vb, np.full(400, 3))
    small.extend(vs)
    assert not big.exact and small.exact
    got = pooled_distribution_ms([big, small, (np.array([0.1]), np.array([2]))])
    vals = np.concatenate((vb, vs, [0.1]))
    w = np.concatenate((np.full(400, 3), np.ones(50, int), [2]))
    want = distribution_ms(vals, w)
    assert got["count"] == want["count"] == 1252
    for q in PCTS:
        assert abs(got[f"p{q}"] - want[f"p{q}"]) <= ALPHA * want[f"p{q}"] * (1 + 1e-9)


def test_an_empty_pool_has_no_figures():
    assert pooled_distribution_ms([Samples(), (np.zeros(0), None)])["p99"] is None
    s = Samples(limit=0)
    s.extend(np.zeros(0))
    assert pooled_distribution_ms([s])["count"] == 0
