"""Replay a golden trace's request stream through servesim and compare it with vLLM, step by step.

`replay(doc)` runs the trace's stream through servesim's engine and policy with the trace's
settings mapped onto a scenario, on the clock `generate.py` describes (every step takes 1.0), and
returns servesim's steps in the trace's form. `first_divergence` names the first step where the
two differ. As a command, `python -m tests.parity.compare DIR... [--set SECTION.KEY=VALUE]` checks
every `*.json.gz` trace under the given directories (e.g. traces made with `generate.py --out`,
kept out of the repository).
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import sys
from pathlib import Path

import numpy as np

from sim import Engine, load_scenario
from sim.inputs.workload import Workload
from tests.helpers import NO_FRONTEND
from tests.parity.generate import NEWEST_KNOWN, OLDEST_KNOWN, is_known, version_behaviours

# vLLM settings -> servesim scenario fields. These behaviours have no setting in vLLM (they are
# what its code does): a trace names them as the vLLM release that made it has them.
BEHAVIOURS = {"register_at_allocation": "kv", "free_uncached_first": "kv",
              "duplicate_cached_blocks": "kv", "continue_after_self_preemption": "scheduler"}


def scenario_overrides(cfg: dict, block_size: int) -> list[str]:
    """`--set` overrides giving servesim the trace's configuration."""
    b = lambda v: "true" if v else "false"  # noqa: E731
    policy = {"fcfs": "chunked", "priority": "priority"}[cfg["policy"]]
    out = [f"scheduler.policy=\"{policy}\"", f"kv.num_blocks={cfg['num_blocks']}",
           f"kv.block_size={block_size}", f"scheduler.max_num_seqs={cfg['max_num_seqs']}",
           f"scheduler.max_num_batched_tokens={cfg['max_num_batched_tokens']}",
           f"kv.enable_prefix_caching={b(cfg['prefix_caching'])}",
           f"scheduler.async_scheduling={b(cfg['async_scheduling'])}",
           f"scheduler.reserve_full_sequence={b(cfg['reserve_full_isl'])}",
           f"scheduler.watermark={cfg['watermark']}", "model.max_model_len=16384"]
    out += [f"{sec}.{k}={b(cfg[k])}" for k, sec in BEHAVIOURS.items() if k in cfg]
    return out


def workload_of_stream(stream: dict) -> Workload:
    reqs = sorted(stream["requests"], key=lambda r: (r[1], r[0]))
    assert [r[0] for r in reqs] == list(range(len(reqs))), "ids must follow arrival order"
    return Workload(
        arrival=np.array([r[1] for r in reqs], dtype=float),
        prompt=np.array([r[2] for r in reqs], dtype=np.int64),
        output=np.array([r[3] for r in reqs], dtype=np.int64),
        priority=np.array([r[4] for r in reqs], dtype=np.int64),
        cancel_at=np.array([np.nan if r[6] is None else r[6] for r in reqs], dtype=float),
        prefix_group=np.array([r[5] for r in reqs], dtype=np.int64),
        prefix_tokens=stream["prefix_tokens"])


def replay(doc: dict, overrides: list[str] = ()) -> list:
    """servesim's steps for the trace's stream and settings (plus `overrides`), in the trace's
    form: [scheduled [[id, tokens]...], preempted ids, ids whose last token the step computed,
    blocks in use after scheduling]."""
    # (vLLM's scheduler saw each request as its engine core received it: no API server in front)
    sc = load_scenario("chat", scenario_overrides(doc["config"], doc["block_size"])
                       + NO_FRONTEND + list(overrides))
    engine = Engine(sc, workload=workload_of_stream(doc["stream"]))
    engine.duration_override = itertools.repeat(1.0)
    steps: list = []
    step_ending: dict[float, int] = {}  # end time -> index (every step takes 1.0)
    policy = engine.policy
    schedule = policy.schedule

    def recording_schedule():
        out = schedule()
        if out.scheduled or out.preempted:
            if out.scheduled:
                step_ending[engine.now + 1.0] = len(steps)
            steps.append([[[r.req_id, n] for r, n in out.scheduled],
                          sorted(r.req_id for r in out.preempted), [],
                          engine.kv.num_used_blocks])
        return out

    policy.schedule = recording_schedule
    engine.run()
    for e in engine.events:
        if e.kind == "finish":
            steps[step_ending[e.t]][2].append(e.req_id)
    for st in steps:
        st[2].sort()
    return steps


def first_divergence(vllm_steps: list, sim_steps: list) -> int | None:
    """The index of the first step that differs (or where one side ends early), else None."""
    for k, (a, b) in enumerate(zip(vllm_steps, sim_steps)):
        if a != b:
            return k
    if len(vllm_steps) != len(sim_steps):
        return min(len(vllm_steps), len(sim_steps))
    return None


def describe(k: int, vllm_steps: list, sim_steps: list) -> str:
    """Both sides of step `k` (and the step before), field by field."""
    names = ("scheduled [id, tokens]", "preempted", "finished", "blocks in use")
    lines = []
    for j in (k - 1, k):
        if j < 0:
            continue
        a = vllm_steps[j] if j < len(vllm_steps) else "(no such step)"
        b = sim_steps[j] if j < len(sim_steps) else "(no such step)"
        lines.append(f"step {j}:" + ("" if a != b else " (identical)"))
        if a == b:
            continue
        if isinstance(a, str) or isinstance(b, str):
            lines += [f"  vllm:     {a}", f"  servesim: {b}"]
            continue
        for name, x, y in zip(names, a, b):
            mark = "  " if x == y else "!="
            lines += [f" {mark} {name}:", f"     vllm:     {x}", f"     servesim: {y}"]
    return "\n".join(lines)


def load(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def provenance(doc: dict) -> str | None:
    """Why a trace's behaviours are not known to be its vLLM release's, or None when they are:
    the release is outside the ones `version_behaviours` was written from (the trace was then
    recorded with another's, `--behaviours-of`), or the trace names behaviours other than those
    `version_behaviours` now gives that release (it was recorded before a correction)."""
    version = doc["vllm_version"]
    if not is_known(version):
        return (f"vLLM {version} is outside {OLDEST_KNOWN}..{NEWEST_KNOWN}: recorded with "
                f"{doc.get('behaviours_of', '(unnamed)')}'s behaviours, assumed")
    differ = {k: doc["config"].get(k) for k, v in version_behaviours(version).items()
              if doc["config"].get(k) != v}
    if differ:
        return f"vLLM {version}: recorded with {differ}, which that release does not have"
    return None


def check(path: Path, overrides: list[str] = ()) -> tuple[int, int, str | None]:
    """(steps, identical steps before the first divergence, its description or None)."""
    doc = load(path)
    sim_steps = replay(doc, overrides)
    k = first_divergence(doc["steps"], sim_steps)
    if k is None:
        return len(doc["steps"]), len(doc["steps"]), None
    same = sum(1 for a, b in zip(doc["steps"], sim_steps) if a == b)
    return len(doc["steps"]), same, describe(k, doc["steps"], sim_steps)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.parity.compare",
                                 description="replay golden traces through servesim")
    ap.add_argument("dirs", nargs="+", type=Path, help="directories of *.json.gz traces")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="SECTION.KEY=VALUE", help="a scenario override on top of the "
                    "trace's settings (e.g. to see a switch's older value diverge)")
    a = ap.parse_args(argv)
    paths = [p for d in a.dirs for p in sorted(d.glob("*.json.gz"))]
    bad = 0
    for p in paths:
        note = provenance(load(p))
        if note:  # the comparison still runs: it then tests the assumption
            print(f"{p.name}: note: {note}")
        n, same, diff = check(p, a.overrides)
        print(f"{p.name}: {n} steps, {same} identical" + ("" if diff is None else
                                                          "  DIVERGES"), flush=True)
        if diff is not None:
            bad += 1
            print(diff)
    print(f"{len(paths) - bad} of {len(paths)} traces identical step by step")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
