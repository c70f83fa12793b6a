"""The OpenAI answers as vLLM 0.33 shapes them: one builder per shape, and the bytes of a stream's
token events derived from the chunk builders, so no shape is spelled twice.

- a completion (``text_completion``) and a chat completion (``chat.completion``), whole;
- their chunks (``text_completion``, ``chat.completion.chunk``): one ``data:`` event per token,
  a chat stream opening with ``delta: {"role": "assistant", "content": ""}``; the usage chunk
  (empty ``choices``) last when ``stream_options.include_usage`` asks; then ``data: [DONE]``.

Usage carries ``prompt_tokens_details.cached_tokens`` (as vLLM with
``--enable-prompt-tokens-details``). A streamed token's event differs from the next only in its
text (and, in a batch of completions, its index): :class:`CompletionEvents` and
:class:`ChatEvents` render the chunk once around a marker text and keep the bytes either side,
so each token costs a join, not a serialization, and the bytes are the builder's by
construction.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Final

import orjson

DONE: Final = b"data: [DONE]\n\n"
FINISHED: Final = "length"  # the simulated model never emits EOS: every answer ends at max_tokens
# Rendered where a token's text goes, then cut out: a JSON string no text the server writes has
# (its NULs are escaped by orjson), looked for from the right so a head holding it changes nothing.
_MARK: Final = "\x00kvlens:text\x00"
_MARKED: Final = orjson.dumps(_MARK)


def head(request_id: str, kind: str, model: str) -> dict[str, Any]:
    """What every answer and chunk opens with; ``kind`` is its ``object``."""
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def event(payload: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


# --- completions --------------------------------------------------------------------------


def completion_choice(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
    }


def completion(request_id: str, model: str, texts: Sequence[str], answer_usage: dict[str, Any]) -> bytes:
    """A whole ``text_completion``: a choice per prompt, each with vLLM's ``prompt_logprobs``."""
    choices = [
        {**completion_choice(i, text, FINISHED), "prompt_logprobs": None} for i, text in enumerate(texts)
    ]
    opening = head(request_id, "text_completion", model)
    return orjson.dumps({**opening, "choices": choices, "usage": answer_usage})


def completion_chunk(opening: dict[str, Any], index: int, text: str, finish_reason: str | None) -> bytes:
    return event({**opening, "choices": [completion_choice(index, text, finish_reason)]})


# --- chat completions ---------------------------------------------------------------------

ASSISTANT_OPENS: Final = {"role": "assistant", "content": ""}  # a chat stream's first delta


def chat_choice(part: str, content: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    """The one choice of a chat answer: ``part`` is ``message`` (whole) or ``delta`` (a chunk).
    vLLM writes ``stop_reason`` with a finish only (its chunks before the last have none)."""
    choice = {"index": 0, part: content, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = None
    return choice


def chat_completion(request_id: str, model: str, text: str, answer_usage: dict[str, Any]) -> bytes:
    """A whole ``chat.completion``."""
    message = {"role": "assistant", "content": text, "tool_calls": []}
    return orjson.dumps(
        {
            **head(request_id, "chat.completion", model),
            "choices": [chat_choice("message", message, FINISHED)],
            "usage": answer_usage,
            "prompt_logprobs": None,
        }
    )


def chat_chunk(opening: dict[str, Any], delta: dict[str, Any], finish_reason: str | None) -> bytes:
    return event({**opening, "choices": [chat_choice("delta", delta, finish_reason)]})


def usage_chunk(opening: dict[str, Any], answer_usage: dict[str, Any]) -> bytes:
    """The last chunk of a stream when ``stream_options.include_usage`` asks: no choices."""
    return event({**opening, "choices": [], "usage": answer_usage})


# --- a stream's token events, cut from the chunks --------------------------------------------


def _around_text(rendered: bytes) -> tuple[bytes, bytes]:
    before, found, after = rendered.rpartition(_MARKED)
    assert found, "the chunk lost its text"
    return before, after


# What follows a token's text depends on its finish only, never on the head (which comes first):
# cut once from chunks of a sample head, so a stream renders only its opening.
_SAMPLE: Final = head("sample", "sample", "sample")
_, _COMPLETION_GOING = _around_text(completion_chunk(_SAMPLE, 0, _MARK, None))
_, _COMPLETION_ENDING = _around_text(completion_chunk(_SAMPLE, 0, _MARK, FINISHED))
_, _CHAT_GOING = _around_text(chat_chunk(_SAMPLE, {"content": _MARK}, None))
_, _CHAT_ENDING = _around_text(chat_chunk(_SAMPLE, {"content": _MARK}, FINISHED))


class CompletionEvents:
    """The events of a completions stream: prompt ``index``'s token is
    ``opening(index) + orjson.dumps(text) + (ending if it is the last else going)``."""

    __slots__ = ("_head",)
    going: Final = _COMPLETION_GOING
    ending: Final = _COMPLETION_ENDING

    def __init__(self, opening: dict[str, Any]) -> None:
        self._head = opening

    def opening(self, index: int) -> bytes:
        return _around_text(completion_chunk(self._head, index, _MARK, None))[0]


class ChatEvents:
    """The events of a chat stream: ``role`` first, then each token
    ``content + orjson.dumps(text) + (ending if it is the last else going)``."""

    __slots__ = ("content", "role")
    going: Final = _CHAT_GOING
    ending: Final = _CHAT_ENDING

    def __init__(self, opening: dict[str, Any]) -> None:
        self.role = chat_chunk(opening, ASSISTANT_OPENS, None)
        self.content, _ = _around_text(chat_chunk(opening, {"content": _MARK}, None))
