"""Stream frames: byte for byte what vLLM's server writes (`json.dumps` of the chunk, in its key
order), whether a frame is built whole or from the tails shared by every stream. Request bodies:
what is refused, with the field named."""

from __future__ import annotations

import json

import pytest

from tui.serve.protocol import (DONE, MAX_SEQUENCES, APIError, ChunkWriter, body_pieces,
                                completion_body, parse_body, parse_generate)


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


@pytest.mark.parametrize("raw, words", [
    (b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "integer literal of more than"),
])
def test_json_nested_too_deep_or_with_an_endless_integer_is_a_400(raw, words):
    with pytest.raises(APIError) as err:
        parse_body(raw)
    assert err.value.status == 400 and words in err.value.message


@pytest.mark.parametrize("field, value, words", [
    ("temperature", -1, "non-negative"), ("temperature", float("nan"), "finite"),
    ("temperature", float("inf"), "finite"), ("temperature", "hot", "a number"),
    ("top_p", -1, "(0, 1]"), ("top_p", 5, "(0, 1]"), ("top_p", 0, "(0, 1]"),
    ("top_k", -5, "at least 1"), ("top_k", 1.5, "an integer"), ("top_k", True, "an integer"),
    ("min_p", 7, "[0, 1]"), ("presence_penalty", 100, "[-2, 2]"),
    ("frequency_penalty", -2.5, "[-2, 2]"), ("repetition_penalty", 0, "greater than zero"),
    ("seed", 1.5, "an integer"), ("seed", 2**64, "an integer from"),
    ("stop", 5, "a string or a list of strings"), ("stop", {}, "a string or a list"),
    ("stop", [5], "a string or a list"), ("stop", [""], "empty string"),
    ("stop_token_ids", ["x"], "a list of integers"), ("best_of", True, "an integer"),
    ("best_of", 2, "not supported"), ("logprobs", 0, "not supported"),
    ("response_format", 5, "'type' is one of"), ("response_format", {"type": "x"}, "one of"),
])
def test_sampling_knobs_of_a_wrong_type_or_range_are_refused_naming_the_field(field, value,
                                                                              words):
    with pytest.raises(APIError) as err:
        parse_generate({"prompt": "hi", field: value}, chat=False)
    assert err.value.param == field and words in err.value.message


@pytest.mark.parametrize("field, value", [
    ("temperature", 0), ("temperature", 1.7), ("top_p", 1), ("top_k", -1), ("top_k", 0),
    ("top_k", 40), ("min_p", 0), ("presence_penalty", -2), ("repetition_penalty", 1.1),
    ("seed", -3), ("stop", "x"), ("stop", ["a", "b"]), ("best_of", 1),
    ("response_format", {"type": "json_object"}), ("logprobs", None), ("echo", False),
    # whole numbers written as floats, which vLLM's pydantic models take; any integer stop id
    ("top_k", 5.0), ("seed", 42.0), ("best_of", 1.0), ("stop_token_ids", [-1, 7]),
])
def test_sampling_knobs_in_range_are_accepted(field, value):
    assert parse_generate({"prompt": "hi", field: value}, chat=False).prompts


def test_a_chats_logprobs_false_or_0_is_accepted():
    for v in (False, 0):
        parse_generate({"messages": [{"role": "user", "content": "x"}], "logprobs": v},
                       chat=True)


@pytest.mark.parametrize("body, param, words", [
    ({"stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage", "'stream_options.include_usage' = \"yes\""),
    ({"stream": True, "stream_options": {"continuous_usage_stats": 1}},
     "stream_options.continuous_usage_stats", "'stream_options.continuous_usage_stats'"),
    ({"priority": 2**63 - 1}, "priority", "from -2,147,483,648 to 2,147,483,647"),
])
def test_errors_name_the_fields_full_path(body, param, words):
    with pytest.raises(APIError) as err:
        parse_generate({"prompt": "hi", **body}, chat=False)
    assert err.value.param == param and words in err.value.message
    assert "inject" not in err.value.message


@pytest.mark.parametrize("prompts, n, param", [
    (MAX_SEQUENCES + 1, 1, "prompt"), (500_000, 1, "prompt"), (1000, 256, "n"),
    (1, MAX_SEQUENCES + 1, "n"), (MAX_SEQUENCES // 2 + 1, 2, "n"),
])
def test_prompts_times_n_over_the_limit_is_refused(prompts, n, param):
    with pytest.raises(APIError) as err:
        parse_generate({"prompt": ["a"] * prompts, "n": n}, chat=False)
    assert err.value.status == 400 and err.value.param == param
    assert f"at most {MAX_SEQUENCES:,}" in err.value.message


def test_prompts_times_n_at_the_limit_is_accepted():
    assert len(parse_generate({"prompt": ["a"] * (MAX_SEQUENCES // 2), "n": 2},
                              chat=False).prompts) == MAX_SEQUENCES // 2


def test_a_bad_value_is_shown_short_however_large():
    with pytest.raises(APIError) as err:
        parse_generate({"prompt": [[1, 2], "a", 3] + [[7] * 1000] * 1000}, chat=False)
    assert len(err.value.message) < 200


def test_a_whole_response_in_pieces_is_json_dumps_of_it():
    for k in (1, 256, 257, 1000):
        body = completion_body('c"choices": []', 7, 'm"choices": []', [(" The", "length")] * k,
                               3, k)
        pieces = list(body_pieces(body))
        assert b"".join(pieces) == json.dumps(body).encode()
        assert len(pieces) == (1 if k <= 256 else 2 + -(-k // 256))
