"""`servesim bench plan`'s bookkeeping around its plans (the plans themselves: tests/sim/deploy)."""

import argparse

import pytest

from tui.bench import plan as B


def _summary(prune: bool, workers: int) -> dict:
    return {"wall_s": 2.0 / workers, "load_before": (0.1, 0.1, 0.1), "load_after": (1, 1, 1),
            "candidates": 4, "runs": 9, "resumed": 0, "statuses": {"ok": 2, "infeasible": 2},
            "work": {"runs_ahead_unused": 0, "cpu_s_unused": 0.0, "cpu_s": 2.0,
                     "critical_path_s": 1.0, "utilisation": [0.9] * workers},
            "winner": "H200 TP2", "winner_max_load": 5.0,
            "winner_usd_per_m_tokens": 3.0 if prune else 2.95,
            "ranked": [("H200 TP2", "ok", 5.0)]}


@pytest.mark.parametrize("skip_scaling", [True, False])
@pytest.mark.parametrize("exhaustive", [True, False])
def test_every_combination_of_flags_reports(monkeypatch, skip_scaling, exhaustive):
    plans = []

    def timed(plan, workers, journal=None):
        plans.append((plan.prune, workers, journal))
        return _summary(plan.prune, workers)
    monkeypatch.setattr(B, "_timed", timed)
    out = B.run(argparse.Namespace(workers=2, skip_scaling=skip_scaling, exhaustive=exhaustive,
                                   output="x.jsonl"))
    assert ("full_1_worker" in out) is not skip_scaling
    assert out["exhaustive_space"] == ("whole" if exhaustive else "small")
    assert plans[-1] == (False, 2, "x.jsonl")  # the exhaustive search, with its file
    assert out["agreement"]["agrees"] and out["agreement"]["same_winner"]
    assert "AGREE" in B.text(out) and not any("ranked" in v for v in out.values()
                                              if isinstance(v, dict))
