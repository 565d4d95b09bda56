"""`priority`: vLLM V1's priority scheduling on top of chunked prefill.

The queue is ordered by priority (lower value first), ties by arrival, then id. When blocks run
short for a running request, the running request with the largest (priority, arrival time) is
preempted, the first such in the batch; when that is the request itself, the requests after it
in the batch still try (`scheduler.continue_after_self_preemption`). No request is preempted to
admit a waiting one unless `scheduler.preempt_for_waiting` (vLLM V0's priority scheduling):
then, when the head of the queue does not fit while a running request of strictly lower
priority holds blocks, that request is preempted to make room.
"""

from __future__ import annotations

import bisect

from sim.policies.base import SchedulerOutput
from sim.policies.chunked import ChunkedPolicy


def _key(r):
    return (r.priority, r.arrival_time, r.req_id)


def _victim_key(r):
    return (r.priority, r.arrival_time)


class PriorityPolicy(ChunkedPolicy):
    name = "priority"
    description = "lower priority value first; preempts the lowest-priority request for room"

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
        # max() keeps the first of equals: among equal keys, the earliest in the batch
        return max(self.running, key=_victim_key)

    def make_room(self, out: SchedulerOutput, req) -> int | None:
        if not self.cfg.preempt_for_waiting:
            return None
        lower = [r for r in self.running if not r.state.is_done and _key(r) > _key(req)
                 and r.priority > req.priority]
        if not lower:
            return None
        _, given_back = self.preempt_one(out, max(lower, key=_key))
        return given_back
