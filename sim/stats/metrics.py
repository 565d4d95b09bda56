"""Metrics: per-request latencies, pooled ITL, throughput, goodput, KV use and energy, for a whole
run (`summarize`) and over a rolling window of simulated time (`rolling`, for a live screen).

Definitions (times in seconds inside, milliseconds in the output):
- queue wait = admission - arrival; TTFT = first token - arrival (it includes the queue);
- ITL = the gaps between consecutive output tokens of a request, all requests pooled;
- TPOT = (last token - first token) / (n - 1), over finished requests with n >= 2;
- E2E = completion - arrival, over finished requests.
Behind an API server (sim.engine.frontend) TTFT, ITL, TPOT and E2E are the client's: from when
it sent the request to when it received the first token or the end, and between the times it
received its tokens; `engine_side` holds the engine's, from the request's arrival at the engine
to the tokens' sampling.
Percentiles are of the observed values (inverted CDF: p99 is the smallest value with at least
99% of the values at or below it), weighted where ITL gaps are pooled by count.
"""

from __future__ import annotations

import numpy as np

from sim.stats.quantiles import EXACT_LIMIT, pooled_distribution_ms, weighted_quantiles

def summarize(engine) -> dict:
    """The run's summary, shaped as `servesim sim --json` documents it. For a deployment of
    several instances (`sim.deploy.cluster.Cluster`) the figures pool every instance's, and
    `replicas` holds each instance's own summary."""
    parts = getattr(engine, "instances", None)
    if parts is None:
        out = _summary(engine, [engine])
        if getattr(engine, "clients", None) is not None:  # a client mix
            out["clients"] = _clients(engine)
        return out
    out = _summary(engine, parts)
    out["policy"] = engine.policy_label
    out["deployment"] = {
        "mode": engine.mode, "instances": len(parts),
        "gpus": engine.gpus,
        "router": engine.router.name if engine.router is not None else None,
        **engine.deployment_figures()}
    # (wall time is the deployment's: its instances run interleaved)
    out["replicas"] = [{"instance": i, "role": role, "routed": n, **summarize(e), "wall_s": None}
                       for i, (e, role, n) in enumerate(zip(parts, engine.roles, engine.routed))]
    if engine.disaggregated:
        wait = pooled_distribution_ms([engine.transfer_wait])
        out["transfers"] = {"count": wait["count"], "cancelled": engine.cancelled_in_transfer,
                            "wait_ms": wait,
                            "transfer_ms": pooled_distribution_ms([engine.transfer_time])}
    return out


def received(whole, parts: list) -> float:
    """How long the run lasted for its clients: the engine's clock, or behind an API server
    (sim.engine.frontend) until it handed out the last token, if that is later."""
    fronts = [e.frontend for e in parts if e.frontend is not None]
    return max([whole.now, *(f.out_free for f in fronts)])


def _clients(engine) -> dict:
    """Each client's figures of a client mix (sim.engine.clients), keyed by its name."""
    f, duration = engine.clients, received(engine, [engine])
    out = {}
    for name, c in f.counts.items():
        out[name] = {
            "requests": {k: c[k] for k in ("finished", "cancelled", "rejected")},
            "ttft_ms": pooled_distribution_ms([f.ttft[name]]),
            "e2e_ms": pooled_distribution_ms([f.e2e[name]]),
            "goodput_requests_per_s": c["slo_met"] / duration if duration > 0 else 0.0,
            "slo_attainment": c["slo_met"] / c["finished"] if c["finished"] else None,
        }
    return out


def _summary(whole, parts: list) -> dict:
    """The summary of `whole` (an engine, or a deployment) pooling its `parts` (engines)."""
    sc = whole.scenario
    duration = whole.now
    c = whole.counts
    finished = c["finished"]
    finished_prompt = sum(e.finished_prompt_tokens for e in parts)
    slo_met = sum(e.slo_met for e in parts)
    tot = [e.timeline.totals() for e in parts]
    rows = sum(t.rows for t in tot)
    used_dur = sum(t.used_dur for t in tot)
    energy = sum(t.energy + e.cost.idle_energy(e.idle_time) for t, e in zip(tot, parts))
    out_tokens = c["output_tokens"]
    fe = parts[0].frontend is not None  # (TTFT, ITL, TPOT and E2E are the client's)
    # (pooled by engine, in step order: the sketch depends on it)
    engine_itl = pooled_distribution_ms(
        [x for e in parts for x in (e.timeline.itl, e.timeline.tail_itl(), e.itl_extra)])
    itl = pooled_distribution_ms(
        [x for e in parts for x in (e.timeline.client_itl, e.timeline.tail_itl(client=True),
                                    e.client_itl_extra)]) if fe else engine_itl
    # (behind an API server the run lasts, for its clients, until its last token reached
    # them: throughput and goodput are theirs)
    served = received(whole, parts)
    per_s = (lambda x: x / served) if served > 0 else (lambda x: 0.0)
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
        **({"client_duration_s": served} if fe else {}),
        "wall_s": whole.wall_s,
        "steps": whole.step_count,
        "throughput": {
            "requests_per_s": per_s(finished),
            "output_tokens_per_s": per_s(out_tokens),
            "total_tokens_per_s": per_s(
                finished_prompt + float(sum(e.finished_output_tokens for e in parts))),
        },
        "ttft_ms": pooled_distribution_ms([e.client_ttft if fe else e.ttft for e in parts]),
        "itl_ms": itl,
        "tpot_ms": pooled_distribution_ms([e.client_tpot if fe else e.tpot for e in parts]),
        "e2e_ms": pooled_distribution_ms([e.client_e2e if fe else e.e2e for e in parts]),
        "queue_ms": pooled_distribution_ms([e.queue_wait for e in parts]),
        **({"engine_side": {"ttft_ms": pooled_distribution_ms([e.ttft for e in parts]),
                            "itl_ms": engine_itl,
                            "tpot_ms": pooled_distribution_ms([e.tpot for e in parts]),
                            "e2e_ms": pooled_distribution_ms([e.e2e for e in parts])}}
           if fe else {}),
        "kv": {
            "total_blocks": nb,
            "block_size": whole.block_size,
            "peak_used_blocks": (tot[0].used_max if len(parts) == 1
                                 else whole.kv_peak.value()),
            "mean_usage": float(used_dur / nb / duration) if duration > 0 else 0.0,
            "used_blocks_at_end": sum(e.kv.num_used_blocks for e in parts),
            # tokens held / slots reserved, averaged over time (PagedAttention paper, sec. 2.3)
            "token_state_share": (
                1.0 - float(sum(t.empty_dur for t in tot)) / float(used_dur * whole.block_size)
                if float(used_dur) > 0 else None),
            # requests refused admission at least once for want of a long enough run of free
            # blocks although enough were free in total (contiguous: external fragmentation)
            "fragmentation_stalls": c["fragmentation_stalls"],
        },
        "batch": {"mean": sum(t.batch_sum for t in tot) / rows if rows else 0.0,
                  "max": max(t.batch_max for t in tot) if rows else 0},
        "preemptions": c["preemptions"],
        "swaps": c["swaps"],
        "prefix_cache": {
            "enabled": parts[0].prefix_caching,
            "hit_tokens": hit,
            "query_tokens": query,
            "hit_rate": hit / query if query else 0.0,
        },
        "output_tokens": out_tokens,
        "goodput_requests_per_s": per_s(slo_met),
        "slo_attainment": slo_met / finished if finished else None,
        "energy_j": energy,
        "energy_j_per_output_token": energy / out_tokens if out_tokens else None,
    }


# Requests still in flight on the instance that holds them, by state. (A request handed off
# stays `transferring` on its prefill instance, whose clock may run past the request's end on
# its decode instance: its time there bounds nothing. The rest have ended.)
_LIVE = frozenset(("waiting", "running", "preempted", "swapped"))


def floors(engine) -> dict[str, float] | None:
    """Lower bounds (ms) of the TTFT, TPOT and E2E percentiles (`ttft_p99_ms`, ...) that
    `summarize` will report once the run ends, however it goes on from here; None where no
    bound holds while it runs.

    Each figure's final values are bounded below, request by request: the values already taken;
    for a request still in flight, the time it has already spent (its first token, or its last,
    comes no earlier than its instance's clock: TTFT >= now - arrival, E2E >= now - arrival,
    TPOT >= (now - first token) / (n - 1) for n output tokens); zero for one still to arrive.
    Percentiles (inverted CDF) only grow with any value, and only grow when a zero leaves the
    population (a request rejected on arrival), so those of this vector bound the final ones.
    That needs a population that can only lose requests still to arrive: none is refused when
    a request in flight may be cancelled (cancellation, parallel samples), or when the figures
    would end folded into a sketch (more requests than `EXACT_LIMIT`)."""
    parts = getattr(engine, "instances", None) or [engine]
    w = engine.workload
    n = len(w) - engine.counts["rejected"]
    if (len(w) > EXACT_LIMIT or engine.scenario.workload.num_samples > 1
            or bool(np.isfinite(w.cancel_at).any())):
        return None
    fe = parts[0].frontend is not None
    first: dict[int, float] = {}  # request -> time spent so far (s), per figure
    last: dict[int, float] = {}
    gap: dict[int, float] = {}
    for e in parts:
        now = e.now
        for r in e.requests.values():
            if r.state.value not in _LIVE or r.parent_id is not None:
                continue
            rid = r.req_id
            spent = now - r.arrival_time
            last[rid] = max(last.get(rid, 0.0), spent)
            if r.num_output_tokens == 0:
                first[rid] = max(first.get(rid, 0.0), spent)
            elif r.max_output_tokens >= 2 and r.first_token_time is not None:
                # (behind a front end, from when the first token reached the client: its last
                # reaches it no earlier than the engine samples it)
                since = r.client_first_time if fe and r.client_first_time is not None \
                    else r.first_token_time
                g = (now - since) / (r.max_output_tokens - 1)
                gap[rid] = max(gap.get(rid, 0.0), g)
    out = {}
    for m, taken, pending in (
            ("ttft", [e.client_ttft if fe else e.ttft for e in parts], first),
            ("tpot", [e.client_tpot if fe else e.tpot for e in parts], gap),
            ("e2e", [e.client_e2e if fe else e.e2e for e in parts], last)):
        if not all(s.exact for s in taken):
            return None
        known = 0
        for s in taken:
            v, wt = s.arrays()
            known += len(v) if wt is None else int(wt.sum())
        rest = n - known - len(pending)
        if rest < 0:  # (more values than requests: not a population this bound holds for)
            return None
        d = pooled_distribution_ms([*taken, (np.fromiter(pending.values(), np.float64), None),
                                    (np.zeros(rest), None)])
        for p in ("p50", "p90", "p99"):
            out[f"{m}_{p}_ms"] = d[p] if d[p] is not None else 0.0
    return out


class KVPeak:
    """The most KV blocks in use at once over several engines (a deployment's instances), each
    holding its count from one step's end to the next: their timelines' rows merged in time
    order (ties: instance order, then row order), consumed as they become final so that the
    rows can be dropped."""

    def __init__(self, timelines: list) -> None:
        self.timelines = timelines
        self.cursor = [0] * len(timelines)  # first row of each not yet merged
        self.last = [0] * len(timelines)    # kv_used of the last merged row of each
        self.total = 0                       # blocks in use after the merged rows
        self.peak = 0

    def _merge(self, his: list[int]) -> tuple[int, int, list[int]]:
        """(total, peak) after the rows before `his`, and the last kv_used of each."""
        times, deltas, last = [], [], list(self.last)
        for i, (tl, lo, hi) in enumerate(zip(self.timelines, self.cursor, his)):
            if hi > lo:
                used = tl.rows("kv_used", lo, hi).astype(np.int64)
                times.append(tl.rows("end", lo, hi))
                deltas.append(np.diff(used, prepend=last[i]))
                last[i] = int(used[-1])
        if not times:
            return self.total, self.peak, last
        order = np.argsort(np.concatenate(times), kind="stable")
        run = self.total + np.cumsum(np.concatenate(deltas)[order])
        return int(run[-1]), max(self.peak, int(run.max())), last

    def advance(self, t: float) -> None:
        """Merge every row ending at or before `t` (no row ending then may still be added)."""
        his = [tl.index(t, "right") for tl in self.timelines]
        self.total, self.peak, self.last = self._merge(his)
        self.cursor = his
        for tl, hi in zip(self.timelines, his):
            tl.release_kv(hi)

    def value(self) -> int:
        """The peak over every row recorded so far."""
        return self._merge([tl.n for tl in self.timelines])[1]


def rolling(engine, window_s: float) -> dict:
    """Live figures over the last `window_s` simulated seconds (for charts), pooled over the
    instances of a deployment. Needs window_s <= Engine.ROLLING_S, and the timeline rows of the
    window (an engine that keeps its history: the dashboard's)."""
    now = engine.now
    t0 = now - window_s
    parts = getattr(engine, "instances", None) or [engine]
    ttft, itl_v, itl_w, sampled, batch = [], [], [], 0, []
    for e in parts:
        if window_s > e.ROLLING_S:
            raise ValueError(f"rolling: window {window_s} s is longer than {e.ROLLING_S} s")
        ttft += [v for t, v in e.recent_ttfts if t >= t0]
        tl = e.timeline
        lo = tl.index(t0, "left")
        hi = tl.index(now, "right")
        glo = max(lo, 1)  # a gap needs the step before it
        ends = tl.rows("end", glo - 1, hi)
        gaps, counts = ends[1:] - ends[:-1], tl.rows("itl_count", glo, hi)
        extra = [g for t, g in e.recent_gaps if t0 <= t <= now]
        itl_v += [gaps, np.asarray(extra, dtype=np.float64)]
        itl_w += [counts, np.ones(len(extra), dtype=np.int64)]
        sampled += int(tl.rows("sampled", lo, hi).sum())
        batch.append(tl.rows("batch", lo, hi))
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
