"""The OpenAI-compatible wire format, as vLLM's server speaks it: request bodies checked field by
field into a `GenerateSpec`, response bodies and stream chunks, and error bodies.

Pure functions over dicts and bytes: no engine, no sockets.

Tokens. Prompts are counted byte-level, one token per UTF-8 byte: the vocabulary of the tiny model
that `[compute]` runs, so with real compute the lengths are exact and the model reads the prompt's
bytes. (A BPE tokenizer such as Llama's gives about one token per 4 bytes of English; send a list
of token ids as the prompt for exact lengths.) A chat request's prompt is its messages rendered by
a fixed template, `<|role|>\\ncontent\\n` per message then `<|assistant|>\\n`.
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import dataclass, field
from http import HTTPStatus

from sim.fileio import json_loads
from sim.limits import PRIORITY_RANGE

# Output text when no real compute runs: one word per token, the same for every request.
FILLER = (" The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog.")


class APIError(Exception):
    """A request the server refuses: becomes an OpenAI-style error body with `status`."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST,
                 param: str | None = None, err_type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.err_type = err_type or _ERROR_TYPES.get(status, "BadRequestError")

    def body(self) -> dict:
        """vLLM's `ErrorResponse`: `{"error": {"message", "type", "param", "code"}}`."""
        return error_body(self.message, self.err_type, int(self.status), self.param)

    def __reduce__(self):  # (whole across processes: a body parsed by the worker, tui.serve.http)
        return APIError, (self.message, self.status, self.param, self.err_type)


_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowed",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "RequestEntityTooLarge",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
}


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


@dataclass
class Prompt:
    """One prompt: its length in tokens and, when its tokens are bytes, those bytes (the tiny
    model's input, and what prefix caching compares)."""

    num_tokens: int
    text: bytes | None


@dataclass
class GenerateSpec:
    """A checked completion or chat completion request."""

    chat: bool
    model: str | None
    prompts: list[Prompt]
    max_tokens: int | None      # None: the output length is drawn from the scenario
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def num_sequences(self) -> int:
        """Engine requests the call makes: one per prompt and choice."""
        return len(self.prompts) * self.n


# --- field checks ------------------------------------------------------------------------------
# Sequences (prompts x n) one request may ask for: 16 waves of vLLM's default max_num_seqs
# (256). Each is an engine request to inject, track and answer (~35 us of the event loop's
# time, injected in slices between sends); a batch larger than this is better sent as several
# requests, which then share the engine fairly with other clients'.
MAX_SEQUENCES = 4096


def _bad(name: str, value, expected: str) -> APIError:
    return APIError(f"'{name}' = {shown(value)}: {expected}", param=name)


def shown(value, limit: int = 60) -> str:
    """`value` as JSON for a message, cut to `limit` characters; only its start is rendered (a
    prompt list of millions of ids, JSON nested a thousand deep)."""
    try:
        text = json.dumps(_head(value, 0))
    except (TypeError, ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _head(v, depth: int):
    if isinstance(v, str):
        return v[:80]
    if isinstance(v, list):
        return [_head(x, depth + 1) for x in v[:8]] if depth < 4 else "..."
    if isinstance(v, dict):
        return ({k: _head(x, depth + 1) for k, x in list(v.items())[:8]} if depth < 4
                else "...")
    return v


def _int(body: dict, name: str, default, *, minimum: int | None = None,
         maximum: int | None = None, path: str | None = None):
    v = body.get(name)
    path = path or name
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():  # 5.0: vLLM's pydantic models take it, as 5
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(path, v, "must be an integer")
    if minimum is not None and maximum is not None and not minimum <= v <= maximum:
        raise _bad(path, v, f"must be an integer from {minimum:,} to {maximum:,}")
    if minimum is not None and v < minimum:
        raise _bad(path, v, f"must be at least {minimum}")
    return v


def _bool(body: dict, name: str, default: bool = False, *, path: str | None = None) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(path or name, v, "must be true or false")
    return v


def _number(body: dict, name: str) -> float | None:
    """A finite number, or None when absent."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(name, v, "must be a number")
    if not math.isfinite(v):
        raise _bad(name, v, "must be a finite number")
    return v


def _sampling(body: dict) -> None:
    """The sampling knobs servesim accepts and does not use, checked as vLLM's
    `SamplingParams` and request models check them (types, then ranges). Raises APIError
    naming the first bad one."""
    v = _number(body, "temperature")
    if v is not None and v < 0:
        raise _bad("temperature", v, "must be non-negative")
    v = _number(body, "top_p")
    if v is not None and not 0 < v <= 1:
        raise _bad("top_p", v, "must be in (0, 1]")
    v = _int(body, "top_k", None)
    if v is not None and v < -1:
        raise _bad("top_k", v, "must be -1 or 0 (disable), or at least 1")
    v = _number(body, "min_p")
    if v is not None and not 0 <= v <= 1:
        raise _bad("min_p", v, "must be in [0, 1]")
    for name in ("presence_penalty", "frequency_penalty"):
        v = _number(body, name)
        if v is not None and not -2 <= v <= 2:
            raise _bad(name, v, "must be in [-2, 2]")
    v = _number(body, "repetition_penalty")
    if v is not None and v <= 0:
        raise _bad("repetition_penalty", v, "must be greater than zero")
    _int(body, "seed", None, minimum=-(2**63), maximum=2**63 - 1)
    stop = body.get("stop")
    if stop is not None:
        if not isinstance(stop, (str, list)) or (
                isinstance(stop, list) and not all(isinstance(s, str) for s in stop)):
            raise _bad("stop", stop, "must be a string or a list of strings")
        if isinstance(stop, list) and "" in stop:
            raise _bad("stop", stop, "cannot contain an empty string")
    ids = body.get("stop_token_ids")
    if ids is not None and (not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise _bad("stop_token_ids", ids, "must be a list of integers")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in RESPONSE_FORMATS):
        raise _bad("response_format", fmt,
                   "must be an object whose 'type' is one of " + ", ".join(RESPONSE_FORMATS))


RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")


UNSUPPORTED = ("logprobs", "top_logprobs", "prompt_logprobs", "echo", "use_beam_search",
               "prompt_embeds")


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body. Raises APIError (400) when it is not one."""
    try:
        body = json_loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(f"Invalid JSON in the request body: {e}") from None
    if not isinstance(body, dict):
        raise APIError("The request body must be a JSON object")
    return body


def _ints(xs: list) -> bool:
    """Every item a JSON integer (not a bool): type by type in C, not item by item in Python,
    since the list is checked on the event loop (2M ids: ~50 ms, not ~400)."""
    return set(map(type, xs)) == {int}


def _prompt_of_ids(ids: list, name: str, typed: bool = False) -> Prompt:
    """A prompt of token ids (`typed`: they are known to be integers already)."""
    if not ids:
        raise _bad(name, ids, "must not be empty")
    if not (typed or _ints(ids)) or min(ids) < 0:
        raise _bad(name, ids, "token ids must be non-negative integers")
    text = bytes(ids) if max(ids) < 256 else None
    return Prompt(len(ids), text)


def _prompt_of_text(text: str, name: str) -> Prompt:
    data = text.encode("utf-8", "surrogatepass")
    if not data:
        raise APIError(f"'{name}' is empty: the prompt needs at least one token", param=name)
    return Prompt(len(data), data)


def completion_prompts(body: dict) -> list[Prompt]:
    """`prompt` of /v1/completions: a string, a list of token ids, or a list of either."""
    p = body.get("prompt")
    if isinstance(p, str):
        return [_prompt_of_text(p, "prompt")]
    if isinstance(p, list) and p:
        if _ints(p):
            return [_prompt_of_ids(p, "prompt", typed=True)]
        if len(p) > MAX_SEQUENCES:  # (before the prompts are read: one pass is long enough)
            raise APIError(f"'prompt' is a list of {len(p):,} prompts: at most "
                           f"{MAX_SEQUENCES:,} prompts x n in one request", param="prompt")
        out = []
        for x in p:
            if isinstance(x, str):
                out.append(_prompt_of_text(x, "prompt"))
            elif isinstance(x, list):
                out.append(_prompt_of_ids(x, "prompt"))
            else:
                raise _bad("prompt", p, "must be a string, a list of token ids, or a list of "
                                        "either")
        return out
    if p is None:
        raise APIError("'prompt' is required", param="prompt")
    raise _bad("prompt", p, "must be a string, a list of token ids, or a list of either")


def render_chat(messages) -> bytes:
    """The prompt bytes of a chat: `<|role|>\\ncontent\\n` per message, then the assistant's
    turn. Raises APIError on a malformed message."""
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list", param="messages")
    parts = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, m, "must be an object with 'role' and 'content'")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise _bad(f"{where}.role", role, "must be a non-empty string")
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            texts = []
            for j, c in enumerate(content):
                if not isinstance(c, dict) or c.get("type") != "text" or not isinstance(
                        c.get("text"), str):
                    raise _bad(f"{where}.content[{j}]", c,
                               "only text parts ({\"type\": \"text\", \"text\": ...}) are "
                               "supported")
                texts.append(c["text"])
            text = "".join(texts)
        else:
            raise _bad(f"{where}.content", content, "must be a string or a list of text parts")
        parts.append(f"<|{role}|>\n{text}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts).encode("utf-8", "surrogatepass")


def _tools(body: dict) -> None:
    """A chat's `tools` as a vLLM server without tool parsing takes them: with `tool_choice`
    "none" they are ignored; "auto" (the default when tools are given) is refused as vLLM
    refuses it without --enable-auto-tool-choice; "required" or a named function would need
    tool calls servesim does not generate. Raises APIError (400)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise _bad("tools", tools, "must be a list")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return
    if choice == "auto":
        raise APIError('"auto" tool choice requires --enable-auto-tool-choice and '
                       "--tool-call-parser to be set (servesim generates no tool calls)",
                       param="tool_choice")
    raise APIError(f"'tool_choice' = {shown(choice)} is not supported by servesim: it "
                   "generates no tool calls", param="tool_choice")


def parse_request(raw: bytes, chat: bool) -> GenerateSpec:
    """A /v1/completions (`chat` False) or /v1/chat/completions request body, parsed and
    checked. Raises APIError (400)."""
    return parse_generate(parse_body(raw), chat)


def parse_generate(body: dict, chat: bool) -> GenerateSpec:
    """Check a /v1/completions (`chat` False) or /v1/chat/completions body.

    Raises APIError (400) naming the first bad field."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", model, "must be a string")
    if chat:
        text = render_chat(body.get("messages"))
        prompts = [Prompt(len(text), text)]
        max_tokens = _int(body, "max_completion_tokens", None, minimum=1)
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens", None, minimum=1)
    else:
        prompts = completion_prompts(body)
        max_tokens = _int(body, "max_tokens", None, minimum=1)
    for name in UNSUPPORTED:
        v = body.get(name)
        # (a completion's `logprobs: 0` asks for the sampled token's logprob; a chat's is a
        # flag)
        if v is not None and v is not False and (v != 0 or name == "logprobs" and not chat):
            raise APIError(f"'{name}' is not supported by servesim", param=name)
    if chat:
        _tools(body)
    best_of = _int(body, "best_of", None)
    if best_of not in (None, 1):
        raise APIError("'best_of' is not supported by servesim", param="best_of")
    _sampling(body)
    n = _int(body, "n", 1, minimum=1)
    if len(prompts) * n > MAX_SEQUENCES:
        raise APIError(f"{len(prompts):,} prompts x 'n' = {n:,} is {len(prompts) * n:,} "
                       f"sequences: at most {MAX_SEQUENCES:,} in one request",
                       param="prompt" if n == 1 else "n")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not stream:
            raise APIError("Stream options can only be defined when `stream=True`.",
                           param="stream_options")
        if not isinstance(options, dict):
            raise _bad("stream_options", options, "must be an object")
        include_usage = _bool(options, "include_usage", path="stream_options.include_usage")
        continuous = _bool(options, "continuous_usage_stats",
                           path="stream_options.continuous_usage_stats")
    min_tokens = _int(body, "min_tokens", 0, minimum=0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise APIError(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got "
                       f"{min_tokens}.", param="min_tokens")
    return GenerateSpec(chat=chat, model=model, prompts=prompts, max_tokens=max_tokens, n=n,
                        stream=stream, include_usage=include_usage, continuous_usage=continuous,
                        ignore_eos=_bool(body, "ignore_eos"), min_tokens=min_tokens,
                        priority=_int(body, "priority", 0, minimum=PRIORITY_RANGE[0],
                                      maximum=PRIORITY_RANGE[1]))


# --- responses ---------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None}


def completion_body(rid: str, created: int, model: str, choices: list[tuple[str, str]],
                    prompt_tokens: int, completion_tokens: int) -> dict:
    """A whole /v1/completions response; `choices` are (text, finish_reason) in index order."""
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": reason,
                     "stop_reason": None, "prompt_logprobs": None}
                    for i, (text, reason) in enumerate(choices)],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chat_body(rid: str, created: int, model: str, choices: list[tuple[str, str]],
              prompt_tokens: int, completion_tokens: int) -> dict:
    """A whole /v1/chat/completions response."""
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": i, "message": {"role": "assistant", "content": text,
                                             "tool_calls": []},
                     "logprobs": None, "finish_reason": reason, "stop_reason": None}
                    for i, (text, reason) in enumerate(choices)],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def body_pieces(body: dict, per: int = 256):
    """The bytes of `json.dumps(body)` (a whole response) in pieces, `per` choices each: a
    response of thousands of choices is encoded between other work, not in one stretch."""
    choices = body["choices"]
    if len(choices) <= per:
        yield json.dumps(body).encode()
        return
    text = json.dumps({**body, "choices": []})
    # (the first match is the key: a quote inside a string value is escaped)
    i = text.index('"choices": []')
    yield text[:i].encode() + b'"choices": ['
    for k in range(0, len(choices), per):
        part = ", ".join(json.dumps(c) for c in choices[k:k + per])
        yield (part if k == 0 else ", " + part).encode()
    yield b"]" + text[i + len('"choices": []'):].encode()


class ChunkWriter:
    """Server-sent-event frames of one streamed response, built from a prefix rendered once.
    A token frame is that prefix and a tail shared by every stream (the same index and text
    give the same bytes), so the usual token costs a dict look-up and one concatenation: the
    server sends hundreds per engine step."""

    def __init__(self, rid: str, created: int, model: str, chat: bool) -> None:
        self.chat = chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = json.dumps({"id": rid, "object": obj, "created": created, "model": model})
        self._prefix = b"data: " + head[:-1].encode() + b', "choices": '
        self.head = self._prefix + b'[{"index": '

    def tails(self, index: int) -> dict[str, bytes]:
        """Choice `index`'s token frames after `head`, by text, shared by every stream (no
        finish reason, no usage); `token` fills it. A frame is `head + tails(index)[text]`."""
        key = (self.chat, index)
        tails = _TAILS.get(key)
        if tails is None:
            _TAILS[key] = tails = {}
        return tails

    def token(self, index: int, text: str, finish_reason: str | None = None,
              usage_: dict | None = None) -> bytes:
        """One choice's text delta (and its finish reason, on its last token)."""
        if finish_reason is None and usage_ is None:
            tails = self.tails(index)
            tail = tails.get(text)
            if tail is None:
                tail = self._tail(index, text, None, None)
                if len(tails) >= MAX_TAILS:  # bounded: texts of real compute vary
                    tails.clear()
                tails[text] = tail
            return self.head + tail
        return self.head + self._tail(index, text, finish_reason, usage_)

    def _tail(self, index: int, text: str, finish_reason: str | None,
              usage_: dict | None) -> bytes:
        """A token frame after `{"index": `."""
        reason = "null" if finish_reason is None else _js(finish_reason)
        if self.chat:
            delta = f'"delta": {{"content": {_js(text)}}}'
            body = f'{index}, {delta}, "logprobs": null, "finish_reason": {reason}}}]'
        else:
            body = (f'{index}, "text": {_js(text)}, "logprobs": null, '
                    f'"finish_reason": {reason}, "stop_reason": null}}]')
        tail = "}" if usage_ is None else f', "usage": {json.dumps(usage_)}}}'
        return body.encode() + tail.encode() + b"\n\n"

    def role(self, index: int) -> bytes:
        """A chat stream's first frame for a choice: the assistant role, empty content."""
        return (self.head + f'{index}, "delta": {{"role": "assistant", "content": ""}}, '
                f'"logprobs": null, "finish_reason": null}}]}}\n\n'.encode())

    def usage(self, usage_: dict) -> bytes:
        """`stream_options.include_usage`: the last frame, no choices, the usage."""
        return self._prefix + f'[], "usage": {json.dumps(usage_)}}}\n\n'.encode()


DONE = b"data: [DONE]\n\n"
# Token frame tails (after a stream's own head) by (chat, choice index), then by text.
_TAILS: dict[tuple[bool, int], dict[str, bytes]] = {}
MAX_TAILS = 4096


@functools.lru_cache(maxsize=4096)
def _js(text: str) -> str:
    """A JSON string literal; cached, as token texts repeat (filler words, single bytes)."""
    return json.dumps(text)


def created_now() -> int:
    return int(time.time())
