"""What the benchmarks share: their argument types, the line that names the machine, and a
function run in a fresh Python process."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys

from sim.native import compiled
from sim.errors import ServesimError, shown
from sim.policies import POLICIES


def count(text: str) -> int:
    """A positive whole number (argparse turns the error into one line)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v}: must be at least 1")
    return v


def positive(what: str):
    """A parser of a positive, finite number (argparse turns the error into one line): not
    subnormal either (1e-320), which the arithmetic after it overflows dividing by."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not sys.float_info.min <= v < math.inf:
            raise argparse.ArgumentTypeError(f"{shown(text)}: expected a positive {what} "
                                             f"(at least {sys.float_info.min:g})")
        return v
    return parse


seconds = positive("number of seconds")
speed = positive("speed")  # simulated seconds per wall second


def comma_list(kind):
    """A comma-separated list of `kind` (a type function) or of policy names."""
    def parse(text: str) -> list:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list")
        if kind == "policy":
            bad = [x for x in items if x not in POLICIES]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"{bad[0]!r}: not a policy (known: {', '.join(POLICIES)})")
            return items
        return [kind(x) for x in items]
    return parse


def machine() -> str:
    """The machine and build the figures come from, in one line."""
    return (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
            f", hot path {'compiled (mypyc)' if compiled.COMPILED else 'pure Python'}")


def run_in_child(module: str, function: str, *args, env: dict | None = None) -> dict:
    """`module.function(*args)` (plain values) in a fresh Python process (`env`: variables
    to set in it): its JSON result, the last line it prints. Raises ServesimError (one line:
    the child's own error, or the last line of its traceback) when the process fails."""
    code = (f"import json; from {module} import {function} as f; "
            f"print(json.dumps(f(*{args!r})))")
    p = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       env={**os.environ, **env} if env else None)
    if p.returncode:
        lines = p.stderr.decode(errors="replace").strip().splitlines()
        last = lines[-1] if lines else f"exited {p.returncode}"
        if ": " in last and last.split(": ", 1)[0].endswith("Error"):
            last = last.split(": ", 1)[1]  # "sim.errors.ScenarioError: F: field ..." -> the message
        raise ServesimError(f"{function}{args!r} in a subprocess: {last}")
    return json.loads(p.stdout.decode().strip().splitlines()[-1])
