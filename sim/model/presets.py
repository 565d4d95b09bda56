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

import math

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
                     tdp_w=700.0, idle_w=90.0, interconnect_gbps=450.0, pcie_gbps=64.0,
                     int8_tops=1979.0, fp4_tflops=0.0, sm_count=132, nvlink_sharp=1,
                     sm_clock_mhz=1980),
    # NVIDIA H100 PCIe product brief (PB-11133-001) and data sheet: the same Hopper die with 114
    # SMs on a 350 W card, 80 GB HBM2e at 2,000 GB/s, BF16 756, FP8 and INT8 1,513 TFLOP/s
    # (the sheet's sparse figures halved); PCIe 5.0 x16. Its NVLink bridge joins two cards at
    # 600 GB/s both ways: the preset is the card without one (GPUs talk over PCIe; a bridged
    # pair is `interconnect_gbps = 300`).
    "h100-pcie": dict(memory_gb=80.0, mem_bandwidth_gbps=2000.0, peak_tflops=756.0,
                      fp8_tflops=1513.0, tdp_w=350.0, idle_w=50.0, interconnect_gbps=64.0,
                      pcie_gbps=64.0, int8_tops=1513.0, fp4_tflops=0.0, sm_count=114,
                      nvlink_sharp=0, sm_clock_mhz=1755),
    "h200": dict(memory_gb=141.0, mem_bandwidth_gbps=4800.0, peak_tflops=989.0, fp8_tflops=1979.0,
                 tdp_w=700.0, idle_w=90.0, interconnect_gbps=450.0, pcie_gbps=64.0,
                 int8_tops=1979.0, fp4_tflops=0.0, sm_count=132, nvlink_sharp=1,
                 sm_clock_mhz=1980),
    "a100-80gb": dict(memory_gb=80.0, mem_bandwidth_gbps=2039.0, peak_tflops=312.0, fp8_tflops=0.0,
                      tdp_w=400.0, idle_w=60.0, interconnect_gbps=300.0, pcie_gbps=32.0,
                      int8_tops=624.0, fp4_tflops=0.0, sm_count=108, nvlink_sharp=0,
                      sm_clock_mhz=1410),
    # The A100's 40 GB SXM part: HBM2 at 1,555 GB/s (NVIDIA A100 data sheet), the 80 GB part's
    # compute, NVLink and power.
    "a100-40gb": dict(memory_gb=40.0, mem_bandwidth_gbps=1555.0, peak_tflops=312.0,
                      fp8_tflops=0.0, tdp_w=400.0, idle_w=60.0, interconnect_gbps=300.0,
                      pcie_gbps=32.0, int8_tops=624.0, fp4_tflops=0.0, sm_count=108,
                      nvlink_sharp=0, sm_clock_mhz=1410),
    "l40s": dict(memory_gb=48.0, mem_bandwidth_gbps=864.0, peak_tflops=362.0, fp8_tflops=733.0,
                 tdp_w=350.0, idle_w=40.0, interconnect_gbps=32.0, pcie_gbps=32.0,
                 int8_tops=733.0, fp4_tflops=0.0, sm_count=142, nvlink_sharp=0,
                 sm_clock_mhz=2520),
    # NVIDIA L40 data sheet: 48 GB GDDR6 at 864 GB/s; FP16 / BF16 tensor 181 TFLOP/s, FP8 and
    # INT8 362 (dense: the sheet's sparse figures halved); 300 W; PCIe Gen4 x16, no NVLink.
    "l40": dict(memory_gb=48.0, mem_bandwidth_gbps=864.0, peak_tflops=181.0, fp8_tflops=362.0,
                tdp_w=300.0, idle_w=40.0, interconnect_gbps=32.0, pcie_gbps=32.0,
                int8_tops=362.0, fp4_tflops=0.0, sm_count=142, nvlink_sharp=0,
                sm_clock_mhz=2490),
    # NVIDIA GH200 Grace Hopper Superchip data sheet, its Hopper GPU with 96 GB of HBM3 at
    # 4 TB/s (the 144 GB HBM3e part is faster: give its sizes) and the H100 SXM's tensor peaks;
    # 700 W for the GPU module (the sheet's 450-1000 W is the superchip's range); NVLink 4 to
    # other GPUs as the H100's; NVLink-C2C to its own CPU at 450 GB/s each way (swap).
    "gh200": dict(memory_gb=96.0, mem_bandwidth_gbps=4000.0, peak_tflops=989.0,
                  fp8_tflops=1979.0, tdp_w=700.0, idle_w=90.0, interconnect_gbps=450.0,
                  pcie_gbps=450.0, int8_tops=1979.0, fp4_tflops=0.0, sm_count=132, nvlink_sharp=1,
                  sm_clock_mhz=1980),
    # NVIDIA HGX B200 specifications (https://www.nvidia.com/en-us/data-center/hgx/; per GPU,
    # dense: the sheet's sparse figures halved): 180 GB HBM3e, BF16 2.25, FP8 and INT8 4.5,
    # FP4 9 PFLOP/s, 1000 W; NVLink 5 1.8 TB/s both directions together. The memory's
    # bandwidth is the 180 GB part's, 7.7 TB/s (NVIDIA's Blackwell data sheet; its 7,680-bit
    # bus at 3,996 MHz, as the driver reports them, gives 7.67), not the 8 TB/s a GPU that
    # the HGX page's 64 TB/s for eight GPUs comes to.
    "b200": dict(memory_gb=180.0, mem_bandwidth_gbps=7700.0, peak_tflops=2250.0,
                 fp8_tflops=4500.0, tdp_w=1000.0, idle_w=140.0, interconnect_gbps=900.0,
                 pcie_gbps=64.0, int8_tops=4500.0, fp4_tflops=9000.0, sm_count=148,
                 nvlink_sharp=1, sm_clock_mhz=0),
    # AMD Instinct MI300X data sheet
    # (https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html): 192 GB HBM3 at
    # 5.3 TB/s, dense matrix BF16 1307.4, FP8 and INT8 2614.9 TFLOP/s, 750 W; 7 Infinity Fabric
    # links of 128 GB/s both directions (a fully connected 8-GPU platform: 7 x 64 GB/s each
    # way). No FP4.
    "mi300x": dict(memory_gb=192.0, mem_bandwidth_gbps=5300.0, peak_tflops=1307.4,
                   fp8_tflops=2614.9, tdp_w=750.0, idle_w=140.0, interconnect_gbps=448.0,
                   pcie_gbps=64.0, int8_tops=2614.9, fp4_tflops=0.0, sm_count=304, nvlink_sharp=0,
                   sm_clock_mhz=2100),
}

# The fastest PCIe link, 5.0 x16, per direction (GB/s): GPUs whose link to each other is no
# faster talk over PCIe only (sim.model.costmodel.pcie_only: the L40S, the L40, H100 PCIe cards
# without a bridge); NVLink (A100 300, H100 SXM 450) and Infinity Fabric (MI300X 448) are
# several times it. (A GH200's host link, NVLink-C2C, is as fast as its GPU link: the host link
# tells nothing.)
PCIE_MAX_GBPS = 64.0

# `sm_count`: the streaming multiprocessors (AMD: compute units) of each GPU, from its
# architecture's white paper or data sheet (H100 SXM5 and the H200 / GH200's Hopper 132, the
# H100 PCIe's 114, A100 108, the L40 / L40S's AD102 142, B200 148, MI300X 304): how many GEMM
# tiles run at once (sim.model.costmodel's wave factor).

# `nvlink_sharp`: 1 where the GPUs' NVLink switches reduce in the network (NVLink SHARP, which
# NCCL calls NVLS): the third-generation NVSwitch of HGX H100 and H200 systems (and the GH200's
# NVLink switch), the fourth of HGX B200 (NVIDIA's NVSwitch pages). The A100's NVSwitch has no
# in-network reduction; PCIe cards and the MI300X's Infinity Fabric have no switch of that kind.

# `sm_clock_mhz`: each GPU's boost clock from its data sheet (H100 SXM5, H200 and GH200 1,980
# MHz, H100 PCIe 1,755, A100 1,410, L40S 2,520, L40 2,490, MI300X's peak engine clock 2,100;
# NVIDIA's B200 pages give none: 0). A decode-attention thread block streams one sequence's
# cached positions at a rate set by its SM's clock, not by the memory (sim.model.costmodel:
# kernels that do not split a sequence over blocks, `engine.decode_split_kv = false`).

# Hardware fields a preset may leave at 0 (the GPU has no tensor cores of that type; its SMs
# not given: no wave factor; its switches do not reduce; its clock not given: no bound on a
# decode-attention block's rate).
OPTIONAL_HARDWARE = ("fp8_tflops", "int8_tops", "fp4_tflops", "sm_count", "nvlink_sharp",
                     "sm_clock_mhz")

# Weight formats (`model.quantization`): bytes per weight, its scales included, and the tensor
# cores that multiply it natively. On a GPU without them the engine's weight-only kernels
# (Marlin-style) unpack the weights to BF16 and multiply at peak_tflops, paying DEQUANT on the
# compute side (sim.model.costmodel). Bytes: FP8 and INT8 1 (block or channel scales are
# under 0.1%); AWQ / GPTQ 4-bit in groups of 128 with an FP16 scale and a 4-bit zero point
# (0.5 + 2.5 / 128); w8a16 groups of 128 with an FP16 scale; MXFP4 (OCP MX spec) blocks of
# 32 with an 8-bit scale (0.5 + 1 / 32); NVFP4 blocks of 16 with an FP8 scale (0.5 + 1 / 16).
QUANTIZATIONS: dict[str, tuple[float, str]] = {
    "fp8": (1.0, "fp8"),
    "int8": (1.0, "int8"),
    "w8a16": (1.0 + 2.0 / 128, ""),
    "w4a16": (0.5 + 2.5 / 128, ""),
    "mxfp4": (0.5 + 1.0 / 32, "fp4"),
    "nvfp4": (0.5 + 1.0 / 16, "fp4"),
}
# The unpacking's cost, as a fraction of a weight-only GEMM's tensor time: about one CUDA-core
# instruction per weight per 64-token tile against 128 tensor FLOPs per weight per tile, at a
# tensor-to-CUDA-core throughput ratio of about 8 (H100: 989 against 134 FP16 TFLOP/s, its
# architecture white paper): 8 / 128. An estimate from the hardware, not fitted.
DEQUANT = 8.0 / 128.0

# The tensor-parallel all-reduce (sim.model.costmodel's t_ar), measured, not fitted: each
# call's fixed time and the fraction of the link's bandwidth its bytes move at. Measured over
# NVLink with vLLM's benchmarks/kernels/benchmark_device_communicators.py (bf16 rows of 8192;
# vLLM pull requests #24532, TP 4, and #24111, TP 6): NCCL's ring (`pynccl`) 21 us at 0.5 MB
# rising by about 5 us per MB at TP 4 (18 us plus the bytes); the one-shot custom all-reduce
# (`ca_1stage`), each GPU reading its peers' buffers, 10 us at 0.5 MB at TP 4 and 13 at TP 6
# (6 us plus tp - 1 times the bytes). SGLang's pull request #2904 (H100s, TensorRT-LLM's
# one-shot kernel): 3.7 / 4.8 / 5.9 us at TP 2 / 4 / 8 for 512 elements; its #10571: NCCL in
# a CUDA graph 16.5 us at 2 KiB. The bytes go at about 0.7 of the data-sheet link bandwidth
# (TP 4: 0.65 for the ring, 0.83 for the one-shot). The time a call takes beyond its kernel
# in a serving step (`allreduce_sync_us`) is fitted with the shared coefficients.
# Between GPUs linked by PCIe only (no NVLink: the L40S, the L40) the engines run no one-shot
# kernel (TensorRT-LLM's custom all-reduce is for NVLink GPUs; vLLM's refuses more than two
# PCIe GPUs), and NCCL's all-reduce of a few bytes took 42 us on eight PCIe GPUs (RTX 4090,
# nccl-tests `all_reduce_perf -g 8`: https://github.com/NVIDIA/nccl/issues/1530) and 54 us on
# eight RTX 3090s (https://github.com/NVIDIA/nccl/issues/1439): about 45 us, against 18 over
# NVLink. vLLM's one-shot kernel (and SGLang's, taken from it) does run on two PCIe GPUs, over
# their peer-to-peer link (`custom_all_reduce.py`: more than two need full NVLink);
# TensorRT-LLM's not at all (TRT_NVLINK).
# Over PCIe the ring's bytes move at about half the link's bandwidth, for the host's PCIe
# root complex or switches carry every GPU's flow both ways: NCCL's `all_reduce_perf` on eight
# RTX 5090s (PCIe 5.0 x16, 64 GB/s each way) peaked at a bus bandwidth of 28 GB/s on eight GPUs
# and 35 on four (https://github.com/NVIDIA/nccl/issues/1639), 0.44 and 0.55 of the link: 0.5.
# On switches that reduce in the network (`hardware.nvlink_sharp`) NCCL's all-reduce of a large
# message takes NVLink SHARP (NVLS): each GPU sends its bytes once and gets the sum back, in
# place of the ring's 2 (tp - 1) / tp times the bytes. NCCL's all_reduce_perf on eight H100s
# (the same figures in vLLM pull request #42324's pynccl column and in Mooncake pull request
# #3484's run: 1 MiB 25-28 us, 4 MiB 50-53, 16 MiB 121, 32 MiB 195, 64 MiB 316, 128 MiB 561)
# follows the ring's line up to 16 MiB and then a line of 71 us plus the bytes at 274 GB/s
# (the 64 and 128 MiB points; NCCL's maintainer gives about 275 GB/s as NVLS's peak on eight
# H100s, https://github.com/NVIDIA/nccl-tests/issues/212): 0.61 of the 450 GB/s link. An engine
# that leaves NCCL its default takes it (`allreduce_nvls`: TensorRT-LLM); vLLM and SGLang turn
# it off: NVLS needs NCCL's cuMem allocator, which vLLM disables (NCCL_CUMEM_ENABLE=0 in
# vllm/env_override.py, off a multi-node NVLink domain) and SGLang too, with
# NCCL_NVLS_ENABLE=0 unless asked (`--enable-nccl-nvls`). B200's NVLink 5 takes the same share of
# its link (no measurement of its own).
COLLECTIVES = dict(allreduce_latency_us=18.0, custom_allreduce_us=6.0, allreduce_efficiency=0.7,
                   allreduce_latency_pcie_us=45.0, custom_allreduce_pcie_gpus=2,
                   allreduce_efficiency_pcie=0.5, allreduce_nvls=False, nvls_latency_us=71.0,
                   nvls_efficiency=0.61)
TRT_NVLINK = dict(custom_allreduce_pcie_gpus=0, allreduce_nvls=True)

# TensorRT-LLM's C++ runtime (its executor, as Triton, NIM and its C++ benchmarks drive it, and
# the session of its older benchmarks) launches every kernel of every layer from the host: CUDA
# graphs are off by default (`ExtendedRuntimePerfKnobConfig(..., bool cudaGraphMode = false)` in
# cpp/include/tensorrt_llm/executor/executor.h; the Triton backend's `cuda_graph_mode` the
# same). So a layer costs it a fixed time of its own, which the shared `layer_overhead_us`
# (engines replaying CUDA graphs) is not: fixed on published TensorRT-LLM 0.9 points of Llama 2
# 7B and 70B on H100s (sim/README.md: the grid and its held-out error on the other GPUs and
# models), nearly three times the graph-replaying engines' (`_KERNELS`).
TRT_LAUNCHES = dict(layer_overhead_us=55.0)
# The GEMMs' output tile (rows x columns, sim.model.costmodel's wave factor): 128 x 128, the
# BF16 tile cuBLAS and CUTLASS most use on Ampere and Hopper (NVIDIA's "Matrix Multiplication
# Background User's Guide", its tile and wave quantization sections).
GEMM_TILE = 128
# How much of a partial wave's loss the GEMMs keep (`gemm_wave_exposure`; 1 = every tile of a
# wave takes the whole wave's time, 0 = none): the libraries' other tile shapes, split-K and
# stream-K kernels recover the rest. Fitted, not on serving points, on Vidur's per-operator
# profiles of vLLM's linear layers (github.com/microsoft/vidur, data/profiling/compute: 80,364
# timings of the four projections of 8 models, 1 to 32,768 tokens, TP 1-8, on A100, H100 and
# A40 GPUs; sim/README.md): one value for every GPU and shape, with each GPU's own efficiencies.
WAVE_EXPOSURE = 0.33
# Engine profiles (see the module docstring; `sim.model.costmodel` defines each coefficient).
# The fitted values come from `servesim validate --fit` on the bundled points (sim.model.profiles says
# what is fitted and how); sim/README.md reports their error and leave-one-out error.
# Shared by every engine: the kernels' efficiencies and fixed costs.
_KERNELS = dict(
    fp8_gemm_efficiency=0.662, bandwidth_efficiency=0.8495, attention_efficiency=0.4841,
    elementwise_efficiency=0.5, allreduce_sync_us=12.34, gemm_wave_exposure=WAVE_EXPOSURE,
    # (a layer's fixed time where the engine replays CUDA graphs, not fitted: Vidur's profiles of
    # vLLM's kernels on A100s and H100s, ~15-35 us per layer once the bytes' time is taken out)
    layer_overhead_us=20.0,
    # (a decode-attention block's cycles per cached position where the kernel does not split
    # a sequence over blocks, and the blocks an SM runs at once: ONE_BLOCK_DECODE below)
    decode_block_cycles=18.0, decode_blocks_per_sm=0.0,
    # (the third stage's terms: `validate --fit`'s own values, sim/README.md)
    moe_gemm_efficiency=0.4305, moe_comm_efficiency=0.4907, fp4_gemm_efficiency=0.2507,
) | COLLECTIVES
# An API server's tokenisation (sim.engine.frontend), us per prompt token: the HuggingFace
# tokenizers' rate for one sequence, 1.1 s for a 4 MB document of about 1M tokens
# (https://charlesxu.io/parallel-tokenizer, "The Long Context Revolution Has a Bottleneck").
HF_TOKENIZE_US = 1.1
# No API server in front (sim.engine.frontend): the engine's times are the client's.
NO_FRONTEND = dict(frontend_request_us=0.0, frontend_prompt_token_us=0.0,
                   frontend_output_token_us=0.0, frontend_chat_request_us=0.0,
                   frontend_one_loop=False)
# TensorRT-LLM's decode attention without its multi-block mode: one thread block per sequence
# and K/V head streams every cached position (sim.model.costmodel's second decode bound). The
# mode was a build flag, off by default, in the releases the 0.6 and 0.9 profiles stand for
# (`--multi_block_mode`), and the NIM the sizing course ran shows it off; the executor's
# runtime option in later releases is on by default (`ExtendedRuntimePerfKnobConfig.
# multi_block_mode`), and NIM 1.8's rows say on (below). What it costs, in SM clock cycles per
# position of a head of 128 (`decode_block_cycles`), fixed with NIM's host time (TRT_SERVING)
# on three rows of NIM's Llama 3 8B on two A100s: one user's ITL at 200 / 1000 and at 2000 /
# 2000 tokens (N1, N10) and 250 users' throughput (N2), on a grid of 0.5 cycles, 100 us and
# 2.5 us, the values whose largest error is smallest (N1 0.997, N10 1.001, N2 1.003). The
# sizing course's single-user runs, held out, put it at 16.7-17.3 cycles on A100s (22 for 70B
# on eight) and 16.2-16.3 on H100s with a 16-bit cache, 18.7-20.6 with FP8 (their ITL at 7000 /
# 1000 tokens less that at 200 / 1000, over the 6,800 positions between: sim/README.md). NIM
# 1.8's one-user ITL (C2) would be 1.27 with it, 1.07 without.
# An SM runs one such block at a time at that rate (`decode_blocks_per_sm`, not fitted): a
# step's blocks beyond the SMs wait for one, so many sequences at long contexts take all their
# blocks' positions over the SMs, where the memory would give them sooner. The sizing course's
# held-out runs of Llama 3 8B (a block per query head: NIM's profile, below) at 7000 / 1000
# tokens and 25-250 users show it: ITL 0.81-1.05 of the published with it (median 0.96),
# 0.56-0.88 without (0.70), the batch the same in both. The 0.6 profile keeps no such wait:
# its terms, the shared ones among them, were fitted without it on its rows (T19-T22, Llama 2
# 70B at batch 64-1,024, a block per query head), which its re-read fraction (`gqa_reread`)
# takes in; with it, and the whole fit redone, the fitted rows' median is 0.036 (0.040 as
# shipped) but the held-out rows' 0.055 (0.049), the terms fixed on the fit's values (Triton's,
# NIM's) then off.
ONE_BLOCK_DECODE = dict(decode_split_kv=False, decode_blocks_per_sm=1.0)
_ONE_STEP = dict(cpu_overlap=False, gqa_shared_kv=True, gqa_reread=1.0, gqa_shared_kv_group=0,
                 gqa_shared_kv_min_head_dim=0, num_scheduler_steps=1,
                 chunked_prefill=True, guaranteed_no_evict=False, cuda_graph_padding=False,
                 decode_split_kv=True, fp8_context_attention=False,
                 **NO_FRONTEND)
ENGINES: dict[str, dict] = {
    # TensorRT-LLM 0.5/0.6 (gptSessionBenchmark): its decode attention read K/V per query head,
    # about half of a GQA group's re-reads reaching HBM (the others hit in L2). TensorRT-LLM
    # computes a prompt whole unless chunked context is turned on: off by default in its
    # executor (`ExecutorConfig`, the Triton backend's `enable_chunked_context`) and in its LLM
    # API and `trtllm-serve` (`enable_chunked_prefill: bool = Field(default=False)`,
    # tensorrt_llm/llmapi/llm_args.py). Its capacity scheduler, GUARANTEED_NO_EVICT by default
    # (`SchedulerConfig`, `trtllm-bench --scheduler_policy`), admits a request only when the
    # blocks it will hold at its last token fit beside every running request's: the profiles
    # derived from this one keep that.
    # Its C++ runtime launches each layer's kernels one by one (TRT_LAUNCHES, above).
    "tensorrt-llm-0.6": dict(_KERNELS, **_ONE_STEP, gemm_efficiency=0.8279,
                             kv_bandwidth_efficiency=1.0,
                             cpu_base_us=1876.0, cpu_per_seq_us=4.33)
    | dict(gqa_shared_kv=False, gqa_reread=0.5174, allreduce_latency_us=41.81,
           custom_allreduce_us=0.0, chunked_prefill=False, guaranteed_no_evict=True)
    | TRT_LAUNCHES | TRT_NVLINK | ONE_BLOCK_DECODE | dict(decode_blocks_per_sm=0.0),  # (above)
    # vLLM 0.6 with --num-scheduler-steps 10. Its API server, a process apart from the engine's
    # since 0.6 (the vLLM team, "vLLM v0.6.0: 2.7x Throughput Improvement and 5x Latency
    # Reduction", https://blog.vllm.ai/2024/09/05/perf-update.html), tokenises with the
    # HuggingFace tokenizers, at their rate for one sequence as sglang-0.3's below; the time per
    # request fitted on S4, its one light-load TTFT row (the value, to 0.1 ms, that brings S4's
    # median TTFT to the published 100.48 ms: 100.48); S5-S7 are held out. It takes in whatever
    # else a light-load TTFT spends under multi-step scheduling, so the one-step profiles
    # derived from this one keep none.
    "vllm-0.6-multistep": dict(_KERNELS, **_ONE_STEP, gemm_efficiency=0.7751,
                               kv_bandwidth_efficiency=0.7231,
                               cpu_base_us=3312.0, cpu_per_seq_us=6.078)
    | dict(num_scheduler_steps=10, frontend_request_us=6800.0,
           frontend_prompt_token_us=HF_TOKENIZE_US),
    # SGLang 0.3 (no overlap scheduler yet). Its front end (sim.engine.frontend): tokenisation
    # at the HuggingFace tokenizers' rate for one sequence (HF_TOKENIZE_US); the time per request
    # fitted on V5, its only light-load TTFT row (the value,
    # to 0.1 ms, that brings V5's median TTFT to the published 31.98 ms: 31.99).
    "sglang-0.3": dict(_KERNELS, **_ONE_STEP, gemm_efficiency=0.7675, kv_bandwidth_efficiency=0.711,
                       cpu_base_us=2332.0, cpu_per_seq_us=47.95)
    | dict(frontend_request_us=6800.0, frontend_prompt_token_us=HF_TOKENIZE_US),
}
# Profiles without bundled points of their own, derived from a fitted one (sim/README.md: why;
# DERIVED below and sim.model.profiles.RATIOS say how).
# Later TensorRT-LLM shares K/V across a GQA group (XQA kernels, from 0.8), its decode attention
# reaching 0.8 of the memory's bandwidth (fixed with TRT_LAUNCHES, on the same points) and
# splitting long sequences over blocks (multi-block mode, on by default in the executor's
# runtime; 0.9's profile and NIM's keep ONE_BLOCK_DECODE), and its executor overlaps its CPU
# work with the GPU.
TRT_EXECUTOR = dict(gqa_shared_kv=True, cpu_overlap=True, kv_bandwidth_efficiency=0.8,
                    decode_split_kv=True,
                    **COLLECTIVES) | TRT_NVLINK
# Its first XQA kernels (0.8, 0.9) were built for Llama 2 70B's shape only: eight query heads
# to a K/V head, heads of 128 or 256 (the precompiled kernel table,
# cpp/tensorrt_llm/kernels/decoderMaskedMultiheadAttention/cubin/xqa_kernel_cubin.h, lists
# `nqpkv` 8 alone; its docs: "It currently only supports a limited number of model
# configurations, such as the LLAMA2 70B model"). Any other GQA model (Mistral's groups of 4,
# Falcon 180B's groups of 29 query heads of size 64) decodes with the masked multi-head kernel,
# reading K/V per query head as 0.6 did (its `gqa_reread`); 0.7, before XQA, is taken as these.
# From 0.10 the kernels are compiled at run time for other groups (`tensorrt-llm`); heads of 64
# came only in 0.16 (its release notes), which `tensorrt-llm` does not model apart.
TRT_XQA_SHAPES = dict(gqa_shared_kv_group=8, gqa_shared_kv_min_head_dim=128)
# NVIDIA NIM serving on its TensorRT-LLM backend as NVIDIA's sizing course ran it (taken as NIM
# 1.0: the course's lab container is nvcr.io/nim/meta/llama3-8b-instruct:1.0.3, in its
# composer/docker-compose.yml; its dataset names no version): each step also
# spends host time on every sequence's output in the engine's loop, the GPU waiting: its CPU
# time per step and per sequence, serial, fixed on rows of NIM's Llama 3 8B on two A100s (N1:
# one user's ITL, N2: the throughput of 250 users) together with its decode attention's time
# without multi-block mode (ONE_BLOCK_DECODE, which says how; N10 the third row), and its API
# server's time per request on N3 (NIM_FRONTEND, below), the other rows of that table held out
# (sim/README.md). NIM 1.8's published table (the C rows) shows neither time: which NIM
# releases take this profile is sim.model.validate.engine_preset_for's.
TRT_SERVING = dict(cpu_overlap=False, cpu_base_us=700.0, cpu_per_seq_us=45.0) | ONE_BLOCK_DECODE
# Its decode kernels read as 0.9's (the release it was built on its dataset does not say):
# K/V shared in groups of eight query heads only (TRT_XQA_SHAPES), and where they read K/V
# per query head (Llama 3 8B's groups of four) the group's re-reads hit in L2 (`gqa_reread`
# 0): its blocks, one per query head, run side by side. With 0.6's fraction the sizing
# course's 8B ITL rows come to median 0.130 (0.069 without), the course's 2,361 points 0.100
# (0.084). 0.9's profile keeps 0.6's: its Falcon 180B rows (groups of 29 heads of 64) ask for
# the re-reads (R24 1.20, 1.41 without), its Mistral 7B rows on an L40 (groups of four) not
# (R39 0.60, 0.99 without).
NIM_KERNELS = TRT_XQA_SHAPES | dict(gqa_reread=0.0)
# NIM's own API server in front of it (sim.engine.frontend; the course's client, genai-perf,
# measured through it): tokenisation at the HuggingFace tokenizers' rate as the others', and a
# time per request, to 0.1 ms the value that brings the table's one light-load TTFT row to its
# published figure (N3, one user, 200 tokens in: 21.44 ms, published 21.43; 13.44 without it;
# N1, N2 and N10 unchanged). The sizing course's one-user TTFT rows (72 runs, N3's among them,
# the other 71 held out) come to median error 0.072 (0.171 without it, 70 of 72 short; the
# course's 2,361 points 0.084, 0.089 without it); one time for every setup leaves one or two
# H100s' rows 20-28% long and four to eight A100s' 9-13% short.
NIM_FRONTEND = dict(frontend_request_us=8000.0, frontend_prompt_token_us=HF_TOKENIZE_US)
# Its PyTorch backend (the default from 1.0): the same kernels, and Python's time per sequence
# on the host, fitted on M8 and Q17 (sim/README.md): the rows where it binds most, a mixture of
# experts on a B200 and a dense 8B on an H200. Its published figures are `trtllm-bench`'s, which
# turns chunked context on by default (`--enable_chunked_context/--disable_chunked_context`,
# default on): so does this profile (`trtllm-serve` keeps it off: `chunked_prefill = false`,
# sim.model.validate.engine_settings_for). The same kernels, its host time (0.6's per step, its
# own per sequence) overlapping the GPU's, offline (`trtllm-bench`) or behind `trtllm-serve`.
# It replays CUDA graphs: the shared fixed time per layer, not TRT_LAUNCHES. `trtllm-bench`
# has them padded (its max-throughput settings: `cuda_graph_config` with `padding_enabled` and
# the engine's batch limit), so a decode-only step runs the graph of the next captured size
# (sim.model.costmodel.graph_batch_sizes: above 128 only powers of two and the limit, a batch
# of 300 under a limit of 512 running as 512); `trtllm-serve`'s LLM API does not pad
# (sim.model.validate.engine_settings_for). `engine.cuda_graph_padding = true` models it; this
# profile keeps it off until the terms fitted on its rows are fitted with it: on, the 60 FP8
# rows of TensorRT-LLM 1.0's table come to median 0.035 (worst 0.144, from 0.038 / 0.170; Llama 3.1 405B at TP 8 0.038
# from 0.057), but the fitted rows' worst goes from 0.099 to 0.148 (M5) and the FP4 rows' median
# from 0.105 to 0.210: the MoE, FP4 and host-time terms fitted on M1-M17 and Q17 took in the
# padding's time. Fitted again with it (`validate --fit`'s third stage: moe_gemm_efficiency
# 0.442, moe_comm_efficiency 0.654, fp4_gemm_efficiency 0.275), the 493 points besides G18-G21
# come to 0.055 and the held-out MoE rows with data-parallel attention to 0.109 (from 0.047):
# off, the bundled rows are better predicted (sim/README.md).
TRT_OFFLINE = dict(gqa_shared_kv=True, **COLLECTIVES, cpu_overlap=True, cpu_per_seq_us=34.42,
                   decode_split_kv=True,
                   chunked_prefill=True,
                   layer_overhead_us=_KERNELS["layer_overhead_us"]) | TRT_NVLINK
# vLLM V1's API server (sim.engine.frontend): tokenisation at the HuggingFace tokenizers' rate as
# the others'. Its time per streamed output token (detokenising it, building its chunk, writing
# it: one process for every stream) from the one published run where one API server bounds the
# throughput: vLLM pull request #17546 (https://github.com/vllm-project/vllm/pull/17546), two
# A100s with data parallelism behind one API server, Llama-3.2-1B, ShareGPT offered at 120 req/s,
# served 10,000 requests in 130.74 s (76.5 req/s); at ShareGPT's ~198 output tokens a request
# (vLLM's own ShareGPT runs: 197,521 tokens for 1,000 requests, pull request #8335) that is 15k
# tokens/s through the server, about 65 us a token, and more API servers is what the pull request
# adds to lift it. (Pull request #12298's A100 run kept pace with 11.2k tokens/s: at most 89 us.)
# The time per request (HTTP, the request's checks, the hand-offs to and from the engine core
# over ZMQ, the first token's output processing) fitted on F3 and F7, two light-load TTFT rows of
# stock `vllm bench serve` on /v1/completions: a 70B in FP8 on one H200 at 0.75 req/s (vLLM
# 0.14.1, a report of its baseline: scenarios/fidelity/published.csv) and Qwen3-0.6B on one H100
# at 16 req/s (vLLM 0.19.0, kvcached pull request #331's raw results,
# https://github.com/ovg-project/kvcached/pull/331), the value, to 0.1 ms, that brings their
# median |log error| to its minimum (F7 1.000 of its published 36.03 ms, F3 1.22). F7's GPU time
# is a seventh of its TTFT, so its row pins the server's; the 70B rows (F3-F6, E1-E3) ask for
# about 18 ms. F1, F2 and F4-F6 are held out.
# A chat-completions request costs its API server more, one request after another: rendering the
# model's Jinja chat template and the chat request's handling. GPUStack's performance lab
# (https://github.com/gpustack/gpustack, docs/performance-lab: `vllm bench serve --backend
# openai-chat`, 1,000 requests of 128 tokens in, 4 out, sent at once) measured 1,000 such
# requests taking 21-27 s through vLLM 0.11 on very different GPUs (Qwen3-14B on an H100, 22.7,
# or an A100, 26.8; DeepSeek-R1 on eight H200s, 22.1; GLM-4.5-Air on four A100s, 21.0), but
# 4.7-5.4 s for gpt-oss (Harmony, not Jinja: `model.chat_template = false`) and 6-10 s through
# SGLang: a server's time per request, not the GPU's. It is not one time for every model:
# the same lab's Qwen3-235B-A22B-Instruct-2507 took 8.8 s on eight H100s (17.7 on eight A100s)
# and GLM-4.6 13.9 s on eight H200s, so this term over-predicts their bursts (the Qwen3 run's
# throughput 0.39 of the published). The value, to 0.1 ms, that brings the Qwen3-14B H100
# run's throughput to its published figure (G4: 0.999); the light-load chat TTFT rows are held
# out. vLLM's API server takes in requests and streams tokens in one event loop
# (`frontend_one_loop`): in that burst the median TTFT, 18.1 s, sits near the end of the 22.7 s
# run, as the loop's intake holds back every first token.
V1_FRONTEND = dict(frontend_request_us=30000.0, frontend_prompt_token_us=HF_TOKENIZE_US,
                   frontend_output_token_us=65.0, frontend_chat_request_us=22400.0,
                   frontend_one_loop=True)
# vLLM V1 before 0.14.0, whose engine core scheduled each step after the one before had ended
# (async scheduling, which overlaps the scheduler with the GPU, became the default in 0.14.0:
# vLLM pull request #27614): its host time per step in series with the GPU's. The time per
# step fixed on one user's decode through vLLM 0.11 (G3, GPUStack's Qwen3-8B latency article:
# 7.22 ms a token on an H100), the time per sequence on that lab's A/B of the switch itself:
# gpt-oss-20b on one A100, a burst of 1,000 ShareGPT chat requests, 9,743 total tokens/s
# without it (G18) and 10,920 with `--async-scheduling` (G20, held out, on `vllm-v1`): on grids
# of 10 us and 0.5 us, the values that bring the two rows to the published figures (G3 1.001,
# G18 1.000; G20 0.987, the switch's gain 1.106 against 1.121 published).
V1_SYNC_HOST = dict(cpu_overlap=False, cpu_base_us=1150.0, cpu_per_seq_us=13.5)
# SGLang 0.5's chat requests, fitted as vLLM's on the same lab's SGLang run (Qwen3-14B-FP8 on an
# H100: G9, 1.005); its burst's first tokens spread over the run (median TTFT 4.1 s of 7.8 s),
# so its streaming is not held back behind its intake. trtllm-serve's (TensorRT-LLM 1.2, its
# PyTorch backend) on its one such run (Qwen3-32B-FP8 on an H100, chunked prefill on: G12,
# 0.999); the same server over the C++ runtime (`tensorrt-llm`) takes it too.
SGLANG_CHAT = dict(frontend_chat_request_us=7600.0)
# Triton's TensorRT-LLM backend in front of the runtime (its ensemble: a Python model
# tokenising, the engine, a Python model detokenising, behind Triton's HTTP/gRPC server), which
# a publication's engine column names (sim.model.validate.engine_settings_for), fitted on
# TensorRT-LLM 0.14's online-serving table (perf-overview.md: Llama 3.1 8B on one H100 and 70B
# on four, 467 in and 256 out, or 467 / 16, or 202 / 214, at 2-16 req/s).
# Its API terms (TRITON_FRONTEND, whatever runtime is behind it): tokenisation at the
# HuggingFace tokenizers' rate as the others', a time per streamed token and a time per request.
# Every streamed response passes the ensemble's postprocessing model, Python detokenising one
# response at a time (tensorrtllm_backend issue #622 traced a streaming slowdown to its
# `execute()`), so a step's tokens queue for it: under load the first token waits behind the
# step's others, more where a step carries more of them (the 70B's steps at 16 req/s carry ~170
# sequences, the 8B's ~40; the 70B's TTFT rows there are 0.80-0.93 without it and
# 0.82-0.99 with it, its 467 / 16 runs, which stream few tokens, unchanged at 0.82-0.87). The
# time per token, on a grid of 2.5 us, the value that makes the larger error of the highest-load
# TTFT rows of H100s smallest (O4 and O16, 70B and 8B at 467 / 256 tokens and 16 req/s: 0.901
# and 1.096; 0.850 and 1.036 without it), and the time per request, to 0.1 ms, the value that
# brings the lightest-load TTFT rows closest (O1 and O13, the two models at 2 req/s: 1.000 and
# 0.999), each fixed with the other and the host time below. The other TTFT rows are held out:
# at 2-16 req/s their median error is 0.043 (0.052 without the time per token); at 32 req/s,
# where one server handles the 8B's 8k tokens/s, it overshoots (the 467 / 256 runs on an H100
# 1.25, 1.10 without it).
# Over the C++ executor (`tensorrt-llm`, the runtime of that table; TRITON_HOST) each step's
# host time per sequence is serial with the GPU, as in NIM's profile (TRT_SERVING): the table's
# inter-token latency grows with the load faster than the GPU's time (70B on four H100s at
# 16 req/s: 66 ms, 53 with the executor's host time overlapped; seen on both models and both
# GPUs, though the H200's 16 req/s rows stay 0.85-0.93 with it), while at 2 req/s it sits on
# the GPU's time (a serial time per step would show there: none is kept). Where that time goes
# (the backend's responses, its hand-off of each to the ensemble) the rows do not say. Its
# time per sequence, on a grid of 2.5 us, the value that makes the larger of
# the two errors of the highest-load ITL rows of H100s smallest (O52 and O64, 70B and 8B at
# 16 req/s: 0.967 and 1.038; 0.80 and 0.87 overlapped; 25.0 would give the smaller mean, 0.951
# and 1.019). The other 114 rows, the H200's all and the table's 32 req/s column among them,
# are held out; at 32 req/s the serial time makes the ITL of the 70B's 202 / 214 runs 1.35-1.41
# (1.06-1.14 overlapped) and of the 8B's 467 / 256 runs 1.16-1.34 (0.69-0.84 overlapped):
# linear in the sequences, it overshoots there. Other runtimes behind Triton (0.6's, the PyTorch
# backend) keep their own host time: none of these rows ran on them.
TRITON_FRONTEND = dict(frontend_request_us=4700.0, frontend_prompt_token_us=HF_TOKENIZE_US,
                       frontend_output_token_us=45.0)
TRITON_HOST = dict(cpu_overlap=False, cpu_base_us=0.0, cpu_per_seq_us=27.5)
TRT_SERVE_CHAT = dict(frontend_chat_request_us=19300.0)
# Its builds of FP8 checkpoints run prefill attention in FP8 when the cache is FP8 (`trtllm-bench
# build` sets `use_fp8_context_fmha` for FP8 quantization, tensorrt_llm/bench/build/build.py;
# the builder turns it on with an FP8 paged cache). On the held-out FP8 rows of TensorRT-LLM
# 0.17's throughput table (81 P rows) the median error goes from 0.044 to 0.034 (20,000 / 2,000
# tokens on two H200s 0.91 -> 0.99) and on NIM 1.8's (C1-C11) from 0.081 to 0.068. Not in 0.9's
# profile (its 32 FP8 R rows 0.053 -> 0.060 with it), nor NIM 1.0's (its FP8 course rows 0.098
# -> 0.102), nor the PyTorch backend's, whose MoE, FP4 and host terms were fitted without it (M
# and Q rows 0.039 / 0.046 -> 0.052 / 0.053 with it).
FP8_CONTEXT = dict(fp8_context_attention=True)
# The derived profiles: each takes every coefficient of the fitted one it names, and its own
# flags over them (the one table: sim.model.profiles fits the sources and derives these from it).
# The current versions overlap their CPU work with the GPU: vLLM V1 (engine core apart from the
# API server and detokenizer, async scheduling: the default from 0.14.0; V1 before it scheduled
# in series, `vllm-v1-sync`), SGLang 0.4's overlap scheduler, TensorRT-LLM's executor.
# vLLM V1: one step per decision, its host time overlapped, its API server in front; before
# 0.14 the same with its host time in series (V1_SYNC_HOST, above).
V1_FLAGS = dict(num_scheduler_steps=1, cpu_overlap=True, **V1_FRONTEND)
DERIVED: dict[str, tuple[str, dict]] = {
    "tensorrt-llm": ("tensorrt-llm-0.6", TRT_EXECUTOR | TRT_SERVE_CHAT | FP8_CONTEXT),
    "tensorrt-llm-0.9": ("tensorrt-llm-0.6", TRT_EXECUTOR | TRT_XQA_SHAPES | ONE_BLOCK_DECODE),
    "nim": ("tensorrt-llm-0.6", TRT_EXECUTOR | TRT_SERVING | NIM_FRONTEND | NIM_KERNELS),
    "tensorrt-llm-pytorch": ("tensorrt-llm-0.6", TRT_OFFLINE | TRT_SERVE_CHAT),
    "sglang": ("sglang-0.3", dict(cpu_overlap=True, **SGLANG_CHAT)),
    "vllm-v1": ("vllm-0.6-multistep", V1_FLAGS),
    "vllm-v1-sync": ("vllm-0.6-multistep", V1_FLAGS | V1_SYNC_HOST),
    # V0 without multi-step: serial CPU time, its time per sequence refitted to the vLLM team's
    # published ratios (below; sim.model.profiles.RATIOS)
    "vllm-0.6": ("vllm-0.6-multistep", dict(num_scheduler_steps=1, **NO_FRONTEND)),
    "vllm-0.5": ("vllm-0.6-multistep", dict(num_scheduler_steps=1, **NO_FRONTEND)),
}
for _name, (_source, _flags) in DERIVED.items():
    ENGINES[_name] = {**ENGINES[_source], **_flags}
ENGINES["vllm-0.6"]["cpu_per_seq_us"] = 125.8
ENGINES["vllm-0.5"]["cpu_per_seq_us"] = 337.2
ENGINES = {k: ENGINES[k] for k in ("vllm-v1", "vllm-v1-sync", "vllm-0.6-multistep", "vllm-0.6",
                                   "vllm-0.5", "sglang", "sglang-0.3", "tensorrt-llm",
                                   "tensorrt-llm-pytorch", "tensorrt-llm-0.9", "tensorrt-llm-0.6",
                                   "nim")}
ENGINE_PRESETS = [*ENGINES, "roofline"]
# What a user running today's vLLM gets.
DEFAULT_ENGINE = "vllm-v1"

# The scheduler's limits a scenario leaves out ([scheduler] max_num_seqs and
# max_num_batched_tokens at 0), as each engine sets them by default:
# - vLLM V1's `vllm serve`: 1,024 sequences and 8,192 tokens a step on a GPU of 70 GiB or more
#   other than an A100, else 256 and 2,048 (`EngineArgs.get_batch_defaults` in
#   vllm/engine/arg_utils.py; the A100 is kept at the smaller budget, which measured faster on
#   it, vLLM pull request #17885);
# - SGLang: a prefill batch of `chunked_prefill_size` tokens by the GPU's memory (2,048 below
#   35 GB, 4,096 below 60, 8,192 below 160, 16,384 above: `ServerArgs._handle_gpu_memory_settings`
#   in python/sglang/srt/server_args.py) and at least 2,048 requests (`max_running_requests`
#   from the KV pool, clamped to 2,048-4,096: the pool binds first);
# - TensorRT-LLM (its executor and PyTorch backend, NIM): 2,048 sequences and 8,192 tokens, its LLM
#   API's `max_batch_size` and `max_num_tokens` (tensorrt_llm/llmapi/llm_args.py);
# - the others: 256 and 2,048.
SGLANG_PREFILL_TOKENS = ((35, 2048), (60, 4096), (160, 8192), (math.inf, 16384))


def scheduler_defaults(engine: str, hardware: str, memory_gb: float) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) that `engine` (a profile's name) takes on a GPU
    (`hardware`: its preset's name, or "" for one given by its sizes) of `memory_gb`."""
    big = memory_gb >= 70 and not hardware.startswith("a100")
    if engine in ("vllm-v1", "vllm-v1-sync") and big:
        return 1024, 8192
    if engine == "sglang":
        return 2048, next(tokens for below, tokens in SGLANG_PREFILL_TOKENS if memory_gb < below)
    if engine in ("tensorrt-llm", "tensorrt-llm-pytorch", "tensorrt-llm-0.9", "nim"):
        return 2048, 8192
    return 256, 2048
