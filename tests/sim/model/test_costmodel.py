import math
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sim.model.costmodel import CostModel, beyond_window, tile_utilisation
from sim.model import presets
from sim.model.presets import WAVE_EXPOSURE
from sim.errors import ScenarioError
from sim.inputs.scenario import load_scenario

ROOFLINE = 'engine.preset="roofline"'
# No CPU, no fixed costs: what is left is the kernels' time.
BARE = ("engine.cpu_base_us=0", "engine.cpu_per_seq_us=0", "engine.layer_overhead_us=0")


def model(*o):
    return CostModel(load_scenario("chat", list(o)))


def decode(m, batch, context):
    """A decode-only step of `batch` sequences holding `context` cached tokens each."""
    return m.step(0, 0, 0, batch, batch * context, batch, batch)[0]


def prefill(m, tokens, cached=0, sampled=1):
    """A prefill chunk of `tokens` tokens after `cached` cached ones."""
    return m.step(tokens, tokens * cached + tokens * (tokens + 1) // 2, cached, 0, 0, 1,
                  sampled)[0]


# --- the roofline kept for teaching ------------------------------------------------------------
def test_roofline_decode_step_is_memory_bound_and_matches_the_formula():
    m = model(ROOFLINE, "hardware.step_overhead_ms=0")
    # one decode token with 1000 cached tokens, Llama-3.1-8B on an H100
    dur, energy = m.step(0, 0, 0, 1, 1000, 1, 1)
    bytes_ = 8.03e9 * 2 + 131072 * (1000 + 1)
    assert dur == pytest.approx(bytes_ / (3350e9 * 0.85))
    assert energy == pytest.approx(90 * dur + (700 - 90) * dur)


def test_roofline_big_prefill_is_compute_bound():
    m = model(ROOFLINE, "hardware.step_overhead_ms=0")
    n = 8192
    flops = 2 * 8.03e9 * n + 4 * 32 * 32 * 128 * (n * (n + 1) // 2)
    assert prefill(m, n) == pytest.approx(flops / (989e12 * 0.6))


def test_h100_pcie_preset_is_its_data_sheet():
    """The H100 PCIe card: 2,000 GB/s of HBM2e, 756 dense BF16 TFLOP/s, 350 W; its GPUs talk
    over PCIe unless a bridge (`interconnect_gbps`) joins them."""
    from sim.model.costmodel import pcie_only

    m = model(ROOFLINE, 'hardware.preset="h100-pcie"', "hardware.step_overhead_ms=1")
    dur, energy = m.step(0, 0, 0, 1, 1000, 1, 1)
    busy = (8.03e9 * 2 + 131072 * 1001) / (2000e9 * 0.85)
    assert dur == pytest.approx(busy + 1e-3)
    assert energy == pytest.approx(50 * dur + (350 - 50) * busy)  # idle draw over the whole step
    n = 8192
    flops = 2 * 8.03e9 * n + 4 * 32 * 32 * 128 * (n * (n + 1) // 2)
    assert prefill(m, n) == pytest.approx(flops / (756e12 * 0.6) + 1e-3)
    # the kernel model: FP8 weights on its FP8 tensor cores, at the dense 1,513 TFLOP/s
    fp8 = model('hardware.preset="h100-pcie"', 'model.quantization="fp8"')
    e = load_scenario("chat").engine
    assert fp8._blk_c == pytest.approx(2 * fp8.shape.p_blocks / (1513e12 * e.fp8_gemm_efficiency))
    hw = load_scenario("chat", ['hardware.preset="h100-pcie"']).hardware
    assert (hw.memory_gb, hw.int8_tops, hw.fp4_tflops, hw.sm_count) == (80, 1513, 0, 114)
    assert pcie_only(hw)
    assert not pcie_only(load_scenario("chat", ['hardware.preset="h100-pcie"',
                                                "hardware.interconnect_gbps=300"]).hardware)


def test_roofline_tensor_parallel_divides_work_and_adds_communication():
    tp1 = model(ROOFLINE, "model.preset=\"llama-3.1-70b\"", "kv.num_blocks=1000")
    tp4 = model(ROOFLINE, "model.preset=\"llama-3.1-70b\"", "model.tensor_parallel=4")
    assert tp4._comm == pytest.approx(2 * 80 * 2 * 0.75 * 8192 * 2 / 450e9)
    d1, d4 = decode(tp1, 64, 500), decode(tp4, 64, 500)
    assert d4 < d1 / 2  # weights and KV are read four ways in parallel
    assert d4 > (d1 - tp1.overhead) / 4 + tp4.overhead  # ...but the all-reduces cost time


# --- the per-kernel model ----------------------------------------------------------------------
def test_batch_one_decode_streams_the_weights_once():
    m = model(*BARE)
    d = decode(m, 1, 100)
    # the transformer blocks and the LM head, not the embedding table (one row of it)
    weights = (8.03e9 - 128256 * 4096) * 2
    assert d == pytest.approx(weights / (3350e9 * 0.85), rel=0.03)
    assert d > weights / (3350e9 * 0.85)


def test_gemm_efficiency_grows_with_the_tokens_in_a_step():
    m = model(*BARE)
    e = load_scenario("chat").engine

    def linear(n):  # a chunk without attention work and without the LM head
        return m.step(n, 0, 0, 0, 0, 1, 0)[0]

    per_token = [linear(n) / n for n in (16, 128, 512, 2048, 8192)]
    assert all(a > b for a, b in zip(per_token, per_token[1:]))
    # at 8k tokens the linear layers run near their compute roofline, 2 P / (F e_g)
    roof = 2 * (8.03e9 - 2 * 128256 * 4096) / (989e12 * e.gemm_efficiency)
    assert roof < per_token[-1] < 1.3 * roof
    # where the compute and memory rooflines meet, the step is 1.4x the larger of them
    ridge = (8.03e9 - 2 * 128256 * 4096) * 2 / (3350e9 * e.bandwidth_efficiency) / roof
    assert linear(int(ridge)) > 1.35 * max(roof * int(ridge), roof * ridge)


def test_tile_utilisation_counts_whole_waves_of_tiles():
    # 8,192 columns are 64 tiles of 128: 2 rows of tiles (256 tokens) fill 128 of 132 SMs in
    # one wave; 264 tokens take a third row, 192 tiles, two waves
    assert tile_utilisation(256, 8192, 132) == 256 * 8192 / (132 * 128 * 128)
    assert tile_utilisation(264, 8192, 132) == 264 * 8192 / (2 * 132 * 128 * 128)
    # a partial tile is padded: 1 token costs a whole row of tiles
    assert tile_utilisation(1, 128, 1) == 1 / 128
    assert tile_utilisation(128 * 132, 128, 132) == 1.0


def test_the_wave_factor_slows_a_step_that_starts_a_new_wave():
    bare = model(*BARE)
    flat = model(*BARE, "engine.gemm_wave_exposure=0")
    # a GPU given by its sizes (an H100's) without its SMs
    none = model(*BARE, 'hardware.preset=""', "hardware.memory_gb=80",
                 "hardware.mem_bandwidth_gbps=3350", "hardware.peak_tflops=989",
                 "hardware.tdp_w=700", "hardware.idle_w=90", "hardware.pcie_gbps=64")

    def linear(m, n):
        return m.step(n, 0, 0, 0, 0, 1, 0)[0]

    assert bare.wave_factor(0) == flat.wave_factor(256) == none.wave_factor(256) == 1.0
    assert linear(flat, 300) == linear(none, 300)
    # Llama 3.1 8B on an H100: 264 tokens put a third row of tiles on every projection, most
    # of them past one wave of 132 SMs
    assert bare.wave_factor(264) > bare.wave_factor(256) >= 1.0
    assert linear(bare, 264) / linear(flat, 264) > linear(bare, 256) / linear(flat, 256)
    for n in (1, 17, 256, 1000, 4096, 8192, 100_000):
        assert bare.wave_factor(n) >= 1.0 and linear(bare, n) >= linear(flat, n)
    # the GPU's SMs, from its data sheet
    assert model('hardware.preset="a100-80gb"')._wave_sms == 108


def test_the_wave_exposure_sits_where_measured_gemm_times_put_it():
    """Vidur's profiles of vLLM's linear layers (github.com/microsoft/vidur,
    data/profiling/compute, MIT licence; a few of their series in vidur_gemm_times.csv: one
    projection of one model on one GPU from 256 to 1,536 tokens): each series' times against
    its FLOPs over the tiles' utilisation to the power x, one scale fitted per series. The
    bundled exposure explains them better than none (x = 0) and than every partial wave
    kept whole (x = 1)."""
    import csv
    from pathlib import Path
    from statistics import median

    series: dict = {}
    with open(Path(__file__).with_name("vidur_gemm_times.csv")) as f:
        for r in csv.DictReader(f):
            series.setdefault((r["gpu"], r["model"], r["tp"], r["projection"]), []).append(
                (int(r["tokens"]), int(r["n"]), int(r["k"]), int(r["sm_count"]), float(r["ms"])))

    def error(x):
        total = 0.0
        for rows in series.values():
            logs = [math.log(ms / (t * n * k * tile_utilisation(t, n, sms) ** -x))
                    for t, n, k, sms, ms in rows]
            mid = median(logs)
            total += median(abs(v - mid) for v in logs)
        return total

    assert len(series) == 4
    assert error(WAVE_EXPOSURE) < error(0.0) and error(WAVE_EXPOSURE) < error(1.0)


def test_lm_head_runs_only_for_sampling_rows():
    m = model(*BARE)
    full = prefill(m, 512, sampled=1)
    partial = prefill(m, 512, sampled=0)  # a chunk that does not reach the prompt's end
    e = load_scenario("chat").engine.bandwidth_efficiency
    head = 128256 * 4096 * 2 / (3350e9 * e)
    assert full - partial == pytest.approx(head, rel=0.1)


def test_prefill_attention_grows_with_the_context_and_decode_attention_with_the_cache():
    m = model(*BARE)
    assert prefill(m, 512, cached=16000) > prefill(m, 512, cached=0) * 1.2
    assert decode(m, 64, 8000) > 2 * decode(m, 64, 500)


def test_gqa_kernels_that_do_not_share_kv_read_it_per_query_head():
    shared = model(*BARE)
    per_head = model(*BARE, "engine.gqa_shared_kv=false")
    kv = decode(shared, 64, 4000) - decode(shared, 64, 0)
    kv_per_head = decode(per_head, 64, 4000) - decode(per_head, 64, 0)
    assert kv_per_head == pytest.approx(4 * kv, rel=0.05)  # 32 heads over 8 KV heads
    # Re-reads that hit in L2 are not charged: a fraction r of the 3 re-reads reaches HBM.
    for r in (0.0, 0.5):
        m = model(*BARE, "engine.gqa_shared_kv=false", f"engine.gqa_reread={r}")
        assert decode(m, 64, 4000) - decode(m, 64, 0) == pytest.approx((1 + 3 * r) * kv,
                                                                         rel=0.05)
    # (a K/V-sharing engine ignores it)
    assert decode(model(*BARE, "engine.gqa_reread=0.2"), 64, 4000) == decode(shared, 64, 4000)


def test_heads_smaller_than_the_shared_kv_kernels_take_read_kv_per_query_head():
    """TensorRT-LLM 0.9 built its XQA kernels for heads of 128 and 256 only: a model
    with heads of 64 decodes with the per-query-head kernel, the same model with heads of 128
    (the same K/V bytes: half the KV heads' count would change them, so the head count halves
    with the size) keeps the shared reads."""
    small = ("model.head_dim=64", "model.num_heads=64", "model.num_kv_heads=16")
    kv = {}
    for name, shape in (("64", small), ("128", ())):
        for limit in (0, 128, 256):
            m = model(*BARE, *shape, "engine.gqa_reread=0.5",
                      f"engine.gqa_shared_kv_min_head_dim={limit}")
            kv[name, limit] = decode(m, 64, 4000) - decode(m, 64, 0)
    assert kv["64", 0] == pytest.approx(kv["128", 0], rel=0.01)  # the same bytes, shared
    assert kv["64", 128] == pytest.approx((1 + 3 * 0.5) * kv["64", 0], rel=0.05)
    assert kv["128", 128] == kv["128", 0]
    assert kv["128", 256] == pytest.approx(kv["64", 128], rel=0.05)
    # the profiles of the releases that had those kernels (0.9's, NIM 1.0's): only they set
    # the limits
    from sim.model.presets import ENGINES
    for key, value in (("gqa_shared_kv_min_head_dim", 128), ("gqa_shared_kv_group", 8)):
        assert {n: e[key] for n, e in ENGINES.items() if e[key]} == {"tensorrt-llm-0.9": value,
                                                                      "nim": value}


def test_gqa_groups_the_shared_kv_kernels_are_not_built_for_read_kv_per_query_head():
    """TensorRT-LLM 0.9's XQA kernels took groups of eight query heads per K/V head (Llama 2
    70B's) alone: Llama 3.1 8B's groups of four read K/V per query head under that limit, its
    70B's groups of eight do not."""
    def kv(*o):
        m = model(*BARE, "engine.gqa_reread=0.5", *o)
        return decode(m, 64, 4000) - decode(m, 64, 0)
    eight = ('model.preset="llama-3.1-70b"', "model.tensor_parallel=8")
    assert kv("engine.gqa_shared_kv_group=4") == kv("engine.gqa_shared_kv_group=0")
    assert kv("engine.gqa_shared_kv_group=8") == pytest.approx(
        (1 + 3 * 0.5) * kv("engine.gqa_shared_kv_group=0"), rel=0.05)
    assert kv(*eight, "engine.gqa_shared_kv_group=8") == kv(*eight, "engine.gqa_shared_kv_group=0")
    assert kv(*eight, "engine.gqa_shared_kv_group=4") == pytest.approx(
        (1 + 7 * 0.5) * kv(*eight, "engine.gqa_shared_kv_group=0"), rel=0.05)


def test_tensor_parallel_all_reduce_takes_the_faster_of_one_shot_and_ring():
    """Two all-reduces per layer (one where attention and MLP run side by side), each the
    faster of the engine's one-shot kernel (its latency plus (tp - 1) times the bytes: every GPU
    reads its peers' buffers) and a ring (NCCL's latency, or two one-shot latencies for the
    engine's two-shot kernel, plus 2 (tp - 1) / tp times the bytes): small messages take the
    one-shot, large ones the ring."""
    base = ("model.preset=\"llama-3.1-70b\"", "model.tensor_parallel=4", *BARE,
            "engine.allreduce_efficiency=0.7")
    custom = model(*base, "engine.custom_allreduce_us=6", "engine.allreduce_latency_us=18")
    nccl = model(*base, "engine.custom_allreduce_us=0", "engine.allreduce_latency_us=18")
    link, row = 450e9 * 0.7, 8192 * 2
    # decode, 8 rows (128 KB): the one-shot at 6 us against NCCL's 18
    one_shot = 6e-6 + 3 * 8 * row / link
    ring = 18e-6 + 1.5 * 8 * row / link
    assert decode(nccl, 8, 100) - decode(custom, 8, 100) == pytest.approx(160 * (ring - one_shot))
    # a 4096-token prefill (64 MB): twice the one-shot's bytes lose; the two-shot's 12 us
    # beat NCCL's 18 on the same ring bytes
    assert prefill(nccl, 4096) - prefill(custom, 4096) == pytest.approx(160 * (18e-6 - 12e-6))
    # the bytes grow with the tokens, at the link's bandwidth times the efficiency
    slow = model(*base, "engine.custom_allreduce_us=0", "engine.allreduce_latency_us=0",
                 "engine.allreduce_efficiency=0.1")
    fast = model(*base, "engine.custom_allreduce_us=0", "engine.allreduce_latency_us=0",
                 "engine.allreduce_efficiency=1")
    per_call = 1.5 * 4096 * 8192 * 2 / 450e9
    assert prefill(slow, 4096) - prefill(fast, 4096) == pytest.approx(
        2 * 80 * (per_call / 0.1 - per_call))
    one = model("model.preset=\"llama-3.1-70b\"", "kv.num_blocks=100", *BARE,
                "engine.allreduce_latency_us=50")
    assert (one._ar_a0, one._ar_a1, one._ar_b0, one._ar_b1) == (0.0,) * 4  # one GPU: none
    # attention and MLP side by side (Falcon, GPT-J): one all-reduce of their sum a layer
    side = model(*base, "engine.custom_allreduce_us=6", "engine.allreduce_latency_us=18",
                 "model.parallel_attention=true")
    s = load_scenario("chat", []).engine.allreduce_sync_us * 1e-6  # (each call's own)
    assert decode(custom, 8, 100) - decode(side, 8, 100) == pytest.approx(80 * (s + one_shot))
    assert (side._ar_a0, side._ar_a1, side._ar_b0, side._ar_b1) == pytest.approx(
        tuple(x / 2 for x in (custom._ar_a0, custom._ar_a1, custom._ar_b0, custom._ar_b1)))
    # the teaching roofline's all-reduce bytes as well
    roof = [model(ROOFLINE, "model.preset=\"llama-3.1-70b\"", "model.tensor_parallel=4",
                  f"model.parallel_attention={flag}")._comm for flag in ("false", "true")]
    assert roof[1] == pytest.approx(roof[0] / 2) and roof[0] > 0


def test_nvlink_sharp_takes_large_all_reduces_where_the_engine_lets_nccl():
    """On switches that reduce in the network (`hardware.nvlink_sharp`: H100 SXM, H200, B200)
    an engine that leaves NCCL its NVLS (`engine.allreduce_nvls`: TensorRT-LLM) pays a large
    all-reduce as its third line: its latency, and each GPU's bytes once at `nvls_efficiency`
    of the link, where the ring moves 2 (tp - 1) / tp times them. A small one keeps the
    one-shot; an A100's switches, or an engine that turns NVLS off, keep the ring."""
    base = ("model.preset=\"llama-3.1-70b\"", "model.tensor_parallel=8", *BARE,
            "engine.allreduce_efficiency=0.7", "engine.custom_allreduce_us=6",
            "engine.allreduce_latency_us=18", "engine.allreduce_sync_us=0",
            "engine.nvls_latency_us=71", "engine.nvls_efficiency=0.61")
    on = model(*base, "engine.allreduce_nvls=true")
    off = model(*base, "engine.allreduce_nvls=false")
    a100 = [model(*base, f"engine.allreduce_nvls={flag}", "hardware.preset=\"a100-80gb\"")
            for flag in ("true", "false")]
    row = 8192 * 2
    # an 8,192-token prefill (128 MiB a call): 71 us and the bytes once at 0.61 of 450 GB/s,
    # against the two-shot's 12 us and 1.75 times the bytes at 0.7
    nvls = 71e-6 + 8192 * row / (450e9 * 0.61)
    ring = 12e-6 + 1.75 * 8192 * row / (450e9 * 0.7)
    assert nvls < ring
    assert prefill(off, 8192) - prefill(on, 8192) == pytest.approx(160 * (ring - nvls))
    assert prefill(a100[0], 8192) == prefill(a100[1], 8192)
    # a decode of 8 rows: the one-shot, whichever
    assert decode(on, 8, 100) == decode(off, 8, 100)
    # below the crossing (here about 1,900 tokens at TP 8) the ring stays
    assert prefill(on, 1024) == prefill(off, 1024)
    # which presets have it, and which engines let NCCL use it
    assert [h for h, v in presets.HARDWARE.items() if v["nvlink_sharp"]] == [
        "h100-sxm", "h200", "gh200", "b200"]
    assert {n for n, e in presets.ENGINES.items() if e.get("allreduce_nvls")} == {
        n for n in presets.ENGINES if n.startswith(("tensorrt-llm", "nim"))}
    # a session log from before the switch existed replays without it
    from sim.inputs.scenario import ENGINE_KEYS_ADDED
    assert ENGINE_KEYS_ADDED["allreduce_nvls"] is False


def test_gpus_linked_by_pcie_only_all_reduce_with_nccl_at_its_pcie_latency():
    """An L40S has no NVLink (its GPU link is no faster than PCIe 5.0): no one-shot kernel,
    NCCL for every size at `allreduce_latency_pcie_us` and `allreduce_efficiency_pcie` of the
    link; an H100's keep the one-shot and `allreduce_efficiency`. The same L40S with the PCIe
    latency at 0 is costed as NVLink GPUs were (an older log's replay), and with the PCIe
    efficiency at 0 its bytes move at `allreduce_efficiency` (a log from before it existed)."""
    from sim.model.costmodel import pcie_only

    base = ("model.preset=\"llama-3.1-70b\"", "model.tensor_parallel=4", *BARE,
            "engine.allreduce_efficiency=0.7", "engine.custom_allreduce_us=6",
            "engine.allreduce_latency_us=18", "engine.allreduce_sync_us=0",
            "engine.allreduce_efficiency_pcie=0.5")
    l40s = ("hardware.preset=\"l40s\"", "model.dtype_bytes=1")
    pcie = model(*base, *l40s, "engine.allreduce_latency_pcie_us=45")
    as_nvlink = model(*base, *l40s, "engine.allreduce_latency_pcie_us=0")
    pcie_at_nvlink_share = model(*base, *l40s, "engine.allreduce_latency_pcie_us=45",
                                 "engine.allreduce_efficiency_pcie=0")
    assert pcie_only(load_scenario("chat", list(l40s)).hardware)
    assert not pcie_only(load_scenario("chat", []).hardware)  # an H100: NVLink
    # a GH200's host link (NVLink-C2C) is as fast as its GPU link: still NVLink between GPUs
    assert not pcie_only(load_scenario("chat", ['hardware.preset="gh200"']).hardware)
    link, pcie_link, row = 32e9 * 0.7, 32e9 * 0.5, 8192 * 2
    for rows in (1, 8):  # one row: the one-shot was the faster; eight: the two-shot
        ring = 1.5 * rows * row / link
        nvlink = min(6e-6 + 3 * rows * row / link, 12e-6 + ring)
        assert decode(pcie, rows, 100) - decode(as_nvlink, rows, 100) == pytest.approx(
            160 * (45e-6 + 1.5 * rows * row / pcie_link - nvlink))
        assert decode(pcie_at_nvlink_share, rows, 100) - decode(as_nvlink, rows, 100) == \
            pytest.approx(160 * (45e-6 + ring - nvlink))
    # every size on the ring: a prefill's all-reduces are NCCL's at 45 us, not the two-shot's
    # 12, and their bytes at PCIe's share of the link
    ring, pcie_ring = 1.5 * 4096 * row / link, 1.5 * 4096 * row / pcie_link
    assert prefill(pcie, 4096) - prefill(as_nvlink, 4096) == pytest.approx(
        160 * (45e-6 + pcie_ring - 12e-6 - ring))
    # vLLM's one-shot kernel still runs on two PCIe GPUs (over their peer-to-peer link), not on
    # four; TensorRT-LLM's on none
    for gpus, tp, kept in ((2, 2, True), (2, 4, False), (0, 2, False)):
        m = model(*base, *l40s, f"model.tensor_parallel={tp}",
                  "engine.allreduce_latency_pcie_us=45",
                  f"engine.custom_allreduce_pcie_gpus={gpus}")
        assert (m._custom_us == 6.0) == kept and m._nccl_us == 45.0
    from sim.model.presets import ENGINES
    assert {n: e["custom_allreduce_pcie_gpus"] for n, e in ENGINES.items()
            if n.startswith(("vllm", "sglang", "tensorrt", "nim"))} == {
        n: 0 if n.startswith(("tensorrt", "nim")) else 2 for n in ENGINES
        if n.startswith(("vllm", "sglang", "tensorrt", "nim"))}
    # the H100's all-reduces do not see the PCIe figure
    h100 = [model(*base, f"engine.allreduce_latency_pcie_us={a}") for a in (0, 45, 90)]
    assert len({decode(m, 8, 100) for m in h100}) == 1


def test_fewer_kv_heads_than_gpus_replicates_them_in_the_pool_and_its_moves():
    """Llama-3.1-70B has 8 KV heads: on 16 GPUs each holds one (replicated), not half of one,
    so its pool is what one head's blocks fill of each GPU's free memory; swaps and hand-offs
    move that much per GPU, and decode reads it."""
    def pool(tp, *o):
        sc = load_scenario("chat", ["model.preset=\"llama-3.1-70b\"", "hardware.preset=\"h100-sxm\"",
                                    f"model.tensor_parallel={tp}", *o])
        return sc.kv.num_blocks, CostModel(sc)
    per_gpu_block = 2 * 80 * 1 * 128 * 2 * 16  # one KV head of 128, bf16, 16-token blocks
    for tp in (8, 16, 32):
        blocks, cm = pool(tp)
        assert cm.kv_bytes_per_block_gpu() == per_gpu_block
        free = 80e9 * 0.9 - 70.6e9 * 2 / tp - cm._reserve
        assert blocks == int(free // per_gpu_block)
        assert cm.swap_time(1000) == pytest.approx(1000 * per_gpu_block / cm.pcie_bytes_per_s)
    assert pool(16)[1]._kv == pool(8)[1]._kv  # decode reads one head's bytes per token
    # Two KV heads per GPU at tp=4: half the heads of the 8, the pool's blocks twice as large.
    assert pool(4)[1].kv_bytes_per_block_gpu() == 2 * per_gpu_block


@pytest.mark.parametrize("override, field", [
    ("model.tensor_parallel=3", "tensor_parallel = 3: must divide model.num_heads = 32"),
    ("model.tensor_parallel=5", "tensor_parallel = 5: must divide model.num_heads"),
    ("model.num_params=1e9", "model.num_params = 1e+09: no more than"),
])
def test_shapes_tensor_parallel_cannot_split_and_too_few_parameters_are_refused(override, field):
    with pytest.raises(ScenarioError, match=re.escape(field)):
        load_scenario("chat", [override])


def test_kv_heads_must_split_evenly_over_the_gpus_or_be_replicated_whole():
    sizes = ['model.preset=""', "model.num_params=10e9", "model.num_layers=32",
             "model.hidden_size=3072", "model.num_heads=24", "model.vocab_size=32000",
             "model.head_dim=128", "model.max_model_len=8192"]
    with pytest.raises(ScenarioError, match="tensor_parallel = 4: must divide model.num_kv_heads = 6"):
        load_scenario("chat", [*sizes, "model.num_kv_heads=6", "model.tensor_parallel=4"])
    load_scenario("chat", [*sizes, "model.num_kv_heads=6", "model.tensor_parallel=3"])
    load_scenario("chat", [*sizes, "model.num_kv_heads=2", "model.tensor_parallel=8"])


def test_tied_embeddings_leave_one_vocab_matrix_out_of_the_blocks():
    """A tied model's num_params holds the vocab x hidden matrix once: the rest, one matrix
    more than an untied model's, goes through every token."""
    base = ("engine.cpu_base_us=0", "engine.cpu_per_seq_us=0", "engine.layer_overhead_us=0")
    untied = model(*base)
    tied = model(*base, "model.tie_word_embeddings=true")
    v_h = 128256 * 4096
    assert tied._blk_m / untied._blk_m == pytest.approx((8.03e9 - v_h) / (8.03e9 - 2 * v_h))
    assert tied._blk_c / untied._blk_c == pytest.approx((8.03e9 - v_h) / (8.03e9 - 2 * v_h))
    assert tied._head_m == untied._head_m  # the LM head still reads the matrix
    assert decode(tied, 1, 100) > decode(untied, 1, 100)



def test_cpu_time_adds_to_the_step_unless_it_overlaps():
    serial = model("engine.cpu_base_us=2000", "engine.cpu_per_seq_us=50",
                   "engine.cpu_overlap=false")
    overlap = model("engine.cpu_base_us=2000", "engine.cpu_per_seq_us=50",
                    "engine.cpu_overlap=true")
    bare = model("engine.cpu_base_us=0", "engine.cpu_per_seq_us=0")
    for batch in (1, 32, 256):
        gpu = decode(bare, batch, 300)
        cpu = 2000e-6 + 50e-6 * batch
        assert decode(serial, batch, 300) == pytest.approx(gpu + cpu)
        assert decode(overlap, batch, 300) == pytest.approx(max(gpu, cpu))


def test_weights_kv_and_activations_have_their_own_dtypes():
    bf16 = model(*BARE)
    fp8 = model(*BARE, "model.dtype_bytes=1")
    fp8_kv16 = model(*BARE, "model.dtype_bytes=1", "model.kv_dtype_bytes=2")
    # batch-1 decode streams the weights: FP8 weights halve it
    assert decode(fp8, 1, 10) == pytest.approx(decode(bf16, 1, 10) / 2, rel=0.05)
    # the K/V read follows kv_dtype_bytes, not the weights'
    kv = decode(bf16, 64, 8000) - decode(bf16, 64, 0)
    assert decode(fp8_kv16, 64, 8000) - decode(fp8_kv16, 64, 0) == pytest.approx(kv)
    assert decode(fp8, 64, 8000) - decode(fp8, 64, 0) == pytest.approx(kv / 2)
    # FP8 weights run their GEMMs on the FP8 tensor cores (H100: 2x the bf16 peak)
    assert fp8._blk_c < bf16._blk_c
    # activations: the all-reduce bytes (tensor parallel) and the elementwise kernels
    tp = ("model.preset=\"llama-3.1-70b\"", "model.tensor_parallel=4", *BARE)
    assert (prefill(model(*tp, "model.act_dtype_bytes=4"), 4096)
            > prefill(model(*tp, "model.act_dtype_bytes=2"), 4096))


def test_a_mixed_step_pays_prefill_and_decode_attention():
    m = model(*BARE)
    n, c = 256, 2000
    chunk = (n, n * c + n * (n + 1) // 2, c)
    mixed = m.step(*chunk, 100, 100 * 3000, 101, 101)[0]
    only_prefill = m.step(*chunk, 0, 0, 1, 1)[0]
    only_decode = m.step(0, 0, 0, 100, 100 * 3000, 100, 100)[0]
    assert mixed > max(only_prefill, only_decode)
    attention = decode(m, 100, 3000) - decode(m, 100, 0)
    assert mixed - m.step(n, chunk[1], c, 100, 0, 101, 101)[0] == pytest.approx(attention,
                                                                               rel=0.05)


def test_engines_differ_in_cpu_and_multi_step():
    from sim.model.presets import ENGINES

    assert ENGINES["vllm-0.6-multistep"]["num_scheduler_steps"] == 10
    assert not ENGINES["tensorrt-llm-0.6"]["gqa_shared_kv"]
    assert ENGINES["tensorrt-llm"]["gqa_shared_kv"]
    assert ENGINES["sglang"]["cpu_overlap"]


def test_padded_cuda_graphs_run_a_decode_step_at_the_next_captured_size():
    """With `cuda_graph_padding` (TensorRT-LLM's PyTorch backend under trtllm-bench) a
    decode-only step's GEMMs, elementwise work, all-reduces and LM head run at the next captured
    batch size (1, 2, 4, multiples of 8 to 128, powers of two below the batch limit, the limit);
    its attention and host time are its own sequences'. A step with prefill is not padded."""
    from sim.model.costmodel import graph_batch_sizes

    assert graph_batch_sizes(512) == [1, 2, 4, *range(8, 129, 8), 256, 512]
    assert graph_batch_sizes(384) == [1, 2, 4, *range(8, 129, 8), 256, 384]
    assert graph_batch_sizes(100) == [1, 2, 4, *range(8, 97, 8), 100]
    base = ('engine.preset="tensorrt-llm-pytorch"', "scheduler.max_num_seqs=512")
    pad = model(*base, "engine.cuda_graph_padding=true")
    flat = model(*base, "engine.cuda_graph_padding=false")
    assert pad.graph_pad(300) == 212 and pad.graph_pad(512) == 0 and pad.graph_pad(0) == 0
    assert pad.graph_pad(9) == 7 and flat.graph_pad(300) == 0
    # 300 sequences run the 512 graph: the GEMMs and the LM head of 512 rows, the attention
    # and host time of 300
    step = (0, 0, 0, 300, 300 * 1000, 300, 300)
    assert pad.step(*step) != flat.step(*step)
    c = pad._blk_c * pad.wave_factor(512) * 512
    blocks = math.sqrt(c * c + pad._blk_m * pad._blk_m)
    c = flat._blk_c * flat.wave_factor(300) * 300
    assert pad.step(*step)[0] - flat.step(*step)[0] > 0.9 * (
        blocks - math.sqrt(c * c + flat._blk_m * flat._blk_m))
    # a full graph, or a step with a prompt in it, runs as it is
    assert pad.step(0, 0, 0, 512, 512000, 512, 512) == flat.step(0, 0, 0, 512, 512000, 512, 512)
    mixed = (64, 64 * 65 // 2, 0, 300, 300 * 1000, 301, 301)
    assert pad.step(*mixed) == flat.step(*mixed)


ONE_BLOCK = ('engine.preset="nim"', 'hardware.preset="a100-80gb"', "model.tensor_parallel=2",
             *BARE)


def test_decode_without_split_kv_waits_on_one_block_per_sequence():
    """Where the engine's decode kernel gives a sequence's K/V head one thread block
    (`decode_split_kv = false`), a few sequences at long contexts take the block's time, L q
    positions over the SM's clock (q = decode_block_cycles hd / 128), not their bytes' time;
    many sequences at once are back on the memory's bound; no clock, no bound. (Without a limit
    on the blocks an SM runs at once: that wait is the next test's.)"""
    L, hd = 32, 128  # (the chat scenario's Llama 3.1 8B)
    cyc = 17.5
    one = model(*ONE_BLOCK, f"engine.decode_block_cycles={cyc}", "engine.decode_blocks_per_sm=0")
    split = model(*ONE_BLOCK, "engine.decode_split_kv=true")
    per_pos = L * cyc * hd / 128 / 1410e6  # (the A100's 1,410 MHz)
    assert one._kv_occ == pytest.approx(per_pos)
    ctx = 7000
    # one sequence: its block streams all 7,000 positions of every layer (2.8 ms here, about ten
    # times the bytes' time at the memory's rate)
    extra = decode(one, 1, ctx) - decode(split, 1, ctx)
    assert extra == pytest.approx(per_pos * ctx - split._kv_read * ctx, rel=1e-9)
    assert extra > 5 * split._kv_read * ctx
    # four sequences: the blocks run side by side, each on its own sequence
    assert decode(one, 4, ctx) - decode(split, 4, ctx) == pytest.approx(
        per_pos * ctx - split._kv_read * 4 * ctx, rel=1e-9)
    # 256 sequences: the blocks together outrun the memory
    assert decode(one, 256, ctx) == decode(split, 256, ctx)
    # a GPU without a clock in its sheet (the B200's preset): no such bound
    b200 = ('hardware.preset="b200"',)
    assert model(*ONE_BLOCK, *b200)._kv_occ == 0.0
    assert decode(model(*ONE_BLOCK, *b200), 1, ctx) == decode(
        model(*ONE_BLOCK, *b200, "engine.decode_split_kv=true"), 1, ctx)
    # twice the cycles, twice the block's time; a faster clock, less
    two = model(*ONE_BLOCK, f"engine.decode_block_cycles={2 * cyc}",
                "engine.decode_blocks_per_sm=0")
    assert two._kv_occ == pytest.approx(2 * one._kv_occ)
    h100 = model(*ONE_BLOCK, 'hardware.preset="h100-sxm"', f"engine.decode_block_cycles={cyc}")
    assert h100._kv_occ == pytest.approx(one._kv_occ * 1410 / 1980)


def test_decode_blocks_beyond_what_the_sms_run_at_once_wait_for_one():
    """The one-block kernel's blocks (one per sequence and K/V head, or per query head where the
    engine's K/V-sharing kernel is not built for the model's group) beyond `sm_count` x
    `decode_blocks_per_sm` wait for an SM: a step's attention takes at least all its blocks'
    positions at the block's rate over the SMs. One sequence is not held back by it; many
    sequences at long contexts are, and more where blocks go per query head."""
    # NIM's profile keeps its shared-K/V kernel to groups of eight (Llama 3.1 8B's is four): a
    # block per query head, 32 / 2 = 16 on each of the two A100s' 108 SMs per sequence
    m = model(*ONE_BLOCK)
    free = model(*ONE_BLOCK, "engine.decode_blocks_per_sm=0")
    assert load_scenario("chat", list(ONE_BLOCK)).engine.decode_blocks_per_sm == 1.0
    assert free._kv_occ_sm == 0.0
    assert m._kv_occ_sm == pytest.approx(m._kv_occ * 16 / 108)
    ctx = 7000
    assert decode(m, 1, ctx) == decode(free, 1, ctx)
    # 64 sequences: 1,024 blocks, 9.5 times what the SMs run at once
    b = 64
    kd = b * ctx
    waited = m._kv_occ_sm * kd
    assert waited > max(free._kv_read * kd, free._kv_occ * ctx) > free._attn_f * (kd + b)
    assert decode(m, b, ctx) - decode(free, b, ctx) == pytest.approx(
        waited - max(free._kv_read * kd, free._kv_occ * ctx), rel=1e-9)
    # a block per K/V head where the kernel shares K/V for this group: a quarter of the blocks
    shared = model(*ONE_BLOCK, "engine.gqa_shared_kv_group=4")
    assert shared._kv_occ_sm == pytest.approx(m._kv_occ_sm / 4)
    # two blocks to an SM at once: half the wait; split-K decode: none
    assert model(*ONE_BLOCK, "engine.decode_blocks_per_sm=2")._kv_occ_sm == pytest.approx(
        m._kv_occ_sm / 2)
    assert model(*ONE_BLOCK, "engine.decode_split_kv=true")._kv_occ_sm == 0.0


def test_fp8_context_attention_runs_prefill_attention_on_fp8_tensor_cores():
    """With an FP8 cache, an engine whose prefill attention runs in FP8 (TensorRT-LLM's C++
    runtime builds of FP8 checkpoints) costs its FLOPs at fp8_tflops; decode attention, a
    16-bit cache or a GPU without FP8 tensor cores keep the 16-bit rate."""
    from sim.model.presets import ENGINES

    base = ('engine.preset="tensorrt-llm"', *BARE)
    fp8 = ("model.kv_dtype_bytes=1",)
    on = model(*base, *fp8)
    off = model(*base, *fp8, "engine.fp8_context_attention=false")
    assert on._attn_p == pytest.approx(off._attn_p * 989.0 / 1979.0)  # (the H100's peaks)
    assert on._attn_f == off._attn_f
    # a long prompt's step: only its attention's compute side is faster
    n = 20000
    step = (n, n * (n + 1) // 2, 0, 0, 0, 1, 1)
    assert off.step(*step)[0] - on.step(*step)[0] == pytest.approx(
        (off._attn_p - on._attn_p) * (n * (n + 1) // 2), rel=1e-9)
    assert model(*base)._attn_p == model(*base, "engine.fp8_context_attention=false")._attn_p
    a100 = ('hardware.preset="a100-80gb"', *fp8)
    assert model(*base, *a100)._attn_p == model(*base, *a100,
                                                "engine.fp8_context_attention=false")._attn_p
    assert [k for k, e in ENGINES.items() if e["fp8_context_attention"]] == ["tensorrt-llm"]


def test_only_tensorrt_llm_before_its_multi_block_default_decodes_one_block_per_sequence():
    """TensorRT-LLM built without multi-block mode (0.6, 0.9, the NIM the sizing course ran)
    gives a sequence one block; the executor's runtime since, and vLLM and SGLang, split it."""
    from sim.model.presets import ENGINES

    assert {k for k, e in ENGINES.items() if not e["decode_split_kv"]} == {
        "tensorrt-llm-0.6", "tensorrt-llm-0.9", "nim"}


def test_tensorrt_llm_profiles_share_kernels_and_differ_in_host_time():
    """Served by NIM (`nim`): each sequence's output handled in the engine's loop, the GPU
    waiting (serial host time per step and per sequence); the PyTorch backend
    (`tensorrt-llm-pytorch`: trtllm-bench, and trtllm-serve on it): Python's host time per
    sequence overlapped with the GPU (the longer of the two), prompts in chunks (trtllm-bench's
    default; the executor's and trtllm-serve's are off). The kernels are
    `tensorrt-llm`'s; the C++ runtime's (`tensorrt-llm`, `nim`, and 0.6's) launched without CUDA
    graphs (TRT_LAUNCHES), the PyTorch backend's replayed from graphs (the shared fixed cost per
    layer, as vLLM's and SGLang's)."""
    from sim.model.presets import ENGINES, TRT_LAUNCHES, _KERNELS

    trt, cpp, py = ENGINES["tensorrt-llm"], ENGINES["nim"], ENGINES["tensorrt-llm-pytorch"]
    runtime = {*TRT_LAUNCHES, "kv_bandwidth_efficiency"}
    # (and the API server: trtllm-serve's time per chat request, which the same server spends
    # over either TensorRT-LLM backend, against NIM's own server, presets.NIM_FRONTEND; and
    # NIM 1.0's decode attention: one block per sequence, waiting for an SM, and K/V shared
    # only in the shapes of 0.9's XQA kernels, the other groups' re-reads hitting in L2)
    one_block = {"decode_split_kv", "decode_blocks_per_sm"}
    xqa = {"gqa_shared_kv_group", "gqa_shared_kv_min_head_dim"}
    assert {k for k in cpp if cpp[k] != py[k]} == {"cpu_base_us", "cpu_per_seq_us",
                                                   "cpu_overlap", "chunked_prefill",
                                                   "frontend_chat_request_us", *one_block,
                                                   *xqa, "gqa_reread",
                                                   "frontend_request_us",
                                                   "frontend_prompt_token_us", *runtime}
    assert cpp["gqa_reread"] == 0.0
    assert {k for k in trt if trt[k] != py[k]} == {"cpu_per_seq_us", "chunked_prefill",
                                                   "fp8_context_attention", *runtime}
    # (the padding of its CUDA graphs is modelled, not yet on: its terms were fitted without it)
    assert not any(e["cuda_graph_padding"] for e in ENGINES.values())
    assert py["frontend_chat_request_us"] == trt["frontend_chat_request_us"] > 0
    assert all(trt[k] == cpp[k] == ENGINES["tensorrt-llm-0.6"][k] == v
               for k, v in TRT_LAUNCHES.items())
    old = ENGINES["tensorrt-llm-0.9"]  # XQA for Llama 2 70B's shape only: all else as later
    assert {k for k in old if old[k] != trt[k]} == {*xqa, *one_block, "fp8_context_attention",
                                                    "frontend_chat_request_us"}
    graphs = _KERNELS["layer_overhead_us"]
    assert py["layer_overhead_us"] == ENGINES["vllm-v1"]["layer_overhead_us"] == graphs
    assert graphs < trt["layer_overhead_us"]
    assert py["chunked_prefill"] and not cpp["chunked_prefill"] and not trt["chunked_prefill"]
    assert py["cpu_overlap"] and not cpp["cpu_overlap"]
    assert py["cpu_base_us"] == ENGINES["tensorrt-llm-0.6"]["cpu_base_us"]
    fp8_b200 = ('model.quantization="fp8"', 'hardware.preset="b200"')
    m = model('engine.preset="tensorrt-llm-pytorch"', *fp8_b200)
    b = 1500
    assert decode(m, b, 100) == pytest.approx(m._cpu0 + b * py["cpu_per_seq_us"] * 1e-6)
    gpu = decode(model('engine.preset="nim"', *fp8_b200, "engine.cpu_base_us=0",
                       "engine.cpu_per_seq_us=0"), b, 100)
    served = decode(model('engine.preset="nim"', *fp8_b200), b, 100)
    assert served == pytest.approx(gpu + (cpp["cpu_base_us"] + b * cpp["cpu_per_seq_us"]) * 1e-6)
    assert gpu < decode(m, b, 100) < served


def test_presets_change_speed():
    h100 = decode(model("hardware.preset=\"h100-sxm\""), 32, 1000)
    a100 = decode(model("hardware.preset=\"a100-80gb\""), 32, 1000)
    h200 = decode(model("hardware.preset=\"h200\""), 32, 1000)
    assert h200 < h100 < a100
    assert math.isfinite(h100)


# --- one definition ------------------------------------------------------------------------------
EFFICIENCIES = ["gemm_efficiency", "bandwidth_efficiency", "kv_bandwidth_efficiency",
                "attention_efficiency", "elementwise_efficiency", "allreduce_efficiency",
                "nvls_efficiency"]
MICROSECONDS = ["layer_overhead_us", "allreduce_latency_us", "custom_allreduce_us",
                "allreduce_sync_us", "cpu_base_us", "cpu_per_seq_us", "nvls_latency_us"]


# Mixtures of experts for the tie test: (config, expert_parallel choices), each with a
# fixed pool (they need not fit in the GPU's memory to be timed).
MOE = [("mixtral-8x7b", [1, 2, 8]), ("qwen3-30b-a3b", [1, 2, 8, 16]), ("deepseek-v3", [1, 8, 32]),
       ("llama-4-scout", [1, 16])]


def random_model(rnd, preset: str, tp: int, hw: str, overlap: bool,
                 moe: bool = False) -> CostModel:
    """A cost model whose parameters are random: every mantissa bit (so that a sum taken in
    another order rounds differently somewhere along a run), some overheads zero; with `moe`
    a mixture of experts of random skew and expert parallelism."""
    sets = [f'engine.preset="{preset}"', f"model.tensor_parallel={tp}", f'hardware.preset="{hw}"',
            f"hardware.interconnect_gbps={rnd.uniform(50, 900)!r}"]
    if moe:
        name, eps = rnd.choice(MOE)
        ep = rnd.choice([e for e in eps if e % tp == 0 or tp % e == 0])
        sets += [f'model.config="{name}"', f"model.expert_parallel={ep}", "kv.num_blocks=1000",
                 f"model.expert_skew={0.0 if rnd.random() < 0.3 else rnd.uniform(0, 4)!r}"]
    if preset == "roofline":
        sets += [f"hardware.flops_efficiency={rnd.uniform(0.05, 1)!r}",
                 f"hardware.bandwidth_efficiency={rnd.uniform(0.05, 1)!r}",
                 f"hardware.step_overhead_ms={rnd.uniform(0, 3)!r}"]
    else:
        sets += [f"engine.{k}={rnd.uniform(0.05, 1)!r}" for k in EFFICIENCIES]
        sets += [f"engine.{k}={0.0 if rnd.random() < 0.2 else rnd.uniform(0, 300)!r}"
                 for k in MICROSECONDS]
        sets += [f"engine.cpu_overlap={str(overlap).lower()}",
                 f"engine.gqa_shared_kv={str(rnd.random() < 0.5).lower()}",
                 f"engine.gqa_reread={rnd.random()!r}",
                 f"engine.allreduce_nvls={str(rnd.random() < 0.7).lower()}",
                 f"engine.cuda_graph_padding={str(rnd.random() < 0.5).lower()}",
                 f"engine.decode_split_kv={str(rnd.random() < 0.5).lower()}",
                 f"engine.decode_block_cycles={rnd.uniform(1, 60)!r}",
                 f"engine.decode_blocks_per_sm={rnd.choice([0.0, 1.0, rnd.uniform(0.1, 8)])!r}",
                 f"engine.gqa_shared_kv_group={rnd.choice([0, 4, 8])}",
                 f"hardware.sm_clock_mhz={rnd.uniform(500, 3000)!r}",
                 f"scheduler.max_num_seqs={rnd.choice([1, 7, 128, 200, 384, 512, 1280])}",
                 f"engine.gemm_wave_exposure={0.0 if rnd.random() < 0.2 else rnd.uniform(0, 2)!r}",
                 f"hardware.sm_count={rnd.choice([0, 1, 7, 108, 132, 304])}"]
    return model(*sets)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), preset=st.sampled_from(["vllm-v1", "sglang", "tensorrt-llm-0.6", "roofline"]),
       tp=st.sampled_from([1, 2, 8]), hw=st.sampled_from(["h100-sxm", "a100-80gb", "l40s"]),
       overlap=st.booleans(), moe=st.booleans(),
       rows=st.lists(st.tuples(*[st.integers(0, 10**7)] * 7), min_size=1, max_size=12),
       b=st.integers(1, 512), c0=st.integers(0, 10**7), n=st.integers(1, 300),
       t0=st.floats(0, 1e6), cut=st.floats(0, 2.0) | st.just(math.inf))
def test_every_path_times_a_step_as_step_does(data, preset, tp, hw, overlap, moe, rows, b, c0, n,
                                             t0, cut):
    """`CostModel.step` is the one definition of a step's time; for any parameters and counts
    the other paths give its very bits: `steps` (its source over arrays), `decode_times` (runs
    of decode steps) and, in the compiled build, sim/native/_rows.c's `decode_rows`, which restates
    the decode step in C (a step ends at the clock plus its duration, added in order)."""
    from sim.engine import stepping

    m = random_model(data.draw(st.randoms(use_true_random=False)), preset, tp, hw, overlap, moe)
    # any rows, as arrays (ints, as the engine's runs give them, or floats, as fits give them)
    cols = [np.array(c, dtype=data.draw(st.sampled_from([np.int64, np.float64])))
            for c in zip(*rows)]
    dv, ev = m.steps(*cols)
    assert [(float(d), float(e)) for d, e in zip(dv, ev)] == [m.step(*r) for r in rows]
    # a run of decode steps, one at a time, the clock added step by step
    t_ext = t0 + cut
    t, want = t0, []
    for j in range(n):
        d, en = m.step(0, 0, 0, b, c0 + b * j, b, b)
        t = t + d
        want.append((t, d, en))
        if t >= t_ext:
            break
    assert list(zip(*m.decode_times(b, c0, n, t0, t_ext))) == want
    dv, ev = m.decode_steps(b, c0 + b * np.arange(len(want), dtype=np.int64))
    assert list(zip(dv.tolist(), ev.tolist())) == [w[1:] for w in want]
    if stepping._ROWS is not None and not m.roofline:
        at = data.draw(st.integers(0, 20))
        cols = [np.full(at + n + 3, -1.0) for _ in range(3)]
        pad = m.graph_pad(b)
        k, first, last = stepping._ROWS.decode_rows(*cols, at, n, t0, t_ext, b, c0,
                                                    m.kernel_coefficients,
                                                    m.wave_factor(b + pad), pad)
        assert (k, first, last) == (len(want), want[0][0], want[-1][0])
        assert list(zip(*(c[at:at + k].tolist() for c in cols))) == want  # (==: the same bits)
        assert all((c[:at] == -1).all() and (c[at + k:] == -1).all() for c in cols)


# --- sliding-window layers ---------------------------------------------------------------------
WINDOWED = ("model.sliding_window=4096", "model.sliding_window_layers=24")  # 24 of 32 layers


def test_beyond_window_counts_the_positions_a_window_leaves_out():
    for w in (1, 5, 16):
        for cached in range(0, 40):
            for n in range(1, 30):
                # query i (1-based) of the chunk sits at position cached + i and attends
                # min(cached + i, w) positions: the rest of its cached + i are left out
                out = sum(cached + i - min(cached + i, w) for i in range(1, n + 1))
                assert beyond_window(cached, n, w) == out, (cached, n, w)


def windowed_step(m, p_tokens, p_cached, d_seqs, d_context, w):
    """`m.step` of one prefill chunk and `d_seqs` decodes of `d_context` each, window `w`."""
    p_att = p_tokens * p_cached + p_tokens * (p_tokens + 1) // 2
    seqs = (p_tokens > 0) + d_seqs
    return m.step(p_tokens, p_att, p_cached, d_seqs, d_seqs * d_context, seqs, seqs,
                  beyond_window(p_cached, p_tokens, w) if p_tokens else 0,
                  beyond_window(p_cached, 1, w) if p_tokens else 0,
                  d_seqs * beyond_window(d_context, 1, w))[0]


def test_a_long_context_decode_reads_only_the_window_on_windowed_layers():
    full, win = model(*BARE), model(*BARE, *WINDOWED)
    b, ctx, w = 32, 60000, 4096
    share = 24 / 32
    # Full layers read the whole cache, windowed ones their w - 1 latest cached tokens.
    read = b * ctx * (1 - share) + b * (w - 1) * share
    t_da = max(full._attn_f * (read + b), full._kv_read * read + full._kv * b)
    t_da_full = max(full._attn_f * (b * ctx + b), full._kv_read * b * ctx + full._kv * b)
    saved = decode(full, b, ctx) - windowed_step(win, 0, 0, b, ctx, w)
    assert saved == pytest.approx(t_da_full - t_da, rel=1e-9)
    assert saved > 0.3 * decode(full, b, ctx)  # (attention dominates such a step)
    # Within the window nothing changes, to the bit.
    assert windowed_step(win, 0, 0, b, w - 1, w) == decode(full, b, w - 1)


def test_a_long_prefill_attends_at_most_the_window_on_windowed_layers():
    full, win = model(*BARE), model(*BARE, *WINDOWED)
    n, cached, w = 8192, 30000, 4096
    share = 24 / 32
    att_full = n * cached + n * (n + 1) // 2
    att_win = sum(min(cached + i, w) for i in range(1, n + 1))  # each query's window
    att = att_full * (1 - share) + att_win * share
    read = cached * (1 - share) + min(cached, w - 1) * share
    t_pa = max(full._attn_p * att, full._kv * (read + n))
    t_pa_full = max(full._attn_p * att_full, full._kv * (cached + n))
    saved = prefill(full, n, cached) - windowed_step(win, n, cached, 0, 0, w)
    assert saved == pytest.approx(t_pa_full - t_pa, rel=1e-9)
    assert saved > 0.3 * prefill(full, n, cached)
    assert windowed_step(win, 100, w - 101, 0, 0, w) == prefill(full, 100, w - 101)


def test_the_roofline_and_models_without_windowed_layers_take_no_window():
    assert model(*WINDOWED).window == 4096
    assert model("model.sliding_window=4096").window == 0  # (no layer uses it)
    assert model(ROOFLINE, *WINDOWED).window == 0
