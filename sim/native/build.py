"""Build hook (install time only): compile the engine's hot path with mypyc when it can be,
else install pure Python.

pyproject.toml names this class as setuptools' `build_ext` and declares the C modules; this
adds the mypyc modules that `sim/native/compiled.py` lists. The compiled modules are the same source
files; `sim/__init__.py` uses the compiled build only while those sources are unchanged since it
was made (else the pure-Python modules load), and `SERVESIM_PURE=1` forces pure Python. A
machine without mypyc or a C compiler, or a failed build, installs the pure-Python package with
a one-line note: the build is all or none, and only a whole build gets a record
(`sim/native/compiled.json`), so nothing partial, old or new is ever trusted.

setuptools loads this file by its path, before the package exists: it imports nothing from
`sim` (`compiled` is read the same way).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parents[2]


def _load_compiled():
    spec = importlib.util.spec_from_file_location("_servesim_compiled",
                                                  ROOT / "sim" / "native" / "compiled.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_c = _load_compiled()


def _note(msg: str) -> None:
    print(f"servesim: {msg}; the engine runs as pure Python (same results, slower)",
          file=sys.stderr)


# (setuptools may make and finalize build_ext more than once in one build: mypyc runs once)
_declared: list | None = None  # pyproject.toml's C modules
_mypyc: list | BaseException | None = None  # mypyc's modules, or why there are none


def _mypyc_modules() -> list:
    global _mypyc
    if _mypyc is None:
        try:
            from mypyc.build import mypycify
            # (the generated C in setuptools' `build/`; the shared library that the compiled
            # modules link to inside `sim/`, not at the top of the checkout)
            _mypyc = mypycify(list(_c.MODULES.values()), opt_level="3",  # ([tool.mypy])
                              target_dir="build/mypyc", group_name="sim.hotpath")
        except BaseException as e:  # noqa: BLE001 - mypyc missing, or its type check failed
            _mypyc = e
            _note(f"mypyc could not compile the hot path ({type(e).__name__}: {e})")
    if isinstance(_mypyc, BaseException):
        raise _mypyc
    return _mypyc


class OptionalBuildExt(build_ext):
    """A compiled hot path is an optimisation: its failure must not fail the install."""

    def finalize_options(self) -> None:
        global _declared
        if _declared is None:
            _declared = list(self.distribution.ext_modules or [])
            declared = {e.name: list(e.sources) for e in _declared}
            wanted = {m: [path] for m, path in _c.C_MODULES.items()}
            if declared != wanted:  # (what sim/native/compiled.py checks at run time)
                raise SystemExit(f"servesim: pyproject.toml's ext-modules {declared} are not "
                                 f"sim/native/compiled.py's C modules {wanted}")
        self._pure = os.environ.get("SERVESIM_PURE") == "1"
        modules = list(_declared)
        if not self._pure:
            try:
                modules = [*_mypyc_modules(), *modules]
            except BaseException:  # noqa: BLE001 - (said once, by _mypyc_modules)
                self._pure = True
        self.distribution.ext_modules = modules
        super().finalize_options()

    def run(self) -> None:
        manifest = ROOT / _c.MANIFEST
        built = None if self.inplace else Path(self.build_lib) / _c.MANIFEST
        # (no record while building, in the checkout or the wheel: a build that fails part
        # way, over an older whole one, is never trusted)
        for path in (manifest, built):
            if path is not None:
                path.unlink(missing_ok=True)
        if self._pure:
            return
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - any compiler or toolchain failure
            _note(f"compiling the hot path failed ({e})")
            return
        # The digests of what was compiled, so that an edited checkout never runs a stale
        # build: in the checkout (an editable install reads it there) and in the wheel.
        record = json.dumps({m: _c.source_digest(ROOT / path) for m, path in
                             {**_c.MODULES, **_c.C_MODULES}.items()}, indent=1) + "\n"
        manifest.write_text(record)
        if built is not None:
            built.parent.mkdir(parents=True, exist_ok=True)
            built.write_text(record)
