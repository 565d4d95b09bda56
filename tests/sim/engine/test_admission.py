"""Admission control (`[admission]`): a queue bound and a token bucket, whose refusals end
`rejected` and count as such."""

from __future__ import annotations

import pytest

from sim import Engine, load_scenario, summarize
from sim.engine.admission import REFUSED, is_refusal
from sim.engine.request import RequestState
from tests.helpers import NO_FRONTEND


def run(*o):
    # (no API server in front: arrivals reach the admission gate at the times sent)
    e = Engine(load_scenario("chat", ["workload.duration_s=0", *NO_FRONTEND, *o]))
    e.run()
    return e


def test_the_token_bucket_admits_its_rate_and_refuses_the_rest():
    # arrivals every 0.25 s, a bucket of one refilled at 1 per second: every fourth is admitted
    e = run("workload.arrival=\"constant\"", "workload.rate=4", "workload.num_requests=40",
            "admission.rate=1.0")
    states = [e.requests[i].state for i in range(40)]
    assert [i for i, s in enumerate(states) if s is not RequestState.REJECTED] == list(
        range(0, 40, 4))
    assert all(is_refusal(e.requests[i].reject_reason) for i in range(40) if i % 4)
    assert summarize(e)["requests"]["rejected"] == 30


def test_a_burst_lets_that_many_through_at_once():
    e = run("workload.arrival=\"batch\"", "workload.num_requests=20", "admission.rate=0.5",
            "admission.burst=5")
    assert e.counts["rejected"] == 15 and e.counts["finished"] == 5


def test_the_queue_bound_refuses_arrivals_while_it_is_full():
    e = run("workload.arrival=\"batch\"", "workload.num_requests=100", "admission.max_waiting=10")
    assert e.counts["rejected"] == 90 and e.counts["finished"] == 10
    reasons = {r.reject_reason for r in e.requests.values() if r.reject_reason}
    assert reasons == {f"{REFUSED}10 requests waiting (admission.max_waiting)"}


def test_a_request_that_could_never_fit_is_no_refusal():
    e = run("workload.num_requests=20", "model.max_model_len=4000", "admission.rate=100.0",
            "workload.prompt_tokens={dist=\"choice\", values=[100, 5000]}")
    too_long = [r for r in e.requests.values() if r.prompt_len == 5000]
    assert too_long and all(r.state is RequestState.REJECTED and "max_model_len" in
                            r.reject_reason and not is_refusal(r.reject_reason)
                            for r in too_long)


@pytest.mark.parametrize("think", [0.0, 0.5])
def test_a_refused_users_next_request_follows_at_once_or_after_thinking(think):
    e = run("workload.concurrency=8", "workload.num_requests=200", "admission.rate=4.0",
            f"workload.think_time_s={think}")
    rejected = [r for r in e.requests.values() if r.state is RequestState.REJECTED]
    assert rejected and all(is_refusal(r.reject_reason) for r in rejected)
    assert len(e.requests) == 200 and all(r.state.is_done for r in e.requests.values())
