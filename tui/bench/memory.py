"""Memory figures of the benchmarks: bytes reachable from an object, and this process's
resident memory (Linux: /proc/self/status)."""

from __future__ import annotations

import gc
import sys
import types

import numpy as np

_SKIP = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
         types.MethodType, types.CodeType)


def reachable_bytes(root, skip=()) -> int:
    """Bytes of the objects reachable from `root` (sys.getsizeof each, NumPy buffers they own),
    not counting `skip`, classes, modules or functions."""
    seen = {id(x) for x in skip}
    total, stack = 0, [root]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, _SKIP):
            continue
        seen.add(id(o))
        if isinstance(o, np.ndarray):
            total += sys.getsizeof(o) if o.base is None else 112
            if o.base is not None:
                stack.append(o.base)
            continue
        total += sys.getsizeof(o)
        stack.extend(gc.get_referents(o))
    return total


def status_bytes(field: str) -> int | None:
    """A memory figure of this process from Linux's /proc/self/status (`VmRSS`, `VmHWM`...),
    in bytes; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's own peak resident memory. Linux: VmHWM of the address space made at
    exec. (Not the ru_maxrss that wait4 reports for a child: Linux carries the parent's RSS at
    fork into it, so a child of a 9 GB process would report 9 GB.)"""
    peak = status_bytes("VmHWM")
    if peak is not None:
        return peak
    import resource  # (Unix only)

    scale = 1 if sys.platform == "darwin" else 1024  # (bytes on macOS, KiB elsewhere)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
