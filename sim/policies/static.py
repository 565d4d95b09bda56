"""`static`: request-level batching, the baseline before continuous batching.

When the batch is empty, take up to `max_num_seqs` waiting requests (whose prompts fit in free
blocks), prefill them together, then decode until every one of them has finished; only then admit
more. Finished requests leave the batch, but their seats stay empty until the whole batch is done.
"""

from __future__ import annotations

import math

from sim.policies.fcfs import FCFSPolicy
from sim.policies.base import SchedulerOutput


class StaticPolicy(FCFSPolicy):
    name = "static"
    description = "request-level batching: admit a batch only when the last one has finished"

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if not self.running:
            self.admit_batch(out)
            if out.scheduled:
                return out
        self.schedule_running(out, math.inf)
        return out

    def admit_batch(self, out: SchedulerOutput) -> None:
        reserved = 0  # (nothing runs)
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            req = self.next_waiting()
            n, hits = self.plan_waiting(req, math.inf)
            if not self.fits_to_completion(req, reserved):
                break
            if not self.kv.allocate_slots(req, n, prefix=hits):
                break
            self.schedule_admitted(out, req, n)
            reserved = self.reserve(req, reserved)
