"""Number formats shared by the panels (milliseconds and seconds only at this edge)."""

from __future__ import annotations

import math


def dur(seconds: float | None) -> str:
    """A duration, compact: `850ms`, `12.34s`, `1234s`; `-` when unknown."""
    if seconds is None or seconds != seconds:
        return "-"
    if seconds < 1.0:
        return f"{seconds * 1e3:.0f}ms"
    if seconds < 100.0:
        return f"{seconds:.2f}s"
    return f"{seconds:.0f}s"


def ms(value_ms: float | None) -> str:
    """A figure already in milliseconds (from `sim.rolling`)."""
    return "-" if value_ms is None or value_ms != value_ms else dur(value_ms / 1e3)


def num(x: float | None, digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def speed(x: float) -> str:
    """A speed factor: `x1`, `x64`, `x1/8`."""
    if x >= 1:
        return f"x{x:g}"
    return f"x1/{1 / x:g}"


def achieved(x: float) -> str:
    """A measured speed factor, three significant digits: `x3.98`, `x0.125`."""
    return f"x{x:.3g}"
