"""Each policy's ordering rule, observed through the engine's event stream."""

import numpy as np

from sim import Engine
from tests.helpers import check_invariants, small_scenario, workload_of


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
        assert e.counts["finished"] + e.counts["rejected"] == e.counts["arrived"] > 10
        assert e.kv.num_used_blocks == 0
        assert np.all(np.diff(e.timeline.column("end")) > 0)
