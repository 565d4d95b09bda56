"""Build hook: compile the engine's hot path with mypyc when it can be, else stay pure Python.

Everything else about the package is in pyproject.toml. The compiled modules are the same
source files (`sim/_compiled.py` names them); `sim/__init__.py` uses the compiled build only while
those sources are unchanged since it was made (else the pure-Python modules load), and
`SERVESIM_PURE=1` forces pure Python. A machine without a C compiler, or a failed build, installs
the pure-Python package with a one-line note.
"""

import json
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "sim"))
from _compiled import C_MODULES, MANIFEST, MODULES, OTHER_C_MODULES, source_digest  # noqa: E402  (no package import yet)

sys.path.pop(0)


def _note(msg: str) -> None:
    print(f"servesim: {msg}; the engine runs as pure Python (same results, slower)",
          file=sys.stderr)


class OptionalBuildExt(build_ext):
    """A compiled hot path is an optimisation: its failure must not fail the install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - any compiler or toolchain failure
            # (no record, so no build, whole or partial, old or new, is ever trusted)
            (ROOT / MANIFEST).unlink(missing_ok=True)
            _note(f"compiling the hot path failed ({e})")


def ext_modules() -> list:
    if os.environ.get("SERVESIM_PURE") == "1":
        return []
    try:
        from mypyc.build import mypycify
        exts = mypycify(list(MODULES.values()), opt_level="3")  # ([tool.mypy] options)
    except BaseException as e:  # noqa: BLE001 - mypyc missing, or its type check failed
        _note(f"mypyc could not compile the hot path ({type(e).__name__}: {e})")
        return []
    # (no fused multiply-adds: the C code's floats must equal Python's bit for bit)
    exts += [Extension(m, [path], extra_compile_args=["-O2", "-ffp-contract=off"])
             for m, path in {**C_MODULES, **OTHER_C_MODULES}.items()]
    # The digests of what is compiled, so that an edited checkout never runs a stale build
    # (written now: build_py copies it into a wheel before build_ext runs).
    (ROOT / MANIFEST).write_text(json.dumps(
        {m: source_digest(ROOT / path)
         for m, path in {**MODULES, **C_MODULES, **OTHER_C_MODULES}.items()},
        indent=1) + "\n")
    return exts


setup(ext_modules=ext_modules(), cmdclass={"build_ext": OptionalBuildExt})
