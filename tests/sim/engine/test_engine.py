import numpy as np
import pytest

from sim import Engine, summarize
from sim.engine.engine import StepObserver
from sim.errors import EngineError, UnknownRequestError
from sim.policies import POLICIES
from sim.session.log import encode
from sim.engine.request import RequestState as S
from tests.helpers import (assert_freed_by_reference_counting, check_invariants, expand_steps,
                           run_with_and_without_history, small_scenario, workload_of)


SHARED = ("kv.enable_prefix_caching=true", "workload.shared_prefix_tokens=300",
          "workload.shared_prefix_groups=3")
OLDER = ("scheduler.async_scheduling=false", "scheduler.reserve_full_sequence=false",
         "kv.register_at_allocation=false", "kv.free_uncached_first=false",
         "kv.duplicate_cached_blocks=false")


@pytest.mark.parametrize("policy,extra", [
    ("static", ()), ("fcfs", ()), ("chunked", ()),
    # vLLM V1's behaviours (the defaults: async scheduling among them) with prefix caching,
    # then each older behaviour
    ("chunked", SHARED), ("chunked", SHARED + ("scheduler.watermark=0.02",)),
    ("chunked", SHARED + OLDER), ("chunked", ("scheduler.async_scheduling=false",)),
    ("priority", SHARED + ("workload.priority={dist=\"choice\", values=[0, 1, 2]}",)),
])
def test_skip_ahead_equals_step_by_step(policy, extra):
    sc = small_scenario(f"scheduler.policy=\"{policy}\"", "kv.num_blocks=600",
                        "workload.cancel_fraction=0.1", "workload.duration_s=15", *extra)
    fast, slow = Engine(sc), Engine(sc, skip_ahead=False)
    for t in np.arange(0.5, 30.0, 0.5):  # the block pools agree whenever both stop
        fast.run_until(t)
        slow.run_until(t)
        if fast.step_count == slow.step_count:
            assert fast.kv.pool.free_block_ids() == slow.kv.pool.free_block_ids()
            assert fast.kv.pool.block_hash == slow.kv.pool.block_hash
    fast.run()
    slow.run()
    assert fast.counts == slow.counts and fast.counts["preemptions"] > 0
    assert expand_steps(fast) == expand_steps(slow)
    for col in ("end", "kv_used", "itl_count", "energy", "batch"):
        assert np.array_equal(fast.timeline.column(col), slow.timeline.column(col)), col
    for rid, r in fast.requests.items():
        assert np.array_equal(r.token_times(), slow.requests[rid].token_times())
    a, b = summarize(fast), summarize(slow)
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b
    # the event streams are identical, not just equivalent: runs of steps are one event
    assert [encode(x) for x in fast.events] == [encode(x) for x in slow.events]
    assert fast.timeline.n > sum(1 for x in fast.events if x.kind == "steps")


def test_multi_step_windows_step_by_step_equal_skip_ahead():
    sc = small_scenario('engine.preset="vllm-0.6-multistep"', 'scheduler.policy="fcfs"',
                        "kv.num_blocks=600", "workload.cancel_fraction=0.1")
    assert sc.engine.num_scheduler_steps == 10
    fast, slow = Engine(sc), Engine(sc, skip_ahead=False)
    fast.run()
    slow.run()
    assert fast.counts == slow.counts
    assert expand_steps(fast) == expand_steps(slow)
    assert np.array_equal(fast.timeline.column("end"), slow.timeline.column("end"))
    assert [encode(x) for x in fast.events] == [encode(x) for x in slow.events]


def test_multi_step_arrivals_wait_for_the_window():
    # one long request decoding; a second arrives while it does
    rows = [(0.0, 100, 200), (0.05, 100, 5)]
    prefill_step = {}
    for k in (1, 10):
        sc = small_scenario('scheduler.policy="fcfs"', f"engine.num_scheduler_steps={k}")
        e = Engine(sc, workload=workload_of(rows))
        e.run()
        ends = e.timeline.column("end")
        g = int(np.searchsorted(ends, e.requests[1].prefill_chunks[0][0]))
        assert ends[g - 1] >= 0.05  # it could not start before the request arrived
        prefill_step[k] = g
    # step 0 prefilled the first request; its decode windows are steps 1-10, 11-20, ...
    assert (prefill_step[10] - 1) % 10 == 0
    # one step at a time, the second request goes at the first step boundary after it arrives
    assert prefill_step[1] <= prefill_step[10]


def test_invariants_hold_after_every_step_under_memory_pressure():
    sc = small_scenario("kv.num_blocks=300", "workload.cancel_fraction=0.2",
                        "workload.cancel_after_s={dist=\"uniform\", min=0, max=3}")
    e = Engine(sc)
    n = 0
    while not e.done:
        e.step()
        check_invariants(e)
        n += 1
    assert n > 100 and e.counts["preemptions"] > 0 and e.counts["cancelled"] > 0
    assert e.kv.num_free_blocks == e.kv.num_blocks


def test_tokens_are_counted_once_per_request():
    sc = small_scenario("kv.num_blocks=300")
    e = Engine(sc)
    e.run()
    for r in e.requests.values():
        if r.state is S.FINISHED:
            assert r.num_output_tokens == r.max_output_tokens
            assert len(r.token_times()) == r.max_output_tokens
            assert r.token_times()[0] == r.first_token_time
            assert r.token_times()[-1] == r.last_token_time == r.finish_time
            assert np.all(np.diff(r.token_times()) > 0)
    assert e.counts["output_tokens"] == sum(r.num_output_tokens for r in e.requests.values())


def test_cancel_in_every_state_frees_exactly_its_blocks():
    sc = small_scenario("kv.num_blocks=40", "kv.block_size=16",
                        "scheduler.max_num_batched_tokens=64")
    w = workload_of([(0.0, 200, 100), (0.0, 150, 300), (0.0, 300, 300), (0.0, 30, 500)])
    e = Engine(sc, workload=w)
    seen = set()
    for _ in range(5000):
        if e.done:
            break
        e.step()
        check_invariants(e)
        for r in e.requests.values():
            key = (r.state, r.is_prefill if r.state is S.RUNNING else None)
            if r.state.is_done or key in seen:
                continue
            seen.add(key)
            held = list(r.block_table)
            used = e.kv.num_used_blocks
            e.cancel(r.req_id)
            assert r.state is S.CANCELLED and r.block_table == []
            assert e.kv.num_used_blocks == used - len(held)
            assert all(e.kv.pool.ref_cnt[b] == 0 for b in held)
            check_invariants(e)
            break
    states = {k[0] for k in seen}
    assert {S.WAITING, S.RUNNING} <= states
    assert (S.RUNNING, True) in seen  # mid-prefill chunk


def test_cancel_errors_are_clear():
    e = Engine(small_scenario())
    with pytest.raises(UnknownRequestError, match="no request with id 999999"):
        e.cancel(999999)
    e.run_until(1.0)
    rid = next(iter(e.requests))
    e.run()
    with pytest.raises(EngineError, match="already finished"):
        e.cancel(rid)


def test_a_request_that_ended_lately_is_named_so_without_history():
    # (the dashboard's engine keeps no history: a request picked from its recent table has
    # been forgotten, and a cancel of it says what happened to it)
    e = Engine(small_scenario(), keep_history=False)
    e.run_until(3.0)
    ended = e.recent[-1]
    assert ended.req_id not in e.requests
    with pytest.raises(EngineError, match=f"request {ended.req_id} is already finished"):
        e.cancel(ended.req_id)
    with pytest.raises(UnknownRequestError, match="no request with id 999999"):
        e.cancel(999999)


def test_cancel_waiting_takes_a_requests_samples_with_it_without_history():
    # A preempted request waits ahead of its own waiting samples: cancelling it cancels them,
    # and a run that keeps no history forgets them at once.
    sc = small_scenario("workload.num_samples=3", "kv.num_blocks=400", "workload.duration_s=10")
    e = Engine(sc, keep_history=False)
    while True:
        e.step()
        order = {r.req_id: k for k, r in enumerate(e.policy.waiting_in_order())}
        if any(r.parent_id in order and order[r.parent_id] < order[r.req_id]
               for r in e.policy.waiting_in_order()):
            break
    ids = e.cancel_waiting()
    assert not e.policy.waiting and all(i not in e.requests for i in ids)
    assert all(r.state is S.CANCELLED for r in e.recent if r.req_id in ids)
    check_invariants(e)


def test_inject_arrives_now_and_is_recorded():
    e = Engine(small_scenario())
    e.run_until(2.0)
    ids = e.inject(64, 8, priority=1, count=3)
    assert len(ids) == 3 and all(e.get(i).arrival_time == e.now for i in ids)
    assert all(e.get(i).state is S.WAITING for i in ids)
    acts = [x for x in e.events if x.kind == "action"]
    assert acts[-1].action == "inject" and acts[-1].args["count"] == 3
    e.run()
    assert all(e.get(i).state is S.FINISHED for i in ids)
    with pytest.raises(EngineError, match="prompt_len = 0"):
        e.inject(0, 5)


def test_inject_with_an_earlier_arrival_time_joins_now_and_replays_exactly(tmp_path):
    """A request that arrived during a step (an HTTP arrival) joins at the step boundary, its
    latencies timed from its arrival; the log replays it exactly."""
    from sim.session.log import read_log, write_log
    from sim.session.replay import verify

    e = Engine(small_scenario())
    e.run_until(1.0)
    arrived = e.now - 0.004
    [rid] = e.inject(64, 4, arrival_time=arrived, tag="10.0.0.1:5000")
    r = e.get(rid)
    assert r.arrival_time == arrived and r.tag == "10.0.0.1:5000"
    [view] = [v for v in e.snapshot().waiting if v.req_id == rid]
    assert view.tag == "10.0.0.1:5000"
    arrival = [x for x in e.events if x.kind == "arrival" and x.req_id == rid][0]
    assert arrival.t == arrived
    e.run_until(3.0)
    assert r.admitted_time >= e.get(rid).arrival_time + 0.004 - 1e-12
    assert r.ttft == r.first_token_time - arrived
    with pytest.raises(EngineError, match="arrival_time"):
        e.inject(64, 4, arrival_time=e.now + 1.0)
    _, divergence = verify(read_log(write_log(tmp_path / "s.msgpack", e)))
    assert divergence is None


def test_requests_that_can_never_fit_are_rejected():
    sc = small_scenario("kv.num_blocks=10", "kv.block_size=16")
    w = workload_of([(0.0, 100, 10), (0.0, 200, 10)])
    e = Engine(sc, workload=w)
    e.run()
    assert e.get(1).state is S.REJECTED and "needs 14 blocks" in e.get(1).reject_reason
    assert e.get(0).state is S.FINISHED


def test_client_cancellation_after_its_delay():
    w = workload_of([(0.0, 100, 100000 // 100, 0, 0.5)])
    e = Engine(small_scenario(), workload=w)
    e.run()
    r = e.get(0)
    assert r.state is S.CANCELLED and r.cancelled_in is S.RUNNING
    assert 0.5 <= r.finish_time < 0.6
    assert e.kv.num_used_blocks == 0


def test_policy_switch_mid_run_keeps_every_request():
    sc = small_scenario("kv.num_blocks=500")
    e = Engine(sc)
    e.run_until(3.0)
    e.switch_policy("fcfs")
    e.run_until(6.0)
    e.switch_policy("static")
    e.run()
    check_invariants(e)
    assert e.counts["finished"] + e.counts["cancelled"] + e.counts["rejected"] == e.counts["arrived"]
    with pytest.raises(EngineError, match="unknown policy"):
        e.switch_policy("nope")


def test_snapshot_is_a_copy_of_state():
    e = Engine(small_scenario("kv.num_blocks=500"))
    e.run_until(5.0)
    snap = e.snapshot()
    assert snap.now == e.now and snap.used_blocks == e.kv.num_used_blocks
    owned = {int(b) for b in np.flatnonzero(snap.block_owner >= 0)}
    assert owned == {b for r in e.policy.running for b in r.block_table}
    assert [v.req_id for v in snap.running] == [r.req_id for r in e.policy.running]
    e.run_until(6.0)
    assert snap.now != e.now  # not a live view


def test_hand_timeline_through_the_engine():
    """Arrival 0 ms, admission 30 ms, first token 80 ms, 100 later gaps of 5 ms."""
    sc = small_scenario("scheduler.max_num_seqs=1")
    w = workload_of([(0.0, 10, 1), (0.0, 10, 101)])
    e = Engine(sc, workload=w)
    e.duration_override = iter([0.030, 0.050] + [0.005] * 100)
    e.run()
    r = e.get(1)
    assert r.queue_wait == pytest.approx(0.030)
    assert r.ttft == pytest.approx(0.080)
    assert r.last_token_time == pytest.approx(0.580)
    assert r.tpot == pytest.approx(0.005)
    s = summarize(e)
    assert s["itl_ms"]["count"] == 100 and s["itl_ms"]["p50"] == pytest.approx(5.0)
    assert s["queue_ms"]["max"] == pytest.approx(30.0)
    assert s["e2e_ms"]["max"] == pytest.approx(580.0)
    assert s["ttft_ms"]["max"] == pytest.approx(80.0)


# --- async scheduling: a finished request's blocks and seat come back one step late -----------
def _admit_step(e, rid):
    """The index of the step in which request `rid` was first scheduled."""
    for x in e.events:
        if x.kind == "steps" and any(c[0] == rid for c in x.prefill):
            return x.step
    raise AssertionError(rid)


def _lag_workload(cancel_a=np.nan):
    # 0 holds 7 of 12 blocks and finishes after 5 tokens; 1 decodes all along; 2 (7 blocks)
    # fits only once 0's blocks are back
    return workload_of([(0.0, 100, 5, 0, cancel_a), (0.0, 20, 40), (0.001, 100, 5)])


@pytest.mark.parametrize("skip_ahead", [True, False])
def test_async_scheduling_frees_a_finished_request_after_the_next_step(skip_ahead):
    steps = {}
    for mode in ("true", "false"):
        sc = small_scenario("kv.num_blocks=12", "kv.block_size=16",
                            f"scheduler.async_scheduling={mode}")
        e = Engine(sc, workload=_lag_workload(), skip_ahead=skip_ahead)
        e.step()
        while e.get(0).state is not S.FINISHED:
            e.step()
        a = e.get(0)
        if mode == "true":  # finished, its blocks and seat held until the next step is scheduled
            assert a.block_table and a in e.policy.running
            check_invariants(e)
            e.step()
            assert not a.block_table and a not in e.policy.running
        else:
            assert not a.block_table and a not in e.policy.running
        e.run()
        finished_at = next(x.step + list(x.ends).index(a.finish_time) for x in e.events
                           if x.kind == "steps" and a.finish_time in x.ends)
        steps[mode] = _admit_step(e, 2) - finished_at
    assert steps == {"false": 1, "true": 2}


def test_a_client_abort_frees_a_finished_request_at_once():
    sc = small_scenario("kv.num_blocks=12", "kv.block_size=16")
    e = Engine(sc, workload=_lag_workload())
    e.run()
    t_fin, late = e.get(0).finish_time, _admit_step(e, 2)
    # the client goes away as the last token is computed: the blocks come back a step earlier,
    # and the request, whose tokens are all computed, stays finished
    e = Engine(sc, workload=_lag_workload(cancel_a=t_fin))
    e.run()
    assert e.get(0).state is S.FINISHED and e.counts["cancelled"] == 0
    assert _admit_step(e, 2) == late - 1


def test_skip_ahead_beside_finishing_requests_equals_step_by_step():
    """Under async scheduling a run of decode steps may start while requests that finished in
    the step before still hold their blocks: it gives them back after its first step."""
    class Beside(StepObserver):
        """Counts the decode runs that start while requests finished in the step before
        still hold their blocks (left in `_releasing` when that step ended)."""

        def __init__(self):
            self.holding = False
            self.count = 0

        def stepped(self, engine, sched):
            self.holding = bool(engine._releasing)

        def decoded(self, engine, reqs, steps):
            self.count += self.holding
            self.holding = bool(engine._releasing)

    sc = small_scenario("workload.rate=2", "workload.duration_s=40", *SHARED)
    beside = Beside()
    fast, slow = Engine(sc, observers=[beside]), Engine(sc, skip_ahead=False)
    fast.run()
    slow.run()
    assert beside.count > 10
    assert expand_steps(fast) == expand_steps(slow)
    for col in ("end", "kv_used", "kv_empty", "itl_count", "batch"):
        assert np.array_equal(fast.timeline.column(col), slow.timeline.column(col)), col
    assert fast.kv.pool.free_block_ids() == slow.kv.pool.free_block_ids()
    assert fast.kv.pool.block_hash == slow.kv.pool.block_hash


@pytest.mark.parametrize("overrides", [
    (),
    ("workload.num_samples=3", "workload.duration_s=10"),
    ("workload.cancel_fraction=0.3", "kv.num_blocks=400", "scheduler.preemption=\"swap\""),
])
def test_a_run_without_history_has_the_same_summary_in_bounded_memory(monkeypatch, overrides):
    # (a rolling window of a few seconds: the rows of the last ROLLING_S seconds are held)
    monkeypatch.setattr(Engine, "ROLLING_S", 2.0)
    full, bounded, a, b = run_with_and_without_history(
        monkeypatch, small_scenario(*overrides), chunk=256, itl_rows=1000, exact=20)
    assert a == b
    assert not bounded.ttft.exact and not bounded.timeline.itl.exact
    assert [encode(x) for x in full.events] == [encode(x) for x in bounded.events]
    assert bounded.requests == {} and len(bounded.recent) == Engine.RECENT
    assert len(full.requests) == full.counts["arrived"] + full.counts["finished_samples"] \
        + full.counts["cancelled_samples"]
    assert bounded.timeline.first >= bounded.timeline.n // 2  # only the last rows are held
    with pytest.raises(EngineError):
        bounded.timeline.column("end")


def test_percentiles_past_the_exact_limit_are_within_the_bound(monkeypatch):
    from sim.stats import quantiles
    from sim.engine import timeline
    sc = small_scenario()
    exact = Engine(sc)
    exact.run()
    monkeypatch.setattr(timeline, "ITL_EXACT_ROWS", 500)
    monkeypatch.setattr(quantiles, "EXACT_LIMIT", 50)
    sketched = Engine(sc)
    sketched.run()
    a, b = summarize(exact), summarize(sketched)
    for fig in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "queue_ms"):
        assert a[fig]["count"] == b[fig]["count"] and a[fig]["max"] == b[fig]["max"], fig
        assert b[fig]["mean"] == pytest.approx(a[fig]["mean"], rel=1e-9), fig
        for q in ("p50", "p90", "p95", "p99"):
            assert abs(b[fig][q] - a[fig][q]) <= quantiles.ALPHA * a[fig][q] * (1 + 1e-9), fig
    assert a["throughput"] == b["throughput"] and a["kv"] == b["kv"]


def test_arrivals_read_a_window_at_a_time_give_the_same_run(monkeypatch):
    sc = small_scenario("workload.cancel_fraction=0.2")
    whole = Engine(sc)
    whole.run()
    monkeypatch.setattr(Engine, "ARRIVAL_WINDOW", 3)
    windowed = Engine(sc)
    assert len(windowed._w_arrival) == 3
    windowed.run()
    a, b = summarize(whole), summarize(windowed)
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b and a["requests"]["total"] > 50
    assert [encode(x) for x in whole.events] == [encode(x) for x in windowed.events]


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("keep_history", [True, False])
def test_a_dropped_engine_is_freed_by_reference_counting_alone(policy, keep_history):
    def make():
        engine = Engine(small_scenario(f"scheduler.policy=\"{policy}\"", "workload.duration_s=5"),
                        keep_history=keep_history)
        engine.run()
        assert engine.counts["finished"] > 0
        return engine

    assert_freed_by_reference_counting(make)
