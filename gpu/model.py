"""A tiny seeded transformer whose greedy tokens do not depend on how a request is batched.

Shape: byte-level embedding (vocabulary 256 by default) plus a position embedding, then per
layer RMSNorm, Q/K/V projections, paged grouped-query attention, an output projection and an
optional ReLU MLP (width 2 * d_model), each added to the residual stream; final RMSNorm and an
LM head tied to the embedding (reading the stream minus the input token's own embedding); the
next token is the argmax, lowest index on ties. Weights are
drawn from `seed`; nothing is downloaded. Prompt token ids come from the caller.

The MoE variant (`num_experts` > 0) replaces each layer's MLP by `num_experts` ReLU MLPs of the
same width and a router: each token's router scores (a projection of its normed stream) pick
its `experts_per_token` best experts (highest score, lowest index on ties), whose outputs are
summed weighted by gates computed from its scores alone (each chosen score less its lowest
score, plus 2**-8, over their sum, rounded to 2**-8: one correctly rounded division per gate). Each
expert runs once over the group of tokens routed to it. A token's routing, gates and expert
outputs are functions of its own row, and every product and sum is exact (point 1 below), so
its result does not depend on which other tokens share the batch or an expert's group.

Why the tokens are batch-invariant
----------------------------------
Float code normally is not: BLAS picks a different kernel (and summation order) for a different
number of rows, a decode step and a prefill sum attention in different orders, padding changes
reduction trees. Rounding noise of ~1e-7 then flips a near-tie argmax now and then. Here:

1. Every weight is a multiple of 2**-10 and every activation is rounded to a multiple of 2**-8
   (`quantize`) before it is multiplied, with magnitudes small enough that every product and
   every partial sum is an integer multiple of 2**-18 below 2**53 * 2**-18. The projections,
   the MLP and the LM head are therefore computed in float64 *exactly*: any summation order,
   any batch size, NumPy or cuBLAS, gives the same bits. RMSNorm is exact sums plus one
   correctly rounded sqrt and divide per row, which no batch shape can change.
2. Attention on the NumPy backend (`gpu.cpu_attention`) is exact too, up to one correctly
   rounded division per output: scores are exact grid products, softmax weights are rounded to
   a fixed grid, and their sums with V are exact in float64. A row's output is a function of
   its sequence's K/V alone: the decode path, the last row of a prefill chunk, any batch and
   any tiling give the same bits, with no exception.
3. Everything downstream of that rounding is exact again (point 1), so identical attention
   outputs give identical tokens.

The stored K/V (rounded to the storage dtype) are the same bits whatever the batch, so a
request re-prefilled after preemption or run in other blocks sees the very same cache. On the
CuPy backend attention accumulates in float32 (fp16/bf16 storage); its tokens match NumPy's
except where float32 noise crosses a rounding midpoint, which the GPU self-check measures.

Attention is not negligible: its output enters the residual stream at the same scale as the
embedding, so a wrong block table changes the hidden state and, soon, the tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .dtypes import Storage
from .cpu_attention import attend_rows, contiguous_kv

ACT_BITS = 8  # activations live on the grid 2**-8
WEIGHT_BITS = 10  # weights on the grid 2**-10
POSITION_PERIOD = 1024  # position p embeds as low[p % 1024] + high[(p // 1024) % 1024]
RMS_EPS = 2.0**-16
# Layer outputs (attention and MLP) enter the residual stream at this gain (a power of two, so
# exact): at 0.5 they weigh about as much as the position embedding, and greedy continuations
# of different prompts differ at ~3 positions in 4 (measured over 5 prompts x 20 tokens).
OUT_GAIN = 0.5

# attend(layer, q [R, H, D], k, v [T, KVH, D], q_rows) -> attention output [R, H, D], all float64;
# q_rows: the R rows' indices among the T tokens, or None when R == T (see TinyModel.forward).
Attend = Callable[[int, object, object, object, object], object]


@dataclass(frozen=True)
class ModelConfig:
    """The tiny model's sizes and seed. d_model = num_heads * head_dim."""

    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 256
    mlp: bool = True
    seed: int = 0
    num_experts: int = 0  # > 0: each layer's MLP is a mixture of this many experts
    experts_per_token: int = 2

    @property
    def d_model(self) -> int:
        return self.num_heads * self.head_dim

    def validate(self) -> None:
        """Raises ValueError naming the first field out of range."""
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"model config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        if self.num_experts and not (self.mlp and 1 <= self.experts_per_token
                                     <= self.num_experts <= 64):
            raise ValueError(f"model config: num_experts {self.num_experts}, experts_per_token "
                             f"{self.experts_per_token}: experts replace the MLP (mlp on), "
                             "1 <= experts_per_token <= num_experts <= 64")
        if self.d_model > 8192:
            # Beyond this the exact-arithmetic bound of the module docstring is no longer certain.
            raise ValueError(f"model config: d_model {self.d_model} > 8192")


def quantize(xp, x, bits: int = ACT_BITS):
    """Rounds `x` to the nearest multiple of 2**-bits (ties to even), as float64."""
    scale = float(2**bits)
    return xp.rint(xp.asarray(x, dtype=np.float64) * scale) / scale


def _rms_norm(xp, x):
    # Sum of squares of grid values is exact; sqrt and divide are correctly rounded per element.
    mean_square = (x * x).sum(axis=-1, keepdims=True) / x.shape[-1]
    return quantize(xp, x / xp.sqrt(mean_square + RMS_EPS))


def _weights(rng: np.random.Generator, shape, std: float, bits: int = WEIGHT_BITS) -> np.ndarray:
    w = quantize(np, rng.standard_normal(shape) * std, bits)
    return np.clip(w, -1.0, 1.0) if bits == WEIGHT_BITS else w


class TinyModel:
    """The model's weights on one array module (`xp`: numpy or cupy) and its forward pass."""

    def __init__(self, config: ModelConfig, xp=np) -> None:
        config.validate()
        self.config = config
        self.xp = xp
        rng = np.random.default_rng(config.seed)
        c = config
        d, qkv = c.d_model, c.num_heads * c.head_dim
        kv = c.num_kv_heads * c.head_dim
        host = {
            "embed": _weights(rng, (c.vocab_size, d), 1.0, ACT_BITS),
            "pos_low": _weights(rng, (POSITION_PERIOD, d), 0.5, ACT_BITS),
            "pos_high": _weights(rng, (POSITION_PERIOD, d), 0.5, ACT_BITS),
        }
        self.layers = []
        for _ in range(c.num_layers):
            layer = {
                "wq": _weights(rng, (d, qkv), 1 / math.sqrt(d)),
                "wk": _weights(rng, (d, kv), 1 / math.sqrt(d)),
                "wv": _weights(rng, (d, kv), 1 / math.sqrt(d)),
                "wo": _weights(rng, (qkv, d), OUT_GAIN / math.sqrt(qkv)),
            }
            if c.mlp and c.num_experts:
                layer["router"] = _weights(rng, (d, c.num_experts), 1 / math.sqrt(d))
                layer["w1"] = _weights(rng, (c.num_experts, d, 2 * d), 1 / math.sqrt(d))
                layer["w2"] = _weights(rng, (c.num_experts, 2 * d, d),
                                       OUT_GAIN / math.sqrt(2 * d))
            elif c.mlp:
                layer["w1"] = _weights(rng, (d, 2 * d), 1 / math.sqrt(d))
                layer["w2"] = _weights(rng, (2 * d, d), OUT_GAIN / math.sqrt(2 * d))
            self.layers.append({name: xp.asarray(w) for name, w in layer.items()})
        self.embed = xp.asarray(host["embed"])
        self.pos_low = xp.asarray(host["pos_low"])
        self.pos_high = xp.asarray(host["pos_high"])

    def forward(self, token_ids, positions, attend: Attend, out_rows=None):
        """Runs all layers over a flat batch of tokens; `attend` does each layer's attention.

        token_ids, positions: [T] integer arrays (on this model's xp). `out_rows` (indices into
        the T tokens, default all): the rows whose result is wanted. The last layer computes
        queries, attention, the output projection and the MLP for those rows only: nothing
        reads the other rows' last-layer results (their K/V, which later steps read, come
        from the layer's input), so skipping them cannot change a token. `attend(layer, q, k,
        v, q_rows)` gets every row's k, v and the queries of rows `q_rows` (None: all rows).
        Returns the residual stream [len(out_rows) or T, d_model] float64, on the 2**-8 grid.
        """
        xp, c = self.xp, self.config
        x = self.embed[token_ids] + self.pos_low[positions % POSITION_PERIOD] \
            + self.pos_high[(positions // POSITION_PERIOD) % POSITION_PERIOD]
        num_tokens = x.shape[0]
        for index, w in enumerate(self.layers):
            h = _rms_norm(xp, x)
            k = quantize(xp, h @ w["wk"]).reshape(num_tokens, c.num_kv_heads, c.head_dim)
            v = quantize(xp, h @ w["wv"]).reshape(num_tokens, c.num_kv_heads, c.head_dim)
            q_rows = out_rows if index == len(self.layers) - 1 else None
            if q_rows is not None:
                x, h = x[q_rows], h[q_rows]
            q = quantize(xp, h @ w["wq"]).reshape(h.shape[0], c.num_heads, c.head_dim)
            a = quantize(xp, attend(index, q, k, v, q_rows)).reshape(h.shape[0], c.num_heads * c.head_dim)
            x = x + quantize(xp, a @ w["wo"])
            if c.mlp and c.num_experts:
                x = x + self._experts(_rms_norm(xp, x), w)
            elif c.mlp:
                u = quantize(xp, xp.maximum(_rms_norm(xp, x) @ w["w1"], 0.0))
                x = x + quantize(xp, u @ w["w2"])
        return x

    def route(self, h, router):
        """Each row's experts [R, k] (best first: highest score, lowest index on ties) and
        gates [R, k] (on the 2**-8 grid), from its router scores alone."""
        xp, k = self.xp, self.config.experts_per_token
        scores = h @ router  # exact: grid products
        chosen = xp.zeros((h.shape[0], k), dtype=np.int64)
        picked = xp.zeros((h.shape[0], k))
        left = scores.copy()
        for slot in range(k):
            best = left.argmax(axis=-1)  # (the first maximum on NumPy and CuPy)
            chosen[:, slot] = best
            picked[:, slot] = scores[xp.arange(h.shape[0]), best]
            left[xp.arange(h.shape[0]), best] = -xp.inf
        lifted = picked - scores.min(axis=-1, keepdims=True) + 2.0**-ACT_BITS  # exact, > 0
        return chosen, quantize(xp, lifted / lifted.sum(axis=-1, keepdims=True))

    def _experts(self, h, w):
        """The mixture's output for normed rows `h`: each expert over its group of rows."""
        xp = self.xp
        chosen, gates = self.route(h, w["router"])
        out = xp.zeros_like(h)
        for e in range(self.config.num_experts):
            rows, slots = xp.nonzero(chosen == e)
            if rows.shape[0] == 0:
                continue
            u = quantize(xp, xp.maximum(h[rows] @ w["w1"][e], 0.0))
            y = quantize(xp, u @ w["w2"][e])
            out[rows] += gates[rows, slots][:, None] * y  # exact: grid products, one per row
        return quantize(xp, out)

    def logits(self, hidden, token_ids):
        """LM-head logits [N, vocab_size] for residual rows `hidden` [N, d_model] whose input
        tokens were `token_ids` [N]. Exact multiples of 2**-16.

        The head is tied to the embedding and reads the residual stream minus the input token's
        own embedding: with it, E[t] . E[t] ~ d_model outweighs everything else and a tied
        head just echoes its input token forever.
        """
        return _rms_norm(self.xp, hidden - self.embed[token_ids]) @ self.embed.T

    def next_tokens(self, hidden, token_ids):
        """Greedy next token per row (see `logits`): argmax, lowest index on ties."""
        return self.logits(hidden, token_ids).argmax(axis=-1)

    def forward_dense(self, token_ids, storage: Storage):
        """Reference forward of one sequence over contiguous K/V, on the host, in float64.

        K/V are rounded through `storage` exactly as the paged cache stores them; attention is
        `gpu.cpu_attention`'s, so on NumPy the token is the one the executor must sample. Returns
        (k_layers, v_layers, next_token): per-layer stored K and V [n, num_kv_heads, head_dim]
        as arrays of storage.array_dtype, and the greedy token after the last position.
        """
        if self.xp is not np:
            raise ValueError("forward_dense runs on a NumPy model")
        token_ids = np.asarray(token_ids, dtype=np.int64)
        k_layers, v_layers = [], []

        def attend(layer, q, k, v, q_rows):
            k_stored, v_stored = storage.encode(np, k), storage.encode(np, v)
            k_layers.append(k_stored)
            v_layers.append(v_stored)
            k_t, v_t, kmax = contiguous_kv(storage.decode(np, k_stored), storage.decode(np, v_stored))
            rows = np.arange(len(token_ids)) if q_rows is None else q_rows
            g = self.config.num_heads // self.config.num_kv_heads
            q4 = q.reshape(len(rows), self.config.num_kv_heads, g, self.config.head_dim)
            out = attend_rows(q4, k_t, v_t, kmax, 1.0 / math.sqrt(self.config.head_dim), rows)
            return out.reshape(q.shape)

        last = np.array([len(token_ids) - 1])
        hidden = self.forward(token_ids, np.arange(len(token_ids)), attend, out_rows=last)
        return k_layers, v_layers, int(self.next_tokens(hidden, token_ids[last])[0])
