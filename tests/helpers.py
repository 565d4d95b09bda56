"""Shared test helpers: small scenarios, the engine invariants checked after every step, and
waiting for a child process to get somewhere (Linux /proc) instead of sleeping a guessed time."""

from __future__ import annotations

import gc
import os
import weakref
from collections import Counter

import numpy as np

from sim import Engine, load_scenario
from sim.engine.frontend import TERMS
from sim.engine.request import RequestState
from sim.inputs.workload import Workload


# No API server in front: the engine's clock alone, a request reaching the engine as it is sent
# (the front end's own tests are tests/sim/engine/test_frontend.py's).
NO_FRONTEND = [f"engine.{k}=0" for k in TERMS]


def small_scenario(*overrides: str, base: str = "chat"):
    """The default scenario shrunk to a few seconds and a small pool, without its API server."""
    return load_scenario(base, ["workload.duration_s=20", "workload.rate=6",
                                "kv.num_blocks=1500", *NO_FRONTEND, *overrides])


def blocks_at_end(r, block_size: int) -> int:
    """The blocks request `r` holds at its last token (no layer groups): its prompt and every
    output token but that one, written out apart from the engine's rule."""
    return -(-(r.prompt_len + r.max_output_tokens - 1) // block_size)


def workload_of(rows, hash_ids=None) -> Workload:
    """A hand-made workload from (arrival, prompt, output[, priority[, cancel_at]]) rows."""
    rows = [tuple(r) + (0, np.nan)[len(r) - 3:] if len(r) < 5 else tuple(r) for r in rows]
    a = np.array([r[0] for r in rows], dtype=float)
    return Workload(arrival=a, prompt=np.array([r[1] for r in rows], dtype=np.int64),
                    output=np.array([r[2] for r in rows], dtype=np.int64),
                    priority=np.array([r[3] for r in rows], dtype=np.int64),
                    cancel_at=np.array([r[4] for r in rows], dtype=float), hash_ids=hash_ids)


def check_invariants(engine: Engine, held=(), releasing_elsewhere=()) -> None:
    """Blocks owned by requests are exactly the used blocks, each owned once (or shared with a
    matching reference count), and every live request's table covers its computed tokens.
    `held`: blocks held outside any request's table (a deployment's hand-offs);
    `releasing_elsewhere`: requests this engine knows that another instance of its deployment
    has finished and not yet released (a prefill instance's record of a handed-off request)."""
    pool = engine.kv.pool
    owners = Counter(held)
    # Every sequence holds a seat, a further sample of a request included (vLLM V1 fans `n`
    # out into `n` requests); one finished by the last step keeps it until the next is scheduled.
    assert len(engine.policy.running) <= engine.scenario.scheduler.max_num_seqs
    live = list(engine.policy.running) + list(engine.policy.waiting)
    # Async scheduling: finished by the last step, still holding blocks and a seat in the batch
    # until the next step has been scheduled.
    releasing = {id(r) for r in engine._releasing}
    host_owners = Counter()
    kv = engine.kv
    for r in live:
        assert not r.state.is_done or (id(r) in releasing and r in engine.policy.running), r
        for b in r.block_table:
            owners[b] += 1
        # Layer groups: every table as long as the first; a window group's blocks freed (-1)
        # exactly before the block holding the earliest position the next query's window
        # reaches, and held from there on.
        tables = r.group_tables or []
        assert len(tables) == (kv.num_tables - 1 if r.block_table else 0), r
        for g, t in enumerate(tables, 1):
            assert len(t) == len(r.block_table), (r, g)
            gone = sum(1 for b in t if b == -1)
            assert all(b == -1 for b in t[:gone]), (r, g, t)
            if g >= kv.full_groups:
                assert gone == max(0, min(len(t), (r.num_computed_tokens + 1 - kv.window)
                                          // engine.block_size)), (r, g, gone)
            else:
                assert gone == 0, (r, g)
            for b in t[gone:]:
                owners[b] += 1
        for b in r.host_table:
            host_owners[b] += 1
        need = -(-r.num_computed_tokens // engine.block_size)
        if r.state is RequestState.SWAPPED:  # all its K/V sits in host memory
            assert r.block_table == [] and need <= len(r.host_table) <= need + 1, r
        else:
            assert r.host_table == [], r
            assert need <= len(r.block_table), (r, need)
            t = r.block_table
            if len(t) > need + 1:  # only a contiguous reservation covers the request's future
                assert t == list(range(t[0], t[0] + len(t))), (r, need)
    host = engine.kv.host
    if host is not None:
        for b in range(host.num_blocks):
            assert host.ref_cnt[b] == host_owners.get(b, 0), ("host", b)
        assert host.num_used == len(host_owners)
    else:
        assert not host_owners
    elsewhere = {id(r) for r in releasing_elsewhere}
    for r in engine.requests.values():
        if r.state.is_done and id(r) not in releasing and id(r) not in elsewhere:
            assert r.block_table == [] and r.host_table == [] and not r.group_tables, r
    for b in range(pool.num_blocks):
        assert pool.ref_cnt[b] == owners.get(b, 0), (b, pool.ref_cnt[b], owners.get(b, 0))
    assert pool.num_used == sum(1 for b in range(pool.num_blocks) if pool.ref_cnt[b] > 0)
    assert pool.num_free + pool.num_used == pool.num_blocks
    assert sorted(pool.free_block_ids()) == [b for b in range(pool.num_blocks)
                                              if pool.ref_cnt[b] == 0]
    for r in engine.policy.running:
        assert r.state is RequestState.RUNNING or id(r) in releasing, r
    for r in engine.policy.waiting:
        assert r.state in (RequestState.WAITING, RequestState.PREEMPTED, RequestState.SWAPPED)


def check_cluster_invariants(cluster) -> None:
    """`check_invariants` on every instance, each block held for a hand-off counted once on
    its side, and every live request in exactly one place: an instance's queue or batch, or
    between a prefill and a decode instance of a disaggregated deployment."""
    inside = {}
    for rid, src, dst, _, _ in cluster.handoff_blocks():
        r = cluster.requests[rid]
        if r.state is RequestState.TRANSFERRING:
            inside[rid] = "handoff"
            assert r.block_table == [] and r.host_table == [], r
            assert src or dst, r
            need = -(-r.num_computed_tokens // cluster.block_size)
            assert len(src) in (0, need) and len(dst) in (0, need), (r, src, dst)
        else:  # it joined the decode batch; the prefill side has not freed its blocks yet
            assert r.state is not RequestState.WAITING and not dst, r
    holds = [[] for _ in cluster.instances]
    for rid, src, dst, p, d in cluster.handoff_blocks():
        holds[p] += src
        holds[d] += dst
    for i, e in enumerate(cluster.instances):
        others = [r for x in cluster.instances if x is not e for r in x._releasing]
        check_invariants(e, holds[i], others)
        for r in list(e.policy.running) + list(e.policy.waiting):
            assert r.req_id not in inside, r
            inside[r.req_id] = i
    releasing = {id(r) for e in cluster.instances for r in e._releasing}
    for rid, r in cluster.requests.items():
        if r.state.is_done and id(r) not in releasing:
            assert r.block_table == [] and r.host_table == [] and rid not in inside, r
        else:
            assert rid in inside, r


def expand_steps(engine: Engine) -> list[tuple]:
    """The step-level event stream with runs of steps split into single steps, for comparing
    a skip-ahead run with a step-by-step one."""
    out = []
    for e in engine.events:
        if e.kind == "steps":
            t = e.t
            for end in e.ends:
                out.append(("step", t, float(end), e.prefill, e.decode))
                t = float(end)
        else:
            d = e.to_dict()
            out.append(tuple(sorted((k, str(v)) for k, v in d.items())))
    return out


def run_with_and_without_history(monkeypatch, sc, chunk: int, itl_rows: int, exact: int):
    """Run `sc` keeping its history and not, with timeline chunks of `chunk` rows, ITL exact
    for `itl_rows` steps and other figures for `exact` values (small: a short run then seals,
    drops rows and sketches). Returns both deployments and their summaries (no wall time)."""
    from sim import build, summarize
    from sim.stats import quantiles
    from sim.engine import timeline
    monkeypatch.setattr(timeline, "CHUNK", chunk)
    # (rows staged before they are written: fewer than a chunk, as in a long run, where a
    # stage is a quarter of a chunk)
    monkeypatch.setattr(timeline, "_STAGE", max(chunk // 4, 1))
    monkeypatch.setattr(timeline, "ITL_EXACT_ROWS", itl_rows)
    monkeypatch.setattr(quantiles, "EXACT_LIMIT", exact)
    full, bounded = build(sc), build(sc, keep_history=False)
    full.run()
    bounded.run()
    a, b = summarize(full), summarize(bounded)
    for s in (a, b, *a.get("replicas", ()), *b.get("replicas", ())):
        s.pop("wall_s")
    return full, bounded, a, b



def wait_for_process(pid: int, ready, what: str, guard_s: float = 120.0) -> None:
    """Polls until `ready()` (e.g. `catches(pid, SIGTERM)`) while process `pid` lives. The bound
    only guards against a hang: a machine however loaded gets there, or the test says why."""
    import time

    stop = time.monotonic() + guard_s
    while not ready():
        assert os.path.exists(f"/proc/{pid}") and time.monotonic() < stop, f"never {what}"
        time.sleep(0.01)


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler of its own for `signum` (Linux's /proc SigCgt): a
    signal sent once it has is handled, not the default death of a process still starting."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask >> (signum - 1) & 1)


def children(pid: int) -> list[int]:
    """The live child processes of `pid` (Linux /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def assert_freed_by_reference_counting(make) -> None:
    """The engine `make()` runs and returns is freed when dropped, by reference counting alone,
    leaving nothing in a cycle: runs freeze what they made (sim/gcpause.py), so a cycle would
    never be collected and repeated runs in one process would grow without bound."""
    gc.collect()
    gc.disable()
    try:
        engine = make()
        gone = weakref.ref(engine)
        del engine
        assert gone() is None
        assert gc.collect() == 0  # nothing it made is left in a cycle (its timeline, requests)
    finally:
        gc.enable()
