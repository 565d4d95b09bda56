"""Deployments of several engines: prefill/decode disaggregation (hand-off timing, blocks on
both sides, cancellation in every state, real K/V copied between executors) and replicas behind
a router (each router's rule, pooled metrics, prefix affinity); for both, identical event streams
however time is sliced, and session logs that replay and verify."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim import Cluster, Engine, build, summarize
from sim.errors import ScenarioError
from sim.inputs.scenario import load_scenario
from sim.engine.kv import blocks_for
from sim.session.log import encode, read_log, write_log
from sim.session.replay import verify
from sim.engine.request import RequestState as S
from tests.fuzz import fuzz_settings
from tests.helpers import (assert_freed_by_reference_counting, blocks_at_end,
                           check_cluster_invariants, run_with_and_without_history,
                           small_scenario, workload_of)
from tui.cli import main
from tui.compute import make_executor

DISAGG = 'scheduler.policy="disaggregated"'
P2D3 = (DISAGG, "cluster.prefill_instances=2", "cluster.decode_instances=3")


def streams(c) -> list:
    return [(i, [encode(e) for e in events]) for i, events in c.tagged_events()]


def step_all(c) -> int:
    n = 0
    while not c.done:
        c.step()
        check_cluster_invariants(c)
        n += 1
    return n


def handoff_events(c, rid: int) -> dict:
    out = {}
    for i, events in c.tagged_events():
        for e in events:
            if e.kind == "handoff" and e.req_id == rid:
                out[e.phase] = (i, e)
    return out


# ================================================================================ disaggregation
def test_build_gives_a_plain_engine_for_one_instance():
    assert type(build(small_scenario())) is Engine
    assert isinstance(build(small_scenario("cluster.replicas=2")), Cluster)
    c = build(small_scenario(DISAGG))
    assert isinstance(c, Cluster) and c.roles == ["prefill", "decode"]
    with pytest.raises(ScenarioError, match="replicas = 2"):
        build(small_scenario(DISAGG, "cluster.replicas=2"))
    with pytest.raises(ScenarioError, match="num_samples"):
        small_scenario("cluster.replicas=2", "workload.num_samples=2")


@pytest.mark.parametrize("tp, gbps", [(1, 50.0), (2, 50.0), (1, 5.0)])
def test_handoff_takes_context_bytes_over_the_link(tp, gbps):
    sc = small_scenario(DISAGG, f"model.tensor_parallel={tp}", f"scheduler.kv_link_gbps={gbps}")
    c = build(sc, workload=workload_of([(0.0, 1000, 20)]))
    P, D = c.instances
    seen_both = False
    while not c.done:
        c.step()
        check_cluster_invariants(c)
        [h] = c._handoffs.values() or [None]
        if h is not None and h.start is not None and not h.sent and not h.joined:
            # in flight: its K/V has blocks on both sides
            assert P.kv.num_used_blocks == D.kv.num_used_blocks == blocks_for(1000, 16)
            seen_both = True
    assert seen_both
    ev = handoff_events(c, 0)
    kv_bytes = 2 * sc.model.num_layers * sc.model.num_kv_heads * sc.model.head_dim * 2
    transfer = 1000 * kv_bytes / tp / (gbps * 1e9)
    (_, ready), (_, start), (_, sent), (_, joined) = (ev[k] for k in
                                                      ("ready", "start", "sent", "joined"))
    assert ev["ready"][0] == ev["sent"][0] == 0 and ev["start"][0] == ev["joined"][0] == 1
    assert start.end - start.t == pytest.approx(transfer, rel=1e-12)
    assert start.t == ready.t  # the decode instance was idle: it had room at once
    assert sent.t >= start.end and joined.t >= start.end
    r = c.get(0)
    # TTFT is the prefill instance's first token; the first gap includes the hand-off
    assert r.first_token_time == ready.t and r.ttft == ready.t
    times = r.token_times()
    assert len(times) == 20 and times[0] == ready.t
    assert times[1] - times[0] > transfer
    assert summarize(c)["itl_ms"]["max"] == pytest.approx(np.diff(times).max() * 1e3)
    assert P.kv.num_used_blocks == D.kv.num_used_blocks == 0


def test_prefill_side_frees_its_blocks_only_when_the_transfer_ends():
    sc = small_scenario(DISAGG, "scheduler.kv_link_gbps=0.5")  # a slow link: a wide window
    c = build(sc, workload=workload_of([(0.0, 600, 30), (0.0, 500, 30)]))
    P = c.prefill
    held_until = {}
    while not c.done:
        c.step()
        check_cluster_invariants(c)
        for rid, h in c._handoffs.items():
            if not h.sent:
                assert all(P.kv.pool.ref_cnt[b] == 1 for b in h.src)
                held_until[rid] = P.now
    for rid in (0, 1):
        start = handoff_events(c, rid)["start"][1]
        sent = handoff_events(c, rid)["sent"][1]
        assert held_until[rid] <= start.end <= sent.t  # held while in flight, freed after


def test_transfer_waits_for_room_on_the_decode_instance():
    # A pool that holds one request's context at a time (plus the watermark): the second
    # request waits, holding its prefill blocks, until the first has finished decoding.
    sc = small_scenario(DISAGG, "kv.num_blocks=70", "scheduler.watermark=0")
    c = build(sc, workload=workload_of([(0.0, 600, 40), (0.0, 600, 40)]))
    step_all(c)
    first, second = handoff_events(c, 0), handoff_events(c, 1)
    assert second["ready"][1].t < second["start"][1].t
    finish0 = next(e.t for e in c.decode.events if e.kind == "finish" and e.req_id == 0)
    assert second["start"][1].t >= finish0 > first["start"][1].t
    assert c.counts["finished"] == 2


def test_a_context_as_large_as_the_pool_still_gets_through():
    # 199 of 200 blocks: more than the pool less its watermark, which an empty instance waives
    sc = small_scenario(DISAGG, "kv.num_blocks=200", "scheduler.watermark=0.01")
    c = build(sc, workload=workload_of([(0.0, 3180, 2), (0.0, 100, 5)]))
    step_all(c)
    assert c.counts["finished"] == 2


CATEGORIES = ("waiting", "prefilling", "decoding", "preempted", "swapped", "handoff-wait",
              "handoff-flight")


def category(c, r) -> str | None:
    h = c._handoffs.get(r.req_id)
    if r.state is S.TRANSFERRING:
        return "handoff-wait" if h.start is None else "handoff-flight"
    if r.state is S.RUNNING:
        return "decoding" if r.replica == 1 else ("prefilling" if r.num_computed_tokens else None)
    return {S.WAITING: "waiting", S.PREEMPTED: "preempted", S.SWAPPED: "swapped"}.get(r.state)


PRESSURE = (DISAGG, "kv.num_blocks=60", "kv.block_size=16", "scheduler.max_num_batched_tokens=64",
            'scheduler.preemption="swap"', "kv.swap_space_gb=0.02", "scheduler.kv_link_gbps=0.3")
ROWS = [(0.01 * i, 150 + 37 * (i % 7), 40 + 23 * (i % 5)) for i in range(14)]


def check_all_returned(c) -> None:
    for e in c.instances:
        assert e.kv.num_free_blocks == e.kv.num_blocks
        assert e.kv.host is None or e.kv.host.num_free == e.kv.host.num_blocks
    assert all(r.state.is_done for r in c.requests.values())


def run_with_cancels(plan) -> Cluster:
    """A disaggregated pair under memory pressure; `plan` is (step, category) pairs: at that
    step, cancel a live request in that state if there is one."""
    c = build(small_scenario(*PRESSURE), workload=workload_of(ROWS))
    todo = sorted(plan)
    n = 0
    while not c.done:
        c.step()
        n += 1
        check_cluster_invariants(c)
        while todo and todo[0][0] <= n:
            _, want = todo.pop(0)
            for r in c.requests.values():
                if not r.state.is_done and category(c, r) == want:
                    c.cancel(r.req_id)
                    check_cluster_invariants(c)
                    break
    check_all_returned(c)
    return c


def test_cancel_in_every_state_returns_every_block_once():
    # each state's first request is cancelled (by the user) and the rest run on
    c = build(small_scenario(*PRESSURE), workload=workload_of(ROWS + [
        (0.3 + 0.01 * i, 170 + 29 * (i % 5), 60) for i in range(14)]))
    hit = {}
    while not c.done:
        c.step()
        check_cluster_invariants(c)
        for r in list(c.requests.values()):
            cat = None if r.state.is_done else category(c, r)
            if cat is not None and cat not in hit:
                held = [e.kv.num_used_blocks for e in c.instances]
                c.cancel(r.req_id)
                hit[cat] = r.req_id
                check_cluster_invariants(c)
                assert r.state is S.CANCELLED and r.block_table == r.host_table == []
                if cat.startswith("handoff"):
                    assert r.cancelled_in is S.TRANSFERRING
                    assert [e.kv.num_used_blocks for e in c.instances] < held
    assert set(hit) == set(CATEGORIES)
    assert c.cancelled_in_transfer == 2
    check_all_returned(c)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 600), st.sampled_from(CATEGORIES)), max_size=12))
def test_cancels_at_random_return_every_block_once(plan):
    run_with_cancels(plan)


def test_real_compute_matches_the_plain_engine_and_the_kv_really_moves(monkeypatch):
    rows = [(0.0, 40, 12), (0.0, 75, 10), (0.01, 130, 9), (0.02, 33, 14), (0.03, 200, 8)]
    sc = small_scenario('compute.backend="numpy"', "compute.verify_every=2")
    ref = Engine(sc, workload=workload_of(rows), executor=make_executor(sc))
    ref.run()
    dsc = small_scenario('compute.backend="numpy"', "compute.verify_every=2", DISAGG)
    c = build(dsc, workload=workload_of(rows), make_executor=make_executor)
    assert c.prefill.executor is not c.decode.executor
    step_all(c)
    assert len(c.transfers) == len(rows)
    for rid in range(len(rows)):
        assert c.get(rid).output_token_ids == ref.get(rid).output_token_ids, rid
    # two prefill and three decode instances: each hand-off copies into its own decode
    # instance's pool
    c = build(small_scenario('compute.backend="numpy"', "compute.verify_every=2", *P2D3),
              workload=workload_of(rows), make_executor=make_executor)
    step_all(c)
    assert min(c.routed) > 0 and len(c.transfers) == len(rows)
    for rid in range(len(rows)):
        assert c.get(rid).output_token_ids == ref.get(rid).output_token_ids, rid
    # replicas, each with its own executor, give the same tokens too
    rsc = small_scenario('compute.backend="numpy"', "cluster.replicas=2")
    c = build(rsc, workload=workload_of(rows), make_executor=make_executor)
    c.run()
    assert min(c.routed) > 0
    for rid in range(len(rows)):
        assert c.get(rid).output_token_ids == ref.get(rid).output_token_ids, rid
    # without the copy, the decode instance attends to blocks it never received
    from gpu.executor import ModelExecutor
    monkeypatch.setattr(ModelExecutor, "import_kv", lambda self, rid, blocks, t: None)
    c = build(small_scenario('compute.backend="numpy"', DISAGG), workload=workload_of(rows),
              make_executor=make_executor)
    c.run()
    assert any(c.get(rid).output_token_ids != ref.get(rid).output_token_ids
               for rid in range(len(rows)))


# ================================================================ other prefill:decode ratios
def test_each_arrival_goes_to_the_decode_instance_with_the_fewest_outstanding_requests():
    # Six at once: the decode instances take turns (ties: lowest index). Later, the two short
    # ones on instance 2 have ended and the others still decode: the next goes to 2.
    rows = [(0.0, 100, 2 if i % 3 == 0 else 400) for i in range(6)] + [(2.0, 100, 5)]
    c = build(small_scenario(*P2D3), workload=workload_of(rows))
    assert c.roles == ["prefill"] * 2 + ["decode"] * 3
    step_all(c)
    joined = {rid: i for rid, (i, _) in ((rid, handoff_events(c, rid)["joined"])
                                         for rid in range(7))}
    assert joined == {0: 2, 1: 3, 2: 4, 3: 2, 4: 3, 5: 4, 6: 2}
    whys = [e.why for e in c.events if e.kind == "route"]
    assert whys[6] == "round robin; decode 2 (least outstanding 0)"
    assert [e.instance for e in c.events if e.kind == "route"] == [0, 1] * 3 + [0]
    assert c.routed == [4, 3, 3, 2, 2][:2] + [3, 2, 2]


@pytest.mark.parametrize("cancel", [0.0, 0.3])
def test_two_prefill_and_three_decode_instances_lose_no_block_and_replay(tmp_path, cancel):
    sc = small_scenario(*P2D3, "kv.num_blocks=120", "workload.rate=30", "seed=5",
                        "workload.duration_s=2", f"workload.cancel_fraction={cancel}",
                        "workload.cancel_after_s=0.05", 'cluster.router="least-kv"')
    c = build(sc)
    step_all(c)  # the invariants after every step: no block lost or owned twice
    pairs = {(h[0][0], h[1][0]) for h in (
        (ev["ready"], ev["joined"]) for ev in (handoff_events(c, rid) for rid in c.requests)
        if "joined" in ev)}
    assert pairs == {(p, d) for p in (0, 1) for d in (2, 3, 4)}  # every route was taken
    assert all(e.kv.num_used_blocks == 0 for e in c.instances)
    if cancel:
        assert c.cancelled_in_transfer > 0
    path = tmp_path / "c.msgpack"
    write_log(path, c, summarize(c))
    log = read_log(path)
    assert [i["role"] for i in log.header["cluster"]["instances"]] == c.roles
    assert verify(log)[1] is None
    whole = build(sc)
    whole.run()
    sliced = build(sc)
    for k in range(1, 60):
        sliced.run_until(k * 0.05)
    sliced.run()
    assert streams(whole) == streams(c) == streams(sliced)


def test_a_replay_lets_an_instance_at_its_recorded_position_deliver_what_it_had(tmp_path):
    """Prefill instance 0 stood at its recorded position with its transfer's end due there,
    its blocks freed when the session routed the next arrival to instance 2 by least-kv; the
    replay, holding it there, never routed that arrival (instance 2 could not reach its
    recorded position) until the instances at their positions apply what the session had."""
    sc = small_scenario(DISAGG, "cluster.prefill_instances=3", "kv.num_blocks=400",
                        "seed=817969", 'cluster.router="least-kv"')
    c = interactive_session(sc)
    path = write_log(tmp_path / "c.msgpack", c)
    assert verify(read_log(path))[1] is None


@pytest.mark.parametrize("value, why", [
    ("0", "at least 1"), ("65", "at most 64"), ("1.5", "an integer"), ('"two"', "an integer"),
    ("1e9", "an integer"), ("true", "an integer")])
@pytest.mark.parametrize("key", ["prefill_instances", "decode_instances"])
def test_a_bad_instance_count_is_one_line_naming_the_field(capsys, key, value, why):
    assert main(["sim", "disaggregated", "--set", f"cluster.{key}={value}", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"cluster.{key}" in err and why in err, err


def test_instance_counts_without_disaggregation_are_refused(capsys):
    assert main(["sim", "chat", "--set", "cluster.decode_instances=2", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cluster.decode_instances = 2" in err, err
    assert "disaggregated" in err


# ====================================================================================== replicas
def route_rows(c) -> list:
    return [(e.req_id, e.instance) for e in c.events if e.kind == "route"]


def test_round_robin_takes_turns():
    c = build(small_scenario("cluster.replicas=3"))
    c.run()
    routes = route_rows(c)
    assert len(routes) == c.counts["arrived"] > 30
    assert [k for _, k in routes] == [i % 3 for i in range(len(routes))]
    assert c.routed == [sum(1 for _, k in routes if k == i) for i in range(3)]


class Recorder:
    """Wraps a router: before each choice, the replicas' state as the test computes it."""

    def __init__(self, c, state) -> None:
        self.c, self.state, self.inner, self.seen = c, state, c.router, []
        c.router = self

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def choose(self, req, engines):
        before = [self.state(self.c, i, e, req) for i, e in enumerate(engines)]
        k, why = self.inner.choose(req, engines)
        self.seen.append((before, k))
        return k, why


def live_on(c, i, e, new) -> int:
    return sum(1 for r in c.requests.values()
               if r.replica == i and not r.state.is_done and r is not new)


def kv_demand(c, i, e, new) -> int:
    queued = sum(blocks_for(r.num_tokens, 16) - len(r.block_table) for r in e.policy.waiting)
    return e.kv.pool.num_used + queued


@pytest.mark.parametrize("router, state", [("least-outstanding", live_on),
                                           ("least-kv", kv_demand)])
def test_load_routers_pick_the_least_loaded(router, state):
    sc = small_scenario("cluster.replicas=3", f'cluster.router="{router}"', "workload.rate=12",
                        "kv.num_blocks=800")
    c = build(sc)
    rec = Recorder(c, state)
    c.run()
    assert len(rec.seen) > 100
    spread = 0
    for before, k in rec.seen:
        assert before[k] == min(before), (before, k)
        assert k == before.index(min(before)) or router == "least-kv"
        spread += len(set(before)) > 1
    assert spread > 20  # the loads did differ: the rule was exercised


def shared_prefix_scenario(router: str, *more):
    # 16 system prompts of 512 tokens, each before a 128-token question
    return small_scenario("cluster.replicas=4", f'cluster.router="{router}"',
                          "kv.enable_prefix_caching=true", "workload.shared_prefix_tokens=512",
                          "workload.shared_prefix_groups=16", "workload.prompt_tokens=128",
                          "workload.output_tokens=64", "workload.rate=8", "kv.num_blocks=3000",
                          *more)


def test_prefix_affinity_keeps_each_prefix_on_one_replica_and_raises_the_hit_rate():
    hit = {}
    for router in ("round-robin", "prefix-affinity"):
        c = build(shared_prefix_scenario(router, "cluster.affinity_max_imbalance=1000"))
        c.run()
        hit[router] = summarize(c)["prefix_cache"]["hit_rate"]
        if router == "prefix-affinity":
            groups = {}
            for rid, k in route_rows(c):
                groups.setdefault(c.get(rid).shared_prefix[0], set()).add(k)
            assert len(groups) == 16 and all(len(v) == 1 for v in groups.values())
            assert len(set().union(*groups.values())) > 1  # not all on one replica
    assert hit["prefix-affinity"] > hit["round-robin"] + 0.15, hit


def test_prefix_affinity_yields_to_load_past_the_imbalance_bound():
    sc = small_scenario("cluster.replicas=2", 'cluster.router="prefix-affinity"',
                        "workload.shared_prefix_tokens=512", "workload.shared_prefix_groups=1",
                        "cluster.affinity_max_imbalance=2", "workload.rate=12")
    c = build(sc)
    rec = Recorder(c, live_on)
    c.run()
    whys = [e.why for e in c.events if e.kind == "route"]
    assert any(w.startswith("prefix") for w in whys) and any(w.startswith("balance") for w in whys)
    for (before, k), why in zip(rec.seen, whys):
        if why.startswith("prefix"):
            assert before[k] - min(before) <= 2
    assert min(c.routed) > 0


def test_metrics_per_replica_and_for_the_whole_deployment():
    c = build(small_scenario("cluster.replicas=3", 'cluster.router="least-outstanding"'))
    c.run()
    s = summarize(c)
    reps = s["replicas"]
    assert [r["instance"] for r in reps] == [0, 1, 2] and s["deployment"]["gpus"] == 3
    for key in ("finished", "total", "cancelled"):
        assert s["requests"][key] == sum(r["requests"][key] for r in reps)
    assert s["output_tokens"] == sum(r["output_tokens"] for r in reps) > 0
    assert s["ttft_ms"]["count"] == sum(r["ttft_ms"]["count"] for r in reps)
    assert s["itl_ms"]["count"] == sum(r["itl_ms"]["count"] for r in reps)
    assert s["kv"]["total_blocks"] == 3 * reps[0]["kv"]["total_blocks"]
    assert s["energy_j"] == pytest.approx(sum(r["energy_j"] for r in reps))
    assert max(r["kv"]["peak_used_blocks"] for r in reps) <= s["kv"]["peak_used_blocks"] <= sum(
        r["kv"]["peak_used_blocks"] for r in reps)
    assert s["duration_s"] == max(r["duration_s"] for r in reps)
    assert all(r["duration_s"] == s["duration_s"] for r in reps)  # idle ones brought to the end
    # pooled percentiles: the deployment's p99 lies within its replicas'
    p99 = [r["ttft_ms"]["p99"] for r in reps]
    assert min(p99) <= s["ttft_ms"]["p99"] <= max(p99)


# ============================================================== both: slicing, logs and replay
def same_events_however_sliced(sc) -> tuple:
    """Run `sc` whole, in small slices and step by step; check the three event streams are
    identical and return the whole and the stepped runs."""
    whole = build(sc)
    whole.run()
    sliced = build(sc)
    t = 0.0
    while not sliced.done:
        t += 0.0137
        sliced.run_until(t, max_steps=5)
    stepped = build(sc)
    while not stepped.done:
        stepped.step()
    assert streams(whole) == streams(sliced) == streams(stepped)
    return whole, stepped


@pytest.mark.parametrize("overrides", [
    ("cluster.replicas=3", 'cluster.router="least-kv"', "workload.cancel_fraction=0.2",
     "kv.num_blocks=500"),
    (DISAGG, "kv.num_blocks=500", "workload.cancel_fraction=0.2",
     'workload.cancel_after_s={dist="uniform", min=0, max=3}', 'scheduler.preemption="swap"',
     "kv.swap_space_gb=0.2"),
])
def test_sliced_and_unsliced_runs_give_identical_events(overrides):
    whole, stepped = same_events_however_sliced(small_scenario(*overrides,
                                                               "workload.duration_s=10"))
    assert sum(len(ev) for _, ev in streams(whole)) > 300
    counts = whole.counts
    assert counts["cancelled"] > 0 and counts["preemptions"] > 0, counts
    a, b = summarize(whole), summarize(stepped)
    assert a["requests"] == b["requests"] and a["itl_ms"] == b["itl_ms"]


def interactive_session(sc) -> Cluster:
    """A session driven as the dashboard drives one: small slices, with injections,
    cancellations (a request between the instances among them) and a policy switch."""
    c = build(sc)
    t, k = 0.0, 0
    while not c.done:
        t += 0.05
        c.run_until(t, max_steps=7)
        k += 1
        if k % 40 == 5:
            c.inject(300, 50, count=2)
        if k % 40 == 20:
            live = [r for r in c.requests.values() if not r.state.is_done]
            if live:
                c.cancel(live[len(live) // 2].req_id)
        if k % 50 == 33:
            moving = [rid for rid, h in c._handoffs.items() if not h.joined]
            if moving:
                c.cancel(moving[0])
        if k == 60:
            c.cancel_waiting()
        if k == 90:
            c.switch_policy("fcfs")
    return c


@pytest.mark.parametrize("overrides", [
    ("cluster.replicas=3", 'cluster.router="prefix-affinity"', "kv.enable_prefix_caching=true",
     "workload.shared_prefix_tokens=256", "workload.shared_prefix_groups=3",
     "workload.cancel_fraction=0.1"),
    (DISAGG, "workload.cancel_fraction=0.1", "kv.num_blocks=800", "seed=3"),
    (*P2D3, 'cluster.router="least-outstanding"', "workload.cancel_fraction=0.1",
     "kv.num_blocks=800", "seed=3"),
])
def test_session_log_round_trip_and_replay_verify(tmp_path, capsys, overrides):
    sc = small_scenario(*overrides)
    c = interactive_session(sc)
    actions = [e.action for e in c.events if e.kind == "action"]
    assert {"inject", "cancel", "cancel_waiting", "switch_policy"} <= set(actions)
    path = tmp_path / "c.msgpack"
    write_log(path, c)
    log = read_log(path)
    assert log.header["format"] == 2 and len(log.header["cluster"]["instances"]) == len(
        c.instances)
    assert [e.instance for e in log.events if e.kind == "stream"] == list(
        range(-1, len(c.instances)))
    r, div = verify(log)
    assert div is None
    assert r.done and r.engine.position() == c.position()
    a, b = summarize(c), summarize(r.engine)
    # idle energy sums idle stretches, which the session and the replay cut differently
    assert b["energy_j"] == pytest.approx(a["energy_j"], rel=1e-12)
    for s in (a, b, *a["replicas"], *b["replicas"]):
        for k in ("wall_s", "energy_j", "energy_j_per_output_token"):
            s.pop(k)
    assert a == b
    assert main(["replay", str(path), "--verify"]) == 0
    assert "identical" in capsys.readouterr().out
    # replayed under another deployment, it diverges
    other = read_log(path)
    if "replicas" in str(overrides):
        other.header["scenario"]["cluster"]["router"] = "round-robin"
    else:
        other.header["scenario"]["scheduler"]["kv_link_gbps"] = 5.0
    _, div = verify(other)
    assert div is not None


def test_sweep_grid_over_replicas(capsys):
    assert main(["sweep", "chat", "--grid", "cluster.replicas=1,2,4", "--workers", "1",
                 "--set", "workload.duration_s=8", "--set", "workload.rate=10"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out[1:]]
    assert [r[0] for r in rows] == ["1", "2", "4"]
    ttft_p99 = [float(r[5].replace(",", "")) for r in rows]
    assert ttft_p99[2] < ttft_p99[0]


def test_cli_sim_shows_each_instance_and_compare_runs_the_pair(capsys):
    assert main(["sim", "chat", "--set", "workload.duration_s=8", "--set",
                 DISAGG]) == 0
    head = capsys.readouterr().out.splitlines()[1].split()
    assert head == ["disaggregated", "prefill", "decode"]
    assert main(["compare", "chat", "--policies", "chunked,disaggregated", "--set",
                 "workload.duration_s=8", "--set", "cluster.replicas=2", "--json"]) == 0
    import json
    out = json.loads(capsys.readouterr().out)
    assert out["chunked"]["deployment"]["gpus"] == out["disaggregated"]["deployment"]["gpus"] == 2


def test_measured_clock_sessions_replay_with_each_instances_durations(tmp_path):
    rows = [(0.0, 40, 12), (0.0, 75, 10), (0.01, 130, 9), (0.02, 33, 14)]
    for over in (DISAGG, "cluster.replicas=2"):
        sc = small_scenario('compute.backend="numpy"', 'compute.clock="measured"', over)
        c = build(sc, workload=workload_of(rows), make_executor=make_executor)
        c.run_until(0.05)
        c.inject(50, 5)
        c.run()
        log = read_log(write_log(tmp_path / "m.msgpack", c))
        r, div = verify(log, make_executor)
        assert div is None and r.engine.position() == c.position(), over


@pytest.mark.parametrize("overrides", [
    # (60 s: with vLLM V1's admission gate the prefill instance takes a third of the steps it
    # took, and needs a longer run to seal and drop rows)
    (DISAGG, "workload.cancel_fraction=0.2", "workload.duration_s=60"),
    ("cluster.replicas=3", 'cluster.router="least-kv"', "workload.rate=12"),
])
def test_a_deployment_without_history_has_the_same_summary(monkeypatch, overrides):
    # (small chunks: the instances seal and drop rows, and the KV peak is merged as the run
    # goes, ties between instances included)
    monkeypatch.setattr(Cluster, "PRUNE_AT", 16)
    # (a rolling window of a few seconds: the rows of the last ROLLING_S seconds are held)
    monkeypatch.setattr(Engine, "ROLLING_S", 2.0)
    full, bounded, a, b = run_with_and_without_history(
        monkeypatch, small_scenario(*overrides), chunk=128, itl_rows=600, exact=30)
    assert a == b and a["kv"]["peak_used_blocks"] > 0
    assert streams(full) == streams(bounded)
    assert len(bounded.requests) < len(full.requests) and bounded.transfers == []
    for e in bounded.instances:
        assert e.requests == {} and e.timeline.first > 0
    # the merged peak is the peak of the instances' summed use, each held from step to step
    times = np.concatenate([e.timeline.column("end") for e in full.instances])
    deltas = np.concatenate([np.diff(e.timeline.column("kv_used"), prepend=0)
                             for e in full.instances])
    order = np.argsort(times, kind="stable")
    assert a["kv"]["peak_used_blocks"] == np.cumsum(deltas[order]).max()


# Short requests, cancelled soon after arriving: many client cancellations land on a request
# that finished in the step before, its blocks still held (async scheduling), and are freed
# at once. A run without history had forgotten that request and kept its blocks a step longer
# (found by the invariant hunt: kv.mean_usage 0.112060 against 0.112160 over 520 steps).
SHORT_CANCELLED = ("kv.block_size=8", "kv.num_blocks=112", "kv.enable_prefix_caching=true",
                   "scheduler.max_num_batched_tokens=256", "workload.arrival=\"poisson\"",
                   "workload.rate=50", "workload.num_requests=125", "workload.duration_s=0",
                   'workload.prompt_tokens={dist="exponential", mean=4, min=1, max=16}',
                   'workload.output_tokens={dist="lognormal", mean=17, cv=1.0, min=1, max=40}',
                   "workload.cancel_fraction=0.3", "workload.cancel_after_s=0.05",
                   "workload.shared_prefix_tokens=25")
KINDS = {"single": (), "replicas": ("cluster.replicas=2",), "disaggregated": (DISAGG,),
         "disaggregated 2:3": P2D3,
         "data-parallel": ("model.data_parallel=2",), "pipeline": ("model.pipeline_parallel=4",)}


@pytest.mark.parametrize("kind", KINDS)
def test_a_client_cancel_of_a_request_finishing_frees_its_blocks_with_or_without_history(
        monkeypatch, kind):
    sc = small_scenario(*SHORT_CANCELLED, "seed=838294", *KINDS[kind])
    full, bounded, a, b = run_with_and_without_history(
        monkeypatch, sc, chunk=64, itl_rows=400, exact=30)
    assert a == b
    assert (streams(full) == streams(bounded) if kind != "single"
            else [encode(x) for x in full.events] == [encode(x) for x in bounded.events])


@pytest.mark.fuzz
@fuzz_settings(20)
@given(kind=st.sampled_from(sorted(KINDS)), seed=st.integers(0, 2**20),
       policy=st.sampled_from(["chunked", "priority", "sjf", "lpm", "fcfs"]),
       async_scheduling=st.booleans(), cancel_after=st.sampled_from([0.01, 0.03, 0.05, 0.2]))
def test_every_deployment_has_the_same_summary_without_history(monkeypatch, kind, seed, policy,
                                                               async_scheduling, cancel_after):
    over = [*SHORT_CANCELLED, f"seed={seed}", f"workload.cancel_after_s={cancel_after}",
            f"scheduler.async_scheduling={str(async_scheduling).lower()}", *KINDS[kind]]
    if not kind.startswith("disaggregated"):
        over.append(f'scheduler.policy="{policy}"')
    monkeypatch.setattr(Cluster, "PRUNE_AT", 16)
    _, _, a, b = run_with_and_without_history(
        monkeypatch, small_scenario(*over), chunk=64, itl_rows=400, exact=30)
    assert a == b


def test_a_request_finishing_on_the_decode_instance_is_released_there_one_step_later():
    # Async scheduling: a handed-off request that finishes on the decode instance keeps its
    # blocks there until the next step is scheduled; the prefill instance's record of it is
    # the same object, and owns none of them (found by the deployment lockstep fuzzer).
    sc = small_scenario('scheduler.policy="disaggregated"', "kv.num_blocks=40", "seed=22639",
                        "workload.duration_s=3", "workload.rate=8",
                        'workload.prompt_tokens={dist="uniform", min=1, max=200}',
                        'workload.output_tokens={dist="uniform", min=1, max=150}')
    d = build(sc)
    for _ in range(8):
        d.step()
    (rid,) = d.inject(1, 2)
    prefill, decode = d.instances
    seen = False
    for _ in range(12):
        d.step()
        check_cluster_invariants(d)
        r = d.requests[rid]
        if r in decode._releasing:
            seen = True
            assert r.block_table and r.state.is_done and rid in prefill.requests
        elif seen:
            assert r.block_table == []  # released: the blocks went back to the decode pool
            break
    assert seen and d.requests[rid].block_table == []


def _times_in_order(c) -> None:
    """Each request's times in the order of its states, its end last of its events (but the
    prefill instance's freeing of its blocks, at its own step boundary)."""
    last: dict[int, float] = {}
    for _, events in c.tagged_events():
        for e in events:
            rid = getattr(e, "req_id", None)
            if rid is not None and getattr(e, "phase", None) != "sent":
                last[rid] = max(last.get(rid, 0.0), e.t)
    for r in c.requests.values():
        times = [r.arrival_time, r.admitted_time, r.first_token_time, r.finish_time]
        times = [t for t in times if t is not None]
        assert times == sorted(times), (r.req_id, r.state, times)
        if r.state.is_done:
            assert r.finish_time == last[r.req_id], (r.req_id, r.state, r.finish_time,
                                                     last[r.req_id])


@settings(max_examples=25, deadline=None)
@given(deployment=st.sampled_from([(DISAGG,), ("cluster.replicas=2",)]),
       rows=st.lists(st.tuples(st.sampled_from([0.0, 0.02, 0.05]),
                               st.sampled_from([100, 2100, 4000]), st.integers(1, 6),
                               st.sampled_from([0.001, 0.03, 0.05, 0.08, 0.1, 0.2])),
                     min_size=1, max_size=6),
       user=st.lists(st.integers(0, 30), max_size=3))
def test_cancellations_in_every_state_end_after_everything_else(deployment, rows, user):
    # A client cancellation due while a request's last prefill chunk ran was stamped with the
    # client's time once the request was between the instances: before its first token.
    rows = sorted((t, p, o, 0, t + after) for t, p, o, after in rows)
    c = build(small_scenario("kv.num_blocks=800", *deployment), workload=workload_of(rows))
    k = 0
    while not c.done:
        c.step()
        k += 1
        if k in user:  # a user's cancellation of the request furthest along
            live = [r for r in c.requests.values() if not r.state.is_done]
            if live:
                c.cancel(max(live, key=lambda r: r.num_computed_tokens).req_id)
    _times_in_order(c)


def test_a_cancellation_during_the_last_prefill_step_ends_at_its_end():
    c = build(small_scenario(DISAGG), workload=workload_of([(0.0, 4000, 5, 0, 0.05)]))
    c.run()
    [r] = c.requests.values()
    assert r.state is S.CANCELLED and r.cancelled_in is S.TRANSFERRING
    assert r.finish_time == r.first_token_time > 0.05


@settings(max_examples=20, deadline=None)
@given(deployment=st.sampled_from([(DISAGG,), ("cluster.replicas=2",),
                                   ("cluster.replicas=2", 'cluster.router="least-outstanding"',
                                    'scheduler.policy="priority"')]),
       window=st.sampled_from([2, 4, 10]), seed=st.integers(0, 50),
       cancel=st.sampled_from([0.05, 0.3, 1.0]))
def test_multi_step_windows_give_the_same_events_however_time_is_sliced(deployment, window,
                                                                         seed, cancel):
    # A deployment applied its instances' client cancellations at every decision, within a
    # multi-step window too: step by step they came mid-window, in a run of steps at its end.
    sc = small_scenario(*deployment, f"engine.num_scheduler_steps={window}", f"seed={seed}",
                        "workload.duration_s=1.5", "workload.rate=40", "kv.num_blocks=300",
                        "workload.cancel_fraction=0.7", f"workload.cancel_after_s={cancel}")
    whole, stepped = build(sc), build(sc, skip_ahead=False)
    whole.run()
    stepped.run()
    assert streams(whole) == streams(stepped)


@pytest.mark.parametrize("deployment", ["cluster.replicas=2", 'scheduler.policy="disaggregated"'])
@pytest.mark.parametrize("history", [True, False])
def test_a_user_cancel_of_a_request_finished_in_the_last_step_frees_its_blocks(
        tmp_path, deployment, history):
    """Under async scheduling a request that finished in its instance's last step holds its
    blocks until the next is scheduled; a user's cancel then gives them back at once, as on a
    single engine (it raised "already finished", or with no history "no request with id"),
    and the session replays."""
    c = build(small_scenario("kv.num_blocks=64", deployment), keep_history=history,
              workload=workload_of([(0.0, 40, 3), (0.0, 40, 3), (0.0, 40, 30), (0.0, 40, 30)]))
    while not any(i._releasing for i in c.instances):
        c.step()
    inst = next(i for i in c.instances if i._releasing)
    req = inst._releasing[0]
    used = inst.kv.num_used_blocks
    c.cancel(req.req_id)
    assert req not in inst._releasing and inst.kv.num_used_blocks < used
    assert req.state is S.FINISHED  # (all its tokens were computed: it stays finished)
    c.run()
    check_cluster_invariants(c)
    path = tmp_path / "s.msgpack"
    write_log(path, c, summarize(c))
    assert verify(read_log(path))[1] is None


@pytest.mark.parametrize("spec", ["replicas", "disaggregated", "data-parallel", "pipeline"])
@pytest.mark.parametrize("keep_history", [True, False])
def test_a_dropped_deployment_is_freed_by_reference_counting_alone(spec, keep_history):
    # (its instances' callbacks into it, a bound method each, once held it in a cycle: a sweep's
    # worker, freezing each run's objects, kept every deployment it ran)
    def make():
        d = build(load_scenario(spec, ["workload.duration_s=3"]), keep_history=keep_history)
        d.run()
        assert d.counts["finished"] > 0
        return d

    assert_freed_by_reference_counting(make)


def test_guaranteed_no_evict_holds_in_a_disaggregated_deployment():
    """Under `engine.guaranteed_no_evict` a decode instance takes a hand-off in only when the
    request fits to its last token beside its running and inbound requests, and a prefill
    instance reserves for the prompt alone (its requests leave after their first token):
    nothing is preempted anywhere, where vLLM's rule preempts on the decode instance."""
    over = (DISAGG, "kv.num_blocks=90", "kv.block_size=16", "scheduler.max_num_batched_tokens=256")
    rows = [(0.01 * i, 150 + 37 * (i % 7), 60 + 23 * (i % 5)) for i in range(24)]
    plain = build(small_scenario(*over), workload=workload_of(rows))
    step_all(plain)
    assert sum(e.counts["preemptions"] for e in plain.instances) > 0
    c = build(small_scenario(*over, "engine.guaranteed_no_evict=true"), workload=workload_of(rows))
    prefill, decode = c.instances
    assert prefill.policy.hands_off and not decode.policy.hands_off
    peak = 0
    while not c.done:
        c.step()
        check_cluster_invariants(c)
        for e in c.instances:
            held = sum(e.policy.completion_blocks(r) for r in e.policy.running)
            assert held <= e.kv.num_blocks
        peak = max(peak, sum(blocks_at_end(r, 16) for r in decode.policy.running))
    assert sum(e.counts["preemptions"] for e in c.instances) == 0
    assert peak > 0.8 * decode.kv.num_blocks
    assert all(r.state is S.FINISHED for r in c.requests.values())
    check_all_returned(c)
