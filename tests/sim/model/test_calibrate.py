import dataclasses
import json
import tomllib

import numpy as np
import pytest

from sim import Engine, build
from sim.model.calibrate import (fit_bench, read_bench_json, read_kernel_csv, fit_kernels,
                                  replay_bench)
from sim.model.costmodel import CostModel
from sim.model.fit import RecordingCost, record_run
from sim.stats.metrics import summarize
from sim.inputs.scenario import load_scenario
from tui.cli import main
from tests.helpers import assert_freed_by_reference_counting

TRUE = dict(gemm_efficiency=0.62, bandwidth_efficiency=0.78, kv_bandwidth_efficiency=0.66,
            attention_efficiency=0.42, layer_overhead_us=35.0)


def _with(sc, **coeffs):
    return dataclasses.replace(sc, engine=dataclasses.replace(sc.engine, **coeffs))


def kernel_csv(tmp_path, name="kernels.csv", extra=()):
    """Synthetic kernel timings of a known engine: forward passes from the cost model,
    all-reduces at 22 us + bytes at 60% of the link, CPU at 1.5 ms + 12 us per sequence."""
    sc = _with(load_scenario("chat"), **TRUE, cpu_base_us=0.0, cpu_per_seq_us=0.0)
    cm = CostModel(sc)
    lines = ["kind,batch,context,tokens,bytes,gpus,time_ms"]
    for b in (1, 8, 32, 128, 256):
        for c in (128, 1024, 4096):
            lines.append(f"decode,{b},{c},,,,{cm.step(0, 0, 0, b, b * c, b, b)[0] * 1e3!r}")
    for n in (64, 256, 1024, 4096, 8192):
        for c in (0, 4096):
            t = cm.step(n, n * c + n * (n + 1) / 2, c, 0, 0, 1, 1)[0]
            lines.append(f"prefill,,{c},{n},,,{t * 1e3!r}")
    for size in (1e3, 1e5, 1e6, 1e7, 1e8):
        t = 22e-6 + 1.5 * size / (450e9 * 0.6)
        lines.append(f"allreduce,,,,{size:g},4,{t * 1e3!r}")
    for b in (1, 16, 64, 256):
        lines.append(f"cpu,{b},,,,,{(1.5 + 0.012 * b)!r}")
    lines += list(extra)
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


def test_kernel_timings_recover_the_coefficients_that_made_them(tmp_path):
    path = kernel_csv(tmp_path)
    chat = load_scenario("chat")
    fit = fit_kernels(read_kernel_csv(path), chat, path)
    c = fit.coeffs
    # what the timings pin down: the compute-bound GEMMs, the K/V reads, the linear terms
    assert c["gemm_efficiency"] == pytest.approx(TRUE["gemm_efficiency"], rel=0.03)
    assert c["kv_bandwidth_efficiency"] == pytest.approx(TRUE["kv_bandwidth_efficiency"],
                                                         rel=0.03)
    assert c["allreduce_latency_us"] == pytest.approx(22.0, rel=0.02)
    assert c["allreduce_efficiency"] == pytest.approx(0.6, rel=0.02)
    assert c["custom_allreduce_us"] == 0.0  # the measured line for every size
    assert c["allreduce_nvls"] is False
    assert c["cpu_base_us"] == pytest.approx(1500.0, rel=0.01)
    assert c["cpu_per_seq_us"] == pytest.approx(12.0, rel=0.01)
    assert np.median(fit.errors()) < 0.01
    # weight streaming and the fixed cost per layer both cost the same every decode step (one
    # model cannot tell them apart), but together they are recovered: so is every step time,
    # including configurations that were not measured
    gpu = dict(cpu_base_us=0.0, cpu_per_seq_us=0.0)
    got = CostModel(_with(chat, **{**c, **gpu}))
    want = CostModel(_with(chat, **TRUE, **gpu))
    for args in [(0, 0, 0, 64, 64 * 2000, 64, 64), (0, 0, 0, 3, 3 * 9000, 3, 3),
                 (2000, 2000 * 1000 + 2000 * 2001 // 2, 1000, 0, 0, 1, 1),
                 (300, 300 * 301 // 2, 0, 40, 40 * 700, 41, 41)]:
        assert got.step(*args)[0] == pytest.approx(want.step(*args)[0], rel=0.01), args


def test_calibrate_writes_a_preset_a_scenario_can_name(tmp_path, capsys):
    path = kernel_csv(tmp_path)
    out = tmp_path / "mine.toml"
    assert main(["calibrate", str(path), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "residuals: median" in text and "worst" in text
    table = tomllib.loads(out.read_text())["engine"]
    assert table["preset"] == "vllm-v1" and table["cpu_base_us"] == pytest.approx(1500, rel=0.01)
    sc = load_scenario("chat", [f'engine.preset="{out}"'])
    assert sc.engine.gemm_efficiency == pytest.approx(0.62, rel=0.03)
    assert sc.engine.cpu_per_seq_us == pytest.approx(12.0, rel=0.01)
    # a key set in the scenario wins over the file's
    sc = load_scenario("chat", [f'engine.preset="{out}"', "engine.cpu_base_us=7"])
    assert sc.engine.cpu_base_us == 7


def bench_result(tmp_path, coeffs, n=80, name="bench.json", rate=6):
    """What `vllm bench serve --save-result --save-detailed` would have written for a
    deployment behaving as the chat scenario with `coeffs`: every request's lengths, TTFT and
    inter-token gaps, and its start time."""
    sc = _with(load_scenario("chat", [f"workload.num_requests={n}", f"workload.rate={rate}",
                                      "workload.duration_s=0"]), **coeffs)
    eng = build(sc, record_events=False)
    eng.run()
    reqs = sorted(eng.requests.values(), key=lambda r: r.req_id)
    data = {"backend": "vllm", "model_id": "meta-llama/Llama-3.1-8B-Instruct",
            "request_rate": float(rate), "burstiness": 1.0, "max_concurrency": None,
            "duration": float(eng.now), "completed": n,
            "input_lens": [r.prompt_len for r in reqs],
            "output_lens": [r.num_output_tokens for r in reqs],
            "ttfts": [r.client_ttft for r in reqs],
            "itls": [np.diff(r.token_times()).tolist() for r in reqs],
            "start_times": [1000.0 + r.sent_time for r in reqs],
            "errors": ["" for _ in reqs]}
    p = tmp_path / name
    p.write_text(json.dumps(data))
    return p, sc


def test_a_bench_result_replays_to_what_its_client_measured_behind_an_api_server(tmp_path):
    """`vllm bench serve` measures from sending: a replay on the deployment that made the
    result gives back each request's TTFT and TPOT as its client saw them, the API server's
    time included (compared with the engine's own, a fit put the server's time into the GPU's
    coefficients)."""
    path, sc = bench_result(tmp_path, {}, n=60, rate=20)
    assert sc.engine.frontend_request_us > 0  # (the chat scenario's vllm-v1: a server in front)
    run = read_bench_json(path)
    ttft, tpot, _ = replay_bench(run, sc)
    assert ttft == pytest.approx(run.ttft, rel=1e-9)
    eng = build(sc, record_events=False)
    eng.run()
    reqs = sorted(eng.requests.values(), key=lambda r: r.req_id)
    assert tpot == pytest.approx([r.client_tpot for r in reqs], rel=1e-9, nan_ok=True)
    assert np.all(ttft > [r.ttft for r in reqs])  # (the engine's alone is shorter)


def test_bench_result_replays_the_requests_and_recovers_the_step_times(tmp_path):
    # A serial engine (CPU time added to every step): with the CPU overlapped, a step's time is
    # max(GPU, CPU) and whichever is shorter leaves no trace in the latencies to recover.
    # The truth lies within the priors' reach (bandwidth efficiency 0.85 +- 10%): the fit is
    # the most probable profile, priors included, not the least-squares one.
    truth = dict(gemm_efficiency=0.6, bandwidth_efficiency=0.78, cpu_base_us=3000.0,
                 cpu_per_seq_us=40.0, cpu_overlap=False)
    path, true_sc = bench_result(tmp_path, truth, n=120, rate=30)
    run = read_bench_json(path)
    assert len(run.ttft) == 120 and run.arrival[0] == 0.0
    serial = load_scenario("chat", ["engine.cpu_overlap=false"])
    fit = fit_bench(run, serial)
    assert np.median(fit.errors()) < 0.03
    assert {"ttft p5", "ttft p95", "tpot p55", "tpot mean"} <= {r["what"] for r in fit.residuals}
    got = CostModel(_with(serial, **fit.coeffs))
    want = CostModel(true_sc)
    # End-to-end latencies pin down how long the steps this load ran take (not how that time
    # splits between per-step and per-sequence costs): re-time the true run's steps.
    steps = record_run(true_sc)
    d_got, d_want = steps.durations(got), steps.durations(want)
    # (a loaded run, so that batches of many sizes separate the per-step from the per-sequence
    # CPU time; what the priors still pull moves the busy time a few percent)
    assert d_got.sum() == pytest.approx(d_want.sum(), rel=0.05)
    assert np.median(d_got / d_want) == pytest.approx(1.0, abs=0.1)
    prefill_1k = (1024, 1024 * 1025 // 2, 0, 0, 0, 1, 1)
    assert got.step(*prefill_1k)[0] == pytest.approx(want.step(*prefill_1k)[0], rel=0.1)


@pytest.mark.parametrize("name,overrides", [
    ("chat", ["workload.num_requests=150"]),                      # online: idles, short runs
    ("chat", ["workload.num_requests=64", "workload.rate=1e9"]),  # a fixed batch: long runs
    ("chat", ["workload.num_requests=120", "workload.rate=40",
              'engine.preset="vllm-0.6-multistep"']),             # multi-step windows
    ("chat", ["workload.num_requests=80", "workload.rate=1e9", 'engine.preset="roofline"']),
    ("chat", ["workload.num_requests=100", "engine.frontend_request_us=5000",
              "engine.frontend_prompt_token_us=2",
              "engine.frontend_output_token_us=300"]),                # an API server in front
    ("chat", ["workload.concurrency=64", "workload.num_requests=200",
              "engine.frontend_output_token_us=400"]),                # ... with a backlog
    ("chat", ["workload.concurrency=64", "workload.num_requests=200",
              'workload.endpoint="chat"',
              "engine.frontend_output_token_us=400"]),                # ... its intake holding it
    ("chat", ["workload.num_requests=300", "workload.rate=1e9",
              'workload.endpoint="chat"']),                           # a burst held back
    ("prefill-stalls", ["workload.duration_s=20"]),               # chunked prefills, mixed steps
    ("fragmentation", ["workload.duration_s=30"]),                # preemptions
    ("burst", ['scheduler.preemption="swap"', "hardware.pcie_gbps=25"]),  # swaps
])
def test_a_run_replayed_under_its_own_cost_model_gives_back_its_latencies(name, overrides):
    # The recorder must see every step the engine times, however it times it (one at a time,
    # a run of decode steps at once): a step it missed replays as an empty one (it did, for
    # decode runs timed by CostModel.decode_times, until the fit's replay was checked here).
    sc = load_scenario(name, overrides)
    rec = record_run(sc)
    got = rec.replay(CostModel(sc))
    s = rec.summary
    assert s["steps"] == rec.features.shape[1] > 50
    # (the run's length for its clients: until its last token reached them)
    assert got["duration"] == pytest.approx(s.get("client_duration_s", s["duration_s"]),
                                             rel=1e-9)
    for key in ("ttft", "e2e"):
        assert np.mean(got[key]) * 1e3 == pytest.approx(s[f"{key}_ms"]["mean"], rel=1e-9), key
    assert np.nanmean(got["tpot"]) * 1e3 == pytest.approx(s["tpot_ms"]["mean"], rel=1e-9)
    if "swap" in str(overrides):
        assert s["swaps"] > 0 and rec.swap.sum() > 0


def test_a_recorded_run_is_timed_as_the_engine_times_it_sliding_windows_included():
    # a model whose layers skip what lies beyond a 256-token window: the recorder passes the
    # engine's counts of it, so a run recorded for a fit is the run `sim` makes, and replays
    # to the same latencies (it timed every layer as full attention, until checked here)
    sc = load_scenario("chat", ["workload.num_requests=60", "model.sliding_window=256",
                                "model.sliding_window_layers=24"])
    assert CostModel(sc).window == 256
    engine = Engine(sc)
    engine.run()
    plain = summarize(engine)
    rec = record_run(sc)
    assert rec.summary["duration_s"] == plain["duration_s"]
    assert rec.summary["ttft_ms"] == plain["ttft_ms"] and rec.summary["tpot_ms"] == plain["tpot_ms"]
    assert rec.features[9].sum() > 0 and rec.features[7].sum() > 0  # (beyond the window)
    got = rec.replay(CostModel(sc))
    assert got["duration"] == pytest.approx(plain["client_duration_s"], rel=1e-9)
    assert np.mean(got["ttft"]) * 1e3 == pytest.approx(plain["ttft_ms"]["mean"], rel=1e-9)


BAD_CSV = [
    ("batch,context,time_ms\n1,2,3\n", "kind: missing column"),
    ("kind,batch,context\ndecode,1,2\n", "time column"),
    ("kind,batch,context,time_min\ndecode,1,2,3\n", "time_min"),
    ("kind,batch,context,time_ms,time_us\ndecode,1,2,3,4\n", "exactly one"),
    ("kind,batch,time_ms\ndecode,1,3\n", ":2: context: missing"),
    ("kind,batch,context,time_ms\ndecode,1,2,-3\n", ":2: time_ms: '-3' is negative"),
    ("kind,batch,context,time_ms\ndecode,1,2,nan\n", ":2: time_ms: 'nan' is not a finite"),
    ("kind,batch,context,time_ms\ndecode,1,2,abc\n", ":2: time_ms: 'abc' is not a number"),
    ("kind,batch,context,time_ms\nbackward,1,2,3\n", ":2: kind: 'backward'"),
    ("kind,batch,context,time_ms\ndecode,1,2,3\ndecode,2,2,4\n", "too few decode and prefill"),
    ("kind,batch,context,time_ms\ndecode,1,2,3\ndecode,2,2,4\ndecode,1,2,9\n",
     ":4: time: contradicts line 2"),
    ("kind,batch,time_ms\ncpu,1,3\ncpu,1,3.1\n", "at least two different batch"),
    ("kind,batch,time_ms\ncpu,1,3\ncpu,8,2\ncpu,64,1\n", "fall as batch grows"),
    # absurd values: a fit of them exited 0 with residuals of 1e27, or overflowed
    ("kind,batch,context,time_ms\ndecode,1e30,2,3\n", ":2: batch: '1e30' is more than 1e+09"),
    ("kind,batch,context,time_ms\ndecode,99999999999999999999999,2,3\n", "batch: '999999"),
    ("kind,bytes,gpus,time_ms\nallreduce,1e30,4,3\n", ":2: bytes: '1e30' is more than 1e+15"),
    ("kind,batch,context,time_ms\ndecode,1,2,1e-300\n", ":2: time_ms: 1e-303 s is outside"),
    ("kind,batch,context,time_s\ndecode,1,2,1e12\n", ":2: time_s: 1e+12 s is outside"),
    # a column the row's kind does not read: refused, not dropped (whatever it holds)
    ("kind,batch,context,tokens,time_ms\ndecode,1,2,abc,3\n",
     ":2: tokens: 'abc': a decode row does not read it (it reads batch, context)"),
    ("kind,batch,context,gpus,time_ms\ndecode,1,2,1e309,3\n", ":2: gpus: '1e309': a decode row"),
]
# What csv itself refuses (a field past its limit was a _csv.Error traceback), and a long value
# quoted cut, not whole.
LONG_CSV = {
    "a long field": ("kind,batch,context,time_ms\ndecode,1,2,3\ndecode," + "1" * 200_000
                     + ",2,3\n", ":3: not CSV: field larger than field limit"),
    "a long column name": ("kind,batch,context" + "x" * 200_000 + ",time_ms\n",
                           ":1: not CSV: field larger"),
    "a long kind": ("kind,batch,context,time_ms\n" + "k" * 100_000 + ",1,2,3\n", ":2: kind: 'kkkk"),
    "a field past the header's": ("kind,batch,context,time_ms\ndecode,1,2,3,4\n",
                                  ":2: 5 fields, the header has 4"),
}


@pytest.mark.parametrize("text,message", [*BAD_CSV, *LONG_CSV.values()],
                         ids=[*map(str, range(len(BAD_CSV))), *LONG_CSV])
def test_bad_kernel_files_are_one_line_and_exit_2(tmp_path, capsys, text, message):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    assert main(["calibrate", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(p) in err and message in err and len(err) < 600, err


def test_bad_bench_files_are_one_line_and_exit_2(tmp_path, capsys):
    good, _ = bench_result(tmp_path, {}, n=12)
    data = json.loads(good.read_text())
    cases = [
        ({k: v for k, v in data.items() if k != "itls"}, "itls: missing"),
        ({**data, "ttfts": data["ttfts"][:-1]}, "ttfts: expected a list of 12"),
        ({**data, "ttfts": [-1.0] + data["ttfts"][1:]}, "ttfts[0]: -1.0 is negative"),
        ({**data, "errors": ["boom"] * 5 + [""] * 7}, "too few successful requests (7"),
        ({k: v for k, v in data.items() if k != "start_times"}, "request_rate: 6.0"),
        # damaged fields that were tracebacks (TypeError, ValueError, OverflowError)
        ({**data, "input_lens": 5}, "input_lens: expected a list"),
        ({**data, "duration": "abc"}, "duration: 'abc': expected the run's seconds"),
        ({**data, "start_times": ["x"] + data["start_times"][1:]}, "start_times[0]: 'x' is not a number"),
        ({**data, "output_lens": [10**30] + data["output_lens"][1:]}, "output_lens[0]: 1000000000000"),
        ({**data, "input_lens": [1e30] + data["input_lens"][1:]}, "input_lens[0]: 1e+30: expected a token count"),
        ({**data, "ttfts": [1e-300] * 12}, "ttfts[0]: 1e-300 s is outside"),
        ({**data, "start_times": [0.0] * 11 + [1e12]}, "start_times: span 1e+12 s"),
        # a long value quoted cut, not whole (the line was 100 kB)
        ({**{k: v for k, v in data.items() if k != "start_times"}, "request_rate": "r" * 100_000},
         "request_rate: 'rrrr"),
        ({**{k: v for k, v in data.items() if k != "start_times"}, "max_concurrency": "c" * 100_000},
         "max_concurrency: 'cccc"),
    ]
    for i, (bad, message) in enumerate(cases):
        p = tmp_path / f"bad{i}.json"
        p.write_text(json.dumps(bad))
        assert main(["calibrate", str(p)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(p) in err and message in err and len(err) < 600, err
    p = tmp_path / "broken.json"
    p.write_text("{ not json")
    assert main(["calibrate", str(p)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    p.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")  # (json recursed: RecursionError)
    assert main(["calibrate", str(p)]) == 2
    assert "not valid JSON: a value nested too deeply" in capsys.readouterr().err


def test_calibrate_never_writes_over_what_it_reads(tmp_path, capsys):
    path = kernel_csv(tmp_path)
    scenario = tmp_path / "mine.toml"
    scenario.write_text('name = "mine"\n[workload]\nrate = 2\nduration_s = 10\n')
    before = path.read_bytes(), scenario.read_bytes()
    for out in (path, scenario):
        assert main(["calibrate", str(path), "--scenario", str(scenario), "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"-o {out}: is " in err and "which this command reads" in err and err.count("\n") == 1
    assert (path.read_bytes(), scenario.read_bytes()) == before


def test_a_recorded_engine_is_freed_by_reference_counting_alone():
    """The recorder bound to its engine makes no cycle: `record_run` repeated in one process
    (a fit, a leave-one-out) frees each engine."""
    def make():
        sc = load_scenario("chat", ["workload.duration_s=5"])
        rec = RecordingCost(CostModel(sc))
        engine = Engine(sc, cost=rec, observers=[rec])
        rec.bind(engine)
        engine.run()
        assert rec.records
        return engine

    assert_freed_by_reference_counting(make)


def test_all_reduce_timings_of_pcie_gpus_set_their_pcie_latency(tmp_path):
    """On GPUs linked by PCIe only the measured line's latency and bandwidth are the PCIe ones,
    which is what their all-reduces take; the NVLink figures are left as they were."""
    lines = ["kind,batch,context,tokens,bytes,gpus,time_ms"]
    for size in (1e3, 1e5, 1e6, 1e7):
        lines.append(f"allreduce,,,,{size:g},4,{(50e-6 + 1.5 * size / 20e9) * 1e3!r}")
    path = tmp_path / "pcie.csv"
    path.write_text("\n".join(lines) + "\n")
    l40s = load_scenario("chat", ['hardware.preset="l40s"', "model.tensor_parallel=4"])
    c = fit_kernels(read_kernel_csv(path), l40s, path).coeffs
    assert c["allreduce_latency_pcie_us"] == pytest.approx(50.0, rel=0.01)
    assert "allreduce_latency_us" not in c
    # and the bytes' share of the link is PCIe's: 20 GB/s of the L40S's 32
    assert c["allreduce_efficiency_pcie"] == pytest.approx(20 / 32, rel=0.01)
    assert "allreduce_efficiency" not in c
    h100 = load_scenario("chat", ["model.tensor_parallel=4"])
    c = fit_kernels(read_kernel_csv(path), h100, path).coeffs
    assert c["allreduce_latency_us"] == pytest.approx(50.0, rel=0.01)
    assert "allreduce_latency_pcie_us" not in c
    assert c["allreduce_efficiency"] == pytest.approx(20 / 450, rel=0.01)
    assert "allreduce_efficiency_pcie" not in c


def test_a_replay_leaves_its_record_as_it_was():
    # a record's intake spells (one loop, thousands of requests) are the run's: replaying it
    # must not drop any, or every later trial of a fit would time a different run
    sc = load_scenario("chat", ["workload.num_requests=2500", "workload.rate=10",
                                'workload.endpoint="chat"'])
    rec = record_run(sc)
    spells = rec.spells.tolist()
    assert len(spells) > 3000  # (a server free to drop them would, from 2,048 on)
    first = rec.replay(CostModel(sc))
    assert rec.spells.tolist() == spells
    again = rec.replay(CostModel(sc))
    assert np.array_equal(first["ttft"], again["ttft"])
