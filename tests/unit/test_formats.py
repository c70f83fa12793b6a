"""Outside line formats -> kvlens records."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlens.records import batch_from_objects
from kvlens.sources.formats import FORMATS, NOT_A_REQUEST, converter

# One line of SGLang's --export-metrics-to-file: meta_info flattened beside request_parameters.
SGLANG_LINE = {
    "request_parameters": '{"rid": "a1", "sampling_params": {"max_new_tokens": 64}}',
    "id": "a1",
    "finish_reason": {"type": "stop", "matched": 2},
    "prompt_tokens": 1024,
    "completion_tokens": 64,
    "cached_tokens": 512,
    "e2e_latency": 1.25,
    "queue_time": 0.05,
    "first_token_latency": 0.21,
}


def test_sglang() -> None:
    record = converter("sglang", model="qwen")(SGLANG_LINE)
    assert record == {
        "request_id": "a1",
        "prompt_tokens": 1024,
        "cached_tokens": 512,
        "output_tokens": 64,
        "e2e_seconds": 1.25,
        "queue_seconds": 0.05,
        "ttft_seconds": 0.21,
        "finish_reason": "stop",
        "model": "qwen",
    }
    assert len(batch_from_objects([record]).batch) == 1


CHAT = {
    "id": "chatcmpl-9",
    "model": "llama",
    "usage": {"prompt_tokens": 200, "completion_tokens": 10, "prompt_tokens_details": {"cached_tokens": 128}},
}
RESPONSES = {
    "id": "resp_1",
    "model": "llama",
    "usage": {"input_tokens": 300, "output_tokens": 5, "input_tokens_details": {"cached_tokens": 256}},
}


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (CHAT, {"request_id": "chatcmpl-9", "model": "llama", "prompt_tokens": 200, "cached_tokens": 128}),
        (RESPONSES, {"request_id": "resp_1", "model": "llama", "prompt_tokens": 300, "cached_tokens": 256}),
        (CHAT["usage"], {"prompt_tokens": 200, "cached_tokens": 128}),  # a bare usage object
    ],
)
def test_openai_usage(line: dict[str, Any], expected: dict[str, Any]) -> None:
    record = converter("openai-usage")(line)
    assert {k: record[k] for k in expected} == expected


def test_missing_details_is_a_rejection_unless_the_switch_says_zero() -> None:
    line = {"model": "llama", "usage": {"prompt_tokens": 50, "completion_tokens": 3}}  # vLLM < 0.24, 0 cached
    strict = batch_from_objects([converter("openai-usage")(line)])
    assert strict.rejections.details(1)[0]["reason"] == "missing"
    lenient = batch_from_objects([converter("openai-usage", missing_cached_is_zero=True)(line)])
    assert lenient.batch.cached_tokens.tolist() == [0]


def test_field_mapping() -> None:
    convert = converter(
        "kvlens", fields={"prompt_tokens": "tokens.in", "cached_tokens": "tokens.hit", "model": "m"}
    )
    assert convert({"tokens": {"in": 9, "hit": 3}, "m": "x"}) == {
        "prompt_tokens": 9,
        "cached_tokens": 3,
        "model": "x",
    }
    with pytest.raises(ValueError, match="unknown record fields"):
        converter("kvlens", fields={"prompt_tokenz": "a"})


def test_unknown_format() -> None:
    with pytest.raises(ValueError, match="unknown format"):
        converter("csv")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=20), children, max_size=5)
    ),
    max_leaves=20,
)


@given(st.sampled_from(FORMATS), json_values)
def test_converters_never_raise(name: str, value: Any) -> None:
    batch_from_objects([converter(name, model="m")(value)])


def test_sglang_prefill_is_the_difference_of_its_own_two_stamps() -> None:
    line = {**SGLANG_LINE, "forward_entry_time": 1764400000.25, "prefill_finished_time": 1764400000.375}
    assert converter("sglang")(line)["prefill_seconds"] == 0.125
    backwards = {**line, "prefill_finished_time": 1764400000.0}
    assert "prefill_seconds" not in converter("sglang")(backwards)


def test_null_cached_tokens_is_missing_and_follows_the_switch() -> None:
    line = {
        "model": "llama",
        "usage": {"prompt_tokens": 50, "prompt_tokens_details": {"cached_tokens": None}},
    }
    assert "cached_tokens" not in converter("openai-usage")(line)
    assert converter("openai-usage", missing_cached_is_zero=True)(line)["cached_tokens"] == 0


@pytest.mark.parametrize(
    ("line", "is_request"),
    [
        ({"object": "chat.completion.chunk", "choices": [{"delta": {"content": "hi"}}]}, False),
        ({"object": "chat.completion.chunk", "choices": [{"delta": {}}], "usage": CHAT["usage"]}, False),
        ({"object": "chat.completion.chunk", "choices": [], "usage": CHAT["usage"]}, True),
        ({"object": "text_completion", "choices": [{"text": "a", "finish_reason": None}]}, False),
        ({"object": "text_completion", "choices": [{"finish_reason": "stop"}], "usage": CHAT["usage"]}, True),
        ({"type": "response.output_text.delta", "delta": "hi"}, False),
        ({"type": "response.completed", "response": RESPONSES}, True),
        ({"object": "chat.completion", "choices": [{"finish_reason": "stop"}]}, True),  # no usage: rejected
    ],
)
def test_streaming_lines_before_the_usage_are_not_requests(line: dict[str, Any], is_request: bool) -> None:
    assert (converter("openai-usage")(line) is not NOT_A_REQUEST) is is_request
