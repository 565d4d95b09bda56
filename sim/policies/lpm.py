"""`lpm`: longest prefix match first (SGLang), on top of chunked prefill.

With prefix caching on, the queue is ordered by how many of a request's prompt tokens the cache
already holds (most first, ties by arrival), so requests that share what is cached run while it
is still cached, raising the hit rate. Matching every queued request costs time, so past
`scheduler.lpm_max_queue` queued requests the policy falls back to FCFS, as SGLang does.
"""

from __future__ import annotations

from sim.policies.chunked import ChunkedPolicy


class LPMPolicy(ChunkedPolicy):
    name = "lpm"
    description = "longest prefix match first (SGLang); FCFS past lpm_max_queue queued"

    @property
    def skip_ahead_safe(self) -> bool:
        # The order follows the cache, which decode steps change (they evict cached blocks).
        return not self.waiting

    def _key(self, r):
        return (-len(self.kv.match_prefix(r)), r.arrival_time, r.req_id)

    def next_waiting(self):
        if len(self.waiting) > self.cfg.lpm_max_queue:
            return self.waiting[0]
        return min(self.waiting, key=self._key)

    def waiting_in_order(self) -> list:
        if len(self.waiting) > self.cfg.lpm_max_queue:
            return list(self.waiting)
        return sorted(self.waiting, key=self._key)

    def requeue(self, req) -> None:
        self.waiting.appendleft(req)
