"""The API server in front of the engine (`engine.frontend_*`): requests reach the engine after
it, tokens reach the client after it, and the client's TTFT and E2E are reported beside the
engine's."""

from __future__ import annotations

import csv
import io

import numpy as np
import pytest

from sim import Engine, load_scenario, rolling, summarize
from sim.engine.frontend import FrontEnd
from sim.engine.request import RequestState
from sim.errors import ScenarioError
from sim.engine.frontend import TERMS
from sim.session.log import read_log, write_log
from sim.session.export import to_csv
from sim.session.replay import Replayer, verify
from tests.helpers import NO_FRONTEND, small_scenario
from tests.logcraft import pack_log, unpack_log
from tests.sim.engine.test_step_invariance import (CLOSED_LOOP, PRESSURE, events_of, scripted,
                                                   session_script, state_of)
from tui.cli import format_table, main

# 4 ms per request, 2 us per prompt token, 150 us per output token
FE = ["engine.frontend_request_us=4000", "engine.frontend_prompt_token_us=2",
      "engine.frontend_output_token_us=150"]
OPEN = ["workload.duration_s=0", "workload.num_requests=150", "workload.rate=4"]
CLOSED = ["workload.concurrency=4", "workload.num_requests=80", "workload.think_time_s=0.25",
          "kv.num_blocks=3000"]


def run(*overrides):
    e = Engine(load_scenario("chat", list(overrides)))
    e.run()
    return e


def test_the_server_tokenises_one_request_at_a_time_in_the_order_sent():
    fe = FrontEnd(1000.0, 10.0, 0.0)  # 1 ms + 10 us per token
    assert fe.intake(0.0, 100) == pytest.approx(0.002)
    assert fe.intake(0.0005, 100) == pytest.approx(0.003)  # sent while the first is tokenised
    assert fe.intake(0.0025, 100) == pytest.approx(0.0045)  # the 1 ms latency holds nobody
    assert fe.intake(1.0, 0) == pytest.approx(1.001)      # the server was idle
    assert FrontEnd.of(load_scenario("chat", NO_FRONTEND).engine) is None  # every term 0: none
    default = FrontEnd.of(load_scenario("chat").engine)  # the default profile (vllm-v1) has one
    assert default is not None and default.request_s > 0 and default.prompt_token_s > 0
    # the roofline, for teaching, is the engine's clock alone
    assert FrontEnd.of(load_scenario("chat", ['engine.preset="roofline"']).engine) is None


def test_the_server_hands_out_each_steps_tokens_after_the_steps_before():
    fe = FrontEnd(0.0, 0.0, 100.0)  # 100 us per output token
    assert fe.deliver(0.010, 5) == pytest.approx(0.0105)  # idle: the step's 5 tokens
    assert fe.deliver(0.0102, 5) == pytest.approx(0.0110)  # waits for the step before
    assert fe.deliver(0.020, 1) == pytest.approx(0.0201)  # idle again
    # a run of steps delivered at once equals the steps delivered one at a time
    ends = [0.021 + 0.0003 * j for j in range(40)]
    one, each = FrontEnd(0.0, 0.0, 100.0), FrontEnd(0.0, 0.0, 100.0)
    one.out_free = each.out_free = fe.out_free
    assert one.deliver_run(ends, 4) == [each.deliver(t, 4) for t in ends]
    # 4 tokens a step take 0.4 ms, longer than a 0.3 ms step: the backlog grows
    assert one.out_free == pytest.approx(0.0201 + 40 * 0.0004 + 0.0009, rel=1e-9)


def lane_of(e, token_s):
    """Each step's delivery time, from the timeline's rows and `FrontEnd.deliver` (with one loop,
    waiting out the spells the engine's server spent taking in requests)."""
    fe = FrontEnd(0.0, 0.0, token_s * 1e6, one_loop=e.frontend.one_loop)
    fe.wait_out(e.frontend.spells)
    return [fe.deliver(t, int(n)) for t, n in zip(e.timeline.column("end").tolist(),
                                                   e.timeline.column("sampled").tolist())]


def test_open_loop_requests_reach_the_engine_after_the_server_and_the_client_sees_later():
    e = run(*OPEN, *FE)
    lane = lane_of(e, 150e-6)
    finished = [r for r in e.requests.values() if r.state is RequestState.FINISHED]
    assert len(finished) == 150
    sent_before = -1.0
    for r in sorted(finished, key=lambda r: r.req_id):
        assert r.sent_time >= sent_before  # (rows stay in the order sent)
        sent_before = r.sent_time
        assert r.arrival_time >= r.sent_time + 0.004 + r.prompt_len * 2e-6 - 1e-12
        # its first and last tokens reach it when the server has handed out their steps'
        first, last = r.token_segments[0][0], r.token_segments[-1][0] + r.token_segments[-1][1] - 1
        assert r.client_ttft == lane[first] - r.sent_time
        assert r.client_e2e == lane[last] - r.sent_time
        assert r.client_tpot == (lane[last] - lane[first]) / (r.num_output_tokens - 1)
        assert lane[first] >= r.first_token_time + 150e-6
        assert r.client_ttft > r.ttft and r.client_e2e > r.e2e
    assert max(lane[k] - t for k, t in enumerate(e.timeline.column("end"))) > 150e-6
    # the workload's arrival column stays the sent times
    assert [r.sent_time for r in sorted(finished, key=lambda r: r.req_id)] == \
        e.workload.arrival.tolist()


def test_the_clients_itl_is_the_gaps_between_the_times_their_tokens_were_handed_out():
    # a mix of single steps, decode runs and preemptions (gaps across steps), with a backlog
    e = run(*CLOSED, "workload.concurrency=32", "kv.num_blocks=400",
            "engine.frontend_output_token_us=1500")
    lane = lane_of(e, 1500e-6)
    gaps = []
    for r in e.requests.values():
        steps = [s + j for s, n in r.token_segments for j in range(n)]
        gaps += [lane[b] - lane[a] for a, b in zip(steps, steps[1:])]
    assert e.counts["preemptions"] > 0
    s = summarize(e)
    assert s["itl_ms"]["count"] == len(gaps) == s["engine_side"]["itl_ms"]["count"]
    assert s["itl_ms"]["mean"] == pytest.approx(1e3 * sum(gaps) / len(gaps), rel=1e-9)
    assert s["itl_ms"]["max"] == pytest.approx(1e3 * max(gaps), rel=1e-9)
    # an open loop whose steps sample more tokens than the server hands out meanwhile: its
    # clients' gaps are the server's time over a step's tokens, longer than the step
    s = summarize(run(*OPEN, "workload.rate=12", "engine.frontend_output_token_us=1500"))
    assert s["itl_ms"]["p50"] > 2 * s["engine_side"]["itl_ms"]["p50"]


def test_a_saturated_server_bounds_what_the_clients_receive():
    # 64 users, short prompts, long outputs: the engine samples far more than 2,000 tokens
    # a second, a server at 500 us a token hands out at most 2,000
    base = ["workload.concurrency=64", "workload.num_requests=256", "kv.num_blocks=20000",
            "workload.prompt_tokens=64", "workload.output_tokens=256", *NO_FRONTEND]
    free = summarize(run(*base))
    slow = summarize(run(*base, "engine.frontend_output_token_us=500"))
    assert free["throughput"]["output_tokens_per_s"] > 4000
    assert 1900 < slow["throughput"]["output_tokens_per_s"] <= 2000
    # the clients' tokens come at the server's pace, the engine's at its own
    assert slow["tpot_ms"]["p50"] > 2 * slow["engine_side"]["tpot_ms"]["p50"]
    assert slow["tpot_ms"]["p50"] > 1.5 * free["tpot_ms"]["p50"]


def test_the_summary_gives_the_clients_ttft_and_e2e_and_the_engines_beside_them():
    s = summarize(run(*OPEN, *FE))
    plain = summarize(run(*OPEN, *NO_FRONTEND))
    assert "engine_side" in s and "engine_side" not in plain
    assert s["ttft_ms"]["count"] == s["engine_side"]["ttft_ms"]["count"] == 150
    assert s["ttft_ms"]["p50"] > s["engine_side"]["ttft_ms"]["p50"] + 4.0
    assert s["e2e_ms"]["mean"] > s["engine_side"]["e2e_ms"]["mean"] + 4.0
    assert set(s["engine_side"]) == {"ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"}
    # (at this load the server keeps up: the client's TPOT is the engine's within its time)
    assert s["tpot_ms"]["count"] == s["engine_side"]["tpot_ms"]["count"]
    assert s["tpot_ms"]["mean"] == pytest.approx(s["engine_side"]["tpot_ms"]["mean"], rel=0.02)
    table = format_table({"fcfs": s})
    assert "engine-side TTFT p50 (ms)" in table
    assert "engine-side" not in format_table({"fcfs": plain})


def test_the_rolling_ttft_is_the_clients():
    e = Engine(load_scenario("chat", [*OPEN, *FE]), keep_history=True)
    e.run_until(20.0)
    seen = {(r.first_token_time, r.client_ttft) for r in e.requests.values()
            if r.first_token_time is not None}
    assert e.recent_ttfts and all(x in seen for x in e.recent_ttfts)
    assert rolling(e, 10.0)["ttft_p50_ms"] > 4.0


def test_the_slo_is_judged_on_what_the_client_sees():
    # a TTFT bound just above the engine's worst: met at the engine, missed by some clients
    bound = summarize(run(*OPEN, *FE))["engine_side"]["ttft_ms"]["max"] + 1.0
    slo = [f"slo.ttft_ms={bound}", "slo.tpot_ms=0", "slo.e2e_ms=0"]
    s = summarize(run(*OPEN, *FE, "engine.frontend_request_us=50000", *slo))
    assert s["engine_side"]["ttft_ms"]["max"] < bound < s["ttft_ms"]["max"]
    assert s["slo_attainment"] < 1.0
    assert summarize(run(*OPEN, *NO_FRONTEND, *slo))["slo_attainment"] == 1.0


def test_a_closed_loop_user_sends_again_when_it_has_seen_the_end():
    e = run(*CLOSED, *FE)
    reqs = sorted(e.requests.values(), key=lambda r: r.sent_time)
    assert len(reqs) == 80 and all(r.state.is_done for r in reqs)
    # every later request is sent when an earlier one's end reached its client, plus thinking
    # and the client's turnaround (0.1 ms)
    lane = lane_of(e, 150e-6)
    seen = sorted(lane[r.token_segments[-1][0] + r.token_segments[-1][1] - 1] + (0.25 + 1e-4)
                  for r in reqs)[:80 - 4]
    assert [r.sent_time for r in reqs[4:]] == pytest.approx(seen, abs=1e-12)
    for r in reqs:
        assert r.arrival_time >= r.sent_time + 0.004 + r.prompt_len * 2e-6 - 1e-12
    # the rows go to the requests in the order sent
    assert [r.req_id for r in reqs] == sorted(r.req_id for r in reqs)


def test_a_ramp_up_user_does_not_hold_a_request_sent_before_it():
    e = Engine(load_scenario("chat", [*CLOSED, *FE, "workload.ramp_up_s=40"]))
    e.run_until(30.0)
    reqs = list(e.requests.values())
    assert len(reqs) > 4  # users sent again before the last user's start (30 s)
    for r in reqs:  # none waited at the server for a user not yet started
        assert r.arrival_time < r.sent_time + 0.1


@pytest.mark.parametrize("overrides", [OPEN, CLOSED + ["workload.turns=3"]])
def test_runs_behind_a_front_end_replay_exactly(tmp_path, overrides):
    e = run(*overrides, *FE)
    _, divergence = verify(read_log(write_log(tmp_path / "fe.msgpack", e)))
    assert divergence is None


def test_the_csv_export_of_a_replayed_log_has_the_clients_figures(tmp_path):
    e = run(*OPEN, *FE)
    r = Replayer(read_log(write_log(tmp_path / "fe.msgpack", e)))
    r.run()
    rows = list(csv.DictReader(io.StringIO(to_csv(r.engine))))
    assert len(rows) == 150
    for row in rows:
        req = e.requests[int(row["req_id"])]
        assert float(row["sent_s"]) == req.sent_time < float(row["arrival_s"])
        assert float(row["client_ttft_ms"]) == pytest.approx(req.client_ttft * 1e3)
        assert float(row["client_e2e_ms"]) == pytest.approx(req.client_e2e * 1e3)
        assert float(row["client_ttft_ms"]) > float(row["ttft_ms"])


def test_a_log_written_before_the_terms_replays_without_them(tmp_path):
    # an SGLang session as it ran when no profile had an API server
    e = run(*OPEN, "engine.preset=sglang", *[f"engine.{k}=0" for k in TERMS])
    path = tmp_path / "old.msgpack"
    objs = unpack_log(write_log(path, e).read_bytes())
    for k in TERMS:
        del objs[0]["scenario"]["engine"][k]
    path.write_bytes(pack_log(objs))
    _, divergence = verify(read_log(path))
    assert divergence is None


def test_chat_requests_take_the_servers_own_time_one_after_another():
    fe = FrontEnd(1000.0, 10.0, 0.0, 5000.0)  # + 5 ms of its own on each chat request
    assert fe.intake(0.0, 100) == pytest.approx(0.007)
    assert fe.intake(0.0, 100) == pytest.approx(0.013)  # sent together: queued behind it
    assert fe.intake(1.0, 0) == pytest.approx(1.006)
    # a scenario's requests are chat ones only with endpoint = "chat", and pay the term only
    # where the model's prompt comes from a Jinja template (not gpt-oss's Harmony)
    term = "engine.frontend_chat_request_us=5000"
    for overrides, chat_s in ((['workload.endpoint="chat"', term], 0.005), ([term], 0.0),
                              (['workload.endpoint="chat"', term, 'model.config="gpt-oss-20b"'],
                               0.0)):
        assert run(*OPEN, *overrides).frontend.chat_s == chat_s
    # a burst of 40 chat requests reaches the engine 5 ms apart (and their tokenising)
    e = run("workload.arrival=\"batch\"", "workload.num_requests=40", *FE, term,
            'workload.endpoint="chat"', "engine.frontend_one_loop=false")
    arrivals = sorted(r.arrival_time for r in e.requests.values())
    assert np.diff(arrivals).min() >= 0.005


def test_one_loop_holds_every_streams_tokens_while_it_takes_in_a_burst():
    # 40 chat requests at once, 50 ms of the server's own time each: 2 s of intake; with one
    # loop (vLLM's API server) no token reaches a client before the last request is taken in
    burst = ["workload.arrival=\"batch\"", "workload.num_requests=40", *FE,
             "engine.frontend_chat_request_us=50000", 'workload.endpoint="chat"']
    one = run(*burst, "engine.frontend_one_loop=true")
    two = run(*burst, "engine.frontend_one_loop=false")
    intake_end = one.frontend.spells[-1]
    assert one.frontend.spells.tolist() == [0.0, intake_end] and intake_end >= 40 * 0.05
    firsts = [r.client_first_time for r in one.requests.values()]
    assert min(firsts) >= intake_end
    assert min(r.client_first_time for r in two.requests.values()) < 0.5
    # the engine ran the same steps either way: only when the clients saw the tokens differs
    assert one.timeline.column("end").tolist() == two.timeline.column("end").tolist()
    s = summarize(one)
    assert s["ttft_ms"]["p50"] > 2000 > summarize(two)["ttft_ms"]["p50"]
    assert s["engine_side"]["ttft_ms"] == summarize(two)["engine_side"]["ttft_ms"]


@pytest.mark.parametrize("value", ['"chats"', "1"])
def test_an_unknown_endpoint_is_refused_in_one_line(value, capsys):
    with pytest.raises(ScenarioError, match="workload.endpoint"):
        load_scenario("chat", [f"workload.endpoint={value}"])
    assert main(["sim", "chat", "-q", "--set", f"workload.endpoint={value}"]) == 2


def test_replicas_take_the_requests_after_the_server():
    s = summarize(run(*OPEN, *FE, "cluster.replicas=2"))
    assert s["ttft_ms"]["count"] == 150
    assert s["ttft_ms"]["p50"] > s["engine_side"]["ttft_ms"]["p50"] + 4.0


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_negative_or_non_finite_term_is_refused_in_one_line(value, capsys):
    with pytest.raises(ScenarioError, match="engine.frontend_prompt_token_us"):
        load_scenario("chat", [f"engine.frontend_prompt_token_us={value}"])
    assert main(["sim", "chat", "-q", "--set", f"engine.frontend_output_token_us={value}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "engine.frontend_output_token_us" in err[0]


@pytest.mark.parametrize("closed", [False, True])
def test_runs_behind_a_front_end_agree_however_time_is_sliced(closed):
    # the sends are events of their own (closed loop); decode runs must stop at them
    sc = small_scenario('scheduler.policy="chunked"', *PRESSURE[1:3],
                        *(CLOSED_LOOP if closed else PRESSURE[3:]), *FE)
    script = [a for a in session_script("chunked") if a[1] != "switch_policy"]
    runs = {m: scripted(Engine(sc), m, script) for m in ("whole", "sliced", "stepped")}
    runs["unskipped"] = scripted(Engine(sc, skip_ahead=False), "whole", script)
    whole = runs["whole"]
    assert whole.counts["finished"] > 25
    for m, e in runs.items():
        assert events_of(e) == events_of(whole), m
        assert state_of(e) == state_of(whole), m
    a, b = summarize(whole), summarize(runs["stepped"])
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b and "engine_side" in a


def test_the_fits_replay_hands_tokens_out_as_the_server_does():
    # sim.model.fit re-times a recorded schedule all at once: its running maximum must give
    # the times the server's one-step-at-a-time sums give
    import numpy as np

    from sim.model.fit import _delivered

    rng = np.random.default_rng(7)
    ends = np.cumsum(rng.uniform(0.0, 0.004, 5000) * (rng.random(5000) < 0.9))
    sampled = rng.integers(0, 160, 5000)
    fe = FrontEnd(0.0, 0.0, 20.0)
    step = [fe.deliver(t, int(n)) for t, n in zip(ends.tolist(), sampled.tolist())]
    assert np.abs(_delivered(ends, sampled * 20e-6) - step).max() < 1e-12
    assert max(np.array(step) - ends) > 0.003  # (a backlog, then idle: both cases seen)
    assert abs(min(np.array(step) - ends - sampled * 20e-6)) < 1e-12


def test_a_decode_runs_tokens_handed_out_in_c_are_those_of_the_python_rule():
    # sim/native/_rows.c's deliver_rows (a compiled build's decode runs) against
    # FrontEnd.deliver, bit for bit, with and without a backlog, and with one loop whose
    # intake spells the tokens wait out (spells before, inside and after the run)
    import numpy as np

    from sim.native import compiled

    rows = compiled.c_module("sim.native._rows")
    if rows is None:
        pytest.skip("no compiled build")
    rng = np.random.default_rng(5)
    hopped = 0
    for trial in range(400):
        k, at = int(rng.integers(1, 60)), int(rng.integers(0, 20))
        end = np.zeros(at + k + 3)
        end[at:at + k] = np.cumsum(rng.uniform(0.0, 0.002, k)) + rng.uniform(0, 1)
        out = np.zeros(at + k + 3)
        fe = FrontEnd(0.0, 2.0, float(rng.uniform(0, 80)), float(rng.uniform(0, 3000)),
                      one_loop=bool(trial % 2))
        if fe.one_loop:  # requests sent around the run: the server's intake spells
            for t in np.sort(rng.uniform(end[at] - 0.05, end[at + k - 1] + 0.01, 12)).tolist():
                fe.intake(t, int(rng.integers(0, 2000)))
        fe.out_free = float(end[at] + rng.uniform(-0.05, 0.05))
        b = int(rng.integers(1, 300))
        start, spell = fe.out_free, fe.spell_at
        plain = FrontEnd(0.0, 0.0, 0.0)  # (the same server, without the spells)
        plain.token_s, plain.out_free = fe.token_s, start
        unheld = plain.deliver_run(end[at:at + k].tolist(), b)
        want = fe.deliver_run(end[at:at + k].tolist(), b)
        hopped += want != unheld
        first, last, at_spell = rows.deliver_rows(end, out, at, k, start, b * fe.token_s,
                                                  fe.spells, spell)
        assert out[at:at + k].tolist() == want and (first, last) == (want[0], want[-1])
        assert at_spell == fe.spell_at
        assert not out[:at].any() and not out[at + k:].any()
    assert hopped > 50  # (the spells held tokens back in many trials)


def test_a_client_mix_judges_its_slo_on_what_its_clients_receive():
    # a TPOT bound between the engine's and the clients' (a server handing out 1 ms a token):
    # the mix's per-client counts and the run's own agree, both on the clients' TPOT
    mix = ('workload.clients=[{name="a", share=0.5, tpot_ms=40}, '
           '{name="b", share=0.5, tpot_ms=40}]')
    e = run(*OPEN, "workload.rate=8", "engine.frontend_output_token_us=1000", mix)
    s = summarize(e)
    assert s["engine_side"]["tpot_ms"]["p50"] < 40 < s["tpot_ms"]["p50"]
    met = sum(c["slo_attainment"] * c["requests"]["finished"] for c in s["clients"].values())
    assert met == pytest.approx(e.slo_met) and e.slo_met < s["requests"]["finished"] / 2


def test_a_closed_loop_user_never_sends_before_its_cancelled_request_ended():
    # requests cancelled while queued or preempted: their last token reached the client before
    # the cancellation, and the user sends its next one only after it
    e = run(*CLOSED, "workload.cancel_fraction=0.5", "kv.num_blocks=300",
            "engine.frontend_output_token_us=200")
    reqs = sorted(e.requests.values(), key=lambda r: r.sent_time)
    cancelled = [r for r in reqs if r.state is RequestState.CANCELLED]
    assert len(cancelled) > 10 and any(
        r.client_last_time is not None and r.client_last_time < r.finish_time for r in cancelled)
    ends = sorted(max(r.client_last_time or r.finish_time, r.finish_time) + (0.25 + 1e-4)
                  for r in reqs)
    assert [r.sent_time for r in reqs[4:]] == pytest.approx(ends[:len(reqs) - 4], abs=1e-12)

