"""`priority`: vLLM's priority scheduling on top of chunked prefill.

The queue is ordered by priority (lower value first), ties by arrival. When blocks run short,
the lowest-priority running request (latest arrival among equals) is preempted; and when the
request at the head of the queue cannot be admitted for lack of blocks while a running request
of strictly lower priority holds some, that request is preempted to make room.
"""

from __future__ import annotations

import bisect

from sim.policies.base import SchedulerOutput
from sim.policies.chunked import ChunkedPolicy


def _key(r):
    return (r.priority, r.arrival_time, r.req_id)


class PriorityPolicy(ChunkedPolicy):
    name = "priority"
    description = "lower priority value first; preempts lower-priority requests for higher ones"

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.waiting: list = []  # kept sorted by _key
        self._keys: list = []

    def add(self, req) -> None:
        k = _key(req)
        i = bisect.bisect(self._keys, k)
        self._keys.insert(i, k)
        self.waiting.insert(i, req)

    requeue = add

    def remove(self, req) -> None:
        if req in self.running:
            self.running.remove(req)
        else:
            self._drop(req)

    def _drop(self, req) -> None:
        i = bisect.bisect_left(self._keys, _key(req))
        del self._keys[i], self.waiting[i]

    def take_waiting(self, req) -> None:
        self._drop(req)

    def pick_victim(self):
        return max(self.running, key=_key)

    def admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            n, hits = self.plan_waiting(req, budget)
            if not self.kv.allocate_slots(req, n, prefix=hits):
                lower = [r for r in self.running if _key(r) > _key(req)
                         and r.priority > req.priority]
                if not lower:
                    break
                _, given_back = self.preempt_one(out, max(lower, key=_key))
                budget += given_back
                continue
            self.take_waiting(req)
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n
