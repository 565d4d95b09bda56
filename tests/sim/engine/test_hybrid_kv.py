"""Layer groups over one KV pool for models with sliding-window layers (vLLM V1's hybrid KV cache
manager): the group rule, the pool it sizes, the blocks a request holds, prefix-cache hits, and
the invariants of every step under memory pressure."""

import dataclasses

import pytest

from sim import Engine, summarize
from sim.engine.kv import NULL, KVCacheManager, blocks_for, blocks_held
from sim.engine.request import Request
from sim.inputs.scenario import load_scenario, pipeline_stage
from sim.model.costmodel import CostModel, group_size, kv_groups
from sim.session.log import write_log
from tests.helpers import NO_FRONTEND, check_invariants, small_scenario, workload_of
from tests.logcraft import pack_log, unpack_log
from tui.cli import main
from tui.compute import make_executor

GPT_OSS = ("model.preset=\"\"", "model.config=\"gpt-oss-20b\"")


def with_layers(sc, full: int, win: int):
    m = dataclasses.replace(sc.model, num_layers=full + win, sliding_window_layers=win)
    return dataclasses.replace(sc, model=m)


def test_group_rule_follows_vllm():
    sc = small_scenario(*GPT_OSS)
    assert kv_groups(sc) == (1, 1, 128)  # 12 full + 12 window layers: one group each
    scout = small_scenario("model.preset=\"\"", "model.config=\"llama-4-scout\"")
    assert kv_groups(scout) == (1, 3, 8192)  # 12 full + 36 chunked: groups of 12
    # Gemma 3's 10 full + 52 window layers: groups of 10, the last window group padded
    assert group_size(10, 52) == 10 and kv_groups(with_layers(sc, 10, 52)) == (1, 6, 128)
    # kinds within a quarter of each other: groups of the larger, one each
    assert group_size(13, 12) == 13 and kv_groups(with_layers(sc, 13, 12)) == (1, 1, 128)
    assert kv_groups(with_layers(sc, 40, 20)) == (2, 1, 128)
    # no window layers, every layer windowed, or turned off: one table per request
    assert kv_groups(small_scenario()) is None
    assert kv_groups(with_layers(sc, 0, 24)) is None
    for off in ("kv.hybrid_kv_cache=false", "scheduler.preemption=\"swap\"",
                "workload.num_samples=2", "scheduler.policy=\"contiguous\""):
        assert kv_groups(small_scenario(*GPT_OSS, off)) is None, off


@pytest.mark.parametrize("config, tp, ratio", [("gpt-oss-20b", 1, 2), ("llama-4-scout", 8, 4)])
def test_a_pool_block_holds_one_group_of_layers(config, tp, ratio):
    base = ("model.preset=\"\"", f"model.config=\"{config}\"", "kv.num_blocks=0",
            f"model.tensor_parallel={tp}")
    on = load_scenario("chat", list(base))
    off = load_scenario("chat", [*base, "kv.hybrid_kv_cache=false"])
    # the same memory, in blocks of one group's layers (12 of 24, or 12 of 48)
    assert CostModel(on).pool_block_bytes * ratio == pytest.approx(
        CostModel(off).pool_block_bytes)
    assert abs(on.kv.num_blocks - ratio * off.kv.num_blocks) <= ratio


def test_a_pipeline_stage_holds_its_share_of_the_window_layers():
    sc = load_scenario("chat", [*GPT_OSS, "model.pipeline_parallel=2", "kv.num_blocks=0"])
    stage = pipeline_stage(sc)
    assert (stage.model.num_layers, stage.model.sliding_window_layers) == (12, 6)
    assert kv_groups(stage) == (1, 1, 128)
    assert CostModel(stage)._win == pytest.approx(0.5)  # the cost model's share of window layers


def test_blocks_held_by_one_request_as_it_decodes():
    """A request alone: after each step the pool holds its whole context in the full group and,
    in the window group, the blocks from the one holding the earliest position its next query
    attends."""
    sc = small_scenario(*GPT_OSS, "kv.block_size=16", "kv.num_blocks=400")
    e = Engine(sc, workload=workload_of([(0.0, 100, 200)]))
    bs, window = 16, 128
    slid = False
    while not e.done:
        e.step()
        check_invariants(e)
        r = e.get(0)
        if r.state.is_done:
            break
        c = r.num_computed_tokens
        first = max(c + 1 - window, 0) // bs
        assert e.kv.num_used_blocks == blocks_for(c, bs) + blocks_for(c, bs) - first
        assert e.kv.num_used_blocks == blocks_held(c, bs, (1, 1, window))
        slid = slid or NULL in (r.group_tables or [[]])[0]
        # the dashboard's block count and map show every group's blocks
        snap = e.snapshot()
        assert snap.running[0].num_blocks == e.kv.num_used_blocks == (snap.block_owner == 0).sum()
    assert slid and e.kv.num_used_blocks == 0


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("policy, chunking", [("chunked", True), ("chunked", False),
                                              ("fcfs", True)])
def test_invariants_hold_every_step_under_memory_pressure(caching, policy, chunking):
    sc = small_scenario(*GPT_OSS, "kv.num_blocks=160", f"scheduler.policy=\"{policy}\"",
                        f"engine.chunked_prefill={str(chunking).lower()}",
                        "scheduler.max_num_batched_tokens=256",
                        f"kv.enable_prefix_caching={str(caching).lower()}",
                        "workload.shared_prefix_tokens=200", "workload.shared_prefix_groups=2",
                        "workload.num_requests=40", "workload.duration_s=0",
                        "workload.rate=20", "workload.output_tokens=300",
                        "workload.prompt_tokens={dist=\"uniform\", min=100, max=600}")
    e = Engine(sc)
    assert e.kv.hybrid
    nulls = 0
    while not e.done:
        e.step()
        check_invariants(e)
        nulls += sum(1 for r in e.policy.running for t in r.group_tables or ()
                     for b in t if b == NULL)
    s = summarize(e)
    assert s["requests"]["finished"] == 40 and e.counts["preemptions"] > 0 and nulls > 0
    assert e.kv.num_used_blocks == 0 or caching
    if caching:
        assert s["prefix_cache"]["hit_tokens"] > 0


def test_more_fit_at_once_than_with_every_layer_holding_the_context():
    """The same memory: with the window layers keeping 128 tokens, twice the blocks and a
    larger batch of long requests."""
    base = [*GPT_OSS, "kv.num_blocks=0", "kv.gpu_memory_utilization=0.2",
            "workload.num_requests=200", "workload.duration_s=0", "workload.rate=1000",
            "workload.prompt_tokens=1000", "workload.output_tokens=400"]
    runs = {h: Engine(load_scenario("chat", base + [f"kv.hybrid_kv_cache={h}", *NO_FRONTEND]))
            for h in ("true", "false")}
    for e in runs.values():
        e.run()
    on, off = (summarize(runs[h]) for h in ("true", "false"))
    assert on["kv"]["total_blocks"] >= 2 * off["kv"]["total_blocks"] - 2
    assert on["batch"]["max"] > 1.5 * off["batch"]["max"]
    assert on["throughput"]["output_tokens_per_s"] > off["throughput"]["output_tokens_per_s"]


def test_a_prefix_hit_ends_where_each_window_group_holds_its_last_blocks():
    """vLLM's rule: the full group's hit shortened to where the window group holds the blocks
    the next query's window reaches (ceil((W - 1) / block_size) of them), searched from the
    right; the places before them NULL."""
    bs, window = 4, 9  # span: 2 blocks
    kv = KVCacheManager(64, bs, prefix_caching=True, groups=(1, 1, window))
    assert kv.window_span == 2
    text = bytes(range(33))
    first = Request(0, 0.0, 33, 4, prompt_text=text)
    assert kv.allocate_slots(first, 33)
    first.num_computed_tokens = 33
    kv.cache_blocks(first, 33)
    window_blocks = list(first.group_tables[0])
    kv.slide(first)
    assert first.group_tables[0][:6] == [NULL] * 6  # (33 + 1 - 9) // 4 = 6 blocks slid
    assert first.group_tables[0][6:] == window_blocks[6:]
    assert kv.num_used_blocks == 9 + 3
    kv.free(first)
    # every block stays cached once freed: the whole prompt but its last token is a hit
    second = Request(1, 0.0, 33, 4, prompt_text=text)
    assert len(kv.match_prefix(second)) == 8
    # the window group lost block 7: a hit of 7 (blocks 5 and 6 hold the window of token 28)
    kv.pool._evict(window_blocks[7])
    third = Request(2, 0.0, 33, 4, prompt_text=text)
    hits = kv.match_prefix(third)
    assert len(hits) == 7
    assert kv.allocate_slots(third, 33 - 28, prefix=hits)
    assert third.num_computed_tokens == 28
    assert third.group_tables[0][:5] == [NULL] * 5
    assert third.group_tables[0][5:7] == window_blocks[5:7]
    assert len(third.block_table) == len(third.group_tables[0]) == blocks_for(33, bs)
    # blocks 6 and 4 lost too: from the right, 3 and 2 are the first two neighbours held
    kv.free(third)
    kv.pool._evict(window_blocks[6])
    kv.pool._evict(window_blocks[4])
    fourth = Request(3, 0.0, 33, 4, prompt_text=text)
    assert len(kv.match_prefix(fourth)) == 4


@pytest.mark.parametrize("policy, chunking", [("fcfs", True), ("chunked", False)])
def test_a_request_that_could_never_fit_is_rejected_not_left_waiting(policy, chunking):
    """Its prompt, computed whole, sits whole in the window group until its step ends: a
    request whose peak exceeds the pool is rejected on arrival, whatever blocks it would hold
    once slid. In chunks of 64 tokens the same request fits."""
    rows = [(0.0, 600, 10), (0.0, 200, 10)]
    for chunks in (False, True):
        sc = small_scenario(*GPT_OSS, "kv.num_blocks=60", "scheduler.max_num_batched_tokens=64",
                            f"scheduler.policy=\"{'chunked' if chunks else policy}\"",
                            f"engine.chunked_prefill={str(chunks or chunking).lower()}")
        e = Engine(sc, workload=workload_of(rows))
        e.run()
        if chunks:
            assert e.get(0).state.name == "FINISHED"
        else:
            assert e.get(0).state.name == "REJECTED" and "blocks" in e.get(0).reject_reason
        assert e.get(1).state.name == "FINISHED"


@pytest.mark.parametrize("chunking", [True, False])
def test_a_recompute_never_needs_more_blocks_than_the_pool(chunking):
    """A request preempted by recompute computes its prompt and its outputs so far again, in
    one step with prompts whole: that chunk sits whole in each window group. A request whose
    recompute could not fit is refused on arrival; left in, it waited forever at the head of
    the queue (the engine stalled)."""
    rows = [(1.019, 707, 331), (1.193, 565, 908), (1.502, 105, 1490), (1.918, 646, 361),
            (1.981, 609, 158), (2.605, 466, 1072), (2.818, 88, 874)]
    sc = small_scenario(*GPT_OSS, "kv.num_blocks=121", "scheduler.max_num_batched_tokens=256",
                        f"engine.chunked_prefill={str(chunking).lower()}")
    e = Engine(sc, workload=workload_of(rows))
    for _ in range(20000):  # (a stalled engine steps on without end)
        if e.done:
            break
        e.step()
        check_invariants(e)
    assert e.done
    states = {r.state.name for r in e.requests.values()}
    assert states <= {"FINISHED", "REJECTED"} and "FINISHED" in states


def test_same_tokens_with_and_without_layer_groups():
    """Memory changes what runs together, never the tokens."""
    rows = [(0.0, 40, 24), (0.0, 175, 40), (0.01, 130, 48), (0.02, 33, 30), (0.03, 300, 32)]
    out = {}
    for h in ("true", "false"):
        sc = small_scenario(*GPT_OSS, "compute.backend=\"numpy\"", "kv.num_blocks=60",
                            f"kv.hybrid_kv_cache={h}")
        e = Engine(sc, workload=workload_of(rows), executor=make_executor(sc))
        while not e.done:
            e.step()
            check_invariants(e)
        out[h] = e
    assert out["true"].kv.hybrid and not out["false"].kv.hybrid
    assert out["true"].step_count != out["false"].step_count
    for rid in range(len(rows)):
        assert (out["true"].get(rid).output_token_ids
                == out["false"].get(rid).output_token_ids), rid


@pytest.mark.parametrize("hybrid", [True, False])
def test_a_windowed_models_log_replays_exactly_and_an_older_one_keeps_the_whole_context(
        tmp_path, capsys, hybrid):
    """A log records whether the windows kept only their blocks; a log written before layer
    groups (its [kv] lacks the key) replays as it ran: every layer kept the whole context."""
    sc = small_scenario(*GPT_OSS, "kv.num_blocks=90", f"kv.hybrid_kv_cache={str(hybrid).lower()}")
    e = Engine(sc, workload=workload_of([(0.01 * i, 150 + 20 * i, 200) for i in range(8)]))
    e.run()
    assert e.counts["preemptions"] > 0
    path = write_log(tmp_path / "run.msgpack", e)
    assert main(["replay", str(path), "--verify"]) == 0
    objs = unpack_log(path.read_bytes())
    del objs[0]["scenario"]["kv"]["hybrid_kv_cache"]
    older = tmp_path / "older.msgpack"
    older.write_bytes(pack_log(objs))
    assert main(["replay", str(older), "--verify"]) == (1 if hybrid else 0)
    capsys.readouterr()
