"""Modeled models and GPUs: public specifications, in the units the scenario file uses.

Model figures are from the models' published configs; GPU figures are vendor data-sheet values
(dense bf16 tensor FLOP/s without sparsity, HBM bandwidth, board power). `idle_w` is an assumed
idle draw, not a data-sheet figure.
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
    "mistral-7b": dict(
        num_params=7.25e9, num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
        head_dim=128, vocab_size=32768, max_model_len=32768,
    ),
}

HARDWARE: dict[str, dict] = {
    "h100-sxm": dict(memory_gb=80.0, mem_bandwidth_gbps=3350.0, peak_tflops=989.0,
                     tdp_w=700.0, idle_w=90.0, interconnect_gbps=450.0, pcie_gbps=64.0),
    "h200": dict(memory_gb=141.0, mem_bandwidth_gbps=4800.0, peak_tflops=989.0,
                 tdp_w=700.0, idle_w=90.0, interconnect_gbps=450.0, pcie_gbps=64.0),
    "a100-80gb": dict(memory_gb=80.0, mem_bandwidth_gbps=2039.0, peak_tflops=312.0,
                      tdp_w=400.0, idle_w=60.0, interconnect_gbps=300.0, pcie_gbps=32.0),
    "l40s": dict(memory_gb=48.0, mem_bandwidth_gbps=864.0, peak_tflops=362.0,
                 tdp_w=350.0, idle_w=40.0, interconnect_gbps=32.0, pcie_gbps=32.0),
}
