"""The server's side of the engine: runs it on the wall clock, injects HTTP requests into it,
learns each token's time from its events, and sends every token when the simulated clock
reaches that time.

One coroutine, the pump, owns the engine (all in the event loop's thread, under the engine lock
the dashboard shares). Each turn it sends the tokens that are due, applies the requests that came
in (each injected with the time it arrived: a request that arrives while a step runs joins the
queue at that step's end, as in a real engine), runs the engine up to the present (the last step
it starts ends in the future: its tokens' times are then known), reads the new events, builds
their frames (so that when their time comes only the writes remain), and sleeps until the next
token is due or the next step is to be decided. A pass's writes go out in one call
(`tui/serve/sender.py`), or with `send_threads=2` shared with a second thread.

The engine's public API only: `inject` (with `arrival_time` and `tag`), `cancel`, `run_until`,
`next_event`, `events`; finished requests are learned from events, never looked up.
"""

from __future__ import annotations

import bisect

import asyncio
import codecs
import collections
import heapq
import math
import os
import sys
import threading
import time
import uuid
from array import array
from http import HTTPStatus
from typing import Any

import numpy as np

from sim import EngineError, ServesimError
from sim.engine.admission import is_refusal
from sim.engine.stepping import arrival_blocks
from sim.inputs.workload import sample_lengths
from tui.serve.intake import fd_share
from tui.serve.metrics import ServeMetrics
from tui.serve.protocol import (DONE, FILLER, APIError, ChunkWriter, GenerateSpec, chat_body,
                            completion_body, created_now, usage)
from tui.serve.sender import PairWriter, RawWriter

SERVE_STREAM = 0x5E  # seed stream of output lengths drawn for requests without max_tokens
WRITE_LIMIT = 32 * 1024  # above this many unsent bytes a client is slow: its own task writes
MAX_STEPS = 256  # engine steps per pump turn, so that sends and requests are not held up
# Engine requests injected per pump turn (~20 us each): a call of thousands of sequences (prompts
# x n) goes in over several turns, the sends due meanwhile between them, not in one stretch.
INJECT_SLICE = 64
# Unsent bytes a stream may hold (its backlog and its transport's buffer) while its client does
# not read: past this the server aborts its requests and closes the connection. 4 MiB is ~20,000
# token frames (a whole 8k-token answer of a choice, or seconds of n=256); at most
# max_num_seqs streams produce frames, so at 256 a server holds at most ~1 GiB for them.
MAX_BACKLOG = 4 << 20
MAX_BACKLOG_UNANSWERED = 64 << 20  # the same before its response is attached (see `_write`)
# The pump looks at least this often (wall seconds), whatever else changed the engine.
MAX_SLEEP_S = 0.1
# The pump asks to be woken this much before a step's tokens are due and sleeps the rest in the
# kernel (the loop held for it). asyncio's epoll waits whole milliseconds, rounded up, and the
# pump's task resumes only after the I/O callbacks ready in that loop iteration (requests
# coming in), so it needs more than 1 ms of margin to resume before the tokens' time (`bench
# serve` shows how late it resumes). A request arriving meanwhile waits for its handler at most
# that long.
WAKE_EARLY_S = 0.0025


class SimClock:
    """Simulated time on the wall clock: `speed` simulated seconds per wall second, from
    `start`; frozen while paused. Wall times are `time.monotonic()` (asyncio's clock)."""

    def __init__(self, start: float = 0.0, speed: float = 1.0) -> None:
        self.speed = speed
        self.paused = False
        self._sim0 = start
        self._wall0 = time.monotonic()

    def now(self) -> float:
        if self.paused:
            return self._sim0
        return self._sim0 + (time.monotonic() - self._wall0) * self.speed

    def at_wall(self, wall: float) -> float:
        """The simulated time at wall time `wall` (a past one: a request's arrival), not after
        now. Before the clock's last anchoring (a pause, a speed change, the start) it was
        running at another rate or not at all, so such a time maps to the anchor: never
        earlier than the true one. While paused, the time the clock stands at."""
        if self.paused or wall <= self._wall0:
            return self._sim0
        return min(self.now(), self._sim0 + (wall - self._wall0) * self.speed)

    def wall_at(self, t: float) -> float:
        """The wall time at which simulated time `t` comes (inf while paused)."""
        if self.paused:
            return math.inf if t > self._sim0 else time.monotonic()
        return self._wall0 + (t - self._sim0) / self.speed

    def set(self, t: float | None = None, *, speed: float | None = None,
            paused: bool | None = None) -> None:
        """Re-anchor at simulated time `t` (default: now), with a new speed or pause state."""
        t = self.now() if t is None else t
        self._sim0, self._wall0 = t, time.monotonic()
        if speed is not None:
            self.speed = speed
        if paused is not None:
            self.paused = paused


class Choice:
    """One engine request serving one choice of an HTTP call."""

    __slots__ = ("call", "index", "req_id", "reason", "n_out", "parts", "decoder", "done",
                 "times", "head", "tails")

    def __init__(self, call: "Call", index: int, req_id: int, reason: str,
                 decode_bytes: bool) -> None:
        self.call, self.index, self.req_id, self.reason = call, index, req_id, reason
        self.n_out = 0
        self.parts: list[str] = []
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace") if decode_bytes else None
        self.done = False
        self.times: list[float] | None = None
        # A streamed token's frame is `head + tails[text]` (shared bytes), unless the call
        # sends usage with every token.
        w = call.writer
        plain = w is not None and not call.spec.continuous_usage
        self.head = w.head if plain else None
        self.tails = w.tails(index) if plain else None

    def text(self, token: int) -> str:
        """The text of output token number `n_out`: the tiny model's byte `token` (UTF-8
        decoded incrementally, as a detokenizer does), or the filler (`token` -1)."""
        if self.decoder is not None:
            return self.decoder.decode(bytes((token & 0xFF,)))
        return FILLER[(self.n_out - 1) % len(FILLER)]


class Call:
    """One HTTP generate request: its choices, its response, and what the handler awaits."""

    def __init__(self, spec: GenerateSpec, model: str, tag: str, arrival: float) -> None:
        loop = asyncio.get_running_loop()
        self.spec, self.model, self.tag, self.arrival = spec, model, tag, arrival
        self.rid = ("chatcmpl-" if spec.chat else "cmpl-") + uuid.uuid4().hex
        self.created = created_now()
        self.choices: list[Choice] = []
        self.prompt_tokens = sum(p.num_tokens for p in spec.prompts)
        self.accepted = loop.create_future()  # True, or an APIError
        self.complete = False  # every choice ended and the last frames are out (or queued)
        self.closed = False    # the client is gone
        self.abandoned = False
        self.open = 0          # choices still running
        self.writer = ChunkWriter(self.rid, self.created, model, spec.chat) if spec.stream \
            else None
        self.resp = None
        self.transport: Any = None  # an asyncio transport, once the response is prepared
        # A duplicate of its socket's fd, ours until the handler ends (`stream_to`), for a
        # pass's raw writes (`RawWriter`, `PairWriter`): the number cannot be closed under a
        # prepared pass and given to another connection, as the transport's own fd can.
        self.fd = -1
        self.detached = _no_op  # called when the handler lets its fd go (the frontend's)
        self.first_sent: float | None = None  # wall time the first frame left (record_timing)
        self.chunked = False
        self.backlog: list[bytes] = []
        self.backlog_bytes = 0
        self.injected = 0  # sequences (prompt, sample) injected so far (in slices)
        self.outs: list[tuple[int, str]] = []  # each sequence's output length and finish reason
        self._kick: asyncio.Future | None = None
        self.done = loop.create_future()  # set when complete (the non-streamed response)

    @property
    def completion_tokens(self) -> int:
        return sum(c.n_out for c in self.choices)

    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens)

    def body(self) -> dict:
        """The whole response (non-streamed)."""
        make = chat_body if self.spec.chat else completion_body
        return make(self.rid, self.created, self.model,
                    [("".join(c.parts), c.reason) for c in self.choices],
                    self.prompt_tokens, self.completion_tokens)

    def kick(self) -> None:
        if self._kick is not None and not self._kick.done():
            self._kick.set_result(None)

    async def stream_to(self, resp, transport) -> None:
        """Handler side of a streamed call: attach the prepared response, then write what the
        pump could not write itself (a slow client's frames), until the call is complete."""
        self.resp, self.transport, self.chunked = resp, transport, resp.chunked
        sock = transport.get_extra_info("socket")
        if (sock is not None and transport.get_extra_info("sslcontext") is None
                and not transport.is_closing() and _fds.take()):
            try:
                self.fd = os.dup(sock.fileno())
            except OSError:  # out of fds: its frames go through the transport
                _fds.give()
        try:
            loop = asyncio.get_running_loop()
            while True:
                while self.backlog:
                    data = b"".join(self.backlog)
                    self.backlog.clear()
                    self.backlog_bytes = 0
                    await resp.write(data)
                if self.complete:
                    break
                if self.closed:  # dropped (see `Frontend._write`): no clean end of stream
                    transport.abort()
                    raise ConnectionResetError("the stream was dropped")
                self._kick = loop.create_future()
                await self._kick
            await resp.write_eof()
        finally:
            if self.fd >= 0:
                fd, self.fd = self.fd, -1
                _fds.give()
                if not self.complete:  # (a complete call is in no pass still to send)
                    self.detached()
                os.close(fd)


def _no_op() -> None:
    pass


class _FdBudget:
    """How many duplicated fds the raw writes may hold at once: `intake.fd_share` (half of
    what the process may open, less a margin), so that accepting connections never runs out
    because of them. Read at each take: serving raises the limit once started."""

    def __init__(self) -> None:
        self.held = 0

    @property
    def left(self) -> int:
        return max(0, fd_share() - self.held)

    def take(self) -> bool:
        if self.held >= fd_share():
            return False
        self.held += 1
        return True

    def give(self) -> None:
        self.held -= 1


_fds = _FdBudget()


class _Due:
    """What leaves at one simulated time: a token for each of `choices` (with real compute,
    the token ids in `toks`, in step), then `ends` (choice -> finish reason): an end folds into
    its choice's token frame at that time, or has a frame of its own. One per engine step, not
    per token: a step of 500 decodes is 500 appends and one heap entry.

    Built ahead: `Frontend._build` renders it into `out` (each call's frames, in order) as soon
    as the engine's events for it are read, which is before its time on the wall clock (a step
    is computed when it starts), so that at its time only the writes remain. What is added
    after the build is built on the next pass over it: more choices, and ends, which then get
    frames of their own (a cancel from the dashboard after its step was computed).

    `prep`: its writes made ready at the build (`_Prepared`), valid while the frontend's `gen`
    is what it was then."""

    __slots__ = ("choices", "toks", "ends", "n_built", "out", "tokens", "ended", "fin",
                 "dirty", "prep")

    def __init__(self) -> None:
        self.choices: list[Choice] = []
        self.toks: list[int] = []
        self.ends: dict[Choice, str] = {}
        self.n_built = 0  # choices[:n_built] are in `out`
        self.out: dict[Call, list[bytes]] = {}
        self.tokens: dict[Call, int] = {}  # tokens each call gets here (record_timing)
        self.ended: list[Call] = []  # calls whose last frame is in `out`
        self.fin: list[Choice] = []  # choices whose end frame is in `out`
        self.dirty = False  # in the frontend's list of instants to build
        self.prep: _Prepared | None = None


class _Prepared:
    """A pass's writes, ready: `fds`/`datas` (each call's frames joined and framed as its
    HTTP chunk) for the calls in `raw`, whose sockets the writer takes in one call; `rest`:
    (call, frames joined) for the others (a slow client, a response not attached yet), written
    through `_write`, or (call, None) where a whole response has nothing to write (its time is
    still recorded). Made at `gen`: it stays true until something bumps the frontend's `gen`
    (a client gone, a backlog begun, a transport left holding bytes, a handler that let its fd
    go)."""

    __slots__ = ("gen", "fds", "datas", "raw", "rest")

    def __init__(self, gen: int) -> None:
        self.gen = gen
        self.fds: list[int] = []
        self.datas: list[bytes] = []
        self.raw: list[Call] = []
        self.rest: list[tuple[Call, bytes | None]] = []


class _Track:
    """What the server keeps about a live engine request (HTTP or background workload)."""

    __slots__ = ("arrival", "prompt_len", "admitted", "first", "last", "n_out", "choice")

    def __init__(self, arrival: float, prompt_len: int, choice: Choice | None) -> None:
        self.arrival, self.prompt_len, self.choice = arrival, prompt_len, choice
        self.admitted = self.first = self.last = None
        self.n_out = 0


class Frontend:
    """The engine on the wall clock, behind the HTTP handlers.

    `engine`: an `Engine` built with events recorded. `lock`: the lock every user of the engine
    takes (the dashboard's). `max_waiting`: answer 503 while this many requests wait.
    `record_timing`: keep every token's send lateness and each call's token times (for
    `servesim bench serve`). `trim_events`: drop the engine's events once read (all but the
    last, which a run of decode steps may still extend), so a server that runs for days holds
    only what is in flight; only when nothing else reads the engine's event list.
    `send_threads`: 2 writes each step's frames from two threads (`PairWriter`), 1 from the
    loop's alone (`RawWriter`)."""

    def __init__(self, engine, *, model_name: str, speed: float = 1.0, lock=None,
                 max_waiting: int | None = None, record_timing: bool = False,
                 trim_events: bool = False, send_threads: int = 1) -> None:
        if not engine.record_events:
            raise ServesimError("serve: the engine must record events")
        self.engine = engine
        sc = engine.scenario
        self.model_name = model_name
        self.max_model_len = sc.model.max_model_len
        self.max_num_seqs = sc.scheduler.max_num_seqs
        self.vocab_size = sc.compute.vocab_size
        self.real_compute = engine.executor is not None
        self.max_waiting = max_waiting
        self.lock = lock if lock is not None else threading.RLock()
        self.clock = SimClock(engine.now, speed)
        self.error: str | None = None
        self.metrics = ServeMetrics(model_name, self.max_model_len, self._read_gauges)
        self.prompt_tokens = 0
        self._pending: collections.deque[Call] = collections.deque()
        self._tracks: dict[int, _Track] = {}
        self._due: dict[float, _Due] = {}
        self._due_times: list[float] = []
        self._dirty: list[float] = []  # instants with something not built yet
        self._event_i = len(engine.events)
        self._open_steps = None  # the last `steps` event read, which may still grow
        self._open_n = 0
        self._waiter: asyncio.Future | None = None
        self._task: asyncio.Task | None = None
        self.send_threads = send_threads
        self._writer: RawWriter | PairWriter | None = None
        # bumped by what can make a prepared pass wrong (see `_Prepared`)
        self.gen = 0
        self.record_timing = record_timing
        self.trim_events = trim_events
        self.lateness = array("d")         # wall seconds each token left after its time
        # per send pass: how late it began, how long it took (wall seconds), calls written,
        # whether it went out as prepared at the build (1.0) or was prepared at its time (0.0)
        self.passes = array("d")
        self.timings: list[dict] = []      # per finished call: arrival and token times

    # --- for the HTTP handlers ----------------------------------------------------------------
    def check(self, spec: GenerateSpec) -> None:
        """What can be refused before the engine sees a request. Raises APIError."""
        if self.error:
            raise self._stopped()
        if spec.model is not None and spec.model != self.model_name:
            raise APIError(f"The model `{spec.model}` does not exist.", HTTPStatus.NOT_FOUND,
                           param="model")
        if spec.n > self.max_num_seqs:
            raise APIError(f"n = {spec.n} is larger than max_num_seqs = {self.max_num_seqs}: "
                           "the samples could never run together", param="n")
        k = spec.num_sequences
        if self.max_waiting is not None and k > self.max_num_seqs + self.max_waiting:
            raise APIError(f"{len(spec.prompts):,} prompts x n = {spec.n} is {k:,} sequences: "
                           f"more than max_num_seqs = {self.max_num_seqs} running and "
                           f"--max-waiting {self.max_waiting} waiting could ever hold",
                           param="prompt" if spec.n == 1 else "n")
        limit = self.max_model_len
        for p in spec.prompts:
            if limit and p.num_tokens >= limit:
                raise APIError(
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"request has {p.num_tokens} input tokens. Please reduce the length of the "
                    "input messages.", param="input_tokens")
            if limit and spec.max_tokens is not None and p.num_tokens + spec.max_tokens > limit:
                raise APIError(
                    f"'max_tokens' or 'max_completion_tokens' is too large: {spec.max_tokens}. "
                    f"This model's maximum context length is {limit} tokens and your request "
                    f"has {p.num_tokens} input tokens ({spec.max_tokens} > {limit} - "
                    f"{p.num_tokens}).", param="max_tokens")
            if limit and spec.max_tokens is None and spec.min_tokens > limit - p.num_tokens:
                # (vLLM's default max_tokens is what the context leaves: min_tokens above it
                # is refused, not cut)
                raise APIError(f"min_tokens must be less than or equal to max_tokens="
                               f"{limit - p.num_tokens}, got {spec.min_tokens}.",
                               param="min_tokens")
            if self.real_compute and p.text is None:
                raise APIError(f"Token ids must be below the vocabulary size "
                               f"({self.vocab_size}) of the tiny model", param="prompt")
            if spec.max_tokens is not None or spec.ignore_eos:  # (else drawn when injected)
                err = self._too_big(spec, p.num_tokens, self._output_len(spec, p.num_tokens)[0])
                if err is not None:
                    raise err

    def _too_big(self, spec: GenerateSpec, prompt_len: int, out: int) -> APIError | None:
        """The refusal of a sequence whose prompt and output could never fit in the KV cache
        (the engine would reject it: `out - 1` output tokens are ever held), naming what to
        shorten; None when it fits."""
        bs, pool = self.engine.scenario.kv.block_size, self.engine.kv.num_blocks
        blocks = arrival_blocks(self.engine, prompt_len, out)  # (the engine's own rule)
        if blocks <= pool:
            return None
        # The tokens a request can hold: the most output that fits with a one-token prompt
        capacity = bisect.bisect_left(range(1, pool * bs + 2), True,
                                      key=lambda n: arrival_blocks(self.engine, 1, n) > pool)
        needs = f"needs {blocks:,} blocks of {bs} tokens"
        if prompt_len > capacity:
            return APIError(f"The request cannot be served: its prompt of {prompt_len:,} tokens "
                            f"{needs} and the KV cache has {pool:,} ({capacity:,} tokens): "
                            "shorten the prompt", param="prompt")
        if spec.max_tokens is not None:
            what = f"'max_tokens' = {out:,}"
        elif spec.ignore_eos:
            what = f"'ignore_eos' without 'max_tokens' ({out:,} output tokens)"
        else:
            what = f"the output length drawn for it ({out:,} tokens; no 'max_tokens')"
        most = bisect.bisect_left(range(1, out), True,
                                  key=lambda n: arrival_blocks(self.engine, prompt_len, n) > pool)
        return APIError(f"The request cannot be served: its prompt of {prompt_len:,} tokens with "
                        f"{what} {needs} and the KV cache has {pool:,} ({capacity:,} tokens): "
                        f"'max_tokens' can be at most {most:,}",
                        param="max_tokens")

    def submit(self, spec: GenerateSpec, tag: str, arrival: float) -> Call:
        """Queue a checked request that arrived at simulated time `arrival`; the pump injects
        it on its next turn. Await `call.accepted` (raises APIError if refused)."""
        call = Call(spec, self.model_name, tag, arrival)
        call.detached = self._bump
        self._pending.append(call)
        self.wake()
        return call

    def _bump(self) -> None:
        self.gen += 1

    def abandon(self, call: Call) -> None:
        """The client went away: cancel its live requests through the engine (their blocks
        are freed, the cancel is logged, as the dashboard's `c` does)."""
        if call.closed:
            return
        call.closed = call.abandoned = True
        self.gen += 1
        call.kick()
        with self.lock:
            for c in call.choices:
                if not c.done:
                    try:
                        self.engine.cancel(c.req_id)
                    except ServesimError:  # it had already ended in the engine
                        pass
        self.wake()

    # --- the pump -----------------------------------------------------------------------------
    def start(self) -> None:
        self._writer = PairWriter() if self.send_threads == 2 else RawWriter()
        self._task = asyncio.get_running_loop().create_task(self.run(), name="servesim-pump")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def run(self) -> None:
        """The pump (see the module docstring); runs until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                self.turn()
            except Exception as err:  # noqa: BLE001 - a bug must not leave clients hanging
                self._crash(err)
            wake_at = min(self.clock.wall_at(self._next_time()), time.monotonic() + MAX_SLEEP_S)
            if wake_at <= time.monotonic():
                await asyncio.sleep(0)  # let the handlers run, then go on
                continue
            self._waiter = fut = loop.create_future()
            handle = loop.call_at(wake_at - WAKE_EARLY_S, _resolve, fut)
            try:
                timer = await fut  # True: the timer, not `wake`
            finally:
                self._waiter = None
                handle.cancel()
            rest = wake_at - time.monotonic()
            if timer and rest > 0:
                time.sleep(rest)

    def turn(self) -> None:
        """One turn of the pump: send what is due, inject, run the engine to now, read events,
        send what became due."""
        self._send_due()
        with self.lock:
            self._apply_pending()
            if not self.error:
                try:
                    self.engine.run_until(self.clock.now(), max_steps=MAX_STEPS)
                except EngineError as e:  # e.g. a stall: shown, and every open call ends
                    # (what ran before it first: a request that finished then ends as it did,
                    # not also with an abort)
                    self._read_events()
                    self._fail(str(e))
            self._read_events()
        self._build()  # ahead of time: the step that ends next was computed just now
        self._send_due()

    def _next_time(self) -> float:
        """The simulated time of the pump's next turn."""
        if self._pending:
            return -math.inf
        t = self._due_times[0] if self._due_times else math.inf
        e = self.engine
        if self.error:
            return t
        if e.policy.has_work():
            return min(t, e.now)  # the next step is decided when the one in flight ends
        return min(t, e.next_event())  # a background arrival

    def _apply_pending(self) -> None:
        """Inject the calls that came in, in order, at most INJECT_SLICE engine requests this
        turn (a call of thousands of sequences goes in over several turns). A call is answered
        (`accepted`) once all of it is in, or when it is refused."""
        pending = self._pending
        budget = INJECT_SLICE
        while pending and budget > 0:
            call = pending[0]
            # (a handler cancelled while it awaited `accepted`, its client gone at once, may not
            # have reached `abandon` yet: its future is done, cancelled, and takes no result)
            if call.abandoned or call.accepted.done():
                pending.popleft()
                if not call.accepted.done():  # (dropped part way in: its handler still waits)
                    call.accepted.set_exception(APIError("the request was aborted while it was "
                                                         "being queued", HTTPStatus.SERVICE_UNAVAILABLE))
                continue
            try:
                if self.error:
                    raise self._stopped()
                budget -= self._inject(call, budget)
            except (APIError, ServesimError) as err:
                pending.popleft()
                self.abandon(call)  # what it had injected goes (cancelled)
                call.accepted.set_exception(err if isinstance(err, APIError)
                                            else APIError(str(err)))
                call.complete = True
                continue
            if call.injected == call.spec.num_sequences:
                pending.popleft()
                call.open -= 1  # (the one held while it was going in)
                call.accepted.set_result(True)

    def _inject(self, call: Call, budget: int) -> int:
        """Inject up to `budget` more of the call's requests, one per prompt and choice, arriving
        when the call arrived (later ones join the queue later, as a real server's fan-out
        does). Returns how many. Raises APIError (or ServesimError) when it is refused."""
        e, spec = self.engine, call.spec
        if call.injected == 0:
            if spec.priority and e.policy.name != "priority":
                raise APIError(f"Got priority {spec.priority} but Priority scheduling is not "
                               f"enabled (policy {e.policy.name!r}).", param="priority")
            if self.max_waiting is not None and len(e.policy.waiting) >= self.max_waiting:
                raise APIError(f"The server is overloaded: {len(e.policy.waiting)} requests are "
                               f"waiting (--max-waiting {self.max_waiting})",
                               HTTPStatus.SERVICE_UNAVAILABLE)
            e.run_until(call.arrival)  # the engine at (or past) the arrival: it joins from there
            # Every choice's output length now, drawn in order as if all went in at once, and
            # checked against the pool before any goes in: a call is refused whole (as vLLM
            # refuses a request before adding it), never after part of it ran.
            call.outs = [self._output_len(spec, spec.prompts[i // spec.n].num_tokens, ahead=i)
                         for i in range(spec.num_sequences)]
            for i, (out, _) in enumerate(call.outs):
                err = self._too_big(spec, spec.prompts[i // spec.n].num_tokens, out)
                if err is not None:
                    raise err
            call.open = 1  # held while it goes in: its first choices may end before its last
        before, first = len(e.events), call.injected
        stop = min(first + budget, spec.num_sequences)
        arrival = min(call.arrival, e.now)
        for i in range(first, stop):
            prompt = spec.prompts[i // spec.n]
            out, reason = call.outs[i]
            [rid] = e.inject(prompt.num_tokens, out, priority=spec.priority,
                             prompt_text=prompt.text, arrival_time=arrival, tag=call.tag)
            choice = Choice(call, len(call.choices), rid, reason, self.real_compute)
            if self.record_timing and choice.index == 0:
                choice.times = []
            call.choices.append(choice)
            call.injected += 1
            call.open += 1
            self._tracks[rid] = _Track(arrival, prompt.num_tokens, choice)
        # (`_too_big` checked the engine's own rule: a rejection here is a bug, refused all the
        # same)
        rejected = [ev for ev in e.events[before:] if ev.kind == "reject"]
        if rejected:  # (admission control's refusals, `[admission]`, are 429s)
            busy = is_refusal(rejected[0].reason)
            raise APIError(f"The request cannot be served: {rejected[0].reason}",
                           HTTPStatus.TOO_MANY_REQUESTS if busy else HTTPStatus.BAD_REQUEST,
                           err_type="RateLimitError" if busy else None)
        return stop - first

    def _output_len(self, spec: GenerateSpec, prompt_len: int, ahead: int = 0) -> tuple[int, str]:
        """The output length of one choice and why it ends: `max_tokens` ("length"); without
        it, drawn from the scenario's workload (the model's end of sequence: "stop"; the draw
        of the engine's injected request number `ahead` from now), at least `min_tokens`; with
        `ignore_eos`, up to the context length."""
        limit = self.max_model_len - prompt_len if self.max_model_len else None
        if spec.max_tokens is not None:
            return spec.max_tokens, "length"
        if spec.ignore_eos and limit is not None:
            return limit, "length"
        sc = self.engine.scenario
        rng = np.random.default_rng([sc.seed, SERVE_STREAM, self.engine.counts["injected"] + ahead])
        out = max(int(sample_lengths(sc, 1, rng)[1][0]), spec.min_tokens, 1)
        if limit is not None and out >= limit:
            return limit, "length"
        return out, "stop"

    def _stopped(self) -> APIError:
        """The refusal of a call once the engine has stopped (500)."""
        return APIError(f"the engine stopped: {self.error}", HTTPStatus.INTERNAL_SERVER_ERROR)

    def _crash(self, err: Exception) -> None:
        """An unexpected error in the pump: say so on stderr and in /health, and end every
        open call now (a stream gets an `abort` frame where it can), refusing new ones."""
        if self.error is None:
            self.error = f"{type(err).__name__}: {err}"
            print(f"servesim serve: the engine stopped: {self.error}", file=sys.stderr)
        self._end_all()

    def shutdown(self) -> None:
        """The server is stopping (SIGINT, SIGTERM, `q`): every open call ends now, a stream
        with an `abort` frame and `[DONE]` as vLLM's do on shutdown, and new ones are refused;
        nothing waits for tokens that will not come."""
        if self.error is None:
            self.error = "the server is shutting down"
        self._end_all()

    def _end_all(self) -> None:
        """End every open call now (a stream gets an `abort` frame where it can) and refuse
        the calls still waiting to go in."""
        calls = {tr.choice.call for tr in self._tracks.values() if tr.choice is not None}
        unsent = set()  # choices whose end frame was built, not sent
        for due in self._due.values():
            calls.update(c.call for c in due.choices)
            calls.update(c.call for c in due.ends)
            unsent.update(due.fin)
        self._tracks.clear()
        self._due.clear()
        self._due_times.clear()
        self._dirty.clear()
        for call in calls:
            if call.complete:
                continue
            for c in call.choices:
                if not c.done or c in unsent:
                    c.done, c.reason = True, "abort"
                    if call.writer is not None:
                        self._write(call, call.writer.token(c.index, "", "abort"))
            if call.writer is not None:
                self._write(call, DONE)
            call.complete = True
            call.kick()
            if not call.done.done():
                call.done.set_result(None)
        for call in self._pending:
            if not call.accepted.done():
                call.accepted.set_exception(self._stopped())
        self._pending.clear()

    def _fail(self, message: str) -> None:
        """The engine stopped (an EngineError): one line on stderr; every open call ends with
        `abort`, and later ones are refused (500, /health 503)."""
        if self.error is None:
            print(f"servesim serve: the engine stopped: {message}", file=sys.stderr, flush=True)
        self.error = message
        for tr in self._tracks.values():
            c = tr.choice
            if c is not None and not c.done:
                self._due_at(self.engine.now).ends[c] = "abort"

    # --- events -> token times ----------------------------------------------------------------
    def unread_events(self) -> int:
        """Events at the end of the engine's list not read yet (the lock held)."""
        return len(self.engine.events) - self._event_i

    def events_moved(self, n: int) -> None:
        """`n` read events were taken from the start of the engine's list (a dashboard's
        spool; the lock held)."""
        self._event_i -= n

    def _read_events(self) -> None:
        events = self.engine.events
        itl: list[float] = []
        ttft: list[float] = []
        # A decode run's `steps` event grows in place while the run goes on.
        open_ = self._open_steps
        if open_ is not None and len(open_.ends) > self._open_n:
            self._steps(open_, self._open_n, itl, ttft)
            self._open_n = len(open_.ends)
        tracks = self._tracks
        for ev in events[self._event_i:]:
            kind = ev.kind
            if kind == "steps":
                self._steps(ev, 0, itl, ttft)
                self._open_steps, self._open_n = ev, len(ev.ends)
            elif kind == "arrival":
                if ev.req_id not in tracks:
                    tracks[ev.req_id] = _Track(ev.t, ev.prompt_len, None)
            elif kind == "admit":
                tr = tracks.get(ev.req_id)
                if tr is not None and tr.admitted is None:
                    tr.admitted = ev.t
            elif kind == "reject":  # (an HTTP call's rejections were answered when injected)
                tracks.pop(ev.req_id, None)
            elif kind == "finish" or kind == "cancel":
                tr = tracks.pop(ev.req_id, None)
                if tr is None:
                    continue
                c = tr.choice
                reason = "abort" if kind == "cancel" else (c.reason if c else "stop")
                self.metrics.observe_finished(reason, tr.arrival, tr.admitted, tr.first, ev.t,
                                              tr.prompt_len, tr.n_out)
                if c is not None:
                    self._due_at(ev.t).ends[c] = reason
        self._event_i = len(events)
        if self.trim_events and len(events) > 1:
            del events[:-1]
            self._event_i = 1
        if ttft:
            self.metrics.ttft.observe(ttft)
        if itl:
            self.metrics.observe_itl(itl)

    def _steps(self, ev, start: int, itl: list, ttft: list) -> None:
        """Tokens of the steps `ev.ends[start:]`: one per decode per step, and one for each
        prefill chunk that completes its request's tokens (its first, or the next after a
        recompute)."""
        tracks = self._tracks
        ends = ev.ends
        ids = ev.tokens
        if start == 0:
            t = float(ends[0])
            for rid, c, n in ev.prefill:
                tr = tracks.get(rid)
                if tr is not None and c + n == tr.prompt_len + tr.n_out:
                    self._token(tr, t, ids[rid][0] if ids else None, itl, ttft)
        times = ends[start:].tolist()
        if not times or not ev.decode:
            return
        # Every decode of the run gets a token at each of `times`: the same buckets, and the
        # same gaps between them, for all of them.
        k = len(times)
        dues = [self._due_at(t) for t in times]
        real = self.real_compute
        t0, t_last = times[0], times[-1]
        itl_append = itl.append
        continued = 0
        for rid in ev.decode:
            tr = tracks.get(rid)
            if tr is None:
                continue
            if tr.n_out == 0:  # (a decode before the first token: the general path)
                for t, tok in zip(times, ids[rid] if ids else [None] * k):
                    self._token(tr, t, tok, itl, ttft)
                continue
            itl_append(t0 - tr.last)
            continued += 1
            tr.n_out += k
            tr.last = t_last
            c = tr.choice
            if c is None:
                continue
            for due in dues:
                due.choices.append(c)
            if real:
                toks = ids[rid] if ids else [-1] * k
                for due, tok in zip(dues, toks):
                    due.toks.append(int(tok))
        if k > 1 and continued:
            itl.extend(np.diff(times).tolist() * continued)

    def _token(self, tr: _Track, t: float, tok, itl: list, ttft: list) -> None:
        tr.n_out += 1
        if tr.n_out == 1:
            tr.first = t
            ttft.append(t - tr.arrival)
            self.prompt_tokens += tr.prompt_len
        else:
            itl.append(t - tr.last)
        tr.last = t
        c = tr.choice
        if c is not None:
            due = self._due_at(t)
            due.choices.append(c)
            if self.real_compute:
                due.toks.append(-1 if tok is None else int(tok))

    def _due_at(self, t: float) -> _Due:
        """What leaves at simulated time `t` (created, and its time queued, when new), to be
        built: the caller adds to it."""
        due = self._due.get(t)
        if due is None:
            self._due[t] = due = _Due()
            heapq.heappush(self._due_times, t)
        if not due.dirty:
            due.dirty = True
            self._dirty.append(t)
        return due

    # --- sending ------------------------------------------------------------------------------
    def _build(self) -> None:
        """Render what is new in every instant, in time order (a token's text, a stream's
        usage and its last frames follow from the tokens before it)."""
        dirty = self._dirty
        if not dirty:
            return
        if len(dirty) > 1:
            dirty.sort()
        dues = self._due
        writer = self._writer
        for t in dirty:
            due = dues.get(t)
            if due is not None and due.dirty:
                due.dirty = False
                self._build_due(t, due)
                if writer is not None and len(due.out) >= writer.MIN_SPLIT:
                    due.prep = self._prepare(due.out)
        dirty.clear()

    def _build_due(self, t: float, due: _Due) -> None:
        """Each new token of `due` (its choice's next text: a frame, or text kept for a whole
        response) and each new end, into `due.out`. A call already closed gets nothing."""
        out, ends, toks, choices = due.out, due.ends, due.toks, due.choices
        real = self.real_compute
        tally = due.tokens if self.record_timing else None
        n_filler = len(FILLER)
        for i in range(due.n_built, len(choices)):
            c = choices[i]
            call = c.call
            if call.closed or c.done:  # (nothing after a choice's end: see the ends below)
                continue
            frames = out.get(call)
            if frames is None:
                out[call] = frames = []
            n = c.n_out = c.n_out + 1
            text = c.text(toks[i]) if real else FILLER[(n - 1) % n_filler]
            if tally is not None:
                tally[call] = tally.get(call, 0) + 1
                if c.times is not None:
                    c.times.append(t)
            if ends and c in ends:
                self._frame(c, text, ends.pop(c), frames, due)
            elif c.tails is not None and n > 1:  # the usual token: mostly shared bytes
                tail = c.tails.get(text)
                frames.append(c.head + tail if tail is not None
                              else call.writer.token(c.index, text))
            elif call.writer is None:
                c.parts.append(text)
            else:
                self._frame(c, text, None, frames, due)
        due.n_built = len(choices)
        if ends:  # ends without a token at this time
            for c, reason in ends.items():
                call = c.call
                # (a choice ends once: after its end its call may be complete, its handler
                # gone and its fd let go, which no pass may then write to)
                if not call.closed and not c.done:
                    frames = out.get(call)
                    if frames is None:
                        out[call] = frames = []
                    self._frame(c, None, reason, frames, due)
            ends.clear()

    def _send_due(self) -> None:
        """Send every token whose time has come, built ahead (`_build`): each call's frames in
        one write (when the pump fell behind, those of several instants: fewer syscalls is
        how it catches up). A call closed since the build gets nothing."""
        if self._dirty:
            self._build()
        clock, dues, times = self.clock, self._due, self._due_times
        now = clock.now()
        if not times or times[0] > now:
            return
        t = heapq.heappop(times)
        ready = [(t, dues.pop(t))]
        while times and times[0] <= now:
            t = heapq.heappop(times)
            ready.append((t, dues.pop(t)))
        prep = None
        if len(ready) == 1:  # the usual pass: one step's tokens, as built
            due = ready[0][1]
            out = due.out
            if due.prep is not None and due.prep.gen == self.gen:
                prep = due.prep
        else:
            out = {}
            for _, due in ready:
                for call, frames in due.out.items():
                    merged = out.get(call)
                    if merged is None:
                        out[call] = list(frames)
                    else:
                        merged.extend(frames)
        write = self._write
        record = self.record_timing
        stamps: list[tuple[Call, float]] = []  # when each call's frames left (record_timing)
        start = time.monotonic() if record else 0.0
        if self._writer is not None and len(out) >= self._writer.MIN_SPLIT:
            self._send_prepared(prep if prep is not None else self._prepare(out),
                                stamps if record else None)
        elif not record:
            for call, frames in out.items():
                if frames and not call.closed:
                    write(call, frames[0] if len(frames) == 1 else b"".join(frames))
        else:
            for call, frames in out.items():
                if call.closed:
                    continue
                if frames:
                    write(call, frames[0] if len(frames) == 1 else b"".join(frames))
                stamps.append((call, time.monotonic()))
        if record:
            lateness = self.lateness
            walls = [(clock.wall_at(t), due.tokens) for t, due in ready]
            self.passes.extend((start - walls[0][0], time.monotonic() - start, len(out),
                                float(prep is not None)))
            for call, sent_at in stamps:
                for wall, tokens in walls:
                    k = tokens.get(call)
                    if k:
                        lateness.extend([sent_at - wall] * k)
                if call.first_sent is None:
                    call.first_sent = sent_at
        for _, due in ready:
            for call in due.ended:
                if call.closed:
                    continue
                if self.record_timing:
                    self._record(call)
                call.complete = True
                call.kick()
                if not call.done.done():
                    call.done.set_result(None)

    def _prepare(self, out: dict) -> _Prepared:
        """`out`'s writes made ready (`_Prepared`): a call whose socket's transport holds
        nothing and which nothing else writes to takes its frames in the writer's one call."""
        p = _Prepared(self.gen)
        fds, datas, raw, rest = p.fds, p.datas, p.raw, p.rest
        for call, frames in out.items():
            if call.closed:
                continue
            if not frames:  # (a whole response: nothing to write, its time still recorded)
                rest.append((call, None))
                continue
            data = frames[0] if len(frames) == 1 else b"".join(frames)
            tr = call.transport
            if (call.fd >= 0 and not call.backlog and call.resp is not None
                    and not tr.get_write_buffer_size() and not tr.is_closing()):
                fds.append(call.fd)
                datas.append(_chunk(data) if call.chunked else data)
                raw.append(call)
            else:
                rest.append((call, data))
        return p

    def _send_prepared(self, p: _Prepared, stamps: list | None) -> None:
        """A prepared pass: the raw writes in one call of the writer (`RawWriter`, or
        `PairWriter`'s two threads), then what a socket did not take through its transport, in
        order, then the other calls through `_write`."""
        times: list[float] = []
        writer = self._writer
        assert writer is not None
        sent = writer.write_all(p.fds, p.datas, times if stamps is not None else None) \
            if p.fds else []
        datas = p.datas
        for i, call in enumerate(p.raw):
            n, data = sent[i], datas[i]
            if n != len(data):
                tr = call.transport
                if tr.is_closing():  # the client is gone
                    self.abandon(call)
                    continue
                # the rest waits in its transport (or meets the error there)
                tr.write(data[n:] if n > 0 else data)
                self.gen += 1
            if stamps is not None:
                stamps.append((call, times[i]))
        write = self._write
        for call, rest in p.rest:
            if call.closed:
                continue
            if rest is not None:
                write(call, rest)
            if stamps is not None:
                stamps.append((call, time.monotonic()))

    def _frame(self, c: Choice, text: str | None, reason: str | None, frames: list[bytes],
               due: _Due) -> None:
        """Choice `c`'s token `text` (None: no token) and, with `reason`, its end: the frames
        they make (a chat's role first; the finish reason in the token's frame; after the
        call's last choice, its usage and [DONE]), or the text kept for a whole response."""
        call = c.call
        if reason is not None:
            c.done = True
            due.fin.append(c)
            if reason == "abort":
                c.reason = "abort"
            call.open -= 1
        w = call.writer
        if w is None:
            if text is not None:
                c.parts.append(text)
        else:
            if text is not None and c.n_out == 1 and w.chat:
                frames.append(w.role(c.index))
            frames.append(w.token(c.index, text or "", c.reason if reason else None,
                                  call.usage() if call.spec.continuous_usage else None))
        if reason is not None and call.open == 0:
            self._end(call, frames)
            due.ended.append(call)

    def _end(self, call: Call, frames: list[bytes]) -> None:
        if call.writer is not None:
            if call.spec.include_usage:
                frames.append(call.writer.usage(call.usage()))
            frames.append(DONE)

    def _write(self, call: Call, data: bytes) -> None:
        """Write now, unless the client is slow (its socket buffer is filling) or its response
        is not attached yet: then its handler writes it, in order, with flow control.

        The frame goes to the transport directly, framed as the HTTP/1.1 chunk that aiohttp's
        `write` would make (the response's headers went out at `prepare`; nothing else is
        written in between): a token is then one small syscall, where aiohttp's two coroutine
        layers cost about as much again, and a step of 500 decodes is 500 of them."""
        tr = call.transport
        if (call.backlog or tr is None or call.resp is None
                or tr.get_write_buffer_size() > WRITE_LIMIT):
            call.backlog.append(data)
            call.backlog_bytes += len(data)
            self.gen += 1
            # (Only a client with its response can be the slow one: before that, frames wait for
            # the rest of a call still going in, or for its handler, a pump turn away, and only a
            # runaway, at a high speed, meets the larger bound.)
            limit = MAX_BACKLOG if call.resp is not None else MAX_BACKLOG_UNANSWERED
            if call.backlog_bytes + (tr.get_write_buffer_size() if tr else 0) > limit:
                self._drop(call)
                return
            call.kick()
            return
        if tr.is_closing():
            self.abandon(call)
            return
        tr.write(_chunk(data) if call.chunked else data)
        if tr.get_write_buffer_size():  # a raw write now would overtake what it holds
            self.gen += 1

    def _drop(self, call: Call) -> None:
        """A stream whose client has stopped reading holds MAX_BACKLOG unsent: its requests are
        aborted in the engine (their blocks freed, counted as `abort`, as vLLM counts a request
        aborted for its client) and its connection closed."""
        call.backlog.clear()
        call.backlog_bytes = 0
        for c in call.choices:
            if not c.done:
                c.reason = "abort"
        why = (f"over {MAX_BACKLOG >> 20} MiB unsent (the client is not reading)" if call.resp is not None
               else f"over {MAX_BACKLOG_UNANSWERED >> 20} MiB made before its response could start")
        print(f"servesim serve: {call.tag}: stream {call.rid} aborted: {why}", file=sys.stderr, flush=True)
        self.abandon(call)
        if call.transport is not None:
            call.transport.abort()

    def _record(self, call: Call) -> None:
        c = call.choices[0]
        if c.times is not None:
            # (wall times: where a request's TTFT goes outside the engine)
            self.timings.append({"id": call.rid, "arrival": call.arrival, "tokens": c.times,
                                 "arrival_wall": self.clock.wall_at(call.arrival),
                                 "first_sent": call.first_sent})

    # --- /metrics -----------------------------------------------------------------------------
    def _read_gauges(self) -> dict:
        with self.lock:
            e = self.engine
            kv = e.kv
            return {
                "running": len(e.policy.running), "waiting": len(e.policy.waiting),
                "kv_usage": kv.num_used_blocks / kv.num_blocks if kv.num_blocks else 0.0,
                "prefix_queries": kv.query_tokens, "prefix_hits": kv.hit_tokens,
                "preemptions": e.counts["preemptions"], "prompt_tokens": self.prompt_tokens,
                "generation_tokens": e.counts["output_tokens"],
            }

    def timing_summary(self) -> dict:
        """Send lateness percentiles (ms) and the calls' token times (record_timing)."""
        late = np.frombuffer(self.lateness, dtype=np.float64) if self.lateness else np.zeros(0)
        pct = (lambda q: float(np.percentile(late, q)) * 1e3) if len(late) else (lambda q: None)
        passes = np.frombuffer(self.passes, dtype=np.float64).reshape(-1, 4)
        passes = passes[passes[:, 2] > 1]  # those that wrote to several calls
        pq = (lambda a, q: float(np.percentile(a, q)) * 1e3) if len(passes) else \
            (lambda a, q: None)
        return {"sends": len(late), "lateness_ms": {"p50": pct(50), "p99": pct(99),
                                                    "max": pct(100)},
                "passes": {"count": len(passes),
                           "calls_mean": float(passes[:, 2].mean()) if len(passes) else None,
                           "prepared_ahead": float(passes[:, 3].mean()) if len(passes) else None,
                           "start_late_ms": {"p50": pq(passes[:, 0], 50),
                                             "p99": pq(passes[:, 0], 99),
                                             "max": pq(passes[:, 0], 100)},
                           "duration_ms": {"p50": pq(passes[:, 1], 50),
                                           "p99": pq(passes[:, 1], 99),
                                           "max": pq(passes[:, 1], 100)}},
                "calls": self.timings}


def _chunk(data: bytes) -> bytes:
    """`data` as one HTTP/1.1 chunk (what aiohttp's `write` makes of it)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(True)
