"""The GPU self-check: exit 2 with one line without CUDA; its plumbing, run on NumPy."""

import json
import math
import os
import stat
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import gpu
from gpu import selfcheck
from gpu.executor import CPU_MODEL

ROOT = Path(__file__).resolve().parents[2]


def cuda_usable() -> bool:
    try:
        gpu.get_backend("cupy")
        return True
    except gpu.BackendUnavailable:
        return False


@pytest.mark.skipif(cuda_usable(), reason="a CUDA device is usable here")
def test_without_cuda_exits_2_with_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "gpu.selfcheck", "--json-out", str(tmp_path / "r.json")],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert "cupy" in result.stderr
    report = json.loads((tmp_path / "r.json").read_text())  # the JSON says why, too
    assert report["backend"] is None and not report["passed"] and "cupy" in report["error"]


def test_get_backend_names_and_errors():
    assert gpu.get_backend("numpy").name == "numpy"
    assert gpu.get_backend("auto").name in ("numpy", "cupy")
    with pytest.raises(ValueError, match="backend 'tpu'"):
        gpu.get_backend("tpu")
    if not cuda_usable():
        with pytest.raises(gpu.BackendUnavailable) as caught:
            gpu.get_backend("cupy")
        assert "\n" not in str(caught.value)


TINY = selfcheck.Plan(
    storages=("float32", "float16"),
    kernel_cases=[(4, 2, 32, 8, [1, 8, 45]), (2, 1, 64, 16, [70, 3])],
    timing_models=(("tiny", 4, 2, 32),), block_size=8, timing_dtype="float32",
    batches=(1, 3), contexts=(64, 128), timing_budget_s=math.inf,  # every shape, however slow the machine
    token_dtypes=("float32",), token_model=dict(CPU_MODEL), token_prompts=(5, 9), new_tokens=4,
)


def test_report_plumbing_runs_on_numpy(tmp_path):
    report = selfcheck.run(gpu.get_backend("numpy"), TINY)
    kernels = {r["kernel"] for r in report["correctness"]}
    assert kernels == {"decode", "prefill", "write_kv"} and report["correctness_passed"]
    (model,) = report["decode_timings"]["models"]
    rows = model["rows"]
    assert len(rows) == 4 and all(r["paged_gbps"] > 0 and r["dense_gbps"] > 0 for r in rows)
    assert all(r["max_rel_error_vs_dense"] < 1e-4 for r in rows)
    (tokens,) = report["token_identity"]
    assert tokens["agreement"] == 1.0 and all(r["batched_equals_alone"] for r in tokens["requests"])
    text = selfcheck.format_report(report)
    assert "kernel correctness:" in text and "device-to-device copy" in text and "agree with NumPy" in text
    json.dumps(report, default=str)  # the --json-out payload serialises


def test_a_spent_time_budget_skips_the_shapes_and_the_report_stays_whole(tmp_path, monkeypatch, capsys):
    # Budget 0: every shape is skipped, as the later ones are when a slow machine spends the
    # budget; the rows say so, and the table, the verdicts and the JSON still come out.
    report = selfcheck.run(gpu.get_backend("numpy"), replace(TINY, timing_budget_s=0.0))
    rows = report["decode_timings"]["models"][0]["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 64), (3, 64), (1, 128), (3, 128)]
    assert all(r["skipped"] == "time budget spent" and "paged_gbps" not in r for r in rows)
    assert report["correctness_passed"] and report["timing_outputs_passed"] and report["passed"]
    text = selfcheck.format_report(report)
    assert text.count("time budget spent") == 4 and "PASSED" in text
    strict_json(json.dumps(selfcheck._json_safe(report), allow_nan=False))

    # --time-budget on the command line: 0 skips every shape, inf none; a bad value is exit 2.
    monkeypatch.setattr(selfcheck, "get_backend", lambda kind: gpu.get_backend("numpy"))
    monkeypatch.setattr(selfcheck, "TINY", TINY)
    path = tmp_path / "r.json"
    for budget, skipped in (("0", 4), ("inf", 0)):
        assert selfcheck.main(["--tiny", "--time-budget", budget, "--json-out", str(path)]) == 0
        rows = strict_json(path.read_text())["decode_timings"]["models"][0]["rows"]
        assert sum("skipped" in r for r in rows) == skipped
    capsys.readouterr()
    for bad in ("-1", "soon", "nan"):
        with pytest.raises(SystemExit) as exited:
            selfcheck.main(["--tiny", "--time-budget", bad])
        assert exited.value.code == 2 and "--time-budget" in capsys.readouterr().err


def test_a_failing_kernel_is_reported_not_raised():
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    numpy = gpu.get_backend("numpy")
    kernels = SimpleNamespace(paged_decode_attention=numpy.kernels.paged_decode_attention,
                              paged_prefill_attention=broken, write_kv=numpy.kernels.write_kv)
    plan = selfcheck.Plan(storages=("float32",), kernel_cases=[(1, 1, 32, 8, [9])])
    results = selfcheck.check_kernels(replace(numpy, kernels=kernels), plan)
    failed = [r for r in results if not r["passed"]]
    assert [r["kernel"] for r in failed] == ["prefill"] and "boom" in failed[0]["error_text"]


def strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")
    return json.loads(text, parse_constant=refuse)


def test_a_section_that_raises_is_recorded_and_the_json_keeps_each_section(tmp_path, monkeypatch):
    def broken_timings(backend, plan, seed=0):
        raise RuntimeError("timing exploded")

    monkeypatch.setattr(selfcheck, "time_decode", broken_timings)
    path = tmp_path / "r.json"
    out, seen = selfcheck.ReportFile(str(path)), []

    def on_section(report):
        out.write(report)
        seen.append(strict_json(path.read_text()))

    report = selfcheck.run(gpu.get_backend("numpy"), TINY, on_section=on_section)
    assert [list(w["sections"]) for w in seen] == [["correctness"], ["correctness", "decode_timings"],
                                                  ["correctness", "decode_timings", "token_identity"]]
    assert seen[0]["correctness_passed"] and seen[0]["correctness"]  # written before the failure
    timings = report["sections"]["decode_timings"]
    assert timings["status"] == "failed" and "timing exploded" in timings["error_text"]
    assert report["sections"]["token_identity"]["status"] == "ok" and report["tokens_passed"]
    assert report["correctness_passed"] and not report["timing_outputs_passed"] and not report["passed"]
    assert "decode_timings: FAILED: RuntimeError: timing exploded" in selfcheck.format_report(report)
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left beside it


def test_a_broken_device_stops_the_cases_and_skips_the_later_sections(monkeypatch):
    # A kernel fault leaves the CUDA context broken: every later call would fail, one by one.
    monkeypatch.setattr(selfcheck, "device_error", lambda backend: "CUDARuntimeError: cudaErrorIllegalAddress")
    report = selfcheck.run(gpu.get_backend("numpy"), TINY)
    kinds = [r["kernel"] for r in report["correctness"]]
    assert kinds[-1] == "device" and kinds.count("device") == 1 and len(kinds) < 26
    for name in ("decode_timings", "token_identity"):
        section = report["sections"][name]
        assert section["status"] == "skipped" and "cudaErrorIllegalAddress" in section["reason"]
    assert not report["passed"] and "decode_timings: SKIPPED" in selfcheck.format_report(report)


def test_timed_calls_rotate_over_kv_sets_and_the_outputs_are_checked():
    plan = replace(TINY, rotate_bytes=1 << 16, storages=("float32",), kernel_cases=[(1, 1, 32, 8, [9])])
    report = selfcheck.run(gpu.get_backend("numpy"), plan)
    rows = report["decode_timings"]["models"][0]["rows"]
    # batch 1 x 64 tokens x 2 kv heads x 32 x 4 bytes x (K, V) = 32 KiB: 2 sets cover 64 KiB
    assert [r["kv_sets"] for r in rows] == [2, 1, 1, 1]
    assert all(r["passed"] and r["rounds"] == TINY.rounds for r in rows) and report["timing_outputs_passed"]


def test_a_wrong_timed_output_fails_the_run(monkeypatch):
    numpy = gpu.get_backend("numpy")

    def off_by_a_bit(q, *args, out=None, **options):
        result = numpy.kernels.paged_decode_attention(q, *args, **options)
        out[...] = result * 1.01
        return out

    kernels = SimpleNamespace(paged_decode_attention=off_by_a_bit, paged_prefill_attention=None, write_kv=None)
    monkeypatch.setattr(selfcheck, "SECTIONS", ("decode_timings",))
    report = selfcheck.run(replace(numpy, kernels=kernels), TINY)
    rows = report["decode_timings"]["models"][0]["rows"]
    assert all(r["passed"] is False for r in rows) and not report["timing_outputs_passed"]
    assert "FAILED" in selfcheck.format_report(report)


def test_main_writes_strict_json_and_exits_by_the_checks(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(selfcheck, "get_backend", lambda kind: gpu.get_backend("numpy"))
    monkeypatch.setattr(selfcheck, "TINY", TINY)
    path = tmp_path / "r.json"
    assert selfcheck.main(["--tiny", "--json-out", str(path)]) == 0
    report = strict_json(path.read_text())
    assert report["passed"] and report["versions"]["numpy"] == np.__version__
    assert "PASSED" in capsys.readouterr().out

    monkeypatch.setattr(selfcheck, "_rel_error", lambda got, ref: math.inf)  # every check fails, inf errors
    assert selfcheck.main(["--tiny", "--json-out", str(path)]) == 1
    report = strict_json(path.read_text())
    assert not report["passed"] and report["correctness"][0]["error"] == "inf"


@pytest.mark.parametrize("where", ["missing-folder/r.json", "."])
def test_main_refuses_an_unwritable_json_out_before_running(tmp_path, monkeypatch, capsys, where):
    monkeypatch.setattr(selfcheck, "run", lambda *a, **k: pytest.fail("ran before checking --json-out"))
    assert selfcheck.main(["--json-out", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--json-out" in err and "Traceback" not in err


def test_a_fifo_json_out_is_written_once_and_kept(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    out = selfcheck.ReportFile(str(fifo))
    out.write({"partial": True})  # not at the end: nothing written (a reader would see two reports)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    out.write({"final": math.inf}, final=True)
    reader.join(10)
    assert strict_json(got[0]) == {"final": "inf"} and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_the_report_gets_the_mode_a_new_file_would_and_a_failed_write_is_exit_2(tmp_path, monkeypatch,
                                                                                 capsys):
    monkeypatch.setattr(selfcheck, "get_backend", lambda kind: gpu.get_backend("numpy"))
    monkeypatch.setattr(selfcheck, "TINY", TINY)
    path = tmp_path / "r.json"
    old = os.umask(0o022)
    try:
        assert selfcheck.main(["--tiny", "--json-out", str(path)]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644  # (mkstemp alone made it 0600)
    capsys.readouterr()

    def full_disk(self, report, final=False):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(selfcheck.ReportFile, "write", full_disk)
    assert selfcheck.main(["--tiny", "--json-out", str(path)]) == 2  # (was a traceback, exit 1)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and "Traceback" not in err
