"""The engine with real attention (NumPy backend): scheduling changes timing and memory, never
the tokens a request produces."""

import numpy as np
import pytest

from sim import Engine, build, summarize
from sim.session.log import read_log, write_log
from sim.session.replay import verify
from tests.helpers import check_invariants, small_scenario, workload_of
from tui.cli import main
from tui.compute import make_executor

ROWS = [(0.0, 40, 24), (0.0, 75, 20), (0.01, 130, 18), (0.02, 33, 30), (0.03, 300, 12),
        (0.04, 17, 25), (0.05, 64, 22)]


def run(*overrides, rows=ROWS, only=None, executor_overrides=()):
    sc = small_scenario("compute.backend=\"numpy\"", "kv.block_size=16", *overrides)
    w = workload_of([rows[i] for i in only] if only is not None else rows)
    e = Engine(sc, workload=w, executor=make_executor(sc))
    while not e.done:
        e.step()
        check_invariants(e)
    return e


def tokens(e, rid):
    return e.get(rid).output_token_ids


@pytest.fixture(scope="module")
def reference():
    return run()


def test_tokens_are_real_and_complete(reference):
    for rid, r in reference.requests.items():
        assert len(r.output_token_ids) == r.max_output_tokens
        assert all(0 <= t < 256 for t in r.output_token_ids)
    # different prompts give different continuations: the tokens are not a constant
    assert len({tuple(r.output_token_ids) for r in reference.requests.values()}) > 1


TEXTS = [b"The KV cache is paged.", b"Continuous batching admits requests every step " * 3,
         b"short", b"x" * 70]


MOE = ("compute.num_experts=4", "compute.experts_per_token=2")


@pytest.mark.parametrize("model", [(), MOE], ids=["dense", "moe"])
def test_same_tokens_alone_as_batched(model):
    """A typed prompt's tokens are its bytes, whatever its request id; the tiny MoE model's
    too, whichever tokens share its experts."""
    alone = []
    for text in TEXTS:
        e = run(*model, rows=[(0.0, 8, 1)])
        e.run()
        [rid] = e.inject(prompt_text=text, max_output_tokens=20)
        e.run()
        alone.append(tokens(e, rid))
    busy = run(*model, rows=ROWS + [(0.5 + 0.01 * i, 50, 40) for i in range(8)])
    # the same prompts injected into a busy engine, each mid-batch
    sc_engine = Engine(busy.scenario, workload=busy.workload, executor=make_executor(busy.scenario))
    sc_engine.run_until(0.2)
    ids = [sc_engine.inject(prompt_text=t, max_output_tokens=20)[0] for t in TEXTS]
    sc_engine.run()
    assert max(len(s.decode) for s in sc_engine.events if s.kind == "steps") > len(TEXTS)
    for rid, want in zip(ids, alone):
        assert tokens(sc_engine, rid) == want


def test_same_tokens_after_preemption_by_recompute_and_swap(reference):
    for mode in ("recompute", "swap"):
        e = run("kv.num_blocks=30", f"scheduler.preemption=\"{mode}\"", "kv.swap_space_gb=1")
        assert e.counts["preemptions"] > 0, mode
        if mode == "swap":
            assert e.counts["swaps"] > 0
        for rid in range(len(ROWS)):
            assert tokens(e, rid) == tokens(reference, rid), (mode, rid)


def test_same_tokens_chunked_and_whole_prefill(reference):
    chunked = run("scheduler.policy=\"chunked\"", "scheduler.max_num_batched_tokens=48")
    whole = run("scheduler.policy=\"fcfs\"")
    assert any(len(r.prefill_chunks) > 2 for r in chunked.requests.values())
    for rid in range(len(ROWS)):
        assert tokens(chunked, rid) == tokens(reference, rid) == tokens(whole, rid)


def test_same_tokens_with_prefix_caching():
    # requests sharing a system prompt: with caching it is computed once, read by every sharer
    base = ("workload.shared_prefix_tokens=96", "workload.shared_prefix_groups=2",
            "workload.num_requests=8", "workload.duration_s=0", "workload.rate=50",
            "workload.prompt_tokens={dist=\"uniform\", min=20, max=60}",
            "workload.output_tokens=16", "compute.backend=\"numpy\"")
    runs = {}
    for caching in ("false", "true"):
        sc = small_scenario(*base, f"kv.enable_prefix_caching={caching}")
        e = Engine(sc, executor=make_executor(sc))
        while not e.done:
            e.step()
            check_invariants(e)
        runs[caching] = e
    assert summarize(runs["true"])["prefix_cache"]["hit_tokens"] >= 6 * 96 // 16 * 16 // 2
    assert summarize(runs["false"])["prefix_cache"]["hit_tokens"] == 0
    for rid in range(8):
        assert tokens(runs["true"], rid) == tokens(runs["false"], rid), rid


def test_verify_option_runs_clean():
    e = run("compute.verify_every=1")
    assert e.counts["finished"] == len(ROWS)


def test_measured_clock_moves_by_wall_time():
    e = run("compute.clock=\"measured\"", only=[0, 1])
    dur = e.timeline.column("dur")
    assert np.all(dur > 0) and dur.max() < 5.0
    modeled = run(only=[0, 1])
    assert not np.array_equal(dur, modeled.timeline.column("dur"))


def test_log_replay_regenerates_the_tokens(tmp_path):
    e = run("workload.duration_s=1")
    log = read_log(write_log(tmp_path / "c.msgpack", e))
    steps = [x for x in log.events if x.kind == "steps"]
    assert any(x.tokens for x in steps)
    _, div = verify(log, make_executor)
    assert div is None


def test_cli_compute_errors_are_one_line(capsys):
    code = main(["sim", "chat", "--compute", "cupy", "--set", "workload.duration_s=1"])
    err = capsys.readouterr().err
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    assert code == 2 and err.count("\n") == 1 and "compute.backend = 'cupy'" in err


def test_moe_tokens_are_the_same_preempted_and_on_ranks_or_virtual_engines(tmp_path):
    """The tiny MoE model: each request's tokens are the same after preemption, on either of
    two data-parallel ranks and on either of two pipeline virtual engines (each its own
    executor and pool) as in one batch; its experts change the tokens (they are not the dense
    model's)."""
    batched = run(*MOE)
    dense = run()
    assert any(tokens(batched, rid) != tokens(dense, rid) for rid in range(len(ROWS)))
    assert "4 experts (top 2)" in batched.executor.describe()
    squeezed = run(*MOE, "kv.num_blocks=30")
    assert squeezed.counts["preemptions"] > 0
    for rid in range(len(ROWS)):
        assert tokens(batched, rid) == tokens(squeezed, rid), rid
    for layout in ("model.data_parallel=2", "model.pipeline_parallel=2"):
        sc = small_scenario("compute.backend=\"numpy\"", "kv.block_size=16", *MOE, layout)
        c = build(sc, workload=workload_of(ROWS), make_executor=make_executor)
        c.run()
        assert all(e.executor is not None and e.step_count for e in c.instances), layout
        for rid in range(len(ROWS)):
            assert c.get(rid).output_token_ids == tokens(batched, rid), (layout, rid)
        log = read_log(write_log(tmp_path / "c.msgpack", c))
        _, div = verify(log, make_executor)
        assert div is None, layout


def test_a_conversations_turns_carry_its_tokens_and_the_cache_holds_them():
    # each turn's prompt is the turns before it, their sampled outputs included: with prefix
    # caching those blocks are read from the cache, and the tokens are the same as without
    base = ("workload.concurrency=3", "workload.num_requests=9", "workload.turns=3",
            "workload.duration_s=0", "workload.prompt_tokens={dist=\"uniform\", min=20, max=60}",
            "workload.output_tokens=20", "compute.backend=\"numpy\"", "compute.verify_every=1")
    runs = {}
    for caching in ("false", "true"):
        sc = small_scenario(*base, f"kv.enable_prefix_caching={caching}")
        e = Engine(sc, executor=make_executor(sc))
        prompts = {}
        while not e.done:
            e.step()
            check_invariants(e)
            prompts.update({k: v.copy() for k, v in e._prompt_ids.items()})
        runs[caching] = (e, prompts)
    (plain, _), (cached, prompts) = runs["false"], runs["true"]
    assert summarize(cached)["prefix_cache"]["hit_tokens"] >= 6 * 32
    for rid in range(9):
        assert tokens(cached, rid) == tokens(plain, rid), rid
    for session in range(3):
        turns = sorted(r.req_id for r in cached.requests.values() if r.session == session)
        for before, rid in zip(turns, turns[1:]):
            history = np.concatenate((prompts[before], tokens(cached, before)))
            assert np.array_equal(prompts[rid][:len(history)], history)
