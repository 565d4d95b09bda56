"""`bench live-memory`: the dashboard's resident memory against simulated time."""

from tui.bench import live_memory
from tui.bench.common import run_in_child


def test_the_dashboard_sampled_over_simulated_time_freezes_nothing():
    # A frame's short engine turn must not gc.freeze() what it made (the live dashboard's
    # garbage cycles would be kept for good). In a fresh process, as the bench
    # runs it: in the test's own, objects that earlier tests froze are freed meanwhile and the
    # freeze count goes down (-1, -18), hiding what this run froze.
    r = run_in_child("tui.bench.live_memory", "child", "chat", "none", 8.0, 6.0)
    times = [t for t, _ in r["samples"]]
    assert times == sorted(times) and times[-1] >= 6.0 and len(times) >= 2
    assert all(20 < mb < 2000 for _, mb in r["samples"])
    assert r["gc_frozen"] == 0 and r["events"] > 0 and r["steps"] > 100
    assert "compute none" in live_memory.text({"scenario": "chat", "speed": 8.0,
                                               "sim_seconds": 6.0, "runs": [r]})
