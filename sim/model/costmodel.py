"""The service-time model of the modeled deployment: how long an engine step takes, what it costs
in energy, and how many KV blocks the GPU memory holds.

A step is the sum of the times of the kernels it launches, per GPU, with the model sharded over
`tp = tensor_parallel` GPUs, plus the engine's CPU time (`[engine]` holds every coefficient;
`sim.model.presets.ENGINES` the fitted profiles). What a step computes:

    T  = tokens computed (prefill chunk tokens + one per decoding sequence)
    S  = rows that sample a token (the LM head runs on these only)
    n  = sequences in the step
    Ap = over prefill tokens, the positions each attends to (itself included)
    Kp = over prefill chunks, the cached tokens of the sequence before the chunk
    D, Kd = decoding sequences, and over them the cached tokens each reads
    Ap_w, Kp_w, Kd_w = the same beyond the sliding window (`beyond_window`; 0 without one)

Model sizes: L layers, h hidden, nh / nkv query / KV heads of hd, V vocab, P parameters;
w = sliding_window_layers / L the share of layers attending within a window of W tokens
(`sliding_window`: each query attends its W latest positions, itself included; Llama 4's
chunked attention, where a query attends only its chunk's earlier positions, costed as a window
of the chunk size: an upper bound, about twice the chunk's mean span at long contexts);
P_head = V h (LM head), P_blocks = P - 2 V h (what every token passes through; P - V h with
tied embeddings), the MLP width I = (P_blocks / L - h hd (2 nh + 2 nkv)) / 3h (a gated MLP).
Bytes per element: wb weights (`model.dtype_bytes`; qb the blocks', wb unless quantized), kvb KV
cache (`model.kv_dtype_bytes`), ab activations (`model.act_dtype_bytes`). Hardware: F = peak_tflops * 1e12 (fp8_tflops for 1-byte
weights when the GPU has FP8 tensor cores, reached at e_g = fp8_gemm_efficiency; a quantized
format's own tensor cores at fp8_gemm_efficiency, FP4's at fp4_gemm_efficiency), F16 =
peak_tflops * 1e12 (attention; Fa below for prefill attention), B = mem_bandwidth_gbps * 1e9, N =
interconnect_gbps * 1e9, f = sm_clock_mhz * 1e6.
Engine: e_g gemm, e_b bandwidth, e_k K/V bandwidth, e_a attention, e_e elementwise, e_n
all-reduce efficiencies; e_x the experts' grouped GEMMs (a share of e_g and e_b), e_d the MoE
dispatch and combine's link efficiency.

    linear    t_blocks = sqrt(c^2 + m^2),  c = 2 P_blocks T W(T) / (tp F e_g),  m = qb P_blocks / (tp B e_b)
              t_head   = sqrt(c^2 + m^2),  c = 2 P_head S / (tp F e_g),   m = wb P_head [S>0] / (tp B e_b)
    elementw. t_elem   = T (L ab (8 h + (3 I + 2 (nh + nkv) hd) / tp) + wb h / tp
                            + Lx a_x ROUTED_PASSES h ab) / (B e_e)   (a_x: MoE only, below)
    prefill   t_pa     = max(4 L nh hd (Ap - w Ap_w) / (tp Fa e_a),
                             kv (Kp - w Kp_w + Tp) / (B e_k))
    decode    t_da     = max(4 L nh hd (Kd' + D) / (tp F16 e_a),
                             max(kv g Kd' / (B e_k), L q Kd' max(1 / max(D, 1), b / (sms k)) / f)
                             + kv D / (B e_k)),
              Kd'      = Kd - w Kd_w,  Fa = F16, or fp8_tflops * 1e12 with an FP8 cache (kvb = 1)
                                        where the engine's prefill attention runs in FP8
                                        (`fp8_context_attention`)
    experts   t_moe    = sqrt((c_x N)^2 + (m_x U)^2)                 (mixtures of experts only)
    kernels   busy     = t_blocks + t_head + t_elem + t_pa + t_da (+ t_moe)
    fixed     t_layer  = L layer_overhead
    all-red.  t_ar     = 2 L min(s + c + (tp-1) M,  s + min(2 c, a) + 2 (tp-1)/tp M,
                                 s + v + T h ab / (N e_v))                         (tp > 1)
              M        = T h ab / (N e_n)       (one all-reduce's bytes over the link)
    dispatch  t_a2a    = 2 Lx (a + (r - 1) h ab T / (N e_d))                        (ep > tp)
    GPU       t_gpu    = busy + (t_layer + t_ar)
    CPU       t_cpu    = cpu_base + cpu_per_seq n
    step      = max(t_gpu, t_cpu) with cpu_overlap (multi-step / async scheduling), else the sum
    energy    = tp (idle_w step + (tdp_w - idle_w) busy)                       (all GPUs, J)

with T = Tp + D (Tp prefill tokens). `CostModel.step` is these lines, in this order (each sum
added left to right; the constant factors folded once per model: `_blk_c` is 2 P_blocks /
(tp F e_g), `_fixed` is t_layer plus t_a2a's latency, `_ar_tok` t_a2a's bytes per token,
`_ar_a0 + _ar_a1 T`, `_ar_b0 + _ar_b1 T` and `_ar_c0 + _ar_c1 T` t_ar's three lines).

W(T) is the wave factor: a GEMM of T rows and N output columns (on one GPU) runs as
`ceil(T / t) ceil(N / t)` tiles of t x t (`presets.GEMM_TILE`), `sms` at a time
(`hardware.sm_count`), so it takes `waves = ceil(tiles / sms)` tile times and keeps
`u = T N / (waves sms t^2)` of the tensor cores busy (the padding of its last row and column
of tiles included). Over a layer's four projections (QKV: N = (nh + 2 nkv) hd / tp; output:
h; gate and up: 2 I / tp; down: h), each weighed by its share of the layer's FLOPs,
`W(T) = sum share u^-x` with x = `gemm_wave_exposure` (the part of the loss the libraries'
other tile shapes, split-K and stream-K kernels do not recover); W = 1 with x = 0 or no
`sm_count`, and e_g is then a GEMM's efficiency in whole waves. (MoE experts' grouped GEMMs
and the LM head are costed without it.)

The all-reduce (two per layer, after attention and after the MLP; one, of their sum, where they
run side by side: `model.parallel_attention`, so `2 L` below is then `L`) is the faster of the
engine's one-shot kernel, in which every GPU reads its peers' whole buffers over NVLink
(latency c = `custom_allreduce_us`, tp - 1 times the bytes), and a ring that moves 2 (tp-1)/tp
times the bytes: the engine's two-shot kernel (reduce-scatter and all-gather, 2 c) or NCCL's
(a = `allreduce_latency_us`), whichever starts sooner. Small messages (decode) take the
one-shot, large ones (prefill) the ring; the switch-over is where the two lines cross, at
M (tp-1)(1 - 2/tp) = min(2 c, a) - c (any size at tp = 2, where both move the bytes once).
c = 0 (no custom kernel) leaves NCCL for every size. a, c and e_n are measured collective
figures (sim.model.presets.COLLECTIVES); s = `allreduce_sync_us`, each call's time beyond its
kernel (the wait for the slowest GPU, the gap around the call), is fitted. GPUs linked by PCIe
only (`pcie_only`: a link no faster than PCIe 5.0) take NCCL at its PCIe latency (a =
`allreduce_latency_pcie_us`) and bandwidth (e_n = `allreduce_efficiency_pcie`), and the
one-shot only on up to `custom_allreduce_pcie_gpus` of them (else c = 0). Where the switches
reduce in the network (`hardware.nvlink_sharp`) and the engine leaves NCCL its NVLS
(`allreduce_nvls`), the third line (v = `nvls_latency_us`, e_v = `nvls_efficiency`; none
elsewhere, nor on two GPUs, where NCCL does not run it): each GPU's bytes once, the switches
summing them, which large messages (prefill at tp >= 4) take.

`kv = 2 L max(nkv / tp, 1) hd kvb` is the KV bytes per token on one GPU (heads replicated when
fewer than GPUs; the pool, swaps and hand-offs hold as much), and `g = 1 + (nh / nkv - 1) r` when
the engine's decode kernels read K/V once per query head (`gqa_shared_kv = false`, or a shape
the shared-K/V kernels are not built for: `gqa_shared_kv_group`, `gqa_shared_kv_min_head_dim`),
where `r = gqa_reread` is the fraction of a group's repeated reads that reach DRAM (the others hit
in L2: the group's query heads run at about the same time), else 1. The linear layers' quadrature
sum is the smooth knee between their two rooflines: a GEMM of a few hundred tokens is neither
bandwidth- nor compute-saturated (Vidur's per-operator profiles show 1.4x the larger roofline where
the two meet), so their efficiency grows with T. Only the embedding rows a step uses are read (the
`wb h / tp` per token in t_elem). A mixed step pays prefill and decode attention both, as the
separate kernels do.

Decode attention's second bound is the engine's kernel's, where it gives each sequence and K/V
head (or query head, where it reads K/V per query head) one thread block that streams all of
its cached positions (`decode_split_kv = false`: TensorRT-LLM's masked multi-head and XQA
kernels without multi-block mode; vLLM's and SGLang's kernels, and FlashDecoding's, split a
sequence over blocks): a block takes q =
`decode_block_cycles` hd / 128 clock cycles of its SM (f = `hardware.sm_clock_mhz` * 1e6) per
position and layer whatever the memory could give, so a step of a few sequences at long
contexts waits on its blocks, each running the mean sequence's positions (for MLA hd is taken
as r + dr, which no measurement pins). An SM runs k = `decode_blocks_per_sm` blocks at once at
that rate (0: no limit), so a step's b blocks per sequence (K/V heads on the GPU, or query heads
nh / tp where the engine reads K/V per query head: g above; 1 for MLA) beyond the sms * k slots
wait for one: the step takes at least all its blocks' positions over the slots. Without that
limit many sequences' blocks together outrun the memory and the first bound holds; with it the
step takes the longer of the memory's time and the blocks' waits, both in proportion to the
positions it holds.

Mixtures of experts (sim/README.md derives each line): `Lx = L - dense_layers` MoE layers of `E`
experts, `k` per token, `P_x = 3 h moe_intermediate_size` per expert per layer, `P_blocks` then
what every token passes through (attention, dense MLPs, shared experts, routers: `ModelShape`);
`ep` GPUs hold the experts (`data_parallel x tensor_parallel` with data-parallel ranks, else
`expert_parallel`: `ModelShape.expert_parallel`), `r = max(ep / tp, 1)` data-parallel ranks send
them tokens, each taken to send a batch like the one being timed, `s = expert_skew`. The busiest
GPU's (expert, token) assignments and the experts it touches:

    N = min(T r min(k, E/ep),  T r (k/ep + s k/E) + z_ep sqrt(T r k/ep (1 - 1/ep) (E-k)/(E-1)))
    U = E/ep (1 - 1 / (1 + x + x^2/2 + x^3/6)),  x = -T r ln(1 - k/E)   (~ 1 - (1 - k/E)^(T r))
    c_x = 2 Lx P_x / (F e_g e_x / (tp/ep)),  m_x = qb Lx P_x / (B e_b e_s / (tp/ep))

with `z_ep` the expected largest of `ep` standard normal draws, and `a_x = min(k/ep + s k/E,
min(k, E/ep)) r` the GPU's (token, expert) assignments per token, each passed over
`ROUTED_PASSES` times by the routing's elementwise kernels; `e_s = e_x` for quantized experts
(qb < 2 bytes: their block scales), else 1 (16-bit experts stream as the dense weights do).
The dispatch gathers every rank's tokens on every GPU of the experts (whatever experts they
use) and the combine reduce-scatters the outputs back, so its bytes grow with the ranks, not
with k. `t_a2a` is
folded into `_ar_tok` and `_fixed`. MLA (`kv_lora_rank` r, `rope_head_dim` dr): `kv = L (r + dr) kvb` on every GPU,
decode attention `2 L nh (2 r + dr)` FLOPs per position (the absorbed form), prefill `2 L nh
(2 hd + dr)`, `g = 1`. Quantized blocks (`model.quantization`): `qb` bytes per weight in place of
`wb` in t_blocks and t_moe, F the format's tensor cores, else `F16 e_g / (1 + DEQUANT)`.

`engine.preset = "roofline"` keeps the single roofline servesim started with, for teaching:

    t_compute = (2 P T + 4 L nh hd A) / tp / (peak_tflops * 1e12 * flops_efficiency)
    t_memory  = (P wb + kvt (Kr + T)) / tp / (mem_bandwidth_gbps * 1e9 * bandwidth_efficiency)
    t_comm    = 2 L 2 (tp - 1) / tp T h wb / N    (tp > 1; L, not 2 L, with parallel_attention)
    step      = max(t_compute, t_memory) + t_comm + step_overhead_ms / 1e3

with A = Ap + Kd + D, Kr = Kp + Kd, kvt = 2 L nkv hd wb, busy = max(t_compute, t_memory).
"""

from __future__ import annotations

import math
from array import array
from statistics import NormalDist
from typing import Any, Protocol

import numpy as np

from sim.model.presets import DEQUANT, GEMM_TILE, PCIE_MAX_GBPS, QUANTIZATIONS


class CostModel:
    """Step time, energy and KV capacity for one scenario's model, hardware and engine."""

    # (Declared so that compiled code runs `step` in machine floats; the values are the same
    # either way: each is only ever multiplied or added to floats.)
    _idle: float
    _dyn: float
    _lin: float
    _attn: float
    _inv_flops: float
    _inv_bw: float
    _comm: float
    overhead: float
    _blk_c: float
    _wave_x: float
    _wave_sms: float
    _wave_gemms: list[tuple[float, float]]
    _wave_memo: Any
    _wave_cap: int
    _blk_m: float
    _head_c: float
    _head_m: float
    _elem: float
    _attn_f: float
    _kv: float
    _kv_read: float
    _ar_fix: float
    _ar_tok: float
    _nccl_us: float
    _custom_us: float
    _ar: bool
    _ar_a0: float
    _ar_a1: float
    _ar_b0: float
    _ar_b1: float
    _ar_c0: float
    _ar_c1: float
    _fixed: float
    _cpu0: float
    _cpu1: float
    _overlap: bool
    _graph_sizes: list[float]
    _attn_p: float
    _moe: bool
    _moe_c: float
    _moe_m: float
    _moe_cap: float
    _moe_mean: float
    _moe_sd: float
    _moe_lam: float
    kernel_coefficients: tuple

    def __init__(self, scenario) -> None:
        m, h, kv, e = scenario.model, scenario.hardware, scenario.kv, scenario.engine
        tp = self.tp = m.tensor_parallel
        self.block_size = kv.block_size
        wb = m.dtype_bytes
        kvb = m.kv_dtype_bytes or wb
        if m.kv_lora_rank:  # MLA: the latent and the rotary key, shared by every head
            self.kv_bytes_per_token = m.num_layers * (m.kv_lora_rank + m.rope_head_dim) * kvb
            # (on every GPU whole: the latent is not split by heads)
            self.kv_bytes_per_token_gpu = float(self.kv_bytes_per_token)
        else:
            self.kv_bytes_per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * kvb
            # On one GPU: its share of the KV heads, and at least one (with fewer KV heads than
            # GPUs each head is replicated, as vLLM does): what its pool, swaps and hand-offs
            # hold.
            self.kv_bytes_per_token_gpu = (2.0 * m.num_layers * max(m.num_kv_heads / tp, 1.0)
                                           * m.head_dim * kvb)
        self.shape = shape = ModelShape(m)
        # bytes per weight of the transformer blocks (quantized) and of the embeddings
        self.block_weight_bytes = qb = QUANTIZATIONS[m.quantization][0] if m.quantization else wb
        if m.quantization:
            self.weight_bytes = shape.p_embed * wb + (m.num_params - shape.p_embed) * qb
        else:
            self.weight_bytes = m.num_params * wb
        # On one GPU: the experts are split over max(expert_parallel, tensor_parallel) GPUs
        # (whole experts over expert_parallel groups, each sharded over the rest), the other
        # weights over tensor_parallel.
        self._weight_bytes_gpu = (self.weight_bytes - shape.p_experts * qb) / tp \
            + shape.p_experts * qb / max(shape.expert_parallel, tp)
        self._idle = tp * h.idle_w
        self._dyn = tp * max(0.0, h.tdp_w - h.idle_w)
        self.pcie_bytes_per_s = h.pcie_gbps * 1e9
        self._mem = h.memory_gb * 1e9
        self._util = kv.gpu_memory_utilization
        self._reserve = kv.reserve_gb * 1e9
        self._fixed_blocks = kv.num_blocks
        self._swap_bytes = kv.swap_space_gb * 1e9
        # A pool block on one GPU: every layer's K/V of block_size tokens, or with layer groups
        # (`kv_groups`) one group's (padded groups included: each kind's last one is whole).
        groups = kv_groups(scenario)
        self.pool_block_bytes: float = self.kv_bytes_per_token_gpu * self.block_size
        if groups is not None:
            win = m.sliding_window_layers
            self.pool_block_bytes *= group_size(m.num_layers - win, win) / m.num_layers
        self.roofline = e.preset == "roofline"
        # decode-only steps replayed as CUDA graphs of fixed sizes, the batch padded up to one
        self._graph_sizes = graph_batch_sizes(scenario.scheduler.max_num_seqs) \
            if e.cuda_graph_padding and not self.roofline else []
        # Sliding-window (or chunked) layers' span W and share of the layers w (module docstring);
        # 0 without them, and under the roofline, which costs them as full attention.
        lw = m.sliding_window_layers if m.sliding_window and not self.roofline else 0
        self.window: int = m.sliding_window if lw else 0
        self._win = lw / m.num_layers
        self._wave_init(m, h, e, shape.mlp_width, scenario.scheduler)
        if self.roofline:
            self._roofline_init(m, h, wb)
        else:
            self._kernel_init(m, h, e, wb, kvb)

    def _roofline_init(self, m, h, wb) -> None:
        tp = self.tp
        self._lin = 2.0 * (self.shape.p_active if m.num_experts else m.num_params)
        self._attn = 4.0 * m.num_layers * m.num_heads * m.head_dim
        self._inv_flops = 1.0 / (tp * h.peak_tflops * 1e12 * h.flops_efficiency)
        self._inv_bw = 1.0 / (tp * h.mem_bandwidth_gbps * 1e9 * h.bandwidth_efficiency)
        if tp > 1 and h.interconnect_gbps > 0:
            self._comm = (self.shape.allreduces * 2 * (tp - 1) / tp * m.hidden_size
                          * wb / (h.interconnect_gbps * 1e9))
        else:
            self._comm = 0.0
        self.overhead = h.step_overhead_ms / 1e3

    def _kernel_init(self, m, h, e, wb, kvb) -> None:
        tp, L, hid = self.tp, m.num_layers, m.hidden_size
        nh, nkv, hd, ab = m.num_heads, m.num_kv_heads, m.head_dim, m.act_dtype_bytes
        shape = self.shape
        p_head = float(m.vocab_size * hid)
        p_blocks = shape.p_blocks
        inter = shape.mlp_width
        f16 = h.peak_tflops * 1e12
        bw = h.mem_bandwidth_gbps * 1e9
        gemm = head_gemm = self._gemm_rate(m, h, e, wb)
        if m.quantization:  # the embeddings and LM head stay at dtype_bytes
            head_gemm = tp * f16 * e.gemm_efficiency
        qb = self.block_weight_bytes
        stream = tp * bw * e.bandwidth_efficiency
        # Seconds per unit of each step quantity (see the module docstring).
        self._blk_c = 2.0 * p_blocks / gemm  # per token (times the wave factor)
        self._blk_m = qb * p_blocks / stream
        self._head_c = 2.0 * p_head / head_gemm  # per sampled row
        self._head_m = wb * p_head / stream
        elem = L * ab * (8.0 * hid + (3.0 * inter + 2.0 * (nh + nkv) * hd) / tp) + wb * hid / tp
        elem_rate = bw * e.elementwise_efficiency  # bytes/s of the elementwise kernels
        self._elem = elem / elem_rate
        attn = tp * f16 * e.attention_efficiency
        # (prefill attention on FP8 tensor cores: an FP8 cache where the engine runs it so)
        fp8 = e.fp8_context_attention and kvb == 1 and h.fp8_tflops > 0
        attn_p = tp * h.fp8_tflops * 1e12 * e.attention_efficiency if fp8 else attn
        # (width: a decode-attention block's position, for its clock-bound rate below)
        if m.kv_lora_rank:  # MLA: decode in the absorbed form, prefill with K/V expanded
            r, dr = m.kv_lora_rank, m.rope_head_dim
            self._attn_f = 2.0 * L * nh * (2 * r + dr) / attn
            self._attn_p = 2.0 * L * nh * (2 * hd + dr) / attn_p
            width = r + dr
        else:
            self._attn_f = 4.0 * L * nh * hd / attn  # per attended position
            self._attn_p = 4.0 * L * nh * hd / attn_p
            width = hd
        self._kv = self.kv_bytes_per_token_gpu / (bw * e.kv_bandwidth_efficiency)
        # (the model's group: with fewer K/V heads than GPUs a GPU's kernel sees nh / tp query
        # heads to its one K/V head, which this does not tell apart, as g below does not)
        group = e.gqa_shared_kv_group
        shared = e.gqa_shared_kv and hd >= e.gqa_shared_kv_min_head_dim \
            and (group == 0 or nh == group * nkv)
        self._kv_read = self._kv * (1.0 if shared or m.kv_lora_rank
                                    else 1.0 + (nh / nkv - 1.0) * e.gqa_reread)
        # Without split-K decode (`decode_split_kv = false`) one thread block streams a
        # sequence's positions for one K/V head (or query head, where K/V is not shared),
        # every layer: seconds per position a step's
        # mean sequence holds, from its SM's clock (0: no such bound)
        self._kv_occ = L * e.decode_block_cycles * width / 128.0 / (h.sm_clock_mhz * 1e6) \
            if not e.decode_split_kv and h.sm_clock_mhz > 0 else 0.0
        # (and where a step's blocks outnumber what the SMs stream at once, they wait for one:
        # seconds per position the step's sequences hold together; 0 without that limit)
        blocks = 1.0 if m.kv_lora_rank else max(nkv / tp, 1.0) if shared else nh / tp
        slots = h.sm_count * e.decode_blocks_per_sm
        self._kv_occ_sm = self._kv_occ * blocks / slots if slots > 0 else 0.0
        self._ar_fix = self._ar_tok = 0.0  # (the all-to-all's, with experts over more GPUs)
        # GPUs linked by PCIe only: NCCL at its PCIe latency and bandwidth, the one-shot kernel
        # on at most custom_allreduce_pcie_gpus of them
        pcie = nccl_over_pcie(h, e)
        link = h.interconnect_gbps * 1e9 * allreduce_efficiency(e, pcie)
        self._nccl_us = e.allreduce_latency_pcie_us if pcie else e.allreduce_latency_us
        one_shot = not pcie or tp <= e.custom_allreduce_pcie_gpus
        self._custom_us = e.custom_allreduce_us if one_shot else 0.0
        # (NCCL runs NVLS on three GPUs or more, switch-linked)
        nvls = h.interconnect_gbps * 1e9 * e.nvls_efficiency \
            if e.allreduce_nvls and h.nvlink_sharp and tp > 2 and not pcie_only(h) else 0.0
        self._allreduce_init(e, tp, shape.allreduces, hid * ab, link, nvls)
        self._moe_init(m, h, e, gemm, stream, elem_rate)
        self._fixed = L * e.layer_overhead_us * 1e-6 + self._ar_fix
        self._cpu0 = e.cpu_base_us * 1e-6
        self._cpu1 = e.cpu_per_seq_us * 1e-6
        self._overlap = e.cpu_overlap
        # (in the order sim/native/_rows.c's `decode_rows` reads them: `step`'s decode step in C)
        self.kernel_coefficients = (
            self._blk_c, self._blk_m, self._head_c, self._head_m, self._elem, self._attn_f,
            self._kv, self._kv_read, self._fixed, self._ar_tok, self._cpu0, self._cpu1,
            self._overlap, self._idle, self._dyn, self._moe_c, self._moe_m, self._moe_cap,
            self._moe_mean, self._moe_sd, self._moe_lam, self._ar_a0, self._ar_a1, self._ar_b0,
            self._ar_b1, self._ar_c0, self._ar_c1, self._kv_occ, self._kv_occ_sm)

    def _wave_init(self, m, h, e, inter: float, sched) -> None:
        """The wave factor's terms (the module docstring's W): a layer's four projections'
        output columns on one GPU and their shares of its FLOPs; and the table that keeps the
        factors of the token counts a step can have under the scheduler's limits (its size
        fixed here: a long run's memory does not grow with it)."""
        tp, hid, hd = self.tp, m.hidden_size, m.head_dim
        self._wave_x = 0.0 if self.roofline else e.gemm_wave_exposure
        self._wave_sms = float(h.sm_count)
        self._wave_cap = 0
        self._wave_memo = None
        shapes = [((m.num_heads + 2 * m.num_kv_heads) * hd / tp, hid),
                  (float(hid), m.num_heads * hd / tp), (2.0 * inter / tp, hid),
                  (float(hid), inter / tp)]
        total = sum(n * k for n, k in shapes)
        self._wave_gemms = [(n, n * k / total) for n, k in shapes if n * k > 0]
        if self._wave_sms <= 0 or total <= 0:
            self._wave_x = 0.0
        if self._wave_x > 0:
            self._wave_cap = min(max(sched.max_num_batched_tokens, sched.max_num_seqs), WAVE_MEMO)
            self._wave_memo = array("d", bytes(8 * (self._wave_cap + 1)))

    def wave_factor(self, T: float) -> float:
        """The wave factor W(T) of a step of T tokens (the module docstring's; 1 without
        one). Each value is computed by this one rule; those of whole token counts up to the
        table's size are kept."""
        if self._wave_x == 0.0 or T <= 0:
            return 1.0
        i = int(T)
        kept = i <= self._wave_cap and i == T
        if kept:
            w: float = self._wave_memo[i]
            if w > 0:
                return w
        w = 0.0
        for n, share in self._wave_gemms:
            w += share * tile_utilisation(T, n, self._wave_sms) ** -self._wave_x
        if kept:
            self._wave_memo[i] = w
        return w

    def graph_pad(self, b: float) -> float:
        """The rows a decode-only step of `b` sequences runs beyond them: up to the smallest
        CUDA graph that holds them (`engine.cuda_graph_padding`); 0 without graphs, or for a
        batch larger than the largest."""
        if b <= 0:
            return 0.0
        for z in self._graph_sizes:
            if z >= b:
                return z - b
        return 0.0

    def graph_pads(self, p_tokens, d_seqs) -> Any:
        """`_graph_pad` of each entry of arrays (the same values, bit for bit)."""
        return np.where(np.asarray(p_tokens) == 0, _each(self.graph_pad, d_seqs), 0.0)

    def wave_factors(self, T) -> Any:
        """`wave_factor` of each entry of an array (the same values, bit for bit)."""
        return _each(self.wave_factor, T)

    def _allreduce_init(self, e, tp: int, calls: int, row: float, link: float,
                        nvls: float) -> None:
        """The tensor-parallel all-reduces' coefficients (the module docstring's t_ar): three
        lines in the step's tokens, of which a step pays the lowest. `calls` is the all-reduces
        per step, `row` the bytes one token's activations take, `nvls` the bytes/s of NCCL's
        in-switch reduction (0: none, its line never taken); all 0 on one GPU."""
        self._ar_a0 = self._ar_a1 = self._ar_b0 = self._ar_b1 = self._ar_c1 = 0.0
        self._ar_c0 = math.inf
        self._ar = tp > 1
        if not self._ar:
            return
        if nvls > 0:  # NVLS: each GPU's bytes once, reduced in the switches
            self._ar_c0 = calls * (e.allreduce_sync_us + e.nvls_latency_us) * 1e-6
            self._ar_c1 = calls * row / nvls
        ring = calls * 2.0 * (tp - 1) / tp * row / link if link > 0 else 0.0
        nccl = calls * self._nccl_us * 1e-6
        custom = calls * self._custom_us * 1e-6
        sync = calls * e.allreduce_sync_us * 1e-6  # (whichever kernel runs)
        if self._custom_us > 0:  # one-shot: every GPU reads the others' whole buffers
            self._ar_a0 = sync + custom
            self._ar_a1 = calls * (tp - 1) * row / link if link > 0 else 0.0
            self._ar_b0 = sync + _min(2.0 * custom, nccl)  # two-shot or NCCL: the same bytes
        else:
            self._ar_a0 = self._ar_b0 = sync + nccl
            self._ar_a1 = ring
        self._ar_b1 = ring

    def _gemm_rate(self, m, h, e, wb) -> float:
        """FLOP/s of the transformer blocks' GEMMs over all tensor-parallel GPUs: at the
        tensor cores of the weights' format where the GPU has them, else (weight-only
        kernels) BF16 tensor cores slowed by the unpacking (`presets.DEQUANT`)."""
        tp, f16 = self.tp, h.peak_tflops * 1e12
        if not m.quantization:
            if wb == 1 and h.fp8_tflops > 0:  # FP8 tensor cores
                return tp * h.fp8_tflops * 1e12 * e.fp8_gemm_efficiency
            return tp * f16 * e.gemm_efficiency
        cores = QUANTIZATIONS[m.quantization][1]
        peak = {"fp8": h.fp8_tflops, "int8": h.int8_tops, "fp4": h.fp4_tflops}.get(cores, 0.0)
        if peak > 0:  # (FP4 with its block scales reaches less of its peak than FP8)
            eff = e.fp4_gemm_efficiency if cores == "fp4" else e.fp8_gemm_efficiency
            return tp * peak * 1e12 * eff
        return tp * f16 * e.gemm_efficiency / (1.0 + DEQUANT)

    def _moe_init(self, m, h, e, gemm, stream, elem_rate) -> None:
        """The routed experts' coefficients (the module docstring's t_moe, t_a2a); all 0 for
        a dense model."""
        self._moe = m.num_experts > 0
        self._moe_c = self._moe_m = self._moe_cap = self._moe_mean = 0.0
        self._moe_sd = self._moe_lam = 0.0
        if not self._moe:
            return
        tp, E, k, ep = self.tp, m.num_experts, m.experts_per_token, self.shape.expert_parallel
        n_moe = self.shape.moe_layers
        # one expert, all MoE layers: over the GPUs one expert is split across (tp / ep when
        # the experts are split inside the engine's GPUs; whole when over more), at the grouped
        # GEMMs' share of the dense linear layers' rates
        p_exp = n_moe * mlp_params(m.hidden_size, m.moe_intermediate_size)
        split = max(tp / ep, 1.0)
        self._moe_c = 2.0 * p_exp / (split * e.moe_gemm_efficiency * gemm / tp)
        qb = self.block_weight_bytes
        e_stream = e.moe_gemm_efficiency if qb < 2.0 else 1.0
        self._moe_m = qb * p_exp / (split * e_stream * stream / tp) * (E / ep)
        # With ep > tensor_parallel the experts span ep / tp data-parallel ranks (model.
        # data_parallel's, or implicit ones beside this engine), each taken to send a batch like
        # this one: the GPU's experts see ep / tp times the tokens.
        ranks = max(ep / tp, 1.0)
        share = k / ep  # expected (expert, token) assignments per token on one GPU
        self._moe_cap = min(k, E / ep) * ranks
        self._moe_mean = (share + m.expert_skew * k / E) * ranks
        var = share * (1.0 - 1.0 / ep) * ((E - k) / (E - 1) if E > 1 else 0.0)
        self._moe_sd = expected_max_normal(ep) * math.sqrt(var * ranks)
        self._moe_lam = (-math.log1p(-k / E) if k < E else 1e6) * ranks
        # the routing's passes over each (token, expert) assignment's hidden state on the GPU,
        # per token of the step: in t_elem
        per_token = min(self._moe_mean, self._moe_cap)  # assignments on the GPU per token
        self._elem += n_moe * per_token * ROUTED_PASSES * m.hidden_size * m.act_dtype_bytes \
            / elem_rate
        link = h.interconnect_gbps * 1e9 * e.moe_comm_efficiency
        if ep > tp:
            # dispatch and combine per MoE layer: every GPU gathers the other ranks' tokens
            # (whatever their experts) and reduce-scatters the outputs back
            if link > 0:
                self._ar_tok += 2.0 * n_moe * (ranks - 1.0) * m.hidden_size \
                    * m.act_dtype_bytes / link
            self._ar_fix += 2.0 * n_moe * self._nccl_us * 1e-6

    def weight_bytes_per_gpu(self) -> float:
        return self._weight_bytes_gpu

    def kv_bytes_per_block_gpu(self) -> float:
        """Bytes one block takes on each GPU (its share of the KV heads, at least one)."""
        return self.kv_bytes_per_token_gpu * self.block_size

    def num_host_blocks(self) -> int:
        """Blocks of host swap space (`kv.swap_space_gb` per GPU)."""
        return int(self._swap_bytes // self.kv_bytes_per_block_gpu())

    def num_blocks(self) -> int:
        """The scenario's `kv.num_blocks`, or when 0, what the GPU memory holds (vLLM's rule):
        memory * gpu_memory_utilization - weights - reserve, per GPU, over a pool block's
        bytes."""
        if self._fixed_blocks > 0:
            return self._fixed_blocks
        free = self._mem * self._util - self.weight_bytes_per_gpu() - self._reserve
        return int(free // self.pool_block_bytes)

    def step(self, p_tokens: float, p_attended: float, p_cached: float, d_seqs: float,
             d_cached: float, num_seqs: float, sampled: float, p_beyond: float = 0.0,
             p_skip: float = 0.0, d_beyond: float = 0.0) -> tuple[float, float]:
        """Duration (s) and energy (J) of a step: `p_tokens` prefill tokens attending to
        `p_attended` positions (Ap) in chunks whose sequences had `p_cached` tokens cached
        (Kp), `d_seqs` decoding sequences (D) holding `d_cached` cached tokens (Kd), `num_seqs`
        sequences in all (n), of which `sampled` (S) sample a token. With sliding-window
        layers, `p_beyond`, `p_skip` and `d_beyond` are Ap_w, Kp_w and Kd_w (`beyond_window`),
        which those layers do not attend to or read.

        The module docstring's formulas, term by term and summed in its order: the one
        definition of a step's time. `steps` runs this very source over NumPy arrays, the
        engine's runs of decode steps call it step by step (`decode_times`), and sim/native/_rows.c's
        decode loop is held to it bit for bit by tests/sim/model/test_costmodel.py. Typed, it runs
        in machine floats when compiled (counts are integers far below 2**53: as floats, their
        sums are exact). Only `_max`, `_min`, `_sqrt`, `_positive`, `_waves` and `_graph_pad`
        differ between floats and arrays.
        """
        pad = _graph_pad(self, p_tokens, d_seqs)  # (0 but in padded decode-only steps)
        T = p_tokens + d_seqs + pad
        sampled = sampled + pad
        if self.roofline:
            A = p_attended + d_cached + d_seqs
            Kr = p_cached + d_cached
            t_compute = (self._lin * T + self._attn * A) * self._inv_flops
            t_memory = (self.weight_bytes + self.kv_bytes_per_token * (Kr + T)) * self._inv_bw
            busy = _max(t_compute, t_memory)
            dur = busy + self._comm * T + self.overhead
            return dur, self._idle * dur + self._dyn * busy
        c = self._blk_c * _waves(self, T) * T
        t_blocks = _sqrt(c * c + self._blk_m * self._blk_m)
        c = self._head_c * sampled
        m = self._head_m * _positive(sampled)
        t_head = _sqrt(c * c + m * m)
        t_elem = self._elem * T
        w = self._win
        t_pa = _max(self._attn_p * (p_attended - w * p_beyond),
                    self._kv * (p_cached - w * p_skip + p_tokens))
        kd = d_cached - w * d_beyond
        t_da = _max(self._attn_f * (kd + d_seqs),
                    _max(self._kv_read * kd,
                         _max(self._kv_occ * kd / _max(d_seqs, 1.0), self._kv_occ_sm * kd))
                    + self._kv * d_seqs)
        busy = t_blocks + t_head + t_elem + t_pa + t_da
        if self._moe:  # + t_moe
            n = _min(self._moe_cap * T, self._moe_mean * T + self._moe_sd * _sqrt(T))
            x = self._moe_lam * T
            c = self._moe_c * n
            m = self._moe_m * (1.0 - 1.0 / (1.0 + x * (1.0 + x * (0.5 + x / 6.0))))
            busy = busy + _sqrt(c * c + m * m)
        fixed = self._fixed + self._ar_tok * T  # t_layer + t_a2a
        if self._ar:  # + t_ar
            fixed = fixed + _min(_min(self._ar_a0 + self._ar_a1 * T, self._ar_b0 + self._ar_b1 * T),
                                 self._ar_c0 + self._ar_c1 * T)
        t_gpu = busy + fixed
        t_cpu = self._cpu0 + self._cpu1 * num_seqs
        dur = _max(t_gpu, t_cpu) if self._overlap else t_gpu + t_cpu
        return dur, self._idle * dur + self._dyn * busy

    def steps(self, p_tokens, p_attended, p_cached, d_seqs, d_cached, num_seqs, sampled,
              p_beyond=0.0, p_skip=0.0, d_beyond=0.0):
        """`step` over NumPy arrays (any argument may be a scalar), elementwise: `step`'s own
        source run with NumPy's elementwise maximum, square root and `> 0` and the wave factor
        of each entry (`_elementwise`), so the same operations in the same order give the same
        bits."""
        return _elementwise()(self, p_tokens, p_attended, p_cached, d_seqs, d_cached,
                              num_seqs, sampled, p_beyond, p_skip, d_beyond)

    def decode_steps(self, b, d_cached):
        """`steps` of decode-only steps of `b` sequences holding `d_cached` cached tokens
        (an array: one entry per step)."""
        return self.steps(0, 0, 0, b, d_cached, b, b)

    def decode_times(self, b: int, c0: int, n: int, t: float, t_ext: float):
        """The first (at most `n`) steps of a run of decode-only steps of `b` sequences holding
        `c0` cached tokens, the first starting at `t`: their end times, durations and energies
        (lists), up to the first that ends at or after `t_ext`. Step j is `step(0, 0, 0, b,
        c0 + b j, b, b)`; the clock advances by sequential addition."""
        ends: list[float] = []
        durs: list[float] = []
        ens: list[float] = []
        kr = c0
        for _ in range(n):
            d, en = self.step(0.0, 0.0, 0.0, b, kr, b, b)
            t = t + d
            ends.append(t)
            durs.append(d)
            ens.append(en)
            if t >= t_ext:
                break
            kr += b
        return ends, durs, ens

    def idle_energy(self, seconds: float) -> float:
        return self._idle * seconds

    def swap_time(self, num_blocks: int) -> float:
        """Seconds to move `num_blocks` blocks over the host link (one direction)."""
        if self.pcie_bytes_per_s <= 0:
            return 0.0
        return num_blocks * self.kv_bytes_per_block_gpu() / self.pcie_bytes_per_s


# Elementwise passes over each routed (token, expert) assignment's hidden state, beyond the
# token's own: the permute writes the copy, the grouped GEMM's input quantization reads and
# writes it (one pass, as the activations are cast), the second GEMM writes the expert's
# output and the finalize reads it back for the weighted sum.
ROUTED_PASSES = 4.0


def pcie_only(h) -> bool:
    """The GPUs talk over PCIe only: their link to each other no faster than PCIe 5.0 x16
    (`presets.PCIE_MAX_GBPS`; NVLink and Infinity Fabric links are several times that)."""
    return 0 < h.interconnect_gbps <= PCIE_MAX_GBPS


def allreduce_efficiency(e, pcie: bool) -> float:
    """The share of the link's bandwidth an all-reduce's bytes move at: PCIe's where the GPUs
    have only that (`nccl_over_pcie`) and the engine gives one, else the interconnect's."""
    return e.allreduce_efficiency_pcie if pcie and e.allreduce_efficiency_pcie > 0 \
        else e.allreduce_efficiency


def nccl_over_pcie(h, e) -> bool:
    """The engine `e` costs the all-reduces of GPUs `h` at NCCL's PCIe latency: they are linked
    by PCIe only and it has a PCIe figure (0 costs them as NVLink GPUs, as older logs replay)."""
    return pcie_only(h) and e.allreduce_latency_pcie_us > 0


def kv_groups(sc) -> tuple[int, int, int] | None:
    """How a model's layers share the KV pool (sim.engine.kv): (full-attention groups, window
    groups, window), or None where every layer keeps the whole context.

    vLLM V1's hybrid KV cache manager: the layers of each kind split into groups of the same
    size, the fewest layers of a kind (the most when the kinds differ by under a quarter), the
    last group of a kind padded; a block holds `block_size` tokens of one group. Chunked
    attention is kept as a window of its chunk, as `CostModel` costs it. None without
    sliding-window layers, with `kv.hybrid_kv_cache` off, with preemption by swap, parallel
    samples, the contiguous policy or disaggregated hand-offs (which move one table per
    request), and where every layer has a window (the table attention reads holds the whole
    context). Of a pipeline, one stage's layers (`sim.inputs.scenario.pipeline_stage`)."""
    m = sc.model
    win = m.sliding_window_layers
    full = m.num_layers - win
    if (not sc.kv.hybrid_kv_cache or not m.sliding_window or win <= 0 or full <= 0
            or sc.scheduler.preemption == "swap" or sc.workload.num_samples > 1
            or sc.scheduler.policy in ("contiguous", "disaggregated")):
        return None
    size = group_size(full, win)
    return -(-full // size), -(-win // size), m.sliding_window


def group_size(full: int, win: int) -> int:
    """Layers per group of `kv_groups`, of `full` full-attention and `win` window layers."""
    size = min(win, full)
    return max(win, full) if max(win, full) < 1.25 * size else size


def beyond_window(cached: int, n: int, window: int) -> int:
    """Over `n` queries computed after `cached` tokens, the positions a sliding window of
    `window` (each query attends its `window` latest positions, itself included) leaves out.
    With n = 1 (a decode, or a prefill chunk's first query) also the cached tokens the window
    leaves unread: the step's Ap_w (sum over prefill chunks), Kp_w (of n = 1 over them) and
    Kd_w (over decodes)."""
    m = min(n, cached + n - window)  # the queries that reach past the window
    if m <= 0:
        return 0
    return m * (m + 1) // 2 + m * max(cached - window, 0)


def mlp_params(hidden: int, width: int) -> float:
    """Weights of one gated MLP (or expert): gate, up and down projections."""
    return 3.0 * hidden * width


def expected_max_normal(n: int) -> float:
    """The expected largest of `n` standard normal draws (Blom's approximation: the
    (n - 0.375) / (n + 0.25) quantile; 0 for one draw)."""
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25)) if n > 1 else 0.0


class ModelShape:
    """Where a model's parameters are, from `[model]`: `p_embed` the embedding table and LM
    head (one matrix when tied), `p_experts` the routed experts, `p_blocks` the rest (what
    every token passes through: attention, dense MLPs, shared experts, routers), `p_active`
    what one token uses, `moe_layers` the layers with experts and `mlp_width` the MLP width a
    token's activations have per layer, on average."""

    def __init__(self, m) -> None:
        L, hid = m.num_layers, m.hidden_size
        p_head = float(m.vocab_size * hid)
        self.p_embed = (1.0 if m.tie_word_embeddings else 2.0) * p_head
        # tensor-parallel all-reduces per step: two a layer (after attention, after the MLP),
        # one of their sum where they run side by side (`model.parallel_attention`)
        self.allreduces = (1 if m.parallel_attention else 2) * L
        self.moe_layers = m.num_layers - m.dense_layers if m.num_experts else 0
        # GPUs the experts span: with data_parallel ranks the MoE layers are expert-parallel
        # over all of them (EP = data_parallel x tensor_parallel), else model.expert_parallel
        dp_ep = m.data_parallel * m.tensor_parallel
        self.expert_parallel = (dp_ep if m.num_experts and m.data_parallel > 1
                                else m.expert_parallel)
        per_expert = mlp_params(hid, m.moe_intermediate_size)
        self.p_experts = self.moe_layers * m.num_experts * per_expert
        self.p_blocks = max(m.num_params - self.p_embed - self.p_experts, 0.0)
        self.p_active = (self.p_embed + self.p_blocks
                         + self.moe_layers * m.experts_per_token * per_expert)
        if m.num_experts:
            width = m.experts_per_token * m.moe_intermediate_size + m.shared_intermediate_size
            self.mlp_width = (m.dense_layers * m.intermediate_size
                              + self.moe_layers * width) / L
        elif m.intermediate_size:
            self.mlp_width = float(m.intermediate_size)
        else:  # derived: the blocks' parameters less attention's, over a gated MLP's 3 h
            self.mlp_width = max((self.p_blocks / L - hid * m.head_dim
                                  * (2 * m.num_heads + 2 * m.num_kv_heads)) / (3 * hid), 0.0)


def _max(x: float, y: float) -> float:
    return x if x >= y else y


def _min(x: float, y: float) -> float:
    return x if x <= y else y


def _sqrt(x: float) -> float:
    return math.sqrt(x)


# The most wave factors a cost model keeps: those of 1 to the scheduler's largest step (its token
# budget or its sequences, whichever is larger), at most this many; larger steps compute theirs.
WAVE_MEMO = 1 << 16


def tile_utilisation(rows: float, cols: float, sms: float) -> float:
    """The share of the tensor cores a GEMM's tiles keep busy (the module docstring's u): its
    `rows` x `cols` output in GEMM_TILE-square tiles, `sms` of them at a time, every wave
    taking a whole tile's time."""
    tile = float(GEMM_TILE)
    tiles = math.ceil(rows / tile) * math.ceil(cols / tile)
    return rows * cols / (math.ceil(tiles / sms) * sms * tile * tile)


def graph_batch_sizes(max_batch: int) -> list[float]:
    """The batch sizes TensorRT-LLM's PyTorch backend captures CUDA graphs for when it pads
    (`CudaGraphConfig` with `enable_padding`, which `trtllm-bench` sets, its largest the
    engine's batch limit): 1, 2, 4, every multiple of 8 to 128, the powers of two from 256
    below the limit, and the limit."""
    sizes = [1, 2, 4] + [8 * i for i in range(1, 17)]
    p = 256
    while p < max_batch:
        sizes.append(p)
        p *= 2
    out = [float(z) for z in sizes if z <= max_batch]  # (ascending, each once)
    if max_batch > 0 and (not out or out[-1] != max_batch):
        out.append(float(max_batch))
    return out


def _each(f: Any, a: Any) -> Any:
    """`f` (of a float) of each entry of an array, called once per distinct value."""
    a = np.asarray(a, dtype=np.float64)
    values, where = np.unique(a, return_inverse=True)
    out = np.array([f(float(v)) for v in values], dtype=np.float64)
    return out[where].reshape(a.shape)


def _graph_pad(cost: CostModel, p_tokens: float, d_seqs: float) -> float:
    """The padding of a decode-only step (`CostModel.graph_pad`); 0 in a step with prefill."""
    return cost.graph_pad(d_seqs) if p_tokens == 0 else 0.0


def _waves(cost: CostModel, T: float) -> float:
    """The wave factor of T tokens (`CostModel.wave_factor`)."""
    return cost.wave_factor(T)


def _positive(x: float) -> float:
    """1 where x > 0, else 0 (the LM head's weights are read only when a row samples)."""
    return 1.0 if x > 0 else 0.0


_ELEMENTWISE: Any = None  # (`_elementwise`'s function, made once)


def _elementwise() -> Any:
    """`CostModel.step` made from its source again, with NumPy's elementwise `maximum`,
    `minimum`, `sqrt` and `greater(x, 0)` for `_max`, `_min`, `_sqrt` and `_positive`, and
    `CostModel.wave_factors` for `_waves`, `CostModel.graph_pads` for `_graph_pad`: the one
    definition run
    over arrays. (From the source file, not the function object: the compiled build's `step`
    has no code object, and takes floats only.)"""
    global _ELEMENTWISE
    if _ELEMENTWISE is None:
        import ast
        from importlib.resources import files

        # (found through the package: a compiled module's __file__ does not name its source)
        path = files("sim.model").joinpath("costmodel.py")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CostModel"]
        [fn] = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "step"]
        space: dict[str, Any] = {"_max": np.maximum, "_min": np.minimum, "_sqrt": np.sqrt,
                                 "_positive": lambda x: np.greater(x, 0),
                                 "_waves": lambda cost, T: cost.wave_factors(T),
                                 "_graph_pad": lambda cost, p, d: cost.graph_pads(p, d)}
        exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), space)
        _ELEMENTWISE = space["step"]
    return _ELEMENTWISE


class ServiceTime(Protocol):
    """What the engine asks of a service-time model: `CostModel` is the one it builds from
    a scenario; `Engine(..., cost=...)` takes any other (sim.model.fit's recorder is one).

    `step` times one step (the arguments as `CostModel.step` has them; the last three, what a
    sliding window skips, are passed only when `window` is set); `decode_times` the first
    steps of a run of identical decode steps, one by one, up to the first that ends at or after
    `t_ext`; `decode_steps` any further steps of such a run at once (NumPy arrays). Each must
    equal `step` of the same arguments, bit for bit."""

    window: int  # the sliding-window layers' window in tokens (0: none)

    def step(self, p_tokens: float, p_attended: float, p_cached: float, d_seqs: float,
             d_cached: float, num_seqs: float, sampled: float, p_beyond: float = 0.0,
             p_skip: float = 0.0, d_beyond: float = 0.0) -> tuple[float, float]: ...

    def decode_times(self, b: int, c0: int, n: int, t: float, t_ext: float) -> Any: ...

    def decode_steps(self, b: int, d_cached: Any) -> Any: ...

    def swap_time(self, num_blocks: int) -> float: ...

    def idle_energy(self, seconds: float) -> float: ...

    def num_blocks(self) -> int: ...

    def num_host_blocks(self) -> int: ...
