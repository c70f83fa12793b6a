"""One reader of an OpenAI ``usage`` object (kvlens.sources.usage), seen through both of its
callers: a gateway log's line (the ``openai-usage`` format) and the experiment client's answer.
Both read the Chat/Completions and the Responses names, take a null for not reported, and refuse
the same counts that cannot be."""

from __future__ import annotations

import asyncio
import io
from typing import Any

import orjson
import pytest

from kvlens.experiment import client
from kvlens.experiment.stream import Exchange
from kvlens.records import MAX_TOKENS, batch_from_objects
from kvlens.sources.formats import converter

SENT_PROMPT = 999  # what the client sent: its record's prompt_tokens unless the usage says otherwise
CHUNKS = 7  # chunks with text the client saw: its output_tokens unless the usage says otherwise

# usage -> the counts it reports (a count not reported is absent), or None: a count that cannot be
CASES: list[tuple[str, dict[str, Any], dict[str, int] | None]] = [
    (
        "chat",
        {"prompt_tokens": 200, "completion_tokens": 10, "prompt_tokens_details": {"cached_tokens": 128}},
        {"prompt_tokens": 200, "cached_tokens": 128, "output_tokens": 10},
    ),
    (
        "responses",
        {"input_tokens": 300, "output_tokens": 5, "input_tokens_details": {"cached_tokens": 256}},
        {"prompt_tokens": 300, "cached_tokens": 256, "output_tokens": 5},
    ),
    (
        "null cached",
        {"prompt_tokens": 50, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": None}},
        {"prompt_tokens": 50, "output_tokens": 3},
    ),
    ("null details", {"prompt_tokens": 50, "prompt_tokens_details": None}, {"prompt_tokens": 50}),
    ("no details (vLLM < 0.24, nothing cached)", {"prompt_tokens": 50}, {"prompt_tokens": 50}),
    (
        "a null chat name falls to the responses name",
        {"prompt_tokens": None, "input_tokens": 40, "completion_tokens": None, "output_tokens": 4},
        {"prompt_tokens": 40, "output_tokens": 4},
    ),
    ("nulls only", {"prompt_tokens": None, "completion_tokens": None}, {}),
    ("empty", {}, {}),
    ("negative", {"prompt_tokens": -5}, None),
    ("a boolean is no count", {"prompt_tokens": True}, None),
    ("a boolean is no count (responses)", {"input_tokens": 300, "output_tokens": False}, None),
    ("a float is no count", {"prompt_tokens": 50.0}, None),
    ("a string is no count", {"completion_tokens": "3"}, None),
    ("past the record's bound", {"prompt_tokens": MAX_TOKENS + 1}, None),
    ("cached past prompt", {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 11}}, None),
    (
        "cached past prompt (responses)",
        {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 11}},
        None,
    ),
]
COUNTS = ("prompt_tokens", "cached_tokens", "output_tokens")


def from_log(usage: dict[str, Any]) -> dict[str, Any] | None:
    """The counts a gateway log's line yields, or None when validation refuses its record."""
    record = converter("openai-usage")({"id": "r", "model": "m", "usage": usage})
    counts = {key: record[key] for key in COUNTS if key in record}
    checked = batch_from_objects([{"prompt_tokens": 1, "cached_tokens": 0, **counts}])
    return counts if len(checked.batch) == 1 else None


def from_client(usage: dict[str, Any], missing_cached_is_zero: bool = False) -> dict[str, Any] | None:
    """The counts the experiment client writes for an answer with this usage, or None when it
    records the request as ``invalid_usage``."""
    loop = asyncio.new_event_loop()
    try:
        answer: asyncio.Future[Exchange] = loop.create_future()
        answer.set_result(
            Exchange(sent=0.0, token_times=[0.1 * (i + 1) for i in range(CHUNKS)], usage=usage, end=1.0)
        )
        out = io.BytesIO()
        client.ended_record(
            answer,
            record={"prompt_tokens": SENT_PROMPT},
            endpoint=client.Endpoint(
                "http://127.0.0.1:9", "m", missing_cached_is_zero=missing_cached_is_zero
            ),
            writer=client.RecordWriter(out),
            progress=client.Progress(in_flight=1),
        )
    finally:
        loop.close()
    record = orjson.loads(out.getvalue())
    if record.get("error") == "invalid_usage":
        return None
    assert "error" not in record
    return {key: record[key] for key in COUNTS if key in record}


@pytest.mark.parametrize(("usage", "reported"), [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_a_gateway_log_and_the_client_read_a_usage_alike(
    usage: dict[str, Any], reported: dict[str, int] | None
) -> None:
    assert from_log(usage) == reported
    expected = (
        None if reported is None else {"prompt_tokens": SENT_PROMPT, "output_tokens": CHUNKS, **reported}
    )
    assert from_client(usage) == expected


@pytest.mark.parametrize(
    "usage",
    [
        {"input_tokens": 50, "output_tokens": 3},
        {"prompt_tokens": 50, "completion_tokens": 3, "prompt_tokens_details": None},
        {"prompt_tokens": 50, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": None}},
    ],
)
def test_a_cached_count_not_reported_is_zero_for_both_callers_when_asked(usage: dict[str, Any]) -> None:
    assert converter("openai-usage", missing_cached_is_zero=True)({"usage": usage})["cached_tokens"] == 0
    assert from_client(usage, missing_cached_is_zero=True) == {
        "prompt_tokens": 50,
        "cached_tokens": 0,
        "output_tokens": 3,
    }
