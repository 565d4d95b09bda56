import csv
import json
import shutil

import pytest

from sim.engine.frontend import TERMS
from sim.inputs.scenario import BUNDLED_DIR
from sim.model import presets
from sim.model import profiles as P
from sim.model.validate import (Metric, engine_preset_for, engine_settings_for, load_points,
                                 parse_metric, point_scenario, run_point)
from tui.cli import main

POINTS = BUNDLED_DIR / "fidelity"

WORDINGS = [
    ("1st-token latency (ms)", Metric("ttft", "mean", False, 1e3)),
    ("Median TTFT (ms)", Metric("ttft", "p50", False, 1e3)),
    ("time to first token, p99 (s)", Metric("ttft", "p99", False, 1.0)),
    ("median TPOT (ms)", Metric("tpot", "p50", False, 1e3)),
    ("Mean Time per Output Token (ms)", Metric("tpot", "mean", False, 1e3)),
    ("P90 ITL (ms)", Metric("itl", "p90", False, 1e3)),
    ("inter-token latency (us)", Metric("itl", "mean", False, 1e6)),
    ("Median E2E Latency (ms)", Metric("e2e", "p50", False, 1e3)),
    ("end-to-end latency (s)", Metric("e2e", "mean", False, 1.0)),
    ("output tok/s/GPU", Metric("output_tps", "mean", True)),
    ("Throughput (out tok/s/GPU)", Metric("output_tps", "mean", True)),
    ("output tokens/s per GPU", Metric("output_tps", "mean", True)),
    ("Output token throughput (tok/s)", Metric("output_tps", "mean", False)),
    ("Total Token throughput (tok/s)", Metric("total_tps", "mean", False)),
    ("Request throughput (req/s)", Metric("request_tps", "mean", False)),
    ("tokens/s/user", Metric("user_tps", "mean", False)),
]


@pytest.mark.parametrize("text,metric", WORDINGS)
def test_metric_wordings(text, metric):
    assert parse_metric(text) == metric


@pytest.mark.parametrize("text", ["latency", "accuracy (%)", "TTFT"])
def test_metrics_without_a_quantity_or_unit_are_refused(text):
    with pytest.raises(ValueError):
        parse_metric(text)


@pytest.mark.parametrize("engine,preset", [
    ("TensorRT-LLM v0.5/v0.6.1 gptSessionBenchmark", "tensorrt-llm-0.6"),
    ("TensorRT-LLM 0.9.0", "tensorrt-llm-0.9"),
    ("TensorRT-LLM v0.8.0", "tensorrt-llm-0.9"),
    ("TensorRT-LLM 0.10.0", "tensorrt-llm"),
    ("Triton 24.05 with TensorRT-LLM 0.9.0", "tensorrt-llm-0.9"),  # the engine's version
    ("Triton 24.03, TensorRT-LLM v0.10.0", "tensorrt-llm"),
    ("SGLang 0.3.0 on CUDA 12.4", "sglang-0.3"),
    ("CUDA 12.4, vLLM 0.5.3", "vllm-0.5"),
    ("TensorRT-LLM 0.16.0", "tensorrt-llm"),
    ("TensorRT-LLM 0.18.2 (C++ runtime)", "tensorrt-llm"),
    ("TRT-LLM", "tensorrt-llm"),
    ("tensorrt_llm 0.8.0", "tensorrt-llm-0.9"),  # the package's name
    ("TRT_LLM v0.6.1", "tensorrt-llm-0.6"),
    ("TensorRT-LLM v1.0 trtllm-bench (PyTorch backend)", "tensorrt-llm-pytorch"),
    ("TensorRT-LLM 1.2.0rc1 (trtllm-serve)", "tensorrt-llm-pytorch"),
    ("TensorRT-LLM v1.1 trtllm-bench", "tensorrt-llm-pytorch"),
    ("TensorRT-LLM 1.0 (C++ runtime)", "tensorrt-llm"),
    ("TensorRT-LLM 1.0, TensorRT backend", "tensorrt-llm"),
    ("TensorRT-LLM 0.21.0", "tensorrt-llm"),
    ("TensorRT-LLM backend for Triton 24.07", "tensorrt-llm"),
    ("Triton 25.01, TensorRT-LLM 1.0", "tensorrt-llm"),
    ("TensorRT 10.3, TensorRT-LLM 0.12", "tensorrt-llm"),  # TensorRT's version is not its own
    ("TensorRT-LLM (CUDA 12.4)", "tensorrt-llm"),
    ("TensorRT 10.0 + TensorRT-LLM 0.9", "tensorrt-llm-0.9"),
    ("TensorRT-LLM (v1.2)", "tensorrt-llm-pytorch"),
    ("TensorRT-LLM 1.0 TRT backend", "tensorrt-llm"),
    ("TensorRT-LLM 1.0 (backend: tensorrt)", "tensorrt-llm"),
    ("TensorRT-LLM 1.0, trtllm-build engine", "tensorrt-llm"),
    ("TensorRT-LLM 1.0 gptManagerBenchmark", "tensorrt-llm"),
    ("TensorRT-LLM 1.1 (Triton MoE kernels)", "tensorrt-llm-pytorch"),
    ("TensorRT-LLM 0.21.0 (PyTorch backend)", "tensorrt-llm-pytorch"),
    ("TensorRT-LLM trtllm-bench (PyTorch backend)", "tensorrt-llm-pytorch"),
    ("vLLM 0.6.0 (--num-scheduler-steps 10)", "vllm-0.6-multistep"),
    ("vLLM 0.5.3", "vllm-0.5"),
    ("vLLM v0.6.3", "vllm-0.6"),
    ("vLLM V1 (0.7.3, VLLM_USE_V1=1)", "vllm-v1-sync"),  # (no async scheduling before 0.10)
    ("vLLM 0.10.1", "vllm-v1-sync"),  # V1 before async scheduling was its default
    ("vLLM v0.11.0", "vllm-v1-sync"),  # a version, not the V0 engine
    ("vLLM 0.11.0 (V1), --async-scheduling", "vllm-v1"),
    ("vLLM 0.8.0", "vllm-v1-sync"),
    ("vLLM 0.13.2 (V1)", "vllm-v1-sync"),
    ("vLLM 0.14.1 (V1 engine)", "vllm-v1"),
    ("vLLM 0.14.0", "vllm-v1"),
    ("vLLM 0.19.0", "vllm-v1"),
    ("vLLM V1", "vllm-v1"),
    # async scheduling named, on or off, whatever the spelling
    ("vLLM 0.11 --async_scheduling", "vllm-v1"),
    ("vLLM 0.11, async scheduling on", "vllm-v1"),
    ("vLLM 0.12 (async_scheduling=True)", "vllm-v1"),
    ("vLLM 0.11 --async-scheduling off", "vllm-v1-sync"),
    ("vLLM 0.12 without --async-scheduling", "vllm-v1-sync"),
    ("vLLM 0.15 --no-async-scheduling", "vllm-v1-sync"),
    ("vLLM 0.14 (async_scheduling=False)", "vllm-v1-sync"),
    ("NVIDIA NIM 2.0 (vLLM 0.11)", "vllm-v1-sync"),
    ("vLLM v0.7.3", "vllm-0.6"),
    ("vLLM V0 (v0.9.2)", "vllm-0.6"),
    ("vLLM 0.9.2 V0 engine (VLLM_USE_V1=0)", "vllm-0.6"),
    ("vLLM", "vllm-v1"),
    ("SGLang 0.3.0", "sglang-0.3"),
    ("SGLang v0.4.1", "sglang"),
    ("NVIDIA NIM (TensorRT-LLM backend)", "nim"),
    ("NVIDIA NIM 1.0.3", "nim"),
    ("NIM 24.05", "nim"),
    ("NVIDIA NIM 1.7.2 (TensorRT-LLM 0.16)", "nim"),
    ("NVIDIA NIM 1.8.0", "tensorrt-llm"),
    ("NVIDIA NIM 1.8.0 (TensorRT-LLM engine)", "tensorrt-llm"),
    ("NIM for LLMs 1.14.0", "tensorrt-llm"),
    ("NIM for LLMs 1.10 (vLLM backend)", "vllm-v1"),
    ("NVIDIA NIM 2.0.8", "vllm-v1"),
    ("NVIDIA NIM LLM 2.0.1", "vllm-v1"),
    ("NIM v2", "vllm-v1"),
    ("NVIDIA NIM, 2 x H100 80G", "nim"),
    ("NIM (2 GPUs)", "nim"),
    ("NIM LLM 1.8.0", "tensorrt-llm"),
    ("NVIDIA NIM for Large Language Models, version 1.8.0", "tensorrt-llm"),
    ("NIM for LLMs (1.10.1)", "tensorrt-llm"),
    ("NIM-1.8.0", "tensorrt-llm"),
    ("NIM 1.15.0 (PyTorch backend)", "tensorrt-llm-pytorch"),
    ("NIM (TensorRT-LLM 0.10)", "nim"),
    ("NVIDIA NIM, 2xH100", "nim"),
    ("NVIDIA NIM 2.1.5 (SGLang backend)", "sglang"),
    ("Animus 2", None),
    ("LMDeploy 0.6", None),
])
def test_engine_column_mapping(engine, preset):
    assert engine_preset_for(engine) == preset


@pytest.mark.parametrize("points,least", [(POINTS, 240), (POINTS / "nim-course", 2361)])
def test_bundled_points_run_on_the_profile_their_engine_column_maps_to(points, least):
    # a bundled scenario names its engine profile (it runs the same alone, under `servesim
    # sim`); that profile, with the row's own changes, is the one the row's published engine
    # and version map to
    mapped = 0
    for p in load_points(points):
        preset = engine_preset_for(p.engine)
        if preset is not None:
            mapped += 1
            assert point_scenario(p).engine.preset == preset, (p.id, p.engine)
    assert mapped >= least


def test_bundled_points_load_with_fit_and_holdout_rows():
    pts = load_points(POINTS)
    assert len([p for p in pts if p.use == "fit"]) == 42
    assert all(p.source for p in pts)
    assert {p.use for p in pts} == {"fit", "holdout"}


def test_validate_runs_bundled_points(capsys):
    assert main(["validate", "--only", "T1,T11", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["id"]: r for r in out["points"]}
    assert set(rows) == {"T1", "T11"}
    for r in rows.values():
        assert r["profile"] == "tensorrt-llm-0.6"
        assert r["ratio"] == pytest.approx(r["predicted"] / r["published"])
        assert 0.5 < r["ratio"] < 2
    assert out["summary"]["all"]["count"] == 2
    assert main(["validate", "--only", "T1"]) == 0
    text = capsys.readouterr().out
    assert "T1" in text and "median |err|" in text and "prefill, small" in text


def test_a_points_folder_without_engine_sections_takes_the_engine_column(tmp_path, capsys):
    """The shape of the lead's hidden points: published.csv and one scenario per row that
    names no engine."""
    (tmp_path / "scenarios").mkdir()
    src = (POINTS / "scenarios" / "T1.toml").read_text()
    plain = src.replace('[engine]\npreset = "tensorrt-llm-0.6"\n', "")
    assert "[engine]" not in plain
    (tmp_path / "scenarios" / "A.toml").write_text(plain)
    (tmp_path / "scenarios" / "B.toml").write_text(plain)
    (tmp_path / "published.csv").write_text(
        "id,engine,config,metric,published,regime,source\n"
        "A,TensorRT-LLM v0.5,bs1,1st-token latency (ms),16,prefill,doc\n"
        "B,SGLang 0.4.0,bs1,Mean TTFT (ms),16,prefill,doc\n")
    assert main(["validate", str(tmp_path), "--json"]) == 0
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)["points"]}
    assert rows["A"]["profile"] == "tensorrt-llm-0.6" and rows["B"]["profile"] == "sglang"
    # the same CSV named directly
    assert main(["validate", str(tmp_path / "published.csv"), "--engine", "roofline",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["points"]
    assert {r["profile"] for r in rows} == {"roofline"}


def test_trtllm_rows_chunk_prompts_as_their_program_does(tmp_path):
    # the PyTorch backend's profile chunks prompts (trtllm-bench's default); trtllm-serve does
    # not unless --enable_chunked_prefill is given: a row whose scenario names no engine takes
    # that from its engine column, a scenario that names its engine keeps its own
    (tmp_path / "scenarios").mkdir()
    plain = (POINTS / "scenarios" / "G17.toml").read_text()
    plain = plain[:plain.index("[engine]")] + plain[plain.index("[scheduler]"):]
    plain = plain.replace("../traces/", f"{POINTS / 'traces'}/")
    named = plain.replace("[scheduler]", "[engine]\npreset = \"tensorrt-llm-pytorch\"\n\n[scheduler]")
    for name, text in (("plain", plain), ("named", named)):
        (tmp_path / "scenarios" / f"{name}.toml").write_text(text)
    head = "id,engine,metric,published,scenario\n"
    rows = [("A", "TensorRT-LLM 1.2.0rc1 (trtllm-serve)", "plain"),
            ("B", "TensorRT-LLM 1.2.0rc1 (trtllm-serve --enable_chunked_prefill)", "plain"),
            ("C", "TensorRT-LLM v1.0 trtllm-bench", "plain"),
            ("D", "TensorRT-LLM 1.2.0rc1 (trtllm-serve)", "named"),
            # the C++ runtime's profile computes prompts whole (its executor's default), but
            # trtllm-bench chunks on either backend unless told not to
            ("E", "TensorRT-LLM 0.17.0 trtllm-bench", "plain"),
            ("F", "TensorRT-LLM 0.17.0 trtllm-bench --disable_chunked_context", "plain"),
            ("G", "TensorRT-LLM 0.17.0", "plain"),
            ("H", "TensorRT-LLM v1.0 trtllm-bench (PyTorch; --disable_chunked_context)", "plain"),
            ("I", "TensorRT-LLM 0.19.0 trtllm-serve --enable_chunked_prefill", "plain"),
            ("J", "TensorRT-LLM 0.17.0 trtllm-bench --enable_chunked_context", "plain")]
    (tmp_path / "published.csv").write_text(head + "".join(
        f"{i},{e},median TTFT (ms),45,scenarios/{f}.toml\n" for i, e, f in rows))
    sc = {p.id: point_scenario(p) for p in load_points(tmp_path)}
    assert {i: s.engine.preset for i, s in sc.items()} == {
        **dict.fromkeys("ABCDH", "tensorrt-llm-pytorch"), **dict.fromkeys("EFGIJ", "tensorrt-llm")}
    assert {i: s.engine.chunked_prefill for i, s in sc.items()} == {
        "A": False, "B": True, "C": True, "D": True, "E": True, "F": False, "G": False,
        "H": False, "I": True, "J": True}


@pytest.mark.parametrize("engine,chunked", [
    # what the column says of chunking overrides the program's default, however worded
    ("TensorRT-LLM 1.0 trtllm-serve (chunked prefill off)", False),
    ("TensorRT-LLM 1.0 trtllm-serve, enable_chunked_prefill: false", False),
    ("TensorRT-LLM v1.0 trtllm-bench --enable_chunked_context=False", False),
    ("TensorRT-LLM v1.0 trtllm-bench, chunked context disabled", False),
    ("trtllm-serve, no chunked prefill", False),
    ("TensorRT-LLM 0.17.0 trtllm-bench (chunked context on)", True),
    ("TensorRT-LLM trtllm_bench", True),
    # neither program named, or both: the profile's own
    ("SGLang 0.4 --disable_chunked_prefix_cache", None),
    ("vLLM 0.6 --no-enable-chunked-prefill", None),
    ("TensorRT-LLM 0.17.0", None),
    ("trtllm-serve, then trtllm-bench", None),
])
def test_a_trtllm_rows_words_on_chunking_override_its_programs_default(engine, chunked):
    want = [] if chunked is None else [f"engine.chunked_prefill={str(chunked).lower()}"]
    got = engine_settings_for(engine)
    # (trtllm-serve alone: its LLM API does not pad CUDA graphs, whatever its chunking)
    serve = "serve" in engine and "bench" not in engine
    assert got == (["engine.cuda_graph_padding=false"] if serve else []) + want


def test_a_tensorrt_llm_row_behind_triton_takes_its_api_terms_and_serial_host_time():
    # Triton's TensorRT-LLM backend is an API server in front of the runtime: its row's TTFT
    # includes Triton's time per request, which trtllm-bench's and OpenAI Triton's do not; over
    # the C++ executor its steps also wait for the host's time on each sequence, which other
    # runtimes behind it (0.6's, the PyTorch backend) do not take: their own host time stands
    api = [f"engine.{k}={json.dumps(v)}" for k, v in presets.TRITON_FRONTEND.items()]
    host = [f"engine.{k}={json.dumps(v)}" for k, v in presets.TRITON_HOST.items()]
    assert presets.TRITON_FRONTEND["frontend_request_us"] > 0
    assert presets.TRITON_HOST["cpu_per_seq_us"] > 0
    assert "engine.cpu_overlap=false" in host
    for engine in ("TensorRT-LLM 0.14 (Triton TensorRT-LLM backend)",
                   "TensorRT-LLM 0.12 via tritonserver", "TensorRT-LLM; triton_backend 24.08"):
        assert engine_settings_for(engine) == api + host, engine
    for engine in ("Triton 24.05 with TensorRT-LLM 0.9.0", "Triton 23.12 with TensorRT-LLM 0.6.1",
                   "TensorRT-LLM 1.0 PyTorch backend (Triton TensorRT-LLM backend)"):
        assert engine_settings_for(engine) == api, engine
    for other in ("TensorRT-LLM 1.1 (Triton MoE kernels)", "TensorRT-LLM 0.17 trtllm-bench",
                  "vLLM 0.6 on Triton", "NVIDIA NIM 1.8.0", "TensorRT-LLM triton-moe",
                  "TensorRT-LLM (Triton-kernel attention)", "NVIDIA NIM 1.0 (TensorRT-LLM on Triton)"):
        assert not any("frontend" in o or "cpu_" in o for o in engine_settings_for(other)), other
    pts = {p.id: p for p in load_points(POINTS) if p.id in ("O4", "O13", "O52")}
    sc = point_scenario(pts["O13"])
    assert sc.engine.preset == "tensorrt-llm"
    assert sc.engine.frontend_request_us == presets.TRITON_FRONTEND["frontend_request_us"]
    assert sc.engine.cpu_overlap is False
    assert sc.engine.cpu_per_seq_us == presets.TRITON_HOST["cpu_per_seq_us"]
    # the server's time is in the client's TTFT, not the engine's
    run = run_point(pts["O13"])
    assert run["predicted"] == pytest.approx(23.0, rel=0.02)
    bare = run_point(pts["O13"], overrides=["engine.frontend_request_us=0"])
    request_ms = presets.TRITON_FRONTEND["frontend_request_us"] / 1000
    assert run["predicted"] - bare["predicted"] == pytest.approx(request_ms, rel=0.05)
    # every streamed token passes the ensemble's postprocessing, one at a time: at 2 req/s an
    # 8B's first token waits behind a few others, at 16 req/s a 70B's behind a step of ~170
    # sequences: its TTFT is longer by far more than one token's time, its ITL as long
    token_us = presets.TRITON_FRONTEND["frontend_output_token_us"]
    assert token_us > 0
    no_tokens = ["engine.frontend_output_token_us=0"]
    light = run["predicted"] - run_point(pts["O13"], overrides=no_tokens)["predicted"]
    heavy = run_point(pts["O4"])["predicted"] - run_point(pts["O4"], overrides=no_tokens)["predicted"]
    assert 0 < light < 20 * token_us / 1000 < heavy
    # at 16 req/s the host's time on some 170 sequences a step lengthens the steps: the ITL
    # is longer than with that time overlapped (an override after the column's terms wins),
    # by more than the time itself
    loaded = run_point(pts["O52"])
    overlapped = run_point(pts["O52"], overrides=["engine.cpu_overlap=true"])
    assert loaded["predicted"] == pytest.approx(66.0, rel=0.1)
    assert loaded["predicted"] > overlapped["predicted"] * 1.15
    assert run_point(pts["O52"], overrides=no_tokens)["predicted"] == pytest.approx(
        loaded["predicted"], rel=0.01)


def test_a_rows_set_column_changes_its_scenario(tmp_path, capsys):
    """Rows of one table share one scenario, each setting its own users and lengths: the
    `set` column's overrides apply to that row alone, before the command line's."""
    (tmp_path / "scenarios").mkdir()
    shutil.copy(POINTS / "scenarios" / "N1.toml", tmp_path / "scenarios" / "one.toml")
    head = "id,engine,metric,published,scenario,set\n"
    row = "{},NIM,mean TTFT (ms),20,scenarios/one.toml,{}\n"
    (tmp_path / "published.csv").write_text(
        head + row.format("A", "") + row.format("B", "workload.prompt_tokens=4000")
        + row.format("C", "workload.prompt_tokens = 4000 ; workload.concurrency=5;"))
    pts = {p.id: p for p in load_points(tmp_path)}
    assert pts["A"].overrides == [] and pts["B"].overrides == ["workload.prompt_tokens=4000"]
    assert pts["C"].overrides == ["workload.prompt_tokens = 4000", "workload.concurrency=5"]
    assert main(["validate", str(tmp_path), "--json"]) == 0
    ttft = {r["id"]: r["predicted"] for r in json.loads(capsys.readouterr().out)["points"]}
    # a prompt 20x as long takes longer to prefill; five users queue behind each other
    assert ttft["B"] > 5 * ttft["A"] and ttft["C"] > 1.2 * ttft["B"]
    # the command line's overrides come after the row's
    assert main(["validate", str(tmp_path), "--json", "--set",
                 "workload.prompt_tokens=200"]) == 0
    again = {r["id"]: r["predicted"] for r in json.loads(capsys.readouterr().out)["points"]}
    assert again["A"] == again["B"] == ttft["A"]


def test_a_rows_set_column_names_files_from_its_folder_and_is_blamed_for_its_errors(
        tmp_path, monkeypatch, capsys):
    (tmp_path / "pts" / "scenarios").mkdir(parents=True)
    shutil.copy(POINTS / "scenarios" / "N1.toml", tmp_path / "pts" / "scenarios" / "one.toml")
    (tmp_path / "pts" / "lengths.csv").write_text(
        "num_prefill_tokens,num_decode_tokens\n300,20\n500,40\n")
    lengths = ('workload.prompt_tokens.dist="empirical"; workload.prompt_tokens.file=lengths.csv; '
               'workload.prompt_tokens.column="num_prefill_tokens"')
    with open(tmp_path / "pts" / "published.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "engine", "metric", "published", "scenario", "set"])
        for pid, sets in (("A", lengths), ("B", 'description="a; b"; seed=3'),
                          ("C", "workload.bogus=3")):
            w.writerow([pid, "NIM", "mean TTFT (ms)", 20, "scenarios/one.toml", sets])
    pts = {p.id: p for p in load_points(tmp_path / "pts")}
    # a `;` inside a value that no key and `=` follow stays in it
    assert pts["B"].overrides == ['description="a; b"', "seed=3"]
    monkeypatch.chdir(tmp_path)  # (not the points file's folder)
    assert run_point(pts["A"])["predicted"] > 0
    assert main(["validate", str(tmp_path / "pts"), "--only", "C"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ":4: C: set: " in err and "workload.bogus: unknown key" in err


def test_the_nim_course_table_loads_one_scenario_per_configuration():
    pts = load_points(POINTS / "nim-course")
    assert len(pts) == 2361 and {p.use for p in pts} == {"holdout"}
    assert len({p.scenario_path for p in pts}) == 12
    assert {p.metric.quantity for p in pts} == {"ttft", "itl", "output_tps"}
    one = next(p for p in pts if p.id == "K8b_a100x2_fp16_200_1000_c1_itl")
    assert one.published == pytest.approx(8.3325)  # N1's figure, the same run
    r = run_point(one)
    assert r["profile"] == "nim" and 0.9 < r["ratio"] < 1.1


def test_nims_profile_serves_behind_its_api_server():
    # one user's TTFT (N3) takes NIM's time per request and its tokenising, one user's ITL (N1)
    # neither: the server's time is before the first token, not between tokens
    front = presets.NIM_FRONTEND
    assert front["frontend_request_us"] > 0 and presets.ENGINES["nim"]["frontend_request_us"] == \
        front["frontend_request_us"]
    pts = {p.id: p for p in load_points(POINTS) if p.id in ("N1", "N3")}
    bare = [f"engine.{k}=0" for k in front]
    ttft, ttft_bare = run_point(pts["N3"]), run_point(pts["N3"], overrides=bare)
    server_ms = (front["frontend_request_us"] + 200 * front["frontend_prompt_token_us"]) / 1000
    assert ttft["predicted"] - ttft_bare["predicted"] == pytest.approx(server_ms, rel=0.01)
    assert ttft["ratio"] == pytest.approx(1.0, abs=0.05)
    assert run_point(pts["N1"], overrides=bare)["predicted"] == pytest.approx(
        run_point(pts["N1"])["predicted"], rel=1e-3)


@pytest.mark.parametrize("csv_text,message", [
    ("id,engine,published\nA,x,1\n", ":1: missing column(s) metric"),
    ("id,engine,metric,published\nA,x,accuracy,1\n", ":2: metric:"),
    ("id,engine,metric,published\nA,x,TTFT (ms),fast\n", ":2: published: 'fast'"),
    ("id,engine,metric,published\nA,x,TTFT (ms),-3\n", ":2: published: '-3' must be a positive number"),
    ("id,engine,metric,published\nZ,x,TTFT (ms),3\n", ":2: scenario:"),
    # a figure too small to divide a prediction by (every ratio was infinite)
    ("id,engine,metric,published\nA,x,TTFT (ms),1e-320\n", ":2: published: '1e-320' must be "
                                                           "a positive number of at least 1e-09"),
    ("id,engine,metric,published\nA,x,TTFT (ms)," + "1" * 5000 + "\n", ":2: published: '111"),
    # what csv itself refuses (a _csv.Error traceback), and long values quoted cut
    ("id,engine,metric,published\nA,x,TTFT (ms)," + "1" * 200_000 + "\n",
     ":2: not CSV: field larger than field limit"),
    ("id,engine,metric,published,use\nA,x,TTFT (ms),3," + "u" * 5000 + "\n", ":2: use: 'uuu"),
    ("id,engine,metric,published\nA,x," + "m" * 5000 + ",3\n", ":2: metric: 'mmm"),
    ("id,engine,metric,published\nT1,x,TTFT (ms),3\nT1,x,TTFT (ms),3\n", ":3: id: 'T1' appears twice"),
    ("id,engine,metric,published,set\nT1,x,TTFT (ms),3,workload.concurrency\n",
     ":2: set: 'workload.concurrency': expected SECTION.KEY=VALUE"),
    ("id,engine,metric,published,set\nT1,x,TTFT (ms),3,a..b=1\n", ":2: set: 'a..b=1': an empty"),
    ("id,engine,metric,published,set\nT1,x,TTFT (ms),3," + "s" * 5000 + "\n", ":2: set: 'sss"),
    # a value with an unquoted comma: more fields than the header (an AttributeError traceback)
    ("id,engine,metric,published\nT1,vLLM 0.8, 0.9,TTFT (ms),3\n",
     ":2: 5 fields, the header has 4 (a value with a comma unquoted?)"),
], ids=lambda v: v[:40] if isinstance(v, str) else None)
def test_bad_points_files_are_one_line_and_exit_2(tmp_path, capsys, csv_text, message):
    (tmp_path / "published.csv").write_text(csv_text)
    shutil.copytree(POINTS / "scenarios", tmp_path / "scenarios")
    assert main(["validate", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    # (one short line: a 5,000-digit value is cut, not quoted whole)
    assert err.count("\n") == 1 and message in err and len(err) < 400, err


def test_validate_a_bench_result_json(tmp_path, capsys):
    from tests.sim.model.test_calibrate import bench_result

    # (an odd count: the median of an even one is the midpoint of the two middle requests in
    # the JSON and one of them in the simulator's quantile, apart wherever the two differ)
    path, _ = bench_result(tmp_path, {"cpu_base_us": 2500.0}, n=41)
    assert main(["validate", str(path), "--scenario", "chat", "--set", "engine.cpu_base_us=2500",
                 "--json"]) == 0
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)["points"]}
    assert {"median_ttft", "mean_tpot", "median_itl", "output_throughput"} <= set(rows)
    # replayed on the deployment that produced it, the requests come out as measured
    for r in rows.values():
        assert r["ratio"] == pytest.approx(1.0, abs=0.02), r


def test_plot_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    for name in ("p.png", "p.svg"):
        assert main(["validate", "--only", "T1,T2", "--plot", str(tmp_path / name)]) == 0
        assert (tmp_path / name).stat().st_size > 1000
    capsys.readouterr()


def test_fit_and_leave_one_out_on_a_few_points(capsys, tmp_path):
    """`validate --loo` on four static rows: one refit per left-out row, each predicting a row
    it never saw, so the held-out error is no better than the in-sample error of the full fit.
    `--trust` writes each row's out-of-sample ratio, regime and setup."""
    from sim.model import profiles as P
    from sim.model import trust as T
    from sim.model.validate import error_stats

    ids = ["T1", "T2", "T5", "T6"]
    trust_file = tmp_path / "t.json"
    assert main(["validate", "--only", ",".join(ids), "--loo", "--json",
                 "--trust", str(trust_file)]) == 0
    out = json.loads(capsys.readouterr().out)
    loo = out["leave_one_out"]
    assert sorted(loo) == sorted(ids) and all(0.2 < r < 5 for r in loo.values())
    assert out["leave_one_out_error"]["count"] == 4
    written = T.load(trust_file)["points"]
    assert {i: written[i]["ratio"] for i in ids} == loo
    assert written["T1"]["hardware"] == "a100-80gb" and written["T1"]["model"] == "llama-2-7b"

    rows = P.prepare([p for p in load_points(BUNDLED_DIR / "fidelity") if p.id in ids])
    c = out["coefficients"]
    inside = {r.point.id: P.predict(r, c, simulate=True) / r.point.published for r in rows}
    assert max(abs(loo[i] - inside[i]) for i in ids) > 0.05  # (a refit without the row)
    assert (out["leave_one_out_error"]["median_abs_error"]
            > error_stats(list(inside.values()))["median_abs_error"])
    # Each refit starts from the priors, not from the shipped profiles (fitted on every row,
    # the left-out one included): moving those moves nothing.
    assert [r for _, r in P.leave_one_out(rows)] == [loo[i] for i in ids]
    shipped = P.presets.ENGINES["tensorrt-llm-0.6"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(shipped, "gemm_efficiency", shipped["gemm_efficiency"] / 2)
        mp.setitem(shipped, "cpu_base_us", shipped["cpu_base_us"] * 3)
        assert [r for _, r in P.leave_one_out(rows)] == [loo[i] for i in ids]


def test_leave_group_out_holds_out_every_row_of_a_value_together(capsys):
    """`validate --leave-out model`: one refit per model without any of its rows. With one row
    per model it is leave-one-out; with two, each fold's prediction differs from leaving out a
    single row (its partner is gone from the fit too); a model every row shares is not held out
    (nothing would be left to fit)."""
    from sim.model import profiles as P
    assert main(["validate", "--only", "T1,T3", "--leave-out", "model", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["leave_group_out"]
    assert out["key"] == "model" and out["error"]["count"] == 2
    assert {g: list(v["points"]) for g, v in out["groups"].items()} == {
        "llama-2-7b": ["T1"], "llama-2-70b": ["T3"]}
    rows = P.prepare([p for p in load_points(BUNDLED_DIR / "fidelity") if p.id in ("T1", "T3")])
    assert {p.id: r for p, r in P.leave_one_out(rows)} == {
        **out["groups"]["llama-2-7b"]["points"], **out["groups"]["llama-2-70b"]["points"]}

    rows = P.prepare([p for p in load_points(BUNDLED_DIR / "fidelity")
                      if p.id in ("T1", "T2", "T3", "T4")])
    folds = dict(P.leave_group_out(rows, "model"))
    assert {g: [p.id for p, _ in v] for g, v in folds.items()} == {
        "llama-2-7b": ["T1", "T2"], "llama-2-70b": ["T3", "T4"]}
    alone = dict((p.id, r) for p, r in P.leave_one_out(rows))
    assert all(0.2 < r < 5 for v in folds.values() for _, r in v)
    assert any(abs(r - alone[p.id]) > 1e-6 for v in folds.values() for p, r in v)
    assert P.leave_group_out(rows, "hardware") == []  # every row on the A100


def test_leave_one_out_of_an_engines_only_row_uses_its_priors():
    # V1 is the only vLLM row here: left out, no row fits vLLM's coefficients, and the ones its
    # scenario was built with (the shipped profile) were fitted on V1 itself.
    from sim.model import profiles as P
    def v1_ratio():
        rows = P.prepare([p for p in load_points(BUNDLED_DIR / "fidelity")
                          if p.id in ("T1", "T5", "V1")])
        return dict((p.id, r) for p, r in P.leave_one_out(rows))["V1"]

    shipped = P.presets.ENGINES["vllm-0.6-multistep"]
    want = v1_ratio()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(shipped, "gemm_efficiency", shipped["gemm_efficiency"] / 2)
        mp.setitem(shipped, "cpu_base_us", shipped["cpu_base_us"] * 3)
        assert v1_ratio() == want


def test_vllm_multistep_online_ttft_rows_are_behind_its_api_server():
    # S4 fitted vLLM 0.6's API server time; S5 (held out) is the same deployment at 8 req/s
    points = {p.id: p for p in load_points(POINTS) if p.id in ("S4", "S5")}
    s4, s5 = run_point(points["S4"]), run_point(points["S5"])
    assert s4["ratio"] == pytest.approx(1.0, abs=0.01)
    bare = ["engine.frontend_request_us=0", "engine.frontend_prompt_token_us=0"]
    assert run_point(points["S4"], overrides=bare)["ratio"] < 0.95
    assert run_point(points["S5"], overrides=bare)["ratio"] < s5["ratio"] < 1.0


def test_the_v0_one_step_vllm_profiles_keep_no_api_server_and_v1_keeps_its_own():
    # the multi-step time per request carries what a multi-step window adds to a light-load
    # TTFT: the V0 one-step profiles derived from it (as shipped and as a fit derives them) keep
    # none; vLLM V1 has its own, fitted apart on F3 and F7, as shipped and as a fit derives it
    assert presets.ENGINES["vllm-0.6-multistep"]["frontend_request_us"] > 0
    fitted = P.profiles({})
    for name in ("vllm-0.6", "vllm-0.5"):
        assert all(presets.ENGINES[name][k] == 0 for k in TERMS), name
        assert all(fitted[name][k] == 0 for k in TERMS), name
    v1 = {k: presets.ENGINES["vllm-v1"][k] for k in TERMS}
    assert v1["frontend_request_us"] > presets.ENGINES["vllm-0.6-multistep"]["frontend_request_us"]
    assert {k: fitted["vllm-v1"][k] for k in TERMS} == v1


def test_vllm_v1_light_load_ttft_rows_are_behind_its_api_server():
    # F3 (a 70B in FP8 on an H200) and F7 (Qwen3-0.6B on an H100) fitted vLLM V1's API server
    # time; without it the tiny model's TTFT is a seventh of the published one
    points = {p.id: p for p in load_points(POINTS) if p.id in ("F3", "F7", "E1")}
    f3, f7 = run_point(points["F3"]), run_point(points["F7"])
    assert f7["ratio"] == pytest.approx(1.0, abs=0.01)
    assert 1.0 < f3["ratio"] < 1.25
    bare = ["engine.frontend_request_us=0", "engine.frontend_prompt_token_us=0"]
    assert run_point(points["F7"], overrides=bare)["ratio"] < 0.2
    # E1 (held out, B200s) was 0.62 without it
    assert 0.62 < run_point(points["E1"])["ratio"] < 1.4


def test_sglangs_online_ttft_rows_are_compared_with_what_its_clients_measured():
    # V5 fitted SGLang's API server time; S1 (held out) is the same deployment at twice the rate
    points = {p.id: p for p in load_points(POINTS) if p.id in ("V5", "S1")}
    v5, s1 = run_point(points["V5"]), run_point(points["S1"])
    assert v5["ratio"] == pytest.approx(1.0, abs=0.01)
    assert s1["ratio"] == pytest.approx(1.0, abs=0.05)
    # without the server the engine's TTFT is about 0.8 of the published one
    bare = ["engine.frontend_request_us=0", "engine.frontend_prompt_token_us=0"]
    assert run_point(points["V5"], overrides=bare)["ratio"] < 0.85


def test_vllm_v1_before_async_scheduling_was_its_default_schedules_in_series():
    # vLLM 0.8-0.13 ran its scheduler after each step ended (async scheduling became the
    # default in 0.14): the row's engine pays its host time beside the GPU's, not under it,
    # and its scheduler frees a finished request's blocks at once
    from sim.inputs.scenario import load_scenario
    from sim.model.costmodel import CostModel

    assert engine_settings_for("vLLM 0.11.0") == ["scheduler.async_scheduling=false"]
    assert engine_settings_for("vLLM 0.11.0, --async-scheduling") == []
    assert engine_settings_for("vLLM 0.14.1") == []
    sync, v1 = presets.ENGINES["vllm-v1-sync"], presets.ENGINES["vllm-v1"]
    assert sync["cpu_overlap"] is False and v1["cpu_overlap"] is True
    # the same kernels and API server: only the host's time and its overlap differ
    assert set(v1) == set(sync)
    assert {k for k in v1 if v1[k] != sync[k]} == {"cpu_overlap", "cpu_base_us", "cpu_per_seq_us"}
    assert presets.scheduler_defaults("vllm-v1-sync", "h100-sxm", 80.0) == \
        presets.scheduler_defaults("vllm-v1", "h100-sxm", 80.0)
    for n in (1.0, 256.0):
        step = {}
        for name in ("vllm-v1", "vllm-v1-sync"):
            sc = load_scenario("chat", [f'engine.preset="{name}"'])
            cost = CostModel(sc)
            step[name] = cost.step(0.0, 0.0, 0.0, n, n * 1000, n, n)[0]
        host = (sync["cpu_base_us"] + sync["cpu_per_seq_us"] * n) * 1e-6
        gpu_only = CostModel(load_scenario("chat", ['engine.preset="vllm-v1-sync"',
                                                    "engine.cpu_base_us=0",
                                                    "engine.cpu_per_seq_us=0"]))
        gpu = gpu_only.step(0.0, 0.0, 0.0, n, n * 1000, n, n)[0]
        assert step["vllm-v1-sync"] == pytest.approx(gpu + host, rel=1e-12)
        assert step["vllm-v1"] < step["vllm-v1-sync"]
    pts = {p.id: p for p in load_points(POINTS) if p.id in ("G3", "G18", "G20", "D1", "F7")}
    for pid, name, lag in (("G3", "vllm-v1-sync", False), ("G18", "vllm-v1-sync", False),
                           ("D1", "vllm-v1-sync", False), ("G20", "vllm-v1", True),
                           ("F7", "vllm-v1", True)):
        sc = point_scenario(pts[pid])
        assert (sc.engine.preset, sc.scheduler.async_scheduling) == (name, lag), pid


def test_a_row_mapped_to_vllm_v1_sync_takes_its_scheduler_too(tmp_path):
    # a scenario naming no engine: the row's engine column picks the profile, and the
    # profile's scheduler comes with it, as it does for `--engine`
    (tmp_path / "scenarios").mkdir()
    (tmp_path / "scenarios" / "X.toml").write_text(
        'name = "X"\n[model]\npreset = "llama-3.1-8b"\n[hardware]\npreset = "h100-sxm"\n'
        "[workload]\nconcurrency = 1\nnum_requests = 4\nprompt_tokens = 100\n"
        "output_tokens = 50\n")
    rows = ["id,engine,metric,published,scenario",
            "A,vLLM 0.11.0,median TPOT (ms),7.22,scenarios/X.toml",
            "B,vLLM 0.11.0 --async-scheduling,median TPOT (ms),7.22,scenarios/X.toml",
            "C,vLLM 0.14.1,median TPOT (ms),7.22,scenarios/X.toml"]
    (tmp_path / "published.csv").write_text("\n".join(rows) + "\n")
    pts = {p.id: p for p in load_points(tmp_path)}
    got = {i: (point_scenario(p).engine.preset, point_scenario(p).scheduler.async_scheduling)
           for i, p in pts.items()}
    assert got == {"A": ("vllm-v1-sync", False), "B": ("vllm-v1", True), "C": ("vllm-v1", True)}
    forced = point_scenario(pts["C"], engine="vllm-v1-sync")
    assert (forced.engine.preset, forced.scheduler.async_scheduling) == ("vllm-v1-sync", False)
