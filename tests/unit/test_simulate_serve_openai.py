"""`kvlens simulate serve`'s answers: each shape built once, the stream's per-token bytes cut from
the chunk builders (never spelled beside them), and the bytes vLLM's serialization gives."""

from __future__ import annotations

import orjson
import pytest

from kvlens.simulate.serve import openai

TEXTS = ["The", " qui", 'a "quoted"\\ line\n', "\u00e9\u4e2d", ""]


def opening(kind: str, request_id: str = "cmpl-1") -> dict[str, object]:
    return {"id": request_id, "object": kind, "created": 1700000000, "model": "simulated"}


@pytest.mark.parametrize("request_id", ["cmpl-1", "cmpl-\x00kvlens:text\x00-x"])
@pytest.mark.parametrize("index", [0, 7, 1023])
def test_a_completion_tokens_event_is_its_chunk(index: int, request_id: str) -> None:
    head = opening("text_completion", request_id)
    events = openai.CompletionEvents(head)
    for text in TEXTS:
        token = orjson.dumps(text)
        assert events.opening(index) + token + events.going == openai.completion_chunk(
            head, index, text, None
        )
        assert events.opening(index) + token + events.ending == openai.completion_chunk(
            head, index, text, "length"
        )


@pytest.mark.parametrize("request_id", ["chatcmpl-1", "chatcmpl-\x00kvlens:text\x00"])
def test_a_chat_tokens_event_is_its_chunk(request_id: str) -> None:
    head = opening("chat.completion.chunk", request_id)
    events = openai.ChatEvents(head)
    for text in TEXTS:
        token = orjson.dumps(text)
        assert events.content + token + events.going == openai.chat_chunk(head, {"content": text}, None)
        assert events.content + token + events.ending == openai.chat_chunk(head, {"content": text}, "length")
    assert events.role == openai.chat_chunk(head, {"role": "assistant", "content": ""}, None)


def test_the_bytes_are_vllms() -> None:
    """The bytes the server wrote before its shapes had one builder each (as serializing vLLM's
    protocol classes gives them; the integration tests check them against the openai client)."""
    completion = opening("text_completion")
    events = openai.CompletionEvents(completion)
    assert events.opening(3) + b'"x"' + events.going == (
        b'data: {"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"simulated",'
        b'"choices":[{"index":3,"text":"x","logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
    )
    assert events.ending == b',"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'
    chat = openai.ChatEvents(opening("chat.completion.chunk"))
    prefix = (
        b'data: {"id":"cmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"simulated",'
        b'"choices":[{"index":0,"delta":'
    )
    assert (
        chat.role == prefix + b'{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
    )
    assert chat.content == prefix + b'{"content":'
    assert chat.going == b'},"logprobs":null,"finish_reason":null}]}\n\n'
    assert chat.ending == b'},"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'
    usage = openai.usage(64, 7, 48)
    assert usage == {
        "prompt_tokens": 64,
        "total_tokens": 71,
        "completion_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 48},
    }
    assert openai.usage_chunk(completion, usage) == (
        b'data: {"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"simulated",'
        b'"choices":[],"usage":{"prompt_tokens":64,"total_tokens":71,"completion_tokens":7,'
        b'"prompt_tokens_details":{"cached_tokens":48}}}\n\n'
    )


def test_whole_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openai.time, "time", lambda: 1700000000.5)
    usage = openai.usage(3, 2, 0)
    assert orjson.loads(openai.completion("cmpl-9", "m", ["ab", "c"], usage)) == {
        "id": "cmpl-9",
        "object": "text_completion",
        "created": 1700000000,
        "model": "m",
        "choices": [
            {
                "index": i,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            for i, text in enumerate(["ab", "c"])
        ],
        "usage": usage,
    }
    assert openai.chat_completion("chatcmpl-9", "m", "ab", usage) == orjson.dumps(
        {
            "id": "chatcmpl-9",
            "object": "chat.completion",
            "created": 1700000000,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ab", "tool_calls": []},
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                }
            ],
            "usage": usage,
            "prompt_logprobs": None,
        }
    )
