"""Session logs of closed-loop runs (`workload.concurrency`) replay exactly: the arrivals depend
on when requests end, and a replay that regenerates the ends regenerates the arrivals."""

from __future__ import annotations

from sim import Engine, load_scenario
from sim.session.log import read_log, write_log
from sim.session.replay import verify
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
