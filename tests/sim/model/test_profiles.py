"""Stage 3 of the engine profiles' fit (sim/model/profiles.py): the mixture-of-experts, FP4 and
PyTorch-backend coefficients, fitted after the dense ones without moving them."""

import dataclasses
import gc

import pytest

from sim import gcpause
from sim.model import presets, profiles as P, trust as T
from sim.model.validate import load_points

HEAD = "id,engine,config,metric,published,regime,use,source,scenario\n"
ENGINE = "TensorRT-LLM v1.0 trtllm-bench (PyTorch backend)"
# Small fixed batches (every request at t = 0), so that each is cheap to replay or simulate.
WORKLOAD = """
[scheduler]
policy = "chunked"
max_num_seqs = {batch}
max_num_batched_tokens = 8192

[workload]
arrival = "batch"
num_requests = {batch}
prompt_tokens = {prompt}
output_tokens = 32
"""
MOE = """
[model]
config = "qwen3-30b-a3b"
quantization = "{quant}"
tensor_parallel = 1
{parallel}

[hardware]
preset = "{gpu}"

[engine]
preset = "tensorrt-llm-pytorch"
"""
DENSE = """
[model]
preset = "llama-2-7b"

[hardware]
preset = "a100-80gb"

[engine]
preset = "tensorrt-llm-0.6"
"""
# id -> (scenario, metric): the expert GEMMs alone (one GPU), the gather over implicit and
# explicit data-parallel ranks, FP4 weights on a B200, and a batch large enough for the host's
# time per sequence to bind; two dense rows.
ROWS = {
    "X1": (MOE.format(quant="fp8", gpu="h100-sxm", parallel="") + WORKLOAD.format(
        batch=16, prompt=512), "output tok/s"),
    "X2": (MOE.format(quant="fp8", gpu="h100-sxm", parallel="expert_parallel = 8")
           + WORKLOAD.format(batch=64, prompt=256), "output tok/s"),
    "X3": (MOE.format(quant="fp8", gpu="h200", parallel="data_parallel = 2")
           + WORKLOAD.format(batch=32, prompt=256), "output tok/s"),
    "X4": (MOE.format(quant="nvfp4", gpu="b200", parallel="") + WORKLOAD.format(
        batch=64, prompt=1024), "output tok/s"),
    "X5": (MOE.format(quant="nvfp4", gpu="b200", parallel="") + WORKLOAD.format(
        batch=1024, prompt=64), "output tok/s"),
    "D1": (DENSE + WORKLOAD.format(batch=8, prompt=512), "1st-token latency (ms)"),
    "D2": (DENSE + WORKLOAD.format(batch=32, prompt=128), "output tok/s"),
}
KNOWN = {"moe_gemm_efficiency": 0.3, "moe_comm_efficiency": 0.5, "fp4_gemm_efficiency": 0.35,
         "tensorrt-llm-pytorch:cpu_per_seq_us": 60.0}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """The rows, each published at what the dense fit and KNOWN predict (the dense rows 10%
    above the shipped profile's prediction, so that stage 1 has something to move)."""
    d = tmp_path_factory.mktemp("points")
    (d / "scenarios").mkdir()
    lines = [HEAD]
    for pid, (text, metric) in ROWS.items():
        (d / "scenarios" / f"{pid}.toml").write_text(f'name = "{pid}"\nseed = 1\n{text}')
        lines.append(f"{pid},{ENGINE},synthetic,{metric},1,-,fit,test,\n")
    (d / "published.csv").write_text("".join(lines))
    rows = P.prepare(load_points(d))
    assert [r.record is None for r in rows] == [p == "X3" for p in ROWS]  # X3: two ranks
    dense = [r for r in rows if not P.touched(r.scenario)]
    for r in dense:
        r.point = dataclasses.replace(r.point, published=P.predict(r, {}) * 1.1)
    # (under the dense coefficients the exact points pin, as the recovery test fits them: two
    # rows leave the dense fit a family of equal fits, and the prior's weight picks one)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(P, "POINT_SPREAD", 1e-3)
        truth = {**P.fit(dense), **KNOWN}
    for r in rows:
        if P.touched(r.scenario):
            r.point = dataclasses.replace(r.point, published=P.predict(r, truth))
    return rows


def test_only_moe_fp4_and_pytorch_backend_rows_are_touched(rows):
    assert [P.touched(r.scenario) for r in rows] == [p.startswith("X") for p in ROWS]


def test_stage_3_recovers_known_coefficients_and_leaves_the_dense_ones(rows, monkeypatch):
    dense = [r for r in rows if not P.touched(r.scenario)]
    alone = P.fit(dense)
    # (the points' weight against the priors raised: exact points pin the coefficients)
    monkeypatch.setattr(P, "POINT_SPREAD", 1e-3)
    alone_tight = P.fit(dense)
    c = P.fit(rows, stage3_iter=30)
    assert {k: c[k] for k in alone_tight} == alone_tight  # bit for bit
    for k, v in KNOWN.items():
        assert c[k] == pytest.approx(v, rel=0.03), k
    # Without stage 3 the dense fit is the same, and the stage-3 terms are not fitted.
    monkeypatch.setattr(P, "POINT_SPREAD", 0.1)
    assert P.fit(rows, stage3=False) == alone


def test_a_fit_gives_the_pytorch_backend_its_stage_3_coefficients():
    c = {"moe_gemm_efficiency": 0.2, "tensorrt-llm-pytorch:cpu_per_seq_us": 77.0,
         "tensorrt-llm-0.6:gemm_efficiency": 0.6, "tensorrt-llm-0.6:cpu_per_seq_us": 3.0}
    got = P.profiles(c)
    assert got["tensorrt-llm-pytorch"]["cpu_per_seq_us"] == 77.0
    assert got["tensorrt-llm-pytorch"]["gemm_efficiency"] == 0.6
    assert got["tensorrt-llm"]["cpu_per_seq_us"] == 3.0
    # (NIM's profile keeps its own host time, fixed apart: presets.TRT_SERVING)
    assert got["nim"]["cpu_per_seq_us"] == presets.TRT_SERVING["cpu_per_seq_us"]
    assert got["nim"]["gemm_efficiency"] == 0.6
    assert all(p["moe_gemm_efficiency"] == 0.2 for p in got.values())


def test_a_fit_keeps_each_runtimes_time_per_layer(rows):
    """TensorRT-LLM's C++ runtime (0.6's rows, and the profiles derived from it but the PyTorch
    backend) launches without CUDA graphs: its fixed time per layer is its own, and no fit
    moves it or the graph-replaying engines' one, whatever the rows ask."""
    from sim.model.presets import ENGINES, TRT_LAUNCHES, _KERNELS

    cpp, graphs = TRT_LAUNCHES["layer_overhead_us"], _KERNELS["layer_overhead_us"]
    assert graphs < cpp
    got = P.profiles(P.fit(rows))
    for name in ("tensorrt-llm-0.6", "tensorrt-llm", "nim"):
        assert got[name]["layer_overhead_us"] == ENGINES[name]["layer_overhead_us"] == cpp, name
    for name in ("tensorrt-llm-pytorch", "vllm-v1", "sglang", "vllm-0.6-multistep"):
        assert got[name]["layer_overhead_us"] == ENGINES[name]["layer_overhead_us"] == graphs
    by = {r.point.id: r for r in rows}  # (the rows' scenarios, built from their profiles)
    assert by["D2"].scenario.engine.layer_overhead_us == cpp
    assert by["X1"].scenario.engine.layer_overhead_us == graphs


def test_holding_out_a_moe_row_refits_stage_3_without_it(rows):
    """A held-out MoE row is predicted by a stage-3 fit of the others; a held-out dense row by
    the dense fit alone, the same with or without the MoE rows beside it."""
    dense = [r for r in rows if not P.touched(r.scenario)]
    with_moe = dict((p.id, x) for p, x in P.leave_one_out(rows))
    assert dict((p.id, x) for p, x in P.leave_one_out(dense)) == {
        k: with_moe[k] for k in ("D1", "D2")}
    # Fitted on the rows' exact values from the priors, the held-out MoE rows whose terms the
    # other rows pin come out near 1 (the priors pull a little: each row weighs as a 10% error)
    # but X5, the one row where the host's time binds: without it the time per sequence keeps
    # its prior (10 us, not 60), not the shipped profile's. (X4 is the one row where the FP4
    # GEMMs bind; without it only X5, host-bound, speaks to them, and where the fit lands
    # trades one against the other: no check.)
    assert all(0.8 < with_moe[k] < 1.25 for k in ("X1", "X2", "X3"))
    assert with_moe["X5"] > 1.5


def test_the_host_time_search_starts_past_the_kink():
    """A step takes max(GPU, host): below the host time where the host binds, the residuals are
    flat and a local search from there stays; the coarse start finds the side where they move."""
    import math

    from sim.model.fit import least_squares

    def res(c):  # one row, GPU step 20 ms, host 1,000 sequences, published step 40 ms
        step = max(20e-3, 1000 * c["e:cpu_per_seq_us"] * 1e-6)
        return [math.log(step / 40e-3) / 0.1]

    start = {"e:cpu_per_seq_us": 10.0}
    kinds = {"e:cpu_per_seq_us": "pos"}
    stuck, _ = least_squares(res, start, kinds, max_iter=12, tol=1e-4, diff_step=0.03)
    assert stuck["e:cpu_per_seq_us"] == pytest.approx(10.0)
    got = P.host_time_start(res, start)
    assert got["e:cpu_per_seq_us"] in (40.0, 80.0)
    found, _ = least_squares(res, got, kinds, max_iter=12, tol=1e-4, diff_step=0.03)
    assert found["e:cpu_per_seq_us"] == pytest.approx(40.0, rel=1e-3)
    # Other coefficients keep their starts; a start already past the kink stays.
    both = {"e:cpu_per_seq_us": 40.0, "moe_gemm_efficiency": 0.3}
    assert P.host_time_start(res, both) == both


def test_from_the_priors_a_host_bound_row_pins_the_host_time(rows, monkeypatch):
    """Fitted from the priors (10 us per sequence, where X5's host does not bind), stage 3
    finds the 60 us X5 was made with; without the coarse start it keeps the prior."""
    start = P.prior_start({r.scenario.engine.preset for r in rows})
    key = "tensorrt-llm-pytorch:cpu_per_seq_us"
    assert start[key] == 10.0
    assert P.fit(rows, start=start)[key] == pytest.approx(60.0, rel=0.1)
    monkeypatch.setattr(P, "HOST_TIME_SCAN", ())
    assert P.fit(rows, start=start)[key] == pytest.approx(10.0, rel=0.2)


def test_a_fit_leaves_no_deployment_run_frozen(rows, monkeypatch):
    """A deployment's run freezes what it made, its reference cycles included; hundreds of them
    in a fit would never be freed. Each trial's are collected."""
    monkeypatch.setattr(gcpause, "FREEZE_AFTER_S", 0.0)  # (this small run freezes too)
    x3 = next(r for r in rows if r.point.id == "X3")
    gc.unfreeze()
    P.predict(x3, KNOWN)
    assert gc.get_freeze_count() == 0


@pytest.mark.slow
def test_the_bundled_fit_pins_the_host_time_on_two_gpus_and_two_models(capsys):
    """A stage-3 coefficient that only one GPU's (or one model's) fitted rows speak to falls
    back to its prior in the fold that holds that GPU (model) out (`validate --leave-out`), and
    the rows it times come out wrong there. The PyTorch backend's host time per sequence must
    move fitted rows of two GPUs and two models."""
    import json

    from sim.inputs.scenario import BUNDLED_DIR
    from sim.model.validate import point_scenario
    from tui.cli import main

    scenarios = {p.id: point_scenario(p) for p in load_points(BUNDLED_DIR / "fidelity")
                 if p.use == "fit"}
    fitted = {pid: sc for pid, sc in scenarios.items() if P.touched(sc)}
    ids = ",".join(fitted)

    def ratios(cpu):
        assert main(["validate", "--only", ids, "--json", "--set",
                     f"engine.cpu_per_seq_us={cpu}"]) == 0
        return {r["id"]: r["ratio"] for r in json.loads(capsys.readouterr().out)["points"]}

    from sim.model.presets import ENGINES
    cpu = ENGINES["tensorrt-llm-pytorch"]["cpu_per_seq_us"]
    base, half = ratios(cpu), ratios(cpu / 2)
    moved = [pid for pid in base if half[pid] / base[pid] > 1.05]
    where = {(T.GROUPS["hardware"](fitted[pid]), T.GROUPS["model"](fitted[pid]))
             for pid in moved}
    assert len({g for g, _ in where}) >= 2 and len({m for _, m in where}) >= 2, where


def test_a_model_is_one_group_whether_named_by_preset_or_by_config(tmp_path):
    """`validate --leave-out model` holds out Llama 3.1 8B whole: the rows that name its
    preset and those that read its bundled config.json."""
    from sim.inputs.scenario import load_scenario

    keys = []
    for i, line in enumerate(['preset = "llama-3.1-8b"', 'config = "llama-3.1-8b"',
                              'config = "qwen3-30b-a3b"']):
        f = tmp_path / f"s{i}.toml"
        f.write_text(f"[model]\n{line}\n[workload]\nnum_requests = 1\n")
        keys.append(T.GROUPS["model"](load_scenario(str(f))))
    assert keys[0] == keys[1] == "llama-3.1-8b"
    assert keys[2] == "qwen3-30b-a3b"
