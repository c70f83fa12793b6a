"""Outside JSON line formats -> kvlens record dicts (validated afterwards like any record).

- ``kvlens``: records as they are.
- ``sglang``: one line per request from SGLang's ``--export-metrics-to-file`` (its ``meta_info``
  flattened beside ``request_parameters``): ``prompt_tokens``, ``cached_tokens``,
  ``completion_tokens``, ``e2e_latency``, ``id``, ``finish_reason`` as ``{"type": ...}``, and with
  ``--enable-metrics`` ``queue_time``, ``first_token_latency`` (TTFT, queueing included) and
  ``forward_entry_time`` / ``prefill_finished_time`` (prefill is their difference, one clock).
  SGLang writes no model name per request: give one with the tail's ``model``.
- ``openai-usage``: gateway logs holding an OpenAI response or just its ``usage``, read by
  :mod:`kvlens.sources.usage` (Chat/Completions and Responses names, also inside a
  ``response.completed`` streaming event; a ``null`` is not reported). A cached count not
  reported is missing: vLLM before 0.24 omits ``prompt_tokens_details`` when nothing was cached,
  so set ``missing_cached_is_zero`` for those (only when ``--enable-prompt-tokens-details`` is on,
  or every request reads as a miss). Streaming chunks are not requests, except the one that carries the
  whole request's usage (``choices`` empty, as ``stream_options.include_usage`` sends it):
  :data:`NOT_A_REQUEST`.
- a field mapping for any other JSON log: ``{"prompt_tokens": "usage.input", ...}`` (dotted paths).

A converter never raises: what it cannot find it leaves out, and validation names the field.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Final

from kvlens.records import FIELD_NAMES
from kvlens.sources.usage import read_usage

Converter = Callable[[Any], Any]
FORMATS = ("kvlens", "sglang", "openai-usage")


class _NotARequest:
    """What a converter returns for a line that describes no finished request (a streaming chunk
    before the last, a progress event): left out, neither counted nor rejected."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NOT_A_REQUEST"


NOT_A_REQUEST: Final = _NotARequest()


def converter(
    name: str,
    *,
    model: str | None = None,
    fields: Mapping[str, str] | None = None,
    missing_cached_is_zero: bool = False,
) -> Converter:
    """The converter for a format name, or for a field mapping when ``fields`` is given."""
    if fields:
        unknown = sorted(set(fields) - set(FIELD_NAMES))
        if unknown:
            raise ValueError(f"field mapping names unknown record fields: {', '.join(unknown)}")
        return _mapping(fields, model)
    if name == "kvlens":
        return _with_model(lambda line: line, model)
    if name == "sglang":
        return _with_model(_sglang, model)
    if name == "openai-usage":
        return _with_model(lambda line: _openai_usage(line, missing_cached_is_zero), model)
    raise ValueError(f"unknown format {name!r}; one of {', '.join(FORMATS)}, or a field mapping")


def _with_model(convert: Converter, model: str | None) -> Converter:
    if model is None:
        return convert

    def with_model(line: Any) -> Any:
        record = convert(line)
        if type(record) is dict and record.get("model") is None:
            record["model"] = model
        return record

    return with_model


def _pick(line: Mapping[str, Any], pairs: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    return {field: line[key] for key, field in pairs if key in line}


_SGLANG_FIELDS = (
    ("id", "request_id"),
    ("prompt_tokens", "prompt_tokens"),
    ("cached_tokens", "cached_tokens"),
    ("completion_tokens", "output_tokens"),
    ("e2e_latency", "e2e_seconds"),
    ("queue_time", "queue_seconds"),
    ("first_token_latency", "ttft_seconds"),
)


def _sglang(line: Any) -> Any:
    if not isinstance(line, dict):
        return line
    record = _pick(line, _SGLANG_FIELDS)
    reason = line.get("finish_reason")
    if isinstance(reason, dict) and isinstance(reason.get("type"), str):
        record["finish_reason"] = reason["type"]
    entered, prefilled = _finite(line.get("forward_entry_time")), _finite(line.get("prefill_finished_time"))
    if entered is not None and prefilled is not None and prefilled >= entered:
        record["prefill_seconds"] = prefilled - entered  # two stamps of SGLang's own clock
    return record


def _finite(value: Any) -> float | None:
    return float(value) if type(value) in (int, float) and math.isfinite(value) else None


_FINAL_RESPONSE_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def _openai_usage(line: Any, missing_cached_is_zero: bool) -> Any:
    if not isinstance(line, dict):
        return line
    event = line.get("type")
    if isinstance(event, str) and event.startswith("response."):  # a Responses streaming event
        if event not in _FINAL_RESPONSE_EVENTS or not isinstance(line.get("response"), dict):
            return NOT_A_REQUEST
        line = line["response"]
    if _streaming_chunk_before_the_last(line):
        return NOT_A_REQUEST
    usage: dict[str, Any] = line["usage"] if isinstance(line.get("usage"), dict) else line
    record = read_usage(usage).counts()  # as read: validation names a count that cannot be
    if missing_cached_is_zero and "prompt_tokens" in record:
        record.setdefault("cached_tokens", 0)
    if usage is not line:
        if isinstance(line.get("model"), str):
            record["model"] = line["model"]
        if isinstance(line.get("id"), str):
            record["request_id"] = line["id"]
    return record


def _streaming_chunk_before_the_last(line: dict[str, Any]) -> bool:
    """A streamed chunk that does not carry the whole request's usage: without usage, or with the
    running usage of ``continuous_usage_stats`` beside content (the last chunk's choices are
    empty); a streamed completion chunk whose choices have not finished."""
    kind = line.get("object")
    choices = line.get("choices")
    if kind == "chat.completion.chunk":
        return not isinstance(line.get("usage"), dict) or bool(choices)
    if kind == "text_completion" and isinstance(choices, list) and choices:
        unfinished = any(isinstance(c, dict) and c.get("finish_reason") is None for c in choices)
        return unfinished or not isinstance(line.get("usage"), dict)
    return False


def _mapping(fields: Mapping[str, str], model: str | None) -> Converter:
    paths = {field: path.split(".") for field, path in fields.items()}

    def convert(line: Any) -> Any:
        if not isinstance(line, dict):
            return line
        record = {}
        for field, path in paths.items():
            value: Any = line
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            if value is not None:
                record[field] = value
        return record

    return _with_model(convert, model)
