"""`servesim serve` driven by the official `openai` client and by raw HTTP: tokens, usage,
timing, cancellation by disconnect, errors, /metrics, and exact replay of a served session."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sim import ScenarioError
from tui.serve import http as http_mod
from tui.serve.http import INTAKE, Limits
from tui.serve.protocol import FILLER
from .conftest import read_until_closed, serving

MODEL = "llama-3.1-8b"


def client(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=30)


def post(s, path: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(s.url + path, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def filler(n: int) -> str:
    return "".join(FILLER[i % len(FILLER)] for i in range(n))


def test_completion_tokens_text_and_usage(server):
    r = client(server).completions.create(model=MODEL, prompt="Hello, world", max_tokens=12)
    assert r.choices[0].text == filler(12)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len("Hello, world".encode())  # byte-level
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == 24
    assert r.model == MODEL and r.id.startswith("cmpl-")


def test_token_id_prompt_and_several_prompts(server):
    r = client(server).completions.create(model=MODEL, prompt=[[1, 2, 3], [7] * 40],
                                          max_tokens=3, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 3 + 40  # each prompt once, whatever n (as vLLM counts)
    assert r.usage.completion_tokens == 4 * 3


def test_chat_stream_role_content_usage_and_done(server):
    stream = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "héllo"}], max_completion_tokens=9,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks[1:] if c.choices]
    assert "".join(content) == filler(9) and len(content) == 9
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    prompt = "<|user|>\nhéllo\n<|assistant|>\n".encode()
    assert chunks[-1].usage.prompt_tokens == len(prompt)


def test_streamed_tokens_leave_at_their_simulated_times(server):
    """At x1 the client sees the engine's TTFT and ITLs (a server that sent everything at once,
    or on a clock of its own, fails)."""
    c = client(server)
    completions = c.completions  # (the client imports its resources on first use: not the lag)
    t0 = time.monotonic()
    stream = completions.create(model=MODEL, prompt="x" * 3000, max_tokens=40, stream=True)
    got = [time.monotonic() - t0 for ch in stream if ch.choices and ch.choices[0].text]
    [rec] = server.call(lambda: server.frontend.timing_summary())["calls"]
    sim = [t - rec["arrival"] for t in rec["tokens"]]
    assert len(got) == len(sim) == 40
    assert sim[-1] > 0.2  # a 3,000-token prefill and 40 decodes take a while at x1
    # Every token arrives after its simulated time and, on a quiet machine, within a few ms;
    # the bound is loose for a loaded CI machine but far below the run's length.
    lag = [g - s for g, s in zip(got, sim)]
    assert min(lag) > -0.002
    assert sorted(lag)[len(lag) // 2] < 0.05


def test_n_samples_and_stream_choices(server):
    stream = client(server).completions.create(model=MODEL, prompt="abc", max_tokens=4, n=3,
                                               stream=True,
                                               stream_options={"include_usage": True})
    per: dict[int, list[str]] = {}
    usage = None
    for ch in stream:
        for c in ch.choices:
            per.setdefault(c.index, []).append(c.text)
        usage = ch.usage or usage
    assert sorted(per) == [0, 1, 2]
    assert all("".join(v) == filler(4) for v in per.values())
    assert usage.completion_tokens == 12 and usage.prompt_tokens == 3


def test_without_max_tokens_length_is_drawn_and_ends_with_stop(server):
    r = client(server).completions.create(model=MODEL, prompt="hi", extra_body={
        "min_tokens": 5})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens >= 5


def test_ignore_eos_runs_to_the_context_length():
    with serving(["model.max_model_len=64"]) as s:
        r = client(s).completions.create(model=MODEL, prompt="x" * 50,
                                         extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 14 and r.choices[0].finish_reason == "length"


def test_closing_the_stream_cancels_the_request_and_frees_its_blocks(server):
    fe = server.frontend
    stream = client(server).completions.create(model=MODEL, prompt="y" * 500,
                                               max_tokens=5000, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 30  # (a guard against a hang only)
    while True:
        with fe.lock:
            cancels = [e for e in fe.engine.events if e.kind == "cancel"]
            used = fe.engine.kv.num_used_blocks
            running = len(fe.engine.policy.running)
        if cancels or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert len(cancels) == 1 and cancels[0].by == "user" and cancels[0].state == "running"
    assert running == 0 and used == 0
    with fe.lock:
        actions = [e.action for e in fe.engine.events if e.kind == "action"]
    assert actions == ["inject", "cancel"]  # through the public API, as the `c` key
    # and the server keeps serving
    assert client(server).completions.create(model=MODEL, prompt="a", max_tokens=2).usage


def test_each_streams_duplicated_fd_is_let_go_when_its_handler_ends(server):
    """A streamed call writes through its own duplicate of the connection's fd (the raw send
    pass); the duplicate is closed when the handler ends, whether the stream finished or the
    client went away, so none is left behind and the budget is whole again."""
    from tui.serve import frontend as fe_mod
    left = fe_mod._fds.left
    gen = server.frontend.gen
    for _ in range(3):
        texts = [ch.choices[0].text for ch in client(server).completions.create(
            model=MODEL, prompt="d", max_tokens=8, stream=True) if ch.choices]
        assert "".join(texts) == filler(8)
    stream = client(server).completions.create(model=MODEL, prompt="e", max_tokens=5000,
                                               stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 30  # (a guard against a hang only)
    while fe_mod._fds.left != left and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fe_mod._fds.left == left
    # a stream cut short made prepared passes stale; one that was complete did not
    assert server.frontend.gen >= gen + 1


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "Invalid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"model": MODEL}, 400, "'prompt' is required"),
    ({"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "'max_tokens'"),
    ({"model": MODEL, "prompt": "a", "max_tokens": "5"}, 400, "integer"),
    ({"model": MODEL, "prompt": "a", "n": 0}, 400, "'n'"),
    ({"model": MODEL, "prompt": "a", "n": 999}, 400, "max_num_seqs"),
    ({"model": "gpt-4", "prompt": "a"}, 404, "does not exist"),
    ({"model": MODEL, "prompt": "a", "stream_options": {"include_usage": True}}, 400,
     "stream=True"),
    ({"model": MODEL, "prompt": "a", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ({"model": MODEL, "prompt": "a", "priority": 3}, 400, "Priority scheduling"),
    ({"model": MODEL, "prompt": "a", "logprobs": 2}, 400, "not supported"),
    ({"model": MODEL, "prompt": [1, "a"]}, 400, "'prompt'"),
])
def test_bad_requests_get_openai_error_bodies_and_the_server_keeps_serving(server, body, status,
                                                                          words):
    code, err = post(server, "/v1/completions", body)
    assert code == status
    assert set(err) == {"error"} and words in err["error"]["message"]
    assert err["error"]["code"] == status and err["error"]["type"].endswith("Error")
    code, ok = post(server, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2})
    assert code == 200 and ok["usage"]["completion_tokens"] == 2


def test_bad_chat_messages_and_unknown_routes(server):
    code, err = post(server, "/v1/chat/completions", {"messages": [{"content": "x"}]})
    assert code == 400 and "role" in err["error"]["message"]
    code, err = post(server, "/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert code == 400 and "text parts" in err["error"]["message"]
    code, err = post(server, "/v1/embeddings", {"input": "x"})
    assert code == 404 and err["error"]["type"] == "NotFoundError"


def test_prompt_longer_than_max_model_len_is_refused():
    with serving(["model.max_model_len=100"]) as s:
        c = client(s)
        with pytest.raises(openai.BadRequestError, match="maximum context length is 100"):
            c.completions.create(model=MODEL, prompt="z" * 100, max_tokens=1)
        with pytest.raises(openai.BadRequestError, match="'max_tokens' or"):
            c.completions.create(model=MODEL, prompt="z" * 60, max_tokens=41)
        assert c.completions.create(model=MODEL, prompt="z" * 60, max_tokens=40).usage


def test_a_request_that_can_never_fit_in_kv_memory_is_refused():
    with serving(["kv.num_blocks=8", "kv.block_size=16"]) as s:
        with pytest.raises(openai.BadRequestError, match="cannot be served: its prompt") as e:
            client(s).completions.create(model=MODEL, prompt="z" * 200, max_tokens=1)
        assert e.value.param == "prompt"
        with pytest.raises(openai.BadRequestError, match="'max_tokens' can be at most") as e:
            client(s).completions.create(model=MODEL, prompt="z" * 100, max_tokens=40)
        assert e.value.param == "max_tokens"


def _raw(s, data: bytes, rst: bool = False) -> bytes:
    """Send `data` on a new connection; what comes back until the server closes it (or, with
    `rst`, reset it at once)."""
    sock = socket.create_connection(("127.0.0.1", int(s.url.rsplit(":", 1)[1])), timeout=10)
    with sock:
        sock.sendall(data)
        if rst:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return b""
        out = b""
        while chunk := sock.recv(1 << 16):
            out += chunk
        return out


def test_bodies_that_do_not_decode_and_bad_json_are_400s_not_500s(server):
    post_ = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    body = b'{"prompt": "hi", "max_tokens": 3}'
    out = _raw(server, post_ + b"Connection: close\r\nContent-Encoding: gzip\r\n"
               b"Content-Length: %d\r\n\r\n%b"
               % (len(body), body))
    assert out.startswith(b"HTTP/1.1 400")
    err = json.loads(out.split(b"\r\n\r\n", 1)[1])["error"]
    assert "Content-Encoding: gzip" in err["message"] and err["type"] == "BadRequestError"
    for raw, words in ((b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                       "nested too deeply"),
                      (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "integer")):
        code, err = post(server, "/v1/completions", raw)
        assert code == 400 and words in err["error"]["message"]
    assert post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2})[0] == 200


def test_a_body_over_16_mib_is_413_and_a_long_id_list_is_refused_on_its_length(server):
    # Bodies are parsed on the event loop: 64 MiB of token ids held every stream ~2.8 s.
    from tui.serve.http import MAX_BODY

    assert MAX_BODY == 16 << 20
    code, err = post(server, "/v1/completions", b'{"prompt": "' + b"x" * (MAX_BODY + 1) + b'"}')
    assert code == 413 and "larger than 16777216 bytes" in err["error"]["message"]
    code, err = post(server, "/v1/completions", {"prompt": list(range(200_000)), "max_tokens": 1})
    assert code == 400 and "maximum context length is 131072 tokens" in err["error"]["message"]
    assert post(server, "/v1/completions", {"prompt": [-1, 2]})[0] == 400
    assert post(server, "/v1/completions", {"prompt": [1, True]})[0] == 400


def test_clients_that_break_http_or_vanish_leave_at_most_a_line_each_no_traceback(server,
                                                                                  caplog):
    """Malformed HTTP (aiohttp's parser answers 400), and streamed requests whose client
    resets the connection at once (some reach `prepare` after it is gone)."""
    bad = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
           b"GET /health HTTP/1.1\r\nHost: x\r\nBroken header\r\n\r\n",
           b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
           b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"zz\r\n{}\r\n0\r\n\r\n",
           b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n")
    for data in bad:
        assert _raw(server, data).split(b"\r\n")[0].endswith(b"400 Bad Request")
    body = json.dumps({"prompt": "hi", "max_tokens": 50, "stream": True}).encode()
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    threads = [threading.Thread(target=_raw, args=(server, req, True)) for _ in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.5)
    assert post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2})[0] == 200
    logged = [r for r in caplog.records if r.name.startswith("aiohttp")]
    assert len(logged) >= len(bad)
    for r in logged:
        assert r.exc_info is None and "\n" not in r.getMessage(), r.getMessage()
    fe = server.frontend
    with fe.lock:  # every reset stream was cancelled
        assert not fe.engine.policy.running and not fe.engine.policy.waiting


def test_a_fan_out_over_the_limit_is_refused_at_once(server):
    # Refused before any of its 256,000 sequences reached the engine (they stalled every stream
    # for 12.8 s): a count of what was injected, not a stopwatch.
    def injected():
        with server.frontend.lock:
            return server.frontend.engine.counts["injected"]
    before = injected()
    code, err = post(server, "/v1/completions", {"prompt": ["a"] * 1000, "n": 256,
                                                 "max_tokens": 1})
    assert code == 400 and err["error"]["param"] == "n"
    assert injected() == before
    assert post(server, "/v1/completions", {"prompt": "a", "max_tokens": 1})[0] == 200
    assert injected() == before + 1  # (the count does see what the server lets through)


def test_full_queue_answers_503_then_serves_again():
    with serving(["scheduler.max_num_seqs=1"], max_waiting=1) as s:
        c = client(s)
        first = c.completions.create(model=MODEL, prompt="a", max_tokens=3000, stream=True)
        next(iter(first))  # running
        out = {}
        second = threading.Thread(target=lambda: out.setdefault(
            "r", c.completions.create(model=MODEL, prompt="b", max_tokens=2)))
        second.start()
        deadline = time.monotonic() + 30  # (a guard against a hang only)
        while time.monotonic() < deadline:
            with s.frontend.lock:
                if len(s.frontend.engine.policy.waiting) == 1:
                    break
            time.sleep(0.01)
        with pytest.raises(openai.APIStatusError) as err:
            c.completions.create(model=MODEL, prompt="c", max_tokens=2)
        assert err.value.status_code == 503 and "overloaded" in err.value.message
        first.close()  # frees the slot: the waiting request runs
        second.join(10)
        assert out["r"].usage.completion_tokens == 2


def test_priority_field_with_the_priority_policy():
    with serving(["scheduler.policy=\"priority\""]) as s:
        r = client(s).completions.create(model=MODEL, prompt="a", max_tokens=2,
                                         extra_body={"priority": -1})
        assert r.usage.completion_tokens == 2
        with s.frontend.lock:
            [arrival] = [e for e in s.frontend.engine.events if e.kind == "arrival"]
        assert arrival.priority == -1


def test_metrics_parse_with_vllm_names_and_labels(server):
    c = client(server)
    for n in (3, 5):
        c.completions.create(model=MODEL, prompt="abcd", max_tokens=n)
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries",
                 "vllm:prefix_cache_hits", "vllm:num_preemptions", "vllm:prompt_tokens",
                 "vllm:generation_tokens", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds"):
        assert name in fams, name
        for sample in fams[name].samples:
            assert sample.labels["model_name"] == MODEL

    def value(fam, suffix=""):
        return sum(s.value for s in fams[fam].samples if s.name == fam + suffix)

    assert value("vllm:generation_tokens", "_total") == 8
    assert value("vllm:prompt_tokens", "_total") == 8
    assert value("vllm:time_to_first_token_seconds", "_count") == 2
    assert value("vllm:inter_token_latency_seconds", "_count") == 2 + 4
    assert value("vllm:e2e_request_latency_seconds", "_count") == 2
    assert value("vllm:num_requests_running") == 0
    finished = {s.labels["finished_reason"]: s.value
                for s in fams["vllm:request_success"].samples}
    assert finished["length"] == 2
    ttft = [s for s in fams["vllm:time_to_first_token_seconds"].samples
            if s.name.endswith("_bucket")]
    assert ttft[0].labels["le"] == "0.001" and ttft[-1].labels["le"] == "+Inf"


def test_models_health_version(server):
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
        assert r.status == 200
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_a_served_session_replays_exactly(server, tmp_path):
    from sim.session.log import read_log, write_log
    from sim.session.replay import verify

    c = client(server)
    threads = [threading.Thread(target=c.completions.create,
                                kwargs=dict(model=MODEL, prompt="p" * (50 * i + 1),
                                            max_tokens=10 + i))
               for i in range(6)]
    for t in threads:
        t.start()
        time.sleep(0.003)
    for t in threads:
        t.join()
    fe = server.frontend
    with fe.lock:
        injects = [e for e in fe.engine.events if e.kind == "action"]
        path = write_log(tmp_path / "served.msgpack", fe.engine)
    assert len(injects) == 6 and all("arrival_time" in a.args for a in injects)
    assert all(a.args["tag"].startswith("127.0.0.1:") for a in injects)
    # at least one arrived while a step was running: it joined later than it arrived
    assert any(a.args["arrival_time"] < a.t for a in injects)
    _, divergence = verify(read_log(path))
    assert divergence is None


def test_with_real_compute_the_text_is_the_tiny_models_bytes():
    import codecs

    from tui.compute import make_executor

    with serving(["compute.backend=\"numpy\"", "kv.num_blocks=256"],
                 make_executor=make_executor) as s:
        r = client(s).completions.create(model=MODEL, prompt="The tiny model", max_tokens=12)
        with s.frontend.lock:
            steps = [e for e in s.frontend.engine.events if e.kind == "steps"]
        ids = [t for e in steps for t in (e.tokens or {}).get(0, [])]
        assert len(ids) == 12
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        assert r.choices[0].text == "".join(decoder.decode(bytes([t])) for t in ids)
        with pytest.raises(openai.BadRequestError, match="vocabulary"):
            client(s).completions.create(model=MODEL, prompt=[300, 1], max_tokens=1)


def test_a_failure_in_the_engine_ends_every_stream_and_is_reported(server):
    fe = server.frontend
    stream = client(server).completions.create(model=MODEL, prompt="q", max_tokens=100_000,
                                               stream=True)
    it = iter(stream)
    next(it)

    def broken(*a, **k):
        raise RuntimeError("simulated bug")

    server.call(lambda: setattr(fe.engine, "run_until", broken))
    rest = list(it)  # the stream ends instead of hanging
    assert rest[-1].choices[0].finish_reason == "abort"
    code, err = post(server, "/v1/completions", {"prompt": "a", "max_tokens": 1})
    assert code == 500 and "simulated bug" in err["error"]["message"]
    try:
        urllib.request.urlopen(server.url + "/health", timeout=10)
        raise AssertionError("healthy after a failure")
    except urllib.error.HTTPError as e:
        assert e.code == 503


def test_background_load_runs_beside_http_requests():
    with serving(["workload.rate=50", "workload.duration_s=5"], background=True) as s:
        r = client(s).completions.create(model=MODEL, prompt="a", max_tokens=20)
        assert r.usage.completion_tokens == 20
        with s.frontend.lock:
            arrivals = [e for e in s.frontend.engine.events if e.kind == "arrival"]
            admitted = {e.req_id for e in s.frontend.engine.events if e.kind == "admit"}
        background = [a for a in arrivals if not a.injected]
        assert len(background) >= 3 and background[0].req_id in admitted
        assert sum(a.injected for a in arrivals) == 1


def test_without_background_the_scenarios_workload_stays_off(server):
    client(server).completions.create(model=MODEL, prompt="a", max_tokens=2)
    with server.frontend.lock:
        arrivals = [e for e in server.frontend.engine.events if e.kind == "arrival"]
    assert [a.injected for a in arrivals] == [True]


def test_a_bounded_server_holds_only_what_is_in_flight():
    # Headless `serve` drops read events and ended requests: after hundreds of background
    # requests, the engine holds a handful of events and only the live requests, and the HTTP
    # answers and the /metrics counters are the same as ever.
    # (A load the engine serves: at rate 400, requests queued for good, and on a loaded machine
    # the first one below waited past the client's 30 s; speed 16 keeps the run short.)
    with serving(["workload.rate=10", "workload.duration_s=120"], background=True,
                 bounded=True, speed=16.0) as s:
        r = client(s).completions.create(model=MODEL, prompt="a", max_tokens=20)
        assert r.choices[0].text == filler(20)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with s.frontend.lock:
                done = s.frontend.engine.counts["finished"]
            if done >= 300:
                break
            time.sleep(0.1)
        with s.frontend.lock:
            e = s.frontend.engine
            assert e.counts["finished"] >= 300
            assert len(e.events) <= 1 + e.counts["arrived"] - e.counts["finished"] + 64
            # (under async scheduling a request that finished in the last step keeps its seat
            # in `running` until the next step is scheduled; it has ended all the same)
            live = [r.req_id for r in (*e.policy.running, *e.policy.waiting)
                    if not r.state.is_done]
            assert sorted(e.requests) == sorted(live)
        with urllib.request.urlopen(s.url + "/metrics", timeout=30) as resp:
            text = resp.read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        ok = sum(x.value for x in fams["vllm:request_success"].samples
                 if x.name.endswith("_total"))
        assert ok >= 300


def test_a_stream_is_vllms_frames_byte_for_byte(server):
    """The whole body of a streamed call with two choices and continuous usage: each token's
    frame in step order, the finish reason folded into each choice's last token, the usage
    frame, [DONE]."""
    req = urllib.request.Request(
        server.url + "/v1/completions", headers={"Content-Type": "application/json"},
        data=json.dumps({"prompt": "abc", "max_tokens": 3, "n": 2, "stream": True,
                         "stream_options": {"include_usage": True,
                                            "continuous_usage_stats": True}}).encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        body = r.read()
    head = json.loads(body.split(b"\n\n", 1)[0][len(b"data: "):])
    rid, created = head["id"], head["created"]

    def chunk(choices, usage) -> bytes:
        return b"data: " + json.dumps({"id": rid, "object": "text_completion",
                                       "created": created, "model": MODEL,
                                       "choices": choices, "usage": usage}).encode() + b"\n\n"

    def usage(n):
        return {"prompt_tokens": 3, "total_tokens": 3 + n, "completion_tokens": n,
                "prompt_tokens_details": None}

    want, sent = [], 0
    for k in range(3):
        for i in range(2):
            sent += 1
            want.append(chunk([{"index": i, "text": FILLER[k], "logprobs": None,
                                "finish_reason": "length" if k == 2 else None,
                                "stop_reason": None}], usage(sent)))
    want.append(chunk([], usage(6)))
    want.append(b"data: [DONE]\n\n")
    assert body == b"".join(want)


def _read_chunked(sock) -> bytes:
    """The body of one chunked HTTP response read from `sock`, headers dropped."""
    data = b""
    while not data.endswith(b"\r\n0\r\n\r\n"):
        got = sock.recv(1 << 16)
        assert got, "the server closed the stream early"
        data += got
    head, rest = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200")
    body = b""
    while True:
        size, rest = rest.split(b"\r\n", 1)
        if int(size, 16) == 0:
            return body
        body, rest = body + rest[:int(size, 16)], rest[int(size, 16) + 2:]


def test_a_client_that_stops_reading_holds_up_nobody_and_gets_its_whole_stream():
    """The pump writes to a socket only while its buffer is short; a stalled client's frames
    wait, in order, for its own task to write them with flow control."""
    n = 6000
    with serving(speed=20.0) as s:
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect(("127.0.0.1", int(s.url.rsplit(":", 1)[1])))
        body = json.dumps({"prompt": "s", "max_tokens": n, "stream": True}).encode()
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
        fe = s.frontend

        def calls():
            with fe.lock:
                return [tr.choice.call for tr in fe._tracks.values() if tr.choice]

        deadline = time.monotonic() + 20
        while not any(c.transport for c in calls()) and time.monotonic() < deadline:
            time.sleep(0.005)
        [call] = calls()
        # A small kernel buffer on the server's side (loopback autotunes it to megabytes,
        # which would take the whole stream): the stall reaches the server at once.
        s.call(lambda: call.transport.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDBUF, 4096))
        while not call.backlog and not call.complete and time.monotonic() < deadline:
            time.sleep(0.005)
        assert call.backlog and not call.complete  # frames held for it, none lost
        # another client is served meanwhile
        texts = [ch.choices[0].text for ch in client(s).completions.create(
            model=MODEL, prompt="f", max_tokens=30, stream=True) if ch.choices]
        assert "".join(texts) == filler(30)
        frames = _read_chunked(slow).split(b"\n\n")
        slow.close()
    assert frames[-2:] == [b"data: [DONE]", b""]
    chunks = [json.loads(f[len(b"data: "):]) for f in frames[:-2]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == filler(n)
    assert len(chunks) == n and chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("threads", [1, 2])
def test_many_streams_written_in_one_pass_each_get_their_whole_stream(threads):
    """With 40 streams in the batch, each step's frames go out in one writer call (the C loop
    where the compiled build is used), or from two threads (`--send-threads 2`); every client
    still gets its own stream, whole and in order. (Streams of 200 tokens, a few seconds each,
    so that the 40 overlap even when a busy machine opens the connections slowly.)"""
    n, k = 40, 200
    with serving(send_threads=threads) as s:
        pair = s.frontend._writer
        batches = []
        write_all = pair.write_all
        pair.write_all = lambda fds, datas, times=None: (batches.append(len(fds)),
                                                         write_all(fds, datas, times))[1]
        port = int(s.url.rsplit(":", 1)[1])
        body = json.dumps({"prompt": "m", "max_tokens": k, "stream": True}).encode()
        socks = []
        for _ in range(n):
            c = socket.create_connection(("127.0.0.1", port))
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
            socks.append(c)
        bodies = [_read_chunked(c) for c in socks]
        for c in socks:
            c.close()
    assert max(batches) >= pair.MIN_SPLIT  # the split path ran
    for b in bodies:
        frames = b.split(b"\n\n")
        assert frames[-2:] == [b"data: [DONE]", b""]
        texts = [json.loads(f[len(b"data: "):])["choices"][0]["text"] for f in frames[:-2]]
        assert "".join(texts) == filler(k)


def test_min_tokens_above_what_the_context_leaves_is_refused_as_vllm_does():
    """Without max_tokens vLLM's limit is what the context leaves (max_model_len - prompt):
    a min_tokens above it is a 400, not an output silently cut to the limit."""
    with serving(["model.max_model_len=100"]) as s:
        c = client(s)
        with pytest.raises(openai.BadRequestError,
                           match=r"min_tokens must be less than or equal to max_tokens=40, "
                                 r"got 41") as e:
            c.completions.create(model=MODEL, prompt="z" * 60, extra_body={"min_tokens": 41})
        assert e.value.param == "min_tokens"
        r = c.completions.create(model=MODEL, prompt="z" * 60, extra_body={"min_tokens": 40})
        assert r.usage.completion_tokens == 40


def test_tools_are_taken_as_vllm_takes_them_without_tool_parsing(server):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "hi"}]
    for choice in (None, "auto"):
        body = {"model": MODEL, "messages": messages, "tools": tools, "max_tokens": 2}
        if choice:
            body["tool_choice"] = choice
        code, err = post(server, "/v1/chat/completions", body)
        assert code == 400 and '"auto" tool choice requires' in err["error"]["message"]
    code, err = post(server, "/v1/chat/completions",
                     {"model": MODEL, "messages": messages, "tools": tools, "max_tokens": 2,
                      "tool_choice": "required"})
    assert code == 400 and err["error"]["param"] == "tool_choice"
    code, ok = post(server, "/v1/chat/completions",
                    {"model": MODEL, "messages": messages, "tools": tools, "max_tokens": 2,
                     "tool_choice": "none"})
    assert code == 200 and ok["usage"]["completion_tokens"] == 2


def test_an_api_key_guards_the_v1_routes_only():
    with serving(api_key="s3cret") as s:
        def get(path, key=None):
            req = urllib.request.Request(s.url + path, headers=(
                {"Authorization": f"Bearer {key}"} if key else {}))
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return r.status, r.read()
            except urllib.error.HTTPError as e:
                return e.code, e.read()
        assert get("/v1/models") == (401, b'{"error": "Unauthorized"}')
        assert get("/v1/models", "wrong")[0] == 401
        assert get("/v1/models", "s3cret")[0] == 200
        assert get("/health")[0] == 200 and get("/metrics")[0] == 200
        with pytest.raises(openai.AuthenticationError):
            client(s).completions.create(model=MODEL, prompt="hi", max_tokens=1)
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0, timeout=30)
        assert c.completions.create(model=MODEL, prompt="hi", max_tokens=1).usage


HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\n"


def test_idle_and_half_sent_connections_are_closed_after_the_keep_alive_timeout():
    with serving(limits=Limits(keep_alive_s=0.2)) as s:
        port = int(s.url.rsplit(":", 1)[1])
        # nothing sent; half a header; a request, then idle on the kept-alive connection
        silent = socket.create_connection(("127.0.0.1", port))
        half = socket.create_connection(("127.0.0.1", port))
        half.sendall(HEAD)
        kept = socket.create_connection(("127.0.0.1", port))
        kept.sendall(HEAD + b"\r\n")
        with silent, half, kept:
            assert read_until_closed(silent) == b""
            assert read_until_closed(half) == b""
            answer = read_until_closed(kept)
            assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"HTTP/1.1") == 1
        assert s.call(lambda: s.server._runner.app[INTAKE].open) == 0
        assert post(s, "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200


def test_a_body_that_stops_arriving_gets_a_408_and_its_connection_closed():
    with serving(limits=Limits(keep_alive_s=60, body_s=0.2)) as s:
        port = int(s.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                         b"Content-Type: application/json\r\n\r\n{\"prompt\": ")
            answer = read_until_closed(sock)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408")
        err = json.loads(body)["error"]
        assert "did not arrive within 0.2 s" in err["message"] and err["code"] == 408
        assert post(s, "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200


def test_a_stream_longer_than_the_keep_alive_timeout_is_not_cut():
    # (the keep-alive timeout runs only while no request is being handled)
    with serving(["scheduler.max_num_seqs=4"], speed=0.5, limits=Limits(keep_alive_s=0.05)) as s:
        stream = client(s).completions.create(model=MODEL, prompt="hi", max_tokens=12,
                                              stream=True)
        chunks = list(stream)
        assert len(chunks) == 12 and chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("kw", [{"keep_alive_s": 0}, {"keep_alive_s": float("nan")},
                                {"body_s": -1}, {"body_s": 1e9}, {"max_connections": 0}])
def test_absurd_limits_are_one_line_errors(kw):
    with pytest.raises(ScenarioError) as e:
        Limits(**kw)
    assert "\n" not in str(e.value) and str(e.value).startswith("--")


def test_a_large_body_is_parsed_in_a_worker_process_and_served_the_same(monkeypatch):
    # (the size from which a body leaves the event loop, lowered so the test's are large)
    monkeypatch.setattr(http_mod, "PARSE_APART", 1024)
    ids = [1000 + i for i in range(2000)]
    with serving() as s:
        status, body = post(s, "/v1/completions", {"prompt": ids, "max_tokens": 3})
        assert status == 200 and body["usage"]["prompt_tokens"] == 2000
        assert body["choices"][0]["text"] == filler(3)
        assert s.call(lambda: s.server._runner.app[http_mod.PARSER]._pool) is not None
        status, body = post(s, "/v1/chat/completions",  # (a chat body too)
                            {"messages": [{"role": "user", "content": "x" * 3000}],
                             "max_tokens": 2})
        assert status == 200 and body["choices"][0]["message"]["content"] == filler(2)
        # a refusal from the worker is the one the loop would give, param and all
        bad = {"prompt": ids + [-1], "max_tokens": 3}
        status, body = post(s, "/v1/completions", bad)
        monkeypatch.setattr(http_mod, "PARSE_APART", 1 << 30)
        assert (status, body) == post(s, "/v1/completions", bad)
        assert status == 400 and body["error"]["param"] == "prompt"
