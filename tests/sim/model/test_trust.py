import json

import pytest

from sim.inputs.scenario import BUNDLED_DIR, load_scenario
from sim.model import trust as T
from sim.model.validate import load_points, point_scenario, run_point
from tui.cli import main


def run(ttft=100.0, queue=0.0, batch=1.0):
    return {"ttft_ms": {"mean": ttft, "count": 1}, "queue_ms": {"mean": queue},
            "batch": {"mean": batch}}


@pytest.mark.parametrize("quantity,summary,expected", [
    ("output_tps", run(queue=90.0), "throughput"),
    ("request_tps", run(), "throughput"),
    ("ttft", run(ttft=100.0, queue=49.0), "first token"),
    ("ttft", run(ttft=100.0, queue=50.0), "queued"),
    ("e2e", run(ttft=100.0, queue=80.0, batch=2.0), "queued"),
    ("e2e", run(ttft=100.0, queue=0.0, batch=2.0), "decode, small batch"),
    ("tpot", run(queue=99.0, batch=16.0), "decode, small batch"),
    ("itl", run(batch=16.5), "decode, large batch"),
    ("user_tps", run(batch=200.0), "decode, large batch"),
])
def test_regimes_follow_the_run(quantity, summary, expected):
    assert T.regime(quantity, summary) == expected


def test_spread_is_where_published_values_lay_around_the_predictions():
    # predicted 0.8x and 1.25x the published: published was +25% and -20% of the prediction
    s = T.spread([0.8, 1.25, 1.0])
    assert s["count"] == 3
    assert s["low"] == pytest.approx(-0.2) and s["high"] == pytest.approx(0.25)
    assert s["median"] == pytest.approx(0.0)


def test_spread_takes_the_10th_to_90th_percentile_from_ten_points():
    ratios = [1 / (1 + d) for d in [-0.5] + [0.01 * i for i in range(10)] + [3.0]]
    s = T.spread(ratios)
    assert s["count"] == 12
    assert -0.5 < s["low"] < 0.01 and 0.08 < s["high"] < 3.0  # the extremes are cut
    assert T.spread([])["low"] is None


def test_table_groups_points_by_regime():
    t = T.table({"a": {"regime": "queued", "ratio": 0.5}, "b": {"regime": "queued", "ratio": 2.0},
                 "c": {"regime": "throughput", "ratio": 1.0}})
    assert t["queued"]["count"] == 2 and t["queued"]["high"] == pytest.approx(1.0)
    assert t["throughput"]["count"] == 1 and t["first token"]["count"] == 0


def test_attach_names_each_headline_figure_with_its_regime_interval():
    trust = {"regimes": {**{r: T.spread([]) for r in T.REGIMES},
                         "queued": T.spread([0.5, 1.0]), "throughput": T.spread([1.1])}}
    summary = {**run(ttft=100.0, queue=80.0, batch=40.0),
               "tpot_ms": {"p50": 20.0, "p99": 30.0}, "throughput": {"output_tokens_per_s": 9.0}}
    summary["ttft_ms"].update(p50=90.0, p99=200.0)
    figures = T.attach(summary, trust)
    assert figures["ttft_ms.p50"] == {"value": 90.0, "regime": "queued", "points": 2,
                                      "low": 0.0, "high": 1.0}
    assert figures["tpot_ms.p99"]["regime"] == "decode, large batch"
    assert figures["tpot_ms.p99"]["low"] is None  # no point there: no claim
    assert "not validated" in T.describe(figures)[2]
    assert "+100%" in T.describe(figures)[0]


def test_the_bundled_trust_file_covers_every_out_of_sample_point():
    trust = T.load()
    wanted = {p.id for p in load_points(BUNDLED_DIR / "fidelity") if p.use in ("fit", "holdout")}
    assert set(trust["points"]) == wanted
    assert sum(s["count"] for s in trust["regimes"].values()) == len(wanted)


def test_coverage_counts_the_points_that_share_the_runs_gpu_model_and_engine():
    def point(hardware, model="llama-3.1-8b", engine="vllm-v1"):
        return {"regime": "throughput", "ratio": 1.0, "hardware": hardware, "model": model,
                "engine": engine}
    trust = {"points": {"a": point("h100-sxm"), "b": point("h100-sxm", engine="sglang"),
                        "c": point("a100-80gb", model="llama-3.1-70b"),
                        "d": point("a100-80gb", engine="sglang")}}
    sxm = load_scenario("chat", ['engine.preset="vllm-v1"'])
    assert T.setup(sxm) == {"hardware": "h100-sxm", "model": "llama-3.1-8b", "engine": "vllm-v1"}
    assert T.coverage(sxm, trust) == {
        "hardware": {"value": "h100-sxm", "points": 2}, "model": {"value": "llama-3.1-8b",
                                                                  "points": 3},
        "engine": {"value": "vllm-v1", "points": 2},
        "setup": {"value": "h100-sxm, llama-3.1-8b, vllm-v1", "points": 1}}
    # each shared on its own, none all three at once: the setup says so
    a100 = load_scenario("chat", ['hardware.preset="a100-80gb"', 'engine.preset="vllm-v1"'])
    cov = T.coverage(a100, trust)
    assert [cov[k]["points"] for k in ("hardware", "model", "engine", "setup")] == [2, 3, 2, 0]
    assert T.describe_coverage(cov)[3] == ("published points of this GPU, model and engine "
                                           "profile together (a100-80gb, llama-3.1-8b, "
                                           "vllm-v1): none")
    pcie = load_scenario("chat", ['hardware.preset="h100-pcie"', 'engine.preset="sglang"'])
    cov = T.coverage(pcie, trust)
    assert cov["hardware"] == {"value": "h100-pcie", "points": 0}
    lines = T.describe_coverage(cov)
    assert lines[0] == ("published points on this GPU (h100-pcie): none: predicted from its data "
                        "sheet and profiles fitted on other GPUs")
    assert lines[2].endswith("(sglang): 2")
    # a file that records no setups (written without them) makes no claim
    for p in trust["points"].values():
        del p["engine"], p["hardware"], p["model"]
    assert T.coverage(sxm, trust) is None


def test_a_trust_file_records_every_points_setup_or_none(tmp_path):
    p = tmp_path / "t.json"
    both = {"regime": "queued", "ratio": 1.0}
    p.write_text(json.dumps({"points": {"a": both, "b": both}}))
    assert T.load(p)["points"]["a"] == both  # an older file: no setups
    p.write_text(json.dumps({"points": {"a": {**both, "hardware": "h100-sxm", "model": "m",
                                              "engine": "e"}, "b": both}}))
    with pytest.raises(T.TrustError, match=r"t.json: points.b: no engine \(other points"):
        T.load(p)


def test_the_bundled_trust_file_records_each_points_setup():
    trust = T.load()
    for p in load_points(BUNDLED_DIR / "fidelity"):
        if p.id in trust["points"]:
            entry = trust["points"][p.id]
            assert {k: entry[k] for k in T.SETUP} == T.setup(point_scenario(p)), p.id


def test_a_validated_point_carries_its_setup():
    t1 = next(p for p in load_points(BUNDLED_DIR / "fidelity") if p.id == "T1")
    row = run_point(t1)
    assert row["setup"] == T.setup(point_scenario(t1))
    assert row["setup"]["hardware"] == "a100-80gb"


@pytest.mark.parametrize("text,why", [("{", "not JSON"), ('{"points": 3}', "points"),
                                      ('{"points": {"x": {"regime": "fast", "ratio": 1}}}',
                                       "points.x"),
                                      ('{"points": {"x": {"regime": "queued", "ratio": 1, '
                                       '"hardware": 3}}}', "points.x.hardware: expected a string"),
                                      # json's recursive parser ran out of stack
                                      ("[" * 100_000 + "]" * 100_000, "not JSON: a value nested "
                                                                      "too deeply")])
def test_a_bad_trust_file_is_one_line(tmp_path, text, why):
    p = tmp_path / "t.json"
    p.write_text(text)
    with pytest.raises(T.TrustError, match=why):
        T.load(p)


def test_sim_trust_attaches_intervals(capsys):
    assert main(["sim", "chat", "--trust", "--json", "-q", "--set", "workload.num_requests=40"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["trust"]) == {"ttft_ms.p50", "ttft_ms.p99", "tpot_ms.p50", "tpot_ms.p99",
                                 "throughput.output_tokens_per_s"}
    f = out["trust"]["ttft_ms.p50"]
    assert f["value"] == out["ttft_ms"]["p50"] and f["regime"] in T.REGIMES
    assert main(["sim", "chat", "--trust", "-q", "--set", "workload.num_requests=40"]) == 0
    assert "expected within" in capsys.readouterr().out
    cover = out["trust_coverage"]
    assert cover["hardware"]["value"] == "h100-sxm" and cover["hardware"]["points"] > 0
    # a GPU no published point ran on: said so, beside the borrowed intervals
    assert main(["sim", "chat", "--trust", "-q", "--set", "workload.num_requests=40",
                 "--set", 'hardware.preset="h100-pcie"']) == 0
    text = capsys.readouterr().out
    assert "published points on this GPU (h100-pcie): none: predicted from its data sheet" in text
    assert "of this GPU, model and engine profile together (h100-pcie, " in text


def test_trust_file_needs_the_leave_one_out(tmp_path, capsys):
    assert main(["validate", "--fit", "--trust", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err
    assert "--trust" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "t.json").exists()


@pytest.mark.slow
def test_the_bundled_regimes_are_those_the_points_run_in():
    trust = T.load()
    for p in load_points(BUNDLED_DIR / "fidelity"):
        if p.id in trust["points"]:
            assert run_point(p)["trust_regime"] == trust["points"][p.id]["regime"], p.id


def test_sim_readme_shows_the_bundled_intervals():
    text = (BUNDLED_DIR.parent / "sim" / "README.md").read_text()
    for name, s in T.load()["regimes"].items():
        row = (f"| {name} | {s['count']} | {s['low']:+.0%} | {s['median']:+.0%} | "
               f"{s['high']:+.0%} |")
        assert row in text, row
