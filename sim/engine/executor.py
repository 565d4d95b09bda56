"""The executor protocol: the one seam between the engine and real compute.

Each engine step the engine hands an executor a `StepWork` built from its own block tables, and
the executor returns the next token of every sequence that sampled. `sim` never imports an
executor implementation; the CLI wires one in (`gpu.executor.ModelExecutor`, or none at all for
the pure fast simulation). Everything here is plain data so that an executor needs no import of
`sim` to read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np


@dataclass(slots=True)
class SeqWork:
    """One sequence's share of a step.

    `token_ids` are the tokens whose K/V this step computes and writes: a prefill chunk, or the
    single newest token of a decoding request. `start_pos` is the position of `token_ids[0]`
    (the request's `num_computed_tokens` before the step), so the sequence attends to
    `start_pos + len(token_ids)` tokens. `block_table` lists the physical block ids that hold
    positions `0 .. start_pos + len(token_ids) - 1`, in order. `sample` is true when this step
    yields the sequence's next token (a decode, or the last chunk of a prefill).
    """

    req_id: int
    token_ids: np.ndarray
    start_pos: int
    block_table: Sequence[int]
    sample: bool


@dataclass(slots=True)
class StepWork:
    """All the work of one engine step, plus memory moves the executor must apply first.

    `copies` are (src_block, dst_block) device copies (copy-on-write of a shared partial block);
    `swap_out` / `swap_in` are (device_block, host_slot) / (host_slot, device_block) moves for
    preemption by swap. `freed` names requests that left the engine (finished, cancelled,
    preempted by recompute) so an executor may drop per-request state.
    """

    step: int
    seqs: list[SeqWork]
    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)


class Executor(Protocol):
    """What the engine calls each step when real compute is on.

    `execute` returns a mapping from `req_id` to the sampled next token id for every `SeqWork`
    with `sample=True`, and nothing else.
    """

    name: str
    device: str

    def execute(self, work: StepWork) -> dict[int, int]: ...


class HandoffExecutor(Executor, Protocol):
    """An executor that can send a request's K/V to another executor's pool: each instance of a
    disaggregated pair (`sim.deploy.cluster`) has its own executor, and when a request is handed from
    the prefill instance to the decode instance, the decode side's `import_kv` stores into its
    own blocks what the prefill side's `export_kv` read from its blocks (an opaque object)."""

    def export_kv(self, req_id: int, block_ids: Sequence[int]) -> object: ...

    def import_kv(self, req_id: int, block_ids: Sequence[int], transfer: object) -> None: ...
