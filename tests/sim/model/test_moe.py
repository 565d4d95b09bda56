"""Mixtures of experts, multi-head latent attention and quantized weights in the service-time
model (sim/model/costmodel.py: t_moe, t_a2a, MLA's cache and attention, weight formats)."""

import math

import pytest
from hypothesis import given, settings, strategies as st

from sim.errors import ScenarioError
from sim.inputs.scenario import load_scenario
from sim.model.costmodel import CostModel
from sim.model.presets import DEQUANT, QUANTIZATIONS

# Timed, not sized (the weights need not fit); no CPU time (it would hide the GPU's).
FIXED = ("kv.num_blocks=1000", "engine.cpu_base_us=0", "engine.cpu_per_seq_us=0")


def cost(*o):
    return CostModel(load_scenario("chat", [*FIXED, *o]))


def decode(m, batch, context=1000):
    return m.step(0, 0, 0, batch, batch * context, batch, batch)[0]


def moe_time(m, T):
    """t_moe alone: the step with and without the routed experts."""
    with_, _ = m.step(T, T, 0, 0, 0, 1, 0)
    m._moe = False
    without, _ = m.step(T, T, 0, 0, 0, 1, 0)
    m._moe = True
    return with_ - without


# --- mixture of experts ----------------------------------------------------------------------------
def test_a_moe_reads_only_the_experts_its_tokens_use():
    m = cost('model.config="qwen3-30b-a3b"', 'hardware.preset="h100-sxm"')
    e = load_scenario("chat").engine
    stream = 3350e9 * e.bandwidth_efficiency  # (16-bit experts: the dense weights' rate)
    expert_bytes = 48 * 128 * 3 * 2048 * 768 * 2
    # one token: 8 assignments, 8 of the 128 experts read per layer (1 - e^-x, x = -ln(1 - 8/128))
    assert moe_time(m, 1) == pytest.approx(math.hypot(m._moe_c * 8,
                                                      expert_bytes * 8 / 128 / stream), rel=1e-3)
    # a large batch reads them all
    assert moe_time(m, 4096) > 0.999 * expert_bytes / stream


@settings(max_examples=60, deadline=None)
@given(T=st.integers(1, 20000), ep=st.sampled_from([1, 2, 4, 8, 16]),
       s1=st.floats(0, 5), s2=st.floats(0, 5))
def test_more_skew_is_never_faster(T, ep, s1, s2):
    lo, hi = sorted((s1, s2))
    tp = min(ep, 8)
    base = ['model.config="qwen3-30b-a3b"', f"model.tensor_parallel={tp}",
            f"model.expert_parallel={ep}"]
    a, b = cost(*base, f"model.expert_skew={lo!r}"), cost(*base, f"model.expert_skew={hi!r}")
    # (t_moe as a difference of two steps, whose elementwise term grows with the skew too:
    # equal up to the subtraction's rounding)
    assert moe_time(a, T) <= moe_time(b, T) * (1 + 1e-12)


def test_skew_slows_expert_parallel_steps():
    """One expert per GPU: the hot expert's GPU gets (1 + skew) times the mean, and the
    others wait for it."""
    base = ['model.config="qwen3-30b-a3b"', "model.tensor_parallel=8", "model.expert_parallel=128"]
    assert moe_time(cost(*base, "model.expert_skew=1"), 8192) > 1.6 * moe_time(cost(*base), 8192)
    # one GPU holding every expert: the same work however it is spread
    one = ['model.config="qwen3-30b-a3b"']
    assert moe_time(cost(*one, "model.expert_skew=1"), 8192) == moe_time(cost(*one), 8192)


def test_top_k_of_all_experts_is_a_dense_mlp_of_the_same_weights():
    """Every token to every expert: each expert gets all T tokens and every weight is read,
    the work of one dense MLP holding all the experts (whatever the skew), at the grouped
    GEMMs' efficiency (1 here: the dense layers' rates)."""
    for skew in ("0", "3"):
        m = cost('model.preset=""', "model.num_params=10e9", "model.num_layers=32",
                 "model.hidden_size=4096", "model.num_heads=32", "model.num_kv_heads=8",
                 "model.head_dim=128", "model.vocab_size=32000", "model.max_model_len=4096",
                 "model.num_experts=8",
                 "model.experts_per_token=8", "model.moe_intermediate_size=1024",
                 f"model.expert_skew={skew}", "engine.moe_gemm_efficiency=1")
        p = 32 * 8 * 3 * 4096 * 1024
        gemm = 2 * m.shape.p_blocks / m._blk_c  # FLOP/s of the block GEMMs
        stream = 2 * m.shape.p_blocks / m._blk_m  # bytes/s streaming weights
        for T in (1, 7, 300, 5000):
            assert moe_time(m, T) == pytest.approx(math.hypot(2 * p * T / gemm, 2 * p / stream),
                                                   rel=1e-9)


def test_expert_parallel_splits_the_expert_weights_and_adds_the_gather():
    tp1 = cost('model.config="qwen3-235b-a22b"', 'hardware.preset="h200"')
    ep8 = cost('model.config="qwen3-235b-a22b"', 'hardware.preset="h200"',
               "model.expert_parallel=8")
    experts = tp1.shape.p_experts * 2
    assert tp1.weight_bytes_per_gpu() - ep8.weight_bytes_per_gpu() == pytest.approx(
        experts * 7 / 8)
    # dispatch and combine, 2 per MoE layer: each GPU receives the hidden states of the 7 other
    # ranks' tokens (each rank taken to send a batch like this one), then reduce-scatters
    e = load_scenario("chat").engine
    gather = 2 * 94 * 7 * 4096 * 2 / (450e9 * e.moe_comm_efficiency)
    assert ep8._ar_tok - tp1._ar_tok == pytest.approx(gather)
    assert ep8._fixed - tp1._fixed == pytest.approx(2 * 94 * e.allreduce_latency_us * 1e-6)


def test_the_gather_moves_every_token_whatever_its_experts():
    """The MoE layers of data-parallel ranks gather every rank's tokens on every GPU: the bytes
    grow with the ranks, not with the experts a token uses (top-1 Llama 4 moves as much per
    token as top-8 Qwen3 of the same hidden size), and the link's efficiency is the MoE's own."""
    def gather(*o):
        m = cost('model.config="qwen3-235b-a22b"', 'hardware.preset="h200"', *o)
        return m._ar_tok

    assert gather("model.data_parallel=8", "model.experts_per_token=1") == pytest.approx(
        gather("model.data_parallel=8"))
    assert gather("model.data_parallel=8") == pytest.approx(7 / 3 * gather("model.data_parallel=4"))
    slow = gather("model.data_parallel=8", "engine.moe_comm_efficiency=0.2")
    assert slow == pytest.approx(gather("model.data_parallel=8", "engine.moe_comm_efficiency=0.4")
                                 * 2)
    # the tensor-parallel all-reduce is not the MoE's link: its efficiency leaves the gather
    assert gather("model.data_parallel=8", "engine.allreduce_efficiency=0.1") == gather(
        "model.data_parallel=8")


@pytest.mark.parametrize("T", [1, 64, 4096])
def test_grouped_gemm_efficiency_scales_the_experts_time_only(T):
    """t_moe of quantized experts (compute and weight reads both) is the dense rates' time
    over moe_gemm_efficiency; the rest of the step does not move."""
    base = ('model.config="qwen3-30b-a3b"', 'hardware.preset="h100-sxm"',
            'model.quantization="fp8"')
    full, half = cost(*base, "engine.moe_gemm_efficiency=1"), cost(
        *base, "engine.moe_gemm_efficiency=0.5")
    assert moe_time(half, T) == pytest.approx(2 * moe_time(full, T), rel=1e-12)
    full._moe = half._moe = False
    assert full.step(T, T, 0, 0, 0, 1, 0) == half.step(T, T, 0, 0, 0, 1, 0)


def test_sixteen_bit_experts_stream_at_the_dense_rate():
    """16-bit experts are read at the dense weights' rate whatever moe_gemm_efficiency (a
    batch-1 decode of Mixtral reads its two experts as fast as a dense model's weights); their
    compute, and both sides of quantized experts, take it."""
    base = ('model.config="mixtral-8x7b"', 'hardware.preset="h100-sxm"', "model.tensor_parallel=2")
    full, half = cost(*base, "engine.moe_gemm_efficiency=1"), cost(
        *base, "engine.moe_gemm_efficiency=0.5")
    assert half._moe_m == full._moe_m and half._moe_c == pytest.approx(2 * full._moe_c)
    # one token reads its two experts of eight, sharded over two GPUs, at the dense rate
    e = load_scenario("chat").engine
    experts = 32 * 2 * 3 * 4096 * 14336 * 2 / 2
    assert moe_time(half, 1) == pytest.approx(
        math.hypot(half._moe_c * 2, experts / (3350e9 * e.bandwidth_efficiency)), rel=0.02)
    q = [cost(*base, 'model.quantization="fp8"', f"engine.moe_gemm_efficiency={x}")
         for x in (1, 0.5)]
    assert q[1]._moe_m == pytest.approx(2 * q[0]._moe_m)


def test_each_routed_assignment_costs_elementwise_passes_over_its_hidden_state():
    """t_elem per token: the dense terms (the MLP width that of k experts) plus ROUTED_PASSES
    passes of h ab per (token, expert) assignment on the GPU, per MoE layer."""
    from sim.model.costmodel import ROUTED_PASSES

    m = cost('model.config="qwen3-30b-a3b"', 'hardware.preset="h100-sxm"')
    e = load_scenario("chat").engine
    L, h, ab, k = 48, 2048, 2, 8
    dense = L * ab * (8 * h + 3 * m.shape.mlp_width + 2 * (32 + 4) * 128) + 2 * h
    routed = L * k * ROUTED_PASSES * h * ab
    assert m._elem == pytest.approx((dense + routed) / (3350e9 * e.elementwise_efficiency))
    assert ROUTED_PASSES == 4


def test_a_dense_model_pays_no_moe_term():
    """The MoE coefficients change nothing for a dense model."""
    a = cost("model.tensor_parallel=2", "model.data_parallel=4")
    b = cost("model.tensor_parallel=2", "model.data_parallel=4", "engine.moe_gemm_efficiency=0.1",
             "engine.moe_comm_efficiency=0.1")
    assert a.kernel_coefficients == b.kernel_coefficients
    assert a.step(100, 5050, 0, 30, 30000, 31, 31) == b.step(100, 5050, 0, 30, 30000, 31, 31)


@pytest.mark.parametrize("sets, needle", [
    (["model.expert_parallel=3"], "expert_parallel = 3: must divide model.num_experts = 128"),
    (["model.num_experts=12", "model.tensor_parallel=8", "model.expert_parallel=12"],
     "expert_parallel = 12: must divide model.tensor_parallel = 8 or be a multiple"),
    (["model.experts_per_token=200"], "more than model.num_experts = 128"),
    (["model.dense_layers=48"], "dense_layers = 48: must be fewer"),
    (["model.quantization=\"w4a16\"", "model.dtype_bytes=1"], "dtype_bytes = 1: with model.q"),
])
def test_impossible_moe_configs_are_refused(sets, needle):
    with pytest.raises(ScenarioError) as e:
        cost('model.config="qwen3-30b-a3b"', *sets)
    assert needle in str(e.value)


def test_moe_keys_need_experts():
    with pytest.raises(ScenarioError, match="expert_parallel = 2: needs model.num_experts"):
        cost("model.expert_parallel=2", "model.tensor_parallel=2")


# --- multi-head latent attention ------------------------------------------------------------------
def test_mla_caches_the_latent_on_every_gpu():
    m = cost('model.config="deepseek-v3"', "model.tensor_parallel=8", 'hardware.preset="h200"',
             "model.kv_dtype_bytes=1")
    assert m.kv_bytes_per_token == m.kv_bytes_per_token_gpu == 61 * (512 + 64)
    # the K/V read per cached token is the latent's, once for all heads
    assert m._kv_read == m._kv == 61 * 576 / (4800e9 * m_kv_eff(m))


def m_kv_eff(m):
    return load_scenario("chat").engine.kv_bandwidth_efficiency


def test_mla_attention_flops_are_the_absorbed_forms():
    m = cost('model.config="deepseek-v3"', "model.tensor_parallel=8")
    assert m._attn_f / m._attn_p == pytest.approx((2 * 512 + 64) / (2 * 128 + 64))


def test_mla_holds_more_tokens_per_gb_than_its_heads_would():
    mla = cost('model.config="deepseek-v3"', "model.tensor_parallel=8")
    mha = 2 * 61 * 128 / 8 * 128 * 2  # K and V of its 16 heads per GPU, had it no latent
    assert mha / mla.kv_bytes_per_token_gpu > 7


# --- weight formats -----------------------------------------------------------------------------
@pytest.mark.parametrize("q", sorted(QUANTIZATIONS))
def test_quantized_weight_bytes(q):
    m = cost(f'model.quantization="{q}"')
    embed = 2 * 128256 * 4096
    assert m.weight_bytes == pytest.approx(embed * 2 + (8.03e9 - embed) * QUANTIZATIONS[q][0])


def test_w4a16_is_about_a_quarter_of_bf16_and_faster_to_decode():
    bf16, w4 = cost(), cost('model.quantization="w4a16"')
    # a quarter of the blocks' bytes; the embeddings and LM head (13% of Llama-3.1-8B) stay
    assert 0.34 < w4.weight_bytes / bf16.weight_bytes < 0.37
    assert decode(w4, 1) < 0.5 * decode(bf16, 1)


def test_a_format_without_tensor_cores_is_emulated_with_the_unpacking_cost():
    h100 = cost('model.quantization="fp8"')
    a100 = cost('model.quantization="fp8"', 'hardware.preset="a100-80gb"')
    e = load_scenario("chat").engine
    assert h100._blk_c == pytest.approx(2 * h100.shape.p_blocks / (1979e12 * e.fp8_gemm_efficiency))
    assert a100._blk_c == pytest.approx(2 * a100.shape.p_blocks * (1 + DEQUANT)
                                        / (312e12 * e.gemm_efficiency))
    b200 = cost('model.quantization="nvfp4"', 'hardware.preset="b200"')
    h200 = cost('model.quantization="nvfp4"', 'hardware.preset="h200"')
    assert b200._blk_c == pytest.approx(2 * b200.shape.p_blocks / (9000e12 * e.fp4_gemm_efficiency))
    # (no FP4 tensor cores on an H200: unpacked to BF16, as the A100's FP8 above)
    assert h200._blk_c == pytest.approx(2 * h200.shape.p_blocks * (1 + DEQUANT)
                                        / (989e12 * e.gemm_efficiency))


def test_fp4_tensor_cores_have_their_own_efficiency():
    """FP4 weights on FP4 tensor cores run at fp4_gemm_efficiency of fp4_tflops; FP8 weights
    and the BF16 LM head do not move with it."""
    fp4 = ('model.quantization="nvfp4"', 'hardware.preset="b200"')
    lo, hi = cost(*fp4, "engine.fp4_gemm_efficiency=0.2"), cost(*fp4, "engine.fp4_gemm_efficiency=0.4")
    assert lo._blk_c == pytest.approx(2 * hi._blk_c)
    assert lo._head_c == hi._head_c
    fp8 = ('model.quantization="fp8"', 'hardware.preset="b200"')
    assert cost(*fp8, "engine.fp4_gemm_efficiency=0.2")._blk_c == cost(*fp8)._blk_c


def test_dtype_bytes_alone_still_works():
    assert cost("model.dtype_bytes=1").weight_bytes == 8.03e9


def test_data_parallel_ranks_make_the_experts_span_dp_x_tp():
    """data_parallel D x tensor_parallel T: the MoE layers are expert-parallel over D T GPUs
    (by default, or given so), as the explicit expert_parallel would make them."""
    base = ('model.config="qwen3-235b-a22b"', 'hardware.preset="h200"',
            "model.tensor_parallel=2")
    dp4 = cost(*base, "model.data_parallel=4")
    assert dp4.shape.expert_parallel == 8
    same = cost(*base, "model.data_parallel=4", "model.expert_parallel=8")
    assert dp4.weight_bytes_per_gpu() == same.weight_bytes_per_gpu()
    assert dp4.step(0, 0, 0, 64, 64 * 1000, 64, 64) == same.step(0, 0, 0, 64, 64 * 1000, 64, 64)
    one = cost(*base)
    assert one.shape.expert_parallel == 1
    assert dp4.weight_bytes_per_gpu() < one.weight_bytes_per_gpu()


def test_contradictory_expert_parallel_with_data_parallel_is_one_line():
    with pytest.raises(ScenarioError, match=r"expert_parallel = 2: with model.data_parallel = 4 "
                                            r"the experts span .* = 8 GPUs"):
        cost('model.config="qwen3-30b-a3b"', "model.tensor_parallel=2",
             "model.data_parallel=4", "model.expert_parallel=2")
