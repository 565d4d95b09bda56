"""Which modules the install compiles with mypyc, and whether this process uses them.

The compiled build is an optimisation of the same sources (see sim/native/build.py): results are
bit-identical either way (tests/test_compiled.py compares whole runs). A compiled module is
used only while every compiled source still has the digest recorded when the build was made,
so an edited checkout runs the edited code, never a stale build; `SERVESIM_PURE=1` forces pure
Python. This module imports nothing from `sim`: the install (sim/native/build.py) reads it before
the package exists.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

# module name -> source path relative to the repository root
MODULES = {
    "sim.engine.request": "sim/engine/request.py",
    "sim.engine.kv": "sim/engine/kv.py",
    "sim.model.costmodel": "sim/model/costmodel.py",
    "sim.engine.timeline": "sim/engine/timeline.py",
    "sim.engine.stepping": "sim/engine/stepping.py",
    "sim.engine.frontend": "sim/engine/frontend.py",
    "sim.policies.batch": "sim/policies/batch.py",
    "sim.policies.base": "sim/policies/base.py",
    "sim.policies.chunked": "sim/policies/chunked.py",
    "sim.stats.quantiles": "sim/stats/quantiles.py",
}
# C extension modules built beside them (the same arithmetic as the Python they stand in for;
# used only when the compiled build is)
C_MODULES = {
    "sim.native._rows": "sim/native/_rows.c",
}
MANIFEST = "sim/native/compiled.json"  # digests of the sources the build compiled


def source_digest(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()

COMPILED = False  # whether this process runs the compiled modules (set by `activate`)


class _SourceFinder:
    """Loads `sim` modules from their sources where the compiled build must not be used: every
    one while the build is not used, and always those it did not compile (a build left over
    from an older list must not shadow a module that has changed since)."""

    def __init__(self, root: Path, compiled: bool) -> None:
        self.root = root
        self.compiled = compiled

    def find_spec(self, name, path=None, target=None):
        if not name.startswith("sim.") or (self.compiled and name in MODULES):
            return None
        source = self.root.joinpath(*name.split(".")).with_suffix(".py")
        if not source.is_file():
            return None  # (a package, or not ours: the usual finders)
        import importlib.util
        return importlib.util.spec_from_file_location(name, source)


def _built(root: Path) -> bool:
    """Whether a compiled build of any listed module lies next to its source."""
    return any(p.name.endswith((".so", ".pyd"))
               for rel in MODULES.values()
               for p in (root / rel).parent.glob(Path(rel).stem + ".*"))


def _fresh(root: Path) -> bool:
    """Whether every one of the engine's modules, compiled and C, was built from its source as
    it is now."""
    import json
    try:
        recorded = json.loads((root / MANIFEST).read_text())
        return all(recorded.get(m) == source_digest(root / rel)
                   for m, rel in {**MODULES, **C_MODULES}.items())
    except (OSError, ValueError, AttributeError):
        return False


def activate() -> bool:
    """Decide, before any listed module is imported, whether this process uses the compiled
    build, and make every other `sim` module load from its source (all or none of the listed
    ones: compiled modules call each other directly). Returns the decision (also in
    COMPILED)."""
    global COMPILED
    root = Path(__file__).resolve().parents[2]
    COMPILED = _built(root) and os.environ.get("SERVESIM_PURE") != "1" and _fresh(root)
    if not any(isinstance(f, _SourceFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceFinder(root, COMPILED))
    return COMPILED


def c_module(name: str):
    """The C module `name` (one of C_MODULES) where this process uses the compiled build, else
    None: the compiled modules then do the same work in Python."""
    if not COMPILED or name not in C_MODULES:
        return None
    import importlib
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
