"""The CUDA kernels, run on the CPU in the emulator of tests/gpu/cuda_emu (no GPU needed).

Every run of the slow set (`pytest -q -m slow`, which `.ci/run` runs after the plain
`pytest -q`; what compiles or runs kernels here is marked `slow`): the `ci` suite (every
instantiation family, batch invariance, a too-small max_seq_len, misaligned write_kv sources)
under two thread/block orders, the head_dim static_asserts and the self-check on the emulated
CuPy. On demand, SERVESIM_EMU_FULL=1: the full matrix (sweep, special, write_kv, chain,
misuse; several minutes) and the mutation check (planted bugs must be caught). Skipped where
the emulator cannot be built (not x86-64 Linux, no g++ >= 12, no nm).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cuda_emu import emulator

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RUN = HERE / "cuda_emu" / "run.py"
REASON = emulator.unavailable()
FULL = os.environ.get("SERVESIM_EMU_FULL") == "1"

pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def run_suite(*args: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    # A process of its own: a kernel that strays out of an array faults and ends it.
    return subprocess.run([sys.executable, str(RUN), "--quiet", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_ci_suite_passes_under_two_schedules():
    r = run_suite("--suite", "ci", "--schedules", "0,2")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed, 0 failed" in r.stdout


def compile_module(names: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    from gpu import cupy_backend

    table = ",\n".join(f'EMU_KERNEL("{n}", {n})' for n in names)
    src = tmp_path / "probe.cpp"
    src.write_text(cupy_backend.kernel_source() + f"\nEMU_MODULE_TABLE({table})\n")
    return subprocess.run(["g++", *emulator.FLAGS, "-fsyntax-only", "-include", "cuda_emu.h", str(src)],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("name, message", [
    ("paged_decode_kernel<F16, 80, 1, 16>", "power of two"),
    ("paged_decode_kernel<F32, 512, 1, 16>", "head_dim in [32, 256]"),
    ("paged_decode_kernel<F16, 128, 1, 12>", "block_size a power of two"),
    ("paged_prefill_kernel<F16, 80>", "head_dim a multiple of 32"),
])
def test_unsupported_shapes_fail_to_compile(tmp_path, name, message):
    # Before the static_asserts, head_dim 80 compiled and computed garbage (10 lanes per token).
    r = compile_module([name], tmp_path)
    assert r.returncode != 0 and "static assertion failed" in r.stderr and message in r.stderr, r.stderr[-3000:]


@pytest.mark.slow
def test_supported_shapes_compile(tmp_path):
    r = compile_module(["paged_decode_kernel<F16, 128, 8, 64>", "paged_prefill_kernel<BF16, 256>"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="full emulator matrix: set SERVESIM_EMU_FULL=1")
def test_full_matrix():
    r = run_suite("--suite", "full", "--schedules", "0,2", timeout=3600)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-3000:]


def test_every_planted_bug_has_one_place_to_go():
    # Runs everywhere (no compiler): a kernel edit that duplicates or removes a mutation's target
    # text would otherwise surface only in the on-demand mutation check, as a "missed" bug.
    from cuda_emu import mutate

    for name, (file, old, _, _) in mutate.MUTATIONS.items():
        assert (mutate.KERNELS / file).read_text().count(old) == 1, name


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="mutation check: set SERVESIM_EMU_FULL=1")
def test_planted_bugs_are_caught():
    r = subprocess.run([sys.executable, str(HERE / "cuda_emu" / "mutate.py")], cwd=ROOT, capture_output=True,
                       text=True, timeout=3600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


@pytest.mark.slow
def test_selfcheck_runs_with_only_numpy_and_cupy(tmp_path):
    # The real `python -m gpu.selfcheck` over the fake CuPy, with textual, msgpack, sim, tui...
    # made unimportable: correctness, timings and tokens all go through the emulated kernels.
    # No time budget: every shape is timed however loaded the machine (with --tiny's 30 s, a
    # busy machine skipped shapes, whose rows have no figures).
    out = tmp_path / "report.json"
    r = subprocess.run([sys.executable, str(HERE / "cuda_emu" / "selfcheck_main.py"), "--tiny", "--time-budget", "inf",
                        "--json-out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["backend"] == "cupy" and "CPU emulator" in report["device"]
    kernels = {(c["kernel"], c.get("split_k"), c.get("source_offset")) for c in report["correctness"]}
    assert {("decode", None, None), ("decode", False, None), ("decode", True, None), ("prefill", None, None),
            ("write_kv", None, None), ("write_kv", None, 1)} <= kernels
    models = report["decode_timings"]["models"]
    assert [m["model"] for m in models] == ["tiny-gqa4", "tiny-gqa8"]
    assert not [r for m in models for r in m["rows"] if "skipped" in r], models
    assert all(r["paged_gbps"] > 0 and r["max_rel_error_vs_dense"] < 1e-2 for m in models for r in m["rows"])
    # Rounds queued behind the spin kernel (kernels/timing.cu), and small shapes timed over
    # several K/V sets (the fake device's L2 is 64 KiB): both went through the emulated device.
    assert "spin kernel" in report["decode_timings"]["timing_method"]
    assert "no spin" not in report["decode_timings"]["timing_method"]
    sets = [r["kv_sets"] for m in models for r in m["rows"]]
    assert max(sets) > 1 and min(sets) == 1, sets
    assert report["passed"] and all(s["status"] == "ok" for s in report["sections"].values())
    (tokens,) = report["token_identity"]
    assert all(req["batched_equals_alone"] for req in tokens["requests"]), tokens
