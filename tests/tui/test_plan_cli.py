"""`servesim plan` run as a user would: the report, the winner's files, exit codes and one-line
errors."""

import json

import pytest

from tui.cli import main

# `chat` cut to 120 requests, on small spaces
SPACE = ["--set", "workload.duration_s=0", "--set", "workload.num_requests=120", "--gpus", "h100,a100", "--tp", "1", "--replicas", "1,2", "--routers", "round-robin",
         "--max-num-seqs", "64", "--max-num-batched-tokens", "2048", "--policies", "chunked",
         "--prefix-caching", "off", "--dp", "1", "--pp", "1", "--probe-requests", "60",
         "--tolerance", "0.1",
         "--workers", "1"]


@pytest.fixture
def tiny():
    return "chat"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_reports_the_winner_and_writes_it(capsys, tiny, tmp_path):
    winner = tmp_path / "winner.toml"
    code, out, err = run(capsys, "plan", tiny, "--slo", "ttft_p99=1000", "--slo", "tpot_p99=60",
                         *SPACE, "--no-validation", "--winner", str(winner), "--plot")
    assert code == 0, err
    assert "Winner: " in out and "Why not the runner-up: " in out
    assert "vllm serve meta-llama/Llama-3.1-8B-Instruct --tensor-parallel-size 1" in out
    assert "sglang.launch_server" in out and "Pareto front" in out
    code, sim_out, err = run(capsys, "sim", str(winner), "--json", "-q")
    assert code == 0, err
    assert json.loads(sim_out)["requests"]["finished"] == 120


def test_plan_json_carries_the_validation_error_of_each_figure(capsys, tiny, tmp_path):
    # validate's JSON for two points on an H100 at TP1: a TTFT row and a throughput row
    points = {"points": [{"id": "T11", "ratio": 1.10}, {"id": "T15", "ratio": 0.95}]}
    val = tmp_path / "val.json"
    val.write_text(json.dumps(points))
    code, out, err = run(capsys, "plan", tiny, "--slo", "ttft_p99=1000", *SPACE,
                         "--gpus", "h100", "--validation", str(val), "--json")
    assert code == 0, err
    d = json.loads(out)
    errors = d["winner"]["validation_error"]
    assert errors["ttft"] == pytest.approx(0.10) and errors["load"] == pytest.approx(0.05)
    assert errors["tpot"] is None  # never validated there
    assert "vllm serve meta-llama/Llama-3.1-8B-Instruct" in d["vllm"] and d["pareto"]


def test_plan_says_when_the_winner_rests_on_an_unvalidated_regime(capsys, tiny, tmp_path):
    val = tmp_path / "val.json"
    val.write_text(json.dumps({"points": [{"id": "T11", "ratio": 1.10}]}))
    code, out, err = run(capsys, "plan", tiny, "--slo", "ttft_p99=1000", *SPACE,
                         "--gpus", "h100", "--validation", str(val))
    assert code == 0, err
    assert "has not been validated in: throughput, TPOT on h100-sxm at TP1" in out


def test_no_feasible_point_exits_1_with_the_nearest_misses(capsys, tiny):
    code, out, err = run(capsys, "plan", tiny, "--slo", "ttft_p99=0.5", *SPACE,
                         "--no-validation")
    assert code == 1, err
    assert "No deployment meets the bounds" in out and "ttft_p99 <= 0.5 ms" in out
    assert "Nearest misses:" in out and "h100-sxm TP1" in out


@pytest.mark.parametrize("argv, message", [
    (["--slo", "foo_p99=1"], "--slo foo_p99=1: unknown metric 'foo_p99'"),
    (["--slo", "ttft_p99=-3"], "--slo ttft_p99=-3: the bound must be a positive number"),
    (["--slo", "ttft_p99=1", "--gpus", "l40s"], "--gpus l40s: no price for this GPU"),
    (["--slo", "ttft_p99=1", "--gpus", "v100"], "--gpus v100: unknown GPU"),
    (["--slo", "ttft_p99=1", "--price", "h100=free"], "--price h100=free: expected GPU=USD"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, tiny, argv, message):
    code, out, err = run(capsys, "plan", tiny, *SPACE, *argv)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    # numbers too small to divide by (subnormal), and a table of fewer than no rows
    (["--rate", "1e-320"], "argument --rate: '1e-320': expected a positive load"),
    (["--budget", "1e-320"], "argument --budget: '1e-320': expected a positive price"),
    (["--top", "-1"], "argument --top: '-1': expected whole numbers of at least 1"),
    # a count past what a scenario takes was searched (minutes of probes, no line)
    (["--replicas", "99999999999"], "argument --replicas: '99999999999': at most 64 (replicas)"),
    (["--tp", "1,65"], "argument --tp: '1,65': at most 64 (tensor_parallel)"),
    (["--dp", "128"], "argument --dp: '128': at most 64"),
    (["--pp", "1000"], "argument --pp: '1000': at most 64"),
])
def test_bad_option_values_are_one_line_usage_errors(capsys, tiny, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["plan", tiny, "--slo", "ttft_p99=1", *SPACE, *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("text, message", [
    (None, "cannot read as JSON: No such file"),
    ('{"points": [{}]}', "points[0] = {}: expected an object with a text id"),
    ('{"points": [{"id": "T1", "ratio": "x"}]}', "points[0] = {'id': 'T1', 'ratio': 'x'}"),
    ("[" * 100_000, "cannot read as JSON: a value nested too deeply"),
])
def test_a_bad_validation_file_is_refused_before_the_search(capsys, tiny, tmp_path, text,
                                                            message):
    val = tmp_path / "val.json"
    if text is not None:
        val.write_text(text)
    code, out, err = run(capsys, "plan", tiny, "--slo", "ttft_p99=1000", *SPACE,
                         "--validation", str(val))
    assert code == 2 and out == "", out  # (no table: nothing was searched)
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_disaggregated_ratios_are_ranked_and_the_winner_runs(capsys, tiny, tmp_path):
    winner = tmp_path / "winner.toml"
    code, out, err = run(capsys, "plan", tiny, "--slo", "ttft_p99=1000", *SPACE,
                         "--gpus", "h100", "--replicas", "1", "--policies", "disaggregated",
                         "--pd-ratios", "1:1,2:1", "--no-validation", "--winner", str(winner),
                         "--exhaustive")
    assert code == 0, err
    rows = [line.split("P:D ")[1].split() for line in out.splitlines() if "P:D " in line
            and line[:1].isdigit()]
    gpus = {r[0]: [x for x in r[r.index("2048") + 1:] if x != "(probe)"][0] for r in rows}
    assert gpus == {"1:1": "2", "2:1": "3"}  # both ratios in the ranked table, with their GPUs
    code, sim_out, err = run(capsys, "sim", str(winner), "--json", "-q")
    assert code == 0, err
    d = json.loads(sim_out)
    assert d["requests"]["finished"] == 120 and d["deployment"]["mode"] == "disaggregated"


@pytest.mark.parametrize("value", ["1:0", "2", "1.5:1", "1:99", ",", "a:b"])
def test_a_bad_ratio_is_one_line_and_exit_2(capsys, tiny, value):
    with pytest.raises(SystemExit) as e:
        main(["plan", tiny, *SPACE, "--slo", "ttft_p99=1", "--pd-ratios", value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "--pd-ratios" in err and "expected prefill:decode" in err, err


def test_a_price_table_with_a_bad_row(capsys, tiny, tmp_path):
    prices = tmp_path / "prices.toml"
    prices.write_text('[gpu.h100-sxm]\nusd_per_gpu_hour = "cheap"\nsource = "x"\ndate = "2026"\n')
    code, _, err = run(capsys, "plan", tiny, "--slo", "ttft_p99=1000", *SPACE,
                       "--prices", str(prices))
    assert code == 2
    assert f"{prices}: gpu.h100-sxm.usd_per_gpu_hour = 'cheap'" in err
    assert len(err.strip().splitlines()) == 1


def test_a_price_given_on_the_command_line_is_used(capsys, tiny):
    code, out, err = run(capsys, "plan", tiny, "--slo", "ttft_p99=1000", *SPACE, "--gpus", "l40s",
                         "--price", "l40s=1.5", "--no-validation", "--json")
    assert code == 0, err
    w = json.loads(out)["winner"]
    assert w["usd_per_hour"] == pytest.approx(1.5 * w["gpus"])


def _trust_file(path, regimes):
    points = {f"{name}{i}": {"regime": name, "ratio": 1.0} for name, n in regimes.items()
              for i in range(n)}
    path.write_text(json.dumps({"points": points}))
    return str(path)


def test_plan_warns_when_the_winners_regime_has_few_validated_points(capsys, tiny, tmp_path):
    # every TTFT regime well covered, decode and throughput not at all
    trust = _trust_file(tmp_path / "trust.json", {"first token": 6, "queued": 6})
    code, out, err = run(capsys, "plan", tiny, "--slo", "ttft_p99=1000", *SPACE, "--gpus", "h100",
                         "--validation", str(_val(tmp_path)), "--trust", trust)
    assert code == 0, err
    assert "ttft_ms.p99" in out and "expected within +0%/+0%" in out
    assert "The winner depends on a regime the model has not been validated in" in out
    warning = next(line for line in out.splitlines() if "barely: fewer than 5" in line)
    assert "throughput" in warning and "decode" in warning and "queued" not in warning
    trust = _trust_file(tmp_path / "all.json", {"first token": 6, "queued": 6, "throughput": 5,
                                                "decode, small batch": 5,
                                                "decode, large batch": 5})
    code, out, err = run(capsys, "plan", tiny, "--slo", "ttft_p99=1000", *SPACE, "--gpus", "h100",
                         "--validation", str(_val(tmp_path)), "--trust", trust, "--json")
    assert code == 0, err
    figures = json.loads(out)["trust"]
    assert figures["ttft_ms.p99"]["points"] == 6 and figures["tpot_ms.p99"]["points"] == 5


def _val(tmp_path):
    val = tmp_path / "val.json"
    val.write_text(json.dumps({"points": [{"id": "T11", "ratio": 1.10}]}))
    return val


def test_a_closed_loop_plan_reports_users_and_what_it_left_out(capsys, tiny):
    code, out, err = run(capsys, "plan", tiny, "--slo", "ttft_p99=1000", *SPACE,
                         "--concurrency", "4", "--no-validation")
    assert code == 0, err
    assert "load to serve 4 users" in out and "max load users" in out
    assert "A closed loop runs on one engine: 2 candidates with replicas" in out
    assert "concurrency = " in out  # the winner scenario


@pytest.mark.parametrize("setting, message", [
    ("plan.gpu_price_usd_per_hour={h100-sxm=0}",
     "plan.gpu_price_usd_per_hour.h100-sxm = 0: expected US dollars per GPU-hour"),
    ("plan.gpu_price_usd_per_hour={v100=1}", "plan.gpu_price_usd_per_hour.v100: unknown GPU"),
])
def test_a_bad_scenario_price_is_one_line_and_exit_2(capsys, tiny, setting, message):
    code, _, err = run(capsys, "plan", tiny, "--slo", "ttft_p99=1000", *SPACE, "--set", setting)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1


def test_the_scenarios_price_is_used_and_the_flag_wins(capsys, tiny):
    code, out, err = run(capsys, "plan", tiny, "--slo", "ttft_p99=1000", *SPACE, "--gpus", "l40s",
                         "--set", "plan.gpu_price_usd_per_hour={l40s=1.25}", "--no-validation",
                         "--json")
    assert code == 0, err
    w = json.loads(out)["winner"]
    assert w["usd_per_hour"] == pytest.approx(1.25 * w["gpus"])
    code, out, err = run(capsys, "plan", tiny, "--slo", "ttft_p99=1000", *SPACE, "--gpus", "l40s",
                         "--set", "plan.gpu_price_usd_per_hour={l40s=1.25}", "--price",
                         "l40s=0.75", "--no-validation", "--json")
    assert code == 0, err
    w = json.loads(out)["winner"]
    assert w["usd_per_hour"] == pytest.approx(0.75 * w["gpus"])
    assert json.loads(out)["prices"]["l40s"]["source"] == "--price"
