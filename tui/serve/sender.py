"""One step's socket writes: from the loop's thread in one call (`RawWriter`), or shared with a
second thread (`PairWriter`).

At a step's end the server writes one frame to each of hundreds of sockets. A loopback TCP
send runs the receiver's TCP path in the sender's system call (several microseconds each), so
one thread doing them one after another makes the last frame wait for all the others. The
system call releases the GIL: a second thread writing some of them runs that kernel work on
the other core at the same time.

Either way the caller hands over file descriptors of its own (duplicates it holds, so that no
number can be closed and reused under a write) of sockets whose transports have nothing
buffered and which the loop does not touch until `write_all` returns; what a socket did not
take is handed back, for the caller to give to its transport, in order. With `PairWriter` only
those raw writes run off the event loop's thread (asyncio is not thread-safe).
"""

from __future__ import annotations

import itertools
import os
import threading
import time


def write_one(fd: int, data: bytes) -> int:
    """One non-blocking write of `data` to socket `fd`: the bytes it took, 0 when its buffer
    was full, -1 on an error (the transport's own write then meets it and closes)."""
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0
    except OSError:
        return -1


def write_many(fds: list[int], datas: list[bytes],
               want_times: bool) -> tuple[list[int], list[float] | None]:
    """`write_one` per socket, in order; with `want_times`, when each write returned
    (time.monotonic)."""
    clock = time.monotonic
    sent = [0] * len(fds)
    times: list[float] | None = [0.0] * len(fds) if want_times else None
    for i, fd in enumerate(fds):
        sent[i] = write_one(fd, datas[i])
        if times is not None:
            times[i] = clock()
    return sent, times



class RawWriter:
    """A pass's writes from the calling thread, in one `write_many` call."""

    MIN_SPLIT = 2  # one write goes through its transport as usual

    def write_all(self, fds: list[int], datas: list[bytes],
                  times: list[float] | None = None) -> list[int]:
        """As `PairWriter.write_all`."""
        sent, stamps = write_many(fds, datas, times is not None)
        if times is not None and stamps is not None:
            times[:] = stamps
        return sent

    def close(self) -> None:
        pass


class _Batch:
    """One call's writes. Both threads take the next index from `claim` (atomic under the
    GIL), so the caller starts at once and the worker helps from whenever it gets a core."""

    __slots__ = ("fds", "datas", "sent", "times", "claim", "helping", "finished")

    def __init__(self, fds: list[int], datas: list[bytes], times: list[float] | None) -> None:
        self.fds, self.datas, self.times = fds, datas, times
        self.sent = [0] * len(fds)
        self.claim = itertools.count()
        self.helping = False  # the worker may hold an index it is writing
        self.finished = threading.Event()

    def write(self) -> None:
        """Write the indices this thread claims: sent[i] as `write_one` gives it; with
        `times`, times[i] = when the write returned (time.monotonic)."""
        fds, datas, sent, times = self.fds, self.datas, self.sent, self.times
        n = len(fds)
        clock = time.monotonic
        for i in self.claim:
            if i >= n:
                return
            sent[i] = write_one(fds[i], datas[i])
            if times is not None:
                times[i] = clock()


class PairWriter:
    """Writes a batch of (socket, bytes) from the calling thread and one worker thread, which
    share the batch as they go. `close` stops the worker."""

    # Below this many writes, waking the worker costs more than it saves.
    MIN_SPLIT = 16

    def __init__(self) -> None:
        self._go = threading.Event()
        self._batch: _Batch | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="servesim-send", daemon=True)
        self._thread.start()

    def write_all(self, fds: list[int], datas: list[bytes],
                  times: list[float] | None = None) -> list[int]:
        """Write each datas[i] to non-blocking socket fds[i], the first ones first; returns
        the bytes each took (0: full, -1: an error), in the order given. A list `times` gets
        when each write returned."""
        if times is not None:
            times[:] = [0.0] * len(fds)
        b = _Batch(fds, datas, times)
        if len(fds) >= self.MIN_SPLIT and not self._stop:
            self._batch = b
            self._go.set()
        b.write()
        # Every index is claimed. The worker writes only an index it claimed after raising
        # `helping`: if it is not helping now, it has written none and will write none.
        if b.helping:
            b.finished.wait()
        return b.sent

    def _run(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            if self._stop:
                return
            b = self._batch
            if b is None:
                continue
            b.helping = True  # before its first claim
            try:
                b.write()
            finally:
                b.helping = False
                b.finished.set()

    def close(self) -> None:
        self._stop = True
        self._go.set()
        self._thread.join(5)
