"""Closed-loop users (`workload.concurrency`) and multi-turn conversations (`workload.turns`)."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from sim import Engine, load_scenario
from sim.errors import ServesimError
from sim.engine.request import RequestState
from tests.fuzz import fuzz_settings
from tests.helpers import NO_FRONTEND, check_invariants


def closed(*o):
    # (no API server in front: a user's request reaches the engine as it is sent; behind one,
    # tests/sim/engine/test_frontend.py)
    return load_scenario("chat", ["workload.concurrency=6", "workload.num_requests=120",
                                  "kv.num_blocks=3000", *NO_FRONTEND, *o])


def ended(engine):
    return sorted((r for r in engine.requests.values()), key=lambda r: r.req_id)


def in_flight_max(reqs) -> int:
    """The most requests between their arrival and their end at any time ([arrival, end))."""
    marks = sorted([(r.arrival_time, 1) for r in reqs] + [(r.finish_time, -1) for r in reqs])
    most = now = 0
    for _, d in marks:  # (an end and an arrival at one time: the end first)
        now += d
        most = max(most, now)
    return most


@pytest.mark.parametrize("think", [0.0, 0.75])
def test_never_more_than_n_in_flight_and_each_next_arrival_is_an_end_plus_think(think):
    e = Engine(closed(f"workload.think_time_s={think}", "workload.cancel_fraction=0.2",
                      "workload.cancel_after_s=2.0"))
    e.run()
    reqs = ended(e)
    assert len(reqs) == 120 and all(r.state.is_done for r in reqs)
    assert {r.state for r in reqs} >= {RequestState.FINISHED, RequestState.CANCELLED}
    assert in_flight_max(reqs) == 6
    # the first 6 start at 0, one after another as a client sends them; every later one is
    # the end of an earlier one plus the think time and the client's turnaround (0.1 ms)
    assert [r.arrival_time for r in reqs[:6]] == pytest.approx([u * 1e-4 for u in range(6)])
    ends = sorted(r.finish_time for r in reqs)[:120 - 6]
    assert sorted(r.arrival_time for r in reqs[6:]) == [t + (think + 1e-4) for t in ends]
    # request ids are rows in arrival order
    assert [r.arrival_time for r in reqs] == sorted(r.arrival_time for r in reqs)


def test_users_started_together_reach_an_idle_engine_one_after_another():
    """The client sends its users' first requests one at a time: the idle engine starts a
    step on the first, the others join the next. With fixed lengths they would otherwise stay
    one batch, all prompts prefilled together, for the whole run."""
    base = ("workload.prompt_tokens=500", "workload.output_tokens=100",
            "workload.num_requests=30", "workload.concurrency=5",
            "scheduler.max_num_batched_tokens=8192")
    e = Engine(closed(*base), skip_ahead=False)
    e.step()
    e.step()
    first, second = [ev for ev in e.events if ev.kind == "steps"][:2]
    assert [c[0] for c in first.prefill] == [0]
    assert sorted(c[0] for c in second.prefill) == [1, 2, 3, 4]
    e.run()
    # the two groups keep apart: no later step prefills five prompts
    assert max(len(ev.prefill) for ev in e.events if ev.kind == "steps") == 4
    # sent in the same instant (start_gap_s = 0), the five are one batch throughout
    e = Engine(closed(*base, "workload.start_gap_s=0"))
    e.run()
    prefills = [len(ev.prefill) for ev in e.events if ev.kind == "steps" and ev.prefill]
    assert prefills == [5] * 6


def test_a_request_sent_on_the_last_token_of_another_misses_the_step_that_follows_it():
    """A busy engine starts its next step as the last one ends; a user's next request, sent
    when the end of its last response reached it, arrives during that step and waits for it
    (the client turns round in `turnaround_s`). With none it would join that very step."""
    base = ("workload.prompt_tokens=200", "workload.output_tokens=40",
            "workload.num_requests=6", "workload.concurrency=2")
    for turnaround, waits in ((1e-4, True), (0.0, False)):
        e = Engine(closed(*base, f"workload.turnaround_s={turnaround}"))
        e.run()
        steps = [ev for ev in e.events if ev.kind == "steps"]
        starts = sorted(t for s in steps for t in (s.t, *s.ends[:-1]))  # every step's
        for r in ended(e)[2:]:  # the users' later requests
            before = max(t for t in starts if t <= r.arrival_time)
            first = min(s.t for s in steps if any(c[0] == r.req_id for c in s.prefill))
            # an arrival on a step's start is in it; one inside it waits for the next
            assert bool(first > r.arrival_time) is waits
            assert bool(before < r.arrival_time) is waits
        assert in_flight_max(ended(e)) == 2


def test_a_log_written_before_start_gap_s_loads_with_the_users_started_at_once():
    """A session log's workload table holds every key; one without `start_gap_s` was written
    when the users' first requests left together, and replays so. A scenario file leaving it
    out gets the client's gap."""
    from sim.inputs.scenario import scenario_from_dict

    table = closed().to_dict()
    assert table["workload"]["start_gap_s"] == 1e-4
    del table["workload"]["start_gap_s"]
    assert scenario_from_dict(table).workload.start_gap_s == 0.0
    # one written before `endpoint` too (its clients called completions) loads the same way
    del table["workload"]["endpoint"]
    old = scenario_from_dict(table).workload
    assert (old.start_gap_s, old.endpoint) == (0.0, "completions")
    # and one written before the client's turnaround resends on the instant a request ends
    table = closed().to_dict()
    assert table["workload"]["turnaround_s"] == 1e-4
    del table["workload"]["turnaround_s"]
    assert scenario_from_dict(table).workload.turnaround_s == 0.0
    with pytest.raises(ServesimError, match="workload.turnaround_s = 0.001: applies to a closed"):
        load_scenario("chat", ["workload.turnaround_s=0.001"])
    partial = {"workload": {"concurrency": 3, "num_requests": 9}}
    assert scenario_from_dict(partial).workload.start_gap_s == 1e-4
    assert scenario_from_dict(partial).workload.turnaround_s == 1e-4  # (a file, not a log)
    # an open loop's log loads as before (the key means nothing there), and a file that sets
    # it on an open loop is told it applies to a closed loop
    table = load_scenario("chat", NO_FRONTEND).to_dict()
    del table["workload"]["start_gap_s"]
    assert scenario_from_dict(table).workload.start_gap_s == 1e-4
    with pytest.raises(ServesimError, match="workload.start_gap_s = 0.001: applies to a closed"):
        load_scenario("chat", ["workload.start_gap_s=0.001"])


def test_ramp_up_spreads_the_first_requests():
    e = Engine(closed("workload.ramp_up_s=3.0"))
    e.run_until(3.0)
    arrivals = [r.arrival_time for r in e.requests.values()]
    assert {u * (3.0 / 6) for u in range(6)} <= set(arrivals)
    assert sum(t < 0.5 for t in arrivals) == 1  # (the first user's first request takes longer)


def test_duration_stops_the_users_sending():
    e = Engine(closed("workload.duration_s=4", "workload.num_requests=100000"))
    e.run()
    assert max(r.arrival_time for r in e.requests.values()) < 4
    assert all(r.state.is_done for r in e.requests.values())


def test_the_invariants_hold_step_by_step():
    e = Engine(closed("workload.turns=3", "kv.enable_prefix_caching=true",
                      "kv.num_blocks=400"), skip_ahead=False)
    while not e.done:
        e.step()
        check_invariants(e)


def test_each_turn_is_the_conversation_so_far_and_hits_the_prefix_cache():
    sc = closed("workload.turns=4", "workload.think_time_s=1.0", "kv.enable_prefix_caching=true",
                "workload.prompt_tokens=200", "workload.output_tokens=50")
    e = Engine(sc)
    e.run()
    bs = sc.kv.block_size
    by_session: dict[int, list] = {}
    for r in ended(e):
        by_session.setdefault(r.session, []).append(r)
    assert len(by_session) == 120 // 4
    for turns in by_session.values():
        assert len(turns) == 4 and turns[0].num_cached_tokens == 0
        for before, r in zip(turns, turns[1:]):
            history = before.prompt_len + before.max_output_tokens
            assert r.prompt_len == history + 200
            # every full block of what the turn before computed (all but its last token)
            assert r.num_cached_tokens == (history - 1) // bs * bs
    single = Engine(closed("workload.think_time_s=1.0", "kv.enable_prefix_caching=true",
                           "workload.prompt_tokens=200", "workload.output_tokens=50"))
    single.run()
    assert single.kv.hit_tokens == 0 and e.kv.hit_tokens > 0


def test_a_turn_that_cannot_fit_ends_the_conversation():
    # the third turn of 200 + 50 tokens each needs 47 blocks of 16 tokens; the pool has 40
    e = Engine(closed("workload.turns=3", "kv.num_blocks=40", "workload.prompt_tokens=200",
                      "workload.output_tokens=50", "workload.concurrency=1",
                      "workload.num_requests=6"))
    e.run()
    states = [r.state.value for r in ended(e)]
    assert states == ["finished", "finished", "rejected"] * 2
    assert [r.session for r in ended(e)] == [0, 0, 0, 1, 1, 1]


def test_an_open_loop_workload_has_no_users():
    e = Engine(load_scenario("chat", ["workload.duration_s=2"]))
    assert e._feed is None and e.observers == []


def test_the_snapshot_says_what_drives_the_arrivals():
    assert Engine(closed()).snapshot().load == "concurrency 6"
    assert Engine(load_scenario("chat", ["workload.duration_s=2"])).snapshot().load == "4 req/s"


@pytest.mark.fuzz
@fuzz_settings(15)
@given(users=st.integers(1, 12), think=st.sampled_from([0.0, 0.05, 1.5]),
       ramp=st.sampled_from([0.0, 2.0]), turns=st.integers(1, 4),
       cancel=st.sampled_from([0.0, 0.3]), rate=st.sampled_from([0.0, 3.0]),
       blocks=st.sampled_from([40, 3000]), policy=st.sampled_from(["chunked", "fcfs", "sjf"]))
def test_the_closed_loop_invariants_hold_for_any_users(users, think, ramp, turns, cancel, rate,
                                                       blocks, policy):
    e = Engine(closed(f"workload.concurrency={users}", f"workload.think_time_s={think}",
                      f"workload.ramp_up_s={ramp}", f"workload.turns={turns}",
                      f"workload.cancel_fraction={cancel}", "workload.num_requests=60",
                      "workload.prompt_tokens={dist=\"uniform\", min=16, max=400}",
                      "workload.output_tokens={dist=\"uniform\", min=1, max=60}",
                      f"admission.rate={rate}", f"kv.num_blocks={blocks}",
                      "kv.enable_prefix_caching=true", f'scheduler.policy="{policy}"'))
    e.run()
    reqs = ended(e)
    assert len(reqs) == 60 and all(r.state.is_done for r in reqs)
    assert in_flight_max(reqs) <= users
    starts = [u * (ramp / users) for u in range(users)]
    later = sorted(r.arrival_time for r in reqs)[users:] if not ramp else None
    if later is not None:  # every arrival after the first users' is an end plus the think
        ends = sorted(r.finish_time for r in reqs)[:60 - users]  # time and the turnaround
        assert later == [t + (think + 1e-4) for t in ends]
    assert set(starts) <= {r.arrival_time for r in reqs}
