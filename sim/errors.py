"""The failure families of servesim, one exception type each.

Every message names the offending file, field or value, so that the CLI can print it as one line
on stderr and exit with code 2.
"""

from __future__ import annotations

import re

# What a terminal acts on instead of showing (C0 and C1 control characters but tab and line
# feed): user text never reaches it raw.
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def cut(text: str, n: int) -> str:
    """`text` cut to `n` characters, "..." marking the cut."""
    return text if len(text) <= n else text[:n - 3] + "..."


def shown(v, n: int = 40) -> str:
    """A value as a message shows it: its repr (one line whatever it holds), cut to n."""
    try:
        return cut(repr(v), n)
    except ValueError:  # an integer of more digits than Python converts to text (in v)
        if isinstance(v, int):
            return f"<an integer of {v.bit_length()} bits>"
        return f"<a {type(v).__name__} holding an integer too long to show>"


def one_line(text: str) -> str:
    """A message as one line a terminal shows as written, whatever it quotes: line breaks as
    spaces, any other control character escaped (an escape sequence as `\\x1b[2J`)."""
    return CONTROL.sub(lambda m: repr(m.group())[1:-1], " ".join(text.split("\n")))


class ServesimError(Exception):
    """Base of every error the CLI reports as one line with exit code 2."""


class ScenarioError(ServesimError):
    """A scenario file or override is malformed, mistyped, or describes an impossible setup."""


class TraceError(ServesimError):
    """A trace or length file is missing or has a malformed row."""


class EngineError(ServesimError):
    """A request to the live engine that cannot be honoured (unknown id, bad injection)."""


class UnknownRequestError(EngineError):
    """A request id that the engine has never seen."""


class InvalidTransition(ServesimError):
    """A request state change that the state machine forbids: always a bug in the engine."""


class LogError(ServesimError):
    """A session log that is truncated, corrupt, foreign or of a newer format."""
