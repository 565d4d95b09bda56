"""`chunked`: vLLM V1 / Sarathi-Serve scheduling.

Running requests go first (decodes, and the next chunk of any prompt still prefilling), then
waiting requests fill what is left of the token budget (`max_num_batched_tokens`), so a long
prompt is prefilled over several steps while decodes keep flowing. When blocks run short, the
most recently admitted request is preempted; no new request is admitted in a step that preempted.

Admission follows vLLM V1: a waiting (or preempted) request is admitted only if blocks for all
its tokens so far fit (`scheduler.reserve_full_sequence`), leaving the watermark free while
anything runs; the first request that does not fit ends admission for the step. Under
`engine.guaranteed_no_evict` (TensorRT-LLM's capacity scheduler) a request must also fit to its
last token beside every running request's reservation (`Policy.fits_to_completion`), and none
is preempted to make room.

Where the engine does not chunk prefills (`engine.chunked_prefill = false`: TensorRT-LLM's
default, vLLM's `--no-enable-chunked-prefill`), a prompt is computed whole in one step beside the
decodes (in-flight batching), and waits while it does not fit in what is left of the budget.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from mypy_extensions import mypyc_attr

from sim.policies.base import Policy, SchedulerOutput


@mypyc_attr(allow_interpreted_subclasses=True)
class ChunkedPolicy(Policy):
    name: ClassVar[str] = "chunked"
    description: ClassVar[str] = ("vLLM V1 / Sarathi-Serve: decodes first, prefill chunks fill "
                                  "the token budget")
    models_v1: ClassVar[bool] = True
    chunks_prompts: ClassVar[bool] = True

    def schedule(self) -> SchedulerOutput:
        """Running requests first within the token budget, then admissions from the queue
        in what is left, unless the pass over the batch preempted."""
        out = SchedulerOutput()
        budget = self.schedule_running(out, self.cfg.max_num_batched_tokens)
        if not out.preempted and self.waiting:
            n_before = len(out.scheduled)
            self.admit_waiting(out, budget)
            # (an admission that preempted a scheduled request for room keeps the count)
            if len(out.scheduled) != n_before or out.preempted:
                out.decode_only = False
        return out

    def decodes_alone(self) -> bool:
        return len(self.running) <= self.cfg.max_num_batched_tokens  # (one token each)

    def admit_waiting(self, out: SchedulerOutput, budget: Any) -> None:
        """Admit from the queue, in the policy's order (`next_waiting`), within what is left
        of the token budget and `max_num_seqs`, while blocks for each fit and leave the
        watermark free (`watermark_blocks`, while anything runs); the first that does not fit
        ends admission unless `make_room` preempts for it. Under `engine.guaranteed_no_evict`
        the first that does not fit to its last token (`fits_to_completion`) ends it too, and
        no room is made. Where the engine computes prompts
        whole (`chunk_tokens` 0), a request whose tokens exceed what is left of the budget
        waits, as the first that does not fit (vLLM V1 without chunked prefill, TensorRT-LLM
        without chunked context), unless its tokens not yet computed, cached prefix or not,
        exceed the whole budget and it is the step's first admission: it then goes whole (an
        engine refuses such a prompt; one that served it had a budget that held it). (That
        count does not change while it waits: a cached prefix evicted meanwhile can keep it
        waiting longer, never let it in.)"""
        kv = self.kv
        full = self.cfg.reserve_full_sequence
        watermark = self.watermark_blocks()
        whole = self.chunk_tokens == 0
        first = True
        reserved = self.reserved_blocks()
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.next_waiting()
            if not self.fits_to_completion(req, reserved):
                break
            n, hits = self.plan_waiting(req, math.inf if whole else budget)
            if whole and n > budget and (not first or req.num_tokens - req.num_computed_tokens
                                         <= self.cfg.max_num_batched_tokens):
                break
            # (positionally: reserve, prefix, full_sequence)
            if not kv.allocate_slots(req, n, watermark if self.running else 0, hits, full):
                # (no room is made where nothing may be evicted)
                given_back = None if self.no_evict else self.make_room(out, req)
                if given_back is None:
                    break
                budget += given_back
                continue
            self.schedule_admitted(out, req, n)
            budget -= n
            first = False
            reserved = self.reserve(req, reserved)

    def make_room(self, out: SchedulerOutput, req) -> int | None:
        """`req`, next in the queue, does not fit: preempt for it and return the tokens given
        back, or None to end admission for this step (vLLM V1 never preempts for a waiting
        request)."""
        return None
