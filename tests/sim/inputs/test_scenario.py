import json

import pytest

from sim.errors import ScenarioError, TraceError
from sim.inputs.scenario import bundled_scenarios, load_scenario, scenario_from_dict
from sim.model.hfconfig import MODELS_DIR
from tui.cli import main


def write(tmp_path, text, name="s.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


BASE = """
name = "t"
seed = 3
[workload]
arrival = "poisson"
rate = 2.0
num_requests = 10
prompt_tokens = 100
output_tokens = 20
"""


def test_defaults_fill_presets_and_derive_blocks(tmp_path):
    sc = load_scenario(write(tmp_path, BASE))
    assert sc.model.num_layers == 32 and sc.model.num_kv_heads == 8
    assert sc.hardware.mem_bandwidth_gbps == 3350.0
    # (80e9 * 0.9 - 8.03e9 * 2 - 1e9) / (16 tokens * 131072 B) for Llama-3.1-8B on an H100
    assert sc.kv.num_blocks == int((80e9 * 0.9 - 8.03e9 * 2 - 1e9) // (16 * 131072))


@pytest.mark.parametrize("override, message", [
    ("kv.blok_size=16", "kv.blok_size: unknown key (did you mean 'block_size'?)"),
    ("workload.rate=0", "workload.rate = 0: must be greater than 0"),
    ("workload.rate=-1.5", "workload.rate = -1.5: must be greater than 0"),
    ("workload.rate=\"fast\"", "workload.rate = 'fast': expected a number"),
    ("kv.block_size=24", "kv.block_size = 24: must be a power of two"),
    ("kv.num_blocks=1.5", "kv.num_blocks = 1.5: expected an integer"),
    ("scheduler.policy=\"fifo\"", "scheduler.policy = 'fifo': unknown policy"),
    ("scheduler.max_num_seqs=-1", "scheduler.max_num_seqs = -1: must be at least 0"),
    ("model.preset=\"llama-9\"", "model.preset = 'llama-9': expected one of"),
    ("workload.arival=\"poisson\"", "did you mean 'arrival'?"),
    ("workload.prompt_tokens.dist=\"zipf\"", "workload.prompt_tokens.dist = 'zipf'"),
    ("scheduler.max_num_seqs=true", "expected an integer"),
    ("bogus=1", "bogus: unknown key"),
])
def test_bad_fields_name_file_field_and_value(tmp_path, override, message):
    path = write(tmp_path, BASE)
    with pytest.raises(ScenarioError) as e:
        load_scenario(path, [override])
    assert message in str(e.value)
    assert path in str(e.value)


def test_unparseable_toml_names_the_file(tmp_path):
    path = write(tmp_path, "name = \n[kv")
    with pytest.raises(ScenarioError, match="not valid TOML"):
        load_scenario(path)


def test_missing_trace_and_malformed_row(tmp_path):
    path = write(tmp_path, BASE.replace('arrival = "poisson"', 'arrival = "trace"\ntrace = "nope.csv"'))
    with pytest.raises(TraceError, match="nope.csv: trace file not found"):
        from sim.inputs.workload import build_workload
        build_workload(load_scenario(path))
    (tmp_path / "bad.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.68,374,44\n"
        "2023-11-16 18:15:47.00,abc,10\n")
    path = write(tmp_path, BASE.replace('arrival = "poisson"', 'arrival = "trace"\ntrace = "bad.csv"'))
    with pytest.raises(TraceError, match=r"bad.csv:3: ContextTokens = 'abc' is not a number"):
        build_workload(load_scenario(path))
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0, "input_length": 5, "output_length": 2}\n'
                                        '{"timestamp": 1, "input_length": 5}\n')
    path = write(tmp_path, BASE.replace('arrival = "poisson"', 'arrival = "trace"\ntrace = "bad.jsonl"'))
    with pytest.raises(TraceError, match=r"bad.jsonl:2: missing field 'output_length'"):
        build_workload(load_scenario(path))


def test_impossible_configurations(tmp_path):
    with pytest.raises(ScenarioError, match="no request could ever fit"):
        load_scenario(write(tmp_path, BASE), ["kv.num_blocks=4", "kv.block_size=16"])
    with pytest.raises(ScenarioError, match="does not fit in hardware.memory_gb"):
        load_scenario(write(tmp_path, BASE), ["model.preset=\"llama-3.1-70b\"",
                                              "hardware.preset=\"l40s\""])
    # sharded over 4 GPUs it fits
    sc = load_scenario(write(tmp_path, BASE), ["model.preset=\"llama-3.1-70b\"",
                                               "hardware.preset=\"h100-sxm\"",
                                               "model.tensor_parallel=4"])
    assert sc.kv.num_blocks > 0
    with pytest.raises(ScenarioError, match="needs num_requests or duration_s"):
        load_scenario(write(tmp_path, BASE.replace("num_requests = 10", "")))
    with pytest.raises(ScenarioError, match="must divide"):
        load_scenario(write(tmp_path, BASE), ["compute.num_heads=4", "compute.num_kv_heads=3"])


def test_set_reaches_nested_distribution_fields(tmp_path):
    path = write(tmp_path, BASE)
    sc = load_scenario(path, ["workload.prompt_tokens.dist=\"uniform\"",
                              "workload.prompt_tokens.min=10", "workload.prompt_tokens.max=20"])
    assert sc.workload.prompt_tokens == {"dist": "uniform", "min": 10, "max": 20}
    with pytest.raises(ScenarioError, match="unknown key for dist = 'uniform'"):
        load_scenario(path, ["workload.prompt_tokens.dist=\"uniform\"",
                             "workload.prompt_tokens.mean=10"])


def test_every_bundled_scenario_loads():
    names = [n for n, _ in bundled_scenarios()]
    assert "chat" in names and "azure-conv" in names
    for n in names:
        sc = load_scenario(n)
        assert sc.kv.num_blocks > 0


def test_unknown_scenario_suggests_a_name():
    with pytest.raises(ScenarioError, match="did you mean 'chat'"):
        load_scenario("chta")


@pytest.mark.parametrize("base, override, message", [
    ("azure-conv", "workload.repeat=0", "workload.repeat = 0: must be at least 1"),
    ("azure-conv", "workload.repeat=2.5", "workload.repeat = 2.5: expected an integer"),
    ("azure-conv", "workload.repeat=true", "workload.repeat = True: expected an integer"),
    ("azure-conv", "workload.repeat=1000000", "workload.repeat = 1000000: must be at most"),
    ("chat", "workload.repeat=3", "workload.repeat = 3: repeats a trace; it needs "
                                  "arrival = \"trace\" (not 'poisson')"),
])
def test_repeat_is_checked_like_every_field(base, override, message):
    with pytest.raises(ScenarioError) as e:
        load_scenario(base, [override])
    assert message in str(e.value) and f"{base}.toml" in str(e.value)
# Values of the right type that no run could carry out: each is refused at load (or when the
# workload is built) with one line naming the file, the field and the value.
@pytest.mark.parametrize("overrides, message", [
    (["seed=-1"], "seed = -1: must be at least 0"),
    (["kv.num_blocks=99999999999999999999999"], "kv.num_blocks = 99999999999999999999999: "
                                                "must fit in 64 bits"),
    (["scheduler.max_num_seqs=-9999999999999999999999"], "must fit in 64 bits"),
    (["workload.duration_s=1e308"], "workload.duration_s = 1e+308: must be at most"),
    (['workload.prompt_tokens={dist="uniform", min=1, max=1e30}'],
     "workload.prompt_tokens.max = 1e+30: must be at most 1e+09"),
    (['workload.prompt_tokens={dist="choice", values=[inf]}'],
     "workload.prompt_tokens.values[0] = inf: must be finite"),
    (['workload.output_tokens={dist="choice", values=[1, 2], weights=[nan, 1]}'],
     "workload.output_tokens.weights[0] = nan: must be finite"),
    (['workload.output_tokens={dist="choice", values=[1, 2], weights=[-1, 1]}'],
     "weights[0] = -1.0: must not be negative"),
    (['workload.output_tokens={dist="choice", values=[1, 2], weights=[0, 0]}'],
     "must not all be 0"),
    (['workload.arrival="gamma"', "workload.cv=1e300"], "workload.cv = 1e+300: must be at most 100"),
    (['workload.prompt_tokens={dist="lognormal", mean=100, cv=1e300}'],
     "workload.prompt_tokens.cv = 1e+300: must be at most 100"),
    (['workload.priority={dist="normal", mean=1, std=1e12}'], "workload.priority.std"),
    (["workload.priority=-1"], "workload.priority = -1.0: must not be negative"),
    (["workload.shared_prefix_tokens=10000000000"], "workload.shared_prefix_tokens"),
    (["workload.num_requests=1000000000"],
     "workload.num_requests = 1000000000: needs about 1,600.0 GB of memory"),
    (["workload.rate=1e300", "workload.num_requests=0"],
     "workload.rate = 1e+300 x duration_s = 10: needs about"),
    (["kv.num_blocks=9223372036854775807"], "kv.num_blocks = 9223372036854775807: needs about"),
    (['scheduler.preemption="swap"', "kv.swap_space_gb=1e300"], "kv.swap_space_gb = 1e+300"),
    (["hardware.memory_gb=1e300"], "hardware.memory_gb = 1e+300: must be at most"),
    (["kv.reserve_gb=1e308"], "kv.reserve_gb = 1e+308: must be less than hardware.memory_gb = 80"),
    (["hardware.mem_bandwidth_gbps=1e-300"], "a one-token decode step would take inf s"),
    (['engine.preset="roofline"', "hardware.step_overhead_ms=1e308"],
     "a one-token decode step would take"),
    (["engine.layer_overhead_us=1e308"], "a one-token decode step would take"),
    (["engine.cpu_base_us=1e300"], "a one-token decode step would take"),
    (["hardware.tdp_w=1e308"], "hardware.tdp_w = 1e+308, idle_w = 90: energies"),
    (['scheduler.policy="disaggregated"', "scheduler.kv_link_gbps=1e-300"],
     "scheduler.kv_link_gbps = 1e-300: one block's K/V would take"),
    (["workload.rate=1e-300", "workload.duration_s=0"],
     "workload.rate = 1e-300: the last request would arrive at t = "),
])
def test_values_that_pass_type_checks_but_could_not_run(tmp_path, overrides, message):
    from sim.inputs.workload import build_workload

    path = write(tmp_path, BASE.replace("num_requests = 10", "duration_s = 10\nnum_requests = 5"))
    with pytest.raises(ScenarioError) as e:
        build_workload(load_scenario(path, overrides))
    assert message in str(e.value) and path in str(e.value) and "\n" not in str(e.value)


def test_a_pool_too_large_for_this_machine_says_how_much_it_needs(tmp_path, monkeypatch):
    import sim.limits

    monkeypatch.setattr(sim.limits, "available_memory", lambda: 8e9)
    path = write(tmp_path, BASE)
    with pytest.raises(ScenarioError, match=r"kv.num_blocks = 1000000000: needs about 160.0 GB "
                                            r"of memory .* more than the 8.0 GB available"):
        load_scenario(path, ["kv.num_blocks=1000000000"])
    assert load_scenario(path, ["kv.num_blocks=10000000"]).kv.num_blocks == 10**7  # 1.6 GB


def test_draws_stay_within_the_fields_bounds(tmp_path, monkeypatch):
    from sim.limits import MAX_TOKENS
    from sim.inputs.workload import build_workload

    import numpy as np

    from sim.inputs.workload import sample

    path = write(tmp_path, BASE)
    sc = load_scenario(path, [
        'workload.prompt_tokens={dist="lognormal", mean=1e9, cv=100}',
        'workload.output_tokens={dist="normal", mean=1e9, std=1e9}',
        'workload.priority={dist="exponential", mean=2e9}', "kv.num_blocks=1000"])
    rng = np.random.default_rng(0)
    for field in ("prompt_tokens", "output_tokens"):
        x = sample(sc, field, 10000, rng)
        assert x.min() >= 0 and x.max() == MAX_TOKENS  # the wide draws are clipped
    p = sample(sc, "priority", 10000, rng)
    assert 0 <= p.min() and p.max() == 2**31 - 1
    # a request of 1e9 output tokens takes 1e9 steps: their records would not fit in memory
    monkeypatch.setattr(__import__("sim.limits").limits, "available_memory", lambda: 8e9)
    with pytest.raises(ScenarioError, match="workload.output_tokens: needs about"):
        build_workload(sc)


def test_setting_dist_keeps_only_what_the_new_distribution_takes(tmp_path):
    # The README's example on the default scenario, whose lengths come from a file.
    sc = load_scenario("chat", ['workload.prompt_tokens.dist="uniform"',
                                "workload.prompt_tokens.min=16", "workload.prompt_tokens.max=512"])
    assert sc.workload.prompt_tokens == {"dist": "uniform", "min": 16, "max": 512}
    sc = load_scenario("chat", ["workload.prompt_tokens.min=16", 'workload.prompt_tokens.dist="uniform"',
                                "workload.prompt_tokens.max=512"])
    assert sc.workload.prompt_tokens == {"dist": "uniform", "min": 16, "max": 512}
    with pytest.raises(ScenarioError, match="dist = 'uniform' needs max, min"):
        load_scenario("chat", ['workload.prompt_tokens.dist="uniform"'])


def test_a_shared_system_prompt_counts_toward_the_smallest_request(tmp_path):
    with pytest.raises(ScenarioError, match="kv.num_blocks = 100: no request could ever fit"):
        load_scenario(write(tmp_path, BASE), ["kv.num_blocks=100",
                                              "workload.shared_prefix_tokens=5000"])
def test_engine_profile_fills_every_coefficient_and_keys_override_it(tmp_path):
    from sim.model.presets import ENGINES

    sc = load_scenario(write(tmp_path, BASE))
    assert sc.engine.preset == "vllm-v1"
    for k, v in ENGINES["vllm-v1"].items():
        assert getattr(sc.engine, k) == v, k
    sc = load_scenario(write(tmp_path, BASE + '[engine]\npreset = "tensorrt-llm-0.6"\n'
                                              'cpu_base_us = 5.0\n'))
    assert sc.engine.cpu_base_us == 5.0
    assert sc.engine.gqa_shared_kv is False  # the rest from the profile
    # A full table (a session log's) written before gqa_reread and chunked_prefill existed
    # keeps the behaviour it was written with (every re-read charged, prompts in chunks), not
    # the profile's values.
    full = {k: v for k, v in ENGINES["tensorrt-llm-0.6"].items()
            if k not in ("gqa_reread", "chunked_prefill")}
    old = load_scenario(write(tmp_path, BASE + "[engine]\npreset = \"tensorrt-llm-0.6\"\n"
                              + "".join(f"{k} = {str(v).lower()}\n" for k, v in full.items())))
    assert old.engine.gqa_reread == 1.0 != ENGINES["tensorrt-llm-0.6"]["gqa_reread"]
    assert old.engine.chunked_prefill is True is not ENGINES["tensorrt-llm-0.6"]["chunked_prefill"]
    # one of vllm-v1 written before its chat term and its one loop: a server without them
    # and before the GEMMs' wave factor: none
    v1 = {k: v for k, v in ENGINES["vllm-v1"].items()
          if k not in ("frontend_chat_request_us", "frontend_one_loop", "gemm_wave_exposure")}
    before = load_scenario(write(tmp_path, BASE + "[engine]\npreset = \"vllm-v1\"\n"
                                 + "".join(f"{k} = {str(v).lower()}\n" for k, v in v1.items())))
    assert (before.engine.frontend_chat_request_us, before.engine.frontend_one_loop,
            before.engine.gemm_wave_exposure) == (0.0, False, 0.0)
    assert ENGINES["vllm-v1"]["gemm_wave_exposure"] > 0
    assert ENGINES["vllm-v1"]["frontend_chat_request_us"] > 0
    assert ENGINES["vllm-v1"]["frontend_one_loop"] is True
    # one of TensorRT-LLM's written before NCCL's in-switch all-reduce: none, whatever its
    # hardware preset's switches (filled from the preset) can do: its steps' times as before
    trt = {k: v for k, v in ENGINES["tensorrt-llm"].items()
           if k not in ("allreduce_nvls", "nvls_latency_us", "nvls_efficiency")}
    tp8 = BASE + ('[model]\npreset = "llama-3.1-70b"\ntensor_parallel = 8\n'
                  '[hardware]\npreset = "h100-sxm"\n[engine]\npreset = "tensorrt-llm"\n')
    logged = load_scenario(write(tmp_path, tp8 + "".join(f"{k} = {str(v).lower()}\n"
                                                         for k, v in trt.items())))
    assert logged.engine.allreduce_nvls is False and logged.hardware.nvlink_sharp == 1
    assert ENGINES["tensorrt-llm"]["allreduce_nvls"] is True
    from sim.model.costmodel import CostModel
    now = load_scenario(write(tmp_path, tp8))
    without = load_scenario(write(tmp_path, tp8 + "allreduce_nvls = false\n"))
    prefill = (8192, 8192 * 8193 // 2, 0, 0, 0, 1, 1)  # (128 MiB an all-reduce)
    assert CostModel(logged).step(*prefill) == CostModel(without).step(*prefill) \
        != CostModel(now).step(*prefill)
    # NIM's and TensorRT-LLM's written before decode attention's one block per sequence and
    # FP8 prefill attention: neither, whatever the hardware's clock (filled from its preset)
    added = ("decode_split_kv", "decode_block_cycles", "fp8_context_attention")
    for name in ("nim", "tensorrt-llm"):
        table = {k: v for k, v in ENGINES[name].items() if k not in added}
        fp8 = BASE + ('[model]\npreset = "llama-3.1-8b"\nkv_dtype_bytes = 1\n'
                      f'[hardware]\npreset = "h100-sxm"\n[engine]\npreset = "{name}"\n')
        logged = load_scenario(write(tmp_path, fp8 + "".join(f"{k} = {str(v).lower()}\n"
                                                             for k, v in table.items())))
        assert logged.engine.decode_split_kv is True and logged.hardware.sm_clock_mhz == 1980
        assert logged.engine.fp8_context_attention is False
        then = load_scenario(write(tmp_path, fp8 + "decode_split_kv = true\n"
                                   "fp8_context_attention = false\n"))
        now = load_scenario(write(tmp_path, fp8))
        long = [(0, 0, 0, 1, 7000, 1, 1), (8192, 8192 * 8193 // 2, 0, 0, 0, 1, 1)]
        assert [CostModel(logged).step(*a) for a in long] == \
            [CostModel(then).step(*a) for a in long] != [CostModel(now).step(*a) for a in long]
    # NIM's written before its decode blocks waited for an SM: none, its other keys as logged
    table = {k: v for k, v in ENGINES["nim"].items() if k != "decode_blocks_per_sm"}
    nim = BASE + ('[model]\npreset = "llama-3.1-8b"\n[hardware]\npreset = "a100-80gb"\n'
                  '[engine]\npreset = "nim"\n')
    logged = load_scenario(write(tmp_path, nim + "".join(f"{k} = {str(v).lower()}\n"
                                                         for k, v in table.items())))
    assert logged.engine.decode_blocks_per_sm == 0.0 and logged.engine.decode_split_kv is False
    then = load_scenario(write(tmp_path, nim + "decode_blocks_per_sm = 0\n"))
    now = load_scenario(write(tmp_path, nim))
    many = (0, 0, 0, 128, 128 * 7000, 128, 128)  # (2,048 blocks on 108 SMs)
    assert CostModel(logged).step(*many) == CostModel(then).step(*many) \
        != CostModel(now).step(*many)
    del full["cpu_base_us"]  # not a full table: the profile fills what it leaves out
    part = load_scenario(write(tmp_path, BASE + "[engine]\npreset = \"tensorrt-llm-0.6\"\n"
                               + "".join(f"{k} = {str(v).lower()}\n" for k, v in full.items())))
    assert part.engine.gqa_reread == ENGINES["tensorrt-llm-0.6"]["gqa_reread"]
    assert part.engine.chunked_prefill is False
    with pytest.raises(ScenarioError, match=r"engine.preset = 'sglang3': unknown engine .*"
                                            r"did you mean 'sglang"):
        load_scenario(write(tmp_path, BASE + '[engine]\npreset = "sglang3"\n'))


def test_engine_profile_from_a_calibrated_file(tmp_path):
    from sim.inputs.scenario import scenario_from_dict

    (tmp_path / "mine.toml").write_text('[engine]\npreset = "sglang"\ncpu_base_us = 1234.0\n'
                                        '[calibration]\nrows = 3\n')
    path = write(tmp_path, BASE + '[engine]\npreset = "mine.toml"\n')
    sc = load_scenario(path)
    assert sc.engine.cpu_base_us == 1234.0 and sc.engine.cpu_overlap  # sglang's flag
    # a resolved scenario (a session log's) reloads without the file
    (tmp_path / "mine.toml").unlink()
    again = scenario_from_dict(sc.to_dict(), source="log", base_dir=tmp_path)
    assert again.engine == sc.engine
    with pytest.raises(ScenarioError, match="mine.toml.*cannot read"):
        load_scenario(path)
    (tmp_path / "mine.toml").write_text("[model]\nx = 1\n")
    with pytest.raises(ScenarioError, match=r"no \[engine\] table"):
        load_scenario(path)
    (tmp_path / "mine.toml").write_text('[engine]\npreset = "nope"\n')
    with pytest.raises(ScenarioError, match="must name a built-in engine"):
        load_scenario(path)
    # a whole profile written before chunked_prefill existed was fitted with prompts in
    # chunks, and keeps them, whatever its base profile does now
    from sim.model.presets import ENGINES

    whole = {k: v for k, v in ENGINES["tensorrt-llm"].items() if k != "chunked_prefill"}
    (tmp_path / "mine.toml").write_text('[engine]\npreset = "tensorrt-llm"\n' + "".join(
        f"{k} = {str(v).lower()}\n" for k, v in whole.items()))
    assert load_scenario(path).engine.chunked_prefill is True
    (tmp_path / "mine.toml").write_text('[engine]\npreset = "tensorrt-llm"\ncpu_base_us = 1.0\n')
    assert load_scenario(path).engine.chunked_prefill is False  # (a partial one: its base's)
    # one written before the K/V-sharing shapes and the PCIe all-reduce existed reads K/V as it
    # did (shared for every shape) and costs PCIe GPUs' all-reduces as NVLink ones
    new = {"gqa_shared_kv_group", "gqa_shared_kv_min_head_dim", "allreduce_latency_pcie_us",
           "custom_allreduce_pcie_gpus"}
    older = {k: v for k, v in ENGINES["tensorrt-llm-0.9"].items() if k not in new}
    (tmp_path / "mine.toml").write_text('[engine]\npreset = "tensorrt-llm-0.9"\n' + "".join(
        f"{k} = {str(v).lower()}\n" for k, v in older.items()))
    e = load_scenario(path).engine
    assert (e.gqa_shared_kv_group, e.gqa_shared_kv_min_head_dim, e.allreduce_latency_pcie_us,
            e.custom_allreduce_pcie_gpus) == (0, 0, 0.0, 0)
    from sim.model.costmodel import CostModel
    l40s = ['hardware.preset="l40s"', 'model.preset="mistral-7b"', "model.tensor_parallel=4"]
    then = CostModel(load_scenario(path, l40s))
    as_nvlink = CostModel(load_scenario(path, l40s + ["engine.allreduce_latency_pcie_us=0",
                                                      "engine.gqa_shared_kv_group=0",
                                                      "engine.gqa_shared_kv_min_head_dim=0"]))
    now = CostModel(load_scenario(path, l40s + ["engine.allreduce_latency_pcie_us=45",
                                                "engine.gqa_shared_kv_group=8"]))
    assert (then._nccl_us, then._custom_us, then._kv_read) == (
        as_nvlink._nccl_us, as_nvlink._custom_us, as_nvlink._kv_read) == (18.0, 6.0, then._kv)
    assert now._nccl_us == 45.0 and now._kv_read > now._kv  # (what the keys now change)
    # one written after the PCIe latency but before its own bandwidth share moves PCIe GPUs'
    # all-reduce bytes at allreduce_efficiency, as it did
    before = {k: v for k, v in ENGINES["tensorrt-llm-0.9"].items()
              if k != "allreduce_efficiency_pcie"}
    (tmp_path / "mine.toml").write_text('[engine]\npreset = "tensorrt-llm-0.9"\n' + "".join(
        f"{k} = {str(v).lower()}\n" for k, v in before.items()))
    assert load_scenario(path).engine.allreduce_efficiency_pcie == 0.0
    old = CostModel(load_scenario(path, l40s))
    at_share = CostModel(load_scenario(path, l40s + [
        f"engine.allreduce_efficiency_pcie={before['allreduce_efficiency']}"]))
    current = CostModel(load_scenario(path, l40s + ["engine.allreduce_efficiency_pcie=0.5"]))
    assert old._nccl_us == 45.0 and old._ar_b1 == at_share._ar_b1 < current._ar_b1


def test_a_scenario_nested_too_deeply_is_one_line(tmp_path):
    # tomllib's parser recurses: 1,000 nested arrays were a RecursionError with a long traceback
    p = tmp_path / "deep.toml"
    p.write_text("a = " + "[" * 1000 + "]" * 1000 + "\n")
    with pytest.raises(ScenarioError, match=r"deep.toml: not valid TOML: a value nested too deeply"):
        load_scenario(str(p))


def test_custom_hardware_needs_a_gpu_link_only_when_the_model_is_sharded():
    gpu = ['hardware.preset=""', "hardware.memory_gb=24", "hardware.mem_bandwidth_gbps=600",
           "hardware.peak_tflops=125", "hardware.tdp_w=150", "hardware.idle_w=20",
           "hardware.pcie_gbps=32"]
    small = ['model.preset="llama-2-7b"', "kv.num_blocks=100"]
    assert load_scenario("chat", [*gpu, *small]).hardware.interconnect_gbps == 0
    with pytest.raises(ScenarioError, match="hardware: preset = \"\" needs every size; missing "
                                            "interconnect_gbps"):
        load_scenario("chat", [*gpu, *small, "model.tensor_parallel=2"])
    load_scenario("chat", [*gpu, *small, "model.tensor_parallel=2", "hardware.interconnect_gbps=64"])


def test_paths_given_with_set_are_read_from_the_current_directory(tmp_path, monkeypatch):
    """`--set engine.preset=mine.toml` (a file `servesim calibrate` just wrote here) and
    `--set workload.trace=t.csv` name files in the current directory, whatever folder the
    scenario lives in (a bundled one included); a scenario file's own paths stay its folder's."""
    (tmp_path / "mine.toml").write_text('[engine]\npreset = "vllm-v1"\ncpu_base_us = 7500.0\n')
    (tmp_path / "t.csv").write_text("arrival_s,prompt_tokens,output_tokens\n0.0,10,5\n0.5,20,6\n")
    monkeypatch.chdir(tmp_path)
    sc = load_scenario("chat", ["engine.preset=mine.toml", 'workload.arrival="trace"',
                                "workload.trace=t.csv"])
    assert sc.engine.cpu_base_us == 7500.0
    assert sc.resolve_path(sc.workload.trace) == tmp_path / "t.csv"
    # a scenario file elsewhere that names its own files keeps reading them from its folder
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "mine.toml").write_text('[engine]\npreset = "vllm-v1"\ncpu_base_us = 9500.0\n')
    (other / "s.toml").write_text('name = "s"\n[workload]\nnum_requests = 2\n'
                                   '[engine]\npreset = "mine.toml"\n')
    assert load_scenario(str(other / "s.toml")).engine.cpu_base_us == 9500.0


@pytest.mark.parametrize("override, message", [
    ("workload.rate=1e-320", r"workload.rate = .*: the mean gap between requests \(1 / rate\) "
                             r"is past the largest float"),
    ('name="bad\\u001b[31mred"', r"name = 'bad\\x1b\[31mred': holds a control character"),
    ('description="ring\\u0007"', r"description = .*: holds a control character"),
])
def test_absurd_rates_and_control_characters_are_one_line(override, message):
    with pytest.raises(ScenarioError, match=message):
        load_scenario("chat", [override])


@pytest.mark.parametrize("override, message", [
    # a hex literal: Python's digit limit does not apply, so TOML gives the integer itself
    ("kv.block_size=0x" + "f" * 5000, "kv.block_size = <an integer of 20000 bits>: must fit "
                                      "in 64 bits"),
    ("workload.rate=0x" + "f" * 5000, "workload.rate = <an integer of 20000 bits>: must be "
                                      "finite"),
    ("kv=0x" + "f" * 5000, "[kv] must be a table, got <an integer of 20000 bits>"),
    ("workload.prompt_tokens={dist=0x" + "f" * 5000 + "}",
     "workload.prompt_tokens.dist = <an integer of 20000 bits>: expected one of"),
    ('workload.prompt_tokens={dist="choice", values=[0x' + "f" * 5000 + ', "x"]}',
     "workload.prompt_tokens.values = <a list holding an integer too long to show>"),
], ids=["integer-field", "float-field", "section", "dist", "list"])
def test_integers_too_long_to_print_or_convert_are_one_line_exit_2(override, message, capsys):
    assert main(["sim", "chat", "-q", "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_a_description_may_hold_line_breaks_and_tabs():
    assert load_scenario("chat", ['description="two\\nlines\\tand a tab"']).description == \
        "two\nlines\tand a tab"


@pytest.mark.parametrize("override, message", [
    ("workload.concurrency=0", "workload.concurrency = 0: must be greater than 0"),
    ("workload.concurrency=-4", "workload.concurrency = -4: must be greater than 0"),
    ("workload.think_time_s=-0.5", "workload.think_time_s = -0.5: must be at least 0"),
    ("workload.think_time_s=nan", "workload.think_time_s = nan: must be finite"),
    ("workload.turnaround_s=-0.001", "workload.turnaround_s = -0.001: must be at least 0"),
    ("workload.turnaround_s=nan", "workload.turnaround_s = nan: must be finite"),
    ("workload.ramp_up_s=-1", "workload.ramp_up_s = -1: must be at least 0"),
    ("workload.turns=0", "workload.turns = 0: must be at least 1"),
    ("workload.prompt_tokens={dist=\"random\", value=100, range_ratio=1.0}",
     "workload.prompt_tokens.range_ratio = 1.0: must be less than 1"),
    ("workload.prompt_tokens={dist=\"random\", range_ratio=0.5}",
     "workload.prompt_tokens: dist = 'random' needs value"),
    ("admission.rate=nan", "admission.rate = nan: must be finite"),
    ("admission.max_waiting=-1", "admission.max_waiting = -1: must be at least 0"),
])
def test_closed_loop_dataset_and_admission_bad_input_is_one_line_exit_2(override, message,
                                                                         capsys):
    assert main(["sim", "chat", "-q", "--set", "workload.concurrency=4", "--set",
                 "workload.num_requests=10", "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "chat.toml" in err and message in err, err


@pytest.mark.parametrize("overrides, message", [
    (["workload.think_time_s=1"], "workload.think_time_s = 1.0: applies to a closed loop"),
    (["workload.turns=3"], "workload.turns = 3: applies to a closed loop"),
    (["workload.concurrency=4"], "a closed loop needs workload.num_requests"),
    (["workload.concurrency=4", "workload.num_requests=9", "cluster.replicas=2"],
     "not modeled across several instances .cluster.replicas = 2"),
    (["workload.concurrency=4", "workload.num_requests=9", "model.tensor_parallel=2",
      "model.data_parallel=2"], "not modeled across several instances .model.data_parallel = 2"),
    (["workload.concurrency=4", "workload.num_requests=9", "model.preset=\"llama-3.1-70b\"",
      "hardware.preset=\"h200\"", "model.pipeline_parallel=2"],
     "several instances .model.pipeline_parallel = 2"),
    (["workload.concurrency=4", "workload.num_requests=9", "workload.arrival=\"trace\"",
      "workload.trace=\"traces/AzureLLMInferenceTrace_conv.csv\""], "times its own arrivals"),
])
def test_closed_loop_keys_that_cannot_go_together_are_refused(overrides, message):
    with pytest.raises(ScenarioError, match=message):
        load_scenario("chat", ["workload.duration_s=0", *overrides])


def test_a_client_mix_is_refused_on_data_parallel_ranks():
    clients = ('workload.clients=[{name="a", share=0.5}, {name="b", share=0.5}]')
    assert load_scenario("chat", [clients]).workload.clients
    with pytest.raises(ScenarioError, match="client mix is not modeled across several "
                                            "instances .model.data_parallel = 2"):
        load_scenario("chat", [clients, "model.tensor_parallel=2", "model.data_parallel=2"])


def test_an_unset_closed_loop_round_trips_through_the_dict():
    sc = load_scenario("chat")
    assert "concurrency" not in sc.to_dict()["workload"]
    closed = load_scenario("chat", ["workload.concurrency=3", "workload.num_requests=5"])
    assert closed.to_dict()["workload"]["concurrency"] == 3


def test_plan_prices_are_checked_and_kept_out_of_the_dict_unless_given():
    assert "plan" not in load_scenario("chat").to_dict()  # (logs of unpriced runs unchanged)
    sc = load_scenario("chat", ["plan.gpu_price_usd_per_hour={h100-sxm=2.5, l40s=1}"])
    assert sc.plan.gpu_price_usd_per_hour == {"h100-sxm": 2.5, "l40s": 1.0}
    again = scenario_from_dict(sc.to_dict())
    assert again.plan.gpu_price_usd_per_hour == sc.plan.gpu_price_usd_per_hour
    for bad, message in (("{h100-sxm=true}", "h100-sxm = True: expected US dollars"),
                         ("{h100-sxm=1e-320}", "h100-sxm = 1e-320: expected US dollars per "
                                               "GPU-hour, from 1e-06"),
                         ("{h100=2}", "h100: unknown GPU"),
                         ("3", "expected a table of GPU")):
        with pytest.raises(ScenarioError, match=message):
            load_scenario("chat", [f"plan.gpu_price_usd_per_hour={bad}"])
# --- model.config ---------------------------------------------------------------------------------
def test_a_config_replaces_the_preset_and_a_size_given_overrides_it():
    sc = load_scenario("chat", ['model.config="mixtral-8x7b"', "model.tensor_parallel=2",
                                "model.max_model_len=4096"])
    m = sc.model
    assert (m.preset, m.num_experts, m.experts_per_token, m.vocab_size) == ("", 8, 2, 32000)
    assert m.num_params == pytest.approx(46.70e9, rel=1e-3) and m.max_model_len == 4096


def test_a_config_gives_its_quantization_unless_the_scenario_sets_one():
    assert load_scenario("chat", ['model.config="deepseek-v3"', "model.tensor_parallel=8",
                                  'hardware.preset="h200"']).model.quantization == "fp8"
    assert load_scenario("chat", ['model.config="deepseek-v3"', "model.tensor_parallel=8",
                                  'hardware.preset="h200"', 'model.quantization="nvfp4"']
                         ).model.quantization == "nvfp4"


def test_a_resolved_model_table_does_not_read_its_config_again(tmp_path):
    """A session log holds every size: it replays without the config file."""
    cfg = tmp_path / "m"
    cfg.mkdir()
    (cfg / "config.json").write_text((load_scenario("chat").base_dir / "models"
                                      / "qwen3-8b.json").read_text())
    p = write(tmp_path, '[model]\nconfig = "m"\n[workload]\nnum_requests = 2\n')
    sc = load_scenario(str(p))
    (cfg / "config.json").unlink()
    with pytest.raises(ScenarioError, match="model.config"):
        load_scenario(str(p))
    sizes = {k: getattr(sc.model, k) for k in ("num_params", "num_layers", "hidden_size",
                                               "num_heads", "num_kv_heads", "head_dim",
                                               "vocab_size", "intermediate_size", "max_model_len")}
    again = load_scenario(str(p), [f"model.{k}={v!r}" for k, v in sizes.items()])
    assert again.model.num_params == sc.model.num_params == pytest.approx(8.19e9, rel=1e-3)


def test_a_config_model_too_big_for_its_gpus_names_the_config():
    with pytest.raises(ScenarioError, match=r"model.config = 'deepseek-v3' \(672.9 GB of weights"):
        load_scenario("chat", ['model.config="deepseek-v3"'])


def test_a_configs_sizes_meet_the_model_fields_bounds(tmp_path):
    raw = json.loads((MODELS_DIR / "llama-3.1-8b.json").read_text())
    raw["max_position_embeddings"] = 10**30
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ScenarioError, match=r"gives model.max_model_len = 10{30}: must fit in "
                                            "64 bits"):
        load_scenario("chat", [f'model.config="{tmp_path}"'])


@pytest.mark.parametrize("overrides, want", [
    # vLLM V1 on a GPU of 70 GB or more other than an A100: 1,024 sequences, 8,192 tokens
    (['hardware.preset="h100-sxm"'], (1024, 8192)),
    (['hardware.preset="h200"'], (1024, 8192)),
    (['hardware.preset="b200"'], (1024, 8192)),
    (['hardware.preset="mi300x"'], (1024, 8192)),
    # an A100 keeps the smaller budget, as does a smaller GPU
    (['hardware.preset="a100-80gb"'], (256, 2048)),
    (['hardware.preset="l40s"'], (256, 2048)),
    (['hardware.preset="h100-sxm"', "hardware.memory_gb=64"], (256, 2048)),
    # SGLang: 2,048 requests, a prefill batch by the GPU's memory
    (['hardware.preset="h100-sxm"', 'engine.preset="sglang"'], (2048, 8192)),
    (['hardware.preset="l40s"', 'engine.preset="sglang"'], (2048, 4096)),
    (['hardware.preset="b200"', 'engine.preset="sglang"'], (2048, 16384)),
    (['hardware.preset="h100-sxm"', 'engine.preset="sglang"', "hardware.memory_gb=24"],
     (2048, 2048)),
    # TensorRT-LLM (its executor and PyTorch backend): 2,048 and 8,192 on any GPU
    (['hardware.preset="l40s"', 'engine.preset="tensorrt-llm"'], (2048, 8192)),
    (['hardware.preset="h100-sxm"', 'engine.preset="tensorrt-llm-pytorch"'], (2048, 8192)),
    (['hardware.preset="a100-40gb"', 'engine.preset="tensorrt-llm-0.9"'], (2048, 8192)),
    # the others: 256 and 2,048 on any GPU
    (['hardware.preset="h100-sxm"', 'engine.preset="tensorrt-llm-0.6"'], (256, 2048)),
    (['hardware.preset="h100-sxm"', 'engine.preset="sglang-0.3"'], (256, 2048)),
    # a limit the scenario gives is kept, the other still the engine's
    (['hardware.preset="h100-sxm"', "scheduler.max_num_seqs=64"], (64, 8192)),
    (['hardware.preset="a100-80gb"', "scheduler.max_num_batched_tokens=512"], (256, 512)),
])
def test_the_schedulers_limits_left_out_are_the_engines_defaults_on_the_gpu(tmp_path,
                                                                            overrides, want):
    path = write(tmp_path, "[model]\npreset = \"llama-3.1-8b\"\n[workload]\nnum_requests = 10\n")
    sc = load_scenario(path, overrides)
    assert (sc.scheduler.max_num_seqs, sc.scheduler.max_num_batched_tokens) == want
