"""ModelExecutor: the engine's executor protocol (`sim/engine/executor.py`) over the tiny model.

Each `execute(work)` applies the step's block moves, plans the batch once (`gpu.batch`), runs
the model over every new token of the step (prefill chunks and decode tokens together; per layer
one K/V write, one decode-kernel call and one prefill-kernel call), and returns the greedy next
token of every sequence that samples. `work` is read by attribute only (`seqs`, `copies`,
`swap_out`, `swap_in`, `freed`; each seq's `req_id`, `token_ids`, `start_pos`, `block_table`,
`sample`), so `gpu` needs no import of `sim`.

Default model sizes (block_size 16; bytes per block are K and V over all layers):

    CPU_MODEL  1 layer,   2 heads, 1 kv head,  head_dim  16, float32:   2 KiB per block
    GPU_MODEL  4 layers,  8 heads, 2 kv heads, head_dim 128, float16:  64 KiB per block

`ModelExecutor.with_defaults` picks the one that fits the backend it resolves to.

Verification: with `verify_every=N`, every N steps one request of the step (seeded choice)
is recomputed densely from the executor's own record of its tokens (`TinyModel.forward_dense`,
float64, contiguous K/V) and compared with its blocks in the paged cache and its sampled token;
a mismatch raises `VerifyError` naming the request and the first block that disagrees.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .backend import Backend, get_backend
from .batch import BatchPlan, plan_batch
from .cpu_attention import SequenceKV, attend_last, attend_rows
from .dtypes import storage as storage_named
from .errors import VerifyError
from .kv_cache import PagedKVCache, kv_bytes_per_block
from .model import ModelConfig, TinyModel

# CPU: small enough that the default scenario (`chat`: batches of ~25 requests with ~4k-token
# contexts, ~42 steps per simulated second) runs at x1 on two cores with headroom, NumPy with
# float64 accumulation: decode reads every context's K/V each step, so bytes per token (layers x
# kv heads x head_dim) set the pace. Still grouped-query (2 heads share a kv head).
CPU_MODEL = {"num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16, "dtype": "float32"}
GPU_MODEL = {"num_layers": 4, "num_heads": 8, "num_kv_heads": 2, "head_dim": 128, "dtype": "float16"}
# CuPy verification tolerates float32-accumulation noise in deeper layers; NumPy must match exactly.
CUPY_VERIFY_ATOL = 0.125
CUPY_VERIFY_RTOL = 0.05


def _mlp_text(c: ModelConfig) -> str:
    if c.mlp and c.num_experts:
        return f"{c.num_experts} experts (top {c.experts_per_token})"
    return "mlp" if c.mlp else "no mlp"


@dataclass
class _History:
    """The tokens whose K/V a request has in the cache, in position order.

    `complete` is false when the request started past position 0 (its prefix came from blocks
    the executor never computed for it, e.g. a prefix-cache hit): it cannot be verified.
    """

    tokens: list[int] = field(default_factory=list)
    complete: bool = True


@dataclass
class KVTransfer:
    """A request's K/V blocks on their way between two executors' pools (`export_kv`)."""

    k: object                  # [num_layers, blocks, block_size, num_kv_heads, head_dim]
    v: object
    history: _History | None


def _format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    raise AssertionError


class ModelExecutor:
    """Runs the tiny model over a paged KV pool of exactly `num_blocks` blocks.

    Attributes `name` (backend name) and `device` satisfy the executor protocol.

    Raises (constructor):
        BackendUnavailable: backend="cupy" without a usable CUDA device.
        ValueError: a size or dtype out of range (bfloat16 needs the CuPy backend).
    """

    def __init__(self, num_blocks: int, block_size: int, *, num_layers: int = 2, num_heads: int = 4,
                 num_kv_heads: int = 2, head_dim: int = 32, vocab_size: int = 256, mlp: bool = True,
                 num_experts: int = 0, experts_per_token: int = 2, dtype: str = "float32",
                 backend: str | Backend = "auto", seed: int = 0,
                 num_host_blocks: int = 0, verify_every: int = 0) -> None:
        if num_blocks < 1 or block_size < 1 or num_host_blocks < 0 or verify_every < 0:
            raise ValueError(f"executor: num_blocks {num_blocks}, block_size {block_size}, num_host_blocks "
                             f"{num_host_blocks}, verify_every {verify_every} out of range")
        self.backend = backend if isinstance(backend, Backend) else get_backend(backend)
        self.storage = storage_named(dtype)
        if self.storage.name == "bfloat16" and self.backend.name != "cupy":
            raise ValueError("executor: dtype bfloat16 needs the cupy backend")
        if self.backend.name == "cupy" and block_size not in self.backend.kernels.BLOCK_SIZES:
            raise ValueError(f"executor: block_size {block_size}: the CUDA kernels take a power of two up to "
                             f"{self.backend.kernels.BLOCK_SIZES[-1]}")
        self.config = ModelConfig(num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                  head_dim=head_dim, vocab_size=vocab_size, mlp=mlp, seed=seed,
                                  num_experts=num_experts, experts_per_token=experts_per_token)
        self.model = TinyModel(self.config, self.backend.xp)
        self.cache = PagedKVCache(self.backend, self.storage, num_layers=num_layers, num_blocks=num_blocks,
                                  block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                  num_host_blocks=num_host_blocks)
        self.name = self.backend.name
        self.device = self.backend.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.verify_every = verify_every
        self._verify_rng = np.random.default_rng(seed)
        self._reference: TinyModel | None = None
        self._history: dict[int, _History] = {}
        self._steps = 0
        # NumPy: per-request contiguous K/V for gpu.cpu_attention (kept coherent with the pool).
        self._kv_copies = SequenceKV(self.cache) if self.backend.name == "numpy" else None

    @classmethod
    def with_defaults(cls, num_blocks: int, block_size: int, *, backend: str = "auto", **overrides) -> "ModelExecutor":
        """Returns an executor with GPU_MODEL sizes on CuPy, CPU_MODEL sizes on NumPy; keyword
        `overrides` win over both."""
        resolved = get_backend(backend)
        sizes = dict(GPU_MODEL if resolved.name == "cupy" else CPU_MODEL)
        sizes.update(overrides)
        return cls(num_blocks, block_size, backend=resolved, **sizes)

    @staticmethod
    def block_bytes(block_size: int, *, num_layers: int, num_kv_heads: int, head_dim: int,
                    dtype: str = "float32") -> int:
        """Bytes one KV block takes (K and V, all layers) for the given sizes, without building
        anything: for documentation and memory planning."""
        return kv_bytes_per_block(block_size, num_layers=num_layers, num_kv_heads=num_kv_heads,
                                  head_dim=head_dim, itemsize=storage_named(dtype).itemsize)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block of this executor's pool takes (K and V, all layers)."""
        return self.cache.bytes_per_block

    def describe(self) -> str:
        """One line: model sizes, storage, pool size and backend."""
        c = self.config
        return (f"tiny model: {c.num_layers} layer{'s' if c.num_layers != 1 else ''}, {c.num_heads} heads ({c.num_kv_heads} kv), head_dim "
                f"{c.head_dim}, d_model {c.d_model}, vocab {c.vocab_size}, {_mlp_text(c)}, "
                f"seed {c.seed}; {self.storage.name} KV, {self.num_blocks} blocks x {self.block_size} tokens, "
                f"{_format_bytes(self.bytes_per_block)}/block, "
                f"{_format_bytes(self.bytes_per_block * self.num_blocks)} pool, "
                f"{self.cache.num_host_blocks} host blocks; {self.name} on {self.device}")

    # -- the protocol ---------------------------------------------------------------------

    def execute(self, work) -> dict[int, int]:
        """Applies the step's block moves, runs all its tokens, and returns {req_id: next token}
        for every sequence with sample=True.

        Order: dropped requests first; then swap_out (its blocks may be handed out again in
        this very step), swap_in, copies; then the model.

        Raises:
            ValueError: a block id or host slot out of range, or a malformed sequence.
            VerifyError: verification is on, due this step, and found a mismatch.
        """
        for req_id in work.freed:
            self._history.pop(req_id, None)
            if self._kv_copies is not None:
                self._kv_copies.forget(req_id)
        self.cache.swap_out(work.swap_out)
        self.cache.swap_in(work.swap_in)
        self.cache.copy_blocks(work.copies)
        if not work.seqs:
            return {}
        plan = plan_batch(work.seqs, self.block_size, self.num_blocks)
        written = plan.slot_mapping[plan.slot_mapping >= 0] // self.block_size
        self.cache.mark_written(written)
        xp = self.backend.xp
        hidden = self.model.forward(xp.asarray(plan.token_ids), xp.asarray(plan.positions), self._attend(plan),
                                    out_rows=xp.asarray(plan.sample_rows))
        tokens = self.backend.to_host(self.model.next_tokens(hidden, xp.asarray(plan.token_ids[plan.sample_rows])))
        sampled = {req_id: int(t) for req_id, t in zip(plan.sample_req_ids, tokens)}
        for seq in work.seqs:
            self._record(seq)
        self._steps += 1
        if self.verify_every and self._steps % self.verify_every == 0:
            self._verify_one(work.seqs, sampled)
        return sampled

    def _attend(self, plan: BatchPlan):
        """Builds this step's per-layer attention: write the layer's new K/V, then attend. The
        last layer attends for the sampling rows only (`TinyModel.forward`): on CuPy they are one
        decode-kernel call (each is its sequence's last position); on NumPy every row goes
        through `gpu.cpu_attention`, whose result does not depend on the path."""
        backend, st, xp = self.backend, self.storage, self.backend.xp
        kernels = backend.kernels
        slot_mapping = xp.asarray(plan.slot_mapping)
        calls = []
        # The kernel batches (built lazily by the plan) are for CuPy: NumPy attends per request.
        for batch, kind in ((plan.decode, "decode"), (plan.prefill, "prefill")) if backend.name != "numpy" else ():
            if batch is not None:
                calls.append((kind, batch, xp.asarray(batch.rows), xp.asarray(batch.block_tables),
                              xp.asarray(batch.seq_lens), xp.asarray(batch.cu_seqlens_q)))

        def attend(layer: int, q, k, v, q_rows):
            k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
            kernels.write_kv(st.encode(xp, k), st.encode(xp, v), k_cache, v_cache, slot_mapping)
            if backend.name == "numpy":
                return self._attend_cpu(plan, layer, q, q_rows is not None)
            q_in = st.encode(xp, q)
            if q_rows is not None:
                b = plan.sample
                if b is None:
                    return q
                out = kernels.paged_decode_attention(q_in, k_cache, v_cache, xp.asarray(b.block_tables),
                                                     xp.asarray(b.seq_lens), max_seq_len=b.max_seq_len)
                return st.decode(xp, out)
            out = xp.empty(q_in.shape, dtype=q_in.dtype)
            for kind, batch, rows, tables, seq_lens, cu in calls:
                if kind == "decode":
                    out[rows] = kernels.paged_decode_attention(q_in[rows], k_cache, v_cache, tables, seq_lens,
                                                               max_seq_len=batch.max_seq_len)
                else:
                    out[rows] = kernels.paged_prefill_attention(q_in[rows], k_cache, v_cache, tables, cu,
                                                                seq_lens, max_q_len=batch.max_q_len)
            return st.decode(xp, out)

        return attend

    def _attend_cpu(self, plan: BatchPlan, layer: int, q, sampled_only: bool):
        """Exact attention (`gpu.cpu_attention`) of this layer's query rows `q`: every row of the
        step, or (`sampled_only`) the last row of each sampling sequence, in plan order."""
        c = self.config
        group, scale = c.num_heads // c.num_kv_heads, 1.0 / np.sqrt(c.head_dim)
        q4 = q.reshape(q.shape[0], c.num_kv_heads, group, c.head_dim)
        out = np.empty_like(q4)
        copies = self._kv_copies
        if sampled_only:
            seqs = plan.sample_seqs.tolist()
            kvs = copies.get_many([plan.req_ids[i] for i in seqs], layer, [plan.tables[i] for i in seqs],
                                  plan.seq_lens[seqs].tolist())
            return attend_last(q4, kvs, scale).reshape(q.shape)
        else:
            kvs = copies.get_many(plan.req_ids, layer, plan.tables, plan.seq_lens.tolist())
            for i, (k_t, v_t, kmax) in enumerate(kvs):
                r0, r1 = int(plan.offsets[i]), int(plan.offsets[i] + plan.lengths[i])
                out[r0:r1] = attend_rows(q4[r0:r1], k_t, v_t, kmax, scale, plan.positions[r0:r1])
        return out.reshape(q.shape)

    def _record(self, seq) -> None:
        history = self._history.get(seq.req_id)
        if seq.start_pos == 0:
            history = self._history[seq.req_id] = _History()
        elif history is None or len(history.tokens) < seq.start_pos:
            history = self._history[seq.req_id] = _History(complete=False)
        if len(history.tokens) > seq.start_pos:
            del history.tokens[seq.start_pos:]
        ids = seq.token_ids
        history.tokens.extend(ids.tolist() if getattr(ids, "ndim", 0) == 1 else np.asarray(ids).reshape(-1).tolist())

    # -- hand-off between executors (prefill/decode disaggregation) -------------------------

    def export_kv(self, req_id: int, block_ids) -> "KVTransfer":
        """The K/V held in `block_ids` (every layer) and this executor's record of `req_id`'s
        tokens, for another executor's `import_kv`.

        Raises:
            ValueError: a block id out of range.
        """
        k, v = self.cache.read_blocks(block_ids)
        history = self._history.get(req_id)
        return KVTransfer(k, v, None if history is None else
                          _History(list(history.tokens), history.complete))

    def import_kv(self, req_id: int, block_ids, transfer: "KVTransfer") -> None:
        """Stores what another executor's `export_kv` gave into `block_ids` of this pool, and
        takes over its record of `req_id`'s tokens (so the request stays verifiable here).

        Raises:
            ValueError: a block id out of range, or a count that differs from the export's.
        """
        if len(block_ids) != transfer.k.shape[1]:
            raise ValueError(f"import_kv: {len(block_ids)} blocks for {transfer.k.shape[1]} exported")
        self.cache.write_blocks(block_ids, transfer.k, transfer.v)
        if transfer.history is not None:
            self._history[req_id] = transfer.history

    # -- verification ---------------------------------------------------------------------

    def _verify_one(self, seqs, sampled: dict[int, int]) -> None:
        candidates = [seq for seq in seqs if self._history[seq.req_id].complete]
        if candidates:
            seq = candidates[int(self._verify_rng.integers(len(candidates)))]
            self.verify_request(seq.req_id, seq.block_table, sampled.get(seq.req_id))

    def verify_request(self, req_id: int, block_table, sampled_token: int | None = None) -> None:
        """Recomputes request `req_id` densely from its recorded tokens and compares.

        Compares every layer's K/V of every position with the paged cache read through
        `block_table` (bit-exact on NumPy; within float32-accumulation tolerance on CuPy) and,
        on NumPy, `sampled_token` with the reference's greedy token.

        Raises:
            KeyError: the executor has no record of `req_id`.
            ValueError: the record does not start at position 0 (it cannot be recomputed).
            VerifyError: a mismatch; it names the request, the layer, the position and the
                logical and physical block of the first disagreement.
        """
        history = self._history[req_id]
        if not history.complete:
            raise ValueError(f"request {req_id}: its tokens before position {len(history.tokens)} are unknown")
        if self._reference is None:
            self._reference = TinyModel(self.config, np)
        tokens = np.array(history.tokens, dtype=np.int64)
        k_ref, v_ref, next_token = self._reference.forward_dense(tokens, self.storage)
        k_got, v_got = self.cache.gather(block_table, len(tokens))
        first = None  # (position, layer)
        for layer in range(self.config.num_layers):
            for got, ref in ((k_got[layer], k_ref[layer]), (v_got[layer], v_ref[layer])):
                bad = np.flatnonzero(~self._same(got, ref).reshape(len(tokens), -1).all(axis=1))
                if bad.size and (first is None or bad[0] < first[0]):
                    first = (int(bad[0]), layer)
        if first is not None:
            position, layer = first
            logical = position // self.block_size
            physical = int(np.asarray(block_table)[logical])
            raise VerifyError(f"request {req_id}: paged K/V differ from a dense recompute at layer {layer}, "
                              f"position {position} (logical block {logical}, physical block {physical})",
                              req_id=req_id, layer=layer, position=position, logical_block=logical,
                              physical_block=physical)
        if sampled_token is not None and self.name == "numpy" and sampled_token != next_token:
            raise VerifyError(f"request {req_id}: sampled token {sampled_token}, dense recompute gives {next_token}",
                              req_id=req_id)

    def _same(self, got: np.ndarray, ref: np.ndarray) -> np.ndarray:
        if self.name == "numpy":
            return got == ref
        got, ref = self.storage.decode(np, got), self.storage.decode(np, ref)
        return np.isclose(got, ref, atol=CUPY_VERIFY_ATOL, rtol=CUPY_VERIFY_RTOL)
