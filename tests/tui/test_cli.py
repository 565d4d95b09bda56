"""The command line, run as a user would: exit codes, one-line errors, JSON shapes."""

import json
import subprocess
import sys

import pytest

from sim.errors import CONTROL
from tui.cli import main

DIST_KEYS = {"count", "mean", "p50", "p90", "p95", "p99", "max"}


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_sim_json_shape(capsys):
    code, out, err = run(capsys, "sim", "chat", "--set", "workload.duration_s=10", "--json")
    assert code == 0, err
    s = json.loads(out)
    assert set(s["requests"]) == {"total", "finished", "cancelled", "rejected"}
    assert s["requests"]["finished"] == s["requests"]["total"] > 0
    assert set(s["throughput"]) == {"requests_per_s", "output_tokens_per_s", "total_tokens_per_s"}
    for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "queue_ms"):
        assert set(s[k]) == DIST_KEYS, k
        assert s[k]["p50"] <= s[k]["p99"] <= s[k]["max"]
    assert {"total_blocks", "peak_used_blocks", "mean_usage", "used_blocks_at_end"} <= set(s["kv"])
    for k in ("duration_s", "wall_s", "preemptions", "goodput_requests_per_s",
              "energy_j_per_output_token"):
        assert k in s
    assert s["ttft_ms"]["p50"] >= s["queue_ms"]["p50"]  # TTFT includes the queue


def test_sim_table_and_policy_override(capsys):
    code, out, _ = run(capsys, "sim", "chat", "--policy", "fcfs", "--seed", "3",
                       "--set", "workload.duration_s=5")
    assert code == 0
    assert "fcfs" in out.splitlines()[1] and "TTFT p99 (ms)" in out


def test_compare_runs_one_trace_under_each_policy(capsys):
    code, out, _ = run(capsys, "compare", "chat", "--policies", "static,fcfs,chunked",
                       "--set", "workload.duration_s=30", "--json")
    assert code == 0
    res = json.loads(out)
    assert list(res) == ["static", "fcfs", "chunked"]
    totals = {p: r["requests"]["total"] for p, r in res.items()}
    assert len(set(totals.values())) == 1
    # continuous batching beats request-level batching on time to first token
    assert res["chunked"]["ttft_ms"]["p50"] < res["static"]["ttft_ms"]["p50"]


def test_scenarios_lists_bundled(capsys):
    code, out, _ = run(capsys, "scenarios")
    assert code == 0 and any(line.startswith("chat ") for line in out.splitlines())


@pytest.mark.parametrize("argv, needle", [
    (["sim", "chat", "--set", "kv.block_size=12"], "kv.block_size = 12: must be a power of two"),
    (["sim", "nope"], "nope: no such scenario"),
    (["sim", "chat", "--set", "workload.rat=1"], "did you mean 'rate'"),
    (["compare", "chat", "--policies", "fcfs,xyz"], "unknown policy 'xyz'"),
    (["sim", "chat", "--set", "novalue"], "expected SECTION.KEY=VALUE"),
    (["sim", "chat", "--set", "workload.prompt_tokens=200000"], "max_model_len = 131072"),
    (["sim", "chat", "--log", "/nonexistent/dir/x.msgpack"], "does not exist"),
    # bench arguments were checked in a subprocess (a RuntimeError traceback) or not at all
    (["bench", "hotpath", "--scenario", "nope"], "nope: no such scenario"),
    (["bench", "kernel", "--static", "--block-sizes", "0"], "--block-sizes '0': want block sizes"),
    # a gamma's shape 1/cv^2 overflows below that (it was a ZeroDivisionError)
    (["sim", "chat", "--set", 'workload.arrival="gamma"', "--set", "workload.cv=1e-300"],
     "workload.cv = 1e-300: must be at least 0.001"),
    # tomllib's parser recurses: thousands of brackets were a RecursionError (a value that
    # does not parse as TOML is taken as a string)
    (["sim", "chat", "--set", "workload.rate=" + "[" * 3000 + "]" * 3000], "expected a number"),
    # an empty --host bound every address without a word
    (["serve", "--host", "", "--port", "0"], "--host '': name the address to listen on"),
    (["serve", "--api-key", " ", "--port", "0"], "--api-key: empty"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


@pytest.mark.parametrize("argv, needle", [
    # a name, path or value quoted in a message never reaches the terminal as an escape
    # sequence (it cleared the screen), nor whole when it is 5,000 digits long
    (["sim", "x\x1b[2Jy"], "x\\x1b[2Jy: no such scenario"),
    (["calibrate", "/nonexistent/\x1b]0;title\x07.csv"], "/nonexistent/\\x1b]0;title\\x07.csv"),
    (["sim", "chat", "--policy", "\x9b2J"], "invalid choice: '\\x9b2J'"),
    (["sweep", "chat", "--seeds", "9" * 5000], "invalid int value: '999"),
    (["serve", "--port", "9" * 5000], "invalid int value: '999"),
    # a number too long to convert is a number, not text to compare with a string field
    (["sim", "chat", "--set", "workload.num_requests=" + "9" * 5000],
     "integer literal of more than"),
    (["sweep", "chat", "--grid", "workload.rate=" + "9" * 5000], "integer literal of more than"),
    # a clock that would never move a token, and a model name no client can send
    (["serve", "--port", "0", "--speed", "1e-300"], "--speed 1e-300: must be at least 1/64"),
    (["serve", "--port", "0", "--served-model-name", ""], "--served-model-name '': empty"),
    (["serve", "--port", "0", "--served-model-name", "m\x1b[2J"], "holding a control character"),
    # a list named whole (5,000 names made a 25 kB line): the name at fault instead
    (["compare", "chat", "--policies", ",".join(["fcfs"] * 5000)],
     "--policies: 'fcfs' is listed twice"),
    (["compare", "chat", "--policies", "fcfs," + "x" * 5000], "unknown policy 'xxxx"),
])
def test_messages_quote_user_text_safely(capsys, argv, needle):
    try:
        code = main(argv)
    except SystemExit as e:  # (argparse's usage errors)
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and needle in err and len(err) < 600, err
    assert not CONTROL.search(err.rstrip("\n")), err


@pytest.mark.parametrize("argv, needle", [
    (["bench", "scale", "--requests", "-1"], "--requests: -1: must be at least 1"),
    (["bench", "live-memory", "--speed", "0"], "--speed: '0': expected a positive speed"),
    (["bench", "serve", "--streams", "0"], "--streams: 0: must be at least 1"),
    (["bench", "serve", "--duration", "nan"], "--duration: 'nan': expected a positive number"),
])
def test_bad_bench_arguments_are_one_line_and_exit_2(argv, needle):
    p = subprocess.run([sys.executable, "-m", "tui.cli", *argv], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and needle in p.stderr, p.stderr


def test_usage_errors_are_one_line_exit_2():
    p = subprocess.run([sys.executable, "-m", "tui.cli", "sim"], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.count("\n") == 1
    p = subprocess.run([sys.executable, "-m", "tui.cli", "frobnicate"], capture_output=True,
                       text=True)
    assert p.returncode == 2 and p.stderr.count("\n") == 1


def test_bench_sim_prints_figures(capsys):
    code, out, _ = run(capsys, "bench", "sim", "--scenario", "chat", "--repeat", "1", "--json")
    assert code == 0
    r = json.loads(out)
    assert r["wall_s"] > 0 and r["steps_per_s"] > 0 and r["output_tokens"] > 0


# --- signals and output streams -----------------------------------------------------------------
SERVESIM = [sys.executable, "-m", "tui.cli"]


def test_a_full_disk_on_stdout_is_one_line_and_exit_2():
    import os

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with open("/dev/full", "w") as full:
        p = subprocess.run(SERVESIM + ["sim", "chat", "--set", "workload.duration_s=2", "--json"],
                           stdout=full, stderr=subprocess.PIPE, text=True)
    assert p.returncode == 2
    assert p.stderr == "servesim: error: standard output: cannot write: No space left on device\n"


def test_compare_without_a_policy_exits_2(capsys):
    for policies in ("", " , ", "fcfs,fcfs"):
        code, out, err = run(capsys, "compare", "chat", "--policies", policies)
        assert code == 2 and out == "" and err.count("\n") == 1 and "--policies" in err


def test_sigterm_stops_a_run_as_ctrl_c_does_and_leaves_no_temporary(tmp_path):
    import signal

    from tests.helpers import catches, wait_for_process

    log = tmp_path / "s.msgpack"
    p = subprocess.Popen(SERVESIM + ["sim", "chat", "--set", "workload.duration_s=20000",
                                     "--log", str(log)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Sent once servesim handles SIGTERM (not while Python still starts, however loaded the
    # machine), into a run of 80,000 requests that takes a minute on an idle machine: the
    # 30 s bound guards against a hang, and fails a run that goes on to its end.
    wait_for_process(p.pid, lambda: catches(p.pid, signal.SIGTERM), "handled SIGTERM")
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 143 and err == "", (p.returncode, err)
    assert list(tmp_path.iterdir()) == []  # no log, no temporary


def test_sigterm_restores_the_terminal_as_q_does():
    """The dashboard in a real pseudo-terminal: SIGTERM leaves the alternate screen and turns
    the mouse off, as quitting does."""
    import os
    import pty
    import select
    import signal
    import time

    pid, fd = pty.fork()
    if pid == 0:  # the child: the dashboard
        os.environ.update(TERM="xterm-256color", COLUMNS="100", LINES="30")
        os.execv(sys.executable, [sys.executable, "-m", "tui.cli", "run", "--compute", "none",
                                  "--set", "workload.duration_s=30"])
    out = b""

    def read(timeout: float) -> bool:
        nonlocal out
        if select.select([fd], [], [], timeout)[0]:
            try:
                data = os.read(fd, 65536)
            except OSError:
                return False
            out += data
            return bool(data)
        return True

    t0 = time.time()
    while b"\x1b[?1049h" not in out and time.time() - t0 < 30:  # in the alternate screen
        if not read(0.2):
            break
    assert b"\x1b[?1049h" in out, out[-300:]
    time.sleep(0.5)
    while select.select([fd], [], [], 0.05)[0] and read(0):
        pass
    mark = len(out)
    os.kill(pid, signal.SIGTERM)
    t1 = time.time()
    while time.time() - t1 < 60 and read(0.2):  # (until the end of output; 60 s: a hang guard)
        pass
    _, status = os.waitpid(pid, 0)
    tail = out[mark:]
    assert os.waitstatus_to_exitcode(status) == 128 + signal.SIGTERM
    assert b"\x1b[?1049l" in tail and b"\x1b[?1000l" in tail, tail[-300:]


def test_the_dashboard_without_a_terminal_is_one_line():
    p = subprocess.run(SERVESIM + ["run", "--compute", "none"], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "needs a terminal" in p.stderr


@pytest.mark.parametrize("argv, needle", [
    (["sim", ""], "scenario '': an empty name"),  # (ran the default scenario)
    (["sim", "/tmp"], "/tmp: a directory, not a scenario file"),  # ("no such scenario file")
    (["sim", "/dev/zero"], "/dev/zero: not a regular file"),
    (["sim", "chat", "--set", "kv..block_size=1"], "an empty part in the key 'kv..block_size'"),
    (["validate", "--only", ""], "--only '': no such point"),  # (ran all 66 points)
    # (a misspelt id among known ones was dropped silently)
    (["validate", "--only", "T1,T99"], "'T99' names no point"),
    (["validate", "--only", "T1,Z1-Z9"], "'Z1-Z9' names no point"),
])
def test_empty_and_odd_names_are_refused(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize("argv", [["sim", "chat", "--log", ""], ["export", "x.msgpack", "-o", ""],
                                  ["sweep", "chat", "-o", ""], ["calibrate", "m.csv", "-o", ""]])
def test_an_empty_output_name_is_refused(argv):
    # --log "" wrote no log and -o "" wrote to stdout, both silently
    p = subprocess.run([sys.executable, "-m", "tui.cli", *argv], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "'': an empty file name" in p.stderr and p.stderr.count("\n") == 1


def test_a_scenario_with_a_byte_order_mark_loads(tmp_path, capsys):
    p = tmp_path / "bom.toml"
    p.write_bytes(b"\xef\xbb\xbf" + b'name = "bom"\n[workload]\nrate = 1\nduration_s = 2\n')
    code, out, err = run(capsys, "sim", str(p), "--json")
    assert code == 0 and json.loads(out)["scenario"] == "bom", err


def test_validate_only_takes_ranges(capsys):
    code, out, err = run(capsys, "validate", "--only", "T1-T3,T11", "--json")
    assert code == 0
    assert [p["id"] for p in json.loads(out)["points"]] == ["T1", "T2", "T3", "T11"]
