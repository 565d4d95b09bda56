"""Runs emulator suites: `python tests/gpu/cuda_emu/run.py [--suite ci|full|NAMES] [--schedules 0,1,2]
[--variant opt|ubsan] [--guard 0|1] [--json PATH] [--kernel-dir DIR]`.

Prints one PASS / FAIL line per case and a closing count; exit 0 when every case passed, 1 when
one failed, 86 when a kernel faulted (the emulator's guard pages caught an access outside an
array). `--kernel-dir` compiles kernels from another directory (the mutation check uses it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # the repository: `gpu`
sys.path.insert(0, str(HERE.parent))      # tests/gpu: `cuda_emu`

import numpy as np  # noqa: E402

from cuda_emu import cases  # noqa: E402
from cuda_emu.emulator import Emulator  # noqa: E402
from gpu import cupy_backend  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="ci", help=f"comma-separated suites, or 'full' ({cases.FULL})")
    ap.add_argument("--schedules", default="0,2")
    ap.add_argument("--variant", default="opt", choices=["opt", "ubsan"])
    ap.add_argument("--guard", type=int, default=0, help="0: guard page after each array, 1: before")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--kernel-dir", default=None)
    ap.add_argument("--quiet", action="store_true", help="print failures and the closing line only")
    args = ap.parse_args(argv)
    if args.kernel_dir:
        cupy_backend.KERNEL_DIR = Path(args.kernel_dir)
    emu = Emulator(args.variant, guard_mode=args.guard)
    runner = cases.Runner(emu, schedules=tuple(int(s) for s in args.schedules.split(",")), verbose=not args.quiet)
    rng = np.random.default_rng(args.seed)
    t0 = time.time()
    for name in (cases.FULL if args.suite == "full" else args.suite).split(","):
        cases.SUITES[name](runner, rng)
    failed = [e for e in runner.results if not e.get("passed")]
    if args.quiet:
        for e in failed:
            print("FAIL", {k: e.get(k) for k in ("kind", "label", "storage", "head_dim", "group", "block_size",
                                                  "seq_lens", "err", "error_text") if k in e})
    print(f"emulator: {len(runner.results) - len(failed)} passed, {len(failed)} failed in {time.time() - t0:.1f} s "
          f"({emu.modules_built} modules compiled); warnings: {len(emu.warning_log)}")
    for w in emu.warning_log[:20]:
        print("  warning:", w)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": runner.results, "warnings": emu.warning_log,
                                               "modules_built": emu.modules_built}, indent=1, default=str))
    return 1 if failed or emu.warning_log else 0


if __name__ == "__main__":
    sys.exit(main())
