"""Each policy's ordering rule, observed through the engine's event stream."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from sim import Engine, build, summarize
from sim.engine.request import RequestState
from tests.fuzz import fuzz_settings
from tests.helpers import (blocks_at_end, check_cluster_invariants, check_invariants,
                           small_scenario, workload_of)


def run_steps(engine, n=100000):
    steps = []
    while not engine.done and n:
        before = len(engine.events)
        engine.step()
        check_invariants(engine)
        steps.extend(e for e in engine.events[before:] if e.kind == "steps")
        n -= 1
    return steps


def test_static_admits_a_new_batch_only_when_the_last_has_finished():
    sc = small_scenario("scheduler.policy=\"static\"", "scheduler.max_num_seqs=4")
    w = workload_of([(0.0, 100, 10), (0.0, 100, 50), (0.001, 100, 10), (0.002, 100, 10),
                     (0.003, 100, 10), (0.004, 100, 10)])
    e = Engine(sc, workload=w)
    steps = run_steps(e)
    first = steps[0]
    assert {c[0] for c in first.prefill} == {0, 1}       # the two that had arrived
    admitted_late = [s for s in steps if s.prefill and s is not first]
    # requests 2..5 wait until request 1 (50 tokens) has finished, although seats were free
    finish_1 = e.get(1).finish_time
    assert admitted_late and admitted_late[0].t >= finish_1
    assert {c[0] for c in admitted_late[0].prefill} == {2, 3, 4, 5}


def test_fcfs_prefills_whole_prompts_in_steps_without_decodes():
    sc = small_scenario("scheduler.policy=\"fcfs\"", "scheduler.max_num_batched_tokens=512")
    w = workload_of([(0.0, 300, 20), (0.05, 900, 5), (0.06, 100, 5)])
    e = Engine(sc, workload=w)
    steps = run_steps(e)
    for s in steps:
        assert not (s.prefill and s.decode)  # a step prefills or decodes, never both
        for rid, start, n in s.prefill:
            assert start == 0 and n == e.get(rid).prompt_len  # whole prompts
    # the 900-token prompt exceeds the 512 budget: it runs alone
    solo = [s for s in steps if any(c[0] == 1 for c in s.prefill)]
    assert len(solo) == 1 and len(solo[0].prefill) == 1


def test_chunked_puts_decodes_first_and_splits_long_prompts():
    sc = small_scenario("scheduler.policy=\"chunked\"", "scheduler.max_num_batched_tokens=256")
    w = workload_of([(0.0, 40, 30), (0.0, 40, 30), (0.01, 1000, 5)])
    e = Engine(sc, workload=w)
    steps = run_steps(e)
    chunks = [(s, c) for s in steps for c in s.prefill if c[0] == 2]
    assert len(chunks) >= 4  # 1000 tokens over several steps
    pos = 0
    for s, (rid, start, n) in chunks:
        assert start == pos
        pos += n
        assert n + len(s.decode) <= 256  # decodes took their share of the budget first
        if s.decode:
            assert set(s.decode) <= {0, 1}
    assert pos == 1000


def test_without_chunked_prefill_prompts_go_whole_beside_the_decodes_or_wait():
    """engine.chunked_prefill = false (TensorRT-LLM's default): in-flight batching of whole
    prompts. A prompt that does not fit in what the decodes leave of the budget waits for a
    step where it does (it is not split, and nothing behind it goes first); one longer than
    the whole budget goes alone, whole, rather than never."""
    rows = [(0.0, 40, 30), (0.0, 40, 30), (0.01, 200, 5), (0.011, 220, 5), (0.012, 30, 5),
            (0.5, 1000, 5)]
    split = {}
    for chunking in (True, False):
        sc = small_scenario("scheduler.policy=\"chunked\"", "scheduler.max_num_batched_tokens=256",
                            f"engine.chunked_prefill={str(chunking).lower()}")
        e = Engine(sc, workload=workload_of(rows))
        steps = run_steps(e)
        pieces = {}
        for s in steps:
            for rid, start, n in s.prefill:
                pieces.setdefault(rid, []).append((s, start, n))
        split[chunking] = any(len(v) > 1 for v in pieces.values())
        if chunking:
            continue
        for rid, ((s, start, n),) in pieces.items():  # one step each, from its start
            assert start == 0 and n == e.get(rid).prompt_len
            if rid != 5:
                assert sum(c[2] for c in s.prefill) + len(s.decode) <= 256
        # 200 and 220 tokens do not fit together: the 220 waits, and the 30 behind it too
        (s2, _, _), = pieces[2]
        (s3, _, _), = pieces[3]
        (s4, _, _), = pieces[4]
        assert s3.t > s2.t and s4.t >= s3.t
        # the 1,000-token prompt, past the whole budget, goes alone beside the decodes
        (s5, _, _), = pieces[5]
        assert [c[0] for c in s5.prefill] == [5]
        assert all(r.state is RequestState.FINISHED for r in e.requests.values())
    assert split == {True: True, False: False}


def test_preemption_picks_the_most_recently_admitted_and_requeues_it_first():
    for policy in ("fcfs", "chunked"):
        sc = small_scenario(f"scheduler.policy=\"{policy}\"", "kv.num_blocks=24",
                            "kv.block_size=16")
        w = workload_of([(0.0, 100, 150), (0.001, 100, 150), (0.002, 16, 4)])
        e = Engine(sc, workload=w)
        run_steps(e)
        pre = [x for x in e.events if x.kind == "preempt"]
        assert pre, policy
        victim = pre[0]
        running_then = [r for r in e.requests.values()
                        if r.admitted_time is not None and r.admitted_time <= victim.t
                        and (r.finish_time is None or r.finish_time > victim.t)]
        newest = max(running_then, key=lambda r: r.admitted_time)
        assert victim.req_id == newest.req_id, policy
        assert e.get(victim.req_id).num_preemptions >= 1
        assert all(e.get(i).state.value == "finished" for i in range(3))


def test_all_policies_finish_every_request_with_invariants():
    for policy in ("static", "fcfs", "chunked"):
        sc = small_scenario(f"scheduler.policy=\"{policy}\"", "kv.num_blocks=400",
                            "workload.duration_s=6")
        e = Engine(sc)
        run_steps(e)
        assert e.counts["finished"] + e.counts["rejected"] == e.counts["arrived"] > 20
        assert e.kv.num_used_blocks == 0
        assert np.all(np.diff(e.timeline.column("end")) > 0)


# --- scheduling breadth ---------------------------------------------------------------------------
def admitted_order(e):
    return [x.req_id for x in e.events if x.kind == "admit" and not x.resumed]


def test_priority_admits_lower_values_first_then_by_arrival():
    sc = small_scenario("scheduler.policy=\"priority\"", "scheduler.max_num_seqs=1")
    # all queued behind request 0; priorities 2, 0, 1, 0
    w = workload_of([(0.0, 50, 30, 5), (0.001, 50, 5, 2), (0.002, 50, 5, 0),
                     (0.003, 50, 5, 1), (0.004, 50, 5, 0)])
    e = Engine(sc, workload=w)
    run_steps(e)
    assert admitted_order(e) == [0, 2, 4, 3, 1]


def test_priority_queue_keeps_vllms_order_through_adds_takes_and_cancels():
    """The heap gives the same head and order as a list sorted by (priority, arrival, id),
    vLLM's order, through random mixes of arrivals (with ties in priority and arrival),
    admissions of the head and cancellations from anywhere in the queue."""
    import random
    from types import SimpleNamespace

    from sim.policies.priority import WaitingHeap

    def key(r):
        return (r.priority, r.arrival_time, r.req_id)

    for seed in range(400):
        rng = random.Random(seed)
        q, ref = WaitingHeap(), []
        for i in range(150):
            op = rng.choice("aatc")
            if op == "a" or not ref:
                r = SimpleNamespace(priority=rng.randrange(4),
                                    arrival_time=float(rng.randrange(5)), req_id=i)
                q.push(r)
                ref.append(r)
            else:
                r = min(ref, key=key) if op == "t" else rng.choice(ref)
                q.discard(r)
                ref.remove(r)
            assert len(q) == len(ref) and bool(q) == bool(ref)
            if ref:
                assert q.head() is min(ref, key=key), (seed, i)
        assert q.in_order() == sorted(ref, key=key)
        assert sorted(x.req_id for x in q) == sorted(x.req_id for x in ref)


def test_priority_preempts_lower_priority_for_a_waiting_higher_one():
    sc = small_scenario("scheduler.policy=\"priority\"", "kv.num_blocks=20", "kv.block_size=16",
                        "scheduler.preempt_for_waiting=true")
    # request 0 (priority 5) fills most of the pool; request 1 (priority 0) cannot fit
    w = workload_of([(0.0, 200, 60, 5), (0.05, 150, 10, 0)])
    e = Engine(sc, workload=w)
    run_steps(e)
    pre = [x for x in e.events if x.kind == "preempt"]
    assert pre and pre[0].req_id == 0
    assert e.get(1).finish_time < e.get(0).finish_time
    # vLLM V1 (the default) never preempts for a waiting request: request 1 waits its turn
    e = Engine(small_scenario("scheduler.policy=\"priority\"", "kv.num_blocks=20",
                              "kv.block_size=16"), workload=w)
    run_steps(e)
    assert e.counts["preemptions"] == 0
    assert e.get(1).admitted_time >= e.get(0).finish_time


def test_priority_victim_is_the_lowest_priority_running():
    sc = small_scenario("scheduler.policy=\"priority\"", "kv.num_blocks=30", "kv.block_size=16")
    w = workload_of([(0.0, 100, 200, 0), (0.0, 100, 200, 9), (0.0, 100, 200, 3)])
    e = Engine(sc, workload=w)
    run_steps(e)
    pre = [x.req_id for x in e.events if x.kind == "preempt"]
    assert pre and pre[0] == 1


def test_chunked_keeps_the_watermark_free_only_when_admitting_beside_others():
    w = workload_of([(0.0, 100, 30), (0.001, 140, 5)])  # 7 blocks (growing to 9), then 9
    admitted = {}
    for wm in (0.0, 0.25):  # 0.25 of 20 blocks and vLLM's null block: 5 kept free
        sc = small_scenario("kv.num_blocks=20", "kv.block_size=16", f"scheduler.watermark={wm}")
        e = Engine(sc, workload=w)
        run_steps(e)
        admitted[wm] = e.get(1).admitted_time >= e.get(0).finish_time
    assert admitted == {0.0: False, 0.25: True}
    # alone, a request is admitted whatever the watermark
    e = Engine(small_scenario("kv.num_blocks=20", "kv.block_size=16", "scheduler.watermark=0.25"),
               workload=workload_of([(0.0, 300, 4)]))
    run_steps(e)
    assert e.get(0).state is RequestState.FINISHED


def test_sjf_shortest_first_until_aged():
    sc = small_scenario("scheduler.policy=\"sjf\"", "scheduler.max_num_seqs=1",
                        "scheduler.sjf_aging_s=1000")
    w = workload_of([(0.0, 50, 40), (0.001, 900, 5), (0.002, 30, 5), (0.003, 400, 5)])
    e = Engine(sc, workload=w)
    run_steps(e)
    assert admitted_order(e) == [0, 2, 3, 1]
    # with a short aging bound the long request, oldest in the queue, is no longer starved
    sc = small_scenario("scheduler.policy=\"sjf\"", "scheduler.max_num_seqs=1",
                        "scheduler.sjf_aging_s=0.05")
    e = Engine(sc, workload=w)
    run_steps(e)
    assert admitted_order(e)[1] == 1


def test_sjf_helps_the_typical_request_and_aging_bounds_the_wait():
    from sim import load_scenario

    runs = {}
    for p in ("sjf", "chunked"):
        # (the waits this bound was set for are the single roofline's)
        e = Engine(load_scenario("burst", [f"scheduler.policy=\"{p}\"", "workload.duration_s=100",
                                           "scheduler.sjf_aging_s=10", 'engine.preset="roofline"']))
        e.run()
        runs[p] = e
    s, f = summarize(runs["sjf"]), summarize(runs["chunked"])
    assert s["ttft_ms"]["p50"] < 0.6 * f["ttft_ms"]["p50"]  # bursts: short prompts first
    # nobody waits much past the 10 s bound (only behind requests that aged earlier)
    assert max(runs["sjf"].queue_waits) < 12 < max(runs["chunked"].queue_waits)


def test_lpm_prefers_the_request_with_the_longest_cached_prefix():
    sc = small_scenario("scheduler.policy=\"lpm\"", "kv.enable_prefix_caching=true",
                        "scheduler.max_num_seqs=1", "kv.block_size=16")
    e = Engine(sc, workload=workload_of([(0.0, 8, 1)]))
    e.run()
    e.inject(prompt_text=b"A" * 200, max_output_tokens=2)   # caches 12 blocks of "A"
    e.run()
    e.inject(prompt_text=b"B" * 120, max_output_tokens=40)  # busy while the others queue
    e.run_until(e.now + 1e-6)
    e.inject(prompt_text=b"C" * 200, max_output_tokens=2)
    e.inject(prompt_text=b"A" * 180 + b"Z" * 20, max_output_tokens=2)
    [c, a] = [r.req_id for r in e.policy.waiting]
    assert [r.req_id for r in e.policy.waiting_in_order()] == [a, c]
    e.run()
    assert e.get(a).admitted_time < e.get(c).admitted_time
    assert e.get(a).num_cached_tokens == 176  # 11 full blocks of "A"


def test_contiguous_reserves_prompt_plus_max_output_and_never_preempts():
    sc = small_scenario("scheduler.policy=\"contiguous\"", "kv.num_blocks=64", "kv.block_size=16",
                        "scheduler.reserve_output_tokens=256")
    w = workload_of([(0.0, 100, 20), (0.0, 50, 300), (0.01, 200, 30), (0.02, 40, 10)])
    e = Engine(sc, workload=w)
    seen = {}
    for s in run_steps(e):
        for r in e.policy.running:
            seen.setdefault(r.req_id, list(r.block_table))
    for rid, table in seen.items():
        r = e.get(rid)
        assert table == list(range(table[0], table[0] + len(table)))  # one contiguous run
        assert len(table) == -(-(r.prompt_len + max(r.max_output_tokens, 256)) // 16)
    assert e.counts["preemptions"] == 0
    s = summarize(e)
    assert s["kv"]["token_state_share"] < 0.6


def test_paged_token_state_share_wastes_at_most_partial_blocks():
    e = Engine(small_scenario())
    e.run()
    assert summarize(e)["kv"]["token_state_share"] > 0.95


def test_contiguous_shows_external_fragmentation():
    from sim import load_scenario

    stalls = {}
    for p in ("contiguous", "chunked"):
        e = Engine(load_scenario("fragmentation", [f"scheduler.policy=\"{p}\"",
                                                   "workload.duration_s=20"]))
        e.run()
        stalls[p] = summarize(e)["kv"]["fragmentation_stalls"]
    assert stalls["contiguous"] > 0 and stalls["chunked"] == 0


def test_priority_preempting_for_an_arrival_is_not_a_run_of_decode_steps():
    # Found by the deployment lockstep fuzzer: the arrival's prefill took the preempted
    # request's place in the batch, which still counted as decode-only, and the engine ran it
    # as a stretch of decode steps (and failed).
    # (vLLM V0's rule, preempting for a waiting request: V1, the default, never does)
    sc = small_scenario('scheduler.policy="priority"', "kv.num_blocks=20", "kv.block_size=16",
                        "scheduler.preempt_for_waiting=true")
    runs = []
    for skip in (True, False):
        e = Engine(sc, workload=workload_of([(0.0, 200, 100, 5)]), skip_ahead=skip)
        e.run_until(0.1)
        [urgent] = e.inject(150, 30, priority=-1)  # needs 10 blocks, 6 free
        e.run()
        check_invariants(e)
        assert e.counts["preemptions"] == 1 and e.get(urgent).state.value == "finished"
        runs.append([x.to_dict() for x in e.events if x.kind != "steps"])
    assert runs[0] == runs[1]


SINGLE = ["fcfs", "static", "contiguous", "chunked", "priority", "sjf", "lpm"]


def batch_sizes(events) -> list[int]:
    """The sequences each recorded step (or run of identical steps) computed."""
    return [len({c[0] for c in x.prefill} | set(x.decode)) for x in events if x.kind == "steps"]


@pytest.mark.parametrize("policy", SINGLE)
def test_parallel_samples_take_a_seat_each(policy):
    # Found by the invariant hunt: eight requests of two samples each under max_num_seqs = 4
    # ran eight sequences a step, every further sample forked into the batch past the limit.
    sc = small_scenario(f'scheduler.policy="{policy}"', "scheduler.max_num_seqs=4",
                        "workload.num_samples=2")
    e = Engine(sc, workload=workload_of([(0.0, 100, 10)] * 8))
    run_steps(e)
    s = summarize(e)
    assert max(batch_sizes(e.events)) == s["batch"]["max"] == 4
    # every sample still runs to the end: the ones that found no seat waited for one
    assert e.counts["finished"] == 8 and e.counts["finished_samples"] == 8
    assert s["output_tokens"] == 8 * 2 * 10


@pytest.mark.parametrize("policy", SINGLE)
def test_a_one_token_output_still_gives_every_sample(policy):
    """n samples of max_tokens = 1 are n tokens (vLLM: n requests): each further sample ends
    with its first token, as its parent does; they once never forked."""
    sc = small_scenario(f'scheduler.policy="{policy}"', "workload.num_samples=3")
    e = Engine(sc, workload=workload_of([(0.0, 10, 1), (0.0, 10, 2), (0.5, 30, 1)]))
    run_steps(e)
    s = summarize(e)
    assert e.counts["finished"] == 3 and e.counts["finished_samples"] == 6
    assert s["output_tokens"] == 3 * (1 + 2 + 1)
    assert e.kv.pool.num_free == e.kv.pool.num_blocks  # (the samples shared, then freed)


@pytest.mark.parametrize("policy", ["chunked", "priority", "lpm"])
def test_a_sample_without_a_seat_waits_ahead_of_later_arrivals(policy):
    """vLLM queues a request's n samples together when it arrives: one that found no seat
    waits ahead of requests that arrived after its request (it joined the back before).
    (Chunked prefills, so that the later arrival is queued before the first tokens; `sjf`
    puts the shorter later arrival first, as it should.)"""
    # (prompts of several chunks: the later arrival waits before its request's first token)
    sc = small_scenario(f'scheduler.policy="{policy}"', "scheduler.max_num_seqs=2",
                        "workload.num_samples=2", "scheduler.max_num_batched_tokens=64")
    e = Engine(sc, workload=workload_of([(0.0, 100, 30), (0.0, 100, 30), (0.001, 10, 30)]))
    while sum(r.parent_id is not None for r in e.requests.values()) < 2:
        e.step()
    assert [(r.parent_id, r.arrival_time) for r in e.policy.waiting_in_order()] == [
        (0, 0.0), (1, 0.0), (None, 0.001)]
    run_steps(e)
    assert e.counts["finished"] == 3 and e.counts["finished_samples"] == 3


def test_a_sample_that_waited_for_a_seat_adds_no_queue_wait():
    """A request's latencies are its first sample's: queue waits too, not one per sample
    that had to wait for a seat."""
    sc = small_scenario("workload.num_samples=2", "scheduler.max_num_seqs=2")
    e = Engine(sc, workload=workload_of([(0.0, 10, 5)] * 4))
    run_steps(e)
    s = summarize(e)
    assert e.counts["finished_samples"] == 4
    assert s["queue_ms"]["count"] == s["ttft_ms"]["count"] == s["requests"]["finished"] == 4


@pytest.mark.fuzz
@fuzz_settings(30)
@given(policy=st.sampled_from([*SINGLE, "disaggregated", "replicas"]),
       seats=st.integers(1, 6), samples=st.integers(1, 4), seed=st.integers(0, 2**16),
       async_scheduling=st.booleans(), caching=st.booleans(),
       budget=st.sampled_from([64, 256, 2048]))
def test_no_step_runs_more_than_max_num_seqs_sequences(policy, seats, samples, seed,
                                                       async_scheduling, caching, budget):
    deployment = policy in ("disaggregated", "replicas")
    over = [f"scheduler.max_num_seqs={seats}", f"seed={seed}",
            f"scheduler.async_scheduling={str(async_scheduling).lower()}",
            f"kv.enable_prefix_caching={str(caching).lower()}",
            f"scheduler.max_num_batched_tokens={budget}", "kv.num_blocks=120",
            "kv.block_size=8", "workload.rate=30", "workload.duration_s=0",
            "workload.num_requests=30", "workload.cancel_fraction=0.2",
            "workload.cancel_after_s=0.1", "workload.shared_prefix_tokens=24",
            'workload.prompt_tokens={dist="uniform", min=1, max=60}',
            'workload.output_tokens={dist="uniform", min=1, max=40}',
            "cluster.replicas=2" if policy == "replicas" else
            f'scheduler.policy="{"chunked" if deployment else policy}"']
    if policy == "disaggregated":
        over.append('scheduler.policy="disaggregated"')
    if not deployment:  # (parallel sampling is for a single engine)
        over.append(f"workload.num_samples={samples}")
    e = build(small_scenario(*over))
    engines = e.instances if deployment else [e]
    for _ in range(20000):
        if e.done:
            break
        e.step()
        if deployment:
            check_cluster_invariants(e)
        else:
            check_invariants(e)
    assert e.done
    for x in engines:
        assert max(batch_sizes(x.events), default=0) <= seats
        assert summarize(x)["batch"]["max"] <= seats


# --- each rule has one definition: changing it changes every policy that applies it --------------
def _results(e) -> dict:
    """What a run produced, less what does not depend on the schedule (wall time, names)."""
    s = summarize(e)
    return {k: v for k, v in s.items() if k not in ("wall_s", "policy")}


def _summary(policy, *overrides):
    sc = small_scenario(f"scheduler.policy=\"{policy}\"", "kv.num_blocks=420", *overrides)
    e = Engine(sc)
    e.run()
    return e, _results(e)


WATERMARKED = ["fcfs", "chunked", "priority", "sjf", "lpm"]
BASE_VICTIM = ["static", "fcfs", "chunked", "sjf", "lpm"]  # (priority picks its own)


@pytest.mark.parametrize("policy", WATERMARKED)
def test_a_changed_watermark_rule_changes_every_policy_that_keeps_one(policy, monkeypatch):
    from sim.policies.base import Policy

    _, before = _summary(policy)
    monkeypatch.setattr(Policy, "watermark_blocks", lambda self: self.kv.num_blocks // 2)
    e, after = _summary(policy)
    assert after != before
    # Half the pool kept free while anything runs: never more than half is used by admissions
    # beside others, so the batch is smaller than before.
    assert after["batch"]["mean"] < before["batch"]["mean"]
    check_invariants(e)


@pytest.mark.parametrize("policy", BASE_VICTIM)
def test_a_changed_victim_rule_changes_every_policy_that_preempts_the_base_way(policy,
                                                                              monkeypatch):
    from sim.policies.base import Policy

    e, before = _summary(policy)
    assert e.counts["preemptions"] > 0
    victims = []

    def oldest(self):
        victims.append(self.running[0])
        return self.running[0]

    monkeypatch.setattr(Policy, "pick_victim", oldest)
    e, after = _summary(policy)
    assert victims and after != before
    check_invariants(e)


def test_a_subclass_that_changes_one_rule_runs_with_it(monkeypatch):
    """A policy subclass registered under a new name is scheduled by its own rules: a
    watermark of half the pool changes what `chunked` does, and only that."""
    from sim.policies import POLICIES, ChunkedPolicy

    class HalfFree(ChunkedPolicy):
        name = "half-free"

        def watermark_blocks(self):
            return self.kv.num_blocks // 2

    monkeypatch.setitem(POLICIES, "half-free", HalfFree)
    sc = small_scenario("kv.num_blocks=420")
    plain, half = Engine(sc), Engine(sc, policy="half-free")
    plain.run()
    half.run()
    assert half.policy.name == "half-free" and half.step_count != plain.step_count
    assert _results(half) != _results(plain)
    # with the same watermark as chunked's, the subclass schedules exactly as chunked does
    monkeypatch.setattr(HalfFree, "watermark_blocks", ChunkedPolicy.watermark_blocks)
    same = Engine(sc, policy="half-free")
    same.run()
    assert _results(same) == _results(plain)


_EDITS = {
    "watermark": ("        return int(self.cfg.watermark * (self.kv.num_blocks + (1 if self.models_v1 "
                  "else 0)))\n", "        return self.kv.num_blocks // 2\n"),
    "victim": ('        """The running request to preempt when blocks run short: the most recently '
               'admitted."""\n        return self.running[-1]\n',
               '        """(edited)"""\n        return self.running[0]\n'),
}
_RUN = """
import json, sys
from tests.helpers import small_scenario
from sim import Engine, summarize
out = {}
for policy in sys.argv[1].split(","):
    e = Engine(small_scenario(f'scheduler.policy="{policy}"', "kv.num_blocks=420"))
    e.run()
    out[policy] = [e.step_count, e.counts["preemptions"], summarize(e)["duration_s"]]
print(json.dumps(out))
"""


@pytest.mark.parametrize("rule,policies", [("watermark", WATERMARKED), ("victim", BASE_VICTIM)])
def test_an_edit_of_a_rule_in_the_policies_source_takes_effect(rule, policies, tmp_path):
    """As a contributor would: edit one rule in `sim/policies/base.py` and run again, without
    reinstalling (where the install compiled the policies, the edited source no longer matches
    the build, so the whole engine runs from its sources). Every policy that applies the rule
    moves."""
    import json
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    for name in ("sim", "tests", "scenarios"):
        shutil.copytree(root / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.msgpack"))
    (tmp_path / "gpu").mkdir()  # (not imported by the engine)

    def run(cwd):
        got = subprocess.run([sys.executable, "-c", _RUN, ",".join(policies)], cwd=cwd,
                             capture_output=True, text=True, check=True,
                             env={**__import__("os").environ, "PYTHONPATH": str(cwd)})
        return json.loads(got.stdout)

    before = run(tmp_path)
    base = tmp_path / "sim" / "policies" / "base.py"
    old, new = _EDITS[rule]
    text = base.read_text()
    assert text.count(old) == 1
    base.write_text(text.replace(old, new))
    after = run(tmp_path)
    for policy in policies:
        assert after[policy] != before[policy], (rule, policy)


# --- admission to completion (TensorRT-LLM's GUARANTEED_NO_EVICT) -----------------------------
NO_EVICT = ["static", "fcfs", "chunked", "priority", "sjf", "lpm"]


@pytest.mark.parametrize("policy", NO_EVICT)
def test_guaranteed_no_evict_keeps_every_running_request_able_to_finish(policy):
    """With `engine.guaranteed_no_evict` the blocks the running requests will hold at their
    last tokens fit in the pool at every step, so nothing is preempted where the same
    workload without it preempts; every request still finishes."""
    over = (f"scheduler.policy=\"{policy}\"", "kv.num_blocks=300", "workload.duration_s=6")
    plain = Engine(small_scenario(*over))
    plain.run()
    assert plain.counts["preemptions"] > 0
    e = Engine(small_scenario(*over, "engine.guaranteed_no_evict=true"))
    bs, peak = e.kv.block_size, 0
    while not e.done:
        e.step()
        check_invariants(e)
        held = sum(blocks_at_end(r, bs) for r in e.policy.running)
        assert held <= e.kv.num_blocks
        peak = max(peak, held)
    assert e.counts["preemptions"] == 0 and peak > 0.9 * e.kv.num_blocks
    assert e.counts["finished"] + e.counts["rejected"] == e.counts["arrived"] > 20


@pytest.mark.parametrize("policy", ["fcfs", "chunked"])
def test_guaranteed_no_evict_holds_the_queue_behind_a_request_that_does_not_fit(policy):
    """Two requests that will hold 12 blocks each at their ends fill 26 blocks but for 2; the
    third waits for one of them to finish, and the small fourth, which would fit, waits
    behind it (first come, first served). Without the rule the third is admitted at once and
    someone is preempted."""
    w = [(0.0, 100, 92), (0.0, 100, 92), (0.001, 100, 92), (0.002, 16, 3)]
    base = (f"scheduler.policy=\"{policy}\"", "kv.num_blocks=26", "kv.block_size=16",
            "scheduler.watermark=0")
    plain = Engine(small_scenario(*base), workload=workload_of(w))
    plain.run()
    assert plain.counts["preemptions"] > 0
    e = Engine(small_scenario(*base, "engine.guaranteed_no_evict=true"), workload=workload_of(w))
    run_steps(e)
    assert e.counts["preemptions"] == 0
    first_end = min(e.get(0).finish_time, e.get(1).finish_time)
    assert e.get(2).admitted_time >= first_end
    assert e.get(3).admitted_time >= e.get(2).admitted_time
    # admitted when the room appeared: at the scheduling that follows the finish
    assert e.get(2).admitted_time == first_end


def test_tensorrt_llm_profiles_reserve_to_completion_and_the_others_do_not():
    from sim.inputs.scenario import load_scenario
    from sim.model.presets import ENGINE_PRESETS

    reserving = {n for n in ENGINE_PRESETS
                 if load_scenario("chat", [f'engine.preset="{n}"']).engine.guaranteed_no_evict}
    assert reserving == {n for n in ENGINE_PRESETS if n.startswith("tensorrt-llm") or n == "nim"}


def test_guaranteed_no_evict_counts_every_token_but_the_last():
    """Two requests whose ends need 13 blocks each (100 + 94 - 1 = 193 tokens) do not run
    together in 25 blocks; two whose ends need 12 (192 tokens) do in 24."""
    for out, pool, together in ((94, 25, False), (93, 24, True)):
        e = Engine(small_scenario("kv.num_blocks=%d" % pool, "kv.block_size=16",
                                  "scheduler.watermark=0", "engine.guaranteed_no_evict=true"),
                   workload=workload_of([(0.0, 100, out), (0.0, 100, out)]))
        run_steps(e)
        assert (e.get(1).admitted_time < e.get(0).finish_time) is together
        assert e.counts["preemptions"] == 0


def test_guaranteed_no_evict_makes_no_room_for_a_higher_priority_request():
    """`priority` with `preempt_for_waiting` preempts a lower-priority request for a waiting
    one; under `engine.guaranteed_no_evict` nothing is preempted and the waiting one waits."""
    # (the two hold 44 of the 52 blocks when the third arrives, and will hold 50 at their ends)
    rows = [(0.0, 100, 300, 5), (0.0, 100, 300, 5), (1.5, 200, 20, 0)]
    base = ('scheduler.policy="priority"', "scheduler.preempt_for_waiting=true",
            "kv.num_blocks=52", "kv.block_size=16")
    plain = Engine(small_scenario(*base), workload=workload_of(rows))
    run_steps(plain)
    assert plain.counts["preemptions"] > 0
    e = Engine(small_scenario(*base, "engine.guaranteed_no_evict=true"), workload=workload_of(rows))
    run_steps(e)
    assert e.counts["preemptions"] == 0
    assert e.get(2).admitted_time == min(e.get(0).finish_time, e.get(1).finish_time)


@pytest.mark.parametrize("policy", ["fcfs", "chunked", "priority"])
def test_guaranteed_no_evict_starts_a_parallel_sample_only_if_it_fits_to_its_end(policy):
    """A request's further samples take blocks of their own as they decode: each starts beside
    the running ones only if it fits to its last token, else it waits in the queue."""
    over = (f"scheduler.policy=\"{policy}\"", "kv.num_blocks=300", "workload.duration_s=6",
            "workload.num_samples=4")
    plain = Engine(small_scenario(*over))
    plain.run()
    assert plain.counts["preemptions"] > 0
    e = Engine(small_scenario(*over, "engine.guaranteed_no_evict=true"))
    bs = e.kv.block_size
    while not e.done:
        e.step()
        check_invariants(e)
        assert sum(blocks_at_end(r, bs) for r in e.policy.running) <= e.kv.num_blocks
    assert e.counts["preemptions"] == 0
    assert e.counts["finished"] + e.counts["rejected"] == e.counts["arrived"]
