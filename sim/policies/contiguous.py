"""`contiguous`: the baseline before PagedAttention (Orca-style iteration-level batching over a
contiguous KV cache).

Each admitted request reserves one run of consecutive slots for its prompt plus its maximum
output (at least `scheduler.reserve_output_tokens`, the most a request may generate) at
admission, first fit. Steps prefill whole prompts or decode, as `fcfs` does, and no request is
ever preempted, because every token it can produce already has a slot. The cost is memory: slots
reserved for tokens not yet (or never) generated hold nothing (internal fragmentation), and free
slots split into holes too short for the next request (external fragmentation).
"""

from __future__ import annotations

from sim.policies.base import SchedulerOutput
from sim.policies.fcfs import FCFSPolicy


class ContiguousPolicy(FCFSPolicy):
    name = "contiguous"
    description = "pre-PagedAttention baseline: contiguous slots for prompt + max output"

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self._stalled: set[int] = set()  # requests refused by external fragmentation

    def admit_prompts(self, out: SchedulerOutput) -> None:
        budget = self.cfg.max_num_batched_tokens
        bs = self.kv.block_size
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            req = self.next_waiting()
            n = req.num_tokens - req.num_computed_tokens
            if n > budget and out.scheduled:
                break
            # capped at the pool: a request the pool holds at all is never refused for ever
            reserve = min(req.prompt_len + max(req.max_output_tokens,
                                               self.cfg.reserve_output_tokens),
                          self.kv.num_blocks * bs)
            if not self.kv.reserve_contiguous(req, reserve):
                if (self.kv.num_free_blocks * bs >= reserve
                        and req.req_id not in self._stalled):
                    # refused although enough blocks are free: external fragmentation. Counted
                    # once per request: how many decisions repeat the refusal depends on how
                    # the engine batches identical decode steps, which must not change results.
                    self._stalled.add(req.req_id)
                    self.engine.counts["fragmentation_stalls"] += 1
                break
            self.schedule_admitted(out, req, n)
            budget -= n
