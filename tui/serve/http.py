"""The HTTP routes (aiohttp): vLLM's OpenAI-compatible endpoints over a `Frontend`.

`POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`,
`GET /metrics`, `GET /version`; `GET /servesim/timing` with `--record-timing` (for `servesim
bench serve`). Every refusal is an OpenAI-style error body with its status; an unexpected error
is a 500 body and one line on stderr, never a traceback to the client or a hung connection. A
client that disconnects cancels its requests (aiohttp cancels the handler: `handler_cancellation`).
A connection is held only while it is used (`Limits`): idle, or without a whole request header,
for at most the keep-alive timeout; a body gets the body timeout; past the connection cap a new
connection is refused with a 503.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import logging
import multiprocessing
import socket
import sys
from dataclasses import dataclass, replace
from http import HTTPStatus

from aiohttp import http_exceptions, web

from sim import ScenarioError, __version__
from tui.serve.frontend import Frontend
from tui.serve.intake import ACCEPT_BATCH, Intake, fd_share, raise_fd_limit
from tui.serve.metrics import CONTENT_TYPE
from tui.serve.protocol import APIError, GenerateSpec, body_pieces, parse_request


# 16 MiB holds a 131k-token prompt many times over, or thousands of prompts.
MAX_BODY = 16 * 1024 * 1024
# A body from this size up is parsed and checked in a worker process (`Parser`), not on the
# event loop that sends every stream's tokens: json.loads and the checks of a list of token ids
# take ~40 ms a MiB in one call that holds the GIL throughout (a thread would not free the loop).
PARSE_APART = 1 << 20
PARSER_IDLE_S = 60.0  # the worker process ends after this long without a body to parse
SHUTDOWN_S = 2.0  # the most a stop waits for a request handler still running
MAX_TIMEOUT_S = 86400.0  # a day: the longest timeout taken (a longer one is as good as none)
LINGER_S = 10.0  # aiohttp's lingering close: the most an unread body is read after the response


@dataclass(frozen=True)
class Limits:
    """How long a connection may hold the server without using it, and how many may be open.

    `keep_alive_s`: a connection with no whole request header for this long (since it opened,
    or since its last response ended) is closed: idle keep-alive connections, and ones that
    send half a header (vLLM's uvicorn closes idle ones after 5 s: its TIMEOUT_KEEP_ALIVE).
    `body_s`: a request body not all received within this long after its header gets a 408
    and its connection is closed. `max_connections`: open connections beyond it are refused
    with a 503 and closed (None: `intake.fd_share()`, half the process's file limit)."""

    keep_alive_s: float = 5.0
    body_s: float = 60.0
    max_connections: int | None = None

    def __post_init__(self) -> None:
        for option, v in (("--keep-alive-timeout", self.keep_alive_s),
                          ("--body-timeout", self.body_s)):
            if not 0 < v <= MAX_TIMEOUT_S:  # (NaN fails too)
                raise ScenarioError(f"{option} {v:g}: must be a positive number of seconds, "
                                    f"at most {MAX_TIMEOUT_S:g}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ScenarioError(f"--max-connections {self.max_connections}: must be at least 1")


class Parser:
    """Request bodies parsed and checked (`protocol.parse_request`): one under `PARSE_APART`
    bytes in the event loop, a larger one in a worker process, started when first needed
    (spawned: the server's process has threads) and ended after `PARSER_IDLE_S` unused, so a
    server that never gets a large body runs none."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._busy = 0
        self._idle: asyncio.TimerHandle | None = None

    async def parse(self, raw: bytes, chat: bool) -> GenerateSpec:
        """Raises APIError as `parse_request` does."""
        if len(raw) < PARSE_APART:
            return parse_request(raw, chat)
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn"))
        pool = self._pool
        self._busy += 1
        try:
            return await asyncio.wrap_future(pool.submit(parse_request, raw, chat))
        except concurrent.futures.process.BrokenProcessPool:  # (the worker died: a new one next)
            if self._pool is pool:
                self._pool = None
            raise
        finally:
            self._busy -= 1
            if self._busy == 0 and self._pool is not None:
                self._idle = asyncio.get_running_loop().call_later(PARSER_IDLE_S, self.close)

    def close(self) -> None:
        """End the worker process (a parse in progress gets CancelledError)."""
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


FRONTEND = web.AppKey("frontend", Frontend)
INTAKE = web.AppKey("intake", Intake)
LIMITS = web.AppKey("limits", Limits)
PARSER = web.AppKey("parser", Parser)


def _error(err: APIError) -> web.Response:
    resp = web.json_response(err.body(), status=int(err.status))
    if err.status == HTTPStatus.REQUEST_TIMEOUT:  # (the rest of its request is not read)
        resp.force_close()
    return resp


def refusal(max_connections: int) -> bytes:
    """The whole HTTP response a connection over the cap gets before it is closed."""
    body = json.dumps(APIError(f"the server has {max_connections} connections open, the most "
                               "it serves (--max-connections): try again later",
                               HTTPStatus.SERVICE_UNAVAILABLE).body()).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


@web.middleware
async def _errors(request: web.Request, handler):
    """Turn every failure into an OpenAI-style error body."""
    try:
        return await handler(request)
    except APIError as err:
        return _error(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        status = HTTPStatus(exc.status)
        message = (f"{request.method} {request.path}: {status.phrase}" if exc.status != 413
                   else f"request body larger than {MAX_BODY} bytes")
        return _error(APIError(message, status))
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as exc:  # noqa: BLE001 - a bug must not reach the client as a traceback
        print(f"servesim serve: {request.method} {request.path}: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return _error(APIError(f"internal error: {type(exc).__name__}",
                               HTTPStatus.INTERNAL_SERVER_ERROR))


def _cause(exc: BaseException) -> str:
    """The innermost message of a chain of exceptions, on one line."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    text = exc.message if isinstance(exc, http_exceptions.HttpProcessingError) else str(exc)
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


class _ClientErrors(logging.Filter):
    """aiohttp's server logger: an error the client caused (malformed HTTP, a body that does not
    decode, a connection reset) becomes one line, without its traceback; anything else (a
    bug) keeps it."""

    CLIENT = (http_exceptions.HttpProcessingError, web.RequestPayloadError, ConnectionError)

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, self.CLIENT):
            peer = record.getMessage().partition(" from ")[2]
            record.msg = (f"servesim serve: a client's error{f' from {peer}' if peer else ''}: "
                          f"{type(exc).__name__}: {_cause(exc)}")
            record.args = None
            record.exc_info = record.exc_text = None
        return True


def _quiet_client_errors() -> None:
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _ClientErrors) for f in logger.filters):
        logger.addFilter(_ClientErrors())


def _client(request: web.Request) -> str:
    peer = request.transport.get_extra_info("peername") if request.transport else None
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return request.remote or "?"


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    fe = request.app[FRONTEND]
    arrival = fe.clock.now()  # (the handler's start, where the kernel's time is not known)
    body_s = request.app[LIMITS].body_s
    try:
        async with asyncio.timeout(body_s):
            body = await request.read()
    except TimeoutError:
        raise APIError(f"the request body did not arrive within {body_s:g} s (--body-timeout)",
                       HTTPStatus.REQUEST_TIMEOUT) from None
    except web.RequestPayloadError as e:  # (a body its Content-Encoding does not decode, ...)
        encoding = request.headers.get("Content-Encoding")
        raise APIError(f"cannot read the request body"
                       f"{f' (Content-Encoding: {encoding})' if encoding else ''}: "
                       f"{_cause(e)}") from None
    # the receive time of the bytes that completed the body, or of later ones
    wall = request.app[INTAKE].arrival(request.transport)
    if wall is not None:
        arrival = fe.clock.at_wall(wall)
    spec = await request.app[PARSER].parse(body, chat)
    fe.check(spec)
    call = fe.submit(spec, _client(request), arrival)
    resp = None
    try:
        await call.accepted
        if not spec.stream:
            await call.done
            pieces = []
            for piece in body_pieces(call.body()):
                pieces.append(piece)
                await asyncio.sleep(0)  # (sends and other handlers between the pieces)
            return web.Response(body=b"".join(pieces), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        if request.version >= (1, 1):  # explicit, so the pump knows it frames chunks
            resp.enable_chunked_encoding()
        await resp.prepare(request)
        await call.stream_to(resp, request.transport)
        return resp
    except asyncio.CancelledError:
        fe.abandon(call)
        raise
    except ConnectionError:  # the client vanished (or its stream was dropped): not an error
        fe.abandon(call)
        return resp if resp is not None else web.Response()


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def models(request: web.Request) -> web.Response:
    fe = request.app[FRONTEND]
    card = {"id": fe.model_name, "object": "model", "created": 0, "owned_by": "servesim",
            "root": fe.model_name, "parent": None, "max_model_len": fe.max_model_len or None,
            "permission": []}
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    fe = request.app[FRONTEND]
    if fe.error:
        return _error(APIError(f"the engine stopped: {fe.error}",
                               HTTPStatus.SERVICE_UNAVAILABLE))
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[FRONTEND].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": f"servesim {__version__}"})


async def timing(request: web.Request) -> web.Response:
    fe = request.app[FRONTEND]
    if not fe.record_timing:
        raise APIError("timing is recorded only with --record-timing", HTTPStatus.NOT_FOUND)
    return web.Response(text=json.dumps(fe.timing_summary()), content_type="application/json")


def _authorized(api_key: str):
    """vLLM's --api-key: every /v1 route wants `Authorization: Bearer KEY` (401 otherwise);
    /health, /metrics and /version stay open."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path.startswith("/v1") and not hmac.compare_digest(
                request.headers.get("Authorization", "").encode(), expected):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check


def make_app(frontend: Frontend, api_key: str | None = None,
             limits: Limits = Limits()) -> web.Application:
    """The routes over `frontend`. `limits.max_connections` must be set (see `Server`)."""
    _quiet_client_errors()
    middlewares = [_errors] if not api_key else [_authorized(api_key), _errors]
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY)
    app[FRONTEND] = frontend
    app[LIMITS] = limits
    app[PARSER] = Parser()
    cap = limits.max_connections
    app[INTAKE] = Intake(cap, refusal(cap) if cap is not None else b"")
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    app.router.add_get("/servesim/timing", timing)
    return app


class Server:
    """The HTTP server and the pump, started in the running event loop (asyncio's own, or
    Textual's) and stopped together."""

    def __init__(self, frontend: Frontend, host: str, port: int,
                 api_key: str | None = None, limits: Limits = Limits()) -> None:
        self.frontend = frontend
        self.host, self.port = host, port
        self.api_key = api_key
        self.limits = limits
        self._runner: web.AppRunner | None = None
        self._loop_errors = None  # the loop's exception handler before this server's

    async def start(self) -> None:
        """Raise the open-file limit (`intake.raise_fd_limit`), listen, and start the pump.
        Raises OSError when the address is taken."""
        raise_fd_limit()
        limits = self.limits
        if limits.max_connections is None:
            limits = replace(limits, max_connections=fd_share())
        # (open calls are ended at stop, so handlers return at once: the shutdown timeout
        # only bounds one that does not; a body that timed out is read for at most its
        # timeout again before its connection closes, aiohttp's lingering close)
        app = make_app(self.frontend, self.api_key, limits)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=SHUTDOWN_S,
                                     keepalive_timeout=limits.keep_alive_s,
                                     lingering_time=min(LINGER_S, limits.body_s))
        await self._runner.setup()
        socks: list[socket.socket] = []
        try:  # its own listening sockets: a deep backlog, receive times (tui/serve/intake.py)
            socks = await self._runner.app[INTAKE].listen(self.host, self.port)
            for sock in socks:
                await web.SockSite(self._runner, sock, backlog=ACCEPT_BATCH).start()
        except OSError:
            await self._runner.cleanup()
            for sock in socks:
                sock.close()
            raise
        loop = asyncio.get_running_loop()
        self._loop_errors = loop.get_exception_handler()
        loop.set_exception_handler(self._loop_error)
        if self.port == 0:  # an ephemeral port: learn which
            self.port = socks[0].getsockname()[1]
        self.frontend.start()

    async def stop(self) -> None:
        """End every open call (an `abort` frame and `[DONE]` for a stream), stop the pump,
        and close the server."""
        self.frontend.shutdown()
        await self.frontend.stop()
        if self._runner is not None:
            self._runner.app[PARSER].close()
            await self._runner.cleanup()
            self._runner = None
            asyncio.get_running_loop().set_exception_handler(self._loop_errors)

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """The loop's errors: the intake's (out of fds) as one line, the rest as before."""
        if self._runner is not None and self._runner.app[INTAKE].loop_error(context):
            return
        if self._loop_errors is not None:
            self._loop_errors(loop, context)
        else:
            loop.default_exception_handler(context)
