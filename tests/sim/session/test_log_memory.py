"""Reading a crafted session log costs memory in proportion to what it holds: each record is
checked as it comes, and a large one for its shape before it is unpacked, so a run of empty
arrays (one byte each in the file, some 60 in memory as objects) is refused having made
little."""

import json
import subprocess
import sys

import msgpack
import pytest

from sim import Engine
from sim.session.log import _SMALL_OBJECT, KIND_CODE, encode, read_log, write_log
from sim.session.replay import verify
from tests.helpers import small_scenario, workload_of
from tests.logcraft import pack_log, unpack_log

SIZE = 15 << 20  # the crafted logs' size
RUN = b"\xdd" + SIZE.to_bytes(4, "big") + b"\x90" * SIZE  # an array of SIZE empty arrays
PK = msgpack.Packer(use_bin_type=True)

# `servesim replay --verify LOG` in a fresh process, tracing its allocations from the call on.
CHILD = """
import json, sys, tracemalloc
from tui.cli import main
tracemalloc.start()
try:
    code = main(["replay", "--verify", sys.argv[1]])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "peak": tracemalloc.get_traced_memory()[1]}))
"""


@pytest.fixture(scope="module")
def objs(tmp_path_factory):
    e = Engine(small_scenario("workload.duration_s=3"))
    e.run()
    path = write_log(tmp_path_factory.mktemp("log") / "s.msgpack", e)
    return unpack_log(path.read_bytes())


def _packed_record(rec, field: int, raw: bytes) -> bytes:
    """`rec` packed with its field `field` (1: the first after the kind) replaced by `raw`."""
    parts = [PK.pack(x) for x in rec]
    parts[field] = raw
    return bytes([0x90 + len(rec)]) + b"".join(parts)


def _crafts(objs):
    header = PK.pack(objs[0])
    steps = next(o for o in objs if isinstance(o, list) and o[0] == KIND_CODE["steps"])
    action = [KIND_CODE["action"], 0.0, 0, "cancel_waiting", {}]
    mark = "(the hash_ids)"
    hashed = PK.pack(dict(objs[0], workload=dict(objs[0]["workload"], hash_ids=mark)))
    # Records each just under _SMALL_OBJECT (unpacked without a look at their shape), as many
    # as SIZE takes, each a run of empty arrays in one field.
    k = _SMALL_OBJECT - 64
    small_run = b"\xdc" + k.to_bytes(2, "big") + b"\x90" * k
    arrival = next(o for o in objs if isinstance(o, list) and o[0] == KIND_CODE["arrival"])
    return {
        "a run of empty records": header + b"\x90" * SIZE,
        "small steps records with runs in decode": header + _packed_record(
            steps, 5, small_run) * (SIZE // k + 1),
        "small steps records with runs in prefill": header + _packed_record(
            steps, 4, small_run) * (SIZE // k + 1),
        "small arrivals with runs in a field": header + _packed_record(
            arrival, 1, small_run) * (SIZE // k + 1),
        "a run in a steps record's decode": header + _packed_record(steps, 5, RUN),
        "a run in a steps record's ends": header + _packed_record(steps, 3, RUN),
        "a run in an action's args": header + _packed_record(
            action, 4, b"\x81" + PK.pack("at") + RUN),
        "a run in the header's hash_ids": hashed.replace(PK.pack(mark), RUN) + pack_log(objs[1:]),
    }


@pytest.mark.parametrize("craft", ["a run of empty records", "small steps records with runs in decode",
                                   "small steps records with runs in prefill",
                                   "small arrivals with runs in a field",
                                   "a run in a steps record's decode",
                                   "a run in a steps record's ends", "a run in an action's args",
                                   "a run in the header's hash_ids"])
def test_a_crafted_log_is_refused_in_memory_proportional_to_it(objs, tmp_path, craft):
    data = _crafts(objs)[craft]
    assert len(data) > SIZE
    path = tmp_path / "crafted.msgpack"
    path.write_bytes(data)
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True,
                         text=True, timeout=300)
    r = json.loads(out.stdout)
    assert r["code"] == 2
    assert len(out.stderr.strip().splitlines()) == 1 and str(path) in out.stderr
    assert r["peak"] < 5 * len(data), f"{r['peak'] / len(data):.1f}x its size"


def test_a_large_record_of_the_right_shape_is_read(tmp_path):
    """A long run of identical decode steps, and an injection of a long prompt's text, are
    records larger than what is unpacked unchecked: their shapes pass and the log replays."""
    sc = small_scenario("kv.num_blocks=8000")
    e = Engine(sc, workload=workload_of([(0.0, 16, 12_000), (0.0, 16, 12_000)]))
    e.run_until(1.0)
    e.inject(prompt_text="x" * 70_000, max_output_tokens=4)
    e.run()
    path = write_log(tmp_path / "long.msgpack", e)
    log = read_log(path)
    large = {r[0] for r in log.records if len(PK.pack(r)) > _SMALL_OBJECT}
    assert large == {KIND_CODE["steps"], KIND_CODE["action"]}
    assert log.records == [encode(x) for x in e.events]
    assert verify(read_log(path, check_events=False))[1] is None
