"""Scenario files: the schema, loading, `--set` overrides and every check made at load time.

A scenario is a TOML file with top-level `name`, `description`, `seed` and the sections
`[model]`, `[hardware]`, `[engine]`, `[kv]`, `[scheduler]`, `[workload]`, `[slo]`, `[compute]`, `[cluster]`. Every field is
declared once below with its type and bounds; an unknown key, a wrong type or an out-of-range
value raises ScenarioError naming the file, the field and the value.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.errors import CONTROL, ScenarioError, shown
from sim.fileio import LONG_INT_MESSAGE, read_input_text, reason, toml_loads
from sim.inputs.workload import min_length
from sim.model import presets
from sim.engine.kv import arrival_blocks
from sim.model.costmodel import CostModel, ModelShape, kv_groups
from sim.model.hfconfig import read_config
from sim.policies import POLICIES
from sim.policies.base import prefill_chunk
from sim.limits import (INT64_MAX, MAX_TIME_S, MAX_TOKENS, PRIORITY_RANGE,
                        USD_PER_GPU_HOUR_TEXT, check_deployment, usd_per_gpu_hour_ok)

BUNDLED_DIR = Path(__file__).resolve().parents[2] / "scenarios"
DEFAULT_SCENARIO = "chat"
MAX_SCENARIO_BYTES = 16 << 20  # a scenario is a page of TOML; traces are separate files
# `scheduler.policy` values that name a deployment of several instances rather than one policy
# (sim.deploy.cluster builds them).
DEPLOYMENT_POLICIES = ("disaggregated",)


def _f(default, *, min=None, max=None, gt=None, choices=None, pow2=False, kind=None, doc="",
       unset=False):
    """A schema field: default plus the checks made at load time. `unset`: the default stands
    for "not given" and lies outside the bounds (a file that gives it is refused); `to_dict`
    leaves such a field out while it holds its default, so the dict loads back."""
    meta = dict(min=min, max=max, gt=gt, choices=choices, pow2=pow2, kind=kind, doc=doc,
                unset=unset)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: default.copy(), metadata=meta)
    return field(default=default, metadata=meta)


# A length or delay distribution: a bare number means fixed, a table names `dist`.
DIST_KEYS = {
    "fixed": {"value"},
    "uniform": {"min", "max"},
    "lognormal": {"mean", "cv", "min", "max"},
    "normal": {"mean", "std", "min", "max"},
    "exponential": {"mean", "min", "max"},
    # (row filters: `vllm bench serve`'s ShareGPT filter, sim.inputs.workload.ROW_FILTERS)
    "empirical": {"file", "column", "min_len", "max_prompt_len", "max_total_len"},
    "choice": {"values", "weights"},
    # `vllm bench serve --dataset-name random`: uniform integers in
    # [floor(value (1 - range_ratio)), ceil(value (1 + range_ratio))]
    "random": {"value", "range_ratio"},
}


@dataclass
class ModelConfig:
    preset: str = _f("llama-3.1-8b", choices=[*presets.MODELS, ""],
                     doc="a modeled model; \"\" to give every size below")
    num_params: float = _f(0.0, min=0, doc="parameter count (0 = from preset)")
    num_layers: int = _f(0, min=0)
    hidden_size: int = _f(0, min=0)
    num_heads: int = _f(0, min=0)
    num_kv_heads: int = _f(0, min=0)
    head_dim: int = _f(0, min=0)
    vocab_size: int = _f(0, min=0)
    tie_word_embeddings: bool = _f(False, doc="the LM head is the embedding table: one "
                                              "vocab x hidden matrix in num_params (Hugging "
                                              "Face's config field)")
    parallel_attention: bool = _f(False, doc="each block's attention and MLP read the same "
                                             "input and their outputs are summed (Falcon, "
                                             "GPT-J, GPT-NeoX): one tensor-parallel all-reduce "
                                             "per layer, not two")
    max_model_len: int = _f(0, min=0, doc="longest prompt+output a request may have")
    chat_template: bool = _f(True, doc="a chat request's prompt is rendered from the model's "
                                       "Jinja chat template (the API server's "
                                       "engine.frontend_chat_request_us); false: gpt-oss's "
                                       "Harmony format, rendered by a compiled encoder")
    dtype_bytes: int = _f(2, choices=[1, 2, 4], doc="bytes per weight (and per KV element "
                                                    "unless kv_dtype_bytes says otherwise)")
    kv_dtype_bytes: int = _f(0, choices=[0, 1, 2, 4], doc="bytes per KV-cache element "
                                                          "(0 = dtype_bytes)")
    act_dtype_bytes: int = _f(2, choices=[1, 2, 4], doc="bytes per activation element")
    tensor_parallel: int = _f(1, min=1, max=64, doc="GPUs the model is sharded over")
    data_parallel: int = _f(1, min=1, max=64,
                            doc="data-parallel ranks, each with its own scheduler, batch and KV "
                                "pool on tensor_parallel GPUs, stepping in lockstep (vLLM DP, "
                                "SGLang DP attention)")
    pipeline_parallel: int = _f(1, min=1, max=64,
                                doc="pipeline stages, each num_layers / pipeline_parallel layers "
                                    "and their KV on tensor_parallel GPUs")
    virtual_engines: int = _f(0, min=0, max=64,
                              doc="pipeline_parallel > 1: micro-batches in flight, each its own "
                                  "scheduler and share of the pool (vLLM virtual engines; 0 = "
                                  "pipeline_parallel)")
    pipeline_send_gbps: float = _f(0.0, min=0,
                                   doc="link between pipeline stages, GB/s (0 = "
                                       "hardware.interconnect_gbps)")
    num_gpus: int = _f(0, min=0, max=4096,
                       doc="GPUs of one deployment; when given, must equal data_parallel x "
                           "tensor_parallel x pipeline_parallel (0 = that product)")
    config: str = _f("", doc="a Hugging Face config.json (a file, a folder holding one, or a "
                             "bundled model: scenarios/models/) giving every size below; it "
                             "replaces preset, and a size set here overrides it")
    intermediate_size: int = _f(0, min=0, doc="dense MLP width (0 = derived from num_params)")
    num_experts: int = _f(0, min=0, doc="routed experts per MoE layer (0 = a dense model)")
    experts_per_token: int = _f(0, min=0, doc="experts each token is routed to (top-k)")
    moe_intermediate_size: int = _f(0, min=0, doc="one expert's MLP width")
    shared_intermediate_size: int = _f(0, min=0, doc="MLP width of the shared experts every "
                                                     "token passes through (0 = none)")
    dense_layers: int = _f(0, min=0, doc="layers with a dense MLP instead of experts")
    expert_parallel: int = _f(1, min=1, max=1024, doc="GPUs the experts are split over (each "
                                                      "holds num_experts / expert_parallel; "
                                                      "must divide tensor_parallel)")
    expert_skew: float = _f(0.0, min=0, max=1e3, doc="routing skew: the hottest expert gets "
                                                     "(1 + skew) times its share of tokens")
    kv_lora_rank: int = _f(0, min=0, doc="multi-head latent attention: the compressed K/V "
                                         "latent cached per token per layer (0 = none)")
    q_lora_rank: int = _f(0, min=0, doc="MLA: the query's compression rank (0 = none)")
    rope_head_dim: int = _f(0, min=0, doc="MLA: the rotary key part cached beside the latent")
    sliding_window: int = _f(0, min=0, doc="sliding-window attention span, tokens (read from "
                                           "a config): each query of sliding_window_layers "
                                           "attends its latest sliding_window positions "
                                           "(chunked attention: a window of the chunk size, a "
                                           "bound), and keeps only those in the KV pool (see "
                                           "kv.hybrid_kv_cache)")
    sliding_window_layers: int = _f(0, min=0, doc="layers attending within sliding_window")
    quantization: str = _f("", choices=["", *presets.QUANTIZATIONS],
                           doc="weight format of the transformer blocks (embeddings and LM head "
                               "stay at dtype_bytes); \"\" = dtype_bytes throughout")


@dataclass
class HardwareConfig:
    preset: str = _f("h100-sxm", choices=[*presets.HARDWARE, ""])
    memory_gb: float = _f(0.0, min=0, max=1e6)
    mem_bandwidth_gbps: float = _f(0.0, min=0, doc="HBM bandwidth, GB/s")
    peak_tflops: float = _f(0.0, min=0, doc="dense bf16 tensor TFLOP/s")
    fp8_tflops: float = _f(0.0, min=0, doc="dense FP8 tensor TFLOP/s, used by the GEMMs of "
                                           "1-byte weights (0 = none: they run at peak_tflops)")
    int8_tops: float = _f(0.0, min=0, doc="dense INT8 tensor TOP/s (w8a8 int8; 0 = none)")
    fp4_tflops: float = _f(0.0, min=0, doc="dense FP4 tensor TFLOP/s (NVFP4 / MXFP4; 0 = none)")
    tdp_w: float = _f(0.0, min=0, doc="board power at full load, W")
    idle_w: float = _f(0.0, min=0, doc="board power when idle, W")
    interconnect_gbps: float = _f(0.0, min=0, doc="GPU-GPU link per direction, GB/s")
    pcie_gbps: float = _f(0.0, min=0, doc="host link, GB/s (swap)")
    sm_count: int = _f(0, min=0, max=100000,
                       doc="streaming multiprocessors (compute units): how many GEMM tiles run "
                           "at once, and decode-attention blocks where the engine limits them "
                           "(engine.decode_blocks_per_sm; 0 = no wave factor, no such limit)")
    nvlink_sharp: int = _f(0, min=0, max=1,
                           doc="1: the GPUs' NVLink switches reduce in the network (NVLink "
                               "SHARP: HGX H100, H200, B200, GH200), which NCCL's all-reduce of "
                               "large messages takes at TP 3 and more where the engine lets it "
                               "(engine.allreduce_nvls; 0 on a preset keeps the preset's: "
                               "engine.allreduce_nvls = false turns it off)")
    sm_clock_mhz: float = _f(0.0, min=0, max=100000,
                             doc="SM boost clock, MHz (data sheet): the rate at which one "
                                 "decode-attention thread block streams a sequence's cached "
                                 "positions where the engine does not split them "
                                 "(engine.decode_split_kv = false; 0 = no such bound; "
                                 "0 on a preset keeps the preset's)")
    flops_efficiency: float = _f(0.6, gt=0, max=1, doc="engine.preset = \"roofline\" only: "
                                                       "achieved / peak FLOP/s")
    bandwidth_efficiency: float = _f(0.85, gt=0, max=1, doc="roofline only: achieved / peak "
                                                             "bandwidth")
    step_overhead_ms: float = _f(1.0, min=0, doc="roofline only: fixed cost per engine step")


_ENGINE = presets.ENGINES[presets.DEFAULT_ENGINE]


@dataclass
class EngineConfig:
    """The serving engine's fitted coefficients (sim.model.costmodel defines each term). A key left
    out takes the preset's value."""
    preset: str = _f(presets.DEFAULT_ENGINE, kind="engine",
                     doc="an engine profile (" + ", ".join(f"`{n}`" for n in presets.ENGINE_PRESETS)
                         + ") or a TOML file written by `servesim calibrate`")
    gemm_efficiency: float = _f(_ENGINE["gemm_efficiency"], gt=0, max=1,
                                doc="linear layers: achieved / peak FLOP/s at large token counts, "
                                    "in whole waves of tiles")
    fp8_gemm_efficiency: float = _f(_ENGINE["fp8_gemm_efficiency"], gt=0, max=1,
                                    doc="linear layers of 1-byte weights: achieved / "
                                        "hardware.fp8_tflops at large token counts")
    fp4_gemm_efficiency: float = _f(_ENGINE["fp4_gemm_efficiency"], gt=0, max=1,
                                    doc="linear layers of FP4 weights (nvfp4, mxfp4) on FP4 "
                                        "tensor cores: achieved / hardware.fp4_tflops at large "
                                        "token counts")
    gemm_wave_exposure: float = _f(_ENGINE["gemm_wave_exposure"], min=0, max=4,
                                   doc="linear layers: how much of the time lost to partial "
                                       "waves of GEMM tiles the kernels keep (0 = none, 1 = "
                                       "all; needs hardware.sm_count)")
    bandwidth_efficiency: float = _f(_ENGINE["bandwidth_efficiency"], gt=0, max=1,
                                     doc="streaming the weights: achieved / peak bandwidth")
    kv_bandwidth_efficiency: float = _f(_ENGINE["kv_bandwidth_efficiency"], gt=0, max=1,
                                        doc="attention reading the paged K/V cache: achieved / "
                                            "peak bandwidth")
    attention_efficiency: float = _f(_ENGINE["attention_efficiency"], gt=0, max=1,
                                     doc="attention kernels: achieved / peak FLOP/s")
    elementwise_efficiency: float = _f(_ENGINE["elementwise_efficiency"], gt=0, max=1,
                                       doc="norms, rotary, activation, residual adds: achieved "
                                           "/ peak bandwidth")
    layer_overhead_us: float = _f(_ENGINE["layer_overhead_us"], min=0,
                                  doc="fixed GPU time per layer per step (launch gaps, tails)")
    allreduce_latency_us: float = _f(_ENGINE["allreduce_latency_us"], min=0,
                                     doc="fixed time of one NCCL all-reduce (ring; and of one "
                                         "all-to-all)")
    allreduce_latency_pcie_us: float = _f(_ENGINE["allreduce_latency_pcie_us"], min=0,
                                          doc="fixed time of one NCCL all-reduce (and "
                                              "all-to-all) between GPUs linked by PCIe only "
                                              "(hardware.interconnect_gbps at most PCIe 5.0 "
                                              "x16's 64), where the one-shot kernel runs on at "
                                              "most custom_allreduce_pcie_gpus (0: such GPUs "
                                              "as NVLink ones)")
    custom_allreduce_pcie_gpus: int = _f(
        _ENGINE["custom_allreduce_pcie_gpus"], min=0, max=1024,
        doc="between GPUs linked by PCIe only, the most GPUs the engine's one-shot kernel still "
            "runs on, over their peer-to-peer link (vLLM, SGLang: 2; TensorRT-LLM: 0)")
    custom_allreduce_us: float = _f(_ENGINE["custom_allreduce_us"], min=0,
                                    doc="fixed time of one all-reduce of the engine's own "
                                        "one-shot kernel over NVLink, taken where it is faster "
                                        "than the ring (0: NCCL for every size)")
    allreduce_sync_us: float = _f(_ENGINE["allreduce_sync_us"], min=0,
                                  doc="time per all-reduce beyond its kernel's own: waiting "
                                      "for the slowest GPU and the gap around the call")
    allreduce_efficiency: float = _f(_ENGINE["allreduce_efficiency"], gt=0, max=1,
                                     doc="all-reduce: achieved / interconnect bandwidth")
    allreduce_efficiency_pcie: float = _f(_ENGINE["allreduce_efficiency_pcie"], min=0, max=1,
                                          doc="the same between GPUs linked by PCIe only, "
                                              "where allreduce_latency_pcie_us applies (NCCL's "
                                              "ring, and a one-shot kernel over their "
                                              "peer-to-peer link; 0: allreduce_efficiency)")
    allreduce_nvls: bool = _f(_ENGINE["allreduce_nvls"],
                              doc="NCCL may reduce in the NVLink switches (NVLS) where the "
                                  "hardware can (hardware.nvlink_sharp): TensorRT-LLM leaves "
                                  "NCCL's default; vLLM and SGLang turn it off")
    fp8_context_attention: bool = _f(_ENGINE["fp8_context_attention"],
                                     doc="prefill attention's matrix products run on the GPU's "
                                         "FP8 tensor cores (hardware.fp8_tflops) where the KV "
                                         "cache is FP8 (model.kv_dtype_bytes = 1): "
                                         "TensorRT-LLM's FP8 context FMHA, which its builds of "
                                         "FP8 checkpoints turn on")
    decode_split_kv: bool = _f(_ENGINE["decode_split_kv"],
                               doc="decode attention splits each sequence's cached positions "
                                   "over several thread blocks (FlashDecoding, vLLM's and "
                                   "SGLang's kernels, TensorRT-LLM's multi-block mode); false: "
                                   "one block per sequence and K/V head (or query head, where "
                                   "K/V is read per query head) streams them all, at "
                                   "decode_block_cycles a position (small batches at long "
                                   "contexts wait on it)")
    decode_block_cycles: float = _f(_ENGINE["decode_block_cycles"], gt=0, max=1e6,
                                    doc="decode_split_kv = false: SM clock cycles "
                                        "(hardware.sm_clock_mhz) a decode-attention block "
                                        "spends on one cached position of one K/V head of 128 "
                                        "(in proportion for other head sizes)")
    decode_blocks_per_sm: float = _f(_ENGINE["decode_blocks_per_sm"], min=0, max=1e4,
                                     doc="decode_split_kv = false: the blocks one SM "
                                         "(hardware.sm_count; none given: no limit) streams "
                                         "at once, each at "
                                         "decode_block_cycles a position; a step's blocks "
                                         "beyond the SMs' wait for one (many sequences: a "
                                         "block per query head where the K/V-sharing kernel "
                                         "is not built for the shape); 0 = no such wait")
    cuda_graph_padding: bool = _f(_ENGINE["cuda_graph_padding"],
                                  doc="decode-only steps run as CUDA graphs of fixed batch "
                                      "sizes, the batch padded up to the next (1, 2, 4, "
                                      "multiples of 8 to 128, powers of two, max_num_seqs): "
                                      "TensorRT-LLM's PyTorch backend under trtllm-bench")
    nvls_latency_us: float = _f(_ENGINE["nvls_latency_us"], min=0,
                                doc="NVLS all-reduce: fixed time of one call (its line's "
                                    "intercept over large messages)")
    nvls_efficiency: float = _f(_ENGINE["nvls_efficiency"], gt=0, max=1,
                                doc="NVLS all-reduce: each GPU's bytes, sent once, over "
                                    "hardware.interconnect_gbps times this")
    moe_gemm_efficiency: float = _f(_ENGINE["moe_gemm_efficiency"], gt=0, max=1,
                                    doc="mixtures of experts: the grouped GEMMs of the routed "
                                        "experts (FLOP/s and weight streaming), achieved / "
                                        "those of the linear layers (gemm_efficiency and "
                                        "bandwidth_efficiency)")
    moe_comm_efficiency: float = _f(_ENGINE["moe_comm_efficiency"], gt=0, max=1,
                                    doc="mixtures of experts over data-parallel ranks: the "
                                        "gather of the tokens and the reduce-scatter of the "
                                        "outputs per MoE layer, achieved / interconnect "
                                        "bandwidth")
    cpu_base_us: float = _f(_ENGINE["cpu_base_us"], min=0,
                            doc="CPU time per step (scheduling, input preparation, sampling)")
    cpu_per_seq_us: float = _f(_ENGINE["cpu_per_seq_us"], min=0,
                               doc="CPU time per step per sequence in the batch")
    cpu_overlap: bool = _f(_ENGINE["cpu_overlap"],
                           doc="the CPU time overlaps the GPU time (multi-step or async "
                               "scheduling): a step takes the longer of the two, not the sum")
    num_scheduler_steps: int = _f(_ENGINE["num_scheduler_steps"], min=1, max=64,
                                  doc="decode steps per scheduling decision (vLLM multi-step "
                                      "scheduling): arrivals wait for the end of the window")
    chunked_prefill: bool = _f(_ENGINE["chunked_prefill"],
                               doc="the `chunked` policies may split a prompt over steps within "
                                   "the token budget (false: a prompt is computed whole in one "
                                   "step, or waits; one longer than the budget goes alone)")
    guaranteed_no_evict: bool = _f(_ENGINE["guaranteed_no_evict"],
                                   doc="admit a request only when the blocks it will hold at "
                                       "its last token fit beside those every running request "
                                       "will hold at its own (TensorRT-LLM's default capacity "
                                       "scheduler, GUARANTEED_NO_EVICT): none is ever "
                                       "preempted; false: admit on the blocks needed now and "
                                       "preempt when they run short (vLLM, SGLang)")
    gqa_shared_kv: bool = _f(_ENGINE["gqa_shared_kv"],
                             doc="decode attention reads K/V once per KV head (false: once per "
                                 "query head)")
    gqa_reread: float = _f(_ENGINE["gqa_reread"], min=0, max=1,
                           doc="where K/V is read per query head (gqa_shared_kv = false, or a "
                               "shape the shared kernels are not built for): the fraction of the "
                               "repeated K/V reads of a GQA group that reach DRAM (the rest hit "
                               "in L2)")
    gqa_shared_kv_group: int = _f(
        _ENGINE["gqa_shared_kv_group"], min=0, max=1024,
        doc="with gqa_shared_kv: the one GQA group size (query heads per K/V head) the shared-K/V "
            "decode kernels are built for (0: any); other groups read K/V per query head")
    gqa_shared_kv_min_head_dim: int = _f(_ENGINE["gqa_shared_kv_min_head_dim"], min=0,
                                         max=1024,
                                         doc="with gqa_shared_kv: the smallest head size the "
                                             "shared-K/V decode kernels are built for (0: any); "
                                             "a model with smaller heads reads K/V per query "
                                             "head, as with gqa_shared_kv = false")
    # The API server in front of the engine (sim.engine.frontend): TTFT, ITL, TPOT and E2E are
    # the client's.
    frontend_request_us: float = _f(_ENGINE["frontend_request_us"], min=0,
                                    doc="API server time per request before the engine sees "
                                        "it (HTTP, checks, hand-off to the engine)")
    frontend_prompt_token_us: float = _f(_ENGINE["frontend_prompt_token_us"], min=0,
                                         doc="tokenisation per prompt token, in the API server")
    frontend_chat_request_us: float = _f(_ENGINE["frontend_chat_request_us"], min=0,
                                         doc="the API server's own time on each "
                                             "chat-completions request (workload.endpoint = "
                                             "\"chat\": the chat template, the chat request's "
                                             "handling), one request after another as its "
                                             "tokenising")
    frontend_one_loop: bool = _f(_ENGINE["frontend_one_loop"],
                                 doc="the API server takes in requests and streams tokens in "
                                     "one event loop (vLLM's): tokens sampled while it takes "
                                     "in requests wait until it is done with them")
    frontend_output_token_us: float = _f(_ENGINE["frontend_output_token_us"], min=0,
                                         doc="the API server's time on each streamed token "
                                             "(detokenising, its chunk, the write), one step's "
                                             "tokens after another's: at hundreds of streams it "
                                             "bounds the tokens/s clients receive")


@dataclass
class KVConfig:
    block_size: int = _f(16, min=1, max=1024, pow2=True)
    num_blocks: int = _f(0, min=0, doc="0 = derive from GPU memory; a number is taken as "
                                       "given, even beyond the memory (as vLLM's "
                                       "num_gpu_blocks_override)")
    gpu_memory_utilization: float = _f(0.9, gt=0, max=1)
    reserve_gb: float = _f(1.0, min=0, doc="activations and workspace kept out of the KV pool")
    swap_space_gb: float = _f(4.0, min=0, doc="host memory per GPU for swapped-out blocks")
    enable_prefix_caching: bool = _f(False, doc="share cached full blocks between requests")
    # vLLM V1's block manager (sim/README.md: "Fidelity to vLLM's scheduler"); false: the older way.
    register_at_allocation: bool = _f(True, doc="a full block enters the prefix cache when the "
                                      "step filling it is scheduled, so a request admitted "
                                      "later in that step shares it; false: after the step")
    free_uncached_first: bool = _f(True, doc="a freed block holding no cached prefix is reused "
                                   "first, cached ones are evicted LRU; false: all LRU")
    duplicate_cached_blocks: bool = _f(True, doc="a block computed again for a prefix already "
                                       "cached holds it too; false: only the first")
    hybrid_kv_cache: bool = _f(True, doc="sliding-window (and chunked-attention) layers keep "
                               "only the blocks their window reaches, in groups of layers over "
                               "the one pool (vLLM V1's hybrid KV cache manager); false, or with "
                               "preemption by swap, parallel samples, the contiguous policy or "
                               "disaggregated hand-offs: every layer keeps the whole context")


@dataclass
class SchedulerConfig:
    policy: str = _f("chunked", kind="policy",
                     doc="or `disaggregated`: prefill and decode instances "
                         "(`cluster.prefill_instances`, `decode_instances`; 1 and 1: 2 GPUs)")
    max_num_seqs: int = _f(0, min=0, doc="0 = as the engine by default on the GPU (vllm-v1: "
                                         "1024 on a GPU of 70 GB or more other than an A100, "
                                         "else 256; sglang and tensorrt-llm 2048; others 256)")
    max_num_batched_tokens: int = _f(0, min=0, doc="0 = as the engine by default on the GPU "
                                                   "(vllm-v1: 8192 on a GPU of 70 GB or more "
                                                   "other than an A100, else 2048; sglang 2048 "
                                                   "to 16384 by the GPU memory; tensorrt-llm "
                                                   "8192; others 2048)")
    preemption: str = _f("recompute", choices=["recompute", "swap"],
                         doc="recompute: free and re-prefill later; swap: copy to host memory")
    watermark: float = _f(0.0, min=0, max=0.5,
                          doc="share of blocks kept free when admitting while others run "
                              "(vLLM V1: 0; V0 used 0.01)")
    sjf_key: str = _f("prompt", choices=["prompt", "total"],
                      doc="sjf: job size is the prompt, or prompt plus output")
    sjf_aging_s: float = _f(10.0, gt=0, doc="sjf: a request waiting this long goes first")
    lpm_max_queue: int = _f(128, min=1, doc="lpm: past this queue length, fall back to FCFS")
    reserve_output_tokens: int = _f(2048, min=1,
                                    doc="contiguous: output slots reserved per request "
                                        "(its maximum output if larger)")
    kv_link_gbps: float = _f(50.0, gt=0, doc="disaggregated: prefill-to-decode K/V link, GB/s "
                                             "per GPU")
    # vLLM V1's scheduler (sim/README.md: "Fidelity to vLLM's scheduler"); false: the older way.
    reserve_full_sequence: bool = _f(True, doc="admit a waiting request only if blocks for all "
                                     "its tokens fit, not just its first chunk")
    async_scheduling: bool = _f(True, doc="schedule each step before the output of the one "
                                "before is processed: a finished request frees its blocks and "
                                "seat one step later")
    preempt_for_waiting: bool = _f(False, doc="priority: preempt lower-priority running "
                                   "requests to admit a higher-priority waiting one (vLLM V0)")
    continue_after_self_preemption: bool = _f(True, doc="priority: a running request that "
                                              "preempts itself lets those after it try; "
                                              "false: the pass over the batch ends")


@dataclass
class ClientConfig:
    """One client of a mix (`[[workload.clients]]`): a key left out takes the workload's (or
    `[slo]`'s) value."""
    name: str = _f("", doc="its name (required, unique): the summary's `clients` and the "
                           "dashboard's request tags")
    share: float = _f(1.0, gt=0, max=1,
                      doc="its share of the requests (the shares sum to 1); open loop: its "
                          "requests arrive at share x workload.rate")
    prompt_tokens: Any = _f(None, kind="dist", max=MAX_TOKENS)
    output_tokens: Any = _f(None, kind="dist", max=MAX_TOKENS)
    priority: Any = _f(None, kind="dist", max=PRIORITY_RANGE[1])
    ttft_ms: float = _f(None, min=0, doc="its SLO class: a bound given here replaces [slo]'s "
                                         "for its requests (0 = no bound)")
    tpot_ms: float = _f(None, min=0)
    e2e_ms: float = _f(None, min=0)


@dataclass
class WorkloadConfig:
    arrival: str = _f("poisson", choices=["poisson", "gamma", "constant", "trace", "batch"],
                      doc="batch: all num_requests at t = 0 (a fixed batch, offline runs)")
    rate: float = _f(1.0, gt=0, doc="requests per second")
    # (below 1e-3 the gamma's shape 1/cv^2 overflows toward infinity: use arrival = "constant")
    cv: float = _f(1.0, min=1e-3, max=100, doc="gamma: coefficient of variation of inter-arrival times")
    trace: str = _f("", doc="trace file (Azure CSV, Mooncake JSONL, length-pairs CSV)")
    time_scale: float = _f(1.0, gt=0, doc="trace timestamps are multiplied by this")
    repeat: int = _f(1, min=1, max=100_000,
                     doc="trace: replay it this many times, each copy one trace period "
                         "(its span plus a mean gap) after the previous")
    prompt_tokens: Any = _f(512, kind="dist", max=MAX_TOKENS)
    output_tokens: Any = _f(128, kind="dist", max=MAX_TOKENS)
    num_requests: int = _f(0, min=0, doc="stop after this many requests (0 = no bound)")
    duration_s: float = _f(0.0, min=0, max=MAX_TIME_S,
                           doc="stop arrivals after this time (0 = no bound)")
    cancel_fraction: float = _f(0.0, min=0, max=1)
    cancel_after_s: Any = _f(5.0, kind="dist", max=MAX_TIME_S,
                             doc="client cancels this long after arrival")
    priority: Any = _f(0, kind="dist", max=PRIORITY_RANGE[1])
    shared_prefix_tokens: int = _f(0, min=0, max=MAX_TOKENS,
                                   doc="synthetic: length of a shared system prompt")
    shared_prefix_groups: int = _f(1, min=1, doc="synthetic: how many distinct system prompts")
    shared_prefix_balanced: bool = _f(False, doc="synthetic: each system prompt goes to an equal "
                                      "share of the requests, in shuffled order (vllm bench "
                                      "serve's prefix_repetition dataset); false: each "
                                      "request draws one")
    num_samples: int = _f(1, min=1, max=64, doc="parallel samples per request (n)")
    endpoint: str = _f("completions", choices=["completions", "chat"],
                       doc="the API its clients call: completions (vllm bench serve's "
                           "default) or chat completions, which costs the API server "
                           "engine.frontend_chat_request_us more per request")
    clients: Any = _f([], kind="clients",
                      doc="a mix of clients, each an `[[workload.clients]]` table (below)")
    # Closed loop (`vllm bench serve --max-concurrency`): left out (0), arrivals are open loop.
    concurrency: int = _f(0, gt=0, max=1_000_000, unset=True,
                          doc="closed loop: this many users, each sending its next request "
                              "when its last one ends (plus think_time_s and "
                              "turnaround_s); needs "
                              "num_requests; arrival and rate are then unused (left out: "
                              "open loop)")
    think_time_s: float = _f(0.0, min=0, max=MAX_TIME_S,
                             doc="closed loop: a user's pause between the end of one request "
                                 "and the sending of its next")
    ramp_up_s: float = _f(0.0, min=0, max=MAX_TIME_S,
                          doc="closed loop: user u sends its first request at u x ramp_up_s "
                              "/ concurrency, and start_gap_s after the user before at least")
    start_gap_s: float = _f(1e-4, min=0, max=MAX_TIME_S,
                            doc="closed loop: the least time between the first requests of "
                                "two users (a benchmark client sends one request at a time: the "
                                "concurrent requests of an aiohttp client reach a server "
                                "0.05-0.13 ms apart; 0: all at once)")
    turnaround_s: float = _f(1e-4, min=0, max=MAX_TIME_S,
                             doc="closed loop: the time from the end of a response reaching its "
                                 "user to the next request reaching the server, think time "
                                 "aside (the client's own handling and one request's transit, "
                                 "as start_gap_s; counted before the request is sent): a request "
                                 "sent on the last token of another never joins the step that "
                                 "starts as that one ends")
    turns: int = _f(1, min=1, max=100_000,
                    doc="closed loop: turns per conversation; turn k's prompt is the turns "
                        "before it (prompts and outputs) followed by prompt_tokens new tokens")


@dataclass
class AdmissionConfig:
    """Admission control in front of the queue: an arriving request refused here ends
    `rejected` (`servesim serve` answers 429)."""
    max_waiting: int = _f(0, min=0, doc="refuse an arrival while this many requests wait "
                                        "(0 = no bound)")
    rate: float = _f(0.0, min=0, doc="token bucket: requests admitted per second on "
                                     "average (0 = no limit)")
    burst: int = _f(1, min=1, doc="token bucket: its size, the requests admitted at once "
                                  "after a quiet spell")


@dataclass
class SLOConfig:
    ttft_ms: float = _f(0.0, min=0, doc="0 = no bound")
    tpot_ms: float = _f(0.0, min=0)
    e2e_ms: float = _f(0.0, min=0)


@dataclass
class ClusterConfig:
    replicas: int = _f(1, min=1, max=64,
                       doc="engine instances, each with its own GPU(s), block pool and policy")
    router: str = _f("round-robin",
                     choices=["round-robin", "least-outstanding", "least-kv", "prefix-affinity",
                              "queue-length"],
                     doc="which replica an arriving request goes to")
    dp_router: str = _f("queue-length",
                        choices=["round-robin", "least-outstanding", "least-kv",
                                 "prefix-affinity", "queue-length"],
                        doc="model.data_parallel > 1: which rank an arriving request goes to "
                            "(queue-length: the DP load balancing of vLLM, 4 x waiting + running)")
    prefill_instances: int = _f(1, min=1, max=64,
                                doc="scheduler.policy = \"disaggregated\": prefill instances "
                                    "(arrivals spread over them by `router`)")
    decode_instances: int = _f(1, min=1, max=64,
                               doc="scheduler.policy = \"disaggregated\": decode instances (an "
                                   "arrival goes to the one with the fewest outstanding "
                                   "requests)")
    affinity_max_imbalance: int = _f(16, min=0,
                                     doc="prefix-affinity: route by load instead when the "
                                         "preferred replica has this many more outstanding "
                                         "requests than the least loaded")


@dataclass
class ComputeConfig:
    backend: str = _f("none", choices=["none", "auto", "numpy", "cupy"],
                      doc="real attention each step: none (pure simulation), numpy, cupy, auto")
    clock: str = _f("modeled", choices=["modeled", "measured"],
                    doc="modeled: the service-time model moves the clock; measured: wall time")
    num_layers: int = _f(0, min=0, doc="tiny model layers (0 = the backend's default)")
    num_heads: int = _f(0, min=0, doc="0 = the backend's default")
    num_kv_heads: int = _f(0, min=0, doc="0 = the backend's default")
    head_dim: int = _f(0, min=0, pow2=True, doc="0 = the backend's default")
    vocab_size: int = _f(256, min=2, doc="256 = byte-level: typed prompts are their bytes")
    mlp: bool = _f(True)
    num_experts: int = _f(0, min=0, max=64,
                          doc="tiny model: > 0 makes the MLP of each layer a mixture of this many "
                              "experts with top-k routing (0 = dense)")
    experts_per_token: int = _f(2, min=1, max=64,
                                doc="tiny model with experts: the top k each token is routed to")
    dtype: str = _f("auto", choices=["auto", "float32", "float16", "bfloat16"],
                    doc="KV storage (auto = the backend's default)")
    verify_every: int = _f(0, min=0, doc="recompute one request densely every N steps")


@dataclass
class PlanConfig:
    """What `servesim plan` reads beyond the deployment: prices of this scenario's own."""
    gpu_price_usd_per_hour: dict = _f({}, kind="prices", unset=True,
                                      doc="`servesim plan`: US dollars per GPU-hour by hardware "
                                          "preset (`{h100-sxm = 3.5}`), over the bundled price "
                                          "table; `--price` overrides these")


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "hardware": HardwareConfig,
    "engine": EngineConfig,
    "kv": KVConfig,
    "scheduler": SchedulerConfig,
    "workload": WorkloadConfig,
    "admission": AdmissionConfig,
    "slo": SLOConfig,
    "compute": ComputeConfig,
    "cluster": ClusterConfig,
    "plan": PlanConfig,
}
_CLIENT_FIELDS = {f.name: f for f in dataclasses.fields(ClientConfig)}
# Each section's fields by name.
_FIELDS = {sec: {f.name: f for f in dataclasses.fields(cls)} for sec, cls in SECTIONS.items()}
TOP_LEVEL = {"name": str, "description": str, "seed": int}


@dataclass
class Scenario:
    name: str = "scenario"
    description: str = ""
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    slo: SLOConfig = field(default_factory=SLOConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    # Where relative paths (traces) resolve; not a field of the file.
    base_dir: Path = field(default=BUNDLED_DIR, repr=False, compare=False)
    source: str = field(default="<scenario>", repr=False, compare=False)

    def to_dict(self) -> dict:
        """The fully resolved scenario as plain data (what a session log stores)."""
        out: dict[str, Any] = {"name": self.name, "description": self.description,
                               "seed": self.seed}
        for sec in SECTIONS:
            cfg = getattr(self, sec)
            given = {k: v for k, v in dataclasses.asdict(cfg).items()
                     if not (_FIELDS[sec][k].metadata["unset"] and v == _default(_FIELDS[sec][k]))}
            if given or sec != "plan":  # (a plan's prices, only where given)
                out[sec] = given
        return out

    def resolve_path(self, p: str) -> Path:
        path = Path(p).expanduser()
        if not path.is_absolute():
            path = self.base_dir / path
        return path


# --- loading -------------------------------------------------------------------------------------
def bundled_scenarios() -> list[tuple[str, str]]:
    """(name, description) of every scenario bundled in `scenarios/`."""
    out = []
    for p in sorted(BUNDLED_DIR.glob("*.toml")):
        try:
            desc = toml_loads(p.read_text()).get("description", "")
        except (OSError, tomllib.TOMLDecodeError):
            desc = "(unreadable)"
        out.append((p.stem, str(desc).strip().splitlines()[0] if desc else ""))
    return out


def find_scenario(spec: str | None) -> Path:
    """A scenario path from a file path or a bundled name. Raises ScenarioError if neither."""
    if spec is None:
        spec = DEFAULT_SCENARIO
    if not spec.strip():
        raise ScenarioError(f"scenario {spec!r}: an empty name (give a file or a bundled name, or none "
                            f"for {DEFAULT_SCENARIO})")
    p = Path(spec).expanduser()
    if p.is_file():
        return p
    bundled = BUNDLED_DIR / f"{spec}.toml"
    if bundled.is_file():
        return bundled
    if p.exists():  # a directory, a FIFO, a device
        kind = "a directory" if p.is_dir() else "not a regular file"
        raise ScenarioError(f"{spec}: {kind}, not a scenario file")
    names = [n for n, _ in bundled_scenarios()]
    hint = difflib.get_close_matches(spec, names, n=1)
    more = f" (did you mean {hint[0]!r}?)" if hint else f" (bundled: {', '.join(names)})"
    raise ScenarioError(f"{spec}: no such scenario file or bundled scenario{more}")


def load_scenario(spec: str | None = None, overrides: list[str] | None = None) -> Scenario:
    """Read, override and check a scenario. Raises ScenarioError on any problem."""
    path = find_scenario(spec)
    try:
        if path.stat().st_size > MAX_SCENARIO_BYTES:  # (not read into memory first)
            raise ScenarioError(f"{path}: larger than {MAX_SCENARIO_BYTES >> 20} MiB, not a "
                                "scenario file")
        raw = toml_loads(path.read_text(encoding="utf-8-sig"))  # (a BOM some editors write is fine)
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{path}: not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ScenarioError(f"{path}: cannot read: {reason(e)}") from None
    for o in overrides or []:
        apply_override(raw, o, str(path))
    return scenario_from_dict(raw, source=str(path), base_dir=path.resolve().parent)


def parse_override(text: str, source: str = "--set") -> tuple[list[str], Any]:
    """`section.key=value` -> (path, value); the value is read as TOML, else as a string."""
    if "=" not in text:
        raise ScenarioError(f"{source}: {shown(text, 80)}: expected SECTION.KEY=VALUE")
    key, _, value = text.partition("=")
    parts = [k.strip() for k in key.strip().split(".")]
    if not all(parts):  # "", ".x", "kv..block_size"
        raise ScenarioError(f"{source}: {shown(text, 80)}: empty key" if not any(parts) else
                            f"{source}: {shown(text, 80)}: an empty part in the key "
                            f"{shown(key.strip(), 80)}")
    try:
        parsed = toml_loads(f"v = {value.strip()}")["v"]
    except tomllib.TOMLDecodeError as e:
        if str(e).startswith(LONG_INT_MESSAGE):  # (a number, not text to take as a string)
            raise ScenarioError(f"{source}: {key.strip()} = {shown(value.strip(), 40)}: "
                                f"{LONG_INT_MESSAGE}") from None
        parsed = value.strip()
    return parts, parsed


def override_path(parts: list[str], value: Any, base: Path) -> Any:
    """An override's value with a relative path made absolute from `base`, where the key takes
    a path: a `.toml` `engine.preset`, `workload.trace` and an empirical distribution's
    `file` set alone (one in a table given whole names a file from the scenario's folder, as
    the scenario's own do); any other value as it is."""
    if not isinstance(value, str) or not value:
        return value
    if not (parts == ["engine", "preset"] and value.endswith(".toml")
            or parts == ["workload", "trace"]
            or (parts[0] == "workload" and parts[-1] == "file")):
        return value
    path = Path(value).expanduser()
    return value if path.is_absolute() else str(base / path)


def _command_line_path(parts: list[str], value: Any) -> Any:
    """A relative path typed with `--set` names a file from the current directory (a scenario
    file's own paths name files from its folder)."""
    return override_path(parts, value, Path.cwd())


def apply_override(raw: dict, text: str, source: str = "--set") -> None:
    """Apply one `--set` override to the raw scenario dict in place."""
    parts, value = parse_override(text, "--set")
    value = _command_line_path(parts, value)
    d = raw
    for p in parts[:-1]:
        nxt = d.get(p)
        if not isinstance(nxt, dict):
            # A bare number (a fixed length) becomes a table when a sub-key is set.
            # Setting `dist` itself starts a fresh table.
            if nxt is None or (isinstance(nxt, (int, float)) and parts[-1] == "dist"):
                nxt = {}
            elif isinstance(nxt, (int, float)):
                nxt = {"dist": "fixed", "value": nxt}
            if not isinstance(nxt, dict):
                raise ScenarioError(f"--set {text}: {'.'.join(parts[:-1])} is not a table")
            d[p] = nxt
        d = nxt
    if parts[-1] == "dist" and isinstance(value, str) and value in DIST_KEYS:
        # Another distribution: drop what the old one had that the new one does not take
        # (`file` of an empirical table when switching to uniform), keep the rest (min, max).
        for k in [k for k in d if k not in DIST_KEYS[value]]:
            del d[k]
    d[parts[-1]] = value


def _key(key) -> str:
    """A key as a message shows it: as written when it is a plain name, else quoted (so that a
    key holding a newline or nothing at all still makes one readable line)."""
    return key if isinstance(key, str) and key.replace("-", "_").isidentifier() else repr(key)


def _suggest(key: str, names) -> str:
    hint = difflib.get_close_matches(key, list(names), n=1, cutoff=0.5)
    return f" (did you mean {hint[0]!r}?)" if hint else ""


def _type_name(t) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        t, str(t))


def _check_type(where: str, value, t) -> Any:
    if t is bool:
        ok = isinstance(value, bool)
    elif t is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if ok and not -INT64_MAX - 1 <= value <= INT64_MAX:  # past int64: no array holds it
            raise ScenarioError(f"{where} = {shown(value, 80)}: must fit in 64 bits "
                                f"(at most {INT64_MAX})")
    elif t is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            given = value
            try:
                value = float(value)
            except OverflowError:  # an integer past the largest float (a long hex literal)
                value = math.inf
            if not math.isfinite(value):
                raise ScenarioError(f"{where} = {shown(given, 80)}: must be finite")
    else:
        ok = isinstance(value, t)
    if not ok:
        raise ScenarioError(f"{where} = {shown(value, 80)}: expected {_type_name(t)}")
    return value


# Lognormal spread: past this, draws are 0 or beyond any bound (sigma = sqrt(log(1 + cv^2))).
MAX_CV = 100.0


def _check_dist(where: str, value, top: float) -> Any:
    """A distribution field: a number (fixed) or a table with a known `dist`. Every number in
    it must be finite, non-negative and at most `top` (the field's bound), every weight finite
    and non-negative with a positive sum."""
    def number(w: str, v, hi: float = top) -> float:
        v = _check_type(w, v, float)
        if v < 0:
            raise ScenarioError(f"{w} = {v!r}: must not be negative")
        if v > hi:
            raise ScenarioError(f"{w} = {v!r}: must be at most {hi:g}")
        return v

    if isinstance(value, bool):
        raise ScenarioError(f"{where} = {shown(value, 80)}: expected a number or a "
                            "{dist = ...} table")
    if isinstance(value, (int, float)):
        number(where, value)
        return value
    if not isinstance(value, dict):
        raise ScenarioError(f"{where} = {shown(value, 80)}: expected a number or a "
                            "{dist = ...} table")
    dist = value.get("dist")
    if not isinstance(dist, str) or dist not in DIST_KEYS:
        raise ScenarioError(
            f"{where}.dist = {shown(dist, 80)}: expected one of {', '.join(DIST_KEYS)}"
            f"{_suggest(dist, DIST_KEYS) if isinstance(dist, str) else ''}")
    allowed = DIST_KEYS[dist] | {"dist"}
    for k, v in value.items():
        if k not in allowed:
            raise ScenarioError(
                f"{where}.{_key(k)}: unknown key for dist = {dist!r} (allowed: "
                f"{', '.join(sorted(allowed - {'dist'}))}){_suggest(k, allowed)}"
            )
        if k in ("file", "column", "dist"):
            _check_type(f"{where}.{k}", v, str)
        elif k in ("values", "weights"):
            if not isinstance(v, list) or not v or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in v
            ):
                raise ScenarioError(f"{where}.{k} = {shown(v, 80)}: expected a non-empty list of "
                                    "numbers")
            for i, x in enumerate(v):
                number(f"{where}.{k}[{i}]", x, top if k == "values" else INT64_MAX)
            if k == "weights" and not sum(v) > 0:
                raise ScenarioError(f"{where}.weights = {v!r}: must not all be 0")
        else:
            number(f"{where}.{k}", v, MAX_CV if k == "cv" else top)
    need = {
        "fixed": {"value"}, "uniform": {"min", "max"}, "lognormal": {"mean"},
        "normal": {"mean", "std"}, "exponential": {"mean"}, "empirical": {"file"},
        "choice": {"values"}, "random": {"value"},
    }[dist]
    missing = need - set(value)
    if missing:
        raise ScenarioError(f"{where}: dist = {dist!r} needs {', '.join(sorted(missing))}")
    if "min" in value and "max" in value and value["min"] > value["max"]:
        raise ScenarioError(f"{where}: min = {value['min']} is above max = {value['max']}")
    if dist == "random" and not value.get("range_ratio", 0.0) < 1:
        raise ScenarioError(f"{where}.range_ratio = {value['range_ratio']!r}: must be less "
                            "than 1 (as vllm bench serve's --random-range-ratio)")
    if dist == "choice" and "weights" in value and len(value["weights"]) != len(value["values"]):
        raise ScenarioError(f"{where}: weights and values differ in length")
    return dict(value)


def _check_field(where: str, f: dataclasses.Field, value) -> Any:
    m = f.metadata
    if m.get("kind") == "clients":
        return _check_clients(where, value)
    if m.get("kind") == "prices":
        return _check_prices(where, value)
    if m.get("kind") == "dist":
        return _check_dist(where, value, m.get("max") or INT64_MAX)
    t = {"int": int, "float": float, "str": str, "bool": bool}.get(f.type, None)
    if t is None:
        t = type(f.default)
    shown = value  # messages show the value as the user wrote it
    value = _check_type(where, value, t)
    if m.get("kind") == "policy":
        known = [*POLICIES, *DEPLOYMENT_POLICIES]
        if value not in known:
            raise ScenarioError(
                f"{where} = {shown!r}: unknown policy (known: {', '.join(known)})"
                f"{_suggest(value, known)}"
            )
    if m.get("choices") is not None and value not in m["choices"]:
        options = ", ".join(repr(c) for c in m["choices"])
        raise ScenarioError(f"{where} = {shown!r}: expected one of {options}"
                            f"{_suggest(str(value), [str(c) for c in m['choices']])}")
    if m.get("min") is not None and value < m["min"]:
        raise ScenarioError(f"{where} = {shown!r}: must be at least {m['min']}")
    if m.get("gt") is not None and value <= m["gt"]:
        raise ScenarioError(f"{where} = {shown!r}: must be greater than {m['gt']}")
    if m.get("max") is not None and value > m["max"]:
        raise ScenarioError(f"{where} = {shown!r}: must be at most {m['max']}")
    if m.get("pow2") and value and (value < 0 or value & (value - 1)):
        raise ScenarioError(f"{where} = {shown!r}: must be a power of two")
    return value


def _default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _check_prices(where: str, value) -> dict:
    """`plan.gpu_price_usd_per_hour`: a table of hardware preset -> positive US dollars."""
    if not isinstance(value, dict):
        raise ScenarioError(f"{where} = {shown(value, 80)}: expected a table of GPU = US "
                            "dollars per GPU-hour ({h100-sxm = 3.5})")
    for gpu, usd in value.items():
        if gpu not in presets.HARDWARE:
            raise ScenarioError(f"{where}.{_key(gpu)}: unknown GPU (known: "
                                f"{', '.join(presets.HARDWARE)}){_suggest(gpu, presets.HARDWARE)}")
        if not usd_per_gpu_hour_ok(usd):
            raise ScenarioError(f"{where}.{gpu} = {shown(usd, 80)}: expected US dollars per "
                                f"GPU-hour, {USD_PER_GPU_HOUR_TEXT}")
    return {gpu: float(usd) for gpu, usd in value.items()}


def _check_clients(where: str, value) -> list[dict]:
    """A client mix: an array of tables, each checked against `ClientConfig` and kept as given
    (a key left out stays out: it takes the workload's value), named uniquely, shares summing
    to 1."""
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ScenarioError(f"{where} = {shown(value, 80)}: expected an array of tables "
                            "([[workload.clients]])")
    fields, out, names = _CLIENT_FIELDS, [], set()
    for k, table in enumerate(value):
        at = f"{where}[{k}]"
        for key in table:
            if key not in fields:
                raise ScenarioError(f"{at}.{_key(key)}: unknown key{_suggest(str(key), fields)}")
        checked = {key: _check_field(f"{at}.{key}", fields[key], v) for key, v in table.items()}
        name = checked.get("name", "")
        if not name.strip() or CONTROL.search(name):
            raise ScenarioError(f"{at}.name = {shown(name, 80)}: every client needs a name of "
                                "printable text")
        if name in names:
            raise ScenarioError(f"{at}.name = {name!r}: two clients of that name")
        names.add(name)
        out.append(checked)
    total = math.fsum(t.get("share", 1.0) for t in out)
    if out and abs(total - 1.0) > 1e-9:
        raise ScenarioError(f"{where}: the shares sum to {total:g}; they must sum to 1")
    return out


def _section(source: str, name: str, cls: type, raw: Any):
    if not isinstance(raw, dict):
        raise ScenarioError(f"{source}: [{name}] must be a table, got {shown(raw, 80)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            raise ScenarioError(
                f"{source}: {name}.{_key(key)}: unknown key{_suggest(key, fields)}")
        kwargs[key] = _check_field(f"{source}: {name}.{key}", fields[key], value)
    return cls(**kwargs)


def scenario_from_dict(raw: dict, *, source: str = "<scenario>",
                       base_dir: Path | None = None, check_workload: bool = True) -> Scenario:
    """Build and check a Scenario from plain data. Raises ScenarioError.

    `check_workload=False` skips the checks that read the workload's files (a replayed log
    carries its own workload)."""
    if not isinstance(raw, dict):
        raise ScenarioError(f"{source}: a scenario must be a table")
    kwargs: dict[str, Any] = {}
    base = base_dir or BUNDLED_DIR
    for key, value in raw.items():
        if key == "engine" and isinstance(value, dict):
            value = resolve_engine(value, source, base)
        if key == "workload" and isinstance(value, dict):
            value = resolve_workload(value)
        if key in TOP_LEVEL:
            kwargs[key] = _check_type(f"{source}: {key}", value, TOP_LEVEL[key])
            if isinstance(value, str) and CONTROL.search(value):
                raise ScenarioError(f"{source}: {key} = {shown(value, 80)}: holds a control "
                                    "character (text for a terminal)")
            if key == "seed" and value < 0:  # seeds NumPy's generators, which take none below 0
                raise ScenarioError(f"{source}: seed = {value!r}: must be at least 0")
        elif key in SECTIONS:
            kwargs[key] = _section(source, key, SECTIONS[key], value)
        else:
            raise ScenarioError(
                f"{source}: {_key(key)}: unknown key{_suggest(key, [*TOP_LEVEL, *SECTIONS])}")
    if "engine" not in kwargs:
        kwargs["engine"] = _section(source, "engine", EngineConfig,
                                    resolve_engine({}, source, base))
    sc = Scenario(**kwargs, base_dir=base, source=source)
    _fill_presets(sc)
    _check_whole(sc, check_workload)
    return sc


def engine_preset(name: str, where: str, base_dir: Path) -> dict:
    """The coefficients an `engine.preset` names: a built-in profile, `roofline` (whose
    coefficients go unused, and with no API server in front), or a TOML file written by
    `servesim calibrate` (its `[engine]` table over the built-in profile it names). Raises
    ScenarioError."""
    if name in presets.ENGINES:
        return dict(presets.ENGINES[name])
    if name == "roofline":
        return dict(presets.ENGINES[presets.DEFAULT_ENGINE], **presets.NO_FRONTEND)
    if not name.endswith(".toml"):
        raise ScenarioError(
            f"{where} = {name!r}: unknown engine (known: {', '.join(presets.ENGINE_PRESETS)}, "
            f"or a .toml file from servesim calibrate){_suggest(name, presets.ENGINE_PRESETS)}")
    path = Path(name).expanduser()
    if not path.is_absolute():
        path = base_dir / path
    try:
        table = toml_loads(read_input_text(path, limit=MAX_SCENARIO_BYTES)).get("engine")
    except (OSError, UnicodeDecodeError) as e:
        raise ScenarioError(f"{where} = {name!r}: cannot read {path}: {reason(e)}") from None
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{path}: not valid TOML: {e}") from None
    if not isinstance(table, dict):
        raise ScenarioError(f"{path}: no [engine] table (expected a file written by "
                            "servesim calibrate)")
    base = table.get("preset", presets.DEFAULT_ENGINE)
    if base not in presets.ENGINES:
        raise ScenarioError(f"{path}: engine.preset = {shown(base, 80)}: must name a built-in engine "
                            f"({', '.join(presets.ENGINES)})")
    own = {k: v for k, v in table.items() if k != "preset"}
    return {**presets.ENGINES[base], **_keys_added(EngineConfig, own, ENGINE_KEYS_ADDED), **own}


# Engine keys added after session logs were first written, with the value that gives the
# behaviour from before each existed: a log holding every other key gets these, not its
# preset's current value (a refitted profile must not change how an old log replays).
ENGINE_KEYS_ADDED = {"gqa_reread": 1.0, "chunked_prefill": True, "gqa_shared_kv_min_head_dim": 0,
                     "gqa_shared_kv_group": 0,
                     "allreduce_latency_pcie_us": 0.0, "custom_allreduce_pcie_gpus": 0,
                     "allreduce_efficiency_pcie": 0.0, "allreduce_nvls": False,
                     "nvls_latency_us": 71.0, "nvls_efficiency": 0.61,
                     "cuda_graph_padding": False, "decode_split_kv": True,
                     "fp8_context_attention": False,
                     "decode_block_cycles": 17.5, "decode_blocks_per_sm": 0.0,
                     "frontend_chat_request_us": 0.0, "frontend_one_loop": False,
                     "gemm_wave_exposure": 0.0, "guaranteed_no_evict": False}
# The same for a closed loop's workload table (a log's holds every key but those left out
# while unset).
CLOSED_LOOP_KEYS_ADDED = {"start_gap_s": 0.0, "endpoint": "completions", "turnaround_s": 0.0}


def resolve_workload(raw: dict) -> dict:
    """The `[workload]` table, with the keys added since a session log's was written set as
    they behaved before (CLOSED_LOOP_KEYS_ADDED) when it is a closed loop's log: one holding
    `concurrency` and every other key a log writes."""
    if "concurrency" not in raw:
        return raw
    return {**_keys_added(WorkloadConfig, raw, CLOSED_LOOP_KEYS_ADDED), **raw}


def _keys_added(cls: type, table: dict, added: dict) -> dict:
    """`added` where `table` holds every other key of section `cls` that a whole table holds
    (a session log's, or a profile `servesim calibrate` wrote before those keys existed: all
    but `preset` and the keys left out while unset), else nothing."""
    keys = [f.name for f in dataclasses.fields(cls)
            if f.name != "preset" and not f.metadata["unset"]]
    return added if all(k in table for k in keys if k not in added) else {}


def resolve_engine(raw: dict, source: str, base_dir: Path) -> dict:
    """The `[engine]` table with every key it leaves out taken from its preset. A table that
    already holds every key (a session log's) is returned as it is, its preset not read."""
    if _keys_added(EngineConfig, raw, ENGINE_KEYS_ADDED):
        return {**ENGINE_KEYS_ADDED, **raw}
    name = raw.get("preset", presets.DEFAULT_ENGINE)
    if not isinstance(name, str):
        raise ScenarioError(f"{source}: engine.preset = {name!r}: expected a string")
    base = engine_preset(name, f"{source}: engine.preset", base_dir)
    return {**base, **raw}


def _fill_presets(sc: Scenario) -> None:
    _fill_sizes(sc)
    s, hw = sc.scheduler, sc.hardware
    seqs, tokens = presets.scheduler_defaults(sc.engine.preset, hw.preset, hw.memory_gb)
    if s.max_num_seqs == 0:
        s.max_num_seqs = seqs
    if s.max_num_batched_tokens == 0:
        s.max_num_batched_tokens = tokens


def _fill_sizes(sc: Scenario) -> None:
    for sec, table in (("model", presets.MODELS), ("hardware", presets.HARDWARE)):
        cfg = getattr(sc, sec)
        base = table.get(cfg.preset, {})
        if sec == "model" and cfg.config:
            base = _from_config(sc)
        for k, v in base.items():
            if getattr(cfg, k) == 0:
                setattr(cfg, k, type(getattr(cfg, k))(v))
        optional = set(presets.OPTIONAL_HARDWARE)
        if sc.model.tensor_parallel == 1:
            optional.add("interconnect_gbps")  # (one GPU: no GPU-GPU link is used)
        missing = [k for k in next(iter(table.values())) if getattr(cfg, k) == 0
                   and k not in optional]
        if missing:
            raise ScenarioError(
                f"{sc.source}: {sec}: preset = \"\" needs every size; missing {', '.join(missing)}"
            )


# The sizes a [model] table needs (the presets' keys): a table holding all of them (a session
# log's) does not read its config file again.
_SIZES = tuple(next(iter(presets.MODELS.values())))


def _from_config(sc: Scenario) -> dict:
    """The [model] fields `model.config` gives, for `_fill_presets` to fill what the scenario
    leaves at 0; its flags (tied embeddings, quantization) set here unless the scenario set
    them. Nothing when the table already holds every size."""
    m = sc.model
    if all(getattr(m, k) for k in _SIZES if k != "max_model_len"):
        return {}
    try:
        got = read_config(m.config, sc.base_dir)
    except ScenarioError as e:
        raise ScenarioError(f"{sc.source}: model.config: {e}") from None
    got.pop("active_params")
    m.preset = ""  # (the config replaces the preset)
    if got.pop("tie_word_embeddings"):
        m.tie_word_embeddings = True
    if not got.pop("chat_template", True):  # (gpt-oss: Harmony, not a Jinja template)
        m.chat_template = False
    quant = got.pop("quantization", "")
    if not m.quantization and m.dtype_bytes == 2:
        m.quantization = quant
    # Each size meets its [model] field's bounds, as if the scenario had written it.
    where = f"{sc.source}: model.config = {shown(m.config)} gives model"
    return {k: _check_field(f"{where}.{k}", _FIELDS["model"][k], v) for k, v in got.items()}


def _check_model(sc: Scenario) -> None:
    """Mixtures of experts, MLA and quantization: shapes that cannot work."""
    src, m = sc.source, sc.model
    if m.num_experts:
        for key in ("experts_per_token", "moe_intermediate_size"):
            if not getattr(m, key):
                raise ScenarioError(f"{src}: model.{key}: a mixture of experts (num_experts = "
                                    f"{m.num_experts}) needs it")
        if m.experts_per_token > m.num_experts:
            raise ScenarioError(f"{src}: model.experts_per_token = {m.experts_per_token}: more "
                                f"than model.num_experts = {m.num_experts}")
        if m.dense_layers >= m.num_layers:
            raise ScenarioError(f"{src}: model.dense_layers = {m.dense_layers}: must be fewer "
                                f"than model.num_layers = {m.num_layers}")
    else:
        for key in ("experts_per_token", "moe_intermediate_size", "shared_intermediate_size",
                    "dense_layers"):
            if getattr(m, key):
                raise ScenarioError(f"{src}: model.{key} = {getattr(m, key)}: needs "
                                    "model.num_experts (a mixture of experts)")
    ep, tp = m.expert_parallel, m.tensor_parallel
    if m.num_experts and m.data_parallel > 1 and ep not in (1, m.data_parallel * tp):
        raise ScenarioError(f"{src}: model.expert_parallel = {ep}: with model.data_parallel = "
                            f"{m.data_parallel} the experts span data_parallel x tensor_parallel"
                            f" = {m.data_parallel * tp} GPUs (leave it at 1 or give that)")
    if ep > 1 and not m.num_experts:
        raise ScenarioError(f"{src}: model.expert_parallel = {ep}: needs model.num_experts "
                            "(a mixture of experts)")
    if m.num_experts and m.num_experts % ep:
        raise ScenarioError(f"{src}: model.expert_parallel = {ep}: must divide "
                            f"model.num_experts = {m.num_experts}")
    if tp % ep and ep % tp:
        raise ScenarioError(f"{src}: model.expert_parallel = {ep}: must divide "
                            f"model.tensor_parallel = {tp} or be a multiple of it (data-parallel "
                            "ranks of this engine)")
    if m.kv_lora_rank and not m.rope_head_dim:
        raise ScenarioError(f"{src}: model.rope_head_dim: MLA (kv_lora_rank = "
                            f"{m.kv_lora_rank}) needs it")
    if (m.q_lora_rank or m.rope_head_dim) and not m.kv_lora_rank:
        raise ScenarioError(f"{src}: model.kv_lora_rank: q_lora_rank and rope_head_dim are "
                            "MLA's; it needs kv_lora_rank")
    if m.quantization and m.dtype_bytes != 2:
        raise ScenarioError(f"{src}: model.dtype_bytes = {m.dtype_bytes}: with model."
                            f"quantization = {m.quantization!r} it is the embeddings' and LM "
                            "head's bytes; leave it at 2 (or give dtype_bytes alone)")
    experts = ModelShape(m).p_experts
    if experts and m.num_params <= experts:
        raise ScenarioError(f"{src}: model.num_params = {m.num_params:.4g}: no more than its "
                            f"{experts:.4g} expert weights")


def _check_whole(sc: Scenario, check_workload: bool = True) -> None:
    """Checks that span fields: shapes that cannot work, and a pool no request could fit."""
    src, m, w = sc.source, sc.model, sc.workload
    _check_model(sc)
    if m.num_heads % m.num_kv_heads:
        raise ScenarioError(f"{src}: model.num_kv_heads = {m.num_kv_heads}: must divide "
                            f"model.num_heads = {m.num_heads}")
    tp = m.tensor_parallel
    if m.num_heads % tp:
        raise ScenarioError(f"{src}: model.tensor_parallel = {tp}: must divide "
                            f"model.num_heads = {m.num_heads} (each GPU holds whole heads)")
    if m.num_kv_heads % tp and tp % m.num_kv_heads:
        raise ScenarioError(f"{src}: model.tensor_parallel = {tp}: must divide "
                            f"model.num_kv_heads = {m.num_kv_heads}, or be a multiple of it "
                            "(each KV head then replicated)")
    embeddings = (1 if m.tie_word_embeddings else 2) * m.vocab_size * m.hidden_size
    attention = m.num_layers * m.hidden_size * m.head_dim * 2 * (m.num_heads + m.num_kv_heads)
    if m.num_params <= embeddings + attention:
        raise ScenarioError(
            f"{src}: model.num_params = {m.num_params:.4g}: no more than the "
            f"{embeddings + attention:.4g} that [model]'s sizes hold in their embeddings and "
            "attention projections alone (no room for the MLPs)")
    if sc.kv.reserve_gb >= sc.hardware.memory_gb:
        raise ScenarioError(f"{src}: kv.reserve_gb = {sc.kv.reserve_gb:g}: must be less than "
                            f"hardware.memory_gb = {sc.hardware.memory_gb:g}")
    c = sc.compute
    if c.num_experts and not (c.mlp and c.experts_per_token <= c.num_experts):
        raise ScenarioError(f"{src}: compute.num_experts = {c.num_experts}: the experts replace "
                            "the MLP (compute.mlp = true) and take compute.experts_per_token = "
                            f"{c.experts_per_token} of them, so it must be at least that")
    if c.num_heads and c.num_kv_heads and c.num_heads % c.num_kv_heads:
        raise ScenarioError(f"{src}: compute.num_kv_heads = {c.num_kv_heads}: must divide "
                            f"compute.num_heads = {c.num_heads}")
    if w.arrival == "trace" and not w.trace:
        raise ScenarioError(f"{src}: workload.trace: arrival = \"trace\" needs a trace file")
    if w.repeat > 1 and w.arrival != "trace":
        raise ScenarioError(f"{src}: workload.repeat = {w.repeat}: repeats a trace; it needs "
                            f"arrival = \"trace\" (not {w.arrival!r})")
    _check_closed_loop(sc)
    if w.clients and w.arrival == "trace":
        raise ScenarioError(f"{src}: workload.clients: a client mix draws its own lengths; "
                            "arrival = \"trace\" cannot go with it")
    if w.arrival != "trace" and not w.num_requests and not w.duration_s:
        raise ScenarioError(f"{src}: workload: arrival = {w.arrival!r} needs num_requests "
                            "or duration_s to bound the run")
    if w.arrival in ("poisson", "gamma", "constant") and math.isinf(1.0 / w.rate):
        raise ScenarioError(f"{src}: workload.rate = {w.rate:g}: the mean gap between "
                            "requests (1 / rate) is past the largest float")
    _check_cluster(sc)
    _check_parallel(sc)
    try:  # (the service-time model derives the pool size: of one pipeline stage's GPUs)
        cm = CostModel(pipeline_stage(sc))
        num_blocks = cm.num_blocks()
    except (ArithmeticError, ValueError) as e:  # sizes whose products leave float range
        raise ScenarioError(f"{src}: [model] / [hardware] / [kv]: the sizes given overflow the "
                            f"service-time model ({e})") from None
    if num_blocks > 0:
        check_deployment(sc, cm, num_blocks)
    if num_blocks <= 0:
        raise ScenarioError(
            f"{src}: kv.num_blocks: derived {float(num_blocks):.4g} blocks: "
            f"{f'model.config = {m.config!r}' if m.config else f'model.preset = {m.preset!r}'} "
            f"({cm.weight_bytes_per_gpu() / 1e9:.4g} GB of weights per GPU) does not fit in "
            f"hardware.memory_gb = {sc.hardware.memory_gb:g} x kv.gpu_memory_utilization = "
            f"{sc.kv.gpu_memory_utilization:g} minus kv.reserve_gb = {sc.kv.reserve_gb:g}"
        )
    sc.kv.num_blocks = num_blocks
    if not check_workload:
        return
    smallest = min_length(sc, "prompt_tokens") + max(1, min_length(sc, "output_tokens")) - 1
    smallest += w.shared_prefix_tokens  # every prompt starts with the shared system prompt
    if m.max_model_len and smallest + 1 > m.max_model_len:
        raise ScenarioError(
            f"{src}: model.max_model_len = {m.max_model_len}: no request could ever fit (the "
            f"smallest the workload makes has {smallest + 1} tokens)")
    # (the engine's own arrival rule: sim.engine.kv.arrival_blocks)
    policy = POLICIES.get(sc.scheduler.policy)
    chunk = prefill_chunk(policy, sc.scheduler, sc.engine) if policy else 0
    need = arrival_blocks(min_length(sc, "prompt_tokens") + w.shared_prefix_tokens,
                          max(1, min_length(sc, "output_tokens")), sc.kv.block_size,
                          kv_groups(pipeline_stage(sc)), chunk)
    if need > num_blocks:
        raise ScenarioError(
            f"{src}: kv.num_blocks = {num_blocks}: no request could ever fit (the smallest "
            f"needs {need} blocks of {sc.kv.block_size} tokens)"
        )


def _check_closed_loop(sc: Scenario) -> None:
    """`workload.concurrency` and the keys that only a closed loop reads."""
    src, w = sc.source, sc.workload
    if not w.concurrency:
        for key, unset in (("think_time_s", 0.0), ("ramp_up_s", 0.0), ("turns", 1),
                           ("start_gap_s", _default(_FIELDS["workload"]["start_gap_s"])),
                           ("turnaround_s", _default(_FIELDS["workload"]["turnaround_s"]))):
            if getattr(w, key) != unset:
                raise ScenarioError(f"{src}: workload.{key} = {getattr(w, key)!r}: applies to "
                                    "a closed loop; it needs workload.concurrency")
        return
    if not w.num_requests:
        raise ScenarioError(f"{src}: workload.concurrency = {w.concurrency}: a closed loop "
                            "needs workload.num_requests (how many requests its users send)")
    if w.arrival == "trace":
        raise ScenarioError(f"{src}: workload.concurrency = {w.concurrency}: a closed loop "
                            "times its own arrivals; arrival = \"trace\" cannot go with it "
                            "(lengths from a file: {dist = \"empirical\", file = ...})")
    several = _several_instances(sc)
    if several:
        raise ScenarioError(f"{src}: workload.concurrency = {w.concurrency}: a closed loop "
                            f"is not modeled across several instances ({several})")
    if w.num_samples > 1:
        raise ScenarioError(f"{src}: workload.num_samples = {w.num_samples}: parallel "
                            "sampling is not modeled in a closed loop (workload.concurrency)")


def _several_instances(sc: Scenario) -> str:
    """What makes the scenario a deployment of several engines (replicas, a disaggregated
    pair, data-parallel ranks, pipeline virtual engines), as `key = value`; "" for one."""
    m = sc.model
    for key, value, several in (("cluster.replicas", sc.cluster.replicas, sc.cluster.replicas > 1),
                                ("scheduler.policy", sc.scheduler.policy,
                                 sc.scheduler.policy in DEPLOYMENT_POLICIES),
                                ("model.data_parallel", m.data_parallel, m.data_parallel > 1),
                                ("model.pipeline_parallel", m.pipeline_parallel,
                                 m.pipeline_parallel > 1)):
        if several:
            return f"{key} = {value!r}"
    return ""


def _check_cluster(sc: Scenario) -> None:
    """Deployments of several instances: the combinations not modeled. (A disaggregated pair
    with cluster.replicas > 1 is refused when it is built: `servesim compare` runs the other
    policies on that many replicas and the pair on its two instances.)"""
    src, cl = sc.source, sc.cluster
    disagg = sc.scheduler.policy == "disaggregated"
    several = _several_instances(sc)
    if several and sc.workload.clients:
        raise ScenarioError(f"{src}: workload.clients: a client mix is not modeled across "
                            f"several instances ({several})")
    for key in ("prefill_instances", "decode_instances"):
        if getattr(cl, key) != 1 and not disagg:
            raise ScenarioError(f"{src}: cluster.{key} = {getattr(cl, key)}: only a "
                                "disaggregated deployment (scheduler.policy = "
                                "\"disaggregated\") has prefill and decode instances")
    if (disagg or cl.replicas > 1) and sc.workload.num_samples > 1:
        raise ScenarioError(
            f"{src}: workload.num_samples = {sc.workload.num_samples}: parallel sampling is not "
            "modeled across several instances (cluster.replicas > 1 or disaggregated)")


def pipeline_stage(sc: Scenario) -> Scenario:
    """The scenario as one pipeline stage sees it: `num_layers / pipeline_parallel` layers (and
    that share of the sliding-window ones) and that share of the parameters (the embedding and
    the LM head counted as spread evenly), so
    that its CostModel sizes the stage's pool from the stage's weights and the stage's KV per
    token. The scenario itself when pipeline_parallel is 1."""
    pp = sc.model.pipeline_parallel
    if pp == 1:
        return sc
    m = sc.model
    model = dataclasses.replace(m, num_layers=m.num_layers // pp, num_params=m.num_params / pp,
                                sliding_window_layers=m.sliding_window_layers // pp)
    return dataclasses.replace(sc, model=model)


def _check_parallel(sc: Scenario) -> None:
    """Data and pipeline parallelism: the GPUs they multiply to, whole layers per stage, and
    the combinations not modeled."""
    src, m = sc.source, sc.model
    dp, tp, pp = m.data_parallel, m.tensor_parallel, m.pipeline_parallel
    if m.num_gpus and m.num_gpus != dp * tp * pp:
        raise ScenarioError(
            f"{src}: model.num_gpus = {m.num_gpus}: data_parallel {dp} x tensor_parallel {tp} x "
            f"pipeline_parallel {pp} = {dp * tp * pp} GPUs")
    if m.num_layers % pp:
        raise ScenarioError(f"{src}: model.pipeline_parallel = {pp}: must divide "
                            f"model.num_layers = {m.num_layers} (each stage holds whole layers)")
    if m.virtual_engines and pp == 1:
        raise ScenarioError(f"{src}: model.virtual_engines = {m.virtual_engines}: needs "
                            "model.pipeline_parallel > 1")
    if dp == 1 and pp == 1:
        return
    which = (f"model.data_parallel = {dp}" if dp > 1
             else f"model.pipeline_parallel = {pp}")
    if dp > 1 and pp > 1:
        raise ScenarioError(f"{src}: {which} with model.pipeline_parallel = {pp}: data and "
                            "pipeline parallelism together are not modeled")
    if sc.cluster.replicas > 1 or sc.scheduler.policy == "disaggregated":
        raise ScenarioError(f"{src}: {which}: not modeled with cluster.replicas > 1 or a "
                            "disaggregated pair")
    if sc.workload.num_samples > 1:
        raise ScenarioError(f"{src}: {which}: parallel sampling (workload.num_samples = "
                            f"{sc.workload.num_samples}) is not modeled across ranks or stages")
    if sc.compute.clock == "measured":
        raise ScenarioError(f"{src}: {which}: compute.clock = \"measured\" times one engine; "
                            "ranks and stages need the modeled clock")
    if pp > 1 and not (m.pipeline_send_gbps or sc.hardware.interconnect_gbps):
        raise ScenarioError(f"{src}: model.pipeline_parallel = {pp}: needs "
                            "model.pipeline_send_gbps or hardware.interconnect_gbps (the link "
                            "between stages)")


def schema_markdown() -> str:
    """The scenario reference as Markdown tables, one per section (scenarios/README.md embeds
    it), and the client table of `[[workload.clients]]`."""
    out = []
    for name, cls in [*SECTIONS.items(), ("[workload.clients]", ClientConfig)]:
        out += ["", f"`[{name}]`", "", "| field | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(cls):
            m = f.metadata
            d = _default(f)
            notes = [m.get("doc", "")]
            if m.get("choices"):
                notes.append("one of " + ", ".join(f"`{c!r}`" if c != "" else '`""`'
                                                    for c in m["choices"]))
            if m.get("kind") == "policy":
                notes.insert(0, "a policy name")
            if m.get("kind") == "dist":
                notes.append("a number or a distribution table")
            for key, word in (("min", ">="), ("gt", ">"), ("max", "<=")):
                if m.get(key) is not None:
                    v = m[key]
                    v = int(v) if float(v).is_integer() else v
                    notes.append(f"{word} {v:,}" if v >= 10**6 else f"{word} {v}")
            if m.get("pow2"):
                notes.append("a power of two")
            shown = {True: "true", False: "false"}.get(d, d) if isinstance(d, bool) else repr(d)
            if m.get("unset"):
                shown = "(none)"
            elif d is None:  # (a client's key left out)
                shown = "(the workload's)" if m.get("kind") == "dist" else "([slo]'s)"
            text = "; ".join(x for x in notes if x).replace("'", '"')
            out.append(f"| `{f.name}` | `{str(shown).replace(chr(39), chr(34))}` | {text} |")
    return "\n".join(out) + "\n"
