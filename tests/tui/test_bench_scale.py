"""`bench scale` and `bench hotpath`: the pieces that measure (not the figures)."""

import json

import numpy as np

from tui import bench_scale
from tui.cli import main


def test_reachable_bytes_counts_owned_buffers_once_and_skips_what_is_shared():
    a = np.zeros(1000)
    shared = list(range(100))
    obj = {"a": a, "view": a[10:], "again": a, "shared": shared}
    alone = bench_scale.reachable_bytes(obj, skip=[shared])
    assert 8000 <= alone - bench_scale.reachable_bytes({"x": 1, "y": 2, "z": 3, "w": 4}) < 9000
    assert bench_scale.reachable_bytes(obj) > alone + 800  # the shared list counts when asked


def test_past_the_limits_a_run_without_history_holds_the_same_after_more_requests(
        monkeypatch):
    from sim.stats import quantiles
    from sim.engine import timeline
    # (scaled down: chunks of 1,024 steps, ITL exact to 2,048 steps, other figures to 64)
    monkeypatch.setattr(timeline, "CHUNK", 1024)
    monkeypatch.setattr(timeline, "ITL_EXACT_ROWS", 2048)
    monkeypatch.setattr(quantiles, "EXACT_LIMIT", 64)
    small = bench_scale.child("chat", 300, keep_history=False)
    big = bench_scale.child("chat", 1200, keep_history=False)
    kept = bench_scale.child("chat", 1200, keep_history=True)
    assert big["steps"] > 3 * small["steps"] and not big["exact_percentiles"]
    assert abs(big["engine_bytes_after"] - small["engine_bytes_after"]) < 100_000
    assert kept["engine_bytes_after"] - big["engine_bytes_after"] > 1000 * 1200


def test_a_child_run_reports_its_own_max_rss_not_the_parents():
    ballast = np.ones(1 << 27)  # 1 GiB resident in this process when it forks the child
    row = bench_scale._run_child("chat", 100, False)
    del ballast
    assert row["requests"] == 100 and row["wall_s"] > 0
    assert 20 << 20 < row["max_rss_bytes"] < 768 << 20


def test_bench_hotpath_names_the_functions_of_a_decision(capsys):
    assert main(["bench", "hotpath", "--scenario", "long-context", "--top", "8",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["decisions"] > 100 and r["steps"] >= r["decisions"]
    assert len(r["functions"]) == 8 and sum(f["share"] for f in r["functions"]) <= 1.0
    assert any(f["function"].startswith(("engine.py:", "stepping.py:")) for f in r["functions"])
    assert r["us_per_decision"] > max(f["us_per_decision"] for f in r["functions"])
