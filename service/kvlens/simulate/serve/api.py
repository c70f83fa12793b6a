"""The OpenAI API as vLLM 0.33 serves it, in front of :class:`RealTimeFleet`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``POST /tokenize``, ``POST /detokenize``, ``POST /reset_prefix_cache`` (vLLM
mounts it only with ``VLLM_SERVER_DEV_MODE=1``; here it is always there), ``GET /metrics``.

The answers' shapes are :mod:`.openai`'s (vLLM's protocol classes). Errors are ``{"error":
{"message", "type", "param", "code"}}``: 400 for a bad request (with the field), 404 for an
unknown model.

What is modelled and what is not: every answer is exactly ``max_tokens`` long (the simulated
model never emits EOS, so ``finish_reason`` is ``length``; ``min_tokens`` and ``ignore_eos`` are
checked and change nothing); ``max_tokens`` defaults to 16 for completions and to what the
context leaves for chat, and is cut to what the context leaves (as vLLM does); a prompt of
``max_model_len`` tokens or more is refused; ``n > 1``, ``echo``, ``suffix``, ``logprobs`` and
beam search are refused with 400; sampling parameters (temperature, ...) are ignored (the text
is fixed). A client that goes away (streaming or not) takes its prompts out of the fleet: they
finish as ``abort``, their blocks freed and still cached.

Bounds (the README's "Reliability and limits"): a body of MAX_BODY_BYTES (MAX_TOKENIZE_BODY_BYTES
for ``/tokenize`` and ``/detokenize``), refused 413 from its Content-Length or as it arrives;
``/tokenize``'s text and ``/detokenize``'s ids :data:`~.requests.MAX_TOKEN_IDS` tokens (400);
tokenizing, and checking a body over OFF_LOOP_BYTES, on a thread, WORK_AT_ONCE at a time (503
past it); an answer nobody reads is dropped at the server's write deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, Final

import orjson
from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvlens.errors import ArrivingBytesFull, BodyTooSlow, Busy, ClientDisconnected, PayloadTooLarge
from kvlens.http.access import bearer_matches
from kvlens.http.bodies import RETRY_AFTER_SECONDS, ArrivingBodies, BodyLimits, BodyReader, IngestGate
from kvlens.simulate.replica import INF
from kvlens.simulate.serve import openai, requests
from kvlens.simulate.serve.engine import RealTimeFleet, Ticket
from kvlens.simulate.serve.metrics import FleetMetrics
from kvlens.simulate.serve.requests import ApiError, Asked, Served

JSON: Final = "application/json"
MAX_BODY_BYTES: Final = 16 * 1024 * 1024
# Prompts in flight in the whole fleet (waiting or running), by default: a real engine queues
# without end, but each prompt here holds its token ids and about half a KiB in the server, and
# max_connections clients of MAX_PROMPTS prompts each would be four million of them. Past it a
# request is refused whole, 503, until prompts finish. Far above what a replica runs at once
# (--max-running, 256), so an experiment that overloads the fleet still sees it queue.
MAX_IN_FLIGHT: Final = 65_536
# A stream is written at most this many token events at a time (3 parts each), each write after
# the last has drained (uvicorn waits for it): tokens that came due while nobody read wait as
# counts, not as bytes, so an unread stream holds about a socket buffer (not its whole answer).
PIECE_PARTS: Final = 3 * 64
# /tokenize's and /detokenize's bodies: room for requests.MAX_TOKEN_IDS ids of up to 7 characters
# each with their commas, refused from their length before they arrive, never parsed
MAX_TOKENIZE_BODY_BYTES: Final = 8 * 1024 * 1024
# Work on a thread at once, each holding its slot until its answer is written: /tokenize,
# /detokenize, and the checking of a generation body over OFF_LOOP_BYTES (on the event loop
# 8M ids took 0.78 s; two clients detokenizing 2.8M ids held /health p99 at 1.3 s). Past it: 503.
WORK_AT_ONCE: Final = 2
OFF_LOOP_BYTES: Final = 256 * 1024
# An answer written from a thread's work goes out this many bytes at a time, each after the last
# drained, so an unread one holds its slot until the write deadline drops it.
ANSWER_PIECE_BYTES: Final = 256 * 1024
BUSY: Final = "the server is at work on other large requests; retry"
Generated = bytes | AsyncGenerator[bytes, None]  # a JSON answer, or the events of a stream
_JSON_HEADERS: Final = [(b"content-type", b"application/json")]
_SSE_HEADERS: Final = [(b"content-type", b"text/event-stream; charset=utf-8")]
_RETRY: Final = (b"retry-after", str(RETRY_AFTER_SECONDS).encode())


def _error_body(error: ApiError) -> bytes:
    kinds = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "BadRequestError"}
    kind = kinds.get(error.status, "Error")
    return orjson.dumps(
        {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.status}}
    )


async def _send(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_error(send: Send, error: ApiError) -> None:
    headers = [*_JSON_HEADERS, _RETRY] if error.status == 503 else _JSON_HEADERS
    await _send(send, error.status, _error_body(error), headers)


async def _send_in_pieces(send: Send, answer: bytes) -> None:
    """A JSON answer, ANSWER_PIECE_BYTES at a time: uvicorn waits for each piece to drain before it
    takes the next, so this returns once the answer is out (or the write deadline dropped it)."""
    length = (b"content-length", str(len(answer)).encode())
    await send({"type": "http.response.start", "status": 200, "headers": [*_JSON_HEADERS, length]})
    for start in range(0, len(answer), ANSWER_PIECE_BYTES):
        piece = answer[start : start + ANSWER_PIECE_BYTES]
        await send({"type": "http.response.body", "body": piece, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


class Client:
    """The other end of one request: whether it went away, and the event that wakes its stream."""

    __slots__ = ("left", "wake")

    def __init__(self) -> None:
        self.left = False
        self.wake: asyncio.Event | None = None

    def leave(self, _: object = None) -> None:
        self.left = True
        if self.wake is not None:
            self.wake.set()


class Api:
    def __init__(
        self,
        served: Served,
        make_engine: Callable[[Callable[[Ticket], None]], RealTimeFleet],
        *,
        prefix_caching: bool,
        on_record: Callable[[Ticket, RealTimeFleet], None] | None = None,
        body_limits: BodyLimits,
        arriving: ArrivingBodies,
        max_in_flight: int = MAX_IN_FLIGHT,
        admin_token: bytes | None = None,
    ) -> None:
        """``body_limits`` and ``arriving``: what a request body may cost, as ``kvlens serve``'s
        (its settings' deadline, pause and pace; MAX_BODY_BYTES here). ``max_in_flight``: the
        prompts the fleet holds at most (:data:`MAX_IN_FLIGHT`). ``admin_token``: the bearer
        token ``/reset_prefix_cache`` requires (None: none)."""
        self.served = served
        self.max_in_flight = max_in_flight
        self._admin_token = admin_token
        self._at_work = IngestGate(WORK_AT_ONCE)
        self._body_limits = body_limits
        self._tokenize_limits = dataclasses.replace(body_limits, max_bytes=MAX_TOKENIZE_BODY_BYTES)
        self._arriving = arriving
        self._make_engine = make_engine
        self._prefix_caching = prefix_caching
        self._on_record = on_record
        self.engine: RealTimeFleet | None = None
        self.metrics: FleetMetrics | None = None
        self.created = int(time.time())

    def app(self) -> Callable[[Scope, Receive, Send], Any]:
        """The generation routes as plain ASGI (the hot path: no router, request object or task
        group per request), everything else through Starlette."""
        routes = [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),
            Route("/metrics", self.scrape, methods=["GET"]),
        ]
        rest = Starlette(routes=routes, lifespan=self._lifespan)
        generation = {
            "/v1/completions": (requests.completion, self.completions),
            "/v1/chat/completions": (requests.chat, self.chat),
        }
        tokens = {"/tokenize": requests.tokenize, "/detokenize": requests.detokenize}

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            path = scope["path"] if scope["type"] == "http" else None
            if path not in generation and path not in tokens:
                await rest(scope, receive, send)
            elif scope["method"] != "POST":
                await _send(send, 405, b'{"detail":"Method Not Allowed"}', _JSON_HEADERS)
            elif path in tokens:
                await self._tokens(tokens[path], receive, send, scope)
            else:
                await self._generate(*generation[path], scope, receive, send)

        return app

    async def _generate(
        self,
        check: Callable[[Served, dict[str, Any], str | None], Asked],
        handler: Callable[[Asked, Client], Any],
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        request_id = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                request_id = value.decode("latin-1")
        client = Client()
        try:
            raw = await self._read_body(scope, receive, self._body_limits)
            asked = await self._checked(check, raw, request_id)
        except ApiError as error:
            await _send_error(send, error)
            return
        if asked is None:
            return
        # The client's going away is heard through receive() (uvicorn answers http.disconnect
        # when the connection is lost): the answer wakes and stops, its prompts leave the fleet.
        watcher = asyncio.ensure_future(receive())
        watcher.add_done_callback(client.leave)
        try:
            try:
                answer: Generated = await handler(asked, client)
            except ApiError as error:
                await _send_error(send, error)
                return
            if isinstance(answer, bytes):
                await _send(send, 200, answer, _JSON_HEADERS)
                return
            try:
                await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
                async for chunk in answer:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                await answer.aclose()
        finally:
            watcher.remove_done_callback(client.leave)
            watcher.cancel()

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.engine = self._make_engine(self._finished)
        self.metrics = FleetMetrics(
            self.served.model,
            self.engine.replicas,
            self.served.max_model_len,
            self.engine.fleet.block_size,
            self._prefix_caching,
        )
        yield

    async def _checked(
        self,
        check: Callable[[Served, dict[str, Any], str | None], Asked],
        raw: bytes | None,
        request_id: str | None,
    ) -> Asked | None:
        """The body parsed and checked: on the event loop when it is small (the hot path), else on
        a thread, WORK_AT_ONCE at a time (503 past it). None: the client went away."""
        if raw is None:
            return None
        if len(raw) <= OFF_LOOP_BYTES:
            return check(self.served, requests.parse(self.served, raw), request_id)
        async with self._at_work.slot() as admitted:
            if not admitted:
                raise ApiError(BUSY, status=503)
            return await asyncio.to_thread(
                lambda: check(self.served, requests.parse(self.served, raw), request_id)
            )

    async def _tokens(
        self, work: Callable[[Served, bytes], bytes], receive: Receive, send: Send, scope: Scope
    ) -> None:
        """``/tokenize`` and ``/detokenize``: the body within MAX_TOKENIZE_BODY_BYTES, its work on a
        thread, WORK_AT_ONCE requests at once from their work to the end of their answer (503 past
        it), so unread answers cannot pile up beyond them."""
        try:
            raw = await self._read_body(scope, receive, self._tokenize_limits)
            if raw is None:
                return
            async with self._at_work.slot() as admitted:
                if not admitted:
                    raise ApiError(BUSY, status=503)
                answer = await asyncio.to_thread(work, self.served, raw)
                await _send_in_pieces(send, answer)
        except ApiError as error:
            await _send_error(send, error)

    # --- the fleet's hook -------------------------------------------------------------------

    def _finished(self, ticket: Ticket) -> None:
        engine, metrics, job = self.engine, self.metrics, ticket.job
        assert engine is not None and metrics is not None
        started = not ticket.left_waiting
        metrics.finished(
            job.replica,
            prompt_tokens=job.prompt_tokens,
            cached_tokens=job.cached_tokens,
            output_tokens=job.output_tokens,
            started=started,
            aborted=ticket.aborted,
            queue=engine.wall_seconds(job.start - job.arrival),
            prefill=engine.wall_seconds(job.first_token - job.start),
            decode=engine.wall_seconds(job.finish - job.first_token),
        )
        if started and self._on_record is not None:
            self._on_record(ticket, engine)

    # --- routes -----------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        served = self.served
        card = {
            "id": served.model,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": served.model,
            "parent": None,
            "max_model_len": served.max_model_len,
            "permission": [],
        }
        # vLLM lists each LoRA adapter too, its parent the base model
        adapters = [{**card, "id": name, "root": name, "parent": served.model} for name in served.loras]
        return Response(orjson.dumps({"object": "list", "data": [card, *adapters]}), media_type=JSON)

    async def reset_prefix_cache(self, request: Request) -> Response:
        assert self.engine is not None
        token = self._admin_token
        if token is not None and not bearer_matches(request.headers.get("authorization", ""), token):
            error = ApiError("missing or invalid bearer token (admin_token)", status=401)
            return Response(_error_body(error), 401, media_type=JSON, headers={"WWW-Authenticate": "Bearer"})
        self.engine.reset_prefix_cache()
        return Response(status_code=200)

    async def scrape(self, request: Request) -> Response:
        assert self.metrics is not None
        return Response(generate_latest(self.metrics.registry), media_type="text/plain; version=0.0.4")

    async def completions(self, answer: Asked, client: Client) -> Generated:
        tickets = self._submit(answer, client)
        if answer.stream:
            return self._completion_stream(answer, tickets, client)
        if not await self._all_finished(tickets, client):
            return b""  # its client went away
        texts = [self.served.codec.generated_text(t.job.output_tokens) for t in tickets]
        return openai.completion(answer.request_id, self.served.model, texts, _usage(tickets, tickets[-1]))

    async def chat(self, answer: Asked, client: Client) -> Generated:
        tickets = self._submit(answer, client)
        if answer.stream:
            return self._chat_stream(answer, tickets, client)
        if not await self._all_finished(tickets, client):
            return b""  # its client went away
        ticket = tickets[0]
        text = self.served.codec.generated_text(ticket.job.output_tokens)
        return openai.chat_completion(answer.request_id, self.served.model, text, _usage(tickets, ticket))

    # --- checking requests ------------------------------------------------------------------

    async def _read_body(self, scope: Scope, receive: Receive, limits: BodyLimits) -> bytes | None:
        """The request's body within ``kvlens serve``'s bounds for one, read by the same
        :class:`~kvlens.http.bodies.BodyReader`: 413 past ``limits.max_bytes`` (from its
        Content-Length, or as it arrives), 408 past the deadline or a pause, 503 while too many
        bodies or bytes are arriving. None: the client went away."""
        declared = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                declared = value
        try:
            return await BodyReader(receive, declared, limits, self._arriving).body()
        except PayloadTooLarge:
            raise ApiError(f"the request body is larger than {limits.max_bytes} bytes", status=413) from None
        except BodyTooSlow as error:  # past the deadline, a pause or the pace: the reader says which
            raise ApiError(str(error), status=408) from None
        except ArrivingBytesFull:
            raise ApiError("request bodies arriving hold too many bytes; retry", status=503) from None
        except Busy:
            raise ApiError("too many request bodies arriving; retry", status=503) from None
        except ClientDisconnected:
            return None

    def _submit(self, answer: Asked, client: Client) -> list[Ticket]:
        engine = self.engine
        assert engine is not None
        if engine.in_flight + len(answer.prompts) > self.max_in_flight:
            raise ApiError(
                f"the simulated fleet holds {engine.in_flight} prompts in flight and takes at most "
                f"{self.max_in_flight} (--max-in-flight); this request has {len(answer.prompts)}: retry",
                status=503,
            )
        wake = client.wake = asyncio.Event()
        many = len(answer.prompts) > 1
        return [
            engine.submit(
                ids,
                out,
                wake,
                f"{answer.request_id}-{i}" if many else answer.request_id,
                answer.cache_salt,
                answer.lora,
            )
            for i, (ids, out) in enumerate(zip(answer.prompts, answer.outputs, strict=True))
        ]

    async def _all_finished(self, tickets: list[Ticket], client: Client) -> bool:
        """Until every prompt finished (True); a client that leaves takes them out of the fleet
        (False: nobody reads an answer, which is then not built: a batch's is up to 33 MB)."""
        engine = self.engine
        assert engine is not None
        wake = tickets[0].wake
        while not all(t.finished for t in tickets):
            wake.clear()
            if client.left:
                for ticket in tickets:
                    engine.abort(ticket)
                return False
            await wake.wait()
        return not client.left

    # --- streaming --------------------------------------------------------------------------

    async def _paced(
        self, tickets: list[Ticket], client: Client
    ) -> AsyncIterator[list[tuple[int, int, int]]]:
        """Batches of (prompt, first token, end token) as they come due; a client that goes away
        takes its unfinished prompts out of the fleet."""
        engine = self.engine
        assert engine is not None
        loop = asyncio.get_running_loop()
        wake = tickets[0].wake
        emitted = [0] * len(tickets)
        try:
            while True:
                wake.clear()  # before reading the state: an event set after this is not lost
                now = engine.now()
                due = []
                for index, ticket in enumerate(tickets):
                    count = ticket.tokens_due(now)
                    if count > emitted[index]:
                        due.append((index, emitted[index], count))
                        emitted[index] = count
                if due:
                    yield due
                if all(t.finished and emitted[i] == t.job.output_tokens for i, t in enumerate(tickets)):
                    return
                next_at = min(t.next_token_at(emitted[i]) for i, t in enumerate(tickets))
                timer = loop.call_at(engine.wall_at(next_at), wake.set) if next_at < INF else None
                await wake.wait()
                if timer is not None:
                    timer.cancel()
                if client.left:
                    return
        finally:
            for ticket in tickets:
                if not ticket.finished:
                    engine.abort(ticket)

    async def _completion_stream(
        self, answer: Asked, tickets: list[Ticket], client: Client
    ) -> AsyncGenerator[bytes, None]:
        opening = openai.head(answer.request_id, "text_completion", self.served.model)
        events = openai.CompletionEvents(opening)
        prefixes = [events.opening(index) for index in range(len(tickets))]
        texts = [orjson.dumps(piece) for piece in self.served.codec.generated_pieces()]
        going, ending = events.going, events.ending
        first: Ticket | None = None
        async for due in self._paced(tickets, client):
            out: list[bytes] = []
            for index, start, end in due:
                ticket = tickets[index]
                first = first or ticket
                last = ticket.job.output_tokens
                prefix = prefixes[index]
                for position in range(start, end):
                    out += (prefix, texts[position % len(texts)], ending if position == last - 1 else going)
                    if len(out) >= PIECE_PARTS:
                        yield b"".join(out)
                        out.clear()
            if out:
                yield b"".join(out)
        if answer.include_usage:
            yield openai.usage_chunk(opening, _usage(tickets, first))
        yield openai.DONE

    async def _chat_stream(
        self, answer: Asked, tickets: list[Ticket], client: Client
    ) -> AsyncGenerator[bytes, None]:
        opening = openai.head(answer.request_id, "chat.completion.chunk", self.served.model)
        events = openai.ChatEvents(opening)
        texts = [orjson.dumps(piece) for piece in self.served.codec.generated_pieces()]
        role, content, going, ending = events.role, events.content, events.going, events.ending
        ticket = tickets[0]
        async for due in self._paced(tickets, client):
            out: list[bytes] = []
            for _, start, end in due:
                if start == 0:
                    out.append(role)
                last = ticket.job.output_tokens
                for position in range(start, end):
                    out += (content, texts[position % len(texts)], ending if position == last - 1 else going)
                    if len(out) >= PIECE_PARTS:
                        yield b"".join(out)
                        out.clear()
            if out:
                yield b"".join(out)
        if answer.include_usage:
            yield openai.usage_chunk(opening, _usage(tickets, ticket))
        yield openai.DONE


def _usage(tickets: Sequence[Ticket], cached_from: Ticket | None) -> dict[str, Any]:
    """The answer's usage: its prompts and outputs summed, the cached tokens of ``cached_from``
    (vLLM's: several prompts, the last one's; streaming, the first to answer)."""
    return openai.usage(
        sum(len(t.prompt_ids) for t in tickets),
        sum(t.job.output_tokens for t in tickets),
        cached_from.job.cached_tokens if cached_from else 0,
    )
