"""The progress line of long headless runs: what it says, when it is drawn, and that it stays
off a pipe and under --quiet."""

import io
import json
import threading
import time

import pytest

from sim import Engine, load_scenario
from tui import cli
from tui.progress import RunProgress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_line_names_simulated_time_requests_and_rate():
    e = Engine(load_scenario("chat", ["workload.duration_s=300"]), keep_history=False)
    stream = Terminal()
    with RunProgress(stream, delay=0, interval=0.01) as p:
        p.watch(e, "sim chat")
        while not e.done:
            e.run_until(e.now + 1.0)
            time.sleep(0.002)
        # (the thread draws every 0.01 s; a loaded machine may have starved it all run long)
        stop = time.monotonic() + 60  # a guard against a hang only
        while "sim chat: t=" not in stream.getvalue() and time.monotonic() < stop:
            time.sleep(0.01)
        line = p.line()
    total = e.counts["arrived"]
    assert line.startswith(f"sim chat: t={e.now:,.1f} s simulated  {total:,}/{total:,} requests")
    assert "req/s" in line and "elapsed" in line
    drawn = stream.getvalue()
    assert drawn.count("\r") >= 3 and "sim chat: t=" in drawn
    assert drawn.endswith("\r") and drawn.rsplit("\r", 2)[-2].strip() == ""  # erased at the end


def test_nothing_is_drawn_before_the_delay_or_when_disabled():
    e = Engine(load_scenario("chat", ["workload.duration_s=5"]))
    for kw in ({"delay": 30}, {"delay": 0, "enabled": False}):
        stream = Terminal()
        with RunProgress(stream, interval=0.01, **kw) as p:
            p.watch(e, "x")
            time.sleep(0.05)
        assert stream.getvalue() == "", kw


@pytest.fixture
def run_waits_for_a_draw(monkeypatch):
    """Hold a run, once it is watched, until the progress thread (where one runs) has drawn it:
    a run faster than the thread's first turn (a compiled build, a loaded machine) would
    otherwise end before anything could be drawn, and these tests would say nothing. (The
    60 s only guard against a hang: 2 s were too few on a loaded machine.)"""
    drawn = threading.Event()
    draw, watch = RunProgress.draw, RunProgress.watch

    def drawing(self):
        draw(self)
        if self.engine is not None:
            drawn.set()

    def watching(self, engine, label):
        drawn.clear()
        watch(self, engine, label)
        if self._thread is not None:  # (none when disabled: nothing will be drawn)
            drawn.wait(timeout=60)

    monkeypatch.setattr(RunProgress, "draw", drawing)
    monkeypatch.setattr(RunProgress, "watch", watching)


@pytest.mark.parametrize("argv, stdout_tty, drawn", [
    (["sim", "chat", "--set", "workload.duration_s=300"], False, True),
    (["sim", "chat", "--set", "workload.duration_s=300", "--quiet"], True, False),
    (["sim", "chat", "--set", "workload.duration_s=300", "--json"], False, False),  # a pipe
    (["sim", "chat", "--set", "workload.duration_s=300", "--json"], True, True),
    (["compare", "chat", "--set", "workload.duration_s=150", "--policies", "fcfs,chunked"],
     True, True),
])
def test_the_cli_draws_on_a_terminal_unless_quiet_or_json_to_a_pipe(
        monkeypatch, capsys, run_waits_for_a_draw, argv, stdout_tty, drawn):
    monkeypatch.setattr(RunProgress, "DELAY", 0.0)
    monkeypatch.setattr(RunProgress, "INTERVAL", 0.001)
    monkeypatch.setattr(cli, "_is_terminal",
                        lambda s: s is cli.sys.stderr or (stdout_tty and s is cli.sys.stdout))
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert ("requests" in err and "simulated" in err) == drawn, err
    if "--json" in argv:
        json.loads(out)  # stdout holds the JSON alone


def test_replay_verify_and_export_show_progress(monkeypatch, capsys, run_waits_for_a_draw,
                                                tmp_path):
    log = tmp_path / "s.msgpack"
    assert cli.main(["sim", "chat", "--set", "workload.duration_s=10", "--log", str(log),
                     "--quiet"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(RunProgress, "DELAY", 0.0)
    monkeypatch.setattr(RunProgress, "INTERVAL", 0.001)
    monkeypatch.setattr(cli, "_is_terminal", lambda s: True)
    assert cli.main(["replay", str(log), "--verify"]) == 0
    out, err = capsys.readouterr()
    assert "verified" in out and f"verify {log}: t=" in err
    assert cli.main(["export", str(log), "--format", "csv", "-o", str(tmp_path / "r.csv")]) == 0
    assert f"export {log}: t=" in capsys.readouterr().err
