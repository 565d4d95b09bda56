"""A client mix (`[[workload.clients]]`): shares, each client's own lengths, priorities and SLO
class, and its figures in the summary."""

from __future__ import annotations

import numpy as np
import pytest

from sim import Engine, load_scenario, summarize
from sim.errors import ScenarioError
from sim.inputs.scenario import scenario_from_dict
from sim.inputs.workload import build_workload

MIX = ('workload.clients=[{name="chat", share=0.75, prompt_tokens=200, output_tokens=20, '
       'ttft_ms=50}, {name="batch", share=0.25, prompt_tokens=3000, output_tokens=5, '
       'priority=7, e2e_ms=1e9}]')


def mixed(*o):
    return load_scenario("chat", ["workload.duration_s=0", "workload.num_requests=4000",
                                  "workload.rate=20", MIX, *o])


def test_shares_lengths_and_priorities_are_each_clients():
    w = build_workload(mixed())
    chat, batch = w.client == 0, w.client == 1
    assert abs(chat.mean() - 0.75) < 0.03
    assert (w.prompt[chat] == 200).all() and (w.output[chat] == 20).all()
    assert (w.prompt[batch] == 3000).all() and (w.priority[batch] == 7).all()
    assert (w.priority[chat] == 0).all()  # (the workload's own)


def test_a_client_leaving_a_length_out_takes_the_workloads():
    w = build_workload(load_scenario("chat", [
        "workload.duration_s=0", "workload.num_requests=500", "workload.output_tokens=33",
        'workload.clients=[{name="a", share=0.5}, {name="b", share=0.5, output_tokens=9}]']))
    assert (w.output[w.client == 0] == 33).all() and (w.output[w.client == 1] == 9).all()


def test_each_client_is_held_to_its_slo_class_and_summarized():
    e = Engine(mixed("workload.num_requests=300"))
    e.run()
    out = summarize(e)
    chat, batch = out["clients"]["chat"], out["clients"]["batch"]
    assert chat["requests"]["finished"] + batch["requests"]["finished"] == 300
    def met(tag, ttft_ms):  # [slo] of chat.toml: TTFT 2,000 ms, TPOT 100 ms
        return np.mean([r.client_ttft * 1e3 <= ttft_ms and (r.tpot is None or r.tpot * 1e3 <= 100)
                        for r in e.requests.values() if r.tag == tag])
    # chat's TTFT bound replaces [slo]'s; batch keeps [slo]'s TTFT and TPOT bounds
    assert chat["slo_attainment"] == pytest.approx(met("chat", 50)) and 0 < met("chat", 50) < 1
    assert batch["slo_attainment"] == pytest.approx(met("batch", 2000))
    total_met = chat["slo_attainment"] * chat["requests"]["finished"] + batch[
        "slo_attainment"] * batch["requests"]["finished"]
    assert out["slo_attainment"] == pytest.approx(total_met / 300)


def test_without_a_mix_the_summary_has_no_clients():
    e = Engine(load_scenario("chat", ["workload.duration_s=2"]))
    e.run()
    assert "clients" not in summarize(e)


@pytest.mark.parametrize("clients, message", [
    ('[{name="a", share=0.5}, {name="b", share=0.4}]', "the shares sum to 0.9; they must sum to 1"),
    ('[{name="a", share=0.5}, {name="a", share=0.5}]', "two clients of that name"),
    ('[{share=1.0}]', "every client needs a name"),
    ('[{name="a", share=1.0, rate=3}]', "workload.clients[0].rate: unknown key"),
    ('[{name="a", share=1.5}]', "workload.clients[0].share = 1.5: must be at most 1"),
    ('[{name="a", share=1.0, ttft_ms=-1}]', "workload.clients[0].ttft_ms = -1"),
    ('{name="a"}', "expected an array of tables"),
])
def test_a_bad_mix_is_one_line_naming_the_field(clients, message):
    with pytest.raises(ScenarioError) as err:
        mixed(f"workload.clients={clients}")
    assert message in str(err.value) and "\n" not in str(err.value)
    assert "chat.toml" in str(err.value)


def test_a_mix_round_trips_through_its_dict():
    sc = mixed()
    again = scenario_from_dict(sc.to_dict(), source="log")
    assert again.workload.clients == sc.workload.clients
