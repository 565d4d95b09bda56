"""`sjf` in O(log n) per decision makes exactly the decisions of the plain definition: the
minimum of the queue by (aged first, oldest first; else smallest, then oldest)."""

from collections import deque

import pytest
from hypothesis import given, strategies as st

from sim import Engine
from sim.session.log import encode
from sim.policies.chunked import ChunkedPolicy
from tests.fuzz import fuzz_settings
from tests.helpers import check_invariants, small_scenario


class ReferenceSJF(ChunkedPolicy):
    """The definition, O(n) per decision: a min over the whole queue."""

    name = "sjf"

    def _key(self, r, now):
        if now - r.arrival_time >= self.cfg.sjf_aging_s:
            return (0, r.arrival_time, r.req_id)
        size = r.num_tokens - r.num_computed_tokens
        if self.cfg.sjf_key == "total":
            size += r.max_output_tokens - r.num_output_tokens
        return (1, size, r.arrival_time, r.req_id)

    def requeue(self, req):
        self.waiting.append(req)

    def next_waiting(self):
        now = self.engine.now
        return min(self.waiting, key=lambda r: self._key(r, now))

    def waiting_in_order(self):
        now = self.engine.now
        return sorted(self.waiting, key=lambda r: self._key(r, now))

    def next_change_time(self):
        bound, now = self.cfg.sjf_aging_s, self.engine.now
        return min([r.arrival_time + bound for r in self.waiting
                    if now - r.arrival_time < bound], default=float("inf"))


def pair(*overrides):
    sc = small_scenario('scheduler.policy="sjf"', *overrides)
    fast, ref = Engine(sc), Engine(sc)
    ref.policy = ReferenceSJF(ref)
    ref.policy.waiting = deque()
    return fast, ref


@pytest.mark.fuzz
@fuzz_settings(15)
@given(aging=st.sampled_from([0.05, 0.5, 3.0, 1000.0]), key=st.sampled_from(["prompt", "total"]),
       blocks=st.integers(80, 600), preemption=st.sampled_from(["recompute", "swap"]),
       seqs=st.sampled_from([1, 4, 64]), seed=st.integers(0, 1000),
       cuts=st.lists(st.tuples(st.floats(0.0, 6.0), st.integers(0, 3)), max_size=6))
def test_heap_sjf_decides_as_the_definition(aging, key, blocks, preemption, seqs, seed, cuts):
    fast, ref = pair(f"scheduler.sjf_aging_s={aging}", f'scheduler.sjf_key="{key}"',
                     f"kv.num_blocks={blocks}", f'scheduler.preemption="{preemption}"',
                     "kv.swap_space_gb=0.05", f"scheduler.max_num_seqs={seqs}", f"seed={seed}",
                     "workload.duration_s=6", "workload.rate=8",
                     'workload.output_tokens={dist="uniform", min=1, max=60}')
    for t, what in sorted(cuts):
        for e in (fast, ref):
            e.run_until(t)
            if what == 1:
                e.inject(50 + int(t * 100), 10, count=3)
            elif what == 2 and e.policy.waiting:
                e.cancel(min(r.req_id for r in e.policy.waiting))
            elif what == 3:
                e.switch_policy("chunked")
                e.switch_policy("sjf")
                if e is ref:  # the switch built a plain sjf: the reference again
                    old = e.policy
                    e.policy = ReferenceSJF(e)
                    e.policy.waiting = deque(old.waiting_in_order())
                    e.policy.running = old.running
        assert [r.req_id for r in fast.policy.waiting_in_order()] == \
               [r.req_id for r in ref.policy.waiting_in_order()]
        assert fast.policy.next_change_time() == ref.policy.next_change_time()
        check_invariants(fast)
    fast.run()
    ref.run()
    assert [encode(x) for x in fast.events] == [encode(x) for x in ref.events]
    assert fast.counts == ref.counts
