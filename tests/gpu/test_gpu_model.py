"""The arithmetic that makes the tiny model batch-invariant (see gpu/model.py's docstring)."""

import numpy as np
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
