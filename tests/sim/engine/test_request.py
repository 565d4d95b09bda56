import numpy as np
import pytest

from sim.errors import InvalidTransition
from sim.engine.request import TRANSITIONS, Request, RequestState as S
from sim.engine.timeline import Timeline


def test_lifecycle_transitions_are_enforced():
    r = Request(1, 0.0, 10, 5)
    assert r.state is S.WAITING
    with pytest.raises(InvalidTransition, match="waiting -> finished"):
        r.transition(S.FINISHED)
    r.transition(S.RUNNING)
    r.transition(S.PREEMPTED)
    with pytest.raises(InvalidTransition):
        r.transition(S.WAITING)
    r.transition(S.RUNNING)
    r.transition(S.FINISHED)
    for s in S:
        with pytest.raises(InvalidTransition):
            r.transition(s)


def test_terminal_states_have_no_way_out():
    for s in (S.FINISHED, S.CANCELLED, S.REJECTED):
        assert TRANSITIONS[s] == frozenset()
        assert s.is_done
    # every live state can be cancelled
    for s in (S.WAITING, S.RUNNING, S.PREEMPTED, S.SWAPPED, S.TRANSFERRING):
        assert S.CANCELLED in TRANSITIONS[s]


def test_hand_timeline_latencies():
    """Arrival 0 ms, admission 30 ms, first token 80 ms, then 100 gaps of 5 ms."""
    tl = Timeline()
    ends = 0.080 + 0.005 * np.arange(101)
    tl.append(end=ends, dur=np.full(101, 0.005))
    r = Request(7, 0.0, 100, 101)
    r._timeline = tl
    r.admitted_time = 0.030
    r.first_token_time = 0.080
    r.last_token_time = float(ends[-1])
    r.num_output_tokens = 101
    r.finish_time = float(ends[-1])
    r.token_segments = [[0, 101]]
    assert r.queue_wait == pytest.approx(0.030)
    assert r.ttft == pytest.approx(0.080)
    assert r.last_token_time == pytest.approx(0.580)
    assert r.tpot == pytest.approx(0.005)
    assert len(r.itls()) == 100
    assert np.allclose(r.itls(), 0.005)
    # response time = TTFT + sum of the ITLs
    assert r.e2e == pytest.approx(r.ttft + r.itls().sum())


def test_token_times_follow_segments_across_a_gap():
    tl = Timeline()
    tl.append(end=np.array([1.0, 2.0, 3.0, 4.0, 5.0]), dur=np.ones(5))
    r = Request(0, 0.0, 4, 4)
    r._timeline = tl
    r.token_segments = [[0, 2], [3, 2]]
    assert r.token_times().tolist() == [1.0, 2.0, 4.0, 5.0]
    assert r.itls().tolist() == [1.0, 2.0, 1.0]


def test_num_tokens_and_prefill_flag():
    r = Request(0, 0.0, 10, 5)
    assert r.num_tokens == 10 and r.is_prefill
    r.num_computed_tokens = 10
    r.num_output_tokens = 1
    assert r.num_tokens == 11 and not r.is_prefill


def test_token_runs_read_and_set_as_segments():
    # The open run lives in native fields; token_segments shows it after the closed ones,
    # and setting token_segments round-trips (a hand-off sets a run of earlier tokens).
    r = Request(1, 0.0, 10, 50)
    assert r.token_segments == [] and not r.run_open
    r.open_run(3, 1)
    r.run_len += 4  # (the engine extends the open run in place)
    r.open_run(9, 2)
    assert r.token_segments == [[3, 5], [9, 2]]
    r.token_segments.append([20, 1])  # a copy: the request is unchanged
    assert r.token_segments == [[3, 5], [9, 2]]
    for runs in ([], [[-3, 2]], [[0, 2], [3, 2], [7, 1]], [[-1, 0]]):
        r.token_segments = runs
        assert r.token_segments == runs and r.run_open == bool(runs)
