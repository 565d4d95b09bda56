"""`python -m gpu.selfcheck` with the emulator's fake CuPy as `cupy`, on a Python that cannot
import anything the self-check must not need: `python tests/gpu/cuda_emu/selfcheck_main.py ARGS`.

The import blocker stands in for a machine that has only NumPy, CuPy and the repository: the
self-check must not reach textual, msgpack, the simulator (sim, tui) or the test tools.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BLOCKED = ("textual", "msgpack", "sim", "tui", "rich", "hypothesis", "pytest", "torch", "scipy", "numba", "ray")


class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not available on a CuPy-only machine (blocked by selfcheck_main)")
        return None


def main() -> None:
    sys.meta_path.insert(0, _Blocker())
    sys.path.insert(0, str(HERE.parents[2]))
    sys.path.insert(0, str(HERE.parent))
    from cuda_emu.emulator import Emulator, FakeCupy

    sys.modules["cupy"] = FakeCupy(Emulator())
    sys.argv = ["gpu.selfcheck", *sys.argv[1:]]
    runpy.run_module("gpu.selfcheck", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
