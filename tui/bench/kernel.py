"""`servesim bench kernel`: NumPy paged decode attention against a dense contiguous computation;
with `--static`, the CUDA kernels compiled without a GPU (registers, spills, occupancy, main-loop
instructions) against those of another git ref."""

from __future__ import annotations

from pathlib import Path
from subprocess import CalledProcessError

from gpu import kernel_static
from gpu.bench import kernel_bench
from gpu.cupy_backend import BLOCK_SIZES
from sim.errors import ServesimError
from tui.bench.common import machine

REPO = Path(__file__).resolve().parents[2]


def run(args):
    if not args.static:
        return kernel_bench(repeat=args.repeat)
    try:
        sizes = tuple(int(s) for s in args.block_sizes.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(b not in BLOCK_SIZES for b in sizes):
        raise ServesimError(f"bench kernel --block-sizes {args.block_sizes!r}: want block sizes like 8,16 "
                            f"(powers of two from {BLOCK_SIZES[0]} to {BLOCK_SIZES[-1]})")
    try:
        return kernel_static.compare(args.before, ".", REPO, sizes)
    except (kernel_static.ToolMissing, RuntimeError, CalledProcessError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ServesimError(f"bench kernel --static: {first}") from None


def text(rows) -> str:
    if isinstance(rows, dict):  # --static
        return kernel_static.format_comparison(rows)
    lines = [f"bench kernel: NumPy paged decode attention vs dense, {machine()}",
             f"{'batch':>6} {'context':>8} {'paged GB/s':>11} {'dense GB/s':>11} {'ratio':>6}"]
    for r in rows:
        lines.append(f"{r['batch']:>6} {r['context']:>8} {r['paged_gbps']:>11.2f} "
                     f"{r['dense_gbps']:>11.2f} {r['ratio_to_dense']:>6.2f}")
    return "\n".join(lines)
