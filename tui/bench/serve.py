"""`servesim bench serve`: timing fidelity of `servesim serve` under many concurrent streams.

Starts `servesim serve --record-timing` as a child process, opens `--streams` concurrent
streaming completions from one asyncio client (each stream starts its next request when one
ends, on the same keep-alive connection) for `--duration` wall seconds, then reads the
server's own record:

- send lateness: for every token, wall time its frame was handed to the socket minus the wall
  time of its simulated time (the server measures it);
- client vs engine: per request, the TTFT and each ITL the client measured (receive times) minus
  the engine's (simulated token times at x1), matched by response id.

A benchmark that prints figures, not a test: on a shared machine the client, the server and
everything else compete for the same cores, and the figures say so.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(a, q) -> float | None:
    return float(np.percentile(a, q)) if len(a) else None


def _placement(pin: bool) -> tuple[set[int], set[int]] | None:
    """(server CPUs, client CPUs) when pinning, else None: the server gets the lowest CPU this
    process may use, the client the rest. On a 2-core machine, unpinned, the kernel often
    queues the client on the server's core (a loopback send wakes the reader as a synchronous
    wake-up, which favours the waker's CPU): the server then waits for the client to read
    hundreds of sockets, several ms, in the middle of a send pass."""
    if not pin or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return {cpus[0]}, set(cpus[1:])


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


class _Stream(asyncio.BufferedProtocol):
    """One keep-alive connection posting the same streaming completion again and again until
    `stop_at`. It does not parse HTTP or SSE per token: each read is timestamped and the frames
    in it counted (`data: {` in the bytes), so the load generator takes as little as it can of
    the cores it shares with the server. Records `rid -> (sent, receive time of each token,
    whether it opened its connection)`.

    Reads go into one buffer shared by every stream (`recv_into`; each read is handled before
    the next): a plain Protocol's reads allocate asyncio's 256 KiB `recv` buffer each time,
    about half of the client's work a read, and a client that reads late measures late."""

    def __init__(self, request: bytes, stop_at: float, records: dict,
                 buffer: memoryview) -> None:
        self.request, self.stop_at, self.records = request, stop_at, records
        self.buffer = buffer
        self.closed = asyncio.get_running_loop().create_future()
        self.errors = 0
        self.transport = None
        self.busy = False
        self.opening = True  # the connection's first request (all streams start at once)

    def connection_made(self, transport) -> None:
        self.transport = transport
        self._post()

    def _post(self) -> None:
        if time.monotonic() >= self.stop_at:
            self.busy = False
            self.transport.close()
            return
        self.busy = True
        self.status = None
        self.head = b""
        self.tail = b""  # the last bytes of the body so far: a frame split across reads
        self.rid = None
        self.recv: list[float] = []
        self.sent = time.monotonic()
        self.transport.write(self.request)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(self.buffer[:nbytes]))

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        if self.status is None:  # the status line and headers
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            self.status = int(self.head.split(None, 2)[1])
            if self.status != 200:  # an error body: count it, start over on a new connection
                self.errors += 1
                self.busy = False
                self.transport.close()
                return
            data, self.head = self.head[end + 4:], b""
            if not data:
                return
        # `tail` is 6 bytes, shorter than `data: {`: a frame is never counted twice.
        buf = self.tail + data
        n = buf.count(b"data: {")
        if n:
            self.recv.extend([now] * n)
        if self.rid is None:
            self.head += data
            start = self.head.find(b'"id": "')
            stop = self.head.find(b'"', start + 7) if start >= 0 else -1
            if stop > 0:
                self.rid = self.head[start + 7:stop].decode()
                self.head = b""
        # The last chunk of a chunked body; a chunk's data here always starts with `data:`.
        if buf.endswith(b"\r\n0\r\n\r\n"):
            if self.rid is not None:
                self.records[self.rid] = (self.sent, self.recv, self.opening)
            self.opening = False
            self._post()
            return
        self.tail = buf[-6:]

    def connection_lost(self, exc) -> None:
        if self.busy:  # closed in the middle of a response
            self.errors += 1
        if not self.closed.done():
            self.closed.set_result(None)


async def _load(host: str, port: int, streams: int, duration: float, prompt: str,
                max_tokens: int):
    loop = asyncio.get_running_loop()
    records: dict[str, tuple[float, list[float], bool]] = {}
    errors = 0
    stop_at = time.monotonic() + duration
    buffer = memoryview(bytearray(1 << 16))
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
               ).encode() + body

    async def worker() -> None:
        nonlocal errors
        while time.monotonic() < stop_at:
            try:
                _, proto = await loop.create_connection(
                    lambda: _Stream(request, stop_at, records, buffer), host, port)
            except OSError:
                errors += 1
                await asyncio.sleep(0.1)
                continue
            try:  # a server that stops answering must not hang the benchmark
                await asyncio.wait_for(asyncio.shield(proto.closed), stop_at - time.monotonic()
                                       + 120)
            except asyncio.TimeoutError:
                proto.transport.abort()
                errors += 1
            errors += proto.errors

    await asyncio.gather(*(worker() for _ in range(streams)))
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"GET /servesim/timing HTTP/1.1\r\nHost: {host}:{port}\r\n"
                 "Connection: close\r\n\r\n".encode())
    raw = await reader.read()
    writer.close()
    timing = json.loads(raw.split(b"\r\n\r\n", 1)[1])
    return records, errors, timing


def run(args) -> dict:
    port = _free_port()
    cmd = [sys.executable, "-m", "tui.cli", "serve", args.scenario, "--port", str(port),
           "--speed", str(args.speed), "--record-timing", "--send-threads",
           str(args.send_threads)]
    overrides = args.overrides or [f"scheduler.max_num_seqs={max(256, 2 * args.streams)}"]
    for o in overrides:
        cmd += ["--set", o]
    placement = _placement(args.pin)
    own = os.sched_getaffinity(0) if placement else None
    server_cpus = placement[0] if placement else None
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, preexec_fn=(
        (lambda: os.sched_setaffinity(0, server_cpus)) if server_cpus else None))
    try:
        if placement:
            os.sched_setaffinity(0, placement[1])
        line = proc.stderr.readline()  # the banner, once listening
        if "http://" not in line:
            raise RuntimeError(f"servesim serve did not start: {line.strip()}")
        cpu0, wall0 = _cpu_s(proc.pid), time.monotonic()
        client0 = time.process_time()
        load0 = os.getloadavg()[0]
        records, errors, timing = asyncio.run(_load("127.0.0.1", port, args.streams,
                                                    args.duration, "x" * args.prompt_tokens,
                                                    args.max_tokens))
        wall = time.monotonic() - wall0
        server_cpu = _cpu_s(proc.pid) - cpu0
        client_cpu = time.process_time() - client0
        load1 = os.getloadavg()[0]
    finally:
        proc.terminate()
        proc.wait(10)
        if own is not None:
            os.sched_setaffinity(0, own)
    # Client minus engine, per request (TTFT) and per token gap (ITL), in wall seconds.
    ttft_diff, itl_diff, seen_late, tokens = [], [], [], 0
    # The TTFT gap's parts (wall clocks: time.monotonic is one clock for both processes):
    # sent -> the engine's arrival (the kernel's receive time where the server has it, else its
    # handler's start: tui/serve/intake.py), the first frame's send lateness, sent -> read.
    parts: dict[str, list[float]] = {"to_arrival": [], "first_send_late": [],
                                     "client_read": [], "later": []}
    for call in timing["calls"]:
        rec = records.get(call["id"])
        if rec is None:
            continue
        sent, recv, opening = rec
        sim = np.asarray(call["tokens"])
        if len(recv) != len(sim) or not len(sim):
            continue
        tokens += len(sim)
        got = np.asarray(recv)
        gap = (got[0] - sent) - (sim[0] - call["arrival"]) / args.speed
        ttft_diff.append(gap)
        if not opening:
            parts["later"].append(gap)
        if call.get("first_sent") is not None:
            due = call["arrival_wall"] + (sim[0] - call["arrival"]) / args.speed
            parts["to_arrival"].append(call["arrival_wall"] - sent)
            parts["first_send_late"].append(call["first_sent"] - due)
            parts["client_read"].append(got[0] - call["first_sent"])
        itl_diff.extend((np.diff(got) - np.diff(sim) / args.speed).tolist())
        # each token's receive time against the request's send time plus its simulated delay
        seen_late.extend((got - sent - (sim - call["arrival"]) / args.speed).tolist())
    ttft_ms, itl_ms = np.asarray(ttft_diff) * 1e3, np.asarray(itl_diff) * 1e3
    seen_ms = np.asarray(seen_late) * 1e3
    late = timing["lateness_ms"]
    return {
        "scenario": args.scenario, "streams": args.streams, "speed": args.speed,
        "send_threads": args.send_threads,
        "machine": f"{os.cpu_count()} cores", "wall_s": wall, "requests": len(ttft_diff),
        "pinned": None if placement is None else {"server": sorted(placement[0]),
                                                  "client": sorted(placement[1])},
        "tokens": tokens, "tokens_per_s": tokens / wall, "errors": errors,
        "server_cpu_share": server_cpu / wall, "client_cpu_share": client_cpu / wall,
        "load_average": [load0, load1],
        "send_lateness_ms": late,
        "send_passes": timing.get("passes"),
        "ttft_client_minus_engine_ms": {"p50": _pct(ttft_ms, 50), "p99": _pct(ttft_ms, 99),
                                        "max": _pct(ttft_ms, 100)},
        "ttft_gap_parts_ms": {k: {"p50": _pct(np.asarray(v) * 1e3, 50),
                                  "p99": _pct(np.asarray(v) * 1e3, 99)}
                              for k, v in parts.items()},
        "token_seen_late_ms": {"p50": _pct(seen_ms, 50), "p99": _pct(seen_ms, 99)},
        "itl_client_minus_engine_ms": {"p1": _pct(itl_ms, 1), "p50": _pct(itl_ms, 50),
                                       "p99": _pct(itl_ms, 99),
                                       "p99_abs": _pct(np.abs(itl_ms), 99)},
    }


def _cpus(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def text(r: dict) -> str:
    late, t, i = (r["send_lateness_ms"], r["ttft_client_minus_engine_ms"],
                  r["itl_client_minus_engine_ms"])
    parts = r["ttft_gap_parts_ms"]

    def pq(k: str) -> str:
        return pq2(parts[k])

    def pq2(d: dict) -> str:
        return f"{_fmt(d['p50'])} / {_fmt(d['p99'])}"

    ps = r.get("send_passes")

    return "\n".join([
        f"bench serve: {r['streams']} concurrent streams at x{r['speed']:g}, {r['scenario']}, "
        f"{r['machine']}, {r['send_threads']} send thread(s), "
        + ("server and client placed by the kernel" if not r.get("pinned") else
           f"server on CPU {_cpus(r['pinned']['server'])}, client on "
           f"{_cpus(r['pinned']['client'])}"),
        f"  {r['requests']:,} requests, {r['tokens']:,} tokens in {r['wall_s']:.1f} s "
        f"({r['tokens_per_s']:,.0f} tokens/s), {r['errors']} errors",
        f"  CPU: server {100 * r['server_cpu_share']:.0f}% of a core, client "
        f"{100 * r['client_cpu_share']:.0f}%; load average {r['load_average'][0]:.1f} at the "
        f"start, {r['load_average'][1]:.1f} at the end",
        f"  send lateness (ms)            p50 {_fmt(late['p50'])}  p99 {_fmt(late['p99'])}  "
        f"max {_fmt(late['max'])}",
        *([f"    its passes (p50 / p99): began late {pq2(ps['start_late_ms'])} ms, took "
           f"{pq2(ps['duration_ms'])} ms for {ps['calls_mean']:.0f} calls on average, "
           f"{100 * ps.get('prepared_ahead', 0):.0f}% prepared ahead"]
          if ps and ps["count"] else []),
        f"  TTFT client - engine (ms)     p50 {_fmt(t['p50'])}  p99 {_fmt(t['p99'])}  "
        f"max {_fmt(t['max'])}",
        f"    its parts, p50 / p99: request sent to its arrival {pq('to_arrival')}, first frame "
        f"sent late {pq('first_send_late')}, frame sent to read {pq('client_read')}",
        f"    without each connection's first request (the opening burst): {pq('later')}",
        f"  token seen by client - its time (ms)  p50 {_fmt(r['token_seen_late_ms']['p50'])}  "
        f"p99 {_fmt(r['token_seen_late_ms']['p99'])}",
        f"  ITL client - engine (ms)      p1 {_fmt(i['p1'])}  p50 {_fmt(i['p50'])}  "
        f"p99 {_fmt(i['p99'])}  p99 |.| {_fmt(i['p99_abs'])}",
    ])
