"""The per-step batch plan: every index array a step needs, built once and shared by all layers.

From the step's sequences (duck-typed `SeqWork`s: `req_id`, `token_ids`, `start_pos`,
`block_table`, `sample`) it lays all new tokens end to end and derives their positions and
`slot_mapping`, then splits the sequences into decodes (one new token: the decode kernel) and
prefill chunks (several: the prefill kernel), each with its own `block_tables` and `seq_lens`.
Python loops here only walk the sequence list to collect lists; all per-token work is vectorised.
"""

from __future__ import annotations

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


@dataclass
class BatchPlan:
    """All tokens of a step and the two attention batches. Arrays are host NumPy arrays."""

    req_ids: list[int]
    token_ids: np.ndarray      # [T] int64
    positions: np.ndarray      # [T] int64
    slot_mapping: np.ndarray   # [T] int64
    decode: AttentionBatch | None
    prefill: AttentionBatch | None
    sample_rows: np.ndarray    # [N] int64: last token row of each sequence that samples
    sample_req_ids: list[int]
    sample: AttentionBatch | None  # each sampling sequence's last row as a decode query
    tables: list[np.ndarray]   # per sequence: int64 block ids covering its positions
    seq_lens: np.ndarray       # [num_seqs] int64: tokens cached after the step
    offsets: np.ndarray        # [num_seqs] int64: first row of each sequence's tokens
    lengths: np.ndarray        # [num_seqs] int64: its number of new tokens
    sample_seqs: np.ndarray    # [N] int64: the sampling sequences' indices


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
    tokens, tables, starts, lengths, req_ids = [], [], [], [], []
    for seq in seqs:
        ids = np.asarray(seq.token_ids, dtype=np.int64).reshape(-1)
        table = np.asarray(seq.block_table, dtype=np.int64).reshape(-1)
        end = seq.start_pos + len(ids)
        if len(ids) == 0 or seq.start_pos < 0:
            raise ValueError(f"request {seq.req_id}: {len(ids)} tokens at start_pos {seq.start_pos}")
        needed = -(-end // block_size)
        if len(table) < needed:
            raise ValueError(f"request {seq.req_id}: block_table has {len(table)} blocks, "
                             f"positions up to {end - 1} need {needed}")
        table = table[:needed]
        if needed and (table.min() < 0 or table.max() >= num_blocks):
            raise ValueError(f"request {seq.req_id}: block_table {table.tolist()} has ids outside "
                             f"0..{num_blocks - 1}")
        tokens.append(ids)
        tables.append(table)
        starts.append(seq.start_pos)
        lengths.append(len(ids))
        req_ids.append(seq.req_id)

    lengths_a = np.array(lengths, dtype=np.int64)
    offsets = np.cumsum(lengths_a) - lengths_a
    seq_of_token = np.repeat(np.arange(len(lengths)), lengths_a)
    positions = np.array(starts, dtype=np.int64)[seq_of_token] + np.arange(int(lengths_a.sum())) \
        - offsets[seq_of_token]
    table_matrix = _padded_tables(tables)
    slot_mapping = table_matrix[seq_of_token, positions // block_size].astype(np.int64) * block_size \
        + positions % block_size

    is_decode = lengths_a == 1
    decode_seqs = np.flatnonzero(is_decode)
    prefill_seqs = np.flatnonzero(~is_decode)
    seq_lens = np.array(starts, dtype=np.int64) + lengths_a
    prefill_rows = np.concatenate([np.arange(offsets[s], offsets[s] + lengths_a[s]) for s in prefill_seqs]) \
        if len(prefill_seqs) else np.zeros(0, dtype=np.int64)
    samples = [i for i, seq in enumerate(seqs) if seq.sample]
    sample_rows = (offsets + lengths_a - 1)[samples]
    return BatchPlan(
        req_ids=req_ids,
        token_ids=np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int64),
        positions=positions,
        slot_mapping=slot_mapping,
        decode=_attention_batch(offsets[decode_seqs], [tables[s] for s in decode_seqs],
                                seq_lens[decode_seqs], lengths_a[decode_seqs]),
        prefill=_attention_batch(prefill_rows, [tables[s] for s in prefill_seqs],
                                 seq_lens[prefill_seqs], lengths_a[prefill_seqs]),
        sample_rows=sample_rows,
        sample_req_ids=[req_ids[i] for i in samples],
        sample=_attention_batch(sample_rows, [tables[s] for s in samples], seq_lens[samples],
                                np.ones(len(samples), dtype=np.int64)),
        tables=tables,
        seq_lens=seq_lens,
        offsets=offsets,
        lengths=lengths_a,
        sample_seqs=np.array(samples, dtype=np.int64),
    )
