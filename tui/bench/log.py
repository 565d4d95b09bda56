"""`servesim bench log`: the session log's size per output token, and the time to write it and
to replay-verify it against the original run."""

from __future__ import annotations

import math
import tempfile
import time

from sim import Engine, load_scenario, summarize
from sim.inputs.workload import build_workload
from sim.session.log import read_log, write_log
from sim.session.replay import verify
from tui.bench.common import machine


def run(args) -> dict:
    sc = load_scenario(args.scenario)
    t_run = t_write = t_verify = math.inf
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/session.msgpack"
        for _ in range(max(1, args.repeat)):  # best of N for each phase, side by side
            t0 = time.perf_counter()
            engine = Engine(sc, workload=build_workload(sc))
            engine.run()
            summary = summarize(engine)
            t_run = min(t_run, time.perf_counter() - t0)
            t0 = time.perf_counter()
            write_log(path, engine, summary)
            t_write = min(t_write, time.perf_counter() - t0)
            del engine
            t0 = time.perf_counter()
            log = read_log(path, check_events=False)  # as `replay --verify` reads it
            _, div = verify(log)
            t_verify = min(t_verify, time.perf_counter() - t0)
    tokens = summary["output_tokens"]
    return {
        "scenario": sc.name, "machine": machine(), "events": len(log.records),
        "output_tokens": tokens, "log_bytes": log.size_bytes,
        "bytes_per_output_token": log.size_bytes / tokens,
        "run_s": t_run, "write_s": t_write, "original_s": t_run + t_write,
        "replay_verify_s": t_verify, "verify_over_original": t_verify / (t_run + t_write),
        "verified": div is None,
    }


def text(r: dict) -> str:
    return "\n".join([
        f"bench log: {r['scenario']} on {r['machine']}",
        f"  events               {r['events']:,}",
        f"  log size             {r['log_bytes']:,} bytes "
        f"({r['bytes_per_output_token']:.2f} per output token)",
        f"  original run         {r['original_s']:.2f} s (simulate {r['run_s']:.2f} s "
        f"+ write {r['write_s']:.2f} s)",
        f"  replay --verify      {r['replay_verify_s']:.2f} s "
        f"({r['verify_over_original']:.2f} x the original), "
        f"{'identical' if r['verified'] else 'DIVERGED'}",
    ])
