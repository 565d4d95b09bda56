"""Memory behaviours of the engine: swap, prefix caching, parallel sampling, and cancellation
in every state returning every block exactly once."""

from hypothesis import given, settings, strategies as st

from sim import Engine, summarize
from sim.engine.request import RequestState as S
from tests.helpers import check_invariants, small_scenario, workload_of


def steps(e, limit=20000):
    while not e.done and limit:
        e.step()
        check_invariants(e)
        limit -= 1


def test_swap_moves_blocks_to_host_and_back():
    sc = small_scenario("scheduler.preemption=\"swap\"", "kv.num_blocks=24", "kv.block_size=16",
                        "kv.swap_space_gb=1")
    e = Engine(sc, workload=workload_of([(0.0, 100, 150), (0.001, 100, 150), (0.002, 16, 4)]))
    seen_swapped = False
    while not e.done:
        e.step()
        check_invariants(e)
        for r in e.policy.waiting:
            if r.state is S.SWAPPED:
                seen_swapped = True
                assert r.block_table == [] and r.host_table
                assert r.num_computed_tokens > 0  # nothing to recompute
    assert seen_swapped and e.counts["swaps"] > 0
    assert all(x.mode == "swap" for x in e.events if x.kind == "preempt")
    assert e.kv.host.num_free == e.kv.host.num_blocks
    # a resumed request decodes at once: no prefill chunk after its swap
    for r in e.requests.values():
        assert len(r.prefill_chunks) == 1


def test_full_host_pool_falls_back_to_recompute():
    sc = small_scenario("scheduler.preemption=\"swap\"", "kv.num_blocks=24", "kv.block_size=16",
                        "kv.swap_space_gb=0.00001")  # room for a handful of blocks only
    e = Engine(sc, workload=workload_of([(0.0, 100, 150), (0.001, 100, 150), (0.002, 16, 4)]))
    steps(e)
    modes = {x.mode for x in e.events if x.kind == "preempt"}
    assert "recompute" in modes


def test_swap_costs_time_over_the_host_link():
    rows = [(0.0, 100, 150), (0.001, 100, 150), (0.002, 16, 4)]
    fast = Engine(small_scenario("scheduler.preemption=\"swap\"", "kv.num_blocks=24",
                                 "kv.block_size=16", "hardware.pcie_gbps=64"),
                  workload=workload_of(rows))
    slow = Engine(small_scenario("scheduler.preemption=\"swap\"", "kv.num_blocks=24",
                                 "kv.block_size=16", "hardware.pcie_gbps=0.5"),
                  workload=workload_of(rows))
    fast.run()
    slow.run()
    assert fast.counts["swaps"] == slow.counts["swaps"] > 0
    assert slow.now > fast.now


def test_prefix_hits_share_blocks_and_count():
    sc = small_scenario("kv.enable_prefix_caching=true", "kv.block_size=16")
    e = Engine(sc, workload=workload_of([(0.0, 8, 1)]))
    e.run()
    [a] = e.inject(prompt_text=b"system prompt " * 20, max_output_tokens=50)
    e.step()
    e.step()
    [b] = e.inject(prompt_text=b"system prompt " * 20 + b"and more", max_output_tokens=5)
    [c] = e.inject(prompt_text=b"another prompt " * 20, max_output_tokens=5)
    e.step()
    check_invariants(e)
    ra, rb, rc = e.get(a), e.get(b), e.get(c)
    shared = 280 // 16  # full blocks of the common text
    assert rb.block_table[:shared] == ra.block_table[:shared]
    assert all(e.kv.pool.ref_cnt[x] == 2 for x in rb.block_table[:shared])
    assert rb.num_cached_tokens == shared * 16
    assert rc.num_cached_tokens == 0 and not set(rc.block_table) & set(ra.block_table)
    e.run()
    s = summarize(e)["prefix_cache"]
    assert s["hit_tokens"] == shared * 16 and 0 < s["hit_rate"] < 1
    # finished requests' blocks stay cached (free, reusable) until evicted
    assert e.kv.num_used_blocks == 0 and e.snapshot().free_cached_blocks > 0


def test_recompute_after_preemption_hits_its_own_cached_blocks():
    sc = small_scenario("kv.enable_prefix_caching=true", "kv.num_blocks=30", "kv.block_size=16")
    e = Engine(sc, workload=workload_of([(0.0, 100, 200), (0.001, 100, 200), (0.002, 64, 4)]))
    steps(e)
    resumed = [r for r in e.requests.values() if r.num_preemptions]
    assert resumed and any(r.num_cached_tokens > 0 for r in resumed)


def test_parallel_samples_share_prompt_blocks_copy_on_write():
    sc = small_scenario("workload.num_samples=3", "kv.block_size=16")
    e = Engine(sc, workload=workload_of([(0.0, 40, 6)]))
    while not any(x.kind == "fork" for x in e.events):
        e.step()
    check_invariants(e)
    parent = e.get(0)
    kids = [r for r in e.requests.values() if r.parent_id == 0]
    assert len(kids) == 2
    for k in kids:
        assert k.block_table[:2] == parent.block_table[:2]  # two full blocks, shared
        assert k.block_table[2] != parent.block_table[2]    # the partial one, copied
    assert all(e.kv.pool.ref_cnt[b] == 3 for b in parent.block_table[:2])
    assert e._copies and {c[0] for c in e._copies} == {parent.block_table[2]}
    steps(e)
    assert e.counts["finished"] == 1 and e.counts["finished_samples"] == 2
    assert summarize(e)["output_tokens"] == 18
    assert e.kv.num_used_blocks == 0


def test_cancelling_a_request_cancels_its_samples():
    e = Engine(small_scenario("workload.num_samples=2"), workload=workload_of([(0.0, 40, 50)]))
    while not any(x.kind == "fork" for x in e.events):
        e.step()
    e.cancel(0)
    check_invariants(e)
    assert all(r.state is S.CANCELLED for r in e.requests.values())
    assert e.kv.num_used_blocks == 0


@settings(max_examples=25, deadline=None)
@given(data=st.data(), preemption=st.sampled_from(["recompute", "swap"]),
       caching=st.booleans(), samples=st.integers(1, 2),
       policy=st.sampled_from(["fcfs", "chunked", "priority", "sjf", "lpm", "contiguous"]))
def test_cancel_in_any_state_returns_every_block_once(data, preemption, caching, samples,
                                                      policy):
    sc = small_scenario(f"scheduler.policy=\"{policy}\"", f"scheduler.preemption=\"{preemption}\"",
                        f"kv.enable_prefix_caching={str(caching).lower()}",
                        f"workload.num_samples={samples}", "kv.num_blocks=48",
                        "kv.block_size=16", "kv.swap_space_gb=0.01",
                        "scheduler.max_num_batched_tokens=96",
                        "workload.shared_prefix_tokens=48", "workload.shared_prefix_groups=2",
                        "workload.prompt_tokens={dist=\"uniform\", min=8, max=200}",
                        "workload.output_tokens={dist=\"uniform\", min=4, max=120}",
                        "workload.num_requests=14", "workload.duration_s=0", "workload.rate=40",
                        "scheduler.reserve_output_tokens=64")
    e = Engine(sc)
    cancelled_in = set()
    for _ in range(3000):
        if e.done:
            break
        e.step()
        check_invariants(e)
        live = [r for r in e.requests.values() if not r.state.is_done]
        if live and data.draw(st.integers(0, 9), label="cancel?") == 0:
            r = data.draw(st.sampled_from(sorted(live, key=lambda r: r.req_id)), label="which")
            state = (r.state, r.state is S.RUNNING and r.is_prefill)
            e.cancel(r.req_id)
            cancelled_in.add(state)
            check_invariants(e)
    e.run()
    check_invariants(e)
    assert e.kv.num_used_blocks == 0
    if e.kv.host is not None:
        assert e.kv.host.num_used == 0


def test_cancelling_the_queue_cancels_a_request_and_its_waiting_samples_once():
    # Found by the lockstep fuzzer: a request's samples queued after it were cancelled with it,
    # then again on their own.
    sc = small_scenario("kv.num_blocks=202", "kv.block_size=4", "workload.num_samples=3",
                        "scheduler.max_num_batched_tokens=64", "scheduler.max_num_seqs=8",
                        "kv.enable_prefix_caching=true", "seed=0", "workload.duration_s=3",
                        "workload.rate=8",
                        'workload.prompt_tokens={dist="uniform", min=1, max=200}',
                        'workload.output_tokens={dist="uniform", min=1, max=150}')
    e = Engine(sc)

    def parent_and_sample_queued():
        waiting = e.policy.waiting_in_order()
        return any(r.parent_id is not None and e.get(r.parent_id) in waiting for r in waiting)

    for _ in range(2000):  # step to a moment with a request and one of its samples queued
        e.run_until(float("inf"), 1)
        if parent_and_sample_queued():
            break
    assert parent_and_sample_queued()
    waiting = e.policy.waiting_in_order()
    ids = e.cancel_waiting()
    assert sorted(ids) == sorted(r.req_id for r in waiting)
    assert all(e.get(i).state is S.CANCELLED for i in ids) and not e.policy.waiting
    check_invariants(e)
    e.run()
    assert e.kv.num_free_blocks == e.kv.num_blocks


def test_a_contiguous_reservation_swapped_out_moves_only_the_blocks_holding_its_kv():
    # Found by the lockstep fuzzer: under `contiguous` a paged request (admitted before a
    # switch) that runs short preempts the newest, a reservation; swapping it copied every
    # reserved block to host memory, empty ones too.
    sc = small_scenario('scheduler.preemption="swap"', "kv.num_blocks=40", "kv.block_size=16",
                        "kv.swap_space_gb=1", "scheduler.reserve_output_tokens=200")
    e = Engine(sc, workload=workload_of([(0.0, 100, 500)]))  # paged: grows to 38 blocks
    e.run_until(0.05)
    e.switch_policy("contiguous")
    [r] = e.inject(20, 400)  # reserves 20 + 400 slots: 27 blocks in one run
    swapped = None
    while not e.done:
        e.step()
        check_invariants(e)
        if e.get(r).state is S.SWAPPED:
            swapped = list(e.get(r).host_table)
            need = -(-e.get(r).num_computed_tokens // 16)
            assert len(swapped) == need < 27
    assert swapped is not None and e.counts["swaps"] >= 1
    assert e.get(r).state is S.FINISHED and e.kv.num_free_blocks == e.kv.num_blocks


def test_only_sizes_that_could_matter_read_what_the_machine_has(monkeypatch):
    # (a server checks every request it is sent: reading /proc and the cgroup files each time
    # was 3.4% of its samples at 500 streams)
    import pytest

    import sim.limits
    from sim.errors import ScenarioError

    reads = []
    monkeypatch.setattr(sim.limits, "available_memory", lambda: reads.append(1) or 1e8)
    e = Engine(small_scenario())
    e.inject(100, 128)
    assert reads == []
    with pytest.raises(ScenarioError, match="max_output_tokens = 1000000: needs about 0.2 GB"):
        e.inject(100, 1_000_000)
    assert reads == [1]
