"""Did a gain come from faster steps or from more KV (article 2)? Decided from what each
endpoint's ``/metrics`` said during a step (vLLM's ``num_requests_running``,
``num_requests_waiting``, ``num_preemptions_total``, ``kv_cache_usage_perc``) and from the
requests' own inter-token latency; never guessed.

The rule (:func:`attribute`), the candidate against the baseline on the same requests:

- **Faster steps**: at a matched running batch, the candidate's inter-token latency is lower
  beyond noise. A request's batch is how many requests were decoding beside it, on average
  over its decode, from the requests' own first-token and end times (:func:`batches`: exact,
  where samples of ``num_requests_running`` seconds apart miss a decode of 100 ms); batches are
  matched within BATCH_BAND (requests in the same band ``[1.25^k, 1.25^(k+1))``); in every band
  with MIN_MATCHED requests or more on both sides the ratio of median ITLs is taken, and their
  geometric mean, weighted by the smaller side's count, is the ITL ratio. Lower beyond noise:
  under ``1 - NOISE`` (a gain of 5 %). Comparing at a matched batch matters: an endpoint that
  runs fewer requests at once has faster steps for that alone.
- **More capacity**: more requests ran at once (the 95th percentile of ``num_requests_running``
  higher by at least one request and 10 %, while the baseline was held at its own: MIN_HELD
  samples or more with requests waiting while it ran its 95th percentile or more; a burst
  arriving at once makes a line for a moment, not a limit), fewer were
  preempted (the baseline's ``num_preemptions_total`` rose during the step and the candidate's
  rose less), or fewer waited for memory (the baseline had requests waiting while its KV cache
  was NEAR_FULL, and the candidate's mean waiting is lower by 10 % and at least 0.5 request).
  Fewer waiting alone is not capacity: faster steps empty a line too.
- **Both** when both; **neither** when neither; **cannot tell** when either endpoint's metrics
  are missing (no sample with running and waiting), and for faster steps alone when no band has
  MIN_MATCHED requests on both sides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from kvlens import bandwidth, limits
from kvlens.simulate.trace import TraceRequest

BATCH_BAND: Final = 1.25
MIN_MATCHED: Final = 3
NOISE: Final = 0.05
MORE_AT_ONCE: Final = 0.10
FEWER_WAITING: Final = 0.10
NEAR_FULL: Final = 0.9
MIN_HELD: Final = 2
LONG_PER_SLOT: Final = 2  # long requests made per --concurrency slot (:func:`long_requests`)


@dataclass(frozen=True)
class Sample:
    """One scrape of an endpoint's ``/metrics`` (None: the endpoint does not report it)."""

    time: float  # unix seconds, the client's clock (as the records' arrival_time)
    running: float | None
    waiting: float | None
    preemptions: float | None  # the counter's value
    kv_usage: float | None  # 0-1


@dataclass(frozen=True)
class Decode:
    """A finished request's decode: from its first token to its end (unix seconds, the client's
    clock), and its mean inter-token latency."""

    start: float
    end: float
    itl_seconds: float


@dataclass
class Verdict:
    verdict: str  # faster steps | more capacity | both | neither | cannot tell
    reasons: list[str] = field(default_factory=list)  # the figures that decide it
    itl_ratio: float | None = None  # candidate / baseline at matched batches
    matched_requests: int = 0

    def as_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "reasons": self.reasons,
            "itl_ratio_at_matched_batch": self.itl_ratio,
            "matched_requests": self.matched_requests,
        }


def decodes(records: Sequence[dict[str, Any]]) -> list[Decode]:
    """The finished requests of a records file that have a decode (two tokens or more)."""
    out = []
    for record in records:
        arrival, ttft, e2e = (record.get(k) for k in ("arrival_time", "ttft_seconds", "e2e_seconds"))
        itl = record.get("client_tpot_seconds")
        if "error" in record or not all(isinstance(v, (int, float)) for v in (arrival, ttft, e2e, itl)):
            continue
        out.append(Decode(float(arrival) + float(ttft), float(arrival) + float(e2e), float(itl)))  # type: ignore[arg-type]
    return out


def _reported(samples: Sequence[Sample]) -> list[Sample]:
    return [s for s in samples if s.running is not None and s.waiting is not None]


def batches(decoded: Sequence[Decode]) -> list[float]:
    """Each request's running batch: how many of the requests (itself included) were decoding,
    between their first token and their end, on average over its own decode. The client sees
    every request's window, so this is exact where ``/metrics`` samples are seconds apart and a
    short decode falls between two. (Requests still in their prefill are not counted: they read
    no KV in a decode step.)"""
    if not decoded:
        return []
    starts = np.array([d.start for d in decoded])
    ends = np.maximum(np.array([d.end for d in decoded]), starts)
    times = np.concatenate([starts, ends])
    order = np.argsort(times, kind="stable")
    steps = np.concatenate([np.ones(len(starts)), -np.ones(len(ends))])[order]
    times = times[order]
    running = np.cumsum(steps)  # after each event
    # integral of the running count from the first event to each event
    area = np.concatenate([[0.0], np.cumsum(running[:-1] * np.diff(times))])

    def integral(at: np.ndarray[Any, np.dtype[np.float64]]) -> np.ndarray[Any, np.dtype[np.float64]]:
        index = np.searchsorted(times, at, side="right") - 1
        value: np.ndarray[Any, np.dtype[np.float64]] = area[index] + running[index] * (at - times[index])
        return value

    span = ends - starts
    mean = (integral(ends) - integral(starts)) / np.where(span > 0, span, 1.0)
    return [float(v) if w > 0 else 1.0 for v, w in zip(mean, span, strict=True)]


def _band(batch: float) -> int:
    return math.floor(math.log(max(batch, 1.0)) / math.log(BATCH_BAND))


def itl_at_matched_batch(baseline: Sequence[Decode], candidate: Sequence[Decode]) -> tuple[float | None, int]:
    """The candidate's ITL over the baseline's at matched running batches (:func:`batches`), and
    how many requests (the smaller side, summed over bands) were matched; None when no band has
    MIN_MATCHED on both."""
    bands: list[dict[int, list[float]]] = []
    for decoded in (baseline, candidate):
        by_band: dict[int, list[float]] = {}
        for decode, batch in zip(decoded, batches(decoded), strict=True):
            by_band.setdefault(_band(batch), []).append(decode.itl_seconds)
        bands.append(by_band)
    logs, weights = [], []
    for band, base in bands[0].items():
        cand = bands[1].get(band, [])
        if len(base) >= MIN_MATCHED and len(cand) >= MIN_MATCHED:
            base_median, cand_median = float(np.median(base)), float(np.median(cand))
            if base_median > 0 and cand_median > 0:
                logs.append(math.log(cand_median / base_median))
                weights.append(min(len(base), len(cand)))
    if not weights:
        return None, 0
    return math.exp(float(np.average(logs, weights=weights))), int(sum(weights))


def _p95(values: list[float]) -> float:
    return float(np.percentile(values, 95))


def _risen(samples: Sequence[Sample]) -> float | None:
    counts = [s.preemptions for s in samples if s.preemptions is not None]
    return counts[-1] - counts[0] if counts else None


def attribute(
    baseline: tuple[Sequence[Decode], Sequence[Sample]],
    candidate: tuple[Sequence[Decode], Sequence[Sample]],
    names: tuple[str, str] = ("baseline", "candidate"),
) -> Verdict:
    """The rule of the module docstring: the candidate's gain over the baseline, with its figures."""
    base_name, cand_name = names
    base_samples, cand_samples = _reported(baseline[1]), _reported(candidate[1])
    missing = [n for n, s in ((base_name, base_samples), (cand_name, cand_samples)) if not s]
    if missing:
        return Verdict(
            "cannot tell",
            [f"{' and '.join(missing)} reported no num_requests_running / num_requests_waiting"],
        )
    reasons: list[str] = []
    ratio, matched = itl_at_matched_batch(baseline[0], candidate[0])
    faster: bool | None = None
    if ratio is None:
        reasons.append(
            f"ITL at a matched running batch: cannot tell (no batch band with {MIN_MATCHED} requests on both)"
        )
    else:
        faster = ratio <= 1 - NOISE
        reasons.append(
            f"ITL at a matched running batch: {cand_name} {ratio:.2f}x {base_name}'s over {matched} matched "
            f"requests ({'lower' if faster else 'not lower'} beyond the {NOISE:.0%} noise floor)"
        )
    capacity = False
    base_running = [float(s.running) for s in base_samples if s.running is not None]
    cand_running = [float(s.running) for s in cand_samples if s.running is not None]
    base_waiting = [float(s.waiting) for s in base_samples if s.waiting is not None]
    cand_waiting = [float(s.waiting) for s in cand_samples if s.waiting is not None]
    base_peak, cand_peak = _p95(base_running), _p95(cand_running)
    # a line while it ran its most: held at a limit (memory, max running), not a burst arriving
    held = [s for s in base_samples if (s.waiting or 0) > 0 and (s.running or 0) >= base_peak]
    if len(held) >= MIN_HELD and cand_peak >= base_peak + max(1.0, MORE_AT_ONCE * base_peak):
        capacity = True
        reasons.append(
            f"more ran at once: {cand_name} {cand_peak:.0f} running (p95) against {base_peak:.0f}, "
            f"{base_name} held there with a line in {len(held)} samples (up to "
            f"{max(s.waiting or 0 for s in held):.0f} waiting)"
        )
    base_pre, cand_pre = _risen(base_samples), _risen(cand_samples)
    if base_pre is not None and cand_pre is not None and base_pre > 0 and cand_pre < base_pre:
        capacity = True
        reasons.append(f"fewer preempted: {cand_pre:.0f} against {base_pre:.0f} on {base_name}")
    for_memory = [
        s for s in base_samples if (s.waiting or 0) > 0 and s.kv_usage is not None and s.kv_usage >= NEAR_FULL
    ]
    base_mean, cand_mean = float(np.mean(base_waiting)), float(np.mean(cand_waiting))
    if for_memory and cand_mean <= base_mean - max(0.5, FEWER_WAITING * base_mean):
        capacity = True
        reasons.append(
            f"fewer waited for memory: {cand_mean:.1f} waiting on average against {base_mean:.1f}, "
            f"{base_name}'s KV cache {NEAR_FULL:.0%} full or more in {len(for_memory)} samples with a line"
        )
    if not capacity:
        reasons.append(
            f"no more capacity: running p95 {cand_peak:.0f} against {base_peak:.0f}, mean waiting "
            f"{cand_mean:.1f} against {base_mean:.1f}, preempted {_count(cand_pre)} against "
            f"{_count(base_pre)}"
        )
    if faster is None and not capacity:
        verdict = "cannot tell"
    elif faster and capacity:
        verdict = "both"
    elif faster:
        verdict = "faster steps"
    elif capacity:
        verdict = "more capacity"
    else:
        verdict = "neither"
    return Verdict(verdict, reasons, ratio, matched)


def _count(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f}"


# --- what the byte model predicts --------------------------------------------------------


@dataclass(frozen=True)
class ByteModel:
    """The decode step of :mod:`kvlens.bandwidth` for each endpoint's weights: ``t0 + (W + B x
    S x c) / BW``."""

    weight_bytes: dict[str, float]  # per endpoint
    bandwidth_bytes_per_second: float
    kv_bytes_per_token: float
    step_overhead_seconds: float = 0.0

    def step_seconds(self, endpoint: str, batch: float, context_tokens: float) -> float | None:
        weights = self.weight_bytes.get(endpoint)
        if weights is None:
            return None
        kv = bandwidth.kv_bytes_per_sequence(context_tokens, self.kv_bytes_per_token)
        read = bandwidth.step_bytes(weights, batch, kv)
        return bandwidth.step_seconds(read, self.bandwidth_bytes_per_second, extra=self.step_overhead_seconds)


def output_tokens_per_second(records: Sequence[dict[str, Any]]) -> float | None:
    """Output tokens of the finished requests over the span from the first arrival to the last
    end (article 2's throughput, B / step time, as a client measures it)."""
    finished = [
        r
        for r in records
        if "error" not in r
        and all(isinstance(r.get(k), (int, float)) for k in ("arrival_time", "e2e_seconds"))
    ]
    if not finished:
        return None
    start = min(float(r["arrival_time"]) for r in finished)
    end = max(float(r["arrival_time"]) + float(r["e2e_seconds"]) for r in finished)
    tokens = sum(int(r.get("output_tokens") or 0) for r in finished)
    return tokens / (end - start) if end > start else None


def scheduler_summary(samples: Sequence[Sample]) -> dict[str, float | None]:
    """A step's scheduler figures for its row: running p95, mean waiting, preemptions during it
    (None: not reported)."""
    reported = _reported(samples)
    return {
        "engine_running_p95": _p95([float(s.running) for s in reported if s.running is not None])
        if reported
        else None,
        "engine_waiting_mean": float(np.mean([s.waiting for s in reported])) if reported else None,
        "engine_preemptions": _risen(samples),
    }


# --- experiment 1: fixed work ------------------------------------------------------------


def long_requests(
    requests: Sequence[TraceRequest],
    long_context: int,
    concurrency: int,
    limits: dict[str, int | None],
    max_output_tokens: int | None,
    block_size: int,
) -> tuple[list[TraceRequest], str]:
    """Long-context requests for a trace that has none (article 2 asks for short and long apart):
    ``LONG_PER_SLOT x concurrency`` prompts of ``long_context`` tokens, the trace's median output length; all
    but their last block shared (``block_size``: the prompts' blocks), so that after the first
    prefill each is mostly cached and the run measures decode at a long context, as the fixed
    work means to, not an engine's prefill lane. None, and why, when an endpoint's context
    (``limits``: max_model_len per endpoint) cannot take them."""
    outputs = sorted(max(1, r.output_tokens) for r in requests) or [16]
    output = outputs[len(outputs) // 2]
    output = min(output, max_output_tokens) if max_output_tokens is not None else output
    short = [
        f"{name} (max_model_len {limit:,})"
        for name, limit in limits.items()
        if limit is not None and limit <= long_context + output
    ]
    if short:
        return [], (
            f"long contexts (>= {long_context:,} prompt tokens): not measured: the trace has none and "
            f"{', '.join(short)} cannot take {long_context:,} + {output} tokens (--long-context)"
        )
    first = max((r.index for r in requests), default=-1) + 1
    shared = tuple((1 << 61) | i for i in range(max(0, long_context // block_size - 1)))
    count = LONG_PER_SLOT * concurrency
    made = [TraceRequest(first + i, 0.0, long_context, output, shared) for i in range(count)]
    return made, ""


def fixed_work_comparison(
    baseline: tuple[str, Sequence[dict[str, Any]], Sequence[Sample]],
    candidate: tuple[str, Sequence[dict[str, Any]], Sequence[Sample]],
    concurrency: int,
    byte_model: ByteModel | None,
) -> dict[str, Any]:
    """A fixed-work row's comparison with the baseline's row of the same context group: the
    measured ITL ratio (baseline / this, medians of the requests' mean ITL) beside the byte model's
    (each endpoint's step at the running batch its requests decoded in, :func:`_mean_batch`, and
    the group's mean context, prompt + half the output),
    and, for an endpoint other than the baseline, what its gain came from."""
    base_name, base_records, base_samples = baseline
    name, records, samples = candidate
    base_itl = median_of(base_records, "client_tpot_seconds")
    itl = median_of(records, "client_tpot_seconds")
    out: dict[str, Any] = {
        "itl_mean_p50_seconds": itl,
        "measured_itl_ratio": base_itl / itl if base_itl and itl else None,  # > 1: this one is faster
        "predicted_step_seconds": None,
        "predicted_itl_ratio": None,
    }
    contexts = [
        float(r["prompt_tokens"]) + float(r.get("output_tokens") or 0) / 2
        for r in records
        if "error" not in r and isinstance(r.get("prompt_tokens"), int)
    ]
    if byte_model is not None and contexts:
        context = float(np.mean(contexts))
        batch = _mean_batch(records, concurrency)
        base_batch = _mean_batch(base_records, concurrency)
        step = byte_model.step_seconds(name, batch, context)
        base_step = byte_model.step_seconds(base_name, base_batch, context)
        out["predicted_batch"] = batch
        out["predicted_step_seconds"] = step
        out["predicted_itl_ratio"] = base_step / step if step and base_step else None
    if name != base_name:
        verdict = attribute(
            (decodes(base_records), base_samples), (decodes(records), samples), (base_name, name)
        )
        out["gain_over_baseline"] = verdict.as_json()
    return out


def _mean_batch(records: Sequence[dict[str, Any]], concurrency: int) -> float:
    """The running batch the requests decoded in (the mean of each request's, :func:`batches`);
    ``concurrency`` when none decoded. A prefill lane or a full KV cache can keep it well under
    the slots the client fills."""
    found = batches(decodes(records))
    return max(1.0, float(np.mean(found))) if found else float(concurrency)


def median_of(records: Sequence[dict[str, Any]], key: str) -> float | None:
    """The median of a number field over the finished requests that have it, or None."""
    values = [float(r[key]) for r in records if "error" not in r and isinstance(r.get(key), (int, float))]
    return float(np.median(values)) if values else None


# --- the byte model from the command line ------------------------------------------------


def byte_model_from(
    weight_specs: Sequence[str] | None,
    bandwidth_text: str | None,
    kv_text: str | None,
    overhead_ms: float | None,
    names: Sequence[str],
    kept: ByteModel | None = None,
) -> ByteModel | None:
    """``--weight-bytes NAME=SIZE`` (per endpoint), ``--bandwidth``, ``--kv-bytes-per-token`` and
    ``--step-overhead-ms`` as a :class:`ByteModel`, over ``kept`` (an earlier run's into the same
    out-dir, whose endpoints may be run one at a time): a flag given replaces what it kept, an
    endpoint's weights are added to the others'. ``names``: the endpoints weights may be given for
    (this run's and the out-dir's). None when no weights are given or kept. Raises ValueError
    naming what is wrong or missing."""
    weights = dict(kept.weight_bytes) if kept is not None else {}
    for spec in weight_specs or []:
        name, separator, size = spec.partition("=")
        if not separator or name not in names:
            raise ValueError(
                f"--weight-bytes takes ENDPOINT=SIZE for an endpoint of this run or of --out-dir "
                f"({', '.join(names)})"
            )
        weights[name] = limits.parse_size(size)
    if not weights:
        return None
    bandwidth_bps = (
        bandwidth.parse_bandwidth(bandwidth_text)
        if bandwidth_text is not None
        else kept.bandwidth_bytes_per_second
        if kept is not None
        else None
    )
    kv = limits.parse_size(kv_text) if kv_text is not None else kept.kv_bytes_per_token if kept else None
    if bandwidth_bps is None or kv is None:
        raise ValueError("--weight-bytes needs --bandwidth and --kv-bytes-per-token for the byte model")
    if overhead_ms is not None and not (math.isfinite(overhead_ms) and overhead_ms >= 0):
        raise ValueError("--step-overhead-ms takes milliseconds >= 0")
    overhead = overhead_ms / 1000 if overhead_ms is not None else kept.step_overhead_seconds if kept else 0.0
    return ByteModel(weights, bandwidth_bps, kv, overhead)


def byte_model_json(model: ByteModel | None) -> dict[str, Any] | None:
    if model is None:
        return None
    return {
        "weight_bytes": model.weight_bytes,
        "bandwidth_bytes_per_second": model.bandwidth_bytes_per_second,
        "kv_bytes_per_token": model.kv_bytes_per_token,
        "step_overhead_seconds": model.step_overhead_seconds,
    }


def byte_model_of(value: Any) -> ByteModel | None:
    """:func:`byte_model_json` read back (None: none kept). ValueError when it is not one."""
    if value is None:
        return None
    try:
        weights = {str(name): float(size) for name, size in value["weight_bytes"].items()}
        model = ByteModel(
            weights,
            float(value["bandwidth_bytes_per_second"]),
            float(value["kv_bytes_per_token"]),
            float(value["step_overhead_seconds"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"not a byte model ({error!r})") from None
    if not all(math.isfinite(v) and v >= 0 for v in (*weights.values(), model.step_overhead_seconds)):
        raise ValueError("not a byte model (a size or time below 0)")
    if not (model.bandwidth_bytes_per_second > 0 and model.kv_bytes_per_token >= 0):
        raise ValueError("not a byte model (no bandwidth)")
    return model
