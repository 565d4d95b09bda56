"""The GPU self-check: exit 2 with one line without CUDA; its plumbing, run on NumPy."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

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
    batches=(1, 3), contexts=(64, 128), timing_budget_s=20.0,
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
    assert "kernel correctness:" in text and "copy bandwidth" in text and "agree with NumPy" in text
    json.dumps(report, default=str)  # the --json-out payload serialises


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
