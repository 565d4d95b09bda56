"""`servesim sweep --plot`: the curves a sweep or a rate search gives, drawn on the terminal and
to SVG / PNG files."""

import sys

import pytest

from sim.deploy import sweep
from tui import plot
from tui.cli import main


def table(rows, keys):
    return sweep.Table(keys + ["throughput_requests_per_s"], rows, keys)


def row(policy, rate, seed, x, ttft):
    return {"scheduler.policy": policy, "workload.rate": rate, "seed": seed,
            "throughput_requests_per_s": x, "ttft_p50_ms": ttft, "ttft_p99_ms": 2 * ttft,
            "tpot_p50_ms": 10.0, "tpot_p99_ms": None}


def test_a_curve_per_configuration_a_point_per_rate_seeds_averaged():
    keys = ["scheduler.policy", "workload.rate", "seed"]
    t = table([row("fcfs", 4, 0, 3.0, 100), row("fcfs", 4, 1, 5.0, 300),
               row("fcfs", 2, 0, 2.0, 50), row("chunked", 2, 0, 2.0, 40)], keys)
    cs = plot.curves(t)
    assert [c.label for c in cs] == ["scheduler.policy=fcfs", "scheduler.policy=chunked"]
    fcfs = cs[0]
    assert [p[0] for p in fcfs.points] == [2.0, 4.0]  # rate order; seeds averaged
    assert fcfs.points[1][1]["ttft_p50_ms"] == 200 and fcfs.points[1][1]["ttft_p99_ms"] == 400
    assert fcfs.points[1][1]["tpot_p99_ms"] is None and fcfs.marked is None


def test_the_rate_search_answer_is_marked():
    keys = ["scheduler.policy", "workload.rate", "seed"]
    probes = table([row("fcfs", r, 0, r * 0.9, 10 * r) for r in (4, 8, 6)], keys)
    answer = sweep.Table(["scheduler.policy", "seeds", "max_rate"],
                         [{"scheduler.policy": "fcfs", "seeds": 1, "max_rate": 6}],
                         ["scheduler.policy", "seeds"], probes=probes)
    [c] = plot.curves(answer)
    assert [p[0] for p in c.points] == pytest.approx([3.6, 5.4, 7.2])
    assert c.max_rate == 6 and c.marked[0] == pytest.approx(5.4)
    text = plot.text_plot([c], {"ttft_ms": [50.0], "tpot_ms": []})
    ttft_panel = text.split("\n\n")[0]
    assert "*" in ttft_panel and "SLO 50" in ttft_panel
    assert sum(line.count("A") for line in ttft_panel.splitlines()[1:]) == 2  # the 3rd is '*'
    assert "-" * 10 in ttft_panel and "(* max rate 6 req/s)" in text


def test_sweep_plot_on_the_terminal(capsys):
    code = main(["sweep", "chat", "--set", "workload.duration_s=10", "--workers", "1",
                 "--grid", "scheduler.policy=fcfs,chunked", "--grid", "workload.rate=2,6",
                 "--slo", "ttft_ms=500", "--plot"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "TTFT (ms, log scale" in out and "TPOT (ms" in out and "SLO 500" in out
    assert "A/a  scheduler.policy=fcfs" in out and "B/b  scheduler.policy=chunked" in out


@pytest.mark.parametrize("suffix", [".svg", ".png"])
def test_sweep_plot_to_a_file(capsys, tmp_path, suffix):
    pytest.importorskip("matplotlib")
    path = tmp_path / f"curve{suffix}"
    code = main(["sweep", "chat", "--set", "workload.duration_s=10", "--workers", "1",
                 "--find-max-rate", "--slo", "ttft_ms=800", "--tolerance", "0.3",
                 "--plot", str(path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") if suffix == ".png" else b"<svg" in data[:2000]
    if suffix == ".svg":
        assert b"max rate" in data and b"SLO 800 ms" in data


@pytest.mark.parametrize("target, needle", [("out.txt", "must end in .svg or .png"),
                                            ("missing/out.svg", "does not exist")])
def test_a_bad_plot_file_fails_before_the_sweep(capsys, tmp_path, target, needle):
    pytest.importorskip("matplotlib")
    code = main(["sweep", "chat", "--plot", str(tmp_path / target)])
    _, err = capsys.readouterr()
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_a_file_without_matplotlib_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    code = main(["sweep", "chat", "--plot", str(tmp_path / "a.svg")])
    _, err = capsys.readouterr()
    assert code == 2 and "pip install 'servesim[plot]'" in err
