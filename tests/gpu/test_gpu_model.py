"""The arithmetic that makes the tiny model batch-invariant (see gpu/model.py's docstring)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpu
from gpu import numpy_backend
from gpu.model import ACT_BITS, WEIGHT_BITS, ModelConfig, TinyModel, quantize
from gpu.synthetic import random_paged_batch


def test_weights_and_embeddings_are_on_their_grids():
    model = TinyModel(ModelConfig(num_layers=1))
    for w in model.layers[0].values():
        assert np.array_equal(w * 2**WEIGHT_BITS, np.rint(w * 2**WEIGHT_BITS))
    assert np.array_equal(model.embed * 2**ACT_BITS, np.rint(model.embed * 2**ACT_BITS))


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 64), seed=st.integers(0, 2**32 - 1))
def test_projections_are_exact_whatever_the_batch(rows, seed):
    # Grid activations times grid weights: float64 BLAS must give the exact integer result
    # (scaled), for a single row and for the whole batch alike.
    rng = np.random.default_rng(seed)
    model = TinyModel(ModelConfig(num_layers=1, num_heads=8, head_dim=64, seed=seed % 7))
    w = model.layers[0]["wq"]
    h = quantize(np, rng.standard_normal((rows, w.shape[0])) * 3)
    exact = (np.rint(h * 2**ACT_BITS).astype(np.int64) @ np.rint(w * 2**WEIGHT_BITS).astype(np.int64))
    batched = h @ w
    assert np.array_equal(batched * 2**(ACT_BITS + WEIGHT_BITS), exact.astype(np.float64))
    assert np.array_equal(h[-1:] @ w, batched[-1:])


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), length=st.integers(1, 300))
def test_attention_paths_agree_exactly_after_rounding(seed, length):
    # The same query at the same position, through the decode kernel alone, the decode kernel in
    # a ragged batch with small tiles, and the prefill kernel: float64
    # accumulation then rounding to the activation grid leaves no trace of the path taken.
    rng = np.random.default_rng(seed)
    batch = random_paged_batch(rng, [length, 7, 290, 33], block_size=16, num_kv_heads=2, head_dim=32)
    grid = lambda x: quantize(np, x)  # noqa: E731
    batch.k_cache[:] = np.where(np.isnan(batch.k_cache), np.nan, grid(batch.k_cache))
    batch.v_cache[:] = np.where(np.isnan(batch.v_cache), np.nan, grid(batch.v_cache))
    q = grid(rng.standard_normal((4, 4, 32)))
    args = (batch.k_cache, batch.v_cache, batch.block_tables)
    alone = gpu.paged_decode_attention(q[:1], *args[:2], batch.block_tables[:1], batch.seq_lens[:1])
    saved = numpy_backend.TILE_BYTES
    numpy_backend.TILE_BYTES = 1 << 12
    try:
        batched = gpu.paged_decode_attention(q, *args, batch.seq_lens)[:1]
    finally:
        numpy_backend.TILE_BYTES = saved
    q_rows = np.repeat(q[:1], length, axis=0)  # prefill: the chunk is the whole sequence
    prefill = gpu.paged_prefill_attention(q_rows, *args[:2], batch.block_tables[:1],
                                          np.array([0, length], dtype=np.int32), batch.seq_lens[:1])[-1:]
    assert np.array_equal(grid(alone), grid(batched))
    assert np.array_equal(grid(alone), grid(prefill))


def test_logits_are_exact_and_ties_go_to_the_lowest_token():
    model = TinyModel(ModelConfig(num_layers=1))
    hidden = quantize(np, np.random.default_rng(0).standard_normal((3, model.config.d_model)))
    tokens = np.array([1, 2, 3])
    logits = model.logits(hidden, tokens)
    assert np.array_equal(logits * 2**16, np.rint(logits * 2**16))
    # Token 9 gets token 4's embedding, and each row points straight at it: an exact tie for the
    # top logit between 4 and 9, which must go to 4.
    model.embed[9] = model.embed[4]
    hidden = model.embed[tokens] + 2 * model.embed[4]
    logits = model.logits(hidden, tokens)
    assert np.all(logits[:, 4] == logits.max(axis=1)) and np.all(logits[:, 9] == logits[:, 4])
    assert model.next_tokens(hidden, tokens).tolist() == [4, 4, 4]


def moe_model(seed: int = 0, experts: int = 4, k: int = 2) -> TinyModel:
    return TinyModel(ModelConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                 num_experts=experts, experts_per_token=k, seed=seed))


def test_experts_replace_the_mlp_and_every_expert_is_used():
    model = moe_model()
    w = model.layers[0]
    assert w["w1"].shape == (4, 64, 128) and w["router"].shape == (64, 4)
    h = quantize(np, np.random.default_rng(1).standard_normal((200, 64)))
    chosen, gates = model.route(h, w["router"])
    assert sorted(set(chosen.ravel().tolist())) == [0, 1, 2, 3]
    assert np.all(chosen[:, 0] != chosen[:, 1])
    assert np.array_equal(gates * 2**ACT_BITS, np.rint(gates * 2**ACT_BITS))
    # the best expert gets at least the other's gate, and the other counts too
    assert np.all(gates[:, 0] >= gates[:, 1]) and gates[:, 1].mean() > 0.2
    for bad in (dict(num_experts=2, experts_per_token=3), dict(num_experts=2, mlp=False)):
        with pytest.raises(ValueError, match="num_experts"):
            TinyModel(ModelConfig(**bad))


def test_routing_ties_go_to_the_lowest_expert():
    model = moe_model(experts=4, k=2)
    router = np.zeros((64, 4))
    router[:, 1] = router[:, 3] = 2.0**-10  # experts 1 and 3 tie for first, 0 and 2 for third
    h = np.full((3, 64), 2.0**-8)
    chosen, gates = model.route(h, router)
    assert chosen.tolist() == [[1, 3]] * 3
    assert np.array_equal(gates[:, 0], gates[:, 1])


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 40), pick=st.data())
def test_a_tokens_experts_and_output_do_not_depend_on_its_batch(seed, rows, pick):
    # The mixture over a whole batch, over any subset of its rows and over each row alone:
    # the same routing and the same bits, whichever tokens share an expert's group.
    rng = np.random.default_rng(seed)
    model = moe_model(seed=seed % 5, experts=int(rng.integers(2, 7)), k=int(rng.integers(1, 3)))
    w = model.layers[1]
    h = quantize(np, rng.standard_normal((rows, 64)) * 2)
    whole = model._experts(h, w)
    subset = sorted(pick.draw(st.sets(st.integers(0, rows - 1), min_size=1)))
    assert np.array_equal(model._experts(h[subset], w), whole[subset])
    for r in range(rows):
        assert np.array_equal(model._experts(h[r:r + 1], w), whole[r:r + 1])
    assert np.array_equal(whole * 2**ACT_BITS, np.rint(whole * 2**ACT_BITS))
