"""`bench scale`: the pieces that measure (not the figures)."""

import numpy as np

from tui.bench import scale
from tui.bench.memory import reachable_bytes


def test_reachable_bytes_counts_owned_buffers_once_and_skips_what_is_shared():
    a = np.zeros(1000)
    shared = list(range(100))
    obj = {"a": a, "view": a[10:], "again": a, "shared": shared}
    alone = reachable_bytes(obj, skip=[shared])
    assert 8000 <= alone - reachable_bytes({"x": 1, "y": 2, "z": 3, "w": 4}) < 9000
    assert reachable_bytes(obj) > alone + 800  # the shared list counts when asked


def test_past_the_limits_a_run_without_history_holds_the_same_after_more_requests(
        monkeypatch):
    from sim.stats import quantiles
    from sim.engine import timeline
    # (scaled down: chunks of 1,024 steps, ITL exact to 2,048 steps, other figures to 64)
    monkeypatch.setattr(timeline, "CHUNK", 1024)
    monkeypatch.setattr(timeline, "ITL_EXACT_ROWS", 2048)
    monkeypatch.setattr(quantiles, "EXACT_LIMIT", 64)
    small = scale.child("chat", 300, keep_history=False)
    big = scale.child("chat", 1200, keep_history=False)
    kept = scale.child("chat", 1200, keep_history=True)
    assert big["steps"] > 3 * small["steps"] and not big["exact_percentiles"]
    assert abs(big["engine_bytes_after"] - small["engine_bytes_after"]) < 100_000
    assert kept["engine_bytes_after"] - big["engine_bytes_after"] > 1000 * 1200


def test_a_child_run_reports_its_own_max_rss_not_the_parents():
    ballast = np.ones(1 << 27)  # 1 GiB resident in this process when it forks the child
    row = scale.run_child("chat", 100, False)
    del ballast
    assert row["requests"] == 100 and row["wall_s"] > 0
    assert 20 << 20 < row["max_rss_bytes"] < 768 << 20
