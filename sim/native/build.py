"""Build hook (install time only): compile the engine's hot path with mypyc when it can be,
else install pure Python.

pyproject.toml names this class as setuptools' `build_ext` and declares the C modules; this
adds the mypyc modules that `sim/native/compiled.py` lists. The compiled modules are the same source
files; `sim/__init__.py` uses the compiled build only while those sources are unchanged since it
was made (else the pure-Python modules load), and `SERVESIM_PURE=1` forces pure Python. A
machine without mypyc or a C compiler, or a failed build, installs the pure-Python package with
a one-line note: the build is all or none, and only a whole build gets a record
(`sim/native/compiled.json`), so nothing partial, old or new is ever trusted.

A whole build is kept in `build/servesim-hotpath/KEY/`, KEY a digest of what decides its output:
the compiled sources (the digests `compiled.json` records), this hook and `compiled.py`,
pyproject.toml (the C flags), the Python ABI, mypy's version and the C compiler. A reinstall with
the same key copies that build instead of compiling again (an edited source makes a new key,
so nothing stale is reused; the run-time digest check stays as it is). Progress goes to the
terminal (`pip -q` hides a build's own output) or, without one, to stderr.

setuptools loads this file by its path, before the package exists: it imports nothing from
`sim` (`compiled` is read the same way).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from setuptools import Extension
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
    progress(f"{msg}; the engine runs as pure Python (same results, slower)")


def progress(msg: str) -> None:
    """One line where the person installing sees it: the terminal, which `pip -q` does not
    capture; stderr without one (pip shows it with -v, or when the build fails)."""
    line = f"servesim: {msg}\n"
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(line)
            return
    except OSError:
        pass
    sys.stderr.write(line)
    sys.stderr.flush()


# --- the cache of whole builds ---------------------------------------------------------------
CACHE = "build/servesim-hotpath"  # under the checkout (setuptools' own build/ is ignored by git)
_RECORD = "extensions.json"  # extension name -> file name, written last: a whole build only


def _compiler() -> str:
    """The C compiler's identity: its command and the first line of its version."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    try:
        out = subprocess.run([*cc.split(), "--version"], capture_output=True, text=True,
                             timeout=30).stdout.partition("\n")[0]
    except (OSError, subprocess.SubprocessError):
        out = "?"
    return f"{cc} {out} {os.environ.get('CFLAGS', '')}"


def cache_key(root: Path = ROOT) -> str:
    """A digest of everything that decides what a build is: the compiled sources, the build's
    own code and flags, the Python ABI, mypy and the C compiler."""
    try:
        mypy = importlib.metadata.version("mypy")
    except importlib.metadata.PackageNotFoundError:
        mypy = "none"
    h = hashlib.sha256()
    for rel in sorted({*_c.MODULES.values(), *_c.C_MODULES.values(), "sim/native/build.py",
                       "sim/native/compiled.py", "pyproject.toml"}):
        h.update(f"{rel} {_c.source_digest(root / rel)}\n".encode())
    h.update(f"{sys.version} {sysconfig.get_config_var('EXT_SUFFIX')} mypy {mypy} "
             f"{_compiler()}".encode())
    return h.hexdigest()[:24]


def cached(root: Path, key: str) -> dict | None:
    """{extension name: path} of the whole build kept under `key`, or None."""
    where = root / CACHE / key
    try:
        names = json.loads((where / _RECORD).read_text())
        files = {name: where / file for name, file in names.items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    return files if all(p.is_file() for p in files.values()) else None


def keep(root: Path, key: str, built: dict) -> None:
    """Keep a whole build ({extension name: its file}) under `key`, replacing older keys: a
    copy in a temporary folder renamed into place, so a cut copy is never found."""
    base = root / CACHE
    tmp = base / f".{key}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    names = {}
    for name, path in built.items():
        names[name] = f"{name}{Path(path).name[Path(path).name.index('.'):]}"
        shutil.copy2(path, tmp / names[name])
    (tmp / _RECORD).write_text(json.dumps(names, indent=1) + "\n")
    for old in base.iterdir():
        if old != tmp:
            shutil.rmtree(old, ignore_errors=True)
    tmp.rename(base / key)


# (setuptools may make and finalize build_ext more than once in one build: mypyc runs once)
_declared: list | None = None  # pyproject.toml's C modules
_reuse: list = []  # [the cache key, the kept build of it or None], once decided
_mypyc: list | BaseException | None = None  # mypyc's modules, or why there are none


def _mypyc_modules() -> list:
    global _mypyc
    if _mypyc is None:
        try:
            from mypyc.build import mypycify
            progress(f"compiling the hot path ({len(_c.MODULES)} modules): mypyc's type check "
                     "and C generation")
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
        if not getattr(self, "_compiling", False):
            self._pure = os.environ.get("SERVESIM_PURE") == "1"
            self._reuse = None  # {extension name: its kept file} when the same build is kept
            self.distribution.ext_modules = list(_declared)
        super().finalize_options()

    def _add_hot_path(self) -> None:
        """The mypyc modules, compiled or kept: decided when the build runs, not when pip only
        asks for the package's metadata (each of its steps finalizes this command anew, in a
        process of its own, and mypyc's type check alone takes some 10 s)."""
        if not _reuse:
            _reuse[:] = [cache_key()]
            _reuse.append(cached(ROOT, _reuse[0]))
            if _reuse[1] is not None:
                progress(f"the compiled hot path is unchanged: reusing {CACHE}/{_reuse[0]}")
        self._key, self._reuse = _reuse
        modules = list(_declared)
        if self._reuse is not None:
            names = {e.name for e in modules}
            modules += [Extension(name, sources=[]) for name in self._reuse if name not in names]
        else:
            try:
                modules = [*_mypyc_modules(), *modules]
            except BaseException:  # noqa: BLE001 - (said once, by _mypyc_modules)
                self._pure = True
                return
        self.distribution.ext_modules = modules
        # Finalized again, for the settings each extension gets (the only option that
        # distutils cannot finalize twice is the one it splits from a string)
        self._compiling, self.swig_opts = True, None
        self.finalize_options()

    def run(self) -> None:
        manifest = ROOT / _c.MANIFEST
        built = None if self.inplace else Path(self.build_lib) / _c.MANIFEST
        # (no record while building, in the checkout or the wheel: a build that fails part
        # way, over an older whole one, is never trusted)
        for path in (manifest, built):
            if path is not None:
                path.unlink(missing_ok=True)
        if not self._pure:
            self._add_hot_path()
        if self._pure:
            return
        self._done, started = 0, time.monotonic()
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - any compiler or toolchain failure
            _note(f"compiling the hot path failed ({e})")
            return
        if self._reuse is None:
            progress(f"compiled the hot path in {time.monotonic() - started:.0f} s (kept in "
                     f"{CACHE} for reinstalls)")
            try:
                keep(ROOT, self._key, {e.name: self.get_ext_fullpath(e.name)
                                       for e in self.extensions})
            except OSError as e:  # (only a later reinstall is slower)
                progress(f"could not keep the build for reinstalls ({e})")
        # The digests of what was compiled, so that an edited checkout never runs a stale
        # build: in the checkout (an editable install reads it there) and in the wheel.
        record = json.dumps({m: _c.source_digest(ROOT / path) for m, path in
                             {**_c.MODULES, **_c.C_MODULES}.items()}, indent=1) + "\n"
        manifest.write_text(record)
        if built is not None:
            built.parent.mkdir(parents=True, exist_ok=True)
            built.write_text(record)

    def build_extension(self, ext) -> None:
        if self._reuse is not None:  # the kept build of these very sources
            target = Path(self.get_ext_fullpath(ext.name))
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(self._reuse[ext.name], target)
            return
        self._done += 1
        progress(f"compiling C {self._done}/{len(self.extensions)}: {ext.name}")
        super().build_extension(ext)
