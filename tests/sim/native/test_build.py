"""sim/native/build.py's cache of whole builds: a reinstall reuses a build only while everything
that decides it is unchanged, and never a cut or partial one."""

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _build_module():
    spec = importlib.util.spec_from_file_location("_servesim_build", ROOT / "sim/native/build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _build_module()


@pytest.fixture
def checkout(tmp_path):
    """A copy of the files the cache key reads."""
    for rel in {*build._c.MODULES.values(), *build._c.C_MODULES.values(), "sim/native/build.py",
                "sim/native/compiled.py", "pyproject.toml"}:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    return tmp_path


def test_the_key_changes_with_any_compiled_source_and_only_then(checkout):
    key = build.cache_key(checkout)
    assert build.cache_key(checkout) == key
    (checkout / "README.md").write_text("not compiled")
    assert build.cache_key(checkout) == key
    for rel in (*build._c.MODULES.values(), *build._c.C_MODULES.values(), "pyproject.toml"):
        path = checkout / rel
        before = path.read_bytes()
        path.write_bytes(before + b"\n")
        assert build.cache_key(checkout) != key, rel
        path.write_bytes(before)
    assert build.cache_key(checkout) == key


def _built(tmp_path, names):
    out = {}
    for name in names:
        p = tmp_path / "out" / f"{name.rpartition('.')[2]}.cpython-311-x86_64-linux-gnu.so"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(name.encode())
        out[name] = p
    return out


def test_a_kept_build_is_found_whole_and_replaces_older_ones(tmp_path):
    names = ["sim.engine.kv", "sim.hotpath__mypyc", "sim.native._rows"]
    assert build.cached(tmp_path, "k1") is None
    build.keep(tmp_path, "k1", _built(tmp_path, names))
    found = build.cached(tmp_path, "k1")
    assert sorted(found) == names
    assert {n: p.read_bytes() for n, p in found.items()} == {n: n.encode() for n in names}
    assert found["sim.engine.kv"].name.endswith(".cpython-311-x86_64-linux-gnu.so")
    assert build.cached(tmp_path, "k2") is None
    build.keep(tmp_path, "k2", _built(tmp_path, names))
    assert build.cached(tmp_path, "k1") is None and build.cached(tmp_path, "k2") is not None
    assert [p.name for p in (tmp_path / build.CACHE).iterdir()] == ["k2"]


def test_a_partial_kept_build_is_not_reused(tmp_path):
    build.keep(tmp_path, "k", _built(tmp_path, ["sim.engine.kv", "sim.hotpath__mypyc"]))
    next(p for p in (tmp_path / build.CACHE / "k").iterdir() if "kv" in p.name).unlink()
    assert build.cached(tmp_path, "k") is None
    (tmp_path / build.CACHE / "k" / build._RECORD).write_text("{not json")
    assert build.cached(tmp_path, "k") is None
