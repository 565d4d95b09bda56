"""`sjf`: shortest job first on top of chunked prefill, with an aging bound.

The queue is ordered by job size: the prompt tokens still to compute (`scheduler.sjf_key =
"prompt"`) or those plus the expected output (`"total"`; the simulator knows each request's
output length, so this is SJF with a perfect predictor). A request that has waited
`scheduler.sjf_aging_s` seconds or more goes ahead of every younger one (oldest first), so no
request starves: none waits longer than the bound plus the time to drain the requests that aged
before it.
"""

from __future__ import annotations

from sim.policies.chunked import ChunkedPolicy


class SJFPolicy(ChunkedPolicy):
    name = "sjf"
    description = "shortest job first, with an aging bound so no request starves"

    def _key(self, r, now: float):
        if now - r.arrival_time >= self.cfg.sjf_aging_s:
            return (0, r.arrival_time, r.req_id)
        size = r.num_tokens - r.num_computed_tokens
        if self.cfg.sjf_key == "total":
            size += r.max_output_tokens - r.num_output_tokens
        return (1, size, r.arrival_time, r.req_id)

    def requeue(self, req) -> None:
        self.waiting.append(req)  # its place follows from its key, not its position

    def next_waiting(self):
        now = self.engine.now
        return min(self.waiting, key=lambda r: self._key(r, now))

    def waiting_in_order(self) -> list:
        now = self.engine.now
        return sorted(self.waiting, key=lambda r: self._key(r, now))

    def next_change_time(self) -> float:
        bound = self.cfg.sjf_aging_s
        now = self.engine.now
        young = [r.arrival_time + bound for r in self.waiting
                 if now - r.arrival_time < bound]
        return min(young, default=float("inf"))
