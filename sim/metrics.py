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

from sim.request import RequestState

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
    """The run's summary, shaped as `servesim sim --json` documents it. For a deployment of
    several instances (`sim.cluster.Cluster`) the figures pool every instance's, and
    `replicas` holds each instance's own summary."""
    parts = getattr(engine, "instances", None)
    if parts is None:
        return _summary(engine, [engine])
    out = _summary(engine, parts)
    out["policy"] = engine.policy_label
    out["deployment"] = {
        "mode": engine.mode, "instances": len(parts),
        "gpus": len(parts) * engine.scenario.model.tensor_parallel,
        "router": engine.router.name if engine.router is not None else None}
    # (wall time is the deployment's: its instances run interleaved)
    out["replicas"] = [{"instance": i, "role": role, "routed": n, **summarize(e), "wall_s": None}
                       for i, (e, role, n) in enumerate(zip(parts, engine.roles, engine.routed))]
    if engine.disaggregated:
        t = np.asarray(engine.transfers, dtype=np.float64).reshape(-1, 3)
        out["transfers"] = {"count": len(t), "cancelled": engine.cancelled_in_transfer,
                            "wait_ms": distribution_ms(t[:, 1] - t[:, 0]),
                            "transfer_ms": distribution_ms(t[:, 2] - t[:, 1])}
    return out


def _summary(whole, parts: list) -> dict:
    """The summary of `whole` (an engine, or a deployment) pooling its `parts` (engines)."""
    sc = whole.scenario
    duration = whole.now
    c = whole.counts
    done = np.asarray([x for e in parts for x in e.done_stats],
                      dtype=np.float64).reshape(-1, 5)
    ttft_f, e2e, tpot, nout = done[:, 1], done[:, 2], done[:, 3], done[:, 4]
    finished = c["finished"]
    finished_prompt = sum(r.prompt_len for r in whole.requests.values()
                          if r.state is RequestState.FINISHED)
    slo = sc.slo
    ok = np.ones(len(done), dtype=bool)
    if slo.ttft_ms:
        ok &= ttft_f * 1e3 <= slo.ttft_ms
    if slo.tpot_ms:
        ok &= (tpot < 0) | (tpot * 1e3 <= slo.tpot_ms)
    if slo.e2e_ms:
        ok &= e2e * 1e3 <= slo.e2e_ms

    def col(name):
        return np.concatenate([e.timeline.column(name) for e in parts])

    dur = col("dur")
    used = col("kv_used")
    batch = col("batch")
    energy = sum(float(e.timeline.column("energy").sum()) + e.cost.idle_energy(e.idle_time)
                 for e in parts)
    out_tokens = c["output_tokens"]
    itls = [pooled_itl(e) for e in parts]
    itl_v = np.concatenate([v for v, _ in itls])
    itl_w = np.concatenate([w for _, w in itls])
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    nb = sum(e.kv.num_blocks for e in parts)
    hit = sum(e.kv.hit_tokens for e in parts)
    query = sum(e.kv.query_tokens for e in parts)
    return {
        "scenario": sc.name,
        "policy": whole.policy.name,
        "seed": sc.seed,
        "requests": {"total": c["arrived"], "finished": finished, "cancelled": c["cancelled"],
                     "rejected": c["rejected"]},
        "duration_s": duration,
        "wall_s": whole.wall_s,
        "steps": whole.step_count,
        "throughput": {
            "requests_per_s": per_s(finished),
            "output_tokens_per_s": per_s(out_tokens),
            "total_tokens_per_s": per_s(finished_prompt + float(nout.sum())),
        },
        "ttft_ms": distribution_ms([x for e in parts for x in e.ttfts]),
        "itl_ms": distribution_ms(itl_v, itl_w),
        "tpot_ms": distribution_ms(tpot[tpot >= 0]),
        "e2e_ms": distribution_ms(e2e),
        "queue_ms": distribution_ms([x for e in parts for x in e.queue_waits]),
        "kv": {
            "total_blocks": nb,
            "block_size": whole.block_size,
            "peak_used_blocks": _peak_used(parts),
            "mean_usage": float((used * dur).sum() / nb / duration) if duration > 0 else 0.0,
            "used_blocks_at_end": sum(e.kv.num_used_blocks for e in parts),
            # tokens held / slots reserved, averaged over time (PagedAttention paper, sec. 2.3)
            "token_state_share": (
                1.0 - float((col("kv_empty") * dur).sum())
                / float((used * dur).sum() * whole.block_size)
                if float((used * dur).sum()) > 0 else None),
            # requests refused admission at least once for want of a long enough run of free
            # blocks although enough were free in total (contiguous: external fragmentation)
            "fragmentation_stalls": c["fragmentation_stalls"],
        },
        "batch": {"mean": float(batch.mean()) if len(batch) else 0.0,
                  "max": int(batch.max()) if len(batch) else 0},
        "preemptions": c["preemptions"],
        "swaps": c["swaps"],
        "prefix_cache": {
            "enabled": parts[0].prefix_caching,
            "hit_tokens": hit,
            "query_tokens": query,
            "hit_rate": hit / query if query else 0.0,
        },
        "output_tokens": out_tokens,
        "goodput_requests_per_s": per_s(int(ok.sum())),
        "slo_attainment": float(ok.mean()) if len(ok) else None,
        "energy_j": energy,
        "energy_j_per_output_token": energy / out_tokens if out_tokens else None,
    }


def _peak_used(parts) -> int:
    """The most blocks in use at once over all `parts`, each holding its count from one step's
    end to the next."""
    if len(parts) == 1:
        used = parts[0].timeline.column("kv_used")
        return int(used.max()) if len(used) else 0
    times, deltas = [], []
    for e in parts:
        used = e.timeline.column("kv_used").astype(np.int64)
        times.append(e.timeline.column("end"))
        deltas.append(np.diff(used, prepend=0))
    order = np.argsort(np.concatenate(times), kind="stable")
    total = np.cumsum(np.concatenate(deltas)[order])
    return int(total.max()) if len(total) else 0


def rolling(engine, window_s: float) -> dict:
    """Live figures over the last `window_s` simulated seconds (for charts), pooled over the
    instances of a deployment."""
    now = engine.now
    t0 = now - window_s
    parts = getattr(engine, "instances", None) or [engine]
    ttft, itl_v, itl_w, sampled, batch = [], [], [], 0, []
    for e in parts:
        i = bisect.bisect_left(e.ttft_times, t0)
        ttft += e.ttfts[i:]
        v, w = pooled_itl(e, t0, now)
        itl_v.append(v)
        itl_w.append(w)
        tl = e.timeline
        ends = tl.column("end")
        lo = int(np.searchsorted(ends, t0, side="left"))
        hi = int(np.searchsorted(ends, now, side="right"))
        sampled += int(tl.column("sampled")[lo:hi].sum())
        batch.append(tl.column("batch")[lo:hi])
    ttft = np.asarray(ttft, dtype=np.float64)
    itl_v, itl_w = np.concatenate(itl_v), np.concatenate(itl_w)
    batch = np.concatenate(batch)
    t_p = weighted_quantiles(ttft, None, (50, 99)) if len(ttft) else [None, None]
    i_p = weighted_quantiles(itl_v, itl_w, (50, 99)) if itl_w.sum() else [None, None]
    ms = lambda x: None if x is None else x * 1e3  # noqa: E731
    return {
        "t": now,
        "ttft_p50_ms": ms(t_p[0]), "ttft_p99_ms": ms(t_p[1]),
        "itl_p50_ms": ms(i_p[0]), "itl_p99_ms": ms(i_p[1]),
        "output_tokens_per_s": sampled / window_s if window_s > 0 else 0.0,
        "batch_mean": float(batch.mean()) if len(batch) else 0.0,
        "kv_usage": (sum(e.kv.num_used_blocks for e in parts)
                     / sum(e.kv.num_blocks for e in parts)),
        "waiting": sum(len(e.policy.waiting) for e in parts),
        "running": sum(len(e.policy.running) for e in parts),
    }
