"""Sweeps: grid parsing and expansion, one row per point and seed, identical rows whatever the
executor, checks before any run, and the search for the highest rate meeting the SLOs."""

import csv
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.deploy import sweep
from sim.errors import ScenarioError, ServesimError
from sim.inputs.scenario import load_scenario
from tui.cli import main

# A few seconds of chat arrivals: each run takes a few hundredths of a second.
SHORT = ["workload.duration_s=8", "kv.num_blocks=3000"]


def rows_without_wall(table: sweep.Table) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in table.rows]


def test_split_values_keeps_commas_inside_tables_arrays_and_strings():
    assert sweep.split_values('1, 2 ,3') == ["1", "2", "3"]
    assert sweep.split_values('{dist = "uniform", min = 1, max = 9},64') == [
        '{dist = "uniform", min = 1, max = 9}', "64"]
    assert sweep.split_values('"a,b",[1, 2]') == ['"a,b"', "[1, 2]"]


def test_parse_axis_reads_values_as_set_does():
    a = sweep.parse_axis('scheduler.policy=fcfs,"chunked"')
    assert (a.key, a.values) == ("scheduler.policy", ("fcfs", "chunked"))
    a = sweep.parse_axis(" kv.block_size = 8, 16 ")
    assert (a.key, a.values, a.texts) == ("kv.block_size", (8, 16), ("8", "16"))
    a = sweep.parse_axis("workload.prompt_tokens={dist='uniform', min=10, max=20},64")
    assert a.values == ({"dist": "uniform", "min": 10, "max": 20}, 64)


@pytest.mark.parametrize("spec, message", [
    ("kv.block_size", "expected KEY=V1,V2"),
    ("kv.block_size=", "empty value"),
    ("kv.block_size=8,,16", "empty value"),
    ("kv.block_size=8,8", "listed twice"),
    ("=8,16", "empty key"),
])
def test_parse_axis_rejects_malformed_specs(spec, message):
    with pytest.raises(ScenarioError, match=message):
        sweep.parse_axis(spec)


def test_grid_is_the_product_in_axis_order():
    axes = sweep.parse_grid(["scheduler.policy=fcfs,chunked", "kv.block_size=8,16,32"])
    p = sweep.plan("chat", axes, overrides=SHORT)
    assert [tuple(pt.values.values()) for pt in p.points] == [
        (pol, bs) for pol in ("fcfs", "chunked") for bs in (8, 16, 32)]
    assert [(pt.scenario.scheduler.policy, pt.scenario.kv.block_size) for pt in p.points] == [
        tuple(pt.values.values()) for pt in p.points]
    with pytest.raises(ScenarioError, match="given twice"):
        sweep.parse_grid(["kv.block_size=8", "kv.block_size=16"])


def test_slo_replaces_the_whole_section():
    p = sweep.plan("chat", [], overrides=sweep.slo_overrides("ttft_ms=500"))
    slo = p.points[0].scenario.slo
    assert (slo.ttft_ms, slo.tpot_ms, slo.e2e_ms) == (500.0, 0.0, 0.0)  # chat sets tpot_ms
    with pytest.raises(ScenarioError, match="did you mean 'ttft_ms'"):
        sweep.slo_overrides("ttf_ms=500")


def test_every_point_is_checked_before_any_run(monkeypatch, capsys):
    def no_runs(*a, **kw):
        raise AssertionError("a run started before the grid was checked")

    monkeypatch.setattr(sweep, "Runner", no_runs)
    # the second value is the bad one: every point is loaded, not just the first
    code = main(["sweep", "chat", "--grid", "kv.block_size=16,24", "--workers", "1"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "kv.block_size=24" in err and "power of two" in err
    code = main(["sweep", "chat", "--grid", "kv.blok_size=16,32"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "did you mean 'block_size'" in err
    code = main(["sweep", "chat", "--grid", "seed=1,2", "--seeds", "2"])
    assert code == 2 and "--seeds" in capsys.readouterr().err


def test_csv_has_a_row_per_point_and_seed_in_grid_then_seed_order(tmp_path, capsys):
    out = tmp_path / "results.csv"
    code = main(["sweep", "chat", *(x for o in SHORT for x in ("--set", o)),
                 "--grid", "scheduler.policy=fcfs,chunked", "--grid", "kv.block_size=16,32",
                 "--seeds", "2", "--workers", "1", "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    rows = list(csv.DictReader(out.open()))
    assert [(r["scheduler.policy"], r["kv.block_size"], r["seed"]) for r in rows] == [
        (pol, bs, s) for pol in ("fcfs", "chunked") for bs in ("16", "32") for s in ("0", "1")]
    for col in ("requests_finished", "throughput_output_tokens_per_s", "ttft_p99_ms",
                "itl_p50_ms", "tpot_p90_ms", "e2e_p99_ms", "goodput_requests_per_s",
                "slo_attainment", "preemptions", "kv_mean_usage", "energy_j_per_output_token",
                "wall_s"):
        assert all(r[col] != "" for r in rows), col
    assert rows[0]["requests_finished"] != rows[1]["requests_finished"]  # seeds differ


def test_table_without_output_file(capsys):
    code = main(["sweep", "chat", *(x for o in SHORT for x in ("--set", o)),
                 "--grid", "kv.block_size=16,32", "--workers", "1"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and len(out) == 3
    assert out[0].split()[:3] == ["kv.block_size", "seed", "finished"]


def test_one_worker_and_two_workers_give_identical_rows():
    p = sweep.plan("chat", sweep.parse_grid(["scheduler.policy=fcfs,chunked",
                                             "kv.block_size=16,64"]),
                   seeds=[0, 1], overrides=SHORT)
    seen = []
    with sweep.Runner(1) as runner:
        serial = sweep.run_sweep(p, runner)
    with sweep.Runner(2) as runner:
        parallel = sweep.run_sweep(p, runner, progress=lambda d, n: seen.append((d, n)))
    assert rows_without_wall(serial) == rows_without_wall(parallel)
    assert len(serial.rows) == 8 and seen[-1] == (8, 8)


def test_a_failed_run_names_its_point(monkeypatch):
    def stall(sc, stop=()):
        raise ServesimError("engine stalled")

    monkeypatch.setattr(sweep, "run_scenario", stall)
    p = sweep.plan("chat", sweep.parse_grid(["kv.block_size=16"]), overrides=SHORT)
    with sweep.Runner(1) as runner, pytest.raises(sweep.SweepError,
                                                  match="kv.block_size=16, seed=7: engine"):
        sweep.run_sweep(p, runner)


@settings(max_examples=200, deadline=None)
@given(octaves=st.floats(-11.9, 11.9), start=st.floats(0.1, 100), tol=st.floats(0.01, 0.3))
def test_rate_search_brackets_a_threshold_within_tolerance(octaves, start, tol):
    s = sweep.RateSearch(start, 0.9, tol)
    capacity = start * 2 ** octaves  # within the doublings and halvings the search allows
    while (rate := s.next_rate()) is not None:
        s.record(rate, 1.0 if rate <= capacity else 0.5)
        assert s.probes < 60
    lo, hi = s.passed, s.failed
    assert lo is not None and hi is not None
    assert lo[0] <= capacity < hi[0] and hi[0] - lo[0] <= tol * lo[0]


def test_rate_search_gives_up_when_nothing_passes():
    s = sweep.RateSearch(4.0, 0.9, 0.05)
    while (rate := s.next_rate()) is not None:
        s.record(rate, 0.0)
    assert s.passed is None and s.failed[0] <= 4.0 / 2 ** s.max_doublings


def test_find_max_rate_meets_the_target_and_a_higher_rate_does_not():
    target = 0.9
    p = sweep.plan("chat", [], seeds=[0, 1], overrides=["workload.duration_s=15"])
    with sweep.Runner(2) as runner:
        row = sweep.find_max_rate(p, runner, target=target).rows[0]
        assert row["attainment"] >= target and row["fail_attainment"] < target
        assert row["max_rate"] < row["fail_rate"] <= row["max_rate"] * 1.05
        higher = sweep.plan("chat", [], seeds=[0, 1], overrides=[
            "workload.duration_s=15", f"workload.rate={row['max_rate'] * 1.3}"])
        att = [r["slo_attainment"] for r in sweep.run_sweep(higher, runner).rows]
    assert sum(att) / len(att) < target


def test_find_max_rate_needs_an_slo_and_no_rate_axis():
    runner = sweep.Runner(1)
    p = sweep.plan("chat", [], overrides=sweep.slo_overrides("e2e_ms=0"))
    with pytest.raises(ScenarioError, match="needs an SLO"):
        sweep.find_max_rate(p, runner)
    p = sweep.plan("chat", sweep.parse_grid(["workload.rate=1,2"]), overrides=SHORT)
    with pytest.raises(ScenarioError, match="searches the rate itself"):
        sweep.find_max_rate(p, runner)
    p = sweep.plan("chat", [], overrides=[*SHORT, "workload.concurrency=8", "workload.num_requests=50",
                                          *sweep.slo_overrides("ttft_ms=500")])
    with pytest.raises(ScenarioError, match="workload.concurrency = 8: a closed loop"):
        sweep.find_max_rate(p, runner)


def test_ray_missing_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    p = sweep.plan("chat", [], overrides=SHORT)
    with pytest.raises(sweep.SweepError, match=r"pip install 'servesim\[ray\]'"):
        with sweep.Runner(ray_address="") as runner:
            sweep.run_sweep(p, runner)


def test_ray_gives_the_same_rows_as_the_process_pool():
    ray = pytest.importorskip("ray")
    p = sweep.plan("chat", sweep.parse_grid(["scheduler.policy=fcfs,chunked"]),
                   seeds=[0, 1], overrides=SHORT)
    with sweep.Runner(2) as runner:
        pooled = sweep.run_sweep(p, runner)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with sweep.Runner(ray_address="") as runner:  # uses the instance started here
            on_ray = sweep.run_sweep(p, runner)
        assert ray.is_initialized()  # a Runner leaves an instance it did not start
    finally:
        ray.shutdown()
    assert rows_without_wall(on_ray) == rows_without_wall(pooled)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_an_interrupted_sweep_stops_at_once_and_leaves_no_worker(sig):
    """Ctrl-C, SIGTERM or SIGKILL mid-sweep: the sweep ends at once, not after its points, and
    nothing it started still holds its output pipes (communicate() returns only when every
    holder of the pipes has exited)."""
    import os
    import signal
    import subprocess

    from tests.helpers import catches, children, wait_for_process

    p = subprocess.Popen(
        [sys.executable, "-m", "tui.cli", "sweep", "chat", "--grid", "workload.rate=4,6,8,10",
         "--set", "workload.duration_s=300000", "--workers", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as in a terminal
    # Signalled once the sweep handles SIGTERM and both pool workers (forked by the pool's
    # forkserver, a child of the sweep) exist, however long that took on a loaded machine.
    # The workers then run points of a minute or more each (1.2M-3M requests: with the
    # compiled hot path on an idle machine, 3,000 simulated seconds ran in under 1.5 s and the
    # whole sweep had ended before the signal).
    wait_for_process(p.pid, lambda: catches(p.pid, signal.SIGTERM)
                     and sum(len(children(c)) for c in children(p.pid)) >= 2, "started two workers")
    assert p.poll() is None, p.communicate()
    os.kill(p.pid, getattr(signal, sig))
    # About 0.3 s on the development machine; a sweep that waited for its workers' points (it
    # took 24 s before) would now wait a minute or more: the bound only guards against a hang.
    out, err = p.communicate(timeout=40)
    assert p.returncode == {"SIGINT": 130, "SIGTERM": 143, "SIGKILL": -9}[sig], (p.returncode, err)
    assert "Traceback" not in err, err


def test_sweep_never_writes_over_a_file_its_scenario_reads(tmp_path, capsys):
    from tui.cli import main

    lengths = tmp_path / "lengths.svg"  # (a name --plot takes too)
    lengths.write_text("num_prefill_tokens,num_decode_tokens\n100,20\n300,40\n")
    scenario = tmp_path / "s.toml"
    scenario.write_text('name = "s"\n[workload]\nrate = 2\nduration_s = 2\n'
                        'prompt_tokens = {dist = "empirical", file = "lengths.svg", column = "num_prefill_tokens"}\n')
    before = lengths.read_bytes()
    for flag in ("-o", "--plot"):
        assert main(["sweep", str(scenario), "--workers", "1", flag, str(lengths)]) == 2
        err = capsys.readouterr().err
        assert f"{flag} {lengths}: is " in err and "which this command reads" in err and err.count("\n") == 1
    assert lengths.read_bytes() == before


FIGURES = [f"{m}_{p}_ms" for m in ("ttft", "tpot", "e2e") for p in ("p50", "p90", "p99")]


@pytest.mark.parametrize("spec, sets", [
    ("chat", ["workload.rate=40", "workload.duration_s=20"]),
    ("replicas", ["workload.rate=60", "workload.duration_s=5"]),
    ("disaggregated", ["workload.rate=30", "workload.duration_s=5"]),
])
def test_a_run_given_bounds_stops_once_one_is_proven_broken_and_not_before(spec, sets):
    sc = load_scenario(spec, sets)
    whole = sweep.run_scenario(sc)
    limit = whole["ttft_p99_ms"] / 4
    stopped = sweep.run_scenario(sc, (("ttft_p99_ms", limit),))
    assert stopped["stopped_s"] < whole["duration_s"]
    assert limit < stopped["ttft_p99_ms"] <= whole["ttft_p99_ms"]
    assert all(stopped[c] <= whole[c] for c in FIGURES)
    assert stopped["itl_p99_ms"] is None and stopped["requests_finished"] is None
    # a bound met exactly is not broken: the run goes to its end, its row the plain run's
    kept = sweep.run_scenario(sc, (("ttft_p99_ms", whole["ttft_p99_ms"]),
                                   ("e2e_p50_ms", whole["e2e_p50_ms"])))
    assert "stopped_s" not in kept
    assert ({k: v for k, v in kept.items() if k not in ("wall_s", *sweep.RUN_ONLY)}
            == {k: v for k, v in whole.items() if k not in ("wall_s", *sweep.RUN_ONLY)})
