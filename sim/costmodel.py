"""The service-time model of the modeled deployment: how long an engine step takes, what it costs
in energy, and how many KV blocks the GPU memory holds.

A step is a roofline (per GPU, with the model sharded over `tensor_parallel` GPUs):

    t_compute = FLOPs / tp / (peak_tflops * 1e12 * flops_efficiency)
    t_memory  = bytes / tp / (mem_bandwidth_gbps * 1e9 * bandwidth_efficiency)
    t_comm    = 2 * layers * 2 (tp - 1) / tp * tokens * hidden * dtype_bytes / (interconnect * 1e9)
    step      = max(t_compute, t_memory) + t_comm + step_overhead_ms / 1e3

    FLOPs = 2 * num_params * tokens + 4 * layers * heads * head_dim * attended
    bytes = num_params * dtype_bytes + kv_bytes_per_token * (kv_read + tokens)

where `attended` sums, over every token computed, the positions it attends to (itself included),
`kv_read` sums, over every sequence, the cached tokens it reads (its context before the step), and
`kv_bytes_per_token = 2 * layers * kv_heads * head_dim * dtype_bytes`.

Energy per step (all GPUs): `tp * (idle_w * step + (tdp_w - idle_w) * max(t_compute, t_memory))`.
"""

from __future__ import annotations

import numpy as np


class CostModel:
    """Step time, energy and KV capacity for one scenario's model and hardware."""

    def __init__(self, scenario) -> None:
        m, h, kv = scenario.model, scenario.hardware, scenario.kv
        self.tp = m.tensor_parallel
        self.block_size = kv.block_size
        self.kv_bytes_per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * m.dtype_bytes
        self.weight_bytes = m.num_params * m.dtype_bytes
        self._lin = 2.0 * m.num_params
        self._attn = 4.0 * m.num_layers * m.num_heads * m.head_dim
        self._inv_flops = 1.0 / (self.tp * h.peak_tflops * 1e12 * h.flops_efficiency)
        self._inv_bw = 1.0 / (self.tp * h.mem_bandwidth_gbps * 1e9 * h.bandwidth_efficiency)
        if self.tp > 1 and h.interconnect_gbps > 0:
            self._comm = (2 * m.num_layers * 2 * (self.tp - 1) / self.tp * m.hidden_size
                          * m.dtype_bytes / (h.interconnect_gbps * 1e9))
        else:
            self._comm = 0.0
        self.overhead = h.step_overhead_ms / 1e3
        self._idle = self.tp * h.idle_w
        self._dyn = self.tp * max(0.0, h.tdp_w - h.idle_w)
        self.pcie_bytes_per_s = h.pcie_gbps * 1e9
        self._mem = h.memory_gb * 1e9
        self._util = kv.gpu_memory_utilization
        self._reserve = kv.reserve_gb * 1e9
        self._fixed_blocks = kv.num_blocks
        self._swap_bytes = kv.swap_space_gb * 1e9

    def weight_bytes_per_gpu(self) -> float:
        return self.weight_bytes / self.tp

    def kv_bytes_per_block(self) -> int:
        """Bytes one block takes across all GPUs."""
        return self.kv_bytes_per_token * self.block_size

    def num_host_blocks(self) -> int:
        """Blocks of host swap space (`kv.swap_space_gb` per GPU)."""
        return int(self._swap_bytes // (self.kv_bytes_per_block() / self.tp))

    def num_blocks(self) -> int:
        """The scenario's `kv.num_blocks`, or when 0, what the GPU memory holds (vLLM's rule):
        memory * gpu_memory_utilization - weights - reserve, per GPU, over the block size."""
        if self._fixed_blocks > 0:
            return self._fixed_blocks
        free = self._mem * self._util - self.weight_bytes_per_gpu() - self._reserve
        return int(free // (self.kv_bytes_per_block() / self.tp))

    def step(self, tokens, attended, kv_read, maximum=max):
        """Duration (s) and energy (J) of steps computing `tokens` tokens.

        Works elementwise on Python numbers (`maximum=max`) or on NumPy arrays
        (`maximum=np.maximum`) with bit-identical results, so a run of steps computed at once
        matches the same steps computed one by one.
        """
        t_compute = (self._lin * tokens + self._attn * attended) * self._inv_flops
        t_memory = (self.weight_bytes + self.kv_bytes_per_token * (kv_read + tokens)) * self._inv_bw
        busy = maximum(t_compute, t_memory)
        dur = busy + self._comm * tokens + self.overhead
        energy = self._idle * dur + self._dyn * busy
        return dur, energy

    def steps(self, tokens: np.ndarray, attended: np.ndarray, kv_read: np.ndarray):
        return self.step(tokens, attended, kv_read, maximum=np.maximum)

    def decode_times(self, b: int, c0: int, n: int, t: float, t_ext: float):
        """The first (at most `n`) steps of a run of decode-only steps of `b` sequences holding
        `c0` cached tokens, the first starting at `t`: their end times, durations and energies
        (lists), up to the first that ends at or after `t_ext`. Equal bit for bit to `step`
        one at a time (the same operations in the same order, the clock advanced by
        sequential addition), without a call per step: the engine's hottest loop."""
        lin_b, attn, inv_flops = self._lin * b, self._attn, self._inv_flops
        wb, kvt, inv_bw = self.weight_bytes, self.kv_bytes_per_token, self._inv_bw
        comm_b, overhead, idle, dyn = self._comm * b, self.overhead, self._idle, self._dyn
        ends, durs, ens = [], [], []
        kr = c0
        for _ in range(n):
            t_compute = (lin_b + attn * (kr + b)) * inv_flops
            t_memory = (wb + kvt * (kr + b)) * inv_bw
            busy = t_compute if t_compute >= t_memory else t_memory  # (max, without a call)
            d = busy + comm_b + overhead
            t = t + d
            ends.append(t)
            durs.append(d)
            ens.append(idle * d + dyn * busy)
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
        return num_blocks * self.kv_bytes_per_block() / self.tp / self.pcie_bytes_per_s
