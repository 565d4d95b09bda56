"""The compiled hot path (mypyc, built by `pip install`): the same results as pure Python, and
never a stale build.

`sim/native/compiled.py` uses the compiled modules only while their sources are those the build
compiled; `SERVESIM_PURE=1` forces the pure-Python modules. Where the install built nothing
(no compiler), the tests that need a build skip.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sim.native import compiled

ROOT = Path(__file__).resolve().parent.parent
built = pytest.mark.skipif(not compiled._built(ROOT), reason="no compiled build (pure install)")

# whether the build is used; whether sim.engine.stepping, sim.engine.request and
# sim.engine.engine (never compiled) came from source
PROBE = ("import sim, sim.native.compiled as c, sim.engine.stepping as s, sim.engine.request as r, "
         "sim.engine.engine as e; "
         "print(c.COMPILED, *[m.__file__.endswith('.py') for m in (s, r, e)])")


def _python(code: str, *, pure: bool = False, path: Path | None = None) -> str:
    env = dict(os.environ)
    env.pop("SERVESIM_PURE", None)
    if pure:
        env["SERVESIM_PURE"] = "1"
    if path is not None:
        env["PYTHONPATH"] = str(path)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=path or ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@built
def test_this_checkout_runs_its_compiled_build_unless_told_not_to():
    assert _python(PROBE) == "True False False True"
    assert _python(PROBE, pure=True) == "False True True True"


@built
def test_a_used_build_loads_every_c_module_it_lists():
    """A compiled build that is used has its C modules too (one that fails to load would leave
    the engine on its slower Python stand-in without a word)."""
    code = ("import sim, sim.native.compiled as c; "
            "print(c.COMPILED, *[c.c_module(m) is not None for m in c.C_MODULES])")
    assert _python(code) == " ".join(["True"] * (1 + len(compiled.C_MODULES)))


@built
def test_an_edited_source_loads_every_listed_module_from_source(tmp_path):
    """A checkout edited after its build must run the edited code: all listed modules from
    source (compiled modules call each other directly, so it is all or none)."""
    shutil.copytree(ROOT / "sim", tmp_path / "sim",
                    ignore=shutil.ignore_patterns("__pycache__"))
    assert _python(PROBE, path=tmp_path) == "True False False True"
    kv = tmp_path / "sim" / "engine" / "kv.py"
    kv.write_text(kv.read_text() + "\n# edited\n")
    assert _python(PROBE, path=tmp_path) == "False True True True"
    (tmp_path / compiled.MANIFEST).unlink()  # (no record of what was built: not trusted)
    kv.write_text(kv.read_text().removesuffix("\n# edited\n"))
    assert _python(PROBE, path=tmp_path) == "False True True True"


@built
def test_a_leftover_build_of_a_module_no_longer_compiled_never_loads(tmp_path):
    """A build from an older list of compiled modules (here: a stand-in for sim.engine.engine's,
    which is not compiled) must not shadow the module's source."""
    shutil.copytree(ROOT / "sim", tmp_path / "sim",
                    ignore=shutil.ignore_patterns("__pycache__"))
    [so] = (tmp_path / "sim" / "engine").glob("kv.*.so")
    shutil.copy(so, so.parent / so.name.replace("kv.", "engine.", 1))
    assert _python(PROBE, path=tmp_path) == "True False False True"
    assert _python(PROBE, path=tmp_path, pure=True) == "False True True True"


RUN = """
import json
from sim.native import compiled
from sim import load_scenario, summarize
from sim.session.log import encode
from tui.cli import build_engine
e = build_engine(load_scenario(NAME, SETS), keep_history=False)
e.run()
print(json.dumps({"compiled": compiled.COMPILED,
                  "summary": {k: v for k, v in summarize(e).items() if "wall" not in k},
                  "events": [encode(x) for x in e.events]}, default=repr))
"""

CASES = [
    ["chat", "workload.num_requests=300"],
    ["chat", "workload.num_requests=60", "compute.backend=numpy"],
    ["mooncake", "workload.num_requests=400"],
    ["fragmentation"],
    ["chat", "workload.num_requests=200", "scheduler.policy=priority", "kv.num_blocks=600"],
    ["chat", "workload.num_requests=200", "scheduler.policy=sjf", "kv.swap_space_gb=4",
     "scheduler.preemption=swap", "kv.num_blocks=500"],
    ["replicas", "workload.num_requests=300"],
    ["disaggregated", "workload.num_requests=200"],
]


@built
@pytest.mark.parametrize("case", CASES, ids=[" ".join(c) for c in CASES])
def test_compiled_and_pure_runs_are_identical(case):
    """Every event (each step's end time, blocks, tokens) and every summary figure."""
    code = RUN.replace("NAME, SETS", f"{case[0]!r}, {case[1:]!r}")
    compiled, pure = json.loads(_python(code)), json.loads(_python(code, pure=True))
    assert compiled.pop("compiled") is True and pure.pop("compiled") is False
    assert compiled["events"], "the run recorded nothing"
    assert compiled == pure


def test_the_c_modules_pyproject_declares_are_those_checked_at_run_time():
    """The install builds pyproject.toml's ext-modules; `sim/native/compiled.py` decides at run time
    whether each is used by its source's digest: the two lists must be the same modules."""
    import tomllib
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert declared["cmdclass"]["build_ext"] == "sim.native.build.OptionalBuildExt"
    assert {e["name"]: e["sources"] for e in declared["ext-modules"]} == {
        m: [path] for m, path in compiled.C_MODULES.items()}
