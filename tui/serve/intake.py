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

The intake also bounds what connections may hold: at most `Intake.max_connections` are open at
once (the next one gets `Intake.refusal`, an HTTP 503, and is closed: the open ones, /health
included, go on being served), and accepting when the process is out of file descriptors is
one line on stderr every `NOTE_EVERY_S`, not a traceback per try (`Intake.loop_error`).
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

try:
    import resource  # (Unix only)
except ImportError:  # pragma: no cover
    resource = None  # type: ignore[assignment]

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
# File descriptors kept for the process's own files (the event loop, logs, a session log).
FD_MARGIN = 64
# The soft limit on open files that serving raises itself to (at most the hard limit), as vLLM's
# API server does at startup (`set_ulimit`, 65535): the common default of 1024 is two fds
# short of 500 streams (a stream holds its connection and a duplicate of it for raw writes).
FD_TARGET = 65535
# A repeated note (refusals, fd exhaustion) is printed at most once per this many seconds.
NOTE_EVERY_S = 10.0
# accept() errors by which the process (or the system) is out of descriptors or memory
OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def fd_limit() -> int:
    """The soft limit on open files (1024 where it cannot be read; at most 2**20)."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (AttributeError, OSError, ValueError):
        return 1024
    return 1 << 20 if soft == -1 or soft > 1 << 20 else soft  # (RLIM_INFINITY, or as good as)


def raise_fd_limit() -> int:
    """Raise the soft limit on open files to `FD_TARGET` where the hard limit allows (never
    lower it). Returns the soft limit."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = FD_TARGET if hard == resource.RLIM_INFINITY else min(FD_TARGET, hard)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (AttributeError, OSError, ValueError):
        pass
    return fd_limit()


def fd_share() -> int:
    """Half of the descriptors the process may open, less `FD_MARGIN`: the most connections
    served at once by default, and the most duplicated fds the raw writes hold, so that
    together they never run the process out."""
    return max(1, (fd_limit() - FD_MARGIN) // 2)


class Notes:
    """One line on stderr per kind of trouble at most every `NOTE_EVERY_S`, saying how many
    more of it there were in between."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def say(self, kind: str, line: str) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < NOTE_EVERY_S:
            self._quiet[kind] = self._quiet.get(kind, 0) + 1
            return
        quiet = self._quiet.pop(kind, 0)
        self._last[kind] = now
        more = f" ({quiet} more since the last note)" if quiet else ""
        print(f"{line}{more}", file=sys.stderr, flush=True)


class _Listener(socket.socket):
    """A listening socket whose `accept` (called by asyncio's accept loop) hands out `_Conn`s.

    asyncio uses one number for the kernel's accept queue (`listen`) and for how many
    connections one wake of its accept loop takes: the queue stays `BACKLOG` deep while the
    server is given `ACCEPT_BATCH` (see there)."""

    intake: "Intake"

    def listen(self, backlog: int = BACKLOG) -> None:
        super().listen(max(backlog, BACKLOG))

    def accept(self):
        """The next connection, as a `_Conn`; one over `Intake.max_connections` is refused
        (see `Intake.refuse`) and the next one taken. Raises BlockingIOError when none waits
        (or after refusing a batch: the rest on the loop's next turn), OSError as accept
        does."""
        intake = self.intake
        for _ in range(ACCEPT_BATCH):
            conn, addr = super().accept()
            if intake.max_connections is None or intake.open < intake.max_connections:
                mine = _Conn(fileno=conn.detach())
                mine.intake = intake
                mine.counted = True
                intake.open += 1
                return mine, addr
            intake.refuse(conn)
        raise BlockingIOError(errno.EAGAIN, "refused a batch of connections")


class _Conn(socket.socket):
    """An accepted connection, counted in `Intake.open` until closed, whose reads note their
    bytes' receive time (`Intake.seen`) where the kernel stamps them."""

    intake: "Intake | None" = None  # (None on a `dup()`: plain reads, not counted)
    counted = False

    def close(self) -> None:
        if self.counted:
            self.counted = False
            self.intake.open -= 1
        super().close()

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        if self.intake is None or not self.intake.stamps:
            return super().recv(bufsize, flags)
        data, ancillary, _, _ = self.recvmsg(bufsize, _ANCILLARY, flags)
        self.intake.note(self.fileno(), ancillary)
        return data

    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
        if self.intake is None or not self.intake.stamps:
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

    def __init__(self, max_connections: int | None = None, refusal: bytes = b"") -> None:
        self.seen: dict[int, float] = {}
        self.stamps = _SO_TIMESTAMPNS is not None and _ANCILLARY > 0
        self.open = 0  # accepted connections not yet closed
        self.max_connections = max_connections  # None: no cap
        self.refusal = refusal  # sent to a connection over the cap before it is closed
        self.refused = 0
        self.notes = Notes()

    def refuse(self, conn: socket.socket) -> None:
        """A connection over the cap: `refusal` if its socket takes it at once, then closed."""
        self.refused += 1
        try:
            conn.setblocking(False)
            conn.send(self.refusal)
        except OSError:
            pass
        conn.close()
        self.notes.say("cap", f"servesim serve: refusing new connections: {self.open} open, "
                              f"the most allowed (--max-connections {self.max_connections})")

    def loop_error(self, context: dict) -> bool:
        """An event-loop error that is the intake's: accepting while out of descriptors, which
        asyncio retries a second later. Says so on one line (at most every `NOTE_EVERY_S`) and
        returns True; False for any other error."""
        exc = context.get("exception")
        if not (isinstance(exc, OSError) and exc.errno in OUT_OF_FDS
                and str(context.get("message", "")).startswith("socket.accept()")):
            return False
        self.notes.say("fds", f"servesim serve: cannot accept connections: "
                              f"{exc.strerror or exc} ({self.open} open, a limit of "
                              f"{fd_limit()} files); they wait in the listen queue, tried "
                              "again each second")
        return True

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
