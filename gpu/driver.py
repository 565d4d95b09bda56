"""A minimal step driver: feeds requests to an executor step by step, without the engine.

For the GPU self-check and the tests, which need to run a few requests through `ModelExecutor`
and steer the awkward cases (chunked prefill, preemption by recompute or swap, blocks in a
chosen order) without `sim`. It is not a scheduler: every active request runs every step, and
blocks come from a free list in the order given. Its step objects carry the attribute names of
`sim.engine.executor.StepWork` / `SeqWork`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Seq:
    """One sequence's share of a step (the attributes of sim's SeqWork)."""

    req_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool


@dataclass
class Step:
    """One step's work (the attributes of sim's StepWork)."""

    step: int
    seqs: list[Seq]
    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)


@dataclass
class _Request:
    tokens: list[int]          # prompt, then every sampled token
    prompt_len: int
    computed: int = 0          # tokens whose K/V are in the cache
    blocks: list[int] = field(default_factory=list)
    host_slots: list[int] = field(default_factory=list)
    active: bool = True

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


class Driver:
    """Runs requests through `executor` (anything with `execute`, `block_size`, `num_blocks`).

    `block_order` is the order in which free blocks are handed out (default 0, 1, 2, ...).
    """

    def __init__(self, executor, block_order=None) -> None:
        self.executor = executor
        self.block_size = executor.block_size
        self.free = list(range(executor.num_blocks) if block_order is None else block_order)
        self.free_host = list(range(getattr(executor.cache, "num_host_blocks", 0)))
        self.requests: dict[int, _Request] = {}
        self._pending = Step(step=0, seqs=[])
        self._next_step = 0

    def add(self, prompt, req_id: int | None = None) -> int:
        """Adds a request with prompt token ids; returns its id."""
        req_id = len(self.requests) if req_id is None else req_id
        self.requests[req_id] = _Request(tokens=[int(t) for t in prompt], prompt_len=len(prompt))
        return req_id

    def generated(self, req_id: int) -> list[int]:
        return self.requests[req_id].generated

    def step(self, chunk_size: int | None = None, only=None) -> dict[int, int]:
        """Runs one step over the active requests (or those in `only`): each computes up to
        `chunk_size` of its pending tokens (all by default). Returns the sampled tokens."""
        seqs = []
        for req_id, r in self.requests.items():
            if not r.active or (only is not None and req_id not in only) or r.computed >= len(r.tokens):
                continue
            n = len(r.tokens) - r.computed if chunk_size is None else min(chunk_size, len(r.tokens) - r.computed)
            while len(r.blocks) * self.block_size < r.computed + n:
                r.blocks.append(self.free.pop(0))
            seqs.append(Seq(req_id, r.tokens[r.computed:r.computed + n], r.computed, list(r.blocks),
                            sample=r.computed + n == len(r.tokens)))
        work, self._pending = self._pending, Step(step=0, seqs=[])
        work.step, work.seqs = self._next_step, seqs
        self._next_step += 1
        sampled = self.executor.execute(work)
        for seq in seqs:
            r = self.requests[seq.req_id]
            r.computed += len(seq.token_ids)
            if seq.sample:
                r.tokens.append(sampled[seq.req_id])
        return sampled

    def run(self, max_new_tokens: int, chunk_size: int | None = None) -> dict[int, list[int]]:
        """Steps until every active request has `max_new_tokens` generated tokens, freeing each
        as it finishes. Returns {req_id: generated tokens}."""
        while True:
            for req_id, r in self.requests.items():
                if r.active and len(r.generated) >= max_new_tokens:
                    self.finish(req_id)
            if not any(r.active for r in self.requests.values()):
                return {req_id: r.generated[:max_new_tokens] for req_id, r in self.requests.items()}
            self.step(chunk_size)

    def finish(self, req_id: int) -> None:
        """Releases a request's blocks; the next step tells the executor it is gone."""
        r = self.requests[req_id]
        r.active = False
        self.free.extend(r.blocks)
        r.blocks = []
        self._pending.freed.append(req_id)

    def preempt_recompute(self, req_id: int) -> None:
        """Drops a request's blocks: it will re-prefill prompt + generated tokens from scratch,
        into whatever blocks come next."""
        r = self.requests[req_id]
        self.free.extend(r.blocks)
        r.blocks, r.computed = [], 0
        self._pending.freed.append(req_id)

    def swap_out(self, req_id: int) -> None:
        """Moves a request's blocks to host slots (applied with the next step) and parks it."""
        r = self.requests[req_id]
        r.host_slots = [self.free_host.pop(0) for _ in r.blocks]
        self._pending.swap_out.extend(zip(r.blocks, r.host_slots))
        self.free.extend(r.blocks)
        r.blocks, r.active = [], False

    def swap_in(self, req_id: int) -> None:
        """Brings a swapped request back into fresh device blocks (applied with the next step)."""
        r = self.requests[req_id]
        r.blocks = [self.free.pop(0) for _ in r.host_slots]
        self._pending.swap_in.extend(zip(r.host_slots, r.blocks))
        self.free_host.extend(r.host_slots)
        r.host_slots, r.active = [], True
