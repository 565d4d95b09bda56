"""Dense float64 attention over contiguous K/V: the oracle the paged kernels are checked against.

Deliberately the plainest form of the math (full score matrix, max-subtracted softmax), with no
paging, tiling or online softmax, so that it shares no structure with the code it checks.
"""

from __future__ import annotations

import math

import numpy as np


def dense_attention(q, k, v, scale=None, *, q_start=None) -> np.ndarray:
    """Causal grouped-query attention of one sequence, in float64.

    q: [num_q, num_heads, head_dim]; k, v: [num_keys, num_kv_heads, head_dim]. Query i sits at
    position q_start + i (default num_keys - num_q: the queries are the last tokens) and sees keys
    0 .. that position. Query head h reads kv head h // (num_heads // num_kv_heads).

    Returns [num_q, num_heads, head_dim] float64.
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    num_q, num_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    q_start = num_keys - num_q if q_start is None else q_start
    k = np.repeat(k, group, axis=1)  # [num_keys, num_heads, head_dim]
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * scale
    visible = np.arange(num_keys)[None, :] <= (q_start + np.arange(num_q))[:, None]
    scores = np.where(visible[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", weights, v)
