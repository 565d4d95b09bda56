"""When a request reached the server: the listening sockets, and the kernel's receive time of
the bytes each connection reads.

A load generator that opens its streams at once (`vllm bench serve --max-concurrency 500`,
guidellm's concurrent profile, `servesim bench serve`) lands hundreds of requests on the server
in a few ms. Accepting, reading and parsing them is ~70 us each in the one event loop, so the
last of 500 reaches its handler ~40 ms after it was sent: a request whose arrival is its
handler's start would show the engine a TTFT ~40 ms shorter than its client sees, the time it
spent queued in the server missing from the engine's queue wait. And with asyncio's default
backlog (aiohttp: 128) the kernel refuses the rest of such a burst for a while: their clients
retry the handshake after 1 s.

So the server listens on its own sockets (`Intake.listen`): a backlog of `BACKLOG` (the kernel
caps it at net.core.somaxconn), and, on Linux, kernel receive timestamps (SO_TIMESTAMPNS,
inherited by every accepted socket). Each accepted connection is a `_Conn`, whose reads (asyncio
calls `recv`) are `recvmsg` calls that also return the kernel's receive time of the bytes read
(of the last packet among them); `Intake.seen` keeps the latest per connection. A request's
arrival is the receive time of the last bytes its connection had read once its body was read:
its own last bytes, unless the client had already sent more (pipelined), which would only make
it later. Where the option is missing (other than Linux on x86-64, aarch64, riscv64), the
handler's start is the arrival, as before.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import functools
import platform
import socket
import struct
import sys
import time

BACKLOG = 4096
# Connections asyncio accepts per wake of its accept loop (`web.SockSite(backlog=...)`); the rest
# wait in the kernel's queue for the loop's next turn, so a burst of new connections is taken in
# slices with the pump's sends between them rather than in one ~35 ms stretch of the loop.
ACCEPT_BATCH = 8
# SO_TIMESTAMPNS (SO_TIMESTAMPNS_OLD): 35 in asm-generic/socket.h, which these use; Python's
# socket module does not name it.
_SO_TIMESTAMPNS = 35 if sys.platform == "linux" and platform.machine() in (
    "x86_64", "aarch64", "arm64", "riscv64") else None
_TIMESPEC = struct.Struct("qq")
_ANCILLARY = socket.CMSG_SPACE(_TIMESPEC.size) if hasattr(socket, "CMSG_SPACE") else 0
# A stamp further back than this is not believed (the wall clock stepped between the receive
# and the conversion): the request's handler start is used instead. Bytes wait unread for ms,
# not seconds, unless the server is stalled.
_MAX_AGE_S = 10.0


class _Listener(socket.socket):
    """A listening socket whose `accept` (called by asyncio's accept loop) hands out `_Conn`s.

    asyncio uses one number for the kernel's accept queue (`listen`) and for how many
    connections one wake of its accept loop takes: the queue stays `BACKLOG` deep while the
    server is given `ACCEPT_BATCH` (see there)."""

    intake: "Intake"

    def listen(self, backlog: int = BACKLOG) -> None:
        super().listen(max(backlog, BACKLOG))

    def accept(self):
        conn, addr = super().accept()
        if not self.intake.stamps:
            return conn, addr
        mine = _Conn(fileno=conn.detach())
        mine.intake = self.intake
        return mine, addr


class _Conn(socket.socket):
    """An accepted connection whose reads note their bytes' receive time (`Intake.seen`)."""

    intake: "Intake | None" = None  # (None on a `dup()`: plain reads)

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        if self.intake is None:
            return super().recv(bufsize, flags)
        data, ancillary, _, _ = self.recvmsg(bufsize, _ANCILLARY, flags)
        self.intake.note(self.fileno(), ancillary)
        return data

    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
        if self.intake is None:
            return super().recv_into(buffer, nbytes, flags)
        view = memoryview(buffer).cast("B")
        if nbytes > len(view):
            raise ValueError("buffer too small for requested bytes")
        n, ancillary, _, _ = self.recvmsg_into([view[:nbytes] if nbytes else view], _ANCILLARY,
                                               flags)
        self.intake.note(self.fileno(), ancillary)
        return n


class Intake:
    """The receive time of the last bytes each accepted connection read, by file descriptor
    (a descriptor's entry is renewed by its connection's first read, before any request on it
    can ask)."""

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}
        self.stamps = _SO_TIMESTAMPNS is not None and _ANCILLARY > 0

    async def listen(self, host: str | None, port: int) -> list[socket.socket]:
        """Bound, not yet listening sockets for `host` (every address it resolves to; None or
        "" for all interfaces) on `port` (0: one free port, the same for every address), with
        SO_REUSEADDR, as asyncio's `create_server` makes them (and, as it does, skipping an
        address family this machine cannot open a socket for). Raises OSError
        (socket.gaierror included)."""
        # (resolved off the loop, in a thread of its own that ends here: a thread left alive
        # in the server's process, as asyncio's default executor's would be, makes the pump's
        # send passes late during a burst of new connections)
        with concurrent.futures.ThreadPoolExecutor(1) as resolver:
            infos = await asyncio.get_running_loop().run_in_executor(
                resolver, functools.partial(socket.getaddrinfo, host or None, port,
                                            type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE))
        socks: list[socket.socket] = []
        try:
            for family, type_, proto, _, addr in dict.fromkeys(infos):
                try:
                    listener = _Listener(family, type_, proto)
                except OSError as e:
                    if e.errno == errno.EAFNOSUPPORT and len(infos) > 1:
                        continue  # e.g. IPv6 off in this kernel
                    raise
                listener.intake = self
                socks.append(listener)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and hasattr(socket, "IPV6_V6ONLY"):
                    listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                if self.stamps and _SO_TIMESTAMPNS is not None:
                    try:
                        listener.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
                    except OSError:
                        self.stamps = False
                bind_to: tuple = tuple(addr)
                if port == 0 and len(socks) > 1:
                    bind_to = (addr[0], socks[0].getsockname()[1]) + tuple(addr[2:])
                listener.bind(bind_to)
        except OSError:
            for sock in socks:
                sock.close()
            raise
        if not socks:
            raise OSError(errno.EAFNOSUPPORT, f"no address family of {host!r} can be opened")
        return socks

    def note(self, fd: int, ancillary) -> None:
        """A read on connection `fd` returned `ancillary`: keep its receive time, on
        time.monotonic's clock (a read without one, e.g. at the end of the stream, leaves the
        connection with no time rather than an older one)."""
        self.seen.pop(fd, None)
        for level, kind, raw in ancillary:
            if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(raw) >= 16:
                sec, nsec = _TIMESPEC.unpack_from(raw)
                mono, real = time.monotonic_ns(), time.time_ns()
                age = (real - (sec * 1_000_000_000 + nsec)) / 1e9
                if 0.0 <= age <= _MAX_AGE_S:  # (else the wall clock stepped: no time)
                    self.seen[fd] = mono / 1e9 - age

    def arrival(self, transport) -> float | None:
        """When the request being handled on `transport` arrived (the receive time of the
        last bytes its connection read), or None when not known."""
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is None:
            return None
        return self.seen.get(sock.fileno())
