"""`fcfs`: continuous batching in the style of vLLM's first engine (V0, chunked prefill off).

A step either prefills or decodes. If waiting prompts can be admitted whole (within the token
budget, `max_num_seqs`, and the free blocks minus a small watermark), the step prefills them and
decodes nothing; otherwise it decodes the whole running batch, preempting the most recently
admitted request (by recompute) while blocks run short. A prompt longer than the token budget is
admitted alone.
"""

from __future__ import annotations

import math

from sim.policies.base import Policy, SchedulerOutput


class FCFSPolicy(Policy):
    name = "fcfs"
    description = "vLLM V0: whole-prompt prefill steps, else decode steps; preempt the newest"

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.waiting:
            self.admit_prompts(out)
            if out.scheduled:
                return out
        self.schedule_running(out, math.inf)
        return out

    def decodes_alone(self) -> bool:
        return True  # (subclasses that admit otherwise say so: `static` admits only when empty)

    def admit_prompts(self, out: SchedulerOutput) -> None:
        budget = self.cfg.max_num_batched_tokens
        reserve = self.watermark_blocks() if self.running else 0
        reserved = self.reserved_blocks()
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            req = self.next_waiting()
            n, hits = self.plan_waiting(req, math.inf)
            if n > budget and out.scheduled or not self.fits_to_completion(req, reserved):
                break
            if not self.kv.allocate_slots(req, n, reserve=reserve, prefix=hits):
                break
            self.schedule_admitted(out, req, n)
            budget -= n
            reserved = self.reserve(req, reserved)
