"""Reading input files without hanging, and writing output files safely: never half-written,
never replacing what is not a plain file.

An input may be a pipe (`--set workload.trace=<(zcat trace.csv.gz)`: it has a writer, however
slow) or a named FIFO, but a named FIFO that no process writes to is refused after FIFO_WAIT_S
instead of waiting forever (`open_input`).

A regular file (or a new one) is written to a temporary file beside it and renamed into place,
so an interrupted write (an error, Ctrl-C, SIGTERM) leaves the old file, or none, and no
temporary file behind. A symbolic link is followed: the file it points to is replaced, the link
stays. A FIFO, a device (`/dev/null`) or this process's own standard output (`-o /dev/stdout`,
whatever stdout is) is written through in place, never replaced by a file.
"""

from __future__ import annotations

import csv
import errno
import json
import os
import re
import signal
import stat
import sys
import tempfile
import time
import tomllib
from contextlib import contextmanager
from collections.abc import Iterator
from pathlib import Path

from sim.errors import ServesimError

# How long an input FIFO may stay silent (no writer, or a writer that writes nothing) before
# it is refused.
FIFO_WAIT_S = 10.0


def open_input(path, wait_s: float | None = None):
    """`path` opened for reading in binary. A named FIFO is opened without blocking and waited
    on for at most `wait_s` (FIFO_WAIT_S) until it has data or its writer closes it; past that
    an OSError (ETIMEDOUT) says so. Anything else, a pipe (/dev/fd/N of a process substitution)
    included, opens as open() does (raising as it does)."""
    try:
        is_fifo = stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        is_fifo = False  # open() raises the right error below
    # (an anonymous pipe's writer exists as long as it is open: waiting on it is right)
    if not is_fifo or "pipe:[" in os.path.realpath(path):
        return open(path, "rb")
    import select

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        wait = FIFO_WAIT_S if wait_s is None else wait_s
        ready, _, _ = select.select([fd], [], [], wait)
        if not ready:
            raise OSError(errno.ETIMEDOUT, f"a FIFO that nothing wrote to for {wait:g} s")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def reason(e: Exception) -> str:
    """An exception as the end of a one-line message: an OSError's text without "[Errno N]"."""
    return (e.strerror if isinstance(e, OSError) and e.strerror else str(e)) or type(e).__name__


READ_CHUNK = 1 << 20


def read_bounded(fh, limit: int) -> bytes:
    """What is left of `fh`, at most `limit` + 1 bytes (one more than `limit` says there is
    more), read a chunk at a time: memory follows what the file holds, not the limit (a
    read(limit) reserves all of it up front, which a small address-space limit refuses)."""
    chunks, total = [], 0
    while total <= limit:
        chunk = fh.read(min(READ_CHUNK, limit + 1 - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def read_input_text(path, encoding: str = "utf-8", limit: int = 1 << 30) -> str:
    """The whole text of an input file, opened with `open_input`; an OSError (EFBIG) past
    `limit` bytes (a device such as /dev/zero never ends)."""
    with open_input(path) as fh:
        data = read_bounded(fh, limit)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit >> 20} MiB")
    return data.decode(encoding)


def _stat(path) -> os.stat_result | None:
    """`path`'s status, following links; None when nothing is there (or a dangling link)."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ServesimError(f"{path}: cannot write: {reason(e)}") from None


def _std_stream(st: os.stat_result):
    """This process's stdout or stderr when `st` is the very file it writes to, else None."""
    for stream in (sys.stdout, sys.stderr):
        try:
            fs = os.fstat(stream.fileno())
        except (AttributeError, OSError, ValueError):
            continue
        if (fs.st_dev, fs.st_ino) == (st.st_dev, st.st_ino):
            return stream
    return None


def _not_a_folder(path, where: str) -> None:
    """A path typed with a trailing separator names a folder: never write a file in its place
    (`out.csv/` is not `out.csv`)."""
    text = os.fspath(path)
    if isinstance(text, str) and text.endswith((os.sep, os.altsep or os.sep)):
        raise ServesimError(f"{where}: ends with {text[-1]!r}, a directory, not a file")


def check_writable(path, what: str = "") -> None:
    """Raise ServesimError now when `path` could not be written later (before a long run):
    a directory, a missing or unwritable directory, a read-only file. A FIFO or a device is
    only checked for permission (opening a FIFO would wait for a reader)."""
    where = f"{what} {path}" if what else str(path)
    st = _stat(path)
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise ServesimError(f"{where}: is a directory")
        if not os.access(path, os.W_OK):
            raise ServesimError(f"{where}: cannot write: permission denied")
        if not stat.S_ISREG(st.st_mode):
            return
    _not_a_folder(path, where)
    parent = Path(os.path.realpath(path)).parent
    if not parent.is_dir():
        raise ServesimError(f"{where}: directory {parent} does not exist")
    # A real probe (access() says yes to root on a read-only file system's files), with SIGINT
    # and SIGTERM held meanwhile: one arriving between the probe's creation and its removal
    # would leave it behind.
    held = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        fd, probe = tempfile.mkstemp(prefix=".servesim-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ServesimError(f"{where}: cannot write in {parent}: {reason(e)}") from None
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextmanager
def atomic_open(path, mode: str = "wb", exclusive: bool = False):
    """Open `path` for writing as the module says: a temporary file renamed over the target
    (the target of a link) when the block exits cleanly, or the FIFO, device or standard
    stream itself. `exclusive=True` never replaces an existing file (FileExistsError).

    Raises ServesimError (one line, naming the file) when it cannot be written.
    """
    st = _stat(path)
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise ServesimError(f"{path}: cannot write: is a directory")
    _not_a_folder(path, f"{path}: cannot write")
    if exclusive and (st is not None or os.path.islink(path)):
        raise FileExistsError(path)
    stream = _std_stream(st) if st is not None else None
    if stream is not None or (st is not None and not stat.S_ISREG(st.st_mode)):
        with _written_through(path, mode, stream) as fh:
            yield fh
        return
    target = Path(os.path.realpath(path))  # a link stays a link: its target is replaced
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        if st is not None:
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
        if exclusive:
            os.link(tmp, target)  # fails, atomically, if the name was taken meanwhile
            os.unlink(tmp)
        else:
            os.replace(tmp, target)
    except FileExistsError:
        _discard(tmp)
        raise
    except OSError as e:
        _discard(tmp)
        raise ServesimError(f"{path}: cannot write: {reason(e)}") from None
    except BaseException:  # an error in the block, Ctrl-C, SIGTERM (see tui.cli)
        _discard(tmp)
        raise


@contextmanager
def _written_through(path, mode: str, stream):
    """The FIFO or device at `path`, or the standard `stream` it names, opened in place."""
    try:
        if stream is not None:
            stream.flush()
            fh = os.fdopen(os.dup(stream.fileno()), mode)  # its offset: an append stays one
        elif stat.S_ISFIFO(os.stat(path).st_mode):
            fh = os.fdopen(_fifo_writer(path), mode)
        else:
            fh = open(path, mode)
        with fh:
            yield fh
    except OSError as e:
        raise ServesimError(f"{path}: cannot write: {reason(e)}") from None


def _fifo_writer(path, wait_s: float | None = None) -> int:
    """A named FIFO opened for writing once a process reads it, waiting at most `wait_s`
    (FIFO_WAIT_S) for one: open() would block for ever on a FIFO nobody reads. Raises
    OSError (ETIMEDOUT) past that."""
    deadline = time.monotonic() + (FIFO_WAIT_S if wait_s is None else wait_s)
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO:  # (ENXIO: no reader yet)
                raise
            if time.monotonic() >= deadline:
                raise OSError(errno.ETIMEDOUT, "a FIFO that nothing read for "
                              f"{FIFO_WAIT_S if wait_s is None else wait_s:g} s") from None
            time.sleep(0.05)
            continue
        os.set_blocking(fd, True)
        return fd


def _discard(tmp: Path) -> None:
    try:
        tmp.unlink()
    except OSError:
        pass


def write_atomic(path, text: str) -> Path:
    with atomic_open(path, "w") as fh:
        fh.write(text)
    return Path(path)


def save_figure(fig, path, **savefig_kw) -> None:
    """Write a matplotlib figure as `atomic_open` writes, in the format its suffix names (PNG
    without one). Raises ServesimError (one line) when it cannot be written."""
    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    with atomic_open(path, "wb") as fh:
        fig.savefig(fh, format=fmt, **savefig_kw)


# --- parsing text that anyone may have written ------------------------------------------------
# Python converts at most this many digits of an integer literal (sys.get_int_max_str_digits):
# a longer one makes json and tomllib raise a bare ValueError.
_LONG_INT = re.compile(r"[0-9_]{%d,}" % (sys.get_int_max_str_digits() + 1))
LONG_INT_MESSAGE = f"an integer literal of more than {sys.get_int_max_str_digits()} digits"


def _long_int_at(text: str) -> int:
    m = _LONG_INT.search(text)
    return m.start() if m else 0


def json_loads(text: str | bytes):
    """json.loads, with what it raises beyond invalid JSON (a value nested too deeply, an
    integer of more digits than Python converts) raised as a JSONDecodeError like it."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("a value nested too deeply", _doc(text), 0) from None
    except json.JSONDecodeError:
        raise
    except ValueError:
        doc = _doc(text)
        raise json.JSONDecodeError(LONG_INT_MESSAGE, doc, _long_int_at(doc)) from None


def _doc(text: str | bytes) -> str:
    """The text a JSONDecodeError counts its line and column in."""
    return text.decode("utf-8", "replace") if isinstance(text, bytes) else text


def toml_loads(text: str) -> dict:
    """tomllib.loads, with what it raises beyond invalid TOML (a value nested too deeply for
    its recursive parser, an integer of more digits than Python converts) raised as a
    TOMLDecodeError like it."""
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise tomllib.TOMLDecodeError("a value nested too deeply") from None
    except tomllib.TOMLDecodeError:
        raise
    except ValueError:
        line = text.count("\n", 0, _long_int_at(text)) + 1
        raise tomllib.TOMLDecodeError(f"{LONG_INT_MESSAGE} (at line {line})") from None


def csv_rows(path, text: str,
             error: type[Exception]) -> tuple[list[str], Iterator[tuple[int, dict]]]:
    """A CSV file's text with a header line: its column names and its rows as (line, {column:
    value}), names and values stripped. What csv refuses (a field past its size limit, a NUL)
    and a row of more fields than the header are raised as `error` naming the file and line,
    when the header or that row is read."""
    reader = csv.DictReader(text.splitlines())
    try:
        header = [h.strip() for h in reader.fieldnames or []]
    except csv.Error as e:
        raise error(f"{path}:1: not CSV: {e}") from None

    def rows():
        line = 1
        while True:
            line += 1
            try:
                raw = next(reader, None)
            except csv.Error as e:
                raise error(f"{path}:{line}: not CSV: {e}") from None
            if raw is None:
                return
            if None in raw:  # (DictReader's key for the fields past the header's)
                raise error(f"{path}:{line}: {len(header) + len(raw[None])} fields, the header "
                            f"has {len(header)} (a value with a comma unquoted?)")
            yield line, {(k or "").strip(): (v or "").strip() for k, v in raw.items()}

    return header, rows()
