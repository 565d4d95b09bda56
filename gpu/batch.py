"""The per-step batch plan: every index array a step needs, built once and shared by all layers.

From the step's sequences (duck-typed `SeqWork`s: `req_id`, `token_ids`, `start_pos`,
`block_table`, `sample`) it lays all new tokens end to end and derives their positions and
`slot_mapping`, then splits the sequences into decodes (one new token: the decode kernel) and
prefill chunks (several: the prefill kernel), each with its own `block_tables` and `seq_lens`.
Python loops here only walk the sequence list to collect lists; all per-token work is vectorised.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass
class AttentionBatch:
    """One kernel call's batch (host arrays). `rows` are its tokens' indices in the step."""

    rows: np.ndarray           # [n] int64, rows of the step's token arrays
    block_tables: np.ndarray   # [num_seqs, max_blocks] int32
    seq_lens: np.ndarray       # [num_seqs] int32
    cu_seqlens_q: np.ndarray   # [num_seqs + 1] int32 (prefill only; decode: arange)
    max_seq_len: int
    max_q_len: int


class BatchPlan:
    """All tokens of a step and its attention batches. Arrays are host NumPy arrays.

    The AttentionBatches (`decode`, `prefill`, `sample`: padded block tables for the CUDA
    kernels) are built on first use; the NumPy path never needs them.
    """

    def __init__(self, *, req_ids, token_ids, positions, slot_mapping, tables, seq_lens, offsets, lengths,
                 sample_seqs) -> None:
        self.req_ids: list[int] = req_ids
        self.token_ids: np.ndarray = token_ids        # [T] int64
        self.positions: np.ndarray = positions        # [T] int64
        self.slot_mapping: np.ndarray = slot_mapping  # [T] int64
        self.tables: list[np.ndarray] = tables        # per sequence: int64 block ids covering its positions
        self.seq_lens: np.ndarray = seq_lens          # [num_seqs] int64: tokens cached after the step
        self.offsets: np.ndarray = offsets            # [num_seqs] int64: first row of each sequence's tokens
        self.lengths: np.ndarray = lengths            # [num_seqs] int64: its number of new tokens
        self.sample_seqs: np.ndarray = sample_seqs    # [N] int64: the sampling sequences' indices
        self.sample_rows: np.ndarray = (offsets + lengths - 1)[sample_seqs]  # their last token rows
        self.sample_req_ids: list[int] = [req_ids[i] for i in sample_seqs.tolist()]

    def _batch(self, seqs, rows, q_lens) -> "AttentionBatch | None":
        return _attention_batch(rows, [self.tables[s] for s in seqs.tolist()], self.seq_lens[seqs], q_lens)

    @functools.cached_property
    def decode(self) -> "AttentionBatch | None":
        """The one-token sequences, for the decode kernel."""
        seqs = np.flatnonzero(self.lengths == 1)
        return self._batch(seqs, self.offsets[seqs], self.lengths[seqs])

    @functools.cached_property
    def prefill(self) -> "AttentionBatch | None":
        """The sequences with several new tokens, for the prefill kernel."""
        seqs = np.flatnonzero(self.lengths != 1)
        rows = np.concatenate([np.arange(self.offsets[s], self.offsets[s] + self.lengths[s]) for s in seqs]) \
            if len(seqs) else np.zeros(0, dtype=np.int64)
        return self._batch(seqs, rows, self.lengths[seqs])

    @functools.cached_property
    def sample(self) -> "AttentionBatch | None":
        """Each sampling sequence's last row as a decode query over all its tokens."""
        return self._batch(self.sample_seqs, self.sample_rows, np.ones(len(self.sample_seqs), dtype=np.int64))


def _padded_tables(tables: list[np.ndarray]) -> np.ndarray:
    lengths = np.array([len(t) for t in tables], dtype=np.int64)
    out = np.zeros((len(tables), int(lengths.max(initial=0))), dtype=np.int32)
    if lengths.sum():
        rows = np.repeat(np.arange(len(tables)), lengths)
        cols = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        out[rows, cols] = np.concatenate(tables)
    return out


def _attention_batch(rows, tables, seq_lens, q_lens) -> AttentionBatch | None:
    if not len(seq_lens):
        return None
    seq_lens = np.asarray(seq_lens, dtype=np.int32)
    q_lens = np.asarray(q_lens, dtype=np.int64)
    return AttentionBatch(
        rows=np.asarray(rows, dtype=np.int64),
        block_tables=_padded_tables(tables),
        seq_lens=seq_lens,
        cu_seqlens_q=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
        max_seq_len=int(seq_lens.max()),
        max_q_len=int(q_lens.max()),
    )


def plan_batch(seqs, block_size: int, num_blocks: int) -> BatchPlan:
    """Returns the plan for one step's sequences.

    Raises:
        ValueError: a sequence has no tokens, a negative start, a block table too short for
            its positions, or a block id outside 0 .. num_blocks - 1.
    """
    tokens, tables, starts, lengths, req_ids, samples = [], [], [], [], [], []
    for i, seq in enumerate(seqs):
        ids = seq.token_ids
        n = len(ids)
        end = seq.start_pos + n
        if n == 0 or seq.start_pos < 0:
            raise ValueError(f"request {seq.req_id}: {n} tokens at start_pos {seq.start_pos}")
        needed = -(-end // block_size)
        table = seq.block_table
        if len(table) < needed:
            raise ValueError(f"request {seq.req_id}: block_table has {len(table)} blocks, "
                             f"positions up to {end - 1} need {needed}")
        tokens.append(ids)
        tables.append(np.asarray(table[:needed], dtype=np.int64).reshape(-1))
        starts.append(seq.start_pos)
        lengths.append(n)
        req_ids.append(seq.req_id)
        if seq.sample:
            samples.append(i)
    table_lens = np.array([len(t) for t in tables], dtype=np.int64)
    all_ids = np.concatenate(tables) if tables else np.zeros(0, dtype=np.int64)
    if all_ids.size and (all_ids.min() < 0 or all_ids.max() >= num_blocks):
        bad = next(i for i, t in enumerate(tables) if t.size and (t.min() < 0 or t.max() >= num_blocks))
        raise ValueError(f"request {req_ids[bad]}: block_table {tables[bad].tolist()} has ids outside "
                         f"0..{num_blocks - 1}")

    lengths_a = np.array(lengths, dtype=np.int64)
    offsets = np.cumsum(lengths_a) - lengths_a
    seq_of_token = np.repeat(np.arange(len(lengths)), lengths_a)
    positions = np.array(starts, dtype=np.int64)[seq_of_token] + np.arange(int(lengths_a.sum())) \
        - offsets[seq_of_token]
    table_starts = np.cumsum(table_lens) - table_lens
    slot_mapping = all_ids[table_starts[seq_of_token] + positions // block_size] * block_size \
        + positions % block_size
    return BatchPlan(
        req_ids=req_ids,
        token_ids=np.concatenate(tokens).astype(np.int64, copy=False).reshape(-1) if tokens
        else np.zeros(0, dtype=np.int64),
        positions=positions,
        slot_mapping=slot_mapping,
        tables=tables,
        seq_lens=np.array(starts, dtype=np.int64) + lengths_a,
        offsets=offsets,
        lengths=lengths_a,
        sample_seqs=np.array(samples, dtype=np.int64),
    )
