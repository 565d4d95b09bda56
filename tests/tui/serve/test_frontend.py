"""The pump's sending driven by hand: the simulated clock set step by step, stand-in
transports in place of sockets. What a step's tokens become is built when its events are read
(before its time), and what happens between that build and the send."""

from __future__ import annotations

import asyncio
import json

import pytest

from sim import Engine, EngineError, load_scenario
from sim.engine.request import RequestState
from tests.helpers import workload_of
from tui.serve import frontend
from tui.serve.app import build_frontend
from tui.serve.protocol import FILLER, APIError, parse_generate


class Sink:
    """A stand-in for a client's transport: keeps what is written, never fills."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closing = False

    def write(self, data: bytes) -> None:
        self.data += data

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return self.closing


def unchunk(data: bytes) -> bytes:
    """The body inside HTTP/1.1 chunks."""
    body, rest = b"", bytes(data)
    while rest:
        size, rest = rest.split(b"\r\n", 1)
        n = int(size, 16)
        body, rest = body + rest[:n], rest[n + 2:]
    return body


def served(body: dict, **kw):
    """A front end paused at simulated time 0 with one streamed call attached to a Sink."""
    fe = build_frontend(load_scenario("chat", []), record_timing=True, **kw)
    fe.clock.set(0.0, paused=True)
    call = fe.submit(parse_generate(body, chat=False), "test", 0.0)
    fe.turn()  # injected
    assert call.accepted.result() is True
    call.resp, call.transport, call.chunked = object(), Sink(), True
    return fe, call


def step(fe) -> float:
    """Move the clock just past the next instant something is due and run a turn (its tokens
    leave, the next step starts); returns that instant."""
    t = fe._due_times[0]
    fe.clock.set(t + 1e-9, paused=True)
    fe.turn()
    return t


def advance(fe) -> None:
    """Move the clock just past the pump's next turn (a token due, a step to decide) and run
    it."""
    t = fe._next_time()
    assert t < float("inf"), "nothing to do"
    fe.clock.set(max(t, fe.clock.now()) + 1e-9, paused=True)
    fe.turn()


def test_a_steps_frames_are_built_when_its_events_are_read_and_sent_unchanged():
    async def main():
        fe, call = served({"prompt": "abc", "max_tokens": 4, "n": 2, "stream": True,
                           "stream_options": {"include_usage": True,
                                              "continuous_usage_stats": True}})
        fe.clock.set(1e-9, paused=True)
        fe.turn()  # the first step starts: its end is in the future
        sent = 0
        while not call.complete:
            t = fe._due_times[0]
            built = b"".join(fe._due[t].out[call])
            assert built and len(unchunk(call.transport.data)) == sent  # built, not sent yet
            step(fe)
            got = unchunk(call.transport.data)
            assert got[sent:] == built  # at its time, exactly what was built
            sent = len(got)
        frames = unchunk(call.transport.data).split(b"\n\n")
        assert frames[-2:] == [b"data: [DONE]", b""]
        chunks = [json.loads(f[len(b"data: "):]) for f in frames[:-2]]
        texts = [[c["choices"][0]["text"] for c in chunks if c["choices"]
                  and c["choices"][0]["index"] == i] for i in (0, 1)]
        assert texts == [list(FILLER[:4])] * 2
        # continuous usage counts the tokens sent before and with each frame
        assert [c["usage"]["completion_tokens"] for c in chunks] == [*range(1, 9), 8]
        assert len(fe.lateness) == 8
    asyncio.run(main())


def test_a_client_gone_between_build_and_send_gets_nothing_more():
    async def main():
        fe, call = served({"prompt": "abc", "max_tokens": 50, "stream": True})
        fe.clock.set(1e-9, paused=True)
        fe.turn()
        step(fe)
        step(fe)
        before = bytes(call.transport.data)
        assert before and fe._due[fe._due_times[0]].out[call]  # the next token is built
        [rid] = [c.req_id for c in call.choices]
        fe.abandon(call)
        fe.clock.set(fe.clock.now() + 1.0, paused=True)  # past what was built
        fe.turn()
        assert not fe._due_times
        assert bytes(call.transport.data) == before
        assert rid not in fe.engine.requests or fe.engine.requests[rid].state.is_done
        assert not fe._tracks  # the engine's cancel was read
    asyncio.run(main())


def test_a_cancel_from_the_dashboard_after_the_build_ends_the_stream_after_the_built_token():
    async def main():
        fe, call = served({"prompt": "abc", "max_tokens": 50, "stream": True,
                           "stream_options": {"include_usage": True}})
        fe.clock.set(1e-9, paused=True)
        fe.turn()
        step(fe)
        step(fe)
        [c] = call.choices
        with fe.lock:
            fe.engine.cancel(c.req_id)  # what `c` on the dashboard does
        for _ in range(5):
            if call.complete:
                break
            step(fe)
        assert call.complete
        frames = unchunk(call.transport.data).split(b"\n\n")
        chunks = [json.loads(f[len(b"data: "):]) for f in frames[:-2]]
        assert frames[-2:] == [b"data: [DONE]", b""]
        texts = [ch["choices"][0]["text"] for ch in chunks if ch["choices"]]
        reasons = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]]
        # every token computed before the cancel, then the end, then the usage
        assert texts[:-1] == list(FILLER[:len(texts) - 1]) and len(texts) >= 3
        assert reasons == [None] * (len(texts) - 1) + ["abort"]
        assert chunks[-1]["choices"] == [] and \
            chunks[-1]["usage"]["completion_tokens"] == len(texts) - (texts[-1] == "")
    asyncio.run(main())


class Buffering(Sink):
    """A transport that never drains: what is written to it waits in its buffer."""

    def get_write_buffer_size(self) -> int:
        return len(self.data)


class HalfWriter:
    """A stand-in writer (`RawWriter`, `PairWriter`) whose sockets take the first half of each write (a full socket
    takes none: the third)."""

    MIN_SPLIT = 1

    def __init__(self) -> None:
        self.took: dict[int, bytes] = {}

    def write_all(self, fds, datas, times=None):
        sent = [0 if i == 2 else len(d) // 2 for i, d in enumerate(datas)]
        for fd, d, n in zip(fds, datas, sent):
            if n:
                self.took[fd] = self.took.get(fd, b"") + d[:n]
        if times is not None:
            times[:] = [1.0] * len(fds)
        return sent


def test_split_writes_hand_what_a_socket_did_not_take_to_its_transport_in_order():
    async def main():
        fe = build_frontend(load_scenario("chat", []), record_timing=True)
        fe.clock.set(0.0, paused=True)
        calls = [fe.submit(parse_generate({"prompt": "ab", "max_tokens": 5, "stream": True},
                                          chat=False), "t", 0.0) for _ in range(4)]
        fe.turn()
        pair = fe._writer = HalfWriter()
        for i, call in enumerate(calls):
            call.resp, call.transport, call.chunked, call.fd = object(), Buffering(), True, 100 + i
        fe.clock.set(1e-9, paused=True)
        fe.turn()
        while not all(c.complete for c in calls):
            step(fe)
        assert sorted(pair.took) == [100, 101, 103] and not calls[0].backlog
        for i, call in enumerate(calls):
            # the socket's part first, then its transport's, which held the rest and all after
            wire = pair.took.get(100 + i, b"") + bytes(call.transport.data)
            frames = unchunk(wire).split(b"\n\n")
            texts = [json.loads(f[len(b"data: "):])["choices"][0]["text"] for f in frames[:-2]]
            assert texts == list(FILLER[:5]) and frames[-2] == b"data: [DONE]"
    asyncio.run(main())


class Recorder(HalfWriter):
    """A stand-in writer whose sockets take everything (kept per fd)."""

    def write_all(self, fds, datas, times=None):
        for fd, d in zip(fds, datas):
            self.took[fd] = self.took.get(fd, b"") + d
        if times is not None:
            times[:] = [1.0] * len(fds)
        return [len(d) for d in datas]


def prepared_calls(n: int, transport=Sink):
    """A front end with `n` streamed calls attached to stand-in transports (fds 100...) and a
    Recorder as its writer, the next step's pass built and prepared."""
    fe = build_frontend(load_scenario("chat", []), record_timing=True)
    fe.clock.set(0.0, paused=True)
    calls = [fe.submit(parse_generate({"prompt": "ab", "max_tokens": 6, "stream": True},
                                      chat=False), "t", 0.0) for _ in range(n)]
    fe.turn()
    fe._writer = Recorder()
    for i, call in enumerate(calls):
        call.resp, call.transport, call.chunked, call.fd = object(), transport(), True, 100 + i
    fe.clock.set(1e-9, paused=True)
    fe.turn()
    step(fe)  # the first tokens (prepared after the attach) went out raw
    due = fe._due[fe._due_times[0]]
    assert due.prep is not None and due.prep.gen == fe.gen and len(due.prep.raw) == n
    return fe, calls


def test_a_prepared_pass_is_sent_as_prepared():
    async def main():
        fe, calls = prepared_calls(4)
        gen, took = fe.gen, dict(fe._writer.took)
        step(fe)
        assert fe.gen == gen
        for i, call in enumerate(calls):  # one more frame each, raw; none via the transport
            new = fe._writer.took[100 + i][len(took[100 + i]):]
            assert unchunk(new).startswith(b"data: {") and not call.transport.data
    asyncio.run(main())


def test_a_client_gone_after_the_pass_was_prepared_gets_nothing():
    async def main():
        fe, calls = prepared_calls(4)
        before = fe._writer.took[101]
        fe.abandon(calls[1])  # after the prepare: the prepared pass is no longer used
        step(fe)
        assert fe._writer.took[101] == before
        assert all(len(fe._writer.took[100 + i]) > len(before) for i in (0, 2, 3))
    asyncio.run(main())


def test_bytes_left_in_a_transport_after_the_prepare_are_not_overtaken():
    """A frame that went through a call's transport and stayed in its buffer (the client is
    slow) after the pass was prepared: that call's next frame must follow it, not go raw."""
    async def main():
        fe, calls = prepared_calls(3, transport=Buffering)
        before = fe._writer.took[102]
        fe._write(calls[2], b"held")  # stays in the transport's buffer
        assert bytes(calls[2].transport.data).endswith(b"held\r\n")
        step(fe)
        assert fe._writer.took[102] == before  # nothing raw after the held bytes
        assert unchunk(bytes(calls[2].transport.data)).startswith(b"helddata: {")
    asyncio.run(main())


def test_an_engine_failure_after_a_finish_ends_that_stream_once_and_writes_nothing_after():
    """The engine raises (a stall) in a run that also finished request A: A ends as it did
    ([DONE] once, no abort after it), and once A is complete no pass writes to its socket
    again (its handler lets the fd go then, and the number may be another connection's)."""
    async def main():
        fe = build_frontend(load_scenario("chat", []), record_timing=True)
        fe.clock.set(0.0, paused=True)
        a, b = (fe.submit(parse_generate({"prompt": "ab", "max_tokens": n, "stream": True},
                                         chat=False), "t", 0.0) for n in (2, 30))
        fe.turn()
        fe._writer = Recorder()
        for i, call in enumerate((a, b)):
            call.resp, call.transport, call.chunked, call.fd = object(), Sink(), True, 100 + i
        fe.clock.set(1e-9, paused=True)
        fe.turn()  # the first step computed: A's first token is due at t1
        t1 = fe._due_times[0]
        run_until = fe.engine.run_until

        def failing(t, max_steps=None):
            run_until(t, max_steps)  # runs past A's finish, then fails
            raise EngineError("engine stalled (simulated)")
        fe.engine.run_until = failing
        fe.clock.set(2.5 * t1, paused=True)
        fe.turn()
        fe.engine.run_until = run_until
        assert fe.error
        sent_at_end = None
        while fe._due_times:
            step(fe)
            if a.complete and sent_at_end is None:
                sent_at_end = len(fe._writer.took.get(100, b""))
        assert a.complete and b.complete
        assert len(fe._writer.took[100]) == sent_at_end  # nothing for A after it completed
        frames = unchunk(fe._writer.took[100]).split(b"\n\n")
        assert frames[-2:] == [b"data: [DONE]", b""] and frames.count(b"data: [DONE]") == 1
        reasons = [json.loads(f[len(b"data: "):])["choices"][0]["finish_reason"]
                   for f in frames[:-2]]
        assert reasons == [None, "length"]  # its real end, not an abort as well
    asyncio.run(main())


def test_a_whole_responses_tokens_are_timed_in_a_prepared_pass():
    """A non-streamed call has nothing to write per token, but its tokens' send times are
    recorded (record_timing) as a streamed call's are, in a pass prepared ahead."""
    async def main():
        fe = build_frontend(load_scenario("chat", []), record_timing=True)
        fe.clock.set(0.0, paused=True)
        s = fe.submit(parse_generate({"prompt": "ab", "max_tokens": 4, "stream": True},
                                     chat=False), "t", 0.0)
        n = fe.submit(parse_generate({"prompt": "ab", "max_tokens": 4}, chat=False), "t", 0.0)
        fe.turn()
        fe._writer = Recorder()
        s.resp, s.transport, s.chunked, s.fd = object(), Sink(), True, 100
        fe.clock.set(1e-9, paused=True)
        fe.turn()
        while not (s.complete and n.complete):
            step(fe)
        assert len(fe.lateness) == 8  # 4 tokens each
        assert [t["first_sent"] is not None for t in fe.timings] == [True, True]
    asyncio.run(main())


def test_a_call_of_thousands_of_sequences_goes_in_over_several_turns_and_ends_whole():
    """prompts x n engine requests are injected INJECT_SLICE a turn (sends between them); the
    first ones may finish before the last are in, and the call still ends once, with all its
    choices."""
    async def main():
        fe = build_frontend(load_scenario("chat", []))
        fe.clock.set(0.0, paused=True)
        k = 10 * frontend.INJECT_SLICE + 3
        call = fe.submit(parse_generate({"prompt": ["a", "b"], "n": k // 2 + 1,
                                         "max_tokens": 1}, chat=False), "t", 0.0)
        k = 2 * (k // 2 + 1)
        fe.turn()
        assert call.injected == frontend.INJECT_SLICE and not call.accepted.done()
        seen = [call.injected]
        ended_early = 0
        while not call.accepted.done():
            ended_early = fe.metrics.finished["length"]
            assert not call.complete and not call.done.done()
            advance(fe)  # (the first ones run, and finish, meanwhile)
            seen.append(call.injected)
        assert max(b - a for a, b in zip(seen, seen[1:])) <= frontend.INJECT_SLICE
        assert seen[-1] == k and ended_early > 0 and call.accepted.result() is True
        while not call.complete:
            advance(fe)
        body = call.body()
        assert len(body["choices"]) == k and body["usage"]["completion_tokens"] == k
        assert {c["finish_reason"] for c in body["choices"]} == {"length"}
        assert fe.metrics.finished["length"] == k
    asyncio.run(main())


class Full(Sink):
    """A transport whose client does not read: it holds what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted = False

    def get_write_buffer_size(self) -> int:
        return len(self.data) + frontend.WRITE_LIMIT + 1

    def abort(self) -> None:
        self.aborted = self.closing = True


def test_a_stream_whose_client_does_not_read_is_aborted_once_its_backlog_passes_the_cap(
        monkeypatch):
    async def main():
        monkeypatch.setattr(frontend, "MAX_BACKLOG", 20_000)
        fe, call = served({"prompt": "abc", "max_tokens": 100_000, "n": 4, "stream": True})
        call.transport = Full()
        fe.clock.set(1e-9, paused=True)
        fe.turn()
        while not call.closed:
            advance(fe)
            assert call.backlog_bytes <= 20_000 + 1000
        assert call.transport.aborted and not call.backlog
        fe.turn()  # the engine's cancels are read
        assert not fe._tracks and fe.engine.kv.num_used_blocks == 0
        assert fe.metrics.finished["abort"] == 4
        assert {c.reason for c in call.choices} == {"abort"}
    asyncio.run(main())


def test_a_stream_still_going_in_is_not_taken_for_a_slow_client(monkeypatch):
    # Frames of a call's first slices wait for the rest of it (and for its handler) before any
    # client could read them: counted against the 4 MiB cap, a reading client of a large fast
    # call was dropped, its handler never answered (a hang). Past the larger bound the call is
    # dropped and its handler answered.
    def going_in(fe, start):
        body = {"prompt": ["abc"] * 16, "max_tokens": 20, "n": frontend.INJECT_SLICE, "stream": True}
        call = fe.submit(parse_generate(body, chat=False), "t", start)
        t = start
        while not call.accepted.done():
            t += 2.0  # 2 simulated seconds a pump turn (x1000 at 2 ms turns)
            fe.clock.set(t, paused=True)
            fe.turn()
        return call

    async def main():
        monkeypatch.setattr(frontend, "MAX_BACKLOG", 2_000)
        fe = build_frontend(load_scenario("chat", []))
        fe.clock.set(0.0, paused=True)
        call = going_in(fe, 0.0)
        assert call.accepted.result() is True and not call.closed and call.backlog_bytes > 2_000
        fe.abandon(call)
        monkeypatch.setattr(frontend, "MAX_BACKLOG_UNANSWERED", 2_000)
        call = going_in(fe, fe.clock.now())
        assert call.closed
        with pytest.raises(APIError, match="aborted while it was being queued"):
            call.accepted.result()
    asyncio.run(main())


def test_a_stream_whose_client_reads_again_keeps_its_backlog(monkeypatch):
    async def main():
        fe, call = served({"prompt": "abc", "max_tokens": 200, "stream": True})
        call.transport = Full()
        fe.clock.set(1e-9, paused=True)
        fe.turn()
        while not call.complete:
            advance(fe)
        frames = b"".join(call.backlog).split(b"\n\n")
        assert not call.closed and len(frames) == 200 + 2  # every frame, [DONE], ""
    asyncio.run(main())


def test_an_engine_that_stops_says_so_in_one_line(capsys):
    async def main():
        fe, call = served({"prompt": "abc", "max_tokens": 50, "stream": True})
        fe.clock.set(1e-9, paused=True)
        fe.turn()

        def failing(t, max_steps=None):
            raise EngineError("simulated time passed 1e+09 s (simulated)")
        fe.engine.run_until = failing
        advance(fe)
        assert fe.error and call.complete
    asyncio.run(main())
    err = capsys.readouterr().err
    assert err == "servesim serve: the engine stopped: simulated time passed 1e+09 s " \
                  "(simulated)\n"


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "z" * 200, "max_tokens": 1}, "prompt",
     "its prompt of 200 tokens needs 13 blocks of 16 tokens and the KV cache has 8"),
    ({"prompt": "z" * 100, "max_tokens": 40}, "max_tokens",
     "with 'max_tokens' = 40 needs 9 blocks of 16 tokens and the KV cache has 8 (128 tokens): "
     "'max_tokens' can be at most 29"),
    ({"prompt": "z" * 100, "ignore_eos": True}, "max_tokens",
     "with 'ignore_eos' without 'max_tokens'"),
])
def test_a_request_too_big_for_the_kv_cache_is_refused_naming_what_to_shorten(body, param,
                                                                              words):
    async def main():
        fe = build_frontend(load_scenario("chat", ["kv.num_blocks=8", "kv.block_size=16"]))
        with pytest.raises(APIError) as err:
            fe.check(parse_generate(body, chat=False))
        assert err.value.param == param and words in err.value.message
    asyncio.run(main())


def test_the_largest_max_tokens_offered_is_the_engines_own_limit_with_layer_groups():
    """A windowed model's tables hold only their window: the server refuses what the engine
    would reject, and offers the most the engine accepts (one more it rejects)."""
    async def main():
        sc = load_scenario("chat", ['model.preset=""', 'model.config="gpt-oss-20b"',
                                    "kv.num_blocks=40", "kv.block_size=16"])
        fe = build_frontend(sc)
        assert fe.engine.kv.hybrid
        # 19 blocks in the full group, 17 at most in the window's (its chunk and window)
        fe.check(parse_generate({"prompt": "z" * 100, "max_tokens": 200}, chat=False))
        with pytest.raises(APIError) as err:
            fe.check(parse_generate({"prompt": "z" * 100, "max_tokens": 5000}, chat=False))
        most = int(err.value.message.rsplit("at most ", 1)[1].replace(",", ""))
        assert most > 200
        for n, rejected in ((most, False), (most + 1, True)):
            e = Engine(sc, workload=workload_of([(0.0, 100, n)]))
            e.run()
            assert (e.get(0).state is RequestState.REJECTED) == rejected, n
    asyncio.run(main())


def test_an_output_length_drawn_too_big_for_the_kv_cache_is_refused_naming_max_tokens():
    async def main():
        fe = build_frontend(load_scenario("chat", ["kv.num_blocks=8", "kv.block_size=16"]))
        fe.clock.set(0.0, paused=True)
        ok = fe.submit(parse_generate({"prompt": "z", "n": 2, "max_tokens": 3}, chat=False),
                       "t", 0.0)
        spec = parse_generate({"prompt": "z" * 120, "n": 100}, chat=False)
        fe.check(spec)  # (the lengths are drawn when it is injected)
        call = fe.submit(spec, "t", 0.0)
        fe.turn()
        assert ok.accepted.result() is True
        with pytest.raises(APIError) as err:
            call.accepted.result()
        assert err.value.param == "max_tokens" and "the output length drawn" in err.value.message
        while not ok.complete:
            advance(fe)
        assert ok.complete and not fe._tracks and fe.engine.kv.num_used_blocks == 0
    asyncio.run(main())


def test_a_call_is_refused_whole_before_any_of_it_goes_in():
    # Output lengths drawn (no max_tokens) are checked against the pool for every choice first:
    # the 100th of 200 that could not fit refused the call after 99 had gone in and run, left
    # as aborts in the metrics and cancels in the session log.
    async def main():
        fe = build_frontend(load_scenario("chat", ["kv.num_blocks=14", "kv.block_size=16"]))
        fe.clock.set(0.0, paused=True)
        spec = parse_generate({"prompt": "z", "n": 200}, chat=False)
        fe.check(spec)
        call = fe.submit(spec, "t", 0.0)
        fe.turn()
        fe.clock.set(0.1, paused=True)
        fe.turn()
        with pytest.raises(APIError, match="the output length drawn for it"):
            call.accepted.result()
        assert not call.choices and fe.engine.counts["injected"] == 0
        assert dict(fe.metrics.finished) == {"stop": 0, "length": 0, "abort": 0}
    asyncio.run(main())
