"""`chunked`: vLLM V1 / Sarathi-Serve scheduling.

Running requests go first (decodes, and the next chunk of any prompt still prefilling), then
waiting requests fill what is left of the token budget (`max_num_batched_tokens`), so a long
prompt is prefilled over several steps while decodes keep flowing. When blocks run short, the
most recently admitted request is preempted; no new request is admitted in a step that preempted.
"""

from __future__ import annotations

from sim.policies.base import Policy, SchedulerOutput


class ChunkedPolicy(Policy):
    name = "chunked"
    description = "vLLM V1 / Sarathi-Serve: decodes first, prefill chunks fill the token budget"

    def schedule(self) -> SchedulerOutput:
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

    def admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.next_waiting()
            n, hits = self.plan_waiting(req, budget)
            if not self.kv.allocate_slots(req, n, prefix=hits):
                break
            self.take_waiting(req)
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n
