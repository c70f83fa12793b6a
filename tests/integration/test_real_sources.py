"""Every source fed by the real software's own output, each checked against the article's golden
ratios on a real ``kvlens serve`` (request hit 0.9000, token reuse 0.0154): the OpenTelemetry SDK
and its OTLP/HTTP exporter, the ``openai`` package's own types, SGLang 0.5.23's own exporter."""

from __future__ import annotations

import gzip
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from openai.types.completion_usage import CompletionUsage, PromptTokensDetails
from openai.types.responses import Response, ResponseCompletedEvent, ResponseTextDeltaEvent, ResponseUsage
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai

from tests.live import Running, start_kvlens

pytestmark = pytest.mark.integration
SGLANG_FIXTURE = (
    Path(__file__).parent.parent / "fixtures" / "sglang" / "sglang-request-metrics-20261129_21.log.gz"
)


def article() -> Iterator[tuple[int, int, int]]:
    """(index, prompt tokens, cached tokens) of seed article 1's 100 requests."""
    for i in range(100):
        yield (i, 128, 16) if i < 90 else (i, 8192, 0)


def assert_article(sidecar: Running, model: str) -> None:
    requests = sidecar.wait_for("kvlens_requests_total", 100, model=model)
    assert requests == 100
    hits = sidecar.value("kvlens_requests_total", model=model, cache="hit")
    reuse = sidecar.value("kvlens_cached_tokens_total", model=model) / sidecar.value(
        "kvlens_prompt_tokens_total", model=model
    )
    assert f"{hits / requests:.4f}" == "0.9000"
    assert f"{reuse:.4f}" == "0.0154"
    rejected = sum(v for (name, _), v in sidecar.samples().items() if name == "kvlens_records_rejected_total")
    assert rejected == 0


@pytest.fixture
def serve() -> Iterator[Any]:
    started: list[Running] = []

    def start(*args: str, **env: str) -> Running:
        started.append(start_kvlens("serve", *args, env=env))
        return started[-1]

    yield start
    for running in started:
        running.output()


# ---- OpenTelemetry SDK 1.45, its OTLP/HTTP protobuf exporter, GenAI attribute names of semconv 0.66


@pytest.mark.parametrize("compression", [Compression.NoCompression, Compression.Gzip, Compression.Deflate])
def test_the_otel_sdk_exporter_with_genai_semantic_conventions(serve: Any, compression: Compression) -> None:
    sidecar = serve()
    provider = TracerProvider(resource=Resource.create({"service.name": "gateway"}))
    exporter = OTLPSpanExporter(endpoint=f"{sidecar.url}/v1/traces", compression=compression)
    provider.add_span_processor(BatchSpanProcessor(exporter, max_export_batch_size=32))
    tracer = provider.get_tracer("my.llm.client")
    for i, prompt, cached in article():
        with tracer.start_as_current_span("chat qwen") as span:
            span.set_attributes(
                {
                    gen_ai.GEN_AI_REQUEST_MODEL: "qwen-asked",
                    gen_ai.GEN_AI_RESPONSE_MODEL: "qwen",  # what served it: the label
                    gen_ai.GEN_AI_USAGE_INPUT_TOKENS: prompt,
                    gen_ai.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: cached,
                    gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS: 32,
                    gen_ai.GEN_AI_RESPONSE_ID: f"chatcmpl-{i}",
                    gen_ai.GEN_AI_RESPONSE_FINISH_REASONS: ["stop"],
                    gen_ai.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK: 0.035 if cached else 1.31,
                }
            )
    assert provider.force_flush(10_000)
    provider.shutdown()
    assert_article(sidecar, "qwen")
    assert sidecar.value("kvlens_ttft_seconds_count", model="qwen") == 100
    assert sidecar.value("kvlens_requests_total", model="qwen-asked") == 0


def test_the_otel_sdk_exporter_with_sglang_and_vllm_attributes(serve: Any) -> None:
    """SGLang's span (scope "sglang server"): its time_in_model_prefill includes queueing, so no
    prefill; its finish reasons are JSON text. vLLM's (scope "vllm.tracing.otel"): prefill read."""
    sidecar = serve()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{sidecar.url}/v1/traces")))
    sglang, vllm = provider.get_tracer("sglang server"), provider.get_tracer("vllm.tracing.otel")
    for i, prompt, cached in article():
        with sglang.start_as_current_span("llm_request") as span:
            span.set_attributes(
                {
                    "gen_ai.usage.prompt_tokens": prompt,
                    "gen_ai.usage.completion_tokens": 32,
                    "gen_ai.usage.cached_tokens": cached,
                    "gen_ai.request.id": f"sgl-{i}",
                    "gen_ai.response.model": "sglang-model",
                    "gen_ai.response.finish_reasons": json.dumps(["length"]),
                    "gen_ai.latency.time_to_first_token": 0.035,
                    "gen_ai.latency.time_in_model_prefill": 0.03,
                }
            )
        with vllm.start_as_current_span("llm_request") as span:  # with the proposed cached tokens
            span.set_attributes(
                {
                    "gen_ai.usage.prompt_tokens": prompt,
                    "gen_ai.usage.cache_read.input_tokens": cached,
                    "gen_ai.request.model": "vllm-model",
                    "gen_ai.latency.time_in_queue": 0.02,
                    "gen_ai.latency.time_in_model_prefill": 0.01,
                }
            )
    assert provider.force_flush(10_000)
    provider.shutdown()
    assert_article(sidecar, "sglang-model")
    assert_article(sidecar, "vllm-model")
    assert sidecar.value("kvlens_prefill_seconds_count", model="sglang-model") == 0
    assert sidecar.value("kvlens_prefill_seconds_count", model="vllm-model") == 100


# ---- the openai package's own types, serialized with model_dump_json(), tailed as a gateway log


def tail(serve: Any, tmp_path: Path, lines: list[str], **settings: Any) -> Running:
    log = tmp_path / "gateway.jsonl"
    log.write_text("".join(line + "\n" for line in lines))
    config = tmp_path / "kvlens.yaml"
    tail_setting = {"path": str(log), "format": "openai-usage", **settings}
    config.write_text(json.dumps({"tails": [tail_setting], "state_dir": str(tmp_path / "state")}))
    sidecar: Running = serve("--config", str(config), KVLENS_TAIL_POLL_SECONDS="0.05")
    return sidecar


def usage(prompt: int, cached: int | None, details: bool = True) -> CompletionUsage:
    return CompletionUsage(
        prompt_tokens=prompt,
        completion_tokens=32,
        total_tokens=prompt + 32,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached) if details else None,
    )


def test_chat_completions(serve: Any, tmp_path: Path) -> None:
    lines = [
        ChatCompletion(
            id=f"chatcmpl-{i}",
            object="chat.completion",
            created=1796000000,
            model="qwen",
            choices=[
                Choice(
                    index=0,
                    finish_reason="stop",
                    message=ChatCompletionMessage(role="assistant", content="ok"),
                )
            ],
            usage=usage(prompt, cached),
        ).model_dump_json()
        for i, prompt, cached in article()
    ]
    assert_article(tail(serve, tmp_path, lines), "qwen")


@pytest.mark.parametrize("how", ["details omitted (vLLM < 0.24)", "cached_tokens null"])
def test_missing_cached_tokens_follow_the_switch(serve: Any, tmp_path: Path, how: str) -> None:
    def line(i: int, prompt: int, cached: int) -> str:
        if cached:
            return ChatCompletion(
                id=f"c-{i}",
                object="chat.completion",
                created=1,
                model="old-vllm",
                choices=[],
                usage=usage(prompt, cached),
            ).model_dump_json()
        omitted = usage(prompt, None, details=how.startswith("cached_tokens"))
        return ChatCompletion(
            id=f"c-{i}", object="chat.completion", created=1, model="old-vllm", choices=[], usage=omitted
        ).model_dump_json()

    lines = [line(*request) for request in article()]
    assert_article(tail(serve, tmp_path, lines, missing_cached_is_zero=True), "old-vllm")


def test_streamed_chat_counts_the_usage_chunk_once(serve: Any, tmp_path: Path) -> None:
    lines = []
    for i, prompt, cached in article():
        common = {"id": f"chatcmpl-{i}", "object": "chat.completion.chunk", "created": 1, "model": "qwen"}
        for piece in ("Hel", "lo", ""):
            finish = "stop" if not piece else None
            choice = ChunkChoice(index=0, delta=ChoiceDelta(content=piece or None), finish_reason=finish)
            lines.append(ChatCompletionChunk(**common, choices=[choice]).model_dump_json())
        lines.append(ChatCompletionChunk(**common, choices=[], usage=usage(prompt, cached)).model_dump_json())
    sidecar = tail(serve, tmp_path, lines)
    assert_article(sidecar, "qwen")
    assert sidecar.wait_for("kvlens_tail_lines_ignored_total", 300) == 300


def test_responses_and_their_streaming_events(serve: Any, tmp_path: Path) -> None:
    lines = []
    sequence = itertools.count()
    for i, prompt, cached in article():
        response = Response.model_construct(
            id=f"resp_{i}",
            object="response",
            created_at=1796000000.0,
            model="qwen",
            status="completed",
            output=[],
            usage=ResponseUsage(
                input_tokens=prompt,
                input_tokens_details=InputTokensDetails(cached_tokens=cached, cache_write_tokens=0),
                output_tokens=32,
                output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
                total_tokens=prompt + 32,
            ),
        )
        delta = ResponseTextDeltaEvent.model_construct(
            type="response.output_text.delta", item_id="m", output_index=0, content_index=0, delta="ok",
            logprobs=[], sequence_number=next(sequence),
        )  # fmt: skip
        done = ResponseCompletedEvent(
            type="response.completed", response=response, sequence_number=next(sequence)
        )
        lines += [delta.model_dump_json(), done.model_dump_json()] if i % 2 else [response.model_dump_json()]
    sidecar = tail(serve, tmp_path, lines)
    assert_article(sidecar, "qwen")
    assert sidecar.wait_for("kvlens_tail_lines_ignored_total", 50) == 50


# ---- SGLang 0.5.23's own FileRequestMetricsExporter (tests/fixtures/sglang/README.md)


def test_sglang_request_metrics_with_lines_over_the_limit(serve: Any, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / SGLANG_FIXTURE.name.removesuffix(".gz")).write_bytes(gzip.decompress(SGLANG_FIXTURE.read_bytes()))
    sidecar = serve(
        "--tail",
        str(logs / "sglang-request-metrics-*.log"),
        "--format",
        "sglang",
        "--model",
        "qwen",
        KVLENS_STATE_DIR=str(tmp_path / "state"),
        KVLENS_TAIL_POLL_SECONDS="0.05",
    )
    assert_article(sidecar, "qwen")  # the ten long misses (1.1 MiB lines) count
    assert sidecar.value("kvlens_tail_lines_shortened_total") == 10
    assert sidecar.value("kvlens_prefill_seconds_count", model="qwen") == 100
    assert sidecar.value("kvlens_prefill_seconds_sum", model="qwen") == pytest.approx(90 * 0.01 + 10 * 0.8)
    assert sidecar.value("kvlens_queue_seconds_sum", model="qwen") == pytest.approx(90 * 0.02 + 10 * 0.5)
