"""Stream frames: byte for byte what vLLM's server writes (`json.dumps` of the chunk, in its key
order), whether a frame is built whole or from the tails shared by every stream."""

from __future__ import annotations

import json

from tui.serve.protocol import DONE, ChunkWriter


def frame(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def text_chunk(rid, index, text, reason=None, usage=None) -> dict:
    d = {"id": rid, "object": "text_completion", "created": 7, "model": "m",
         "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": reason,
                      "stop_reason": None}]}
    if usage is not None:
        d["usage"] = usage
    return d


def chat_chunk(rid, index, delta, reason=None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": 7, "model": "m",
            "choices": [{"index": index, "delta": delta, "logprobs": None,
                         "finish_reason": reason}]}


def test_token_frames_are_the_chunks_json_byte_for_byte():
    usage = {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2,
             "prompt_tokens_details": None}
    w = ChunkWriter("cmpl-a", 7, "m", chat=False)
    for _ in range(2):  # the second time from the shared tails
        assert w.token(0, " The") == frame(text_chunk("cmpl-a", 0, " The"))
        assert w.token(2, 'é"\n') == frame(text_chunk("cmpl-a", 2, 'é"\n'))
    assert w.token(1, " fox", "length") == frame(text_chunk("cmpl-a", 1, " fox", "length"))
    assert w.token(0, "x", None, usage) == frame(text_chunk("cmpl-a", 0, "x", None, usage))
    assert w.usage(usage) == frame({"id": "cmpl-a", "object": "text_completion",
                                    "created": 7, "model": "m", "choices": [],
                                    "usage": usage})
    c = ChunkWriter("chatcmpl-b", 7, "m", chat=True)
    for _ in range(2):
        assert c.token(0, " The") == frame(chat_chunk("chatcmpl-b", 0, {"content": " The"}))
    assert c.token(0, "", "abort") == frame(chat_chunk("chatcmpl-b", 0, {"content": ""},
                                                       "abort"))
    assert c.role(3) == frame(chat_chunk("chatcmpl-b", 3, {"role": "assistant",
                                                           "content": ""}))
    assert DONE == b"data: [DONE]\n\n"


def test_streams_share_tails_but_keep_their_own_ids():
    """A cache of whole frames by text would send one stream's id on another's tokens."""
    a = ChunkWriter("cmpl-a", 7, "m", chat=False)
    b = ChunkWriter("cmpl-b", 7, "m", chat=False)
    assert a.token(0, " over") == frame(text_chunk("cmpl-a", 0, " over"))
    assert b.token(0, " over") == frame(text_chunk("cmpl-b", 0, " over"))
    assert a.token(0, " over") != b.token(0, " over")
