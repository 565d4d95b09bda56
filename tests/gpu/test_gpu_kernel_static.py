"""gpu.kernel_static: the SASS main-loop count, occupancy, and the CLI without the CUDA tools."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpu import kernel_static

ROOT = Path(__file__).resolve().parents[2]

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   FFMA R8, R4, R5, R8 ;
        /*0030*/                   LDG.E.128 R12, desc[UR4][R2.64+0x10] ;
        /*0040*/                   LDG.E R16, desc[UR4][R2.64] ;
        /*0050*/                   FFMA R8, R12, R13, R8 ;
        /*0060*/               @P0 BRA 0x10 ;
        /*0070*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0080*/                   EXIT ;
"""


def test_main_loop_counts_the_body_of_the_backward_branch():
    loop = kernel_static.main_loop(SASS.splitlines())
    # Body 0x10..0x60: 6 instructions, two 128-bit loads (the 32-bit load is not K/V data).
    assert loop["instructions"] == 6 and loop["loads_128"] == 2 and loop["instructions_per_16B"] == 3.0
    assert loop["local_memory"] == 0
    spilled = SASS.replace("FFMA R8, R12, R13, R8", "STL [R1+0x8], R8")
    assert kernel_static.main_loop(spilled.splitlines())["local_memory"] == 1


def test_no_loop_no_figure():
    assert kernel_static.main_loop(["        /*0000*/  LDG.E.128 R4, desc[UR4][R2.64] ;"]) is None


@pytest.mark.parametrize("regs, threads, smem, expected", [
    (32, 128, 0, 1.0),        # 32 registers x 2048 threads = the whole register file
    (64, 128, 0, 0.5),
    (128, 128, 0, 0.25),
    (255, 128, 0, 0.125),     # rounded to 256 per thread: 32768 per block, 2 blocks
    (32, 128, 100_000, 0.125),  # shared memory allows 2 blocks of 4 warps
])
def test_occupancy(regs, threads, smem, expected):
    assert kernel_static.occupancy(regs, threads, smem) == pytest.approx(expected)


def test_missing_tools_give_one_line_and_exit_2(tmp_path):
    # A PATH with python but without nvcc; the nvidia pip packages are hidden too.
    hide = tmp_path / "nvidia"
    hide.mkdir()
    (hide / "__init__.py").write_text("__path__ = []\n")
    code = ("import sys; sys.path.insert(0, %r); from tui.cli import main; "
            "sys.exit(main(['bench', 'kernel', '--static']))" % str(tmp_path))
    env = {"PATH": str(Path(sys.executable).parent), "HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert "not found" in r.stderr


@pytest.mark.slow  # (nvcc, cuobjdump and nvdisasm over every decode instantiation)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("storage_name, head_dim", [("float16", 128), ("float32", 64), ("float32", 256)])
def test_every_decode_instantiation_is_analysed(tmp_path, storage_name, head_dim):
    try:
        kernel_static.find_tool("cuobjdump")
        kernel_static.find_tool("nvdisasm")
    except kernel_static.ToolMissing as exc:
        pytest.skip(str(exc))
    from gpu import cupy_backend

    names = cupy_backend.name_expressions(storage_name, head_dim, 16)
    rows = kernel_static.analyse(cupy_backend, names, tmp_path, lambda n: 128)
    # Every heads-per-block variant has a main loop that loads K/V and keeps its registers (a
    # few spilled bytes outside the loop are reported by `bench kernel --static`, not failed
    # here). fp16 decode is the tensor-core kernel; fp32 is too (3xTF32) from
    # FP32_MMA_MIN_HEADS heads per block on, the CUDA-core kernel below.
    decode = [r for r in rows if kernel_static._is_decode(r["kernel"])]
    assert len(decode) == len(cupy_backend.HEADS_PER_BLOCK)
    assert all(r["instructions_per_16B"] > 0 and r["loop_local_memory"] == 0 for r in decode), decode
    mma = {kernel_static.decode_shape(r["kernel"])[2] for r in decode if r["kernel"].startswith("paged_decode_mma")}
    expect = set(cupy_backend.HEADS_PER_BLOCK) if storage_name != "float32" else {
        g for g in cupy_backend.HEADS_PER_BLOCK if g >= cupy_backend.FP32_MMA_MIN_HEADS[head_dim]}
    assert mma == expect
