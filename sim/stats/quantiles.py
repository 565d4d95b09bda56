"""Distributions of a run's figures in bounded memory: exact while small, a log-bucket sketch past
a size limit.

`Samples` keeps every value (with its integer weight) until it holds `EXACT_LIMIT` entries; its
percentiles are then exactly those of `weighted_quantiles`. Past the limit it folds
them into a `LogHistogram` and keeps only bucket counts: memory stops growing with the run.

`LogHistogram` buckets non-negative values on a logarithmic scale (as HDR histograms and
DDSketch do): bucket i holds (gamma^(i-1), gamma^i] with gamma = (1 + ALPHA) / (1 - ALPHA), and a
percentile read from it is the value 2 gamma^i / (gamma + 1) of the bucket that holds the exact
percentile (the same inverted-CDF rank rule), so it is within a relative error ALPHA of the exact
one (plus float rounding at a bucket edge). Zero has a bucket of its own and is exact. Count, mean,
minimum and maximum are kept exactly beside the buckets. Two histograms merge by adding counts,
so the figures of several engines pool without losing the bound.
"""

from __future__ import annotations

import math
from array import array

import numpy as np

ALPHA = 1e-3  # relative error bound of a percentile read from a LogHistogram
EXACT_LIMIT = 1 << 17  # entries a Samples keeps exactly before it switches to the sketch
_GAMMA = (1 + ALPHA) / (1 - ALPHA)
_LN_GAMMA = math.log(_GAMMA)


class LogHistogram:
    """Counts of non-negative values in logarithmic buckets (see the module docstring)."""

    __slots__ = ("counts", "offset", "zeros")

    def __init__(self) -> None:
        self.counts = np.zeros(0, dtype=np.int64)  # counts[k] is bucket offset + k
        self.offset = 0
        self.zeros = 0  # values equal to 0 (or below: none are expected)

    @property
    def total(self) -> int:
        return int(self.counts.sum()) + self.zeros

    def add(self, values: np.ndarray, weights: np.ndarray | None = None) -> None:
        """Count `values` (float64), each `weights` times (integers; default once)."""
        values = np.asarray(values, dtype=np.float64)
        pos = values > 0
        if weights is None:
            self.zeros += int(len(values) - pos.sum())
            w = None
        else:
            weights = np.asarray(weights, dtype=np.int64)
            self.zeros += int(weights[~pos].sum())
            w = weights[pos]
        if not pos.any():
            return
        idx = np.ceil(np.log(values[pos]) / _LN_GAMMA).astype(np.int64)
        lo, hi = int(idx.min()), int(idx.max())
        self._cover(lo, hi)
        binned = np.bincount(idx - self.offset, weights=w, minlength=len(self.counts))
        self.counts += binned.astype(np.int64) if w is not None else binned

    def merge(self, other: "LogHistogram") -> None:
        """Add `other`'s counts to this one's."""
        self.zeros += other.zeros
        if len(other.counts):
            self._cover(other.offset, other.offset + len(other.counts) - 1)
            k = other.offset - self.offset
            self.counts[k:k + len(other.counts)] += other.counts

    def _cover(self, lo: int, hi: int) -> None:
        """Grow the bucket array to hold indices lo..hi."""
        if not len(self.counts):
            self.counts = np.zeros(hi - lo + 1, dtype=np.int64)
            self.offset = lo
            return
        cur_hi = self.offset + len(self.counts) - 1
        new_lo, new_hi = min(lo, self.offset), max(hi, cur_hi)
        if (new_lo, new_hi) != (self.offset, cur_hi):
            grown = np.zeros(new_hi - new_lo + 1, dtype=np.int64)
            k = self.offset - new_lo
            grown[k:k + len(self.counts)] = self.counts
            self.counts, self.offset = grown, new_lo

    def quantiles(self, qs, vmin: float, vmax: float) -> list[float]:
        """Inverted-CDF percentiles (q in 0..100), each within ALPHA of the exact one; clamped
        to the exact [vmin, vmax], which only brings an estimate closer."""
        total = self.total
        if total == 0:
            return [float("nan")] * len(qs)
        cw = np.cumsum(self.counts)
        out = []
        for q in qs:
            # the rank rule of weighted_quantiles; counts are integers, so at least 1/2 means
            # the first value (not an empty bucket before it)
            need = max(q / 100.0 * total - 1e-9 * total, 0.5)
            if self.zeros >= need:
                out.append(0.0)
                continue
            k = min(int(np.searchsorted(cw, need - self.zeros, side="left")), len(cw) - 1)
            rep = 2.0 * _GAMMA ** (self.offset + k) / (_GAMMA + 1.0)
            out.append(float(min(max(rep, vmin), vmax)))
        return out


class Samples:
    """Values of one figure (each with an integer weight): exact up to EXACT_LIMIT entries,
    then a LogHistogram. `add` takes one value, `extend` arrays; do not mix the two on one
    Samples if the order of exact values matters (it sets the rounding of the mean)."""

    __slots__ = ("_parts", "_buf", "_n", "sketch", "_count", "_sum", "_min", "_max", "limit")

    def __init__(self, limit: int | None = None) -> None:
        self.limit = EXACT_LIMIT if limit is None else limit
        self._parts: list[tuple[np.ndarray, np.ndarray | None]] = []  # exact (values, weights)
        self._buf = array("d")  # single values not yet in _parts
        self._n = 0  # entries in _parts
        self.sketch: LogHistogram | None = None
        # Exact running figures, kept once the values are folded into the sketch.
        self._count = 0
        self._sum = 0.0
        self._min = math.inf
        self._max = -math.inf

    # --- adding ---------------------------------------------------------------------------
    def add(self, v: float) -> None:
        """One value of weight 1."""
        buf = self._buf
        buf.append(v)
        if len(buf) >= 4096:
            self._spill()

    def extend(self, values: np.ndarray, weights: np.ndarray | None = None) -> None:
        """Values (float64) with integer weights (None: 1 each)."""
        self._spill()
        self._take(np.asarray(values, dtype=np.float64),
                   None if weights is None else np.asarray(weights))

    def _spill(self) -> None:
        if self._buf:
            vals = np.frombuffer(self._buf, dtype=np.float64).copy()
            self._buf = array("d")
            self._take(vals, None)

    def _take(self, v: np.ndarray, w: np.ndarray | None) -> None:
        if not len(v):
            return
        if self.sketch is None:
            self._parts.append((v, w))
            self._n += len(v)
            if self._n > self.limit:
                self._fold()
            return
        self._fold_part(v, w)

    def _fold(self) -> None:
        """Move every exact entry into the sketch (from now on the figures are bounded)."""
        self.sketch = LogHistogram()
        parts, self._parts, self._n = self._parts, [], 0
        for v, w in parts:
            self._fold_part(v, w)

    def _fold_part(self, v: np.ndarray, w: np.ndarray | None) -> None:
        if w is None:
            self._count += len(v)
            self._sum += float(v.sum())
            live = v
        else:
            self._count += int(w.sum())
            self._sum += float((v * w).sum())
            live = v[w > 0]
        if len(live):
            self._min = min(self._min, float(live.min()))
            self._max = max(self._max, float(live.max()))
        assert self.sketch is not None  # (set by _fold before any part is folded)
        self.sketch.add(v, w)

    # --- reading --------------------------------------------------------------------------
    @property
    def exact(self) -> bool:
        """True while every value is held (percentiles exact)."""
        self._spill()
        return self.sketch is None

    def arrays(self) -> tuple[np.ndarray, np.ndarray | None]:
        """Every value and weight (None: all 1), in the order added. Exact Samples only."""
        if self.sketch is not None:
            raise ValueError("the values were folded into a sketch")
        parts = list(self._parts)
        if self._buf:
            parts.append((np.frombuffer(self._buf, dtype=np.float64).copy(), None))
        if not parts:
            return np.zeros(0), None
        vals = np.concatenate([v for v, _ in parts]) if len(parts) > 1 else parts[0][0]
        if all(w is None for _, w in parts):
            return vals, None
        ws = np.concatenate([np.ones(len(v), np.int64) if w is None else w.astype(np.int64)
                             for v, w in parts])
        return vals, ws

    def values(self) -> np.ndarray:
        """Every value, unweighted, in the order added. Exact Samples only."""
        v, w = self.arrays()
        return v if w is None else np.repeat(v, w)


PCTS = (50, 90, 95, 99)


def weighted_quantiles(values: np.ndarray, weights: np.ndarray | None, qs) -> list[float]:
    """Inverted-CDF quantiles (q in 0..100) of `values` with integer `weights`."""
    values = np.asarray(values, dtype=np.float64)
    if weights is None:
        weights = np.ones(len(values), dtype=np.int64)
    keep = weights > 0
    values, weights = values[keep], weights[keep]
    if len(values) == 0:
        return [float("nan")] * len(qs)
    order = np.argsort(values, kind="stable")
    v, cw = values[order], np.cumsum(weights[order])
    total = cw[-1]
    out = []
    for q in qs:
        # smallest value whose cumulative weight reaches q% of the total
        need = q / 100.0 * total
        i = int(np.searchsorted(cw, need - 1e-9 * total, side="left"))
        out.append(float(v[min(i, len(v) - 1)]))
    return out


def distribution_ms(values, weights=None) -> dict:
    """{count, mean, p50, p90, p95, p99, max} in milliseconds (NaN-free: empty gives None)."""
    values = np.asarray(values, dtype=np.float64)
    w = None if weights is None else np.asarray(weights, dtype=np.int64)
    count = int(len(values) if w is None else w.sum())
    if count == 0:
        return {"count": 0, "mean": None, **{f"p{q}": None for q in PCTS}, "max": None}
    mean = float(values.mean() if w is None else (values * w).sum() / count)
    qs = weighted_quantiles(values, w, PCTS)
    vmax = float(values.max() if w is None else values[w > 0].max())
    return {"count": count, "mean": mean * 1e3,
            **{f"p{q}": x * 1e3 for q, x in zip(PCTS, qs)}, "max": vmax * 1e3}


def pooled_distribution_ms(sources: list) -> dict:
    """{count, mean, p50, p90, p95, p99, max} in milliseconds of several sources pooled in
    order, each a Samples or a (values, weights or None) pair of arrays: computed exactly as
    `distribution_ms` of their concatenation when every Samples is exact, else
    from merged sketches."""
    pairs = []
    for src in sources:
        if isinstance(src, Samples):
            if not src.exact:
                return _sketched(sources)
            pairs.append(src.arrays())
        else:
            v, w = src
            pairs.append((np.asarray(v, dtype=np.float64), w))
    vals = np.concatenate([v for v, _ in pairs]) if pairs else np.zeros(0)
    if all(w is None for _, w in pairs):
        return distribution_ms(vals)
    ws = np.concatenate([np.ones(len(v), np.int64) if w is None else np.asarray(w, np.int64)
                         for v, w in pairs])
    return distribution_ms(vals, ws)


def _sketched(sources: list) -> dict:
    pool = Samples(limit=0)
    pool.sketch = LogHistogram()
    for src in sources:
        if isinstance(src, Samples) and not src.exact:
            src._spill()
            assert src.sketch is not None  # (not exact)
            pool.sketch.merge(src.sketch)
            pool._count += src._count
            pool._sum += src._sum
            pool._min = min(pool._min, src._min)
            pool._max = max(pool._max, src._max)
        else:
            v, w = src.arrays() if isinstance(src, Samples) else src
            pool._fold_part(np.asarray(v, dtype=np.float64),
                            None if w is None else np.asarray(w, np.int64))
    if pool._count == 0:
        return {"count": 0, "mean": None, **{f"p{q}": None for q in PCTS}, "max": None}
    qs = pool.sketch.quantiles(PCTS, pool._min, pool._max)
    return {"count": pool._count, "mean": pool._sum / pool._count * 1e3,
            **{f"p{q}": x * 1e3 for q, x in zip(PCTS, qs)}, "max": pool._max * 1e3}
