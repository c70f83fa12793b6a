"""The articles' prefix-cache protocol: one fixed request sequence, three arms.

- **off**: an endpoint started without prefix caching (``vllm serve --no-enable-prefix-caching``,
  ``kvlens simulate serve --no-prefix-caching``); the runner checks that every cached count is 0;
- **cold**: prefix caching on, the cache emptied first (``POST /reset_prefix_cache`` on vLLM in dev
  mode, ``POST /flush_cache`` on SGLang); an endpoint that cannot be emptied is not called cold
  unless the user says it is empty (``assume_empty``);
- **warm**: emptied, then a warm-up that looks like real traffic (a separate warm-up trace, or the
  part of the trace before ``measure_from``), recorded apart and timed apart (the measured window
  starts when the warm-up has finished), then the measured window.

Every arm sends the measured window with the same arrivals (seconds after the window's start).
No arm is ever warmed with the requests it is about to measure: that would be a perfect cache
built from knowledge of the future, which production never has.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import orjson

from kvlens.errors import InputError, ScrapeError
from kvlens.experiment import calls
from kvlens.experiment.client import MEASURE, Endpoint, Planned
from kvlens.simulate.trace import TraceRequest
from kvlens.sources.vllm_metrics import families

log = logging.getLogger("kvlens.experiment")

RESET_PATHS = ("/reset_prefix_cache", "/flush_cache")  # vLLM (dev mode), SGLang


class ExperimentError(InputError):
    """The experiment cannot run as asked (an endpoint down, an arm that cannot be what it says)."""


@dataclass(frozen=True)
class Window:
    """The trace cut into the warm-up and the measured window."""

    warmup: list[TraceRequest]
    measure: list[TraceRequest]
    measure_from: float  # trace seconds where the measured window starts


def split(requests: Iterable[TraceRequest], measure_from: float | None) -> Window:
    """Requests arriving before ``measure_from`` warm up, the rest are measured. Without it, the
    first half of the requests (by arrival) warm up: the warm state then comes from earlier
    traffic of the same workload, never from the requests about to be measured."""
    ordered = list(requests)
    if not ordered:
        raise ExperimentError("the trace holds no request")
    if measure_from is None:
        measure_from = ordered[len(ordered) // 2].arrival
    if math.isnan(measure_from):
        raise ExperimentError("--measure-from must be a number of seconds")
    warmup = [r for r in ordered if r.arrival < measure_from]
    measure = [r for r in ordered if r.arrival >= measure_from]
    if not measure:
        raise ExperimentError(f"no request arrives at or after --measure-from {measure_from:g} s")
    return Window(warmup, measure, measure_from)


def plan(
    requests: Iterable[TraceRequest],
    *,
    start: float,
    speed: float = 1.0,
    max_output_tokens: int | None = None,
    phase: str = MEASURE,
) -> Iterator[Planned]:
    """Each request sent ``(arrival - start) / speed`` seconds after the replay starts, asking for
    the trace's output length (capped at ``max_output_tokens``)."""
    if not (math.isfinite(speed) and speed > 0):
        raise ExperimentError("--speed must be a positive number")
    for request in requests:
        output = max(1, request.output_tokens)
        if max_output_tokens is not None:
            output = min(output, max_output_tokens)
        yield Planned(request, max(0.0, (request.arrival - start) / speed), output, phase)


def check_reachable(endpoint: Endpoint) -> list[str]:
    """The endpoint's served model names; a clear error when it is down (or gives no whole answer
    within CHECK_SECONDS), or does not serve the endpoint's model, before any arm runs: every
    request to a model not served fails (vLLM answers 404), and a run of failures is no arm."""
    served = _served_models(endpoint)
    if endpoint.model not in served:
        shown = ", ".join(repr(name[:100]) for name in served[:SHOWN_MODELS]) or "nothing"
        if len(served) > SHOWN_MODELS:
            shown += f", ... ({len(served)} in all)"
        raise ExperimentError(
            f"{endpoint.url} does not serve --model {endpoint.model!r} (it serves: {shown})"
        )
    return served


SHOWN_MODELS = 10  # served names listed when --model is not one of them


def _served_models(endpoint: Endpoint) -> list[str]:
    try:
        answer = calls.call_now(
            endpoint.url, "GET", "/v1/models", headers=endpoint.headers, seconds=calls.CHECK_SECONDS
        )
    except ScrapeError as error:
        raise ExperimentError(f"{endpoint.url} does not answer ({error})") from None
    if answer.status != 200:
        raise ExperimentError(f"{endpoint.url}/v1/models answered {answer.status}")
    found = model_ids(answer.body)
    if found is None:
        raise ExperimentError(f"{endpoint.url}/v1/models is not an OpenAI model list")
    return found


def model_ids(body: bytes | bytearray) -> list[str] | None:
    """The served model names of a ``/v1/models`` answer, or None when it is not a model list."""
    try:
        return [str(model["id"]) for model in orjson.loads(body)["data"]]
    except (ValueError, KeyError, TypeError):
        return None


def max_model_len(endpoint: Endpoint) -> int | None:
    """The context length the endpoint serves its model with, from its ``/v1/models`` (vLLM,
    SGLang and kvlens simulate serve give ``max_model_len``), or None when it does not say (or
    cannot be asked: :func:`check_reachable` says why)."""
    try:
        answer = calls.call_now(
            endpoint.url, "GET", "/v1/models", headers=endpoint.headers, seconds=calls.CHECK_SECONDS
        )
        cards = orjson.loads(answer.body)["data"] if answer.status == 200 else []
    except (ScrapeError, ValueError, KeyError, TypeError):
        return None
    for card in cards if isinstance(cards, list) else []:
        if isinstance(card, dict) and card.get("id") == endpoint.model:
            length = card.get("max_model_len")
            return length if type(length) is int and length > 0 else None
    return None


def check_context(endpoint: Endpoint, requests: Iterable[TraceRequest]) -> None:
    """Refuse, before any prompt is built or sent, requests the endpoint cannot take: a prompt
    of ``max_model_len`` tokens or more leaves no room to generate one (vLLM and kvlens simulate
    serve answer 400; building it first cost memory for nothing: tens of bytes a token). Without
    a ``max_model_len`` the trace's own bound (``records.MAX_TOKENS``) is the only one. The whole
    run is refused, not the requests alone: arms must send the same sequence, and a trace
    quietly thinned is not the workload asked for."""
    limit = max_model_len(endpoint)
    if limit is None:
        return
    over = [request for request in requests if request.prompt_tokens >= limit]
    if over:
        first = min(over, key=lambda request: request.index)
        requests_leave = "requests of the trace leave" if len(over) > 1 else "request of the trace leaves"
        raise ExperimentError(
            f"{endpoint.url} serves model {endpoint.model!r} with max_model_len {limit:,}: {len(over):,} "
            f"{requests_leave} no room for it to generate a token (the first: trace_index {first.index}, "
            f"{first.prompt_tokens:,} prompt tokens); nothing was sent"
        )


def reset_cache(endpoint: Endpoint) -> str | None:
    """Empty the endpoint's prefix cache; the path that did it, or None when none could within
    RESET_SECONDS (every path together)."""
    deadline = time.monotonic() + calls.RESET_SECONDS
    for path in RESET_PATHS:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            answer = calls.call_now(endpoint.url, "POST", path, headers=endpoint.headers, seconds=left)
        except ScrapeError as error:
            log.debug("%s", error)
            continue
        if answer.status == 200:
            return path
    return None


def measured_window(
    requests: Iterable[TraceRequest], measure_from: float | None, warmup: list[TraceRequest] | None
) -> Window:
    """The window of ``--warmup-trace`` (that file warms up; the whole trace is measured), or of
    ``--measure-from`` (and its default, see :func:`split`)."""
    if warmup is None:
        return split(requests, measure_from)
    measure = list(requests)
    if not measure:
        raise ExperimentError("the trace holds no request")
    return Window(warmup, measure, measure[0].arrival)


def engine_block_size(endpoint: Endpoint) -> int | None:
    """The engine's KV block size from its ``/metrics`` (vLLM's ``vllm:cache_config_info``), or
    None when it does not say (or gives no whole answer within CHECK_SECONDS)."""
    try:
        answer = calls.call_now(
            endpoint.url, "GET", "/metrics", headers=endpoint.headers, seconds=calls.CHECK_SECONDS
        )
    except ScrapeError:
        return None
    return block_size_in(answer.body) if answer.status == 200 else None


def block_size_in(exposition: bytes | bytearray) -> int | None:
    """The KV block size an engine's ``/metrics`` states (vLLM's ``vllm:cache_config_info``), or
    None when it states none or is no exposition kvlens reads."""
    try:
        found = list(families(exposition.decode("utf-8", "replace")))
    except ScrapeError:
        return None
    for family in found:
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info" and sample.labels.get("block_size", "").isdigit():
                return int(sample.labels["block_size"])
    return None


def block_size_warning(trace_block_size: int, engine: int | None) -> str | None:
    """A trace's blocks must be whole engine blocks, or shared prefixes end mid-block and the
    engine reuses less than the trace shares."""
    if engine is None:
        return None
    if trace_block_size % engine:
        return (
            f"the trace's blocks are {trace_block_size} tokens, not a multiple of the engine's "
            f"{engine}: the engine reuses only the whole blocks of each shared prefix"
        )
    return None
