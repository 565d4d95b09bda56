import functools
import json
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import assume, given, strategies as st

from sim import Engine, build, load_scenario, summarize
from sim.errors import LogError
from sim.session.export import to_chrome, to_csv
from sim.session.log import FORMAT, KIND_CODE, encode, read_log, write_log
from sim.session.replay import Replayer, verify
from tests.fuzz import fuzz_settings
from tests.logcraft import pack_log, unpack_log
from tests.helpers import small_scenario, workload_of
from tui.cli import main


def busy_session():
    """A session with injections, cancellations in several states and policy switches."""
    e = Engine(small_scenario("kv.num_blocks=300", "workload.cancel_fraction=0.15",
                              "workload.duration_s=12"))
    e.run_until(1.0)
    e.inject(300, 40, count=4)
    e.inject(prompt_text="hello, paged attention", max_output_tokens=12)
    e.run_until(2.0)
    states = set()
    for _ in range(200):
        e.step()
        for r in list(e.policy.waiting) + list(e.policy.running):
            key = (r.state.value, r.is_prefill)
            if key not in states:
                states.add(key)
                e.cancel(r.req_id)
                break
    e.switch_policy("fcfs")
    e.run_until(5.0)
    e.cancel_waiting()
    e.switch_policy("chunked")
    e.run()
    return e, states


def test_round_trip(tmp_path):
    e, _ = busy_session()
    p = write_log(tmp_path / "s.msgpack", e)
    log = read_log(p)
    assert log.records == [encode(x) for x in e.events]
    assert log.header["format"] == FORMAT and log.header["policy"] == "chunked"
    assert log.footer["step"] == e.step_count and log.footer["now"] == e.now
    assert log.footer["summary"]["requests"]["total"] == e.counts["arrived"]
    w = log.workload()
    assert np.array_equal(w.arrival, e.workload.arrival)
    kinds = [x.kind for x in log.events]
    assert kinds.count("action") >= 6


def test_replay_verify_with_actions(tmp_path):
    e, states = busy_session()
    assert {"waiting", "running"} <= {s for s, _ in states}
    log = read_log(write_log(tmp_path / "s.msgpack", e))
    r, div = verify(log)
    assert div is None, div.describe()
    assert r.engine.counts == e.counts and r.engine.now == e.now


def test_export_mid_session_replays_to_the_same_point(tmp_path):
    e = Engine(small_scenario())
    e.run_until(3.0)
    e.inject(100, 10)
    e.run_until(4.5)
    log = read_log(write_log(tmp_path / "mid.msgpack", e))
    r, div = verify(log)
    assert div is None and r.engine.step_count == e.step_count and r.engine.now == e.now
    assert not r.engine.done  # a live session, cut where it was exported


def test_sliced_and_unsliced_runs_log_the_same_events(tmp_path):
    a, b = Engine(small_scenario()), Engine(small_scenario())
    t = 0.0
    while not a.done:
        t += 0.05  # a screen's ticks
        a.run_until(t)
    b.run()
    assert [encode(x) for x in a.events] == [encode(x) for x in b.events]


def test_divergence_is_found_and_named(tmp_path):
    e, _ = busy_session()
    log = read_log(write_log(tmp_path / "s.msgpack", e))
    i = next(k for k, r in enumerate(log.records) if r[0] == 7)  # a finish
    log.records[i][1] += 1.0
    _, div = verify(log)
    assert div is not None and div.index == i
    assert div.expected["kind"] == "finish" and div.expected["t"] == div.got["t"] + 1.0


def repack(path, out, mutate_header):
    """Rewrite a log with a changed header and valid checksums (a consistent but different
    session), using only the documented layout."""
    up = msgpack.Unpacker(open(path, "rb"), raw=False, strict_map_key=False)
    objs = list(up)
    header, rest = objs[0], objs[1:]
    mutate_header(header)
    import zlib
    pk = msgpack.Packer(use_bin_type=True)
    with open(out, "wb") as fh:
        chunk = pk.pack(header)  # checkpoints cover the bytes since the last (header first)
        for o in rest:
            if isinstance(o, dict) and "crc" in o:
                o = dict(o, crc=zlib.crc32(chunk))
                fh.write(chunk + pk.pack(o))
                chunk = b""
            else:
                chunk += pk.pack(o)


def test_cli_verify_exit_codes(tmp_path, capsys):
    p = tmp_path / "s.msgpack"
    assert main(["sim", "chat", "--set", "workload.duration_s=8", "--log", str(p)]) == 0
    capsys.readouterr()
    assert main(["replay", str(p), "--verify"]) == 0
    assert "events identical" in capsys.readouterr().out
    bad = tmp_path / "bad.msgpack"
    repack(p, bad, lambda h: h["scenario"]["scheduler"].update(max_num_seqs=2))
    assert main(["replay", str(bad), "--verify"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("servesim: replay diverged at event ") and "expected" in err


def test_measured_clock_replays_recorded_durations(tmp_path):
    class FakeExecutor:
        name, device = "fake", "cpu"

        def execute(self, work):
            sum(range(2000))  # take a little, varying, wall time
            return {s.req_id: 1 for s in work.seqs if s.sample}

    sc = small_scenario("workload.duration_s=2", "compute.clock=\"measured\"")
    e = Engine(sc, executor=FakeExecutor())
    e.run()
    log = read_log(write_log(tmp_path / "m.msgpack", e))
    r, div = verify(log, lambda sc: FakeExecutor())
    assert div is None, div.describe()
    assert r.engine.now == e.now  # wall times differ run to run; the replay used the recorded


def test_measured_clock_with_no_compute_replays(tmp_path):
    # With no executor the engine ran decode steps in runs, which record no durations: the log
    # of `sim --set compute.clock="measured"` could not be replayed.
    e = Engine(small_scenario("workload.duration_s=3", "compute.clock=\"measured\""))
    e.run()
    log = read_log(write_log(tmp_path / "m.msgpack", e))
    r, div = verify(log, lambda sc: None)
    assert div is None, div.describe()
    assert r.engine.now == e.now and e.step_count > 100


@functools.lru_cache(maxsize=1)
def _small_log() -> bytes:
    import tempfile
    e = Engine(small_scenario("workload.duration_s=4"))
    e.run()
    with tempfile.TemporaryDirectory() as d:
        return write_log(f"{d}/s.msgpack", e).read_bytes()


@pytest.mark.fuzz
@fuzz_settings(40)
@given(data=st.data())
def test_truncated_or_flipped_logs_fail_cleanly(tmp_path_factory, data):
    original = _small_log()
    blob = bytearray(original)
    if data.draw(st.booleans(), label="truncate"):
        blob = blob[: data.draw(st.integers(0, len(blob) - 1), label="length")]
    else:
        for _ in range(data.draw(st.integers(1, 3), label="flips")):
            i = data.draw(st.integers(0, len(blob) - 1), label="offset")
            blob[i] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    assume(bytes(blob) != original)  # two flips of one bit cancel out
    p = tmp_path_factory.mktemp("fuzz") / "x.msgpack"
    p.write_bytes(bytes(blob))
    with pytest.raises(LogError) as e:
        read_log(p)
    msg = str(e.value)
    assert str(p) in msg and "\n" not in msg


def test_cli_bad_logs_exit_2_with_one_line(tmp_path, capsys):
    small_log = _small_log()
    cases = {
        "empty.msgpack": b"",
        "foreign.msgpack": b"PK\x03\x04 not a log at all",
        "newer.msgpack": msgpack.packb({"magic": "servesim-log", "format": FORMAT + 1}),
        "cut.msgpack": small_log[: len(small_log) // 2],
    }
    expect = {"empty.msgpack": "empty file", "foreign.msgpack": "not a servesim session log",
              "newer.msgpack": "is newer than this servesim", "cut.msgpack": "truncated"}
    for name, blob in cases.items():
        p = tmp_path / name
        p.write_bytes(blob)
        for argv in (["replay", str(p)], ["export", str(p), "--format", "csv"]):
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and expect[name] in err and str(p) in err, err
    assert main(["replay", str(tmp_path / "missing.msgpack")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_write_is_atomic(tmp_path):
    e = Engine(small_scenario("workload.duration_s=2"))
    e.run()
    p = tmp_path / "keep.msgpack"
    p.write_bytes(b"precious")
    e.events.append(object())  # an event that cannot be encoded: the write fails midway
    with pytest.raises(Exception):
        write_log(p, e)
    assert p.read_bytes() == b"precious"
    assert [x.name for x in tmp_path.iterdir()] == ["keep.msgpack"]


def test_chrome_trace_nests_and_matches_csv(tmp_path):
    e, _ = busy_session()
    log = read_log(write_log(tmp_path / "s.msgpack", e))
    r = Replayer(log)
    r.run()
    trace = json.loads(to_chrome(log, r.engine))
    evs = trace["traceEvents"]
    assert all({"ph", "pid", "name"} <= set(x) for x in evs)
    spans = [x for x in evs if x["ph"] == "X"]
    assert all(x["dur"] >= 0 and "ts" in x for x in spans)
    by_req = {}
    for x in spans:
        if x["pid"] == 1:
            by_req.setdefault(x["tid"], []).append(x)
    rows = {int(row.split(",")[0]): row.split(",") for row in to_csv(r.engine).splitlines()[1:]}
    cols = to_csv(r.engine).splitlines()[0].split(",")
    col = {c: i for i, c in enumerate(cols)}
    checked = 0
    for rid, xs in by_req.items():
        parent = [x for x in xs if x["name"] == "request"]
        assert len(parent) == 1
        p = parent[0]
        kids = sorted((x for x in xs if x["name"] != "request"), key=lambda x: x["ts"])
        for k in kids:  # children inside the parent, one after another
            assert p["ts"] - 1e-3 <= k["ts"] and k["ts"] + k["dur"] <= p["ts"] + p["dur"] + 1e-3
        for a, b in zip(kids, kids[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3
        row = rows[rid]
        assert kids[0]["name"] == "queued"
        assert kids[0]["ts"] == pytest.approx(float(row[col["arrival_s"]]) * 1e6, abs=1e-2)
        if row[col["state"]] == "finished":
            assert kids[-1]["name"] == "decode"
            end = kids[-1]["ts"] + kids[-1]["dur"]
            assert end == pytest.approx(float(row[col["finish_s"]]) * 1e6, abs=1e-2)
            first_decode = next(k for k in kids if k["name"] == "decode")
            assert first_decode["ts"] == pytest.approx(
                float(row[col["first_token_s"]]) * 1e6, abs=1e-2)
            checked += 1
    assert checked > 10
    counters = {x["name"] for x in evs if x["ph"] == "C"}
    assert counters == {"kv_used_blocks", "batch_size", "queue_length"}


def _bytes_read() -> int | None:
    """What this process has read so far (/proc/self/io's rchar), or None where not known."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    except (OSError, StopIteration, ValueError):
        return None


def test_what_cannot_be_a_log_is_refused_at_once(tmp_path, capsys):
    for path, needle in (("/dev/zero", "not a servesim session log"),
                         (str(tmp_path), "is a directory")):
        for argv in (["replay", path, "--verify"], ["export", path, "--format", "jsonl"]):
            before = _bytes_read()
            assert main(argv) == 2
            after = _bytes_read()
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and needle in err and path in err, err
            # /dev/zero is not read to the end, nor far: a byte count, not a stopwatch (about
            # 4-13 KB, imports included; the bound leaves room for a module loaded on the way)
            if before is not None and after is not None:
                assert after - before < 8 << 20, (argv, after - before)


def _crafted(tmp_path, name, mutate):
    from tests.logcraft import pack_log, unpack_log

    objs = unpack_log(_busy_log())
    mutate(objs)
    p = tmp_path / name
    p.write_bytes(pack_log(objs))
    return p


@functools.lru_cache(maxsize=1)
def _busy_log() -> bytes:
    import tempfile
    e, _ = busy_session()
    with tempfile.TemporaryDirectory() as d:
        return write_log(f"{d}/s.msgpack", e).read_bytes()


def _first(objs, code, action=None):
    return next(o for o in objs if isinstance(o, list) and o[0] == code
                and (action is None or o[3] == action))


def _set_arg(objs, action, key, value):
    _first(objs, 9, action)[4][key] = value


CRAFTED = {
    "footer step of the wrong type": (lambda o: o[-2].update(step="many"), "footer: step = 'many'"),
    "absurd footer step": (lambda o: o[-2].update(step=2**64 - 1), "footer: step = 1844674"),
    "footer time not finite": (lambda o: o[-2].update(now=float("nan")), "footer: now = nan"),
    "summary not plain": (lambda o: o[-2].update(summary={"x": b"\x00"}), "footer: summary"),
    "unknown policy": (lambda o: o[0].update(policy="fifo"), "header: policy = 'fifo'"),
    "unknown clock": (lambda o: o[0].update(clock="sundial"), "header: clock = 'sundial'"),
    "scenario not a table": (lambda o: o[0].update(scenario=[1, 2]), "header: scenario"),
    "workload lengths of zero": (
        lambda o: o[0]["workload"].update(prompt=b"\x00" * len(o[0]["workload"]["prompt"])),
        "header's workload: prompt: lengths must be 1"),
    "workload arrays of different lengths": (
        lambda o: o[0]["workload"].update(output=o[0]["workload"]["output"][:-8]),
        "header's workload: its arrays differ in length"),
    "arrivals not sorted": (
        lambda o: o[0]["workload"].update(arrival=o[0]["workload"]["arrival"][::-1]),
        "header's workload: arrival"),
    "unknown action": (lambda o: _first(o, 9).__setitem__(3, "reboot"), "unknown action 'reboot'"),
    "action args not a map": (lambda o: _first(o, 9).__setitem__(4, [1]), "action field args"),
    "inject past int64": (lambda o: _set_arg(o, "inject", "prompt_len", 2**64 - 1),
                          "inject prompt_len = 18446744073709551615"),
    "inject with a float count": (lambda o: _set_arg(o, "inject", "count", 1.5),
                                  "inject count = 1.5"),
    "inject text past latin-1": (lambda o: _set_arg(o, "inject", "prompt_text", "\u4e16"),
                                 "inject prompt_text"),
    "inject lacking its length": (lambda o: _first(o, 9, "inject")[4].pop("max_output_tokens"),
                                  "inject lacks max_output_tokens"),
    "cancel of a string id": (lambda o: _set_arg(o, "cancel", "req_id", "3"), "cancel req_id = '3'"),
    "switch to an unknown policy": (lambda o: _set_arg(o, "switch_policy", "policy", "fifo"),
                                    None),
    "action at an absurd step": (lambda o: _first(o, 9).__setitem__(2, 2**63 + 5),
                                 "action field step"),
    "action at a time not finite": (lambda o: _first(o, 9).__setitem__(1, float("inf")),
                                    "action field t = inf"),
    "event of an unknown kind": (lambda o: _first(o, 7).__setitem__(0, 99), "not an event record"),
    "steps with a string time": (lambda o: _first(o, 4).__setitem__(1, "soon"), "steps field t = 'soon'"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_logs_with_valid_checksums_exit_2_with_one_line(tmp_path, capsys, case):
    mutate, needle = CRAFTED[case]
    _refused_by_every_reader(_crafted(tmp_path, "crafted.msgpack", mutate), needle, capsys)


def _refused_by_every_reader(p, needle, capsys) -> None:
    """replay (with and without --verify) and every export: exit 2, one line naming the file
    (and `needle` when given), no traceback."""
    for argv in (["replay", str(p), "--verify"], ["replay", str(p)],
                 ["export", str(p), "--format", "jsonl"], ["export", str(p), "--format", "csv"],
                 ["export", str(p), "--format", "chrome"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(p) in err and "Traceback" not in err, (argv, err)
        assert needle is None or needle in err, (argv, err)


def test_a_record_whose_time_is_a_list_is_refused_by_verify(tmp_path, capsys):
    # Found by the log fuzzer: the regenerated time (a NumPy number) compared with a list.
    p = _crafted(tmp_path, "t.msgpack", lambda o: _first(o, 7).__setitem__(1, []))
    assert main(["replay", str(p), "--verify"]) == 2
    err = capsys.readouterr().err
    assert "finish field t = []" in err and err.count("\n") == 1


# --- the header against itself, its events and its footer ----------------------------------------
# (a reporter's edits with valid checksums: each gave a traceback, or a "verified" that `export`
# contradicted, before the header's every field was checked against the rest)
def _measured(objs):
    for h in (objs[0], objs[0]["compute"], objs[0]["scenario"]["compute"]):
        h["clock"] = "measured"


def _step_durations(objs):
    _first(objs, 4)[8] = _first(objs, 4)[3]


HEADER_CRAFTED = {
    "disaggregated policy without a cluster": (
        lambda o: o[0].update(policy="disaggregated"),
        "header: policy = 'disaggregated': a deployment of several instances, but the header "
        "lacks 'cluster'"),
    "no compute": (lambda o: o[0].pop("compute"), "header lacks 'compute'"),
    "compute without a backend": (
        lambda o: [c.pop("backend") for c in (o[0]["compute"], o[0]["scenario"]["compute"])],
        "header: compute.backend = None"),
    "compute other than the scenario's": (
        lambda o: o[0]["compute"].update(backend="numpy"),
        "header: compute.backend = 'numpy': differs from the scenario's compute.backend"),
    "compute with an unknown field": (lambda o: o[0]["compute"].update(junk=3),
                                      "header: compute.junk = 3: unknown field"),
    "measured clock on a modeled log": (lambda o: o[0].update(clock="measured"),
                                        "header: clock = 'measured': differs from compute.clock"),
    "measured clock everywhere, steps without durations": (
        _measured, "header: clock = 'measured', but event 6 (steps) records no step durations"),
    "modeled clock, steps with durations": (
        _step_durations, "header: clock = 'modeled', but event 6 (steps) records measured"),
    "seed other than the scenario's": (lambda o: o[0].update(seed=o[0]["seed"] + 1),
                                       "header: seed = 8: differs from the scenario's seed = 7"),
    "no seed": (lambda o: o[0].pop("seed"), "header lacks 'seed'"),
    "unknown header field": (lambda o: o[0].update(junk=1), "header: unknown field 'junk'"),
    "a deployment in format 1": (
        lambda o: o[0].update(format=1, cluster={"mode": "replicas", "router": "round-robin",
                                                 "instances": [{"role": "replica",
                                                                "policy": "chunked"}]}),
        "header: unknown field 'cluster' (format 1 has no deployments)"),
    "scenario without a name": (lambda o: o[0]["scenario"].pop("name"),
                                "header: scenario.name = None"),
    "workload without hash_ids": (lambda o: o[0]["workload"].pop("hash_ids"),
                                  "header's workload: lacks 'hash_ids'"),
    "workload with an unknown field": (lambda o: o[0]["workload"].update(junk=1),
                                       "header's workload: unknown field 'junk'"),
    "a stream mark in a single engine's log": (lambda o: o.insert(1, [14, 0.0, -1]),
                                               "event 0: a stream mark, but the header has no"),
    "footer step past the events": (lambda o: o[-2].update(step=2**62),
                                    "footer: step = 4611686018427387904: the events end at step"),
    "footer step short of the events": (lambda o: o[-2].update(step=1),
                                        "footer: step = 1: the events end at step"),
    "footer time before the last step": (lambda o: o[-2].update(now=0.0),
                                         "footer: now = 0.0: before the end of the last step"),
    "footer positions in a single engine's log": (
        lambda o: o[-2].update(at=[[1, 0.5]]), "footer: at = [[1, 0.5]]: a position per instance"),
}


@pytest.mark.parametrize("case", sorted(HEADER_CRAFTED))
def test_a_header_that_contradicts_itself_is_refused_with_one_line(tmp_path, capsys, case):
    mutate, needle = HEADER_CRAFTED[case]
    _refused_by_every_reader(_crafted(tmp_path, "crafted.msgpack", mutate), needle, capsys)


@functools.lru_cache(maxsize=None)
def _deployment_log(kind: str) -> bytes:
    """A small session of two replicas or a disaggregated pair, with a user action."""
    import tempfile

    from sim import build
    over = {"replicas": ["cluster.replicas=2", 'cluster.router="least-kv"'],
            "disaggregated": ['scheduler.policy="disaggregated"'],
            "disaggregated 2:3": ['scheduler.policy="disaggregated"', "cluster.prefill_instances=2",
                                  "cluster.decode_instances=3", 'cluster.router="least-kv"']}[kind]
    c = build(small_scenario("workload.duration_s=3", "kv.num_blocks=400", *over))
    c.run_until(1.0)
    c.inject(100, 8)
    c.run()
    with tempfile.TemporaryDirectory() as d:
        return write_log(f"{d}/c.msgpack", c).read_bytes()


def _cluster(o):
    return o[0]["cluster"]


def _instances(**kv):
    return lambda o: [i.update(kv) for i in _cluster(o)["instances"]]


DEPLOYMENT_CRAFTED = {
    ("replicas", "no cluster"): (lambda o: o[0].pop("cluster"),
                                 "event 0: a stream mark, but the header has no 'cluster'"),
    ("replicas", "cluster not a table"): (lambda o: o[0].update(cluster=[1]), "header: cluster"),
    ("replicas", "unknown mode"): (lambda o: _cluster(o).update(mode="bogus"),
                                   "header: cluster.mode = 'bogus'"),
    ("replicas", "mode of the other deployment"): (
        lambda o: _cluster(o).update(mode="disaggregated"),
        "header: cluster.mode = 'disaggregated': expected 'replicas' for policy = 'chunked'"),
    ("replicas", "unknown router"): (lambda o: _cluster(o).update(router="bogus"),
                                     "header: cluster.router = 'bogus': not a router"),
    ("replicas", "router other than the scenario's"): (
        lambda o: _cluster(o).update(router="round-robin"),
        "header: cluster.router = 'round-robin': differs from the scenario's cluster.router"),
    ("replicas", "no router"): (lambda o: _cluster(o).pop("router"),
                                "header: cluster lacks 'router'"),
    ("replicas", "unknown role"): (_instances(role="bogus"),
                                   "header: cluster.instances[0].role = 'bogus'"),
    ("replicas", "unknown instance policy"): (_instances(policy="bogus"),
                                              "header: cluster.instances[0].policy = 'bogus'"),
    ("replicas", "instance policy other than the header's"): (
        _instances(policy="fcfs"), "header: cluster.instances[0].policy = 'fcfs': expected"),
    ("replicas", "an instance that is not a table"): (
        lambda o: _cluster(o)["instances"].__setitem__(1, "replica"),
        "header: cluster.instances[1] = 'replica'"),
    ("replicas", "one instance too few"): (
        lambda o: _cluster(o)["instances"].pop(),
        "header: cluster.instances: 1 of them, but the scenario's cluster.replicas = 2"),
    ("replicas", "three times the instances"): (
        lambda o: _cluster(o).update(instances=_cluster(o)["instances"] * 3),
        "header: cluster.instances: 6 of them"),
    ("replicas", "disaggregated policy"): (
        lambda o: o[0].update(policy="disaggregated"),
        "header: cluster.mode = 'replicas': expected 'disaggregated'"),
    ("replicas", "footer step not the instances' sum"): (
        lambda o: o[-2].update(step=o[-2]["step"] + 1), "footer: step = "),
    ("replicas", "footer position past an instance's events"): (
        lambda o: o[-2]["at"][1].__setitem__(0, 2**62),
        "footer: at[1] = [4611686018427387904"),
    ("disaggregated", "no cluster"): (
        lambda o: o[0].pop("cluster"),
        "header: policy = 'disaggregated': a deployment of several instances, but the header "
        "lacks 'cluster'"),
    ("disaggregated", "a router"): (lambda o: _cluster(o).update(router="least-kv"),
                                    "header: cluster.router = 'least-kv': expected None"),
    ("disaggregated", "roles swapped"): (
        lambda o: _cluster(o)["instances"].reverse(),
        "header: cluster.instances[0].role = 'decode': expected 'prefill'"),
    ("disaggregated", "instance policy fcfs"): (
        _instances(policy="fcfs"), "header: cluster.instances[0].policy = 'fcfs': expected"),
    ("disaggregated", "one instance"): (
        lambda o: _cluster(o)["instances"].pop(),
        "header: cluster.instances: 1 of them, but a disaggregated pair (prefill, decode) has 2"),
    ("disaggregated", "a single policy"): (
        lambda o: o[0].update(policy="chunked"),
        "header: cluster.mode = 'disaggregated': expected 'replicas' for policy = 'chunked'"),
    ("disaggregated 2:3", "one decode instance fewer"): (
        lambda o: _cluster(o)["instances"].pop(),
        "header: cluster.instances: 4 of them, but a disaggregated deployment (2 prefill, 3 "
        "decode) has 5"),
    ("disaggregated 2:3", "the scenario says 3:3"): (
        lambda o: o[0]["scenario"]["cluster"].update(prefill_instances=3),
        "header: cluster.instances: 5 of them, but a disaggregated deployment (3 prefill, 3 "
        "decode) has 6"),
    ("disaggregated 2:3", "a decode instance as a prefill one"): (
        lambda o: _cluster(o)["instances"][2].update(role="prefill"),
        "header: cluster.instances[2].role = 'prefill': expected 'decode'"),
    ("disaggregated 2:3", "no router"): (
        lambda o: _cluster(o).update(router=None),
        "header: cluster.router = None: differs from the scenario's cluster.router = 'least-kv'"),
    ("disaggregated 2:3", "a count that is no count"): (
        lambda o: o[0]["scenario"]["cluster"].update(decode_instances="3"),
        "header: the scenario's cluster.prefill_instances = 2, decode_instances = '3': expected "
        "counts of 1 or more"),
}


@pytest.mark.parametrize("kind,case", sorted(DEPLOYMENT_CRAFTED))
def test_a_deployment_header_that_contradicts_itself_is_refused(tmp_path, capsys, kind, case):
    from tests.logcraft import pack_log, unpack_log

    mutate, needle = DEPLOYMENT_CRAFTED[kind, case]
    objs = unpack_log(_deployment_log(kind))
    mutate(objs)
    p = tmp_path / "c.msgpack"
    p.write_bytes(pack_log(objs))
    _refused_by_every_reader(p, needle, capsys)


@pytest.mark.parametrize("kind", ["replicas", "disaggregated", "disaggregated 2:3"])
def test_deployment_logs_as_written_verify(tmp_path, capsys, kind):
    p = tmp_path / "c.msgpack"
    p.write_bytes(_deployment_log(kind))
    assert main(["replay", str(p), "--verify"]) == 0
    assert "events identical" in capsys.readouterr().out


def test_a_single_engine_log_of_a_replicas_scenario_still_reads(tmp_path):
    # (`bench log` and the API run a plain Engine on any scenario: no `cluster` in its header)
    e = Engine(small_scenario("workload.duration_s=2", "cluster.replicas=3"))
    e.run()
    r, div = verify(read_log(write_log(tmp_path / "s.msgpack", e)))
    assert div is None


class _FakeExecutor:
    name, device = "fake", "cpu"

    def execute(self, work):
        return {s.req_id: 1 for s in work.seqs if s.sample}


@functools.lru_cache(maxsize=1)
def _measured_log() -> bytes:
    import tempfile
    e = Engine(small_scenario("workload.duration_s=2", "compute.clock=\"measured\""),
               executor=_FakeExecutor())
    e.run()
    with tempfile.TemporaryDirectory() as d:
        return write_log(f"{d}/m.msgpack", e).read_bytes()


def test_a_replay_that_outruns_the_recorded_durations_says_so(tmp_path, capsys):
    from tests.logcraft import pack_log, unpack_log

    objs = unpack_log(_measured_log())
    objs[0]["scenario"]["scheduler"]["max_num_batched_tokens"] = 64  # more steps than recorded
    p = tmp_path / "m.msgpack"
    p.write_bytes(pack_log(objs))
    assert main(["replay", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "more steps than the log recorded durations for" in err, err
    assert main(["replay", str(p), "--verify"]) == 1
    assert capsys.readouterr().err.startswith("servesim: replay diverged at event ")


def test_steps_with_a_duration_per_step_only(tmp_path, capsys):
    from tests.logcraft import pack_log, unpack_log

    objs = unpack_log(_measured_log())
    i = next(k for k, o in enumerate(objs[1:]) if isinstance(o, list) and o[0] == 4)
    objs[i + 1][8] *= 2
    p = tmp_path / "m.msgpack"
    p.write_bytes(pack_log(objs))
    for argv in (["replay", str(p), "--verify"], ["export", str(p), "--format", "jsonl"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"event {i}: steps field durs: 2 durations, expected one for each of its 1" in err


def test_a_header_scenario_that_does_not_load_names_the_file_once(tmp_path, capsys):
    def block_size_3(objs):
        objs[0]["scenario"].setdefault("kv", {})["block_size"] = 3

    p = _crafted(tmp_path, "crafted.msgpack", block_size_3)
    assert main(["replay", str(p)]) == 2
    err = capsys.readouterr().err
    assert "the header's scenario does not load: kv.block_size = 3: must be a power of two" in err
    assert err.count(str(p)) == 1, err


@pytest.mark.parametrize("second", ["inject", "switch_policy", "cancel_waiting"])
def test_stepping_a_replay_applies_every_action_recorded_at_that_step(tmp_path, second):
    # Two keys pressed between two steps are two actions at one step: the dashboard's `n` in a
    # replay applied only the first, then stepped on off the recording ("replay diverged").
    e = Engine(small_scenario("workload.duration_s=3"))
    e.run_until(0.5)
    e.inject(40, 8)
    {"inject": lambda: e.inject(30, 6), "switch_policy": lambda: e.switch_policy("fcfs"),
     "cancel_waiting": e.cancel_waiting}[second]()
    at = e.step_count
    e.run_until(1.0)
    log = read_log(write_log(tmp_path / "s.msgpack", e))
    r = Replayer(log)
    r.run_until(0.5)
    assert r.engine.step_count == at and r.engine.counts["injected"] == 0
    r.step()
    assert r.engine.counts["injected"] == (2 if second == "inject" else 1)
    while r.engine.step_count < e.step_count:
        r.step()
    assert r.engine.now == e.now and r.engine.counts == e.counts


@pytest.mark.parametrize("scenario", ["replicas", "disaggregated"])
def test_a_deployment_log_written_before_its_first_step_verifies(tmp_path, scenario):
    # Its replay routed the arrivals due at t = 0, which the session had not yet done.
    from sim import build, load_scenario

    c = build(load_scenario(scenario, []))
    c.inject(50, 5)
    log = read_log(write_log(tmp_path / "c.msgpack", c))
    _, div = verify(log)
    assert div is None, div.describe()


FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("kind", ["single", "replicas", "disaggregated"])
def test_a_log_written_before_actions_said_settled_still_verifies(tmp_path, capsys, kind):
    """Logs written by servesim before actions and footers carried `settled` (at abf1b3c: an
    inject and a cancel mid-run) replay and verify: the regenerated actions' flag is not
    compared with records that never had it."""
    p = FIXTURES / f"before-settled-{kind}.msgpack"
    objs = unpack_log(p.read_bytes())
    assert not any(isinstance(o, dict) and "settled" in o for o in objs)
    assert main(["replay", str(p), "--verify"]) == 0
    assert "events identical" in capsys.readouterr().out


def _set_first_actions_settled(objs, value):
    for o in objs:
        if isinstance(o, list) and o[0] == KIND_CODE["action"]:
            o[4]["settled"] = value
            return
    raise AssertionError("no action")


@pytest.mark.parametrize("kind,value", [("single", 5), ("single", None), ("single", [True]),
                                        ("replicas", True), ("replicas", 5),
                                        ("replicas", [True, "x", False])])
def test_an_actions_settled_flag_of_the_wrong_shape_is_one_line(tmp_path, capsys, kind, value):
    c = build(small_scenario("kv.num_blocks=64",
                             *(("cluster.replicas=2",) if kind == "replicas" else ())),
              workload=workload_of([(0.0, 40, 5), (0.1, 60, 80)]))
    c.run_until(0.15)
    c.inject(50, 6)
    c.run()
    objs = unpack_log(write_log(tmp_path / "ok.msgpack", c, summarize(c)).read_bytes())
    _set_first_actions_settled(objs, value)
    p = tmp_path / "c.msgpack"
    p.write_bytes(pack_log(objs))
    _refused_by_every_reader(p, "settled", capsys)


def test_reading_a_small_log_needs_memory_for_the_file_not_for_the_size_limit(tmp_path):
    """Under an address-space limit of 4 GB a 16 KB log replays and exports (reading it
    reserved MAX_LOG_BYTES, 4 GiB, up front: MemoryError), and a scenario file reads (1 GiB
    reserved)."""
    import resource
    import subprocess
    import sys

    from sim.fileio import read_bounded

    log = tmp_path / "small.msgpack"
    e = Engine(load_scenario("chat", ["workload.duration_s=3"]))
    e.run()
    write_log(log, e, summarize(e))
    code = ("import sys; from sim.session.log import read_log; "
            "from sim.session.replay import verify; "
            "from sim.fileio import read_input_text; "
            f"read_input_text({str(log)!r}, encoding='latin-1'); "
            f"print(verify(read_log({str(log)!r}))[1])")

    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (4_000_000_000, 4_000_000_000))

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         preexec_fn=limited, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stderr[-300:]
    # one byte past the limit says there is more, in chunks
    with open(log, "rb") as fh:
        assert len(read_bounded(fh, 100)) == 101
    with open(log, "rb") as fh:
        assert read_bounded(fh, 1 << 30) == log.read_bytes()
