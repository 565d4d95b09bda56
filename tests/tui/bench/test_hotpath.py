"""`bench hotpath`: a profiled run, by function, per scheduling decision."""

import json

from tui.cli import main


def test_bench_hotpath_names_the_functions_of_a_decision(capsys):
    assert main(["bench", "hotpath", "--scenario", "long-context", "--top", "8",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["decisions"] > 100 and r["steps"] >= r["decisions"]
    assert len(r["functions"]) == 8 and sum(f["share"] for f in r["functions"]) <= 1.0
    assert any(f["function"].startswith(("engine.py:", "stepping.py:")) for f in r["functions"])
    assert r["us_per_decision"] > max(f["us_per_decision"] for f in r["functions"])
