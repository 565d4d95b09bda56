"""The server's side of the engine: runs it on the wall clock, injects HTTP requests into it,
learns each token's time from its events, and sends every token when the simulated clock
reaches that time.

One coroutine, the pump, owns the engine (all in the event loop's thread, under the engine lock
the dashboard shares). Each turn it sends the tokens that are due, applies the requests that came
in (each injected with the time it arrived: a request that arrives while a step runs joins the
queue at that step's end, as in a real engine), runs the engine up to the present (the last step
it starts ends in the future: its tokens' times are then known), reads the new events, and
sleeps until the next token is due or the next step is to be decided.

The engine's public API only: `inject` (with `arrival_time` and `tag`), `cancel`, `run_until`,
`next_event`, `events`; finished requests are learned from events, never looked up.
"""

from __future__ import annotations

import asyncio
import codecs
import heapq
import math
import sys
import threading
import time
import uuid
from array import array
from http import HTTPStatus

import numpy as np

from sim import EngineError, ServesimError
from sim.workload import sample_lengths
from tui.serve.metrics import ServeMetrics
from tui.serve.protocol import (DONE, FILLER, APIError, ChunkWriter, GenerateSpec, chat_body,
                            completion_body, created_now, usage)

SERVE_STREAM = 0x5E  # seed stream of output lengths drawn for requests without max_tokens
WRITE_LIMIT = 32 * 1024  # above this many unsent bytes a client is slow: its own task writes
MAX_STEPS = 256  # engine steps per pump turn, so that sends and requests are not held up
# The pump looks at least this often (wall seconds), whatever else changed the engine.
MAX_SLEEP_S = 0.1


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
        self.transport = None
        self.chunked = False
        self.backlog: list[bytes] = []
        # What a pass of the pump sends it: frames, the wall time each token was due.
        self.frames: list[bytes] = []
        self.walls: list[float] = []
        self.mark = -1  # the last pass that sent it something
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
        loop = asyncio.get_running_loop()
        while True:
            while self.backlog:
                data = b"".join(self.backlog)
                self.backlog.clear()
                await resp.write(data)
            if self.complete:
                break
            self._kick = loop.create_future()
            await self._kick
        await resp.write_eof()


class _Due:
    """What leaves at one simulated time: a token for each of `choices` (with real compute,
    the token ids in `toks`, in step), then `ends` (choice -> finish reason): an end folds into
    its choice's token frame at that time, or has a frame of its own. One per engine step, not
    per token: a step of 500 decodes is 500 appends and one heap entry."""

    __slots__ = ("choices", "toks", "ends")

    def __init__(self) -> None:
        self.choices: list[Choice] = []
        self.toks: list[int] = []
        self.ends: dict[Choice, str] = {}


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
    only what is in flight; only when nothing else reads the engine's event list."""

    def __init__(self, engine, *, model_name: str, speed: float = 1.0, lock=None,
                 max_waiting: int | None = None, record_timing: bool = False,
                 trim_events: bool = False) -> None:
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
        self._pending: list[Call] = []
        self._tracks: dict[int, _Track] = {}
        self._due: dict[float, _Due] = {}
        self._due_times: list[float] = []
        self._pass = 0
        self._event_i = len(engine.events)
        self._open_steps = None  # the last `steps` event read, which may still grow
        self._open_n = 0
        self._waiter: asyncio.Future | None = None
        self._task: asyncio.Task | None = None
        self.record_timing = record_timing
        self.trim_events = trim_events
        self.lateness = array("d")         # wall seconds each token left after its time
        self.timings: list[dict] = []      # per finished call: arrival and token times

    # --- for the HTTP handlers ----------------------------------------------------------------
    def check(self, spec: GenerateSpec) -> None:
        """What can be refused before the engine sees a request. Raises APIError."""
        if self.error:
            raise APIError(f"the engine stopped: {self.error}",
                           HTTPStatus.INTERNAL_SERVER_ERROR)
        if spec.model is not None and spec.model != self.model_name:
            raise APIError(f"The model `{spec.model}` does not exist.", HTTPStatus.NOT_FOUND,
                           param="model")
        if spec.n > self.max_num_seqs:
            raise APIError(f"n = {spec.n} is larger than max_num_seqs = {self.max_num_seqs}: "
                           "the samples could never run together", param="n")
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
            if self.real_compute and p.text is None:
                raise APIError(f"Token ids must be below the vocabulary size "
                               f"({self.vocab_size}) of the tiny model", param="prompt")

    def submit(self, spec: GenerateSpec, tag: str, arrival: float) -> Call:
        """Queue a checked request that arrived at simulated time `arrival`; the pump injects
        it on its next turn. Await `call.accepted` (raises APIError if refused)."""
        call = Call(spec, self.model_name, tag, arrival)
        self._pending.append(call)
        self.wake()
        return call

    def abandon(self, call: Call) -> None:
        """The client went away: cancel its live requests through the engine (their blocks
        are freed, the cancel is logged, as the dashboard's `c` does)."""
        if call.closed:
            return
        call.closed = call.abandoned = True
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
        self._task = asyncio.get_running_loop().create_task(self.run(), name="servesim-pump")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

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
            handle = loop.call_at(wake_at, _resolve, fut)
            try:
                await fut
            finally:
                self._waiter = None
                handle.cancel()

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
                    self._fail(str(e))
            self._read_events()
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
        pending, self._pending = self._pending, []
        for call in pending:
            if call.abandoned:
                continue
            if self.error:
                call.accepted.set_exception(APIError(f"the engine stopped: {self.error}",
                                                     HTTPStatus.INTERNAL_SERVER_ERROR))
                continue
            try:
                self._inject(call)
            except APIError as err:
                call.accepted.set_exception(err)
                call.complete = True
                continue
            except ServesimError as err:
                call.accepted.set_exception(APIError(str(err)))
                call.complete = True
                continue
            call.accepted.set_result(True)

    def _inject(self, call: Call) -> None:
        """Inject one request per prompt and choice, arriving when the call arrived."""
        e, spec = self.engine, call.spec
        if spec.priority and e.policy.name != "priority":
            raise APIError(f"Got priority {spec.priority} but Priority scheduling is not "
                           f"enabled (policy {e.policy.name!r}).", param="priority")
        if self.max_waiting is not None and len(e.policy.waiting) >= self.max_waiting:
            raise APIError(f"The server is overloaded: {len(e.policy.waiting)} requests are "
                           f"waiting (--max-waiting {self.max_waiting})",
                           HTTPStatus.SERVICE_UNAVAILABLE)
        e.run_until(call.arrival)  # the engine at (or past) the arrival: it joins from there
        before = len(e.events)
        ids = []
        for prompt in spec.prompts:
            for _ in range(spec.n):
                out, reason = self._output_len(spec, prompt.num_tokens)
                [rid] = e.inject(prompt.num_tokens, out, priority=spec.priority,
                                 prompt_text=prompt.text, arrival_time=min(call.arrival, e.now),
                                 tag=call.tag)
                choice = Choice(call, len(call.choices), rid, reason, self.real_compute)
                if self.record_timing and choice.index == 0:
                    choice.times = []
                call.choices.append(choice)
                ids.append(rid)
        rejected = [ev for ev in e.events[before:] if ev.kind == "reject"]
        if rejected:
            for c in call.choices:
                if c.req_id not in {r.req_id for r in rejected}:
                    e.cancel(c.req_id)
            raise APIError(f"The request cannot be served: {rejected[0].reason}")
        call.open = len(call.choices)
        arrival = min(call.arrival, e.now)
        for c in call.choices:
            self._tracks[c.req_id] = _Track(arrival, spec.prompts[c.index // spec.n].num_tokens,
                                            c)

    def _output_len(self, spec: GenerateSpec, prompt_len: int) -> tuple[int, str]:
        """The output length of one choice and why it ends: `max_tokens` ("length"); without
        it, drawn from the scenario's workload (the model's end of sequence: "stop"), at least
        `min_tokens`; with `ignore_eos`, up to the context length."""
        limit = self.max_model_len - prompt_len if self.max_model_len else None
        if spec.max_tokens is not None:
            return spec.max_tokens, "length"
        if spec.ignore_eos and limit is not None:
            return limit, "length"
        sc = self.engine.scenario
        rng = np.random.default_rng([sc.seed, SERVE_STREAM, self.engine.counts["injected"]])
        out = max(int(sample_lengths(sc, 1, rng)[1][0]), spec.min_tokens, 1)
        if limit is not None and out >= limit:
            return limit, "length"
        return out, "stop"

    def _crash(self, err: Exception) -> None:
        """An unexpected error in the pump: say so on stderr and in /health, and end every
        open call now (a stream gets an `abort` frame where it can), refusing new ones."""
        if self.error is None:
            self.error = f"{type(err).__name__}: {err}"
            print(f"servesim serve: the engine stopped: {self.error}", file=sys.stderr)
        calls = {tr.choice.call for tr in self._tracks.values() if tr.choice is not None}
        for due in self._due.values():
            calls.update(c.call for c in due.choices)
            calls.update(c.call for c in due.ends)
        self._tracks.clear()
        self._due.clear()
        self._due_times.clear()
        for call in calls:
            if call.complete:
                continue
            for c in call.choices:
                if not c.done:
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
                call.accepted.set_exception(APIError(
                    f"the engine stopped: {self.error}", HTTPStatus.INTERNAL_SERVER_ERROR))
        self._pending.clear()

    def _fail(self, message: str) -> None:
        self.error = message
        for tr in self._tracks.values():
            c = tr.choice
            if c is not None and not c.done:
                self._due_at(self.engine.now).ends[c] = "abort"

    # --- events -> token times ----------------------------------------------------------------
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
        """What leaves at simulated time `t` (created, and its time queued, when new)."""
        due = self._due.get(t)
        if due is None:
            self._due[t] = due = _Due()
            heapq.heappush(self._due_times, t)
        return due

    # --- sending ------------------------------------------------------------------------------
    def _send_due(self) -> None:
        """Send every token whose time has come: each call's frames in one write (when the
        pump fell behind, those of several instants: fewer syscalls is how it catches up)."""
        clock, dues, times = self.clock, self._due, self._due_times
        now = clock.now()
        if not times or times[0] > now:
            return
        self._pass = mark = self._pass + 1
        sent: list[Call] = []  # each call sent something in this pass, once
        ended: list[Call] = []
        real, record = self.real_compute, self.record_timing
        n_filler = len(FILLER)
        while times and times[0] <= now:
            t = heapq.heappop(times)
            due = dues.pop(t)
            wall_t = clock.wall_at(t)
            ends = due.ends
            toks = due.toks
            for i, c in enumerate(due.choices):
                call = c.call
                if call.closed:
                    continue
                if call.mark != mark:
                    call.mark = mark
                    sent.append(call)
                n = c.n_out = c.n_out + 1
                text = c.text(toks[i]) if real else FILLER[(n - 1) % n_filler]
                if record:
                    call.walls.append(wall_t)
                    if c.times is not None:
                        c.times.append(t)
                if ends and c in ends:
                    self._frame(c, text, ends.pop(c), call.frames, ended)
                elif c.tails is not None and n > 1:  # the usual token: mostly shared bytes
                    tail = c.tails.get(text)
                    call.frames.append(c.head + tail if tail is not None
                                       else call.writer.token(c.index, text))
                elif call.writer is None:
                    c.parts.append(text)
                else:
                    self._frame(c, text, None, call.frames, ended)
            for c, reason in ends.items():  # ends without a token at this time
                call = c.call
                if not call.closed:
                    if call.mark != mark:
                        call.mark = mark
                        sent.append(call)
                    self._frame(c, None, reason, call.frames, ended)
        lateness = self.lateness
        for call in sent:
            frames = call.frames
            if frames:
                self._write(call, frames[0] if len(frames) == 1 else b"".join(frames))
                frames.clear()
            walls = call.walls
            if walls:
                sent_at = time.monotonic()
                if len(walls) == 1:
                    lateness.append(sent_at - walls[0])
                else:
                    lateness.extend([sent_at - w for w in walls])
                walls.clear()
        for call in ended:
            if record:
                self._record(call)
            call.complete = True
            call.kick()
            if not call.done.done():
                call.done.set_result(None)

    def _frame(self, c: Choice, text: str | None, reason: str | None, frames: list[bytes],
               ended: list[Call]) -> None:
        """Choice `c`'s token `text` (None: no token) and, with `reason`, its end: the frames
        they make (a chat's role first; the finish reason in the token's frame; after the
        call's last choice, its usage and [DONE]), or the text kept for a whole response."""
        call = c.call
        if reason is not None:
            c.done = True
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
            ended.append(call)

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
            call.kick()
            return
        if tr.is_closing():
            self.abandon(call)
            return
        tr.write(b"%x\r\n%b\r\n" % (len(data), data) if call.chunked else data)

    def _record(self, call: Call) -> None:
        c = call.choices[0]
        if c.times is not None:
            self.timings.append({"id": call.rid, "arrival": call.arrival, "tokens": c.times})

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
        return {"sends": len(late), "lateness_ms": {"p50": pct(50), "p99": pct(99),
                                                    "max": pct(100)},
                "calls": self.timings}


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
