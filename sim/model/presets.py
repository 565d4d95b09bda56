"""Modeled models, GPUs and serving engines, in the units the scenario file uses.

Model figures are from the models' published configs; GPU figures are vendor data-sheet values
(dense bf16 and FP8 tensor FLOP/s without sparsity, HBM bandwidth, board power): physical facts,
never fitted. `idle_w` is an assumed idle draw, not a data-sheet figure.

Engine profiles hold what differs between serving engines and is fitted to measurements: how
close their kernels come to the hardware's peaks, their fixed costs per layer and per step, their
CPU time per step and whether it overlaps the GPU's, and whether their decode attention shares K/V
across a GQA group. `sim.model.costmodel` documents each coefficient; sim/README.md says what each profile
was fitted on and its leave-one-out error.
"""

from __future__ import annotations

MODELS: dict[str, dict] = {
    "llama-3.1-8b": dict(
        num_params=8.03e9, num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
        head_dim=128, vocab_size=128256, max_model_len=131072,
    ),
    "llama-3.1-70b": dict(
        num_params=70.6e9, num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
        head_dim=128, vocab_size=128256, max_model_len=131072,
    ),
    "llama-2-7b": dict(
        num_params=6.74e9, num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32,
        head_dim=128, vocab_size=32000, max_model_len=4096,
    ),
    "llama-2-70b": dict(
        num_params=68.98e9, num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
        head_dim=128, vocab_size=32000, max_model_len=4096,
    ),
    "mistral-7b": dict(
        num_params=7.25e9, num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
        head_dim=128, vocab_size=32768, max_model_len=32768,
    ),
}

HARDWARE: dict[str, dict] = {
    "h100-sxm": dict(memory_gb=80.0, mem_bandwidth_gbps=3350.0, peak_tflops=989.0, fp8_tflops=1979.0,
                     tdp_w=700.0, idle_w=90.0, interconnect_gbps=450.0, pcie_gbps=64.0),
    "h200": dict(memory_gb=141.0, mem_bandwidth_gbps=4800.0, peak_tflops=989.0, fp8_tflops=1979.0,
                 tdp_w=700.0, idle_w=90.0, interconnect_gbps=450.0, pcie_gbps=64.0),
    "a100-80gb": dict(memory_gb=80.0, mem_bandwidth_gbps=2039.0, peak_tflops=312.0, fp8_tflops=0.0,
                      tdp_w=400.0, idle_w=60.0, interconnect_gbps=300.0, pcie_gbps=32.0),
    "l40s": dict(memory_gb=48.0, mem_bandwidth_gbps=864.0, peak_tflops=362.0, fp8_tflops=733.0,
                 tdp_w=350.0, idle_w=40.0, interconnect_gbps=32.0, pcie_gbps=32.0),
}

# Hardware fields a preset may leave at 0 (`fp8_tflops`: the GPU has no FP8 tensor cores).
OPTIONAL_HARDWARE = ("fp8_tflops",)

# Engine profiles (see the module docstring; `sim.model.costmodel` defines each coefficient).
# The fitted values come from `servesim validate --fit` on the bundled points (sim.model.profiles says
# what is fitted and how); sim/README.md reports their error and leave-one-out error.
# Shared by every engine: the kernels' efficiencies and fixed costs.
_KERNELS = dict(
    fp8_gemm_efficiency=0.6653, bandwidth_efficiency=0.833, attention_efficiency=0.4902,
    elementwise_efficiency=0.5, layer_overhead_us=26.38, allreduce_efficiency=0.7,
)
_ONE_STEP = dict(cpu_overlap=False, gqa_shared_kv=True, gqa_reread=1.0, num_scheduler_steps=1)
ENGINES: dict[str, dict] = {
    # TensorRT-LLM 0.5/0.6 (gptSessionBenchmark): its decode attention read K/V per query head,
    # about half of a GQA group's re-reads reaching HBM (the others hit in L2).
    "tensorrt-llm-0.6": dict(_KERNELS, **_ONE_STEP, gemm_efficiency=0.8147,
                             kv_bandwidth_efficiency=1.0, allreduce_latency_us=64.40,
                             cpu_base_us=3036.0, cpu_per_seq_us=4.317)
    | dict(gqa_shared_kv=False, gqa_reread=0.5352),
    # vLLM 0.6 with --num-scheduler-steps 10.
    "vllm-0.6-multistep": dict(_KERNELS, **_ONE_STEP, gemm_efficiency=0.7527,
                               kv_bandwidth_efficiency=0.7239, allreduce_latency_us=22.98,
                               cpu_base_us=3147.0, cpu_per_seq_us=6.074) | dict(num_scheduler_steps=10),
    # SGLang 0.3 (no overlap scheduler yet).
    "sglang-0.3": dict(_KERNELS, **_ONE_STEP, gemm_efficiency=0.7136, kv_bandwidth_efficiency=0.6867,
                       allreduce_latency_us=26.76, cpu_base_us=2567.0, cpu_per_seq_us=40.73),
}
# Profiles without bundled points of their own, derived from a fitted one (sim/README.md: why;
# sim.model.profiles.DERIVED and RATIOS say how).
ENGINES["tensorrt-llm"] = dict(ENGINES["tensorrt-llm-0.6"], gqa_shared_kv=True, cpu_overlap=True)
ENGINES["sglang"] = dict(ENGINES["sglang-0.3"], cpu_overlap=True)
ENGINES["vllm-v1"] = dict(ENGINES["vllm-0.6-multistep"], num_scheduler_steps=1, cpu_overlap=True)
# V0 without multi-step: serial CPU time, refitted to the vLLM team's published ratios.
ENGINES["vllm-0.6"] = dict(ENGINES["vllm-0.6-multistep"], num_scheduler_steps=1,
                           cpu_per_seq_us=127.4)
ENGINES["vllm-0.5"] = dict(ENGINES["vllm-0.6-multistep"], num_scheduler_steps=1,
                           cpu_per_seq_us=337.7)
ENGINES = {k: ENGINES[k] for k in ("vllm-v1", "vllm-0.6-multistep", "vllm-0.6", "vllm-0.5",
                                   "sglang", "sglang-0.3", "tensorrt-llm", "tensorrt-llm-0.6")}
ENGINE_PRESETS = [*ENGINES, "roofline"]
# What a user running today's vLLM gets.
DEFAULT_ENGINE = "vllm-v1"
