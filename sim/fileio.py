"""Atomic file writes: a temporary file beside the target, then a rename, so an interrupted
write never leaves a half-written file under the final name."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from sim.errors import ServesimError


@contextmanager
def atomic_open(path, mode: str = "wb"):
    """Open a temporary file for writing that replaces `path` when the block exits cleanly.

    Raises ServesimError (one line, naming the file) when it cannot be written.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as e:
        _discard(tmp)
        raise ServesimError(f"{path}: cannot write: {e.strerror or e}") from None
    except BaseException:
        _discard(tmp)
        raise


def _discard(tmp: Path) -> None:
    try:
        tmp.unlink()
    except OSError:
        pass


def write_atomic(path, text: str) -> Path:
    with atomic_open(path, "w") as fh:
        fh.write(text)
    return Path(path)
