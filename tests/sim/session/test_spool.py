"""sim/session/spool.py: a session whose events are moved to disk as it runs writes the very log
it would have written from memory, and replays exactly."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sim import Engine, build, load_scenario
from sim.errors import LogError
from sim.session.log import read_log, write_log
from sim.session.replay import verify
from sim.session.spool import Spool
from tests.helpers import small_scenario
from tests.logcraft import unpack_log

ROOT = Path(__file__).resolve().parents[3]


def _objects(path) -> list:
    """The log's objects but the summary's wall-clock time (a property of the run, not of the
    session) and the checkpoint that covers it."""
    objs = unpack_log(path.read_bytes())
    del objs[-2]["summary"]["wall_s"], objs[-1]["crc"]
    return objs


def _drive(engine, spool=None):
    """A session in slices, with actions between them, trimming the spool after each."""
    held = []
    for i, t in enumerate((0.5, 1.0, 2.0, 3.0, 4.5, 6.0)):
        engine.run_until(t)
        if i == 1:
            engine.inject(300, 40, count=3)
        elif i == 3:
            engine.switch_policy("fcfs")
        elif i == 4:
            engine.cancel_waiting()
        if spool is not None:
            spool.trim()
            held.append(max(len(events) for _, events in spool._streams()))
    return held


SCENARIOS = [
    lambda: Engine(small_scenario("workload.cancel_fraction=0.1")),
    lambda: build(load_scenario("replicas", ["workload.duration_s=6"])),
    lambda: build(load_scenario("disaggregated", ["workload.duration_s=6"])),
]


@pytest.mark.parametrize("make", SCENARIOS, ids=["engine", "replicas", "disaggregated"])
def test_a_spooled_session_writes_the_log_it_would_from_memory(tmp_path, make):
    reference = make()
    _drive(reference)
    want = _objects(write_log(tmp_path / "memory.msgpack", reference))

    engine = make()
    spool = Spool(engine, keep=5, dir=str(tmp_path))
    held = _drive(engine, spool)
    assert max(held) <= 5 and sum(spool.spooled.values()) > 100
    path = write_log(tmp_path / "spooled.msgpack", engine, records=spool.records())
    assert _objects(path) == want
    assert verify(read_log(path, check_events=False))[1] is None
    # exporting again, later, still gives the whole session
    engine.run_until(8.0)
    spool.trim()
    reference.run_until(8.0)
    again = write_log(tmp_path / "again.msgpack", engine, records=spool.records())
    assert _objects(again) == _objects(write_log(tmp_path / "memory2.msgpack", reference))
    spool.close()


def test_the_spool_leaves_no_file_behind(tmp_path):
    engine = Engine(small_scenario())
    spool = Spool(engine, keep=5, dir=str(tmp_path))
    engine.run_until(2.0)
    spool.trim()
    assert spool.bytes > 0 and os.listdir(tmp_path) == []  # (unnamed files)
    spool.close()


def test_a_spool_that_cannot_be_written_says_so_and_keeps_the_events(tmp_path):
    engine = Engine(small_scenario())
    engine.run_until(2.0)
    n = len(engine.events)
    spool = Spool(engine, keep=5, dir=str(tmp_path / "missing"))
    with pytest.raises(LogError, match="missing"):
        spool.trim()
    assert len(engine.events) == n and not spool.spooled


# Writes that fail part way (here past a file-size limit, as on a full disk), in a child
# process: the export is refused with one line, leaves no file, and a later one is whole.
FULL = """
import os, resource, signal, sys
from sim import Engine
from sim.errors import LogError
from sim.session.log import read_log, write_log
from sim.session.replay import verify
from sim.session.spool import Spool
from tests.helpers import small_scenario
d = sys.argv[1]
e = Engine(small_scenario())
spool = Spool(e, keep=5, dir=d)
e.run_until(4.0)
spool.trim()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (spool.bytes + 100, resource.RLIM_INFINITY))
try:
    write_log(d + "/cut.msgpack", e, records=spool.records())
except LogError as err:
    print("refused:", err)
e.run_until(5.0)
try:
    spool.trim()
except LogError as err:
    print("spool refused:", err)
print("left:", sorted(os.listdir(d)))
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
spool.trim()
path = write_log(d + "/whole.msgpack", e, records=spool.records())
print("verified:", verify(read_log(path, check_events=False))[1] is None)
"""


def test_an_export_or_a_spool_that_runs_out_of_room_leaves_nothing_cut(tmp_path):
    out = subprocess.run([sys.executable, "-c", FULL, str(tmp_path)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stderr
    assert lines[0].startswith("refused:") and "cut.msgpack" in lines[0]
    assert lines[1].startswith("spool refused:") and "cannot write" in lines[1]
    assert lines[2:] == ["left: []", "verified: True"]
