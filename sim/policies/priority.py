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

import heapq

from sim.policies.base import SchedulerOutput
from sim.policies.chunked import ChunkedPolicy


def _key(r):
    return (r.priority, r.arrival_time, r.req_id)


def _victim_key(r):
    return (r.priority, r.arrival_time)


class WaitingHeap:
    """The waiting queue in vLLM's priority order (priority, then arrival time, then id), as a
    binary heap like vLLM's `PriorityRequestQueue`: adding a request and taking the head cost
    O(log n); taking one from the middle (a cancellation) costs O(n), as in vLLM. Iterating
    yields the requests in heap order; `in_order()` gives the queue's order."""

    __slots__ = ("_heap", "_order")

    def __init__(self) -> None:
        self._heap: list = []  # (priority, arrival_time, req_id, request); ids are unique
        self._order: list | None = None  # in_order(), until the queue changes

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self):
        return (e[-1] for e in self._heap)

    def push(self, req) -> None:
        heapq.heappush(self._heap, (*_key(req), req))
        self._order = None

    def head(self):
        """The first request in the queue's order. Raises IndexError if it is empty."""
        return self._heap[0][-1]

    def discard(self, req) -> None:
        """Take `req` out of the queue. Raises StopIteration if it is not there."""
        h = self._heap
        if h[0][-1] is req:
            heapq.heappop(h)
        else:
            i = next(i for i, e in enumerate(h) if e[-1] is req)
            h[i] = h[-1]
            h.pop()
            heapq.heapify(h)
        self._order = None

    def in_order(self) -> list:
        if self._order is None:
            self._order = [e[-1] for e in sorted(self._heap)]
        return list(self._order)


class PriorityPolicy(ChunkedPolicy):
    name = "priority"
    description = "lower priority value first; preempts the lowest-priority request for room"

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.waiting = WaitingHeap()

    def add(self, req) -> None:
        self.waiting.push(req)

    requeue = add  # a preempted request goes back to its place by its key, as in vLLM
    add_sample = add

    def remove(self, req) -> None:
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.discard(req)

    def next_waiting(self):
        return self.waiting.head()

    def take_waiting(self, req) -> None:
        self.waiting.discard(req)

    def waiting_in_order(self) -> list:
        return self.waiting.in_order()

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
