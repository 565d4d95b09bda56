"""`sjf`: shortest job first on top of chunked prefill, with an aging bound.

The queue is ordered by job size: the prompt tokens still to compute (`scheduler.sjf_key =
"prompt"`) or those plus the expected output (`"total"`; the simulator knows each request's
output length, so this is SJF with a perfect predictor). A request that has waited
`scheduler.sjf_aging_s` seconds or more goes ahead of every younger one (oldest first), so no
request starves: none waits longer than the bound plus the time to drain the requests that aged
before it.

Each decision costs O(log n) for n queued: the queue is kept in three heaps with lazy deletion
(aged requests by arrival, young ones by arrival and by size). A request's size does not change
while it waits, and the aged requests are always the oldest ones (at a given time, waiting at
least the bound is monotone in arrival time), so the next request is the top of the aged heap,
else the top of the size heap, and the next aging time is the top of the young heap's.
"""

from __future__ import annotations

import math

import heapq
from itertools import count

from sim.policies.chunked import ChunkedPolicy


class _Waiting(dict):
    """The queue as a set: req_id -> (request, serial of its live heap entries). Iterates over
    the requests in no particular order (`waiting_in_order` gives the order)."""

    def __iter__(self):
        return (req for req, _ in self.values())

    def __contains__(self, req) -> bool:
        return dict.__contains__(self, req.req_id)


class SJFPolicy(ChunkedPolicy):
    name = "sjf"
    description = "shortest job first, with an aging bound so no request starves"

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.waiting = _Waiting()
        self._aged: list = []     # (arrival, req_id, serial, request): oldest first
        self._young: list = []    # the same, for requests not yet aged
        self._by_size: list = []  # (size, arrival, req_id, serial, request): smallest first
        self._serial = count()

    def _size(self, r) -> int:
        size = r.num_tokens - r.num_computed_tokens
        if self.cfg.sjf_key == "total":
            size += r.max_output_tokens - r.num_output_tokens
        return size

    def _key(self, r, now: float):
        if now - r.arrival_time >= self.cfg.sjf_aging_s:
            return (0, r.arrival_time, r.req_id)
        return (1, self._size(r), r.arrival_time, r.req_id)

    # --- the queue -----------------------------------------------------------------------------
    def add(self, req) -> None:
        s = next(self._serial)
        dict.__setitem__(self.waiting, req.req_id, (req, s))
        entry = (req.arrival_time, req.req_id, s, req)
        if self.engine.now - req.arrival_time >= self.cfg.sjf_aging_s:
            heapq.heappush(self._aged, entry)
        else:
            heapq.heappush(self._young, entry)
        heapq.heappush(self._by_size, (self._size(req), *entry))

    requeue = add  # its place follows from its key, not its position
    add_sample = add

    def remove(self, req) -> None:
        if req in self.running:
            self.running.remove(req)
        else:
            del self.waiting[req.req_id]

    def take_waiting(self, req) -> None:
        del self.waiting[req.req_id]

    def _top(self, heap: list):
        """The heap's first live entry (stale ones, of requests gone or re-added, dropped)."""
        live = self.waiting
        while heap:
            e = heap[0]
            got = live.get(e[-3])
            if got is not None and got[1] == e[-2]:
                return e
            heapq.heappop(heap)
        return None

    def _promote(self) -> None:
        """Move the requests that have now waited the aging bound to the aged heap."""
        now, bound = self.engine.now, self.cfg.sjf_aging_s
        while (e := self._top(self._young)) is not None and now - e[0] >= bound:
            heapq.heappush(self._aged, heapq.heappop(self._young))

    def next_waiting(self):
        self._promote()
        e = self._top(self._aged) or self._top(self._by_size)
        return e[-1]

    def waiting_in_order(self) -> list:
        now = self.engine.now
        return sorted(self.waiting, key=lambda r: self._key(r, now))

    def next_change_time(self) -> float:
        self._promote()
        e = self._top(self._young)
        return math.inf if e is None else e[0] + self.cfg.sjf_aging_s
