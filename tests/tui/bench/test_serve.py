"""`servesim bench serve` end to end at a toy size: the server as a child process, a few streams,
the report's figures present and sane, the server and client placed as asked."""

from __future__ import annotations

import argparse
import os

import pytest

from tui import bench
from tui.bench import serve


def args(**kw) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    a = ap.parse_args(["serve", "--streams", "4", "--duration", "1.5", "--max-tokens", "12",
                       "--prompt-tokens", "16"])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_placement_splits_the_cpus_or_leaves_them_to_the_kernel():
    assert serve._placement(False) is None
    got = serve._placement(True)
    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        assert got is None
    else:
        server, client = got
        cpus = os.sched_getaffinity(0)
        assert server | client == cpus and not server & client and len(server) == 1
        assert min(cpus) in server


@pytest.mark.parametrize("pin", [True, False])
def test_bench_serve_reports_every_stream_and_restores_its_cpus(pin):
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    r = serve.run(args(pin=pin))
    if before is not None:
        assert os.sched_getaffinity(0) == before  # the client's placement is undone
    assert r["errors"] == 0 and r["requests"] >= 4
    assert r["tokens"] == 12 * r["requests"]  # every token of every request seen by the client
    late = r["send_lateness_ms"]
    assert late["p50"] is not None and late["p50"] <= late["p99"] <= late["max"]
    assert (r["pinned"] is not None) == (pin and serve._placement(True) is not None)
    text = serve.text(r)
    assert "send lateness" in text and ("client on" in text) == (r["pinned"] is not None)
