"""Metrics: per-request latencies, pooled ITL, throughput, goodput, KV use and energy, for a whole
run (`summarize`) and over a rolling window of simulated time (`rolling`, for a live screen).

Definitions (times in seconds inside, milliseconds in the output):
- queue wait = admission - arrival; TTFT = first token - arrival (it includes the queue);
- ITL = the gaps between consecutive output tokens of a request, all requests pooled;
- TPOT = (last token - first token) / (n - 1), over finished requests with n >= 2;
- E2E = completion - arrival, over finished requests.
Percentiles are of the observed values (inverted CDF: p99 is the smallest value with at least
99% of the values at or below it), weighted where ITL gaps are pooled by count.
"""

from __future__ import annotations

import bisect

import numpy as np

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


def pooled_itl(engine, t_from: float = -np.inf, t_to: float = np.inf):
    """All ITL gaps with their token times in [t_from, t_to]: (values, weights)."""
    tl = engine.timeline
    ends = tl.column("end")
    lo = int(np.searchsorted(ends, t_from, side="left"))
    hi = int(np.searchsorted(ends, t_to, side="right"))
    lo = max(lo, 1)  # a gap needs the step before it
    if hi > lo:
        gaps = ends[lo:hi] - ends[lo - 1:hi - 1]
        counts = tl.column("itl_count")[lo:hi]
    else:
        gaps = np.zeros(0)
        counts = np.zeros(0, dtype=np.int64)
    extra = engine.itl_extra
    if extra:
        if t_from == -np.inf and t_to == np.inf:
            sel = extra
        else:
            times = [t for t, _ in extra]
            sel = extra[bisect.bisect_left(times, t_from):bisect.bisect_right(times, t_to)]
        if sel:
            gaps = np.concatenate((gaps, np.fromiter((g for _, g in sel), float, len(sel))))
            counts = np.concatenate((counts, np.ones(len(sel), dtype=np.int64)))
    return gaps, counts


def summarize(engine) -> dict:
    """The run's summary, shaped as `servesim sim --json` documents it."""
    sc = engine.scenario
    tl = engine.timeline
    duration = engine.now
    c = engine.counts
    done = np.asarray(engine.done_stats, dtype=np.float64).reshape(-1, 5)
    ttft_f, e2e, tpot, nout = done[:, 1], done[:, 2], done[:, 3], done[:, 4]
    finished = c["finished"]
    finished_prompt = sum(engine.requests[i].prompt_len for i in _finished_ids(engine))
    slo = sc.slo
    ok = np.ones(len(done), dtype=bool)
    if slo.ttft_ms:
        ok &= ttft_f * 1e3 <= slo.ttft_ms
    if slo.tpot_ms:
        ok &= (tpot < 0) | (tpot * 1e3 <= slo.tpot_ms)
    if slo.e2e_ms:
        ok &= e2e * 1e3 <= slo.e2e_ms
    dur = tl.column("dur")
    used = tl.column("kv_used")
    energy = float(tl.column("energy").sum()) + engine.cost.idle_energy(engine.idle_time)
    out_tokens = c["output_tokens"]
    itl_v, itl_w = pooled_itl(engine)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    nb = engine.kv.num_blocks
    return {
        "scenario": sc.name,
        "policy": engine.policy.name,
        "seed": sc.seed,
        "requests": {"total": c["arrived"], "finished": finished, "cancelled": c["cancelled"],
                     "rejected": c["rejected"]},
        "duration_s": duration,
        "wall_s": engine.wall_s,
        "steps": engine.step_count,
        "throughput": {
            "requests_per_s": per_s(finished),
            "output_tokens_per_s": per_s(out_tokens),
            "total_tokens_per_s": per_s(finished_prompt + float(nout.sum())),
        },
        "ttft_ms": distribution_ms(engine.ttfts),
        "itl_ms": distribution_ms(itl_v, itl_w),
        "tpot_ms": distribution_ms(tpot[tpot >= 0]),
        "e2e_ms": distribution_ms(e2e),
        "queue_ms": distribution_ms(engine.queue_waits),
        "kv": {
            "total_blocks": nb,
            "block_size": engine.block_size,
            "peak_used_blocks": int(used.max()) if len(used) else 0,
            "mean_usage": float((used * dur).sum() / nb / duration) if duration > 0 else 0.0,
            "used_blocks_at_end": engine.kv.num_used_blocks,
            # tokens held / slots reserved, averaged over time (PagedAttention paper, sec. 2.3)
            "token_state_share": (
                1.0 - float((tl.column("kv_empty") * dur).sum())
                / float((used * dur).sum() * engine.block_size)
                if float((used * dur).sum()) > 0 else None),
        },
        "batch": {"mean": float(tl.column("batch").mean()) if tl.n else 0.0,
                  "max": int(tl.column("batch").max()) if tl.n else 0},
        "preemptions": c["preemptions"],
        "swaps": c["swaps"],
        "prefix_cache": {
            "enabled": engine.prefix_caching,
            "hit_tokens": engine.kv.hit_tokens,
            "query_tokens": engine.kv.query_tokens,
            "hit_rate": (engine.kv.hit_tokens / engine.kv.query_tokens
                         if engine.kv.query_tokens else 0.0),
        },
        "output_tokens": out_tokens,
        "goodput_requests_per_s": per_s(int(ok.sum())),
        "slo_attainment": float(ok.mean()) if len(ok) else None,
        "energy_j": energy,
        "energy_j_per_output_token": energy / out_tokens if out_tokens else None,
    }


def _finished_ids(engine):
    return (r.req_id for r in engine.requests.values() if r.state.value == "finished")


def rolling(engine, window_s: float) -> dict:
    """Live figures over the last `window_s` simulated seconds (for charts)."""
    now = engine.now
    t0 = now - window_s
    times = engine.ttft_times
    i = bisect.bisect_left(times, t0)
    ttft = np.asarray(engine.ttfts[i:]) if i < len(times) else np.zeros(0)
    itl_v, itl_w = pooled_itl(engine, t0, now)
    tl = engine.timeline
    ends = tl.column("end")
    lo = int(np.searchsorted(ends, t0, side="left"))
    sampled = int(tl.column("sampled")[lo:].sum())
    batch = tl.column("batch")[lo:]
    t_p = weighted_quantiles(ttft, None, (50, 99)) if len(ttft) else [None, None]
    i_p = weighted_quantiles(itl_v, itl_w, (50, 99)) if itl_w.sum() else [None, None]
    ms = lambda x: None if x is None else x * 1e3  # noqa: E731
    return {
        "t": now,
        "ttft_p50_ms": ms(t_p[0]), "ttft_p99_ms": ms(t_p[1]),
        "itl_p50_ms": ms(i_p[0]), "itl_p99_ms": ms(i_p[1]),
        "output_tokens_per_s": sampled / window_s if window_s > 0 else 0.0,
        "batch_mean": float(batch.mean()) if len(batch) else 0.0,
        "kv_usage": engine.kv.num_used_blocks / engine.kv.num_blocks,
        "waiting": len(engine.policy.waiting),
        "running": len(engine.policy.running),
    }
