"""Exports of a session log for analysis elsewhere: Chrome trace events (open in Perfetto), one CSV
row per request, or the events as JSON lines.

The Chrome trace has a process "requests" with one thread (track) per request: a `request` span
from arrival to completion holding nested `queued`, `prefill` and `decode` spans (after a
preemption, `queued` and `prefill` again, or `swapped` then `decode`; a disaggregated request's
`handoff wait` and `kv transfer` between its prefill and its decode); a process "engine" (for a
deployment of several, one per instance) with a track of engine steps (a run of identical decode
steps is one span); and counters for KV blocks in use, batch size and queue length. Times are
microseconds of simulated time.
"""

from __future__ import annotations

import csv
import io
import json

import numpy as np

from sim.session.log import SessionLog, decode

CSV_COLUMNS = [
    "req_id", "state", "priority", "injected", "prompt_tokens", "max_output_tokens",
    "output_tokens", "arrival_s", "admitted_s", "first_token_s", "last_token_s", "finish_s",
    "queue_ms", "ttft_ms", "tpot_ms", "e2e_ms", "preemptions", "cancelled_in", "reject_reason",
    "sent_s", "client_ttft_ms", "client_e2e_ms",
]


def _ms(x):
    return "" if x is None else round(x * 1e3, 6)


def _s(x):
    return "" if x is None else repr(float(x))


def request_rows(engine) -> list[dict]:
    """One dict per request the engine has seen, with every timestamp and metric."""
    rows = []
    for r in sorted(engine.requests.values(), key=lambda r: r.req_id):
        rows.append({
            "req_id": r.req_id, "state": r.state.value, "priority": r.priority,
            "injected": int(r.injected), "prompt_tokens": r.prompt_len,
            "max_output_tokens": r.max_output_tokens, "output_tokens": r.num_output_tokens,
            "arrival_s": _s(r.arrival_time), "admitted_s": _s(r.admitted_time),
            "first_token_s": _s(r.first_token_time), "last_token_s": _s(r.last_token_time),
            "finish_s": _s(r.finish_time), "queue_ms": _ms(r.queue_wait), "ttft_ms": _ms(r.ttft),
            "tpot_ms": _ms(r.tpot),
            "e2e_ms": _ms(r.e2e) if r.state.value == "finished" else "",
            "preemptions": r.num_preemptions,
            "cancelled_in": r.cancelled_in.value if r.cancelled_in else "",
            "reject_reason": r.reject_reason or "",
            # the client's side of the API server (the engine's times without a front end)
            "sent_s": _s(r.sent_time), "client_ttft_ms": _ms(r.client_ttft),
            "client_e2e_ms": _ms(r.client_e2e) if r.state.value == "finished" else "",
        })
    return rows


def to_csv(engine) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows(request_rows(engine))
    return buf.getvalue()


def to_jsonl(log: SessionLog) -> str:
    lines = [json.dumps({"kind": "header", **{k: v for k, v in log.header.items()
                                               if k != "workload"}}, default=str)]
    for rec in log.records:
        lines.append(json.dumps(decode(rec).to_dict()))
    lines.append(json.dumps({"kind": "footer", **log.footer}))
    return "\n".join(lines) + "\n"


def _us(t: float) -> float:
    return round(t * 1e6, 3)


def _streams(log: SessionLog, engine) -> list[tuple[int, list]]:
    """(engine process id, events) of each stream of the log: one for a single engine; for a
    deployment, each instance's (process 2 + its index), then the deployment's own (hand-offs
    cancelled on their way close there, after the instances' events opened them)."""
    parts = getattr(engine, "instances", None)
    if parts is None:
        return [(2, log.events)]
    streams: dict[int, list] = {}
    current: list = []
    for e in log.events:
        if e.kind == "stream":
            current = streams.setdefault(e.instance, [])
        else:
            current.append(e)
    return [(2 + i, streams.get(i, [])) for i in range(len(parts))] + [(2, streams.get(-1, []))]


class _Phases(dict):
    """req_id -> (phase, since): an unknown request is `queued` since time 0."""

    def __missing__(self, req_id):
        return ("queued", 0.0)


def to_chrome(log: SessionLog, engine) -> str:
    """Chrome trace-event JSON for the session (engine: the replayed session, an Engine or a
    deployment of several, whose instances get an engine process each)."""
    parts = getattr(engine, "instances", None)
    names = (["engine"] if parts is None else
             [f"instance {i} ({role})" for i, role in enumerate(engine.roles)])
    out = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "requests"}}]
    for i, name in enumerate(names):
        out += [{"ph": "M", "pid": 2 + i, "name": "process_name", "args": {"name": name}},
                {"ph": "M", "pid": 2 + i, "tid": 0, "name": "thread_name",
                 "args": {"name": "steps"}}]

    def span(pid, tid, name, t0, t1, args=None):
        e = {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": _us(t0),
             "dur": max(0.0, round(_us(t1) - _us(t0), 3))}
        if args:
            e["args"] = args
        out.append(e)

    # Per-request phases from the event stream: where each request is at each transition.
    # (A transition of a request the stream never introduced, which only a hand-made log
    # holds, opens its phase where it is.)
    phase_start: dict[int, tuple[str, float]] = _Phases()
    events = [(pid, e) for pid, stream in _streams(log, engine) for e in stream]
    for pid, e in events:
        k = e.kind
        if k == "arrival":
            out.append({"ph": "M", "pid": 1, "tid": e.req_id, "name": "thread_name",
                        "args": {"name": f"request {e.req_id}"}})
            phase_start[e.req_id] = ("queued", e.t)
        elif k == "admit":
            name, t0 = phase_start[e.req_id]
            span(1, e.req_id, name, t0, e.t)
            # back from host memory it decodes at once; otherwise it (re-)prefills
            phase_start[e.req_id] = ("decode" if name == "swapped" else "prefill", e.t)
        elif k in ("first_token", "recomputed"):
            name, t0 = phase_start[e.req_id]
            span(1, e.req_id, name, t0, e.t)
            phase_start[e.req_id] = ("decode", e.t)
        elif k == "preempt":
            name, t0 = phase_start[e.req_id]
            span(1, e.req_id, name, t0, e.t)
            phase_start[e.req_id] = ("swapped" if e.mode == "swap" else "queued", e.t)
        elif k == "handoff" and e.phase in ("ready", "start", "joined"):
            name, t0 = phase_start[e.req_id]
            span(1, e.req_id, name, t0, e.t)
            phase_start[e.req_id] = ({"ready": "handoff wait", "start": "kv transfer",
                                      "joined": "decode"}[e.phase], e.t)
        elif k in ("finish", "cancel", "reject"):
            if e.req_id in phase_start:
                name, t0 = phase_start.pop(e.req_id)
                span(1, e.req_id, name, t0, e.t)
        elif k == "steps":
            ends = e.ends
            t0 = e.t
            if len(ends) == 1:
                label = f"step {e.step}"
            else:
                label = f"steps {e.step}..{e.step + len(ends) - 1} (decode x{len(ends)})"
            span(pid, 0, label, t0, float(ends[-1]),
                 {"prefill_tokens": int(sum(c[2] for c in e.prefill)),
                  "decodes": len(e.decode), "steps": len(ends)})
            batch = len(e.prefill) + len(e.decode)
            out.append({"ph": "C", "pid": pid, "name": "kv_used_blocks",
                        "ts": _us(float(ends[-1])), "args": {"blocks": e.kv_used}})
            out.append({"ph": "C", "pid": pid, "name": "batch_size", "ts": _us(t0),
                        "args": {"sequences": batch}})
    for rid, (name, t0) in phase_start.items():  # requests still live when exported
        span(1, rid, name, t0, max(t0, log.footer["now"]))
    # Queue length over time, from the replayed timelines (one point per run of steps).
    for pid, part in enumerate(parts or [engine], start=2):
        tl = part.timeline
        if not tl.n:
            continue
        ends = tl.column("end")
        waiting = tl.column("waiting")
        change = np.flatnonzero(np.diff(waiting, prepend=-1))
        for i in change.tolist():
            out.append({"ph": "C", "pid": pid, "name": "queue_length",
                        "ts": _us(float(ends[i])), "args": {"waiting": int(waiting[i])}})
    # A parent span per request around its phases, so the phases nest.
    for r in engine.requests.values():
        end = r.finish_time if r.finish_time is not None else max(log.footer["now"],
                                                                    r.arrival_time)
        span(1, r.req_id, "request", r.arrival_time, end,
             {"prompt_tokens": r.prompt_len, "output_tokens": r.num_output_tokens,
              "state": r.state.value})
    return json.dumps({"traceEvents": out, "displayTimeUnit": "ms",
                       "otherData": {"scenario": log.header["scenario"]["name"],
                                     "policy": log.header["policy"]}})
