"""Data-parallel ranks in lockstep and pipeline stages with virtual engines
(`sim.deploy.parallel`): the step is the slowest rank's and idle ranks run dummy steps, DP
doubles a saturated rank's throughput, the pipeline's bubble and its fill, per-rank block
accounting, bad combinations refused in one line, and sessions that replay exactly."""

from __future__ import annotations

import numpy as np
import pytest

from sim import Engine, build, summarize
from sim.deploy.parallel import DataParallel, PipelineParallel
from sim.engine.engine import Engine as PlainEngine
from sim.errors import ScenarioError
from sim.session.log import read_log, write_log
from sim.session.replay import verify
from tests.helpers import check_cluster_invariants, small_scenario, workload_of
from tests.tui.test_app import SIZE, pilot_test
from tests.sim.deploy.test_cluster import interactive_session, same_events_however_sliced
from tui.app import Dashboard
from tui.cli import main
from tui.serve.app import build_frontend

DP2 = ("model.data_parallel=2",)
PP4 = ("model.pipeline_parallel=4",)


def durations(e) -> np.ndarray:
    return np.asarray(e.timeline.column("dur"))


def alone(sc, rows) -> np.ndarray:
    """The step durations of `rows` on one plain engine, one step at a time."""
    e = PlainEngine(sc, workload=workload_of(rows), skip_ahead=False)
    e.run()
    return durations(e)


# ================================================================================ data parallel
def test_one_rank_or_stage_is_a_plain_engine_and_more_are_deployments():
    assert type(build(small_scenario("model.data_parallel=1"))) is Engine
    assert type(build(small_scenario(*DP2))) is DataParallel
    assert type(build(small_scenario(*PP4))) is PipelineParallel


# sliding-window layers, as a model's config.json gives them: ranks and stages skip what
# lies beyond the window as one engine does
WINDOWED = ("model.sliding_window=256", "model.sliding_window_layers=2")


@pytest.mark.parametrize("extra", [(), WINDOWED])
def test_a_lockstep_step_lasts_as_long_as_the_slowest_ranks(extra):
    sc = small_scenario(*DP2, *extra)
    big, small = (0.0, 900, 30), (0.0, 40, 30)
    c = build(sc, workload=workload_of([big, small]))
    c.run()
    # queue-length routing: the first to rank 0, the second (rank 0's score now 4) to rank 1
    assert c.routed == [1, 1]
    d0, d1 = (durations(e) for e in c.instances)
    a0, a1 = alone(sc, [big]), alone(sc, [small])
    assert len(d0) == len(d1) == len(a0) == len(a1) == 30
    # each rank's steps end together and last the longer of the two ranks' own times
    assert np.array_equal(d0, d1)
    assert np.array_equal(d0, np.maximum(a0, a1))
    assert d0[0] > a1[0]  # the prefill of the long prompt held the other rank back
    assert c.lockstep_steps == 30 and c.dummy_steps == 0
    assert summarize(c)["deployment"]["dummy_steps"] == 0


def test_an_idle_rank_runs_a_dummy_step_while_another_works():
    sc = small_scenario(*DP2)
    c = build(sc, workload=workload_of([(0.0, 300, 20)]))
    c.run()
    busy, idle = c.instances
    assert busy.step_count == 20 and idle.step_count == 0
    assert c.lockstep_steps == c.dummy_steps == 20
    # the idle rank's clock moved with every step, and its dummy one-token pass is in the max
    assert idle.now == busy.now
    dummy = c._dummy
    assert np.array_equal(durations(busy), np.maximum(alone(sc, [(0.0, 300, 20)]), dummy))
    assert summarize(c)["deployment"]["lockstep_steps"] == 20


def test_two_ranks_serve_twice_one_ranks_throughput_at_saturation():
    rows = [(0.0, 200, 100)] * 256
    sat = ("scheduler.max_num_seqs=32",)
    one = build(small_scenario(*sat, "kv.num_blocks=3000"), workload=workload_of(rows))
    one.run()
    two = build(small_scenario(*DP2, *sat, "kv.num_blocks=3000"), workload=workload_of(rows))
    two.run()
    t1 = summarize(one)["throughput"]["output_tokens_per_s"]
    t2 = summarize(two)["throughput"]["output_tokens_per_s"]
    assert 1.95 < t2 / t1 <= 2.0, (t1, t2)
    assert two.routed == [128, 128]
    assert summarize(two)["deployment"]["gpus"] == 2


def test_every_rank_accounts_for_each_of_its_blocks_through_preemptions_and_cancels():
    sc = small_scenario(*DP2, "kv.num_blocks=300", "workload.cancel_fraction=0.2",
                        "workload.duration_s=8", "workload.rate=10")
    c = build(sc)
    while not c.done:
        c.step()
        check_cluster_invariants(c)
        assert len({e.now for e in c.instances}) == 1  # the ranks' clocks move together
    assert c.counts["preemptions"] > 0 and c.counts["cancelled"] > 0
    for e in c.instances:
        assert e.kv.num_used_blocks == 0


@pilot_test
async def test_the_dashboard_shows_each_rank_and_r_cycles_their_blocks():
    c = build(small_scenario(*DP2), workload=workload_of([(0.0, 300, 20), (0.0, 600, 20)]))
    c.step()
    snap = c.snapshot()
    assert [v.role for v in snap.instances] == ["rank", "rank"]
    assert snap.used_blocks == c.instances[0].kv.num_used_blocks
    app = Dashboard(c, paused=True)
    async with app.run_test(size=SIZE) as pilot:
        rows = app.instance_rows._text.plain.splitlines()
        assert len(rows) == 2 and "rank" in rows[0] and "run   1" in rows[1]
        await pilot.press("r")
        assert c.focus == 1
    assert c.snapshot().used_blocks == c.instances[1].kv.num_used_blocks != snap.used_blocks


# ============================================================================ pipeline parallel
@pytest.mark.parametrize("extra", [(), WINDOWED])
def test_one_request_through_four_stages_takes_the_whole_model_plus_the_sends(extra):
    sc = small_scenario(*PP4, *extra)
    rows = [(0.0, 500, 40)]
    c = build(sc, workload=workload_of(rows))
    c.run()
    one = PlainEngine(small_scenario(*extra), workload=workload_of(rows), skip_ahead=False)
    one.run()
    m = sc.model
    send = m.hidden_size * m.act_dtype_bytes / (sc.hardware.interconnect_gbps * 1e9)
    tokens = np.asarray(one.timeline.column("tokens"), dtype=float)
    expected = durations(one) + 3 * tokens * send
    got = np.concatenate([durations(e) for e in c.instances if e.step_count])
    assert got == pytest.approx(expected, rel=1e-12)
    # no faster than one GPU: three stages wait while the fourth works (the bubble)
    fig = summarize(c)["deployment"]
    assert fig["stage_utilization"] == pytest.approx(0.25, rel=0.01)
    assert fig["sends"] == 3 * 40


def test_micro_batches_in_flight_fill_the_pipeline():
    rows = [(0.0, 100, 200)] * 64
    fixed = ("scheduler.max_num_seqs=8", "kv.num_blocks=4000")
    base = build(small_scenario(*fixed), workload=workload_of(rows))
    base.run()
    runs = {}
    for v in (1, 4):
        c = build(small_scenario(*PP4, *fixed, f"model.virtual_engines={v}"),
                  workload=workload_of(rows))
        c.run()
        runs[v] = summarize(c)
    tput = {k: s["throughput"]["output_tokens_per_s"] for k, s in runs.items()}
    t1 = summarize(base)["throughput"]["output_tokens_per_s"]
    # one micro-batch: one GPU's throughput, less the sends; four: close to four GPUs'
    assert 0.9 < tput[1] / t1 < 1.0
    assert 3.5 < tput[4] / t1 <= 4.0, (t1, tput)
    assert runs[4]["deployment"]["stage_utilization"] > 0.9
    assert runs[4]["deployment"]["gpus"] == 4 and runs[4]["kv"]["total_blocks"] == 4000


def test_each_virtual_engine_has_its_share_of_the_stage_pool():
    sc = small_scenario(*PP4, "kv.num_blocks=1000")
    c = build(sc)
    assert [e.kv.num_blocks for e in c.instances] == [250] * 4
    derived = build(small_scenario(*PP4, "kv.num_blocks=0"))
    one = small_scenario("kv.num_blocks=0")
    # a stage holds a quarter of the weights and a quarter of the layers' KV per token
    assert derived.scenario.kv.num_blocks > 4 * one.kv.num_blocks
    with pytest.raises(ScenarioError, match="virtual_engines = 8"):
        build(small_scenario(*PP4, "kv.num_blocks=4", "model.virtual_engines=8"))


# ============================================================================ both, and input
@pytest.mark.parametrize("overrides", [
    (*DP2, "kv.num_blocks=500", "workload.cancel_fraction=0.2"),
    (*PP4, "kv.num_blocks=800", "workload.cancel_fraction=0.2", "model.virtual_engines=3"),
])
def test_sliced_and_unsliced_runs_give_identical_events(overrides):
    whole, _ = same_events_however_sliced(small_scenario(*overrides, "workload.duration_s=6"))
    assert whole.counts["cancelled"] > 0


@pytest.mark.parametrize("overrides", [
    (*DP2, "workload.cancel_fraction=0.1", "kv.num_blocks=600"),
    (*PP4, "workload.cancel_fraction=0.1", "kv.num_blocks=1200"),
])
def test_session_logs_replay_exactly(tmp_path, capsys, overrides):
    sc = small_scenario(*overrides, "workload.duration_s=8")
    c = interactive_session(sc)
    path = tmp_path / "p.msgpack"
    write_log(path, c)
    log = read_log(path)
    assert log.header["cluster"]["mode"] == c.mode
    r, div = verify(log)
    assert div is None and r.engine.position() == c.position()
    assert main(["replay", str(path), "--verify"]) == 0
    assert "identical" in capsys.readouterr().out
    other = read_log(path)  # under another deployment it diverges
    other.header["scenario"]["model"]["tensor_parallel"] = 2
    _, div = verify(other)
    assert div is not None


@pytest.mark.parametrize("sets, words", [
    (["model.data_parallel=2", "model.num_gpus=3"], "model.num_gpus = 3"),
    (["model.pipeline_parallel=3"], "model.pipeline_parallel = 3: must divide"),
    (["model.data_parallel=2", "model.pipeline_parallel=2"], "together are not modeled"),
    (["model.virtual_engines=2"], "model.virtual_engines = 2: needs"),
    (["model.data_parallel=2", "cluster.replicas=2"], "cluster.replicas > 1"),
    (["model.pipeline_parallel=2", 'scheduler.policy="disaggregated"'], "disaggregated"),
    (["model.pipeline_parallel=2", 'hardware.preset=""', "hardware.memory_gb=80",
      "hardware.mem_bandwidth_gbps=3350", "hardware.peak_tflops=989", "hardware.tdp_w=700",
      "hardware.idle_w=90", "hardware.pcie_gbps=64"], "pipeline_send_gbps"),
    (["model.data_parallel=2", 'compute.clock="measured"'], "modeled clock"),
])
def test_impossible_parallel_layouts_exit_2_with_one_line(capsys, sets, words):
    args = ["sim", "chat", "-q"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and "chat.toml" in err, err


def test_compare_refuses_a_disaggregated_pair_of_ranks_in_one_line(capsys):
    assert main(["compare", "data-parallel", "--policies", "chunked,disaggregated", "--set",
                 "workload.duration_s=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "disaggregated pair of ranks" in err, err


@pytest.mark.parametrize("name, column", [("data-parallel", "rank 1"), ("pipeline", "ve 3")])
def test_the_bundled_scenarios_run_with_a_column_per_instance(capsys, name, column):
    assert main(["sim", name, "-q", "--set", "workload.duration_s=3"]) == 0
    out = capsys.readouterr().out
    assert column in out and name in out.splitlines()[0]


@pytest.mark.parametrize("layout", ["model.data_parallel=2", "model.pipeline_parallel=2"])
def test_serve_refuses_ranks_and_stages(layout):
    with pytest.raises(ScenarioError, match="serve runs one engine instance"):
        build_frontend(small_scenario(layout))
