"""Results never depend on how time is sliced: a run in one call, in a screen's small slices and
one step at a time give the same events, blocks and figures, under every policy and across live
policy switches (the engine computes runs of identical decode steps at once; these tests are
what keeps that shortcut honest)."""

import math

import numpy as np
import pytest
from hypothesis import event, example, given, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from sim import Engine, build, summarize
from sim.errors import ServesimError
from sim.session.log import encode
from sim.policies import POLICIES
from tests.fuzz import fuzz_settings
from tests.helpers import check_cluster_invariants, check_invariants, small_scenario

POLICY_NAMES = sorted(POLICIES)
PRESSURE = ("kv.num_blocks=400", "scheduler.reserve_output_tokens=256",
            "workload.cancel_fraction=0.1", "workload.duration_s=12",
            'workload.cancel_after_s={dist="uniform", min=0, max=4}')


def state_of(e: Engine) -> tuple:
    """Everything that must agree between two ways of running the same session."""
    reqs = tuple(sorted((rid, r.state.value, r.num_computed_tokens, r.num_output_tokens,
                         tuple(r.block_table), tuple(r.host_table),
                         tuple(map(tuple, r.group_tables or ())))
                        for rid, r in e.requests.items()))
    # (a finished run in slices idles to the end of its last slice: its clock is not compared)
    return (None if e.done else e.now, e.step_count, e.policy.name, dict(e.counts), reqs,
            [r.req_id for r in e.policy.waiting_in_order()], e.kv.num_used_blocks)


def events_of(e: Engine) -> list:
    return [encode(x) for x in e.events]


def scripted(e: Engine, mode: str, script) -> Engine:
    """Run `e` through `script` ((time, action, args) in time order, then to the end), in one
    of three modes: `whole` (one run_until per action), `sliced` (a screen's 13.7 ms ticks of
    at most 5 steps) or `stepped` (one step() at a time)."""
    def reach(t):
        if mode == "whole":
            e.run_until(t)
        elif mode == "sliced":
            x = e.now
            while e.now < t and not (e.done and math.isinf(t)):
                x = min(t, x + 0.0137)
                e.run_until(x, max_steps=5)
        else:
            while e.now < t and not e.done:
                e.step()
            if e.now < t and not math.isinf(t):
                e.run_until(t)  # the idle stretch after the last request
    for t, action, args in script:
        reach(t)
        if action == "cancel":  # the oldest live request, whatever its state
            live = sorted(rid for rid, r in e.requests.items() if not r.state.is_done)
            if live:
                e.cancel(live[len(live) // 2])
        else:
            getattr(e, action)(*args)
    reach(math.inf)
    return e


def session_script(policy: str):
    """A session that injects, cancels and cycles through every other policy and back."""
    others = [p for p in POLICY_NAMES if p != policy]
    script, t = [], 0.7
    for i, p in enumerate(others + [policy]):
        script.append((t, "inject", (300 + 40 * i, 30)))
        script.append((t + 0.3, "cancel", ()))
        script.append((t + 0.6, "switch_policy", (p,)))
        t += 1.1
    script.append((t, "cancel_waiting", ()))
    return script


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_whole_sliced_and_stepped_runs_agree_under_every_policy(policy):
    sc = small_scenario(f'scheduler.policy="{policy}"', *PRESSURE)
    runs = {m: scripted(Engine(sc), m, []) for m in ("whole", "sliced", "stepped")}
    unskipped = scripted(Engine(sc, skip_ahead=False), "whole", [])
    whole = runs["whole"]
    assert whole.counts["finished"] > 50
    for m, e in [*runs.items(), ("unskipped", unskipped)]:
        assert events_of(e) == events_of(whole), m
        assert state_of(e) == state_of(whole), m
        for col in ("end", "kv_used", "kv_empty", "itl_count", "batch", "energy"):
            assert np.array_equal(e.timeline.column(col), whole.timeline.column(col)), (m, col)
    a, b = summarize(whole), summarize(unskipped)
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b
    # the shortcut did run: far fewer decisions than steps
    assert whole.timeline.n > 2 * sum(1 for x in whole.events if x.kind == "steps")


WHOLE_PROMPTS = {
    # a request that waits for room in the budget while decode steps evict its cached prefix
    "evicted prefix": ('scheduler.policy="sjf"', "scheduler.max_num_batched_tokens=64",
                       "kv.num_blocks=100", "kv.enable_prefix_caching=true",
                       "scheduler.async_scheduling=false", "scheduler.max_num_seqs=16",
                       "workload.num_requests=60", "workload.duration_s=0", "workload.rate=5",
                       'workload.output_tokens={dist="uniform", min=1, max=900}',
                       'workload.prompt_tokens={dist="uniform", min=1, max=100}',
                       'scheduler.sjf_key="total"'),
    **{policy: (f'scheduler.policy="{policy}"', *PRESSURE, "kv.enable_prefix_caching=true",
                "workload.shared_prefix_tokens=200", "workload.shared_prefix_groups=2",
                "scheduler.max_num_batched_tokens=512")
       for policy in ("chunked", "priority", "lpm")},
}


@pytest.mark.parametrize("case", sorted(WHOLE_PROMPTS))
def test_whole_sliced_and_stepped_runs_agree_with_prompts_computed_whole(case):
    """`engine.chunked_prefill = false`: a request waits for a step whose budget holds it;
    what lets it in (room in the budget, its prefix's blocks) must not change in a run of
    decode steps the engine takes without asking the policy."""
    sc = small_scenario("engine.chunked_prefill=false", *WHOLE_PROMPTS[case])
    runs = {m: scripted(Engine(sc), m, []) for m in ("whole", "sliced", "stepped")}
    unskipped = scripted(Engine(sc, skip_ahead=False), "whole", [])
    whole = runs["whole"]
    assert whole.counts["finished"] > 20 and whole.counts["preemptions"] > 0
    for m, e in [*runs.items(), ("unskipped", unskipped)]:
        assert events_of(e) == events_of(whole), m
        assert state_of(e) == state_of(whole), m
    for e in runs.values():  # (prompts whole: no prefill goes on where the last one ended)
        ended: dict[int, int] = {}
        for ev in e.events:
            if ev.kind == "steps":
                for rid, start, n in ev.prefill:
                    assert ended.get(rid) != start, (rid, start)
                    ended[rid] = start + n
                for rid in ev.decode:
                    ended.pop(rid, None)


# Layer groups (sim.engine.kv): gpt-oss's window of 128 ends runs early, Llama 4's 8192 not
GROUPS = {"gpt-oss": ('model.preset=""', 'model.config="gpt-oss-20b"'),
          "llama-4": ('model.preset=""', 'model.config="llama-4-scout"', "model.tensor_parallel=8",
                      "kv.num_blocks=1200")}  # (four tables a request)


@pytest.mark.parametrize("model", sorted(GROUPS))
@pytest.mark.parametrize("policy", ["chunked", "fcfs", "priority", "static"])
def test_whole_sliced_and_stepped_runs_agree_with_layer_groups(policy, model):
    sc = small_scenario(f'scheduler.policy="{policy}"', *PRESSURE, *GROUPS[model])
    runs = {m: scripted(Engine(sc), m, []) for m in ("whole", "sliced", "stepped")}
    unskipped = scripted(Engine(sc, skip_ahead=False), "whole", [])
    whole = runs["whole"]
    assert whole.kv.hybrid and whole.counts["finished"] > 20
    for m, e in [*runs.items(), ("unskipped", unskipped)]:
        assert events_of(e) == events_of(whole), m
        assert state_of(e) == state_of(whole), m
        for col in ("end", "kv_used", "kv_empty", "itl_count", "batch", "energy"):
            assert np.array_equal(e.timeline.column(col), unskipped.timeline.column(col)), \
                (m, col)
    # the shortcut did run: runs of several steps
    assert whole.timeline.n > 1.5 * sum(1 for x in whole.events if x.kind == "steps")
    # and mid-run every request holds the very blocks, in every group's table
    fused, plain = Engine(sc), Engine(sc, skip_ahead=False)
    for t in np.arange(0.5, 12.0, 0.5):
        fused.run_until(t)
        plain.run_until(t)
        assert state_of(fused) == state_of(plain), t
        check_invariants(fused)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_policy_switches_through_every_policy_keep_the_paths_identical(policy):
    sc = small_scenario(f'scheduler.policy="{policy}"', *PRESSURE)
    script = session_script(policy)
    runs = {m: scripted(Engine(sc), m, script) for m in ("whole", "sliced", "stepped")}
    runs["unskipped"] = scripted(Engine(sc, skip_ahead=False), "whole", script)
    whole = runs["whole"]
    switches = [x for x in whole.events if x.kind == "action" and x.action == "switch_policy"]
    assert len(switches) == len(POLICY_NAMES)
    for m, e in runs.items():
        assert events_of(e) == events_of(whole), m
        assert state_of(e) == state_of(whole), m
        check_invariants(e)
        assert e.kv.num_free_blocks == e.kv.num_blocks


CLOSED_LOOP = ("workload.concurrency=12", "workload.num_requests=150", "workload.turns=3",
               "workload.think_time_s=0.4", "workload.ramp_up_s=1.5",
               "kv.enable_prefix_caching=true", "admission.rate=6", "admission.burst=3")


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_closed_loop_runs_agree_however_time_is_sliced(policy):
    # the users' next arrivals are known only when requests end: runs of decode steps must stop
    # at a finish and pick the new arrival up at its time, whatever the slicing
    sc = small_scenario(f'scheduler.policy="{policy}"', *PRESSURE[1:3], *CLOSED_LOOP)
    script = [a for a in session_script(policy) if a[1] != "switch_policy"]
    runs = {m: scripted(Engine(sc), m, script) for m in ("whole", "sliced", "stepped")}
    unskipped = scripted(Engine(sc, skip_ahead=False), "whole", script)
    whole = runs["whole"]
    assert whole.counts["finished"] > 25 and whole.counts["rejected"] > 0
    for m, e in [*runs.items(), ("unskipped", unskipped)]:
        assert events_of(e) == events_of(whole), m
        assert state_of(e) == state_of(whole), m


def test_contiguous_reservations_take_no_further_blocks_while_decoding():
    # The bug this file was written for: a run of decode steps allocated a block per boundary
    # crossed, as paged tables need, on top of a contiguous reservation that already held them.
    sc = small_scenario('scheduler.policy="contiguous"', "kv.num_blocks=400",
                        "scheduler.reserve_output_tokens=256")
    e = Engine(sc)
    seen = set()
    while not e.done:
        e.run_until(math.inf, max_steps=40)
        for r in e.policy.running:
            reserved = min(r.prompt_len + max(r.max_output_tokens, 256), 400 * 16)
            assert len(r.block_table) == -(-reserved // 16), r
            seen.add(r.req_id)
    assert len(seen) > 20


# ================================================================== the state machine (fuzzer)
class Lockstep(RuleBasedStateMachine):
    """Three engines on one scenario, driven by the same random interleaving of injections,
    cancellations, policy switches, single steps and runs of time: one runs each stretch in one
    call, one one step at a time (no skip-ahead), one in random slices with random step caps.
    After every rule they must agree exactly and every block must be accounted for."""

    @initialize(policy=st.sampled_from(POLICY_NAMES),
                blocks=st.integers(24, 240), block_size=st.sampled_from([4, 16, 16, 32]),
                preemption=st.sampled_from(["recompute", "swap"]),
                caching=st.booleans(), samples=st.sampled_from([1, 1, 3]),
                budget=st.sampled_from([64, 512, 2048]), seqs=st.sampled_from([2, 8, 256]),
                seed=st.integers(0, 2**16))
    def setup(self, policy, blocks, block_size, preemption, caching, samples, budget, seqs, seed):
        sc = small_scenario(
            f'scheduler.policy="{policy}"', f"kv.num_blocks={blocks}",
            f"kv.block_size={block_size}", f'scheduler.preemption="{preemption}"',
            "kv.swap_space_gb=0.05", f"kv.enable_prefix_caching={str(caching).lower()}",
            f"workload.num_samples={samples}", f"scheduler.max_num_batched_tokens={budget}",
            f"scheduler.max_num_seqs={seqs}", "scheduler.reserve_output_tokens=64",
            f"seed={seed}", "workload.duration_s=3", "workload.rate=8",
            'workload.prompt_tokens={dist="uniform", min=1, max=200}',
            'workload.output_tokens={dist="uniform", min=1, max=150}',
            "workload.cancel_fraction=0.2",
            'workload.cancel_after_s={dist="uniform", min=0, max=2}',
            'workload.priority={dist="choice", values=[0, 1, 2]}')  # (priority preempts)
        self.whole, self.stepped, self.sliced = (Engine(sc), Engine(sc, skip_ahead=False),
                                                 Engine(sc))
        self.all = (self.whole, self.stepped, self.sliced)

    def _each(self, fn):
        """Apply `fn` to every engine; an error must be the same error in each."""
        outcomes = []
        for e in self.all:
            try:
                outcomes.append(("ok", fn(e)))
            except ServesimError as err:
                outcomes.append(("error", str(err)))
        assert outcomes.count(outcomes[0]) == 3, outcomes

    @rule(dt=st.floats(0.0, 1.5), data=st.data())
    def run_for(self, dt, data):
        t = self.whole.now + dt
        self.whole.run_until(t)
        self.stepped.run_until(t)
        e = self.sliced
        for _ in range(100000):
            if e.now >= t:
                break
            x = min(t, e.now + data.draw(st.floats(1e-4, 0.3), label="slice"))
            e.run_until(x, max_steps=data.draw(st.integers(1, 40), label="cap"))
        # The last slice ends at t, as the others' one call does: a deployment brings its idle
        # instances' clocks there (they may lag while a busy one's step ends past t).
        e.run_until(t)

    @rule(n=st.integers(1, 200), data=st.data())
    def run_steps(self, n, data):
        self.whole.run_until(math.inf, n)
        self.stepped.run_until(math.inf, n)
        left = n
        while left > 0:
            k = data.draw(st.integers(1, left), label="piece")
            if self.sliced.run_until(math.inf, k) < k:
                break  # nothing left to run
            left -= k

    @rule()
    def step(self):
        self._each(lambda e: e.step())

    @rule(prompt=st.integers(1, 600), output=st.integers(1, 120), priority=st.integers(-2, 2),
          count=st.integers(1, 4), text=st.one_of(st.none(), st.binary(min_size=1, max_size=80)))
    def inject(self, prompt, output, priority, count, text):
        self._each(lambda e: e.inject(None if text else prompt, output, priority=priority,
                                      prompt_text=text, count=count))

    @precondition(lambda self: any(not r.state.is_done for r in self.whole.requests.values()))
    @rule(data=st.data())
    def cancel(self, data):
        live = sorted(rid for rid, r in self.whole.requests.items() if not r.state.is_done)
        rid = data.draw(st.sampled_from(live), label="req_id")
        self._each(lambda e: e.cancel(rid))

    @rule()
    def cancel_waiting(self):
        self._each(lambda e: e.cancel_waiting())

    @rule(name=st.sampled_from(POLICY_NAMES))
    def switch(self, name):
        self._each(lambda e: e.switch_policy(name))

    def teardown(self):
        if hasattr(self, "all"):  # what the run went through, for --hypothesis-show-statistics
            c = self.whole.counts
            for k in ("preemptions", "swaps", "cancelled", "rejected", "finished_samples",
                      "fragmentation_stalls"):
                if c.get(k):
                    event(f"had {k}")
            if any(x.kind == "action" and x.action == "switch_policy" for x in self.whole.events):
                event("switched policy")

    @invariant()
    def agree(self):
        if not hasattr(self, "all"):
            return
        want = state_of(self.whole)
        assert state_of(self.stepped) == want
        assert state_of(self.sliced) == want
        ev = events_of(self.whole)
        assert events_of(self.stepped) == ev and events_of(self.sliced) == ev
        for e in self.all:
            check_invariants(e)


class DeploymentLockstep(Lockstep):
    """The same, for deployments of several engines: replicas behind a router, a
    disaggregated prefill/decode pair or `replicas - 1` prefill and `replicas` decode
    instances, data-parallel ranks in lockstep, or pipeline stages with virtual engines."""

    @initialize(kind=st.sampled_from(["replicas", "disaggregated", "disaggregated P:D",
                                      "data-parallel", "pipeline"]),
                policy=st.sampled_from([p for p in POLICY_NAMES if p != "contiguous"]),
                replicas=st.integers(2, 3), router=st.sampled_from(
                    ["round-robin", "least-outstanding", "least-kv", "prefix-affinity"]),
                blocks=st.integers(40, 240), preemption=st.sampled_from(["recompute", "swap"]),
                caching=st.booleans(), seed=st.integers(0, 2**16))
    def setup(self, kind, policy, replicas, router, blocks, preemption, caching, seed):
        layout = {"data-parallel": [f"model.data_parallel={replicas}",
                                    f'cluster.dp_router="{router}"'],
                  "pipeline": ["model.pipeline_parallel=4", f"model.virtual_engines={replicas}"],
                  "disaggregated P:D": [f"cluster.prefill_instances={replicas - 1}",
                                        f"cluster.decode_instances={replicas}"]}
        disaggregated = kind.startswith("disaggregated")
        sc = small_scenario(
            f'scheduler.policy="{"disaggregated" if disaggregated else policy}"',
            f"cluster.replicas={replicas if kind == 'replicas' else 1}",
            *layout.get(kind, ()),
            f'cluster.router="{router}"', f"kv.num_blocks={blocks}",
            f'scheduler.preemption="{preemption}"', "kv.swap_space_gb=0.05",
            f"kv.enable_prefix_caching={str(caching).lower()}", f"seed={seed}",
            "workload.duration_s=3", "workload.rate=8",
            'workload.prompt_tokens={dist="uniform", min=1, max=200}',
            'workload.output_tokens={dist="uniform", min=1, max=150}',
            "workload.cancel_fraction=0.2",
            'workload.cancel_after_s={dist="uniform", min=0, max=2}')
        self.whole, self.stepped, self.sliced = (build(sc), build(sc, skip_ahead=False),
                                                 build(sc))
        self.all = (self.whole, self.stepped, self.sliced)

    def run_steps(self):
        """Not a rule here: a deployment's step budget is shared by its instances, and where a
        budget ends depends on how their decisions were batched (time cuts do not)."""

    @invariant()
    def agree(self):
        if not hasattr(self, "all"):
            return
        want = deployment_state(self.whole)
        assert deployment_state(self.stepped) == want
        assert deployment_state(self.sliced) == want
        for d in self.all:
            check_cluster_invariants(d)


def deployment_state(d) -> tuple:
    reqs = tuple(sorted((rid, r.state.value, r.num_computed_tokens, r.num_output_tokens,
                         tuple(r.block_table)) for rid, r in d.requests.items()))
    return (None if d.done else d.position(), d.step_count, d.counts, reqs,
            [encode(x) for x in d.log_events()])


TestLockstep = Lockstep.TestCase
TestLockstep.settings = fuzz_settings(25, stateful_step_count=30)
TestLockstep = pytest.mark.fuzz(TestLockstep)
TestDeploymentLockstep = DeploymentLockstep.TestCase
TestDeploymentLockstep.settings = fuzz_settings(15, stateful_step_count=30)
TestDeploymentLockstep = pytest.mark.fuzz(TestDeploymentLockstep)


def test_decode_runs_cut_at_their_longest_give_the_same_session(monkeypatch):
    # A stretch of decode steps longer than RUN_STEPS_MAX is several runs (bounded memory).
    sc = small_scenario('scheduler.policy="chunked"', *PRESSURE)
    whole = scripted(Engine(sc), "whole", [])
    monkeypatch.setattr(Engine, "RUN_STEPS_MAX", 7)
    cut = scripted(Engine(sc), "whole", [])
    assert events_of(cut) == events_of(whole) and state_of(cut) == state_of(whole)
    for col in ("end", "kv_used", "itl_count", "energy"):
        assert np.array_equal(cut.timeline.column(col), whole.timeline.column(col)), col


def counting_schedule(e: Engine) -> list:
    """Count the engine's calls of its policy's `schedule` (one per decision it had to make)."""
    calls, schedule = [], e.policy.schedule

    def counted():
        calls.append(1)
        return schedule()
    e.policy.schedule = counted
    return calls


@pytest.mark.fuzz
@fuzz_settings(12)
@given(policy=st.sampled_from(POLICY_NAMES), seed=st.integers(0, 10**6),
       rate=st.floats(1.0, 12.0), blocks=st.integers(300, 3000), seqs=st.integers(1, 48),
       budget=st.sampled_from([256, 700, 2048]))
# (a run of one step right after async scheduling released a finished request's blocks)
@example(policy="chunked", seed=17, rate=7.0, blocks=300, seqs=5, budget=256)
def test_decode_runs_that_follow_without_a_decision_equal_single_steps(policy, seed, rate,
                                                                         blocks, seqs, budget):
    # After a prefill step, or a run that ended with requests finishing, while nothing arrives
    # and the queue is empty the engine runs the batch's decode steps without asking the
    # policy (sim.engine.stepping.decodes_follow). Random pressure: short pools (preemption at the first
    # step of such a run), few seats, small token budgets, cancellations.
    sc = small_scenario(f'scheduler.policy="{policy}"', f"seed={seed}", f"workload.rate={rate}",
                        f"kv.num_blocks={blocks}", f"scheduler.max_num_seqs={seqs}",
                        f"scheduler.max_num_batched_tokens={budget}", "workload.duration_s=8",
                        "scheduler.reserve_output_tokens=256", "workload.cancel_fraction=0.1",
                        'workload.cancel_after_s={dist="uniform", min=0, max=4}')
    fused = Engine(sc)
    calls = counting_schedule(fused)
    fused.run()
    plain = Engine(sc, skip_ahead=False)
    plain.run()
    assert events_of(fused) == events_of(plain)
    assert state_of(fused) == state_of(plain)
    for col in ("end", "dur", "kv_used", "kv_empty", "itl_count", "batch", "energy", "waiting"):
        assert np.array_equal(fused.timeline.column(col), plain.timeline.column(col)), col
    a, b = summarize(fused), summarize(plain)
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b
    runs = sum(1 for x in fused.events if x.kind == "steps")
    event(f"decisions skipped: {'some' if len(calls) < runs else 'none'}")


def test_decisions_are_skipped_where_nothing_is_left_to_decide():
    sc = small_scenario("kv.num_blocks=0", "workload.rate=4")  # (blocks to spare: chat's load)
    e = Engine(sc)
    calls = counting_schedule(e)
    e.run()
    runs = sum(1 for x in e.events if x.kind == "steps")  # (one per prefill step or run)
    assert len(calls) < 0.7 * runs
    stepped = Engine(sc, skip_ahead=False)
    stepped.run()
    assert events_of(e) == events_of(stepped) and state_of(e) == state_of(stepped)


def test_a_decode_run_does_not_pass_a_hand_off_the_prefill_instance_is_about_to_make():
    """Found by TestDeploymentLockstep: the decode instance of a disaggregated pair ran a
    decode run past the next arrival at its idle prefill instance, which handed that request
    off one prefill step later; step by step the decode instance took it earlier."""
    sc = small_scenario('scheduler.policy="disaggregated"', "kv.num_blocks=40", "seed=0",
                        'scheduler.preemption="recompute"', "kv.swap_space_gb=0.05",
                        "workload.duration_s=3", "workload.rate=8",
                        'workload.prompt_tokens={dist="uniform", min=1, max=200}',
                        'workload.output_tokens={dist="uniform", min=1, max=150}',
                        "workload.cancel_fraction=0.2",
                        'workload.cancel_after_s={dist="uniform", min=0, max=2}')
    whole, stepped = build(sc), build(sc, skip_ahead=False)
    for d in (whole, stepped):  # the fuzzer's shrunk sequence
        d.step()
        d.cancel_waiting()
        d.cancel(0)
        d.inject(433, 13, priority=0, count=1)
        for _ in range(3):
            d.step()
        d.cancel_waiting()
    assert deployment_state(stepped) == deployment_state(whole)
    t = whole.now + 0.125
    whole.run_until(t)
    stepped.run_until(t)
    assert deployment_state(stepped) == deployment_state(whole)


@pytest.mark.parametrize("policy", ["chunked", "fcfs"])
def test_decode_runs_of_a_model_with_sliding_window_layers_equal_single_steps(policy):
    # A run of decode steps is timed by the batch's total context: with windowed layers it
    # stops where a sequence would pass the window, and single steps time each one's part.
    win = ("model.sliding_window=96", "model.sliding_window_layers=16")
    sc = small_scenario(f'scheduler.policy="{policy}"', *win, *PRESSURE)
    fused = Engine(sc)
    fused.run()
    plain = Engine(sc, skip_ahead=False)
    plain.run()
    assert events_of(fused) == events_of(plain) and state_of(fused) == state_of(plain)
    for col in ("end", "dur", "kv_used", "energy"):
        assert np.array_equal(fused.timeline.column(col), plain.timeline.column(col)), col
    full = Engine(small_scenario(f'scheduler.policy="{policy}"', *PRESSURE), skip_ahead=False)
    full.run()  # (the same steps cost more when every layer attends the whole context)
    assert fused.timeline.column("end")[-1] < full.timeline.column("end")[-1]
