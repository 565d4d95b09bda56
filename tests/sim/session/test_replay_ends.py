"""Sessions that end, or are exported, right after a decision that ran no step (the last
arrival rejected, a waiting request's cancellation at the last step's end) replay and verify,
for a single engine and for deployments, whether exported at the end or mid-run."""

from __future__ import annotations

from hypothesis import given, strategies as st

from sim import build
from sim.session.log import read_log, write_log
from sim.session.replay import verify
from tests.fuzz import fuzz_settings
from tests.helpers import small_scenario, workload_of

DEPLOYMENTS = {"engine": (), "replicas": ("cluster.replicas=2",),
               "disaggregated": ('scheduler.policy="disaggregated"',)}


def _verified(tmp_path, c) -> None:
    log = read_log(write_log(tmp_path / "s.msgpack", c))
    r, div = verify(log)
    assert div is None, div.describe()
    assert r.engine.counts == c.counts
    assert [e.kv.num_used_blocks for e in getattr(r.engine, "instances", [r.engine])] == [
        e.kv.num_used_blocks for e in getattr(c, "instances", [c])]


def test_a_session_ending_in_a_rejection_replays(tmp_path):
    # the second request, too long for the pool, arrives when the first has finished
    for extra in DEPLOYMENTS.values():
        c = build(small_scenario("kv.num_blocks=20", *extra),
                  workload=workload_of([(0.0, 100, 1), (1.0, 1000, 1)]))
        c.run()
        assert c.counts["rejected"] == 1
        _verified(tmp_path, c)


def test_a_session_ending_in_a_cancellation_at_the_last_step_end_replays(tmp_path):
    # one seat each: the waiting requests' cancellations applies at the first one's last step end
    for extra in DEPLOYMENTS.values():
        c = build(small_scenario("scheduler.max_num_seqs=1", *extra),
                  workload=workload_of([(0.0, 1000, 1, 0, 0.01)] * 4))
        c.run()
        assert c.counts["cancelled"] >= 1
        _verified(tmp_path, c)


def test_a_deployment_ticked_like_a_dashboard_then_acted_on_replays(tmp_path):
    """A few run_until ticks, then a user action (the dashboard's way): an instance's own
    record of the action once said whether it had applied a stale cancellation due there,
    which the replay, jumping the idle instance instead, did not (found by a review)."""
    c = build(small_scenario('scheduler.policy="disaggregated"'),
              workload=workload_of([(0.0, 3000, 3, 0, 0.5), (0.5, 1000, 2, 0, 0.501)]))
    for t in (0.1, 0.501, 0.502):
        c.run_until(t)
    c.cancel_waiting()
    c.run()
    _verified(tmp_path, c)


@fuzz_settings(30)
@given(deployment=st.sampled_from(sorted(DEPLOYMENTS)),
       rows=st.lists(st.tuples(st.sampled_from([0.0, 0.5, 1.0, 1.5]),
                               st.sampled_from([40, 300, 1000, 2000]), st.integers(1, 4),
                               st.sampled_from([0.001, 0.01, 0.5, 1.0, 9.0])),
                     min_size=1, max_size=6),
       cut=st.sampled_from([None, 0.0, 0.5, 1.0, 1.5]), act=st.booleans())
def test_sessions_cut_anywhere_replay_and_verify(tmp_path_factory, deployment, rows, cut,
                                                 act):
    # Arrivals and cancellations at the very times where runs are cut (a screen's tick, the
    # end of the session), then an action there or none.
    rows = sorted((t, p, o, 0, t + after) for t, p, o, after in rows)
    c = build(small_scenario("kv.num_blocks=64", "scheduler.max_num_seqs=2",
                             *DEPLOYMENTS[deployment]), workload=workload_of(rows))
    if cut is None:
        c.run()
    else:
        c.run_until(cut)
    if act:
        c.inject(40, 2)
        live = [r for r in c.requests.values() if not r.state.is_done]
        if live:
            c.cancel(live[0].req_id)
        c.run_until(c.now + 0.25)
    _verified(tmp_path_factory.mktemp("ends"), c)


def test_arrivals_rejected_while_idle_between_recorded_positions_keep_their_times(tmp_path):
    """No step runs between the last action and the end, but two arrivals too long for the
    pool are rejected at their own times (0.25, 0.5): the replay decided them at the end's
    time, after a decision that released a finished request had not moved the clock."""
    c = build(small_scenario("kv.num_blocks=40", "scheduler.max_num_seqs=1",
                             'scheduler.policy="chunked"', "workload.num_samples=2"),
              workload=workload_of([(0.0, 10, 2, 0, 0.01), (0.25, 1000, 6), (0.5, 1000, 3)]))
    c.inject(10, 2)
    c.run_until(0.001)
    c.cancel(4)  # (the injected request's waiting second sample)
    c.run_until(0.008)
    c.inject(3000, 3)
    c.step()
    c.run()
    assert [(e.t, e.req_id) for e in c.events if e.kind == "reject"][-2:] == [(0.25, 1), (0.5, 2)]
    _verified(tmp_path, c)


def test_a_cancellation_of_a_request_already_ended_is_never_pending(tmp_path):
    """A client cancellation due after its request finished does nothing: whether an idle
    engine had passed over it must not change what a user action records (`settled`)."""
    c = build(small_scenario("kv.num_blocks=64", "scheduler.max_num_seqs=1",
                             "engine.num_scheduler_steps=4", 'scheduler.policy="static"'),
              workload=workload_of([(0.25, 1000, 2, 0, 0.75), (0.5, 1000, 4, 0, 0.51)]))
    c.run_until(0.001)
    c.run_until(1.001, 3)
    c.cancel(1)
    c.run_until(c.now + 0.1)
    c.run_until(c.now + 0.5)  # (past the finished request's cancellation at 0.75)
    c.cancel_waiting()
    c.run()
    _verified(tmp_path, c)
