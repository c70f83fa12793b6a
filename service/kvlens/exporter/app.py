"""The sidecar's HTTP app: ingest, ``/metrics``, health. Built by :func:`create_app`; nothing is
registered globally, so every test (and every process) brings its own registry."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from kvlens import __version__
from kvlens.config import Settings
from kvlens.exporter.aggregator import Aggregator
from kvlens.exporter.background import BackgroundSources
from kvlens.exporter.collector import KVLensCollector
from kvlens.records import Record
from kvlens.sources import otlp, push, vllm_plugin

log = logging.getLogger(__name__)


class Rejection(BaseModel):
    index: int = Field(description="0-based position of the record in the array or NDJSON lines.")
    field: str | None = Field(description="The field at fault; null when the whole record is.")
    reason: str = Field(description="Reason code, as in kvlens_records_rejected_total{reason}.")
    message: str = Field(description="The rule that was broken (the value is never echoed).")


class IngestResult(BaseModel):
    accepted: int = Field(description="Records counted.")
    rejected_count: int = Field(description="Records rejected (exact).")
    rejected: list[Rejection] = Field(description="The first rejections, in payload order (capped).")
    unknown_fields: int = Field(description="Fields ignored because kvlens does not know them.")


class ErrorBody(BaseModel):
    error: str


_RECORD_SCHEMA = Record.model_json_schema()
_INGEST_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "One record, an array of records, or NDJSON (one record per line); "
        "`Content-Encoding: gzip` accepted.",
        "content": {
            "application/json": {
                "schema": {"anyOf": [_RECORD_SCHEMA, {"type": "array", "items": _RECORD_SCHEMA}]}
            },
            "application/x-ndjson": {"schema": _RECORD_SCHEMA},
        },
    }
}


def create_app(
    settings: Settings, registry: CollectorRegistry, aggregator: Aggregator | None = None
) -> FastAPI:
    aggregator = aggregator or Aggregator(settings)
    background = BackgroundSources(settings, aggregator)
    registry.register(KVLensCollector(aggregator, background.upstream))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await background.start()
        yield
        await background.stop()

    app = FastAPI(
        title="kvlens",
        version=__version__,
        description="Prefix-cache statistics sidecar: push per-request records, scrape /metrics.",
        lifespan=lifespan,
    )
    app.state.aggregator = aggregator
    app.state.registry = registry
    token = settings.ingest_token.get_secret_value().encode() if settings.ingest_token else None
    batches = BatchLedger()

    @app.exception_handler(RequestValidationError)
    async def _no_echo(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default 422 body quotes the offending input; ours names fields only.
        fields = sorted({".".join(str(p) for p in e.get("loc", ())) for e in exc.errors()})
        return JSONResponse({"error": f"invalid request: {', '.join(fields)}"}, status_code=422)

    @app.post(
        "/v1/records",
        response_model=IngestResult,
        openapi_extra=_INGEST_BODY,
        responses={
            400: {"model": ErrorBody, "description": "Nothing in the body decodes."},
            401: {"model": ErrorBody, "description": "Missing or wrong bearer token."},
            408: {"model": ErrorBody, "description": "The body did not arrive within the deadline."},
            413: {"model": ErrorBody, "description": "Body over the limit, also after gzip."},
        },
        summary="Ingest finished-request records (partial acceptance).",
    )
    async def ingest(request: Request) -> Response:
        if token is not None and not _authorized(request, token):
            return _error(401, "missing or invalid bearer token", {"WWW-Authenticate": "Bearer"})
        batch_id = request.headers.get(vllm_plugin.BATCH_HEADER, "")[:64]
        if batch_id and not batches.claim(batch_id):
            return Response(
                batches.answer(batch_id), media_type="application/json", headers={"kvlens-duplicate": "1"}
            )
        source = request.headers.get(vllm_plugin.SOURCE_HEADER, push.SOURCE)
        if source not in (push.SOURCE, vllm_plugin.SOURCE):
            source = push.SOURCE
        # What the sender dropped since its last delivery: counted once the batch is taken (200,
        # or 400 which the sender does not retry), never on 413, which it retries.
        dropped = request.headers.get(vllm_plugin.DROPPED_HEADER, "")
        dropped_count = int(dropped) if dropped.isdigit() and len(dropped) <= 12 else 0
        try:
            body = await _read_body(request, settings.max_body_bytes, settings.body_timeout_seconds)
            result = await run_in_threadpool(_ingest, body, request.headers.get("content-encoding"), source)
        except push.PayloadTooLarge as error:
            batches.release(batch_id)  # the sender retries it
            return _error(413, str(error))
        except BodyTooSlow as error:
            batches.release(batch_id)
            return _error(408, str(error))
        except push.PayloadUndecodable as error:
            aggregator.add_dropped(source, dropped_count)
            batches.settle(batch_id, orjson.dumps({"error": str(error)}))
            return _error(400, str(error))
        except BaseException:
            batches.release(batch_id)
            raise
        aggregator.add_dropped(source, dropped_count)
        answer = result.model_dump_json().encode()
        batches.settle(batch_id, answer)
        return Response(answer, media_type="application/json")

    def _ingest(body: bytes, content_encoding: str | None, source: str) -> IngestResult:
        validated = push.read_records(push.decompress(body, content_encoding, settings.max_body_bytes))
        aggregator.add(validated, source)
        return IngestResult(
            accepted=len(validated.batch),
            rejected_count=len(validated.rejections),
            rejected=[Rejection(**r) for r in validated.rejections.details(settings.max_rejections_listed)],
            unknown_fields=validated.unknown_fields,
        )

    @app.post(
        "/v1/traces",
        summary="OTLP/HTTP traces (protobuf or JSON, gzip): LLM request spans become records.",
        responses={400: {"description": "Not an OTLP export."}, 415: {"description": "Unsupported type."}},
    )
    async def traces(request: Request) -> Response:
        if token is not None and not _authorized(request, token):
            return _error(401, "missing or invalid bearer token", {"WWW-Authenticate": "Bearer"})
        content_type = request.headers.get("content-type", otlp.PROTOBUF)
        media = content_type.split(";")[0].strip().lower()
        media = media if media in (otlp.JSON, otlp.PROTOBUF) else otlp.PROTOBUF
        try:
            body = await _read_body(request, settings.max_body_bytes, settings.body_timeout_seconds)
            body = push.decompress(body, request.headers.get("content-encoding"), settings.max_body_bytes)
            result = await run_in_threadpool(otlp.read_traces, body, content_type)
        except push.PayloadTooLarge as error:
            return _error(413, str(error))
        except BodyTooSlow as error:
            return _error(408, str(error))
        except otlp.ProtobufUnavailable as error:
            return _error(415, str(error))
        except (otlp.TracesUndecodable, push.PayloadUndecodable) as error:
            return Response(otlp.error_status(str(error), media), status_code=400, media_type=media)
        aggregator.add(result.validated, otlp.SOURCE)
        rejected = len(result.validated.rejections)
        counts = result.validated.rejections.counts_by_reason()
        message = ", ".join(f"{count} {reason}" for reason, count in sorted(counts.items()))
        return Response(otlp.response(rejected, message, media), media_type=media)

    @app.get("/metrics", summary="Prometheus text, or OpenMetrics by content negotiation.")
    async def metrics(request: Request) -> Response:
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        # Rendering is CPU work: off the event loop, so a scrape never stalls ingestion.
        data = await run_in_threadpool(encoder, registry)
        return Response(data, media_type=content_type)

    @app.get("/healthz", summary="Liveness.")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", summary="Readiness: the aggregator answers a snapshot.")
    async def readyz() -> dict[str, str]:
        aggregator.snapshot()
        return {"status": "ready"}

    return app


class BatchLedger:
    """Recent batch ids (``kvlens-batch-id``, sent by the vLLM plugin) and their answers, so that a
    batch retried after a lost answer is counted once. Bounded: the oldest ids are forgotten."""

    def __init__(self, capacity: int = 10_000) -> None:
        self._answers: OrderedDict[str, bytes | None] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def claim(self, batch_id: str) -> bool:
        """True for a batch not seen before (it is now in progress); False for a repeat."""
        with self._lock:
            if batch_id in self._answers:
                return False
            self._answers[batch_id] = None
            while len(self._answers) > self._capacity:
                self._answers.popitem(last=False)
            return True

    def answer(self, batch_id: str) -> bytes:
        with self._lock:
            return self._answers.get(batch_id) or b'{"accepted": 0, "duplicate": true}'

    def settle(self, batch_id: str, answer: bytes) -> None:
        if batch_id:
            with self._lock:
                self._answers[batch_id] = answer

    def release(self, batch_id: str) -> None:
        if batch_id:
            with self._lock:
                self._answers.pop(batch_id, None)


def _authorized(request: Request, token: bytes) -> bool:
    scheme, _, presented = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), token)


class BodyTooSlow(Exception):
    """The request body did not arrive within the deadline."""


async def _read_body(request: Request, limit: int, deadline_seconds: float) -> bytes:
    """The whole body, under a size limit and a total deadline (a client that stalls mid-body
    would otherwise hold its connection and a worker slot forever)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise push.PayloadTooLarge(f"body exceeds {limit} bytes")

    async def read() -> bytes:
        chunks = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise push.PayloadTooLarge(f"body exceeds {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), deadline_seconds)
    except asyncio.TimeoutError:
        raise BodyTooSlow(f"the body did not arrive within {deadline_seconds:g} s") from None


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)
