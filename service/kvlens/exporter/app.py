"""The sidecar's HTTP app: ingest, ``/metrics``, health. Built by :func:`create_app`; nothing is
registered globally, so every test (and every process) brings its own registry.

Handlers live at module level and find the sidecar's parts in ``request.app.state.sidecar``;
:func:`create_app` only wires them. No client input yields a 5xx, and no answer or log line quotes
what a client sent (an :class:`~kvlens.errors.InputError` names the rule, not the value).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import logging
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from pydantic import BaseModel, Field

from kvlens import __version__
from kvlens.errors import BodyTooSlow, Busy, ClientDisconnected, InputError
from kvlens.exporter.aggregator import Aggregator
from kvlens.exporter.background import BackgroundSources
from kvlens.exporter.collector import KVLensCollector
from kvlens.exporter.ingest import BatchLedger, IngestWorker, LogThrottle, RecentRecords
from kvlens.exporter.runtime import ScrapeRenderer, ServiceHealth
from kvlens.exporter.settings import SidecarSettings
from kvlens.fleet.subscriber import KVEvents
from kvlens.http.access import bearer_matches
from kvlens.http.bodies import RETRY_AFTER_SECONDS, BodyReader, IngestGate, arriving_bodies, body_limits
from kvlens.http.server import ConnectionGuard
from kvlens.records import Record, Rejections, Validated
from kvlens.sources import encoding, otlp, push, vllm_plugin

log = logging.getLogger(__name__)
GONE_LOG_INTERVAL_SECONDS: Final = 10.0  # a client decides how often it leaves mid-body
DEDUPE_HEADER = "kvlens-dedupe"
# The exposition versions prometheus_client writes, by media type (an Accept's `version=`).
EXPOSITION_VERSIONS: Final = {
    "application/openmetrics-text": ("1.0.0", "2.0.0"),
    "text/plain": ("0.0.4", "1.0.0"),
}


class Rejection(BaseModel):
    index: int = Field(description="0-based position of the record in the array or NDJSON lines.")
    field: str | None = Field(description="The field at fault; null when the whole record is.")
    reason: str = Field(description="Reason code, as in kvlens_records_rejected_total{reason}.")
    message: str = Field(description="The rule that was broken (the value is never echoed).")


class IngestResult(BaseModel):
    accepted: int = Field(description="Records counted.")
    rejected_count: int = Field(description="Records rejected (exact), duplicates not included.")
    rejected: list[Rejection] = Field(description="The first rejections, in payload order (capped).")
    unknown_fields: int = Field(description="Fields ignored because kvlens does not know them.")
    duplicates: int = Field(0, description="Records counted already (de-duplication was asked for).")
    duplicate: bool = Field(False, description="The whole batch (kvlens-batch-id) was counted already.")


class ErrorBody(BaseModel):
    error: str


@dataclass
class Sidecar:
    """The parts the handlers share."""

    settings: SidecarSettings
    aggregator: Aggregator
    background: BackgroundSources
    registry: CollectorRegistry
    health: ServiceHealth = field(init=False)
    worker: IngestWorker = field(default_factory=IngestWorker)
    ledger: BatchLedger = field(init=False)
    recent: RecentRecords = field(init=False)
    renderer: ScrapeRenderer = field(init=False)
    ingest_token: bytes | None = field(init=False)
    decode_limits: encoding.DecodeLimits = field(init=False)
    gone_log: LogThrottle = field(init=False)

    def __post_init__(self) -> None:
        settings = self.settings
        self.health = ServiceHealth(
            ingest_open=settings.ingest_open,
            gate=IngestGate(settings.max_concurrent_ingest),
            arriving=arriving_bodies(settings),
            connections=ConnectionGuard(
                settings.max_connections, settings.header_timeout_seconds, settings.write_timeout_seconds
            ),
        )
        self.ledger = BatchLedger(settings.batch_id_window)
        self.recent = RecentRecords(settings.request_id_window)
        self.renderer = ScrapeRenderer(self.registry)
        self.ingest_token = settings.ingest_secret
        self.decode_limits = encoding.DecodeLimits(
            settings.max_body_bytes, settings.max_decompression_ratio, settings.max_gzip_members
        )
        self.gone_log = LogThrottle(GONE_LOG_INTERVAL_SECONDS, time.monotonic)

    async def arrived(self, request: Request) -> bytes | Response:
        """The request's whole body, received at the pace the settings ask while it counts against
        the arriving bodies' caps; or the answer that refuses it. Until it has arrived the request
        holds no ingest slot: a slot is the decoding's, which a slow sender must not hold."""
        limits = body_limits(self.settings, self.settings.max_body_bytes)
        try:
            return await BodyReader.of(request, limits, self.health.arriving).body()
        except InputError as error:
            return _refused(self, error)

    def dedupe(self, request: Request) -> bool:
        """Whether records already counted are dropped: by setting, or asked for per request."""
        asked = request.headers.get(DEDUPE_HEADER, "").lower() == "request-id"
        return self.settings.dedupe_request_ids or asked

    def count(self, validated: Validated, source: str, dedupe: bool) -> tuple[Validated, int]:
        """Add a batch to the sums (dropping duplicates first when asked); on the worker thread."""
        duplicates = 0
        if dedupe and len(validated.batch):
            keep = self.recent.fresh(validated.batch)
            duplicates = int(len(keep) - keep.sum())
            if duplicates:
                validated = Validated(
                    validated.batch.select(keep),
                    validated.rejections + Rejections.single([-1] * duplicates, "duplicate"),
                    validated.unknown_fields,
                )
        self.background.count(validated, source)
        return validated, duplicates


def create_app(
    settings: SidecarSettings,
    registry: CollectorRegistry,
    aggregator: Aggregator | None = None,
    kv_events: KVEvents | None = None,
) -> FastAPI:
    aggregator = aggregator or Aggregator(settings)
    background = BackgroundSources(settings, aggregator, kv_events)
    sidecar = Sidecar(settings, aggregator, background, registry)
    registry.register(KVLensCollector(aggregator, background, sidecar.health))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await background.start()
        watch = asyncio.create_task(sidecar.health.loop_lag.watch())
        yield
        watch.cancel()
        await background.stop()
        await asyncio.to_thread(sidecar.worker.close)

    app = FastAPI(
        title="kvlens",
        version=__version__,
        description="Prefix-cache statistics sidecar: push per-request records, scrape /metrics.",
        lifespan=lifespan,
        docs_url="/docs" if settings.docs else None,
        redoc_url="/redoc" if settings.docs else None,
    )
    app.router.redirect_slashes = False  # a redirect would be built from the client's Host header
    app.state.sidecar = sidecar
    app.state.aggregator = aggregator
    app.state.registry = registry
    app.add_exception_handler(RequestValidationError, _no_echo)
    app.add_exception_handler(Exception, _internal_error)
    app.post(
        "/v1/records",
        response_model=IngestResult,
        openapi_extra=_INGEST_BODY,
        responses={
            400: {"model": ErrorBody, "description": "Nothing in the body decodes."},
            401: {"model": ErrorBody, "description": "Missing or wrong bearer token."},
            408: {"model": ErrorBody, "description": "The body did not arrive within the deadline."},
            413: {"model": ErrorBody, "description": "Over a limit: size (also decompressed), records."},
            415: {"model": ErrorBody, "description": "A Content-Encoding other than gzip or deflate."},
            503: {"model": ErrorBody, "description": "Busy, or this batch id is in progress: retry."},
        },
        summary="Ingest finished-request records (partial acceptance).",
    )(ingest_records)
    app.post(
        "/v1/traces",
        summary="OTLP/HTTP traces (protobuf or JSON, gzip or deflate): LLM request spans become records.",
        responses={
            400: {"description": "Not an OTLP export."},
            413: {"description": "Over a limit."},
            415: {"description": "Unsupported type or encoding."},
            503: {"description": "Busy: retry."},
        },
    )(ingest_traces)
    app.get(
        # :path: a request id may hold a "/" (sent as %2F, decoded before routing)
        "/v1/requests/{request_id:path}/diagnosis",
        summary="Why one of the last requests missed the cache (records with prefix_hashes).",
        responses={
            401: {"model": ErrorBody, "description": "Missing or wrong bearer token (as ingest)."},
            404: {"model": ErrorBody, "description": "No diagnosis kept for this request id."},
        },
    )(request_diagnosis)
    app.get("/metrics", summary="Prometheus text, or OpenMetrics by content negotiation.")(metrics)
    app.get("/healthz", summary="Liveness.")(healthz)
    app.get("/readyz", summary="Readiness: 503 with the reasons while a source cannot keep its promise.")(
        readyz
    )
    return app


_RECORD_SCHEMA = Record.model_json_schema()
_INGEST_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "One record, an array of records, or NDJSON (one record per line); "
        "`Content-Encoding: gzip` or `deflate` accepted. Headers: `kvlens-batch-id` (a batch retried "
        "with the same id counts once), `kvlens-dedupe: request-id` (drop records counted already).",
        "content": {
            "application/json": {
                "schema": {"anyOf": [_RECORD_SCHEMA, {"type": "array", "items": _RECORD_SCHEMA}]}
            },
            "application/x-ndjson": {"schema": _RECORD_SCHEMA},
        },
    }
}


def _sidecar(request: Request) -> Sidecar:
    sidecar: Sidecar = request.app.state.sidecar
    return sidecar


async def ingest_records(request: Request) -> Response:
    sidecar = _sidecar(request)
    settings = sidecar.settings
    if sidecar.ingest_token is not None and not _bearer_matches(request, sidecar.ingest_token):
        return _unauthorized(sidecar)
    batch_id = request.headers.get(vllm_plugin.BATCH_HEADER, "")
    key = BatchLedger.key(batch_id) if batch_id else None
    source = request.headers.get(vllm_plugin.SOURCE_HEADER, push.SOURCE)
    source = source if source in (push.SOURCE, vllm_plugin.SOURCE) else push.SOURCE
    dedupe = sidecar.dedupe(request)
    # What the sender dropped since its last delivery: counted once the batch is taken (200, or 400
    # which the sender does not retry), never on 413, 408 or 503, which it retries.
    dropped = request.headers.get(vllm_plugin.DROPPED_HEADER, "")
    dropped_count = int(dropped) if dropped.isascii() and dropped.isdigit() and len(dropped) <= 12 else 0
    body = await sidecar.arrived(request)
    if isinstance(body, Response):
        return body
    async with sidecar.health.gate.slot() as admitted:
        if not admitted:
            return _busy(sidecar, "busy", "too many ingest requests in progress")
        if key is not None:
            state = sidecar.ledger.begin(key)
            if state == BatchLedger.IN_PROGRESS:
                return _busy(sidecar, "batch_in_progress", "this kvlens-batch-id is in progress; retry")
            if isinstance(state, tuple):
                accepted, rejected, unknown, duplicates = state
                answer = {
                    "accepted": accepted,
                    "rejected_count": rejected,
                    "rejected": [],
                    "unknown_fields": unknown,
                    "duplicates": duplicates,
                    "duplicate": True,
                }
                return Response(
                    orjson.dumps(answer), media_type="application/json", headers={"kvlens-duplicate": "1"}
                )
        try:
            content_encoding = request.headers.get("content-encoding")

            def work() -> IngestResult:
                text = encoding.decode(body, content_encoding, sidecar.decode_limits)  # off the loop
                validated = push.read_records(
                    text,
                    settings.max_records_per_request,
                    # read by the requests' diagnoses (always), the modelled caches, the tenants' storers
                    keep_prefix_hashes=True,
                )
                counted, duplicates = sidecar.count(validated, source, dedupe)
                return IngestResult(
                    accepted=len(counted.batch),
                    rejected_count=len(validated.rejections),
                    rejected=[
                        Rejection(**r) for r in validated.rejections.details(settings.max_rejections_listed)
                    ],
                    unknown_fields=validated.unknown_fields,
                    duplicates=duplicates,
                )

            result = await sidecar.worker.run(work)
        except InputError as error:
            if key is not None:
                sidecar.ledger.abandon(key)
            if error.status == 400:
                sidecar.aggregator.add_dropped(source, dropped_count)
            return _refused(sidecar, error)
        except BaseException:
            if key is not None:
                sidecar.ledger.abandon(key)
            raise
    if key is not None:
        sidecar.ledger.commit(
            key, (result.accepted, result.rejected_count, result.unknown_fields, result.duplicates)
        )
    sidecar.aggregator.add_dropped(source, dropped_count)
    return Response(result.model_dump_json().encode(), media_type="application/json")


async def request_diagnosis(request: Request, request_id: str) -> Response:
    """The request's diagnosis (:mod:`kvlens.exporter.diagnoses`), behind ingest's bearer token:
    it names replicas and request ids, as records do."""
    sidecar = _sidecar(request)
    if sidecar.ingest_token is not None and not _bearer_matches(request, sidecar.ingest_token):
        return _unauthorized(sidecar)
    diagnosis = sidecar.background.diagnoses.get(request_id)
    if diagnosis is None:
        return _error(404, "no diagnosis kept for this request id")
    cost = sidecar.settings.cost_model_for(diagnosis.model or "")
    return Response(orjson.dumps(diagnosis.as_json(cost)), media_type="application/json")


async def ingest_traces(request: Request) -> Response:
    sidecar = _sidecar(request)
    settings = sidecar.settings
    if sidecar.ingest_token is not None and not _bearer_matches(request, sidecar.ingest_token):
        return _unauthorized(sidecar)
    try:
        media = otlp.media_type(request.headers.get("content-type"))
    except InputError as error:
        return _refused(sidecar, error)
    dedupe = sidecar.dedupe(request)
    body = await sidecar.arrived(request)
    if isinstance(body, Response):
        return body
    async with sidecar.health.gate.slot() as admitted:
        if not admitted:
            return _busy(sidecar, "busy", "too many ingest requests in progress")
        try:
            content_encoding = request.headers.get("content-encoding")

            def work() -> bytes:
                text = encoding.decode(body, content_encoding, sidecar.decode_limits)
                result = otlp.read_traces(text, media, settings.max_records_per_request)
                counted, _ = sidecar.count(result.validated, otlp.SOURCE, dedupe)
                rejections = counted.rejections
                counts = rejections.counts_by_reason()
                message = ", ".join(f"{count} {reason}" for reason, count in sorted(counts.items()))
                return otlp.response(len(rejections), message, media)

            answer = await sidecar.worker.run(work)
        except InputError as error:
            if error.status == 400:
                sidecar.health.refuse(error.reason)
                return Response(otlp.error_status(str(error), media), status_code=400, media_type=media)
            return _refused(sidecar, error)
    return Response(answer, media_type=media)


async def metrics(request: Request) -> Response:
    sidecar = _sidecar(request)
    challenge = _metrics_challenge(request, sidecar.settings)
    if challenge is not None:
        return _error(401, "authentication required", {"WWW-Authenticate": challenge})
    encoder, content_type = exposition_format(request.headers.get("accept", ""))
    data = await sidecar.renderer.render(encoder, content_type)
    return Response(data, media_type=content_type)


def exposition_format(accept: str) -> tuple[Callable[[CollectorRegistry], bytes], str]:
    """prometheus_client's choice of format for an ``Accept`` header, shown only the media ranges
    whose version it writes: it raised on ``version=abc`` or ``1.x`` (a 500), and named any other
    version, ``9.CANARY`` included, in the Content-Type it answered. Without a range it knows,
    the answer is text 0.0.4, as for a scraper that asks for nothing."""
    known = []
    for media_range in accept.split(","):
        media, *parameters = (part.strip() for part in media_range.split(";"))
        versions = [value for key, _, value in (p.partition("=") for p in parameters) if key == "version"]
        if all(version in EXPOSITION_VERSIONS.get(media, ()) for version in versions):
            known.append(media_range)
    return choose_encoder(",".join(known))


async def healthz() -> dict[str, str]:
    return {"status": "ok"}


async def readyz(request: Request) -> Response:
    sidecar = _sidecar(request)
    sidecar.aggregator.snapshot()
    problems = sidecar.background.problems()
    if problems:
        return JSONResponse({"status": "not ready", "problems": problems}, status_code=503)
    return JSONResponse({"status": "ready"})


async def _no_echo(request: Request, exc: Exception) -> Response:
    # FastAPI's default 422 body quotes the offending input; ours names fields only.
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    fields = sorted({".".join(str(p) for p in e.get("loc", ())) for e in errors})
    return _error(422, f"invalid request: {', '.join(fields)}")


async def _internal_error(request: Request, exc: Exception) -> Response:
    # Where it broke, not what it said: an exception's message may quote a client's bytes.
    frames = "".join(traceback.format_tb(exc.__traceback__))
    log.error("kvlens: %s in %s %s\n%s", type(exc).__name__, request.method, request.url.path, frames)
    return _error(500, "internal error")


def _bearer_matches(request: Request, token: bytes) -> bool:
    return bearer_matches(request.headers.get("authorization", ""), token)


def _metrics_challenge(request: Request, settings: SidecarSettings) -> str | None:
    """None when /metrics may be served; else the WWW-Authenticate challenge to answer with."""
    token, user, password = settings.metrics_token, settings.metrics_username, settings.metrics_password
    if token is None and password is None:
        return None
    if token is not None and _bearer_matches(request, token.get_secret_value().encode()):
        return None
    if (
        password is not None
        and user is not None
        and _basic_matches(request, user, password.get_secret_value())
    ):
        return None
    return 'Basic realm="kvlens"' if password is not None else "Bearer"


def _basic_matches(request: Request, user: str, password: str) -> bool:
    scheme, _, encoded = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return False
    try:
        presented = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return False
    expected = f"{user}:{password}".encode()
    return hmac.compare_digest(presented, expected)


def _busy(sidecar: Sidecar, reason: str, message: str, close: bool = False) -> JSONResponse:
    sidecar.health.refuse(reason)
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
    if close:
        headers["Connection"] = "close"
    return _error(503, message, headers)


def _refused(sidecar: Sidecar, error: InputError) -> JSONResponse:
    if isinstance(error, Busy):  # nothing more of the body is read: close rather than take the rest
        return _busy(sidecar, error.reason, str(error), close=True)
    sidecar.health.refuse(error.reason)
    if isinstance(error, ClientDisconnected):  # routine on a flaky network: counted exactly, logged
        held = sidecar.gone_log.allow()  # at most once per interval: a client decides how often
        if held is not None:
            more = f"; {held} more since the last such line" if held else ""
            log.info("kvlens: %s (%s)%s", error, error.reason, more)
    # A slow body's sender is still sending: close rather than wait for the rest of it.
    headers = {"Connection": "close"} if isinstance(error, BodyTooSlow) else None
    return _error(error.status, str(error), headers)


def _unauthorized(sidecar: Sidecar) -> JSONResponse:
    sidecar.health.refuse("unauthorized")
    return _error(401, "missing or invalid bearer token", {"WWW-Authenticate": "Bearer"})


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)
