"""Session logs of closed-loop runs (`workload.concurrency`) replay exactly: the arrivals depend
on when requests end, and a replay that regenerates the ends regenerates the arrivals. A client
mix's log keeps each request's client."""

from __future__ import annotations

from sim import Engine, load_scenario, summarize
from sim.session.log import read_log, write_log
from sim.session.replay import Replayer, verify
from tui.cli import main

CLOSED = ["workload.concurrency=8", "workload.num_requests=300", "workload.turns=3",
          "workload.think_time_s=0.5", "workload.ramp_up_s=2", "kv.enable_prefix_caching=true",
          "workload.cancel_fraction=0.1", "admission.rate=3"]


def test_a_closed_loop_run_replays_exactly(tmp_path, capsys):
    p = tmp_path / "s.msgpack"
    assert main(["sim", "chat", "-q", "--log", str(p), *[x for o in CLOSED
                                                         for x in ("--set", o)]]) == 0
    capsys.readouterr()
    assert main(["replay", str(p), "--verify"]) == 0
    assert "events identical" in capsys.readouterr().out


def test_a_live_session_with_actions_mid_loop_replays_exactly(tmp_path):
    e = Engine(load_scenario("chat", CLOSED))
    e.run_until(3.0)
    e.inject(300, 40, count=3)  # (not the users': nobody sends after these)
    e.run_until(6.0)
    e.cancel(next(r.req_id for r in e.policy.running))  # its user sends the next at once
    e.cancel_waiting()
    e.run_until(12.5)
    path = write_log(tmp_path / "live.msgpack", e)
    _, divergence = verify(read_log(path))
    assert divergence is None


def test_a_client_mix_replays_with_each_requests_client(tmp_path):
    sc = load_scenario("chat", [
        "workload.duration_s=0", "workload.num_requests=200", "workload.rate=10",
        'workload.clients=[{name="a", share=0.5, ttft_ms=40}, {name="b", share=0.5, '
        'output_tokens=12, priority=3}]'])
    e = Engine(sc)
    e.run()
    log = read_log(write_log(tmp_path / "mix.msgpack", e))
    _, divergence = verify(log)
    assert divergence is None
    again = Replayer(log).engine
    again.run()
    assert [r.tag for r in sorted(again.requests.values(), key=lambda r: r.req_id)] == [
        r.tag for r in sorted(e.requests.values(), key=lambda r: r.req_id)]
    a, b = summarize(again), summarize(e)
    assert a["clients"] == b["clients"] and a["goodput_requests_per_s"] == b[
        "goodput_requests_per_s"]
