"""The deployment search (sim.deploy.plan): bisection, pruning against the exhaustive answer,
resuming from the output file, the winner as a scenario and as serving command lines."""

import json
import math

import pytest
from hypothesis import given, settings, strategies as st

from sim.deploy import plan as P
from sim.deploy.sweep import Runner
from sim.inputs.scenario import load_scenario
from sim.model import trust as T

PRICES = {g: P.Price(usd, "test", "2026-01-01")
          for g, usd in {"h100-sxm": 4.0, "a100-80gb": 2.5, "h200": 5.0}.items()}
BOUNDS = [P.Bound("ttft_p99", 100.0)]
SLICE = P.Slice([], False, 1.0, 101, 200.0)  # 200 output tokens a request


def toy(capacity):
    """An evaluator of a monotone toy: a probe meets the bound iff its load is at most the
    candidate's capacity."""
    calls = []

    def evaluate(probes, progress=None, **_):
        calls.extend(probes)
        rows = []
        for c, load in probes:
            cap = capacity(c)
            rows.append({"ttft_p99_ms": 100.0 * load / cap,
                         "throughput_output_tokens_per_s": 0.95 * load * 200})
        return rows
    evaluate.calls = calls
    return evaluate


def cand(gpu="h100-sxm", tp=1, replicas=1, router="round-robin", seqs=128, tokens=2048,
         policy="chunked", pc=False):
    return P.Candidate(gpu, tp, replicas, router, seqs, tokens, policy, pc)


def test_bisection_finds_the_highest_load_meeting_the_bound():
    c = cand()
    for capacity in (0.37, 3.0, 17.5):
        ev = toy(lambda _: capacity)
        s = P.SearchSettings(BOUNDS, required=0.2, prices=PRICES, tolerance=0.02)
        r = P.search([c], ev, SLICE, s)[c.key]
        assert r.status == "ok"
        assert r.max_load <= capacity < r.fail_load  # a bracket around the capacity
        assert r.fail_load - r.max_load <= 0.02 * r.max_load + 1e-12
        assert r.probes == len(ev.calls)


def test_failing_at_the_required_load_is_infeasible_after_one_probe():
    c = cand()
    ev = toy(lambda _: 1.0)
    s = P.SearchSettings(BOUNDS, required=2.0, prices=PRICES)
    r = P.search([c], ev, SLICE, s)[c.key]
    assert r.status == "infeasible" and r.probes == 1
    assert "ttft_p99" in r.note and r.max_load is None


def test_a_replicated_candidate_starts_from_its_single_replica():
    one, two = cand(), cand(replicas=2)
    ev = toy(lambda c: 3.0 * c.replicas)
    s = P.SearchSettings(BOUNDS, required=1.0, prices=PRICES, tolerance=0.02)
    res = P.search([one, two], ev, SLICE, s)
    assert res[two.key].max_load <= 6.0 < res[two.key].fail_load
    exhaustive = P.search([one, two], toy(lambda c: 3.0 * c.replicas), SLICE,
                          P.SearchSettings(BOUNDS, 1.0, PRICES, 0.02, prune=False))
    assert res[two.key].probes < exhaustive[two.key].probes  # it reused the bound


# Random small spaces whose capacities obey the rule pruning relies on: more GPUs of one type
# with the same settings never carry less load per replica.
@st.composite
def spaces(draw):
    gpus = draw(st.lists(st.sampled_from(sorted(PRICES)), min_size=1, max_size=3, unique=True))
    tps = sorted(draw(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=3,
                               unique=True)))
    replicas = sorted(draw(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=3,
                                    unique=True)))
    seqs = draw(st.lists(st.sampled_from([64, 256]), min_size=1, max_size=2, unique=True))
    space = P.Space(gpus, tps, replicas, ["round-robin"], seqs, [2048], ["chunked"], [False],
                    [1], [1], [False])
    base = {(g, s): draw(st.floats(0.2, 20)) for g in gpus for s in seqs}
    tp_gain = {t: draw(st.floats(1.0, 2.0)) for t in tps}
    rep_gain = draw(st.floats(1.0, 1.1))
    prices = {g: P.Price(draw(st.floats(0.5, 10)), "test", "") for g in gpus}
    required = draw(st.floats(0.1, 10))

    def capacity(c):
        gain = math.prod(tp_gain[t] for t in tps if t <= c.tp)
        return base[(c.gpu, c.max_num_seqs)] * gain * c.replicas * rep_gain ** (c.replicas - 1)
    return space, capacity, prices, required


@settings(max_examples=150, deadline=None)
@given(spaces())
def test_pruning_never_drops_the_true_winner(case):
    space, capacity, prices, required = case
    cands = space.candidates()
    s = dict(bounds=BOUNDS, required=required, prices=prices, tolerance=0.02)
    pruned = P.search(cands, toy(capacity), SLICE, P.SearchSettings(**s))
    full = P.search(cands, toy(capacity), SLICE, P.SearchSettings(**s, prune=False))
    best = P.rank(list(full.values()))[0]
    got = P.rank(list(pruned.values()))[0]
    if best.status != "ok":
        assert got.status != "ok"
        return
    assert got.status == "ok"
    # the same winner, or one within the search's precision of its cost
    assert got.candidate == best.candidate or \
        got.usd_per_m_tokens <= best.usd_per_m_tokens * (1 + 2 * 0.02)


# --- on the simulator -----------------------------------------------------------------------------
SCENARIO = """
name = "tiny"
seed = 3
[model]
preset = "llama-3.1-8b"
[workload]
arrival = "poisson"
rate = 4.0
num_requests = 120
prompt_tokens = 256
output_tokens = 32
"""


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(SCENARIO)
    return str(path)


@pytest.fixture(scope="module")
def tiny_module(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "tiny.toml"
    path.write_text(SCENARIO)
    return str(path)


def small_plan(spec, **kw):
    space = P.Space(["h100-sxm", "a100-80gb"], [1], [1, 2], ["round-robin"], [64], [2048],
                    ["chunked"], [False, True], [1], [1])
    return P.Plan(spec, [P.Bound("ttft_p99", 250.0), P.Bound("tpot_p99", 40.0)], space,
                  P.load_prices(), **{"probe_requests": 60, "tolerance": 0.1, **kw})


def test_a_plan_resumes_from_its_output_file(tiny, tmp_path):
    out = tmp_path / "plan.jsonl"
    with Runner(1) as runner:
        first = P.run_plan(small_plan(tiny), runner, journal_path=str(out))
    assert first.winner is not None and first.probes > 0
    lines = out.read_text().splitlines()
    assert json.loads(lines[0])["servesim_plan"] == 1
    # interrupted after three candidates, the fourth's line torn
    kept = lines[:4]
    out.write_text("\n".join(kept) + "\n" + lines[4][:25])
    with Runner(1) as runner:
        again = P.run_plan(small_plan(tiny), runner, journal_path=str(out))
    assert again.resumed == 3
    assert 0 < again.probes < first.probes
    assert {r.candidate for r in again.results} == {r.candidate for r in first.results}
    assert again.winner.candidate == first.winner.candidate
    assert again.winner.max_load == first.winner.max_load
    with Runner(1) as runner:  # everything read back: nothing runs
        third = P.run_plan(small_plan(tiny), runner, journal_path=str(out))
    assert third.probes == 0 and third.winner.candidate == first.winner.candidate


def test_a_file_of_another_plan_is_refused(tiny, tmp_path):
    out = tmp_path / "plan.jsonl"
    with Runner(1) as runner:
        P.run_plan(small_plan(tiny), runner, journal_path=str(out))
        with pytest.raises(P.PlanError, match="holds another plan"):
            P.run_plan(small_plan(tiny, tolerance=0.2), runner, journal_path=str(out))


def test_the_winner_scenario_runs_at_its_load(tiny, tmp_path):
    with Runner(1) as runner:
        out = P.run_plan(small_plan(tiny), runner)
    w = out.winner
    path = tmp_path / "winner.toml"
    path.write_text(P.winner_toml(out, w))
    sc = load_scenario(str(path))
    assert sc.hardware.preset == w.candidate.gpu
    assert sc.cluster.replicas == w.candidate.replicas
    assert sc.kv.enable_prefix_caching == w.candidate.prefix_caching
    assert sc.workload.rate == pytest.approx(w.max_load)


def test_no_feasible_point_names_what_binds(tiny):
    p = small_plan(tiny)
    p.bounds = [P.Bound("ttft_p99", 0.5)]
    with Runner(1) as runner:
        out = P.run_plan(p, runner)
    assert out.winner is None
    assert "ttft_p99 <= 0.5 ms" in P.binding(out)
    misses = P.nearest_misses(out)
    assert misses and all(m.status == "infeasible" for m in misses)


def test_the_vllm_command_carries_the_winners_settings():
    sc = load_scenario("chat", ['model.preset="llama-3.1-70b"', "model.tensor_parallel=4"])
    c = cand(tp=4, seqs=128, tokens=8192, pc=True, replicas=2)
    line = P.vllm_command(sc, c)
    for flag in ("--tensor-parallel-size 4", "--max-num-seqs 128",
                 "--max-num-batched-tokens 8192", "--enable-prefix-caching",
                 "meta-llama/Llama-3.1-70B-Instruct"):
        assert flag in line
    assert "--no-enable-prefix-caching" in P.vllm_command(sc, cand(tp=4))
    sg = P.sglang_command(sc, c)
    assert "--tp-size 4" in sg and "--dp-size 2" in sg and "--disable-radix-cache" not in sg


@pytest.mark.parametrize("text, message", [
    ("foo_p99=3", "unknown metric 'foo_p99'"),
    ("ttft_p99=-5", "positive number"),
    ("ttft_p99=nan", "positive number"),
    ("ttft_p99", "expected METRIC=MS"),
])
def test_bad_bounds(text, message):
    with pytest.raises(P.PlanError, match=message):
        P.parse_bound(text)


def test_bound_units():
    assert P.parse_bound("ttft_p99=0.5s").limit_ms == 500
    assert P.parse_bound("tpot_p90=40ms").limit_ms == 40


def test_a_bad_price_row_names_file_field_and_value(tmp_path):
    path = tmp_path / "prices.toml"
    path.write_text('[gpu.h100-sxm]\nusd_per_gpu_hour = -2\nsource = "x"\ndate = "2026"\n')
    with pytest.raises(P.PlanError, match=r"prices.toml: gpu.h100-sxm.usd_per_gpu_hour = -2"):
        P.load_prices(path)
    path.write_text('[gpu.h100-sxm]\nusd_per_gpu_hour = 2\ndate = "2026"\n')
    with pytest.raises(P.PlanError, match=r"gpu.h100-sxm.source = None"):
        P.load_prices(path)


@pytest.mark.parametrize("text", ["h100-sxm=1e-320", "h100-sxm=abc", "h100-sxm=2e6",
                                  "h100-sxm=-0.0"])
def test_a_price_too_small_to_divide_by_or_absurd_is_refused(text):
    with pytest.raises(P.PlanError, match="with a price from 1e-06 to 1e\\+06"):
        P.price_override(text)


def test_an_output_file_that_is_not_text_is_refused(tmp_path):
    out = tmp_path / "plan.jsonl"
    out.write_bytes(b"\x00\x01\xff")
    with pytest.raises(P.PlanError, match="plan.jsonl: cannot read: .*give another -o"):
        P.Journal(str(out), {}).read()


@pytest.mark.parametrize("text", ["my notes, no line break at the end", '{"kind": "plan", "sce'])
def test_a_one_line_file_that_is_not_a_plan_is_refused_not_truncated(tmp_path, text):
    out = tmp_path / "notes.txt"
    out.write_text(text)
    with pytest.raises(P.PlanError, match="not a servesim plan file"):
        P.Journal(str(out), {"a": 1}).read()
    assert out.read_text() == text


def test_a_torn_header_of_this_plan_is_written_again(tmp_path):
    out = tmp_path / "plan.jsonl"
    journal = P.Journal(str(out), {"a": 1})
    out.write_text(journal.header()[:30])
    assert journal.read() == ({}, {})


def test_the_bundled_prices_are_attributed_and_dated():
    for gpu, price in P.load_prices().items():
        assert price.source.startswith("https://") and price.date[:4].isdigit(), gpu


class CountingRunner:
    """A Runner stand-in of one worker: counts the runs started and answers each with its
    scenario's prefix-caching setting."""

    slots = 1

    def __init__(self):
        self.runs = []

    def submit(self, sc, stop=()):
        self.runs.append(sc)
        return len(self.runs) - 1

    def wait(self, handles):
        return list(handles)

    def outcome(self, h):
        return True, {"prefix_caching": self.runs[h].kv.enable_prefix_caching}


@pytest.mark.parametrize("shares, expected_runs", [(False, 1), (True, 2)])
def test_candidates_whose_runs_are_identical_share_them(tiny, shares, expected_runs):
    raw, source, base = P.read_raw(tiny)
    full, _ = P.slices(load_scenario(tiny), None)
    full.shares_prefixes = shares
    runner = CountingRunner()
    probes = P.Probes(raw, source, base, full, P.Scheduler(runner), "whole")
    off, on = cand(seqs=64), cand(seqs=64, pc=True)
    rows = probes([(off, 2.0), (on, 2.0)])
    assert len(runner.runs) == expected_runs and probes.runs == expected_runs
    assert (rows[0] is rows[1]) == (not shares)
    probes([(on, 2.0)])  # asked again: answered from what ran
    assert len(runner.runs) == expected_runs


def test_a_trace_probe_runs_at_the_rate_of_the_traces_busiest_stretch():
    from sim.inputs.workload import build_workload

    sc = load_scenario("azure-conv")
    full, probe = P.slices(sc, 500)
    assert full.requests > probe.requests == 500 and probe.peak > 1
    assert not full.shares_prefixes  # (the Azure trace has no prefix hashes)
    for load in (3.0, 9.0):
        a = build_workload(load_variant_of(probe, sc, load)).arrival
        assert (len(a) - 1) / (a[-1] - a[0]) == pytest.approx(load * probe.peak)
        a = build_workload(full.at(sc, load)).arrival
        assert (len(a) - 1) / (a[-1] - a[0]) == pytest.approx(load)


def load_variant_of(slice_, sc, load):
    raw, source, base = P.read_raw("azure-conv")
    return slice_.at(P.load_variant(raw, source, base, slice_.overrides), load)


def test_a_confirmed_cost_is_what_a_candidate_must_beat_not_to_be_pruned():
    # h100 carries 10 req/s at $4/h; a100 carries 2 at $2.5/h: cost per token 2.5x h100's
    cands = [cand(), cand(gpu="a100-80gb")]
    cap = {"h100-sxm": 10.0, "a100-80gb": 2.0}
    s = P.SearchSettings(BOUNDS, required=1.0, prices=PRICES, tolerance=0.02)
    res = P.search(cands, toy(lambda c: cap[c.gpu]), SLICE, s)
    assert res[cands[1].key].status == "pruned" and res[cands[1].key].cap is not None
    # confirmed on the whole workload the h100 turned out to cost more: the a100 is searched
    worse = res[cands[0].key].usd_per_m_tokens * 10
    again = P.search(cands, toy(lambda c: cap[c.gpu]), SLICE,
                     P.SearchSettings(BOUNDS, 1.0, PRICES, 0.02, confirmed_cost=worse))
    assert again[cands[1].key].status == "ok"
    assert again[cands[1].key].max_load <= 2.0 < again[cands[1].key].fail_load


# --- closed loops ------------------------------------------------------------------------------
CLOSED = P.Slice([], False, 1.0, 101, 200.0, closed=True)


def test_closed_loop_bisection_finds_the_most_users_meeting_the_bound():
    c = cand()
    for users in (1, 7, 40):
        ev = toy(lambda _, u=users: u + 0.5)  # meets the bound up to `users` users
        s = P.SearchSettings(BOUNDS, required=1, prices=PRICES, closed=True)
        r = P.search([c], ev, CLOSED, s)[c.key]
        assert r.status == "ok" and r.max_load == users and r.fail_load == users + 1
        assert all(float(load).is_integer() and load >= 1 for _, load in ev.calls)
        # the cost divides by the throughput measured at that many users
        assert r.usd_per_m_tokens == pytest.approx(4.0 / (0.95 * users * 200 * 3600) * 1e6)


def test_a_given_concurrency_is_probed_once_and_never_searched_past():
    c = cand()
    ev = toy(lambda _: 50.5)
    s = P.SearchSettings(BOUNDS, required=8, prices=PRICES, closed=True, fixed=True)
    r = P.search([c], ev, CLOSED, s)[c.key]
    assert r.status == "ok" and r.max_load == 8 and [load for _, load in ev.calls] == [8.0]
    s = P.SearchSettings(BOUNDS, required=8, prices=PRICES, closed=True, fixed=True)
    assert P.search([c], toy(lambda _: 7.5), CLOSED, s)[c.key].status == "infeasible"


CLOSED_SCENARIO = SCENARIO.replace("rate = 4.0", "concurrency = 4")


def test_a_closed_loop_plan_searches_single_engines_and_says_what_it_left_out(tmp_path):
    path = tmp_path / "closed.toml"
    path.write_text(CLOSED_SCENARIO)
    space = P.Space(["h100-sxm"], [1], [1, 2], ["round-robin"], [64], [2048],
                    ["chunked", "disaggregated"], [False], [1, 2], [1], pd_ratios=[(1, 1)])
    p = P.Plan(str(path), [P.Bound("ttft_p99", 400.0)], space, P.load_prices(),
               probe_requests=None, tolerance=0.1)
    with Runner(1) as runner:
        out = P.run_plan(p, runner)
    # x2 replicas, a pair and DP2 cannot run a closed loop: only the single engine is searched
    assert out.closed and out.unit == "users" and out.skipped == 3 and out.required == 4
    assert [r.candidate.single for r in out.results] == [True]
    w = out.winner
    assert w is not None and w.max_load >= 4 and float(w.max_load).is_integer()
    assert w.usd_per_m_tokens == pytest.approx(
        4 * 3.99 / 4 / (w.row["throughput_output_tokens_per_s"] * 3600) * 1e6)
    winner = tmp_path / "winner.toml"
    winner.write_text(P.winner_toml(out, w))
    assert load_scenario(str(winner)).workload.concurrency == int(w.max_load)


def test_concurrency_makes_an_open_workload_a_closed_loop_at_that_load(tiny):
    p = small_plan(tiny, concurrency=3, probe_requests=None)
    p.space.replicas = [1]
    with Runner(1) as runner:
        out = P.run_plan(p, runner)
    assert out.closed and out.required == 3
    assert out.winner is not None and out.winner.max_load == 3


# --- prefill:decode ratios -----------------------------------------------------------------------
def test_disaggregated_candidates_take_each_ratio_and_rent_p_plus_d_instances():
    space = P.Space(["h100-sxm"], [1, 2], [1, 2], ["round-robin", "least-outstanding"], [64],
                    [2048], ["chunked", "disaggregated"], [False], [1], [1], [False],
                    [(1, 1), (2, 1), (1, 3)])
    cands = space.candidates()
    pairs = [c for c in cands if c.disaggregated]
    # a router only where there are several prefill instances; never replicated
    assert sorted((c.tp, c.prefill, c.decode, c.router) for c in pairs) == sorted(
        (tp, p, d, r) for tp in (1, 2) for p, d in ((1, 1), (2, 1), (1, 3))
        for r in (["round-robin", "least-outstanding"] if p > 1 else ["round-robin"]))
    assert all(c.replicas == 1 for c in pairs)
    assert all((c.prefill, c.decode) == (1, 1) for c in cands if not c.disaggregated)
    assert len([c for c in cands if not c.disaggregated]) == 2 * 3  # TP x (x1, x2 by router)
    c = next(c for c in pairs if (c.tp, c.prefill, c.decode) == (2, 1, 3))
    assert c.gpus == 8 and P.usd_per_hour(c, PRICES) == 8 * 4.0
    assert "P:D 1:3" in c.label()
    assert {"cluster.prefill_instances=1", "cluster.decode_instances=3"} <= set(c.overrides())


PREFILL_HEAVY = """
name = "prefill-heavy"
seed = 3
[model]
preset = "llama-3.1-8b"
[workload]
arrival = "poisson"
rate = 12.0
num_requests = 200
prompt_tokens = 4000
output_tokens = 16
"""


def test_a_prefill_heavy_workload_is_served_cheapest_by_two_prefill_instances(tmp_path):
    path = tmp_path / "prefill-heavy.toml"
    path.write_text(PREFILL_HEAVY)
    space = P.Space(["h100-sxm"], [1], [1], ["round-robin"], [64], [2048],
                    ["chunked", "disaggregated"], [False], [1], [1], [False],
                    [(1, 1), (1, 2), (2, 1)])
    p = P.Plan(str(path), [P.Bound("ttft_p99", 500.0)], space, P.load_prices(),
               probe_requests=None, tolerance=0.1)
    with Runner(1) as runner:
        out = P.run_plan(p, runner)
    by_ratio = {(r.candidate.prefill, r.candidate.decode): r for r in out.results
                if r.candidate.disaggregated}
    assert set(by_ratio) == {(1, 1), (1, 2), (2, 1)}  # each ratio searched
    # one prefill instance cannot keep up with 4,000-token prompts at 12/s, however many
    # decode instances it has; two can
    assert by_ratio[(1, 1)].status == by_ratio[(1, 2)].status == "infeasible"
    w = out.winner
    assert w is not None and (w.candidate.policy, w.candidate.prefill, w.candidate.decode) == (
        "disaggregated", 2, 1)
    assert w.usd_per_hour == pytest.approx(3 * out.prices["h100-sxm"].usd_per_gpu_hour)
    winner = tmp_path / "winner.toml"
    winner.write_text(P.winner_toml(out, w))
    sc = load_scenario(str(winner))
    assert (sc.scheduler.policy, sc.cluster.prefill_instances, sc.cluster.decode_instances) == (
        "disaggregated", 2, 1)
    v, s = P.vllm_command(sc, w.candidate), P.sglang_command(sc, w.candidate)
    assert v.startswith("# 2 prefill instances and a decode instance, 1 GPU(s) each")
    assert v.count("vllm serve") == 2 and "kv_producer" in v and "kv_consumer" in v
    assert s.count("--prefill http://") == 2 and s.count("--decode http://") == 1
    assert "--disaggregation-mode prefill" in s and "--disaggregation-mode decode" in s


# --- data and pipeline parallelism, experts -----------------------------------------------------
def test_data_and_pipeline_parallel_candidates_are_only_those_modeled():
    space = P.Space(["h100-sxm"], [1, 2], [1, 2], ["round-robin"], [64], [2048],
                    ["chunked", "disaggregated"], [False], [1, 2, 4], [1, 2], [False, True])
    cands = space.candidates()
    assert {(c.dp, c.pp) for c in cands} == {(1, 1), (2, 1), (4, 1), (1, 2)}
    for c in cands:
        if c.dp > 1 or c.pp > 1:
            assert c.replicas == 1 and not c.disaggregated
        assert not (c.expert_parallel and c.tp * c.dp == 1)
    c = next(c for c in cands if c.dp == 4 and c.tp == 2 and not c.expert_parallel)
    assert c.gpus == 8 and "model.data_parallel=4" in c.overrides()


def test_parallel_candidates_carry_their_serving_flags():
    sc = load_scenario("chat", ['model.preset="llama-3.1-70b"', "model.tensor_parallel=4"])
    dp = P.Candidate("h100-sxm", 2, 1, "round-robin", 128, 2048, "chunked", False, dp=4,
                     expert_parallel=True)
    pp = P.Candidate("h100-sxm", 4, 1, "round-robin", 128, 2048, "chunked", False, pp=2)
    v, s = P.vllm_command(sc, dp), P.sglang_command(sc, dp)
    assert "--tensor-parallel-size 2 --data-parallel-size 4 --enable-expert-parallel" in v
    assert "--tp-size 2 --dp-size 4 --ep-size 8" in s
    assert "--pipeline-parallel-size 2" in P.vllm_command(sc, pp)
    assert "--pp-size 2" in P.sglang_command(sc, pp)
    assert "--data-parallel-size" not in P.vllm_command(sc, pp)
    assert "model.expert_parallel=8" in dp.overrides()


def test_expert_parallelism_is_searched_for_a_mixture_of_experts_only(tiny):
    space = P.Space(["h200"], [8], [1], ["round-robin"], [64], [2048], ["chunked"], [False],
                    [1], [1], [False, True])
    for spec, moe in ((tiny, False), ("moe", True)):
        raw, source, base = P.read_raw(spec)
        p = P.Plan(spec, BOUNDS, space, PRICES)
        ok, bad = P.check_space(p, raw, source, base)
        assert sorted(c.expert_parallel for c in ok + [r.candidate for r in bad]) == \
            ([False, True] if moe else [False])
        if moe:  # the scenario's own expert_parallel = 8 is the candidate's to set
            off = next(c for c in ok if not c.expert_parallel)
            assert P.load_variant(raw, source, base, off.overrides()).model.expert_parallel == 1


# --- prices -------------------------------------------------------------------------------------
def test_prices_the_flag_over_the_scenario_over_the_table(tmp_path):
    path = tmp_path / "priced.toml"
    path.write_text(SCENARIO + "[plan]\ngpu_price_usd_per_hour = {h100-sxm = 1.25, "
                               "a100-80gb = 2.0}\n")
    sc = load_scenario(str(path))
    p = small_plan(str(path))
    prices = P.plan_prices(p, sc)
    table = P.load_prices()
    assert prices["h100-sxm"].usd_per_gpu_hour == 1.25 and "plan.gpu_price" in \
        prices["h100-sxm"].source
    assert prices["h200"] == table["h200"]
    p.price_overrides = {"h100-sxm": P.Price(0.5, "--price", "")}
    prices = P.plan_prices(p, sc)
    assert prices["h100-sxm"].usd_per_gpu_hour == 0.5 and prices["a100-80gb"].usd_per_gpu_hour == 2
    with Runner(1) as runner:
        out = P.run_plan(p, runner)
    for r in out.results:
        assert r.usd_per_hour == {"h100-sxm": 0.5, "a100-80gb": 2.0}[r.candidate.gpu] * \
            r.candidate.gpus


# --- trust ---------------------------------------------------------------------------------------
def test_the_winners_figures_carry_their_regimes_interval(tiny):
    with Runner(1) as runner:
        out = P.run_plan(small_plan(tiny), runner)
    w = out.winner
    assert w.confirmed
    points = {f"q{i}": {"regime": "queued", "ratio": 1 / (1 + 0.01 * i)} for i in range(6)}
    points.update({f"f{i}": {"regime": "first token", "ratio": 1 / (1 - 0.02 * i)}
                   for i in range(3)})
    trust = {"points": points, "regimes": T.table(points)}
    figures = P.winner_trust(out, w, trust)
    ttft = figures["ttft_ms.p99"]
    # the run at the winner's highest load on the whole workload: the figure the table shows
    assert ttft["value"] == pytest.approx(w.row["ttft_p99_ms"])
    assert ttft["regime"] in ("queued", "first token")
    expected = trust["regimes"][ttft["regime"]]
    assert (ttft["points"], ttft["low"], ttft["high"]) == \
        (expected["count"], expected["low"], expected["high"])
    assert figures["throughput.output_tokens_per_s"]["points"] == 0  # no claim made


def test_finalists_are_confirmed_as_many_at_once_as_there_are_workers():
    # six candidates the probes found cheap; on the whole workload each carries half as much,
    # so each confirmed cost leaves the next ones still worth confirming
    cands = [cand(seqs=64 + i) for i in range(6)]
    found = {c.key: P.Result(c, "ok", 4.0, max_load=10.0 + i, tokens_per_request=200.0)
             for i, c in enumerate(cands)}
    s = P.SearchSettings(BOUNDS, required=1.0, prices=PRICES, tolerance=0.05)
    p = P.Plan(None, BOUNDS, P.Space(["h100-sxm"]), PRICES, finalists=1)
    rounds = {}
    for width in (1, 4):
        sizes = []
        ev = toy(lambda c: (10.0 + c.max_num_seqs - 64) / 2)

        def evaluate(probes, progress=None, ev=ev, sizes=sizes, **_):
            sizes.append(len(probes))
            return ev(probes)
        confirmed = {}
        P.confirm(found, confirmed, p, s, evaluate, P.Journal(None, {}), width=width)
        assert set(confirmed) == set(found)
        for key, r in confirmed.items():
            assert r.confirmed and r.max_load <= found[key].max_load / 2 < r.fail_load
        assert max(sizes) == width
        rounds[width] = len(sizes)
    assert rounds[4] < rounds[1] / 2


# --- scheduling: workers kept busy, the answer the same ------------------------------------------
class ClockRunner:
    """A Runner stand-in with `slots` workers on a simulated clock: a run of a scenario takes
    as many time units as it has engine instances (replicas, or 2 for a pair), plus 1, and
    its row is the simulator's (run here, at once) with that as its CPU time (and twice that
    as its wall time). `order` picks which of the runs ending together is reported first
    (adversarial orders must not change the answer)."""

    def __init__(self, slots, order=min):
        self.slots, self.order = slots, order
        self.now = 0.0
        self.busy = 0.0
        self.ends = {}  # handle -> (end time, outcome)
        self.started = 0

    def submit(self, sc, stop=()):
        from sim.deploy.sweep import _run_task  # (the stand-in runs what a worker runs)
        cost = 1.0 + (2 if sc.scheduler.policy == "disaggregated" else sc.cluster.replicas)
        self.started += 1
        h = self.started
        ok, row = _run_task(sc, stop)
        self.ends[h] = (self.now + cost, (ok, {**row, "cpu_s": cost, "wall_s": 2 * cost}))
        self.busy += cost
        return h

    def wait(self, handles):
        first = min(self.ends[h][0] for h in handles)
        self.now = first
        done = [h for h in handles if self.ends[h][0] == first]
        return [self.order(done)]

    def outcome(self, h):
        return self.ends[h][1]


def scheduled_plan(spec, **kw):
    space = P.Space(["h100-sxm", "a100-80gb"], [1], [1, 2, 4], ["round-robin"], [64, 256],
                    [2048], ["chunked", "disaggregated"], [False], [1], [1], pd_ratios=[(1, 1)])
    return P.Plan(spec, [P.Bound("ttft_p99", 250.0), P.Bound("tpot_p99", 40.0)], space,
                  P.load_prices(), **{"probe_requests": 60, "tolerance": 0.1, **kw})


def _answer(out):
    return [(r.candidate, r.status, r.max_load, r.fail_load, r.row, r.confirmed)
            for r in out.results]


def test_the_answer_does_not_depend_on_the_workers_or_which_run_ends_first(tiny):
    answers, spans = [], {}
    for slots, order in ((1, min), (2, min), (2, max), (4, max)):
        runner = ClockRunner(slots, order)
        out = P.run_plan(scheduled_plan(tiny), runner)
        answers.append(_answer(out))
        spans[(slots, order)] = runner.now
        work = out.work
        assert work["runs"] == out.probes and work["cpu_s"] == runner.busy
        # the critical path: no shorter than any candidate's chain of probes, no longer than all
        cost = {r.candidate: 1.0 + (2 if r.candidate.disaggregated else r.candidate.replicas)
                for r in out.results}
        longest = max(r.probes * cost[r.candidate] for r in out.results)
        assert longest <= work["critical_path_s"] <= work["cpu_s"] - work["cpu_s_unused"]
    assert all(a == answers[0] for a in answers[1:])
    assert spans[(2, min)] < spans[(1, min)]


def test_running_ahead_keeps_the_workers_busy(tiny, monkeypatch):
    # the same plan on two simulated workers, with and without running ahead: ahead, a
    # round's last probes leave no worker idle, and the plan ends sooner
    span, util = {}, {}
    for depth in (0, 3):
        monkeypatch.setattr(P.Scheduler, "__init__", _depth_init(depth))
        runner = ClockRunner(2)
        out = P.run_plan(scheduled_plan(tiny), runner)
        span[depth] = runner.now
        util[depth] = runner.busy / (2 * runner.now)
        assert out.winner is not None
    assert span[3] < span[0]
    assert util[3] > util[0]


def _depth_init(depth):
    init = P.Scheduler.__init__

    def __init__(self, runner, depth_=depth):
        init(self, runner, depth_)
    return __init__


def test_the_pruned_answer_agrees_with_the_exhaustive_search(tiny):
    # the exhaustive search bisects every candidate on the whole workload, nothing pruned or
    # carried between candidates: the pruned plan's winner is its winner, or within 2% of cost
    with Runner(1) as runner:
        pruned = P.run_plan(scheduled_plan(tiny), runner)
        exhaustive = P.run_plan(scheduled_plan(tiny, prune=False), runner)
    assert not any(r.status == "pruned" for r in exhaustive.results)
    assert all(r.row["requests_finished"] == 120 for r in exhaustive.results  # the whole
               if r.status == "ok")
    w, e = pruned.winner, exhaustive.winner
    assert w is not None and e is not None
    assert w.candidate == e.candidate or w.usd_per_m_tokens <= e.usd_per_m_tokens * 1.02


def test_runs_stopped_once_a_bound_is_proven_broken_give_the_same_answer(tiny):
    # a run that breaks a bound ends early with a floor of the figure; the search decides as it
    # would on the whole run: same statuses, loads and passing runs
    with Runner(1) as runner:
        early = P.run_plan(small_plan(tiny), runner)
        whole = P.run_plan(small_plan(tiny, stop_early=False), runner)
    assert _answer(early) == _answer(whole)
    stopped = [r for r in early.results if (r.fail_row or {}).get("stopped_s") is not None]
    assert stopped
    by_key = {r.candidate.key: r for r in whole.results}
    for r in stopped:
        b, v = P.worst_bound(r.fail_row, early.bounds)
        assert v > b.limit_ms
        assert by_key[r.candidate.key].fail_row[b.column] >= v  # (a floor of the whole run's)
        if r.status == "infeasible":
            assert "at least" in r.note


def toy_probes(capacity):
    """A stand-in for the plan's Probes: the toy's rows, a candidate's capacity
    `capacity("probe" or "whole", candidate)` by the slice it runs (the tiny scenario's 120
    requests are the whole; a probe slice is shorter)."""
    class ToyProbes:
        def __init__(self, raw, source, base_dir, slice_, scheduler, name, stop=()):
            self.part, self.runs = "whole" if slice_.requests == 120 else "probe", 0

        def __call__(self, probes, progress=None, **_):
            self.runs += len(probes)
            return [{"ttft_p99_ms": 100.0 * load / capacity(self.part, c),
                     "throughput_output_tokens_per_s": 0.95 * load * 200}
                    for c, load in probes]
    return ToyProbes


def test_when_every_finalist_fails_the_whole_workload_the_pruned_are_searched_again(
        tiny, monkeypatch):
    # the probe slice flatters the cheap H100 (it carries 10 req/s there, 0.5 on the whole
    # workload, below the 1 req/s required), so the dearer H200 (5 req/s on both) is pruned
    # against it; once the H100 fails on the whole workload, nothing confirmed bounds the H200
    # and it is searched again: it wins
    capacity = {("probe", "h100-sxm"): 10.0, ("whole", "h100-sxm"): 0.5,
                ("probe", "h200"): 5.0, ("whole", "h200"): 5.0}

    monkeypatch.setattr(P, "Probes", toy_probes(lambda part, c: capacity[(part, c.gpu)]))
    space = P.Space(["h100-sxm", "h200"], [1], [1], ["round-robin"], [64], [2048],
                    ["chunked"], [False], [1], [1])
    plan = P.Plan(tiny, BOUNDS, space, PRICES, rate=1.0, probe_requests=60, tolerance=0.05)
    with Runner(1) as runner:
        out = P.run_plan(plan, runner)
    status = {r.candidate.gpu: r.status for r in out.results}
    assert status == {"h100-sxm": "infeasible", "h200": "ok"}
    assert out.winner.candidate.gpu == "h200" and out.winner.confirmed
    assert 4.5 <= out.winner.max_load <= 5.0


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_a_flattering_probe_slice_never_drops_the_true_winner(tiny_module, data):
    # each candidate carries up to 4x more on the probe slice than on the whole workload: the
    # plan's winner is the exhaustive search's (every candidate on the whole workload), or
    # within the tolerance of its cost
    space = P.Space(["h100-sxm", "a100-80gb", "h200"], [1, 2], [1], ["round-robin"], [64, 256],
                    [2048], ["chunked"], [False], [1], [1])
    # (capacities that obey the sibling rule: two GPUs carry no less than one, on either part)
    kinds = [(g, s) for g in space.gpus for s in space.max_num_seqs]
    base = {k: data.draw(st.floats(0.3, 3.0)) for k in kinds}
    flatter = {k: data.draw(st.floats(1.0, 4.0)) for k in kinds}
    tp_gain = data.draw(st.floats(1.0, 2.0))

    def capacity(part, c):
        k = (c.gpu, c.max_num_seqs)
        return base[k] * tp_gain ** (c.tp - 1) * (flatter[k] if part == "probe" else 1.0)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(P, "Probes", toy_probes(capacity))
        winners = []
        for prune in (True, False):
            plan = P.Plan(tiny_module, BOUNDS, space, PRICES, rate=1.0, probe_requests=60,
                          tolerance=0.02, prune=prune)
            with Runner(1) as runner:
                winners.append(P.run_plan(plan, runner).winner)
    got, best = winners
    if best is None:
        assert got is None
        return
    assert got is not None and got.confirmed
    assert got.candidate == best.candidate or \
        got.usd_per_m_tokens <= best.usd_per_m_tokens * (1 + 2 * 0.02)
