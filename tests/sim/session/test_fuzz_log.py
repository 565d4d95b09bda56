"""Structure-aware session-log fuzzing: decode a real log into its objects, change fields
(header, the embedded scenario and workload, event records, user actions, footer, the order of
records), encode it again with valid checksums, and run `replay --verify` and `export` on it.
Each must verify correctly (exit 0), report a divergence (exit 1, verify only), or refuse the
log with one line naming it (exit 2); never a traceback. `SERVESIM_FUZZ=N` tries N times as
many logs (tests/fuzz.py)."""

import functools
import math
import re
import struct
import tempfile

import pytest
from hypothesis import event, given, strategies as st

import sim.limits
from sim import Engine, build
from sim.session.log import write_log
from tests.fuzz import fuzz_settings
from tests.helpers import small_scenario
from tests.logcraft import pack_log, unpack_log
from tui.cli import main

pytestmark = pytest.mark.fuzz


@functools.lru_cache(maxsize=None)
def base_log(kind: str) -> bytes:
    """A small real session with every kind of user action."""
    over = ["kv.num_blocks=200", "workload.duration_s=3", "workload.cancel_fraction=0.2",
            'workload.cancel_after_s={dist="uniform", min=0, max=2}']
    if kind == "cluster":
        over += ["cluster.replicas=2"]
    elif kind == "disaggregated":
        over += ['scheduler.policy="disaggregated"']
    elif kind == "data-parallel":
        over += ["model.data_parallel=2"]
    elif kind == "pipeline":
        over += ["model.pipeline_parallel=2"]
    e = build(small_scenario(*over)) if kind != "engine" else Engine(small_scenario(*over))
    e.run_until(0.5)
    e.inject(120, 9, count=2, priority=1)
    e.inject(prompt_text="fuzz me", max_output_tokens=5)
    e.run_until(1.0)
    live = sorted(r for r, q in e.requests.items() if not q.state.is_done)
    if live:
        e.cancel(live[0])
    e.switch_policy("fcfs")
    e.run_until(1.5)
    e.cancel_waiting()
    e.switch_policy("sjf")
    e.run()
    with tempfile.TemporaryDirectory() as d:
        return write_log(f"{d}/s.msgpack", e).read_bytes()


DEEP: list = [1]
for _ in range(40):
    DEEP = [DEEP]
# Values msgpack can hold (ints from -2**63 to 2**64 - 1), from the dull to the hostile.
NASTY = st.sampled_from([None, True, False, 0, -1, 1, 2, 7, 255, 2**31, 2**53 + 1, 2**63 - 1,
                         2**63, 2**64 - 1, -2**63, 0.0, -0.0, 0.5, 1e-300, 1e308, -1e308,
                         math.inf, -math.inf, math.nan, "", "x", "chunked", "fifo", "recompute",
                         "modeled", "measured", "\u4e16", "\x00", b"", b"\x00" * 8,
                         b"\xff" * 8, b"\x00" * 7, [], [1], [[1, 2, 3]], {}, {"a": 1},
                         DEEP])
LEAVES = st.one_of(NASTY, st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
                   st.text(max_size=8), st.binary(max_size=24))
VALUES = st.recursive(LEAVES, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=5),
                                                                       inner, max_size=3)),
                      max_leaves=6)


def paths(obj, prefix=()):
    """Every path to a value inside nested maps and lists."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += paths(v, prefix + (i,))
    return out


def put(root, path, value, delete=False):
    *parents, last = path
    node = root
    for p in parents:
        node = node[p]
    if delete and isinstance(node, dict):
        node.pop(last, None)
    elif delete and isinstance(node, list) and len(node) > 1:
        del node[last]
    else:
        node[last] = value


@st.composite
def mutated_logs(draw):
    kind = draw(st.sampled_from(["engine", "engine", "cluster", "disaggregated", "data-parallel",
                                 "pipeline"]), label="log")
    objs = unpack_log(base_log(kind))
    for _ in range(draw(st.integers(1, 3), label="mutations")):
        how = draw(st.sampled_from(["value", "value", "value", "delete", "array", "structure",
                                    "number"]), label="how")
        i = draw(st.integers(0, len(objs) - 1), label="object")
        if isinstance(objs[i], dict) and "crc" in objs[i]:
            i = 0  # checkpoints are re-made by pack_log: change the header instead
        target = objs[i]
        ps = [p for p in paths(target) if p]
        if how == "structure":
            j = draw(st.integers(0, len(objs) - 1), label="other")
            op = draw(st.sampled_from(["drop", "dup", "swap", "insert"]), label="op")
            if op == "drop" and len(objs) > 3:
                del objs[i]
            elif op == "dup":
                objs.insert(j, objs[i])
            elif op == "swap":
                objs[i], objs[j] = objs[j], objs[i]
            else:
                objs.insert(j, draw(VALUES, label="inserted"))
        elif how == "array":  # one 8-byte element of a packed column (workload, step times)
            byte_paths = [p for p in ps if _at(target, p).__class__ is bytes
                          and len(_at(target, p)) >= 8]
            if byte_paths:
                p = draw(st.sampled_from(byte_paths), label="column")
                b = bytearray(_at(target, p))
                k = draw(st.integers(0, len(b) // 8 - 1), label="element") * 8
                b[k:k + 8] = draw(st.sampled_from([
                    struct.pack("<d", math.nan), struct.pack("<d", math.inf),
                    struct.pack("<d", -1.0), struct.pack("<d", 1e300), struct.pack("<q", -1),
                    struct.pack("<q", 0), struct.pack("<q", 2**62), struct.pack("<q", 10**9),
                    struct.pack("<q", 10**9 + 1)]), label="bytes")
                put(target, p, bytes(b[:len(b) - draw(st.sampled_from([0, 0, 0, 8, 3]))]))
        elif ps:
            p = draw(st.sampled_from(ps), label="path")
            if how == "delete":
                put(target, p, None, delete=True)
            elif how == "number" and isinstance(_at(target, p), (int, float)) \
                    and not isinstance(_at(target, p), bool):
                v = _at(target, p)
                new = draw(st.sampled_from([v + 1, v - 1, v * 2, -v, v * 1000, v / 3]))
                put(target, p, new if -2**63 <= new < 2**64 or isinstance(new, float) else 0)
            else:
                put(target, p, draw(VALUES, label="value"))
        else:
            objs[i] = draw(VALUES, label="replaced")
    return kind, objs


def _at(root, path):
    for p in path:
        root = root[p]
    return root


@pytest.fixture(autouse=True)
def small_machine(monkeypatch):
    monkeypatch.setattr(sim.limits, "available_memory", lambda: 2e9)


@fuzz_settings(25)
@given(log=mutated_logs(), fmt=st.sampled_from(["csv", "jsonl", "chrome"]))
def test_mutated_logs_verify_or_are_refused_with_one_line(tmp_path_factory, capsys, log, fmt):
    kind, objs = log
    path = tmp_path_factory.mktemp("fuzz") / "mutated.msgpack"
    path.write_bytes(pack_log(objs))
    outcomes = []
    for argv, allowed in ((["replay", str(path), "--verify"], (0, 1, 2)),
                          (["export", str(path), "--format", fmt], (0, 2))):
        code = main(argv)
        out, err = capsys.readouterr()
        assert code in allowed, (argv, code, err)
        if code == 2:
            assert err.count("\n") == 1 and str(path) in err, err
        elif code == 1:
            assert err.startswith("servesim: replay diverged at event ") and err.count("\n") == 1
        outcomes.append(code)
    event(f"{kind}: verify exit {outcomes[0]}, export exit {outcomes[1]}")


@pytest.mark.parametrize("bad", ["delete", None, "x", [], [[6]], [[6, 0.5, 1], [0, 0.5]],
                                 [[6, 0.5]], [[-1, 0.5], [0, 0.5]], [[6, math.nan], [0, 0.5]],
                                 [["6", 0.5], [0, 0.5]], [[6, "t"], [0, 0.5]], [1, 2]])
@pytest.mark.parametrize("where", ["action", "footer"])
def test_a_deployment_position_that_is_not_one_is_refused(tmp_path, capsys, bad, where):
    # (the fuzzer found KeyError('at') / IndexError from these: a deployment's actions and
    # footer each say where every instance stood, [steps, clock] per instance)
    objs = unpack_log(base_log("cluster"))
    if where == "action":
        target = next(o[4] for o in objs if isinstance(o, list) and o[0] == 9 and "at" in o[4])
    else:
        target = next(o for o in objs if isinstance(o, dict) and o.get("footer"))
    if bad == "delete":
        del target["at"]
    else:
        target["at"] = bad
    path = tmp_path / "s.msgpack"
    path.write_bytes(pack_log(objs))
    for argv in (["replay", str(path), "--verify"], ["replay", str(path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(path) in err, err
        assert re.search(r"\bat\b", err.replace(str(path), "")), err  # (names the field)
