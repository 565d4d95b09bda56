"""One step's socket writes spread over two threads.

At a step's end the server writes one frame to each of hundreds of sockets. A loopback TCP
send runs the receiver's TCP path in the sender's system call (several microseconds each), so
one thread doing them one after another makes the last frame wait for all the others. The
system call releases the GIL: a second thread writing the other half runs that kernel work on
the other core at the same time.

Only raw writes run off the event loop's thread (asyncio is not thread-safe): the caller hands
over file descriptors of sockets whose transports have nothing buffered and which the loop
does not touch until `write_all` returns; what a socket did not take is handed back, for the
caller to give to its transport, in order.
"""

from __future__ import annotations

import os
import threading
import time


def _write_range(fds: list[int], datas: list[bytes], sent: list[int], lo: int, hi: int,
                 times: list[float] | None) -> None:
    """Write datas[i] to fds[i] for i in [lo, hi): sent[i] = bytes taken (0 when the socket
    was full), or -1 on an error (the transport's own write then meets it and closes); with
    `times`, times[i] = when the write returned (time.monotonic)."""
    write, clock = os.write, time.monotonic
    for i in range(lo, hi):
        try:
            sent[i] = write(fds[i], datas[i])
        except BlockingIOError:
            sent[i] = 0
        except OSError:
            sent[i] = -1
        if times is not None:
            times[i] = clock()


class PairWriter:
    """Writes a batch of (socket, bytes) from the calling thread and one worker thread, each
    taking half. `close` stops the worker."""

    # Below this many writes, waking the worker costs more than it saves.
    MIN_SPLIT = 16

    def __init__(self) -> None:
        self._go = threading.Event()
        self._done = threading.Event()
        self._job: tuple | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="servesim-send", daemon=True)
        self._thread.start()

    def write_all(self, fds: list[int], datas: list[bytes],
                  times: list[float] | None = None) -> list[int]:
        """Write each datas[i] to non-blocking socket fds[i]; returns the bytes each took (0:
        full, -1: an error), in the order given. A list `times` gets when each write returned."""
        n = len(fds)
        sent = [0] * n
        if times is not None:
            times[:] = [0.0] * n
        if n < self.MIN_SPLIT or self._stop:
            _write_range(fds, datas, sent, 0, n, times)
            return sent
        half = n // 2
        self._job = (fds, datas, sent, half, n, times)
        self._done.clear()
        self._go.set()
        _write_range(fds, datas, sent, 0, half, times)
        self._done.wait()
        return sent

    def _run(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            if self._stop:
                return
            fds, datas, sent, lo, hi, times = self._job
            try:
                _write_range(fds, datas, sent, lo, hi, times)
            finally:
                self._job = None
                self._done.set()

    def close(self) -> None:
        self._stop = True
        self._go.set()
        self._thread.join(5)
