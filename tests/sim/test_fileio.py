"""Output files: written atomically, never half-written, never replacing a link, a FIFO, a
device or this process's own standard output; a destination that cannot be written is found
before a run."""

import os
import signal
import subprocess
import sys
import threading

import pytest

from sim.errors import ServesimError
from sim.fileio import atomic_open, check_writable, write_atomic

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_regular_file_is_replaced_whole_and_keeps_its_mode(tmp_path):
    p = tmp_path / "out.csv"
    p.write_text("old")
    os.chmod(p, 0o640)
    write_atomic(p, "new")
    assert p.read_text() == "new" and oct(p.stat().st_mode & 0o777) == oct(0o640)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out.csv"]


def test_a_symlink_stays_and_its_target_is_written(tmp_path):
    (tmp_path / "data").mkdir()
    target = tmp_path / "data" / "real.csv"
    target.write_text("old")
    link = tmp_path / "link.csv"
    link.symlink_to(target)
    write_atomic(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new"
    assert sorted(x.name for x in (tmp_path / "data").iterdir()) == ["real.csv"]
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "data" / "new.csv")
    write_atomic(dangling, "made")
    assert dangling.is_symlink() and (tmp_path / "data" / "new.csv").read_text() == "made"


def test_a_fifo_is_written_through_not_replaced(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()))
    reader.start()
    write_atomic(fifo, "through the pipe")
    reader.join(5)
    assert got == ["through the pipe"]
    assert fifo.is_fifo()
    # and a link to the FIFO stays a link to a FIFO
    link = tmp_path / "link"
    link.symlink_to(fifo)
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()))
    reader.start()
    write_atomic(link, "again")
    reader.join(5)
    assert got[-1] == "again" and link.is_symlink() and fifo.is_fifo()


def test_devices_are_written_through():
    write_atomic("/dev/null", "nothing")  # not replaced by a file (it would be, as root)
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")
    if os.path.exists("/dev/full"):
        with pytest.raises(ServesimError, match="/dev/full: cannot write: No space left"):
            write_atomic("/dev/full", "x" * 100000)


def test_exclusive_never_replaces(tmp_path):
    p = tmp_path / "log"
    p.write_text("first")
    with pytest.raises(FileExistsError):
        with atomic_open(p, "w", exclusive=True) as fh:
            fh.write("second")
    assert p.read_text() == "first" and [x.name for x in tmp_path.iterdir()] == ["log"]
    with atomic_open(tmp_path / "other", "w", exclusive=True) as fh:
        fh.write("ok")
    assert (tmp_path / "other").read_text() == "ok"


def test_failure_or_interrupt_leaves_neither_a_half_file_nor_a_temporary(tmp_path):
    p = tmp_path / "keep"
    p.write_text("precious")
    for exc in (RuntimeError, KeyboardInterrupt):
        with pytest.raises(exc):
            with atomic_open(p, "w") as fh:
                fh.write("half")
                raise exc()
    assert p.read_text() == "precious" and [x.name for x in tmp_path.iterdir()] == ["keep"]


def test_sigterm_mid_write_leaves_no_temporary(tmp_path):
    # The CLI turns SIGTERM into an exception (as Ctrl-C), so the clean-up above runs.
    code = f"""
import os, signal, sys
sys.path.insert(0, {ROOT!r})
from tui.cli import _terminate
from sim.fileio import atomic_open
signal.signal(signal.SIGTERM, _terminate)
with atomic_open({str(tmp_path / 'out')!r}, "w") as fh:
    fh.write("half")
    os.kill(os.getpid(), signal.SIGTERM)
    fh.write("never")
"""
    (tmp_path / "out").write_text("old")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode != 0 and "Terminated" in p.stderr
    assert [x.name for x in tmp_path.iterdir()] == ["out"]
    assert (tmp_path / "out").read_text() == "old"


def test_stdout_is_written_through_keeping_what_it_holds(tmp_path):
    """`-o /dev/stdout` with stdout appended to a file: the file is not truncated, nor replaced
    by a new one that the shell would no longer be writing to."""
    out = tmp_path / "appended.txt"
    out.write_text("first line\n")
    code = f"""
import sys
sys.path.insert(0, {ROOT!r})
from sim.fileio import write_atomic
print("from print", flush=True)
write_atomic("/dev/stdout", "through /dev/stdout\\n")
print("after", flush=True)
"""
    with open(out, "a") as fh:
        subprocess.run([sys.executable, "-c", code], stdout=fh, check=True)
    assert out.read_text() == "first line\nfrom print\nthrough /dev/stdout\nafter\n"


def test_check_writable_finds_problems_before_a_run(tmp_path):
    check_writable(tmp_path / "new.csv")
    with pytest.raises(ServesimError, match="is a directory"):
        check_writable(tmp_path, "-o")
    with pytest.raises(ServesimError, match="does not exist"):
        check_writable(tmp_path / "no" / "such" / "x.csv", "-o")
    (tmp_path / "file").write_text("")
    with pytest.raises(ServesimError, match="x.csv: cannot write: Not a directory"):
        check_writable(tmp_path / "file" / "x.csv", "--log")
    if os.geteuid() != 0:  # root may write anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        os.chmod(ro, 0o555)
        with pytest.raises(ServesimError, match="cannot write in"):
            check_writable(ro / "x.csv")
        (tmp_path / "locked").write_text("")
        os.chmod(tmp_path / "locked", 0o444)
        with pytest.raises(ServesimError, match="permission denied"):
            check_writable(tmp_path / "locked")


def test_a_pipe_is_read_however_slow_its_writer(tmp_path, monkeypatch):
    # A process substitution (<(sort big.csv)) is a pipe with a writer: only a named FIFO that
    # nothing writes to is refused after FIFO_WAIT_S.
    import threading
    import time

    from sim import fileio

    monkeypatch.setattr(fileio, "FIFO_WAIT_S", 0.2)
    r, w = os.pipe()

    def slow_writer():
        time.sleep(0.5)
        os.write(w, b"late but here\n")
        os.close(w)
    threading.Thread(target=slow_writer).start()
    try:
        with fileio.open_input(f"/dev/fd/{r}") as fh:
            assert fh.read() == b"late but here\n"
    finally:
        os.close(r)
    fifo = tmp_path / "named"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="a FIFO that nothing wrote to for 0.2 s"):
        fileio.open_input(fifo)


# --- integers longer than Python converts (sys.get_int_max_str_digits) ----------------------------
BIG = "9" * (sys.get_int_max_str_digits() + 700)


@pytest.mark.parametrize("argv", [
    ["sim", "chat", "--set", f"workload.num_requests={BIG}"],
    ["sim", "SCENARIO"],
    ["sweep", "chat", "--grid", f"workload.rate=1,{BIG}"],
    ["compare", "chat", "--policies", "fcfs,chunked", "--set", f"workload.rate={BIG}"],
    ["sim", "mooncake", "--set", "workload.trace=TRACE"],
    ["calibrate", "BENCH"],
    ["validate", "BENCH"],
])
def test_an_integer_longer_than_python_converts_is_one_line_and_exit_2(argv, tmp_path):
    """json and tomllib raise a bare ValueError on such a literal: each input says so in one
    short line naming the file (or the field), exit 2, no traceback."""
    (tmp_path / "big.toml").write_text(f'name = "big"\n[workload]\nnum_requests = {BIG}\n')
    (tmp_path / "big.jsonl").write_text(
        f'{{"timestamp": 0, "input_length": {BIG}, "output_length": 5, "hash_ids": [1]}}\n')
    (tmp_path / "big.json").write_text(f'{{"date": "x", "num_prompts": {BIG}}}')
    subst = {"SCENARIO": str(tmp_path / "big.toml"), "workload.trace=TRACE":
             f"workload.trace={tmp_path / 'big.jsonl'}", "BENCH": str(tmp_path / "big.json")}
    out = subprocess.run([sys.executable, "-m", "tui.cli", *[subst.get(a, a) for a in argv]],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 2, out.stderr[-500:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr and len(lines[0]) < 400, lines


def test_a_path_with_a_trailing_separator_is_refused_not_written_without_it(tmp_path):
    """`-o out.csv/` names a folder: nothing is written as `out.csv`, one line says why."""
    target = tmp_path / "out.csv"
    with pytest.raises(ServesimError, match=r"out.csv/: ends with '/', a directory"):
        check_writable(str(target) + "/", "-o")
    with pytest.raises(ServesimError, match=r"ends with '/', a directory"):
        with atomic_open(str(target) + "/") as fh:
            fh.write(b"x")
    assert not target.exists()
    write_atomic(target, "ok")  # (the same name without the separator is a file)
    assert target.read_text() == "ok"


def test_writing_to_a_fifo_nobody_reads_is_refused_after_the_wait(tmp_path, monkeypatch):
    """open() of a FIFO for writing blocks until a reader comes: without one, the output is
    refused in one line after FIFO_WAIT_S; with one, it is written through."""
    import sim.fileio

    monkeypatch.setattr(sim.fileio, "FIFO_WAIT_S", 0.3)
    fifo = tmp_path / "out"
    os.mkfifo(fifo)
    with pytest.raises(ServesimError, match=r"out: cannot write: a FIFO that nothing read for "
                                            r"0.3 s"):
        with atomic_open(fifo) as fh:
            fh.write(b"never")
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    with atomic_open(fifo) as fh:
        fh.write(b"read")
    reader.join(30)
    assert got == [b"read"]
