"""Did a gain come from faster steps or from more KV (article 2)? Decided from what each
endpoint's ``/metrics`` said during a step (vLLM's ``num_requests_running``,
``num_requests_waiting``, ``num_preemptions_total``, ``kv_cache_usage_perc``) and from the
requests' own inter-token latency; never guessed.

The rule (:func:`attribute`), the candidate against the baseline on the same requests:

- **Faster steps**: at a matched running batch, the candidate's inter-token latency is lower
  beyond noise. A request's batch is the mean ``num_requests_running`` of the samples taken
  during its decode (or the sample nearest its middle, within MATCH_GAP_SECONDS); batches are
  matched within BATCH_BAND (requests in the same band ``[1.25^k, 1.25^(k+1))``); in every band
  with MIN_MATCHED requests or more on both sides the ratio of median ITLs is taken, and their
  geometric mean, weighted by the smaller side's count, is the ITL ratio. Lower beyond noise:
  under ``1 - NOISE`` (a gain of 5 %). Comparing at a matched batch matters: an endpoint that
  runs fewer requests at once has faster steps for that alone.
- **More capacity**: more requests ran at once (the 95th percentile of ``num_requests_running``
  higher by at least one request and 10 %, while the baseline had requests waiting), fewer were
  preempted (the baseline's ``num_preemptions_total`` rose during the step and the candidate's
  rose less), or fewer waited for memory (the baseline had requests waiting while its KV cache
  was NEAR_FULL, and the candidate's mean waiting is lower by 10 % and at least 0.5 request).
  Fewer waiting alone is not capacity: faster steps empty a line too.
- **Both** when both; **neither** when neither; **cannot tell** when either endpoint's metrics
  are missing (no sample with running and waiting), and for faster steps alone when no band has
  MIN_MATCHED requests on both sides.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from kvlens import bandwidth

BATCH_BAND: Final = 1.25
MIN_MATCHED: Final = 3
NOISE: Final = 0.05
MORE_AT_ONCE: Final = 0.10
FEWER_WAITING: Final = 0.10
NEAR_FULL: Final = 0.9
MATCH_GAP_SECONDS: Final = 1.0


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


def batch_during(decode: Decode, samples: Sequence[Sample]) -> float | None:
    """The mean running batch the samples saw during ``decode`` (``samples`` sorted by time)."""
    times = [s.time for s in samples]
    low, high = bisect.bisect_left(times, decode.start), bisect.bisect_right(times, decode.end)
    inside = [s.running for s in samples[low:high] if s.running is not None]
    if inside:
        return float(np.mean(inside))
    middle = (decode.start + decode.end) / 2
    near = min(samples, key=lambda s: abs(s.time - middle), default=None)
    if near is None or near.running is None or abs(near.time - middle) > MATCH_GAP_SECONDS:
        return None
    return near.running


def _band(batch: float) -> int:
    return math.floor(math.log(max(batch, 1.0)) / math.log(BATCH_BAND))


def itl_at_matched_batch(
    baseline: tuple[Sequence[Decode], Sequence[Sample]], candidate: tuple[Sequence[Decode], Sequence[Sample]]
) -> tuple[float | None, int]:
    """The candidate's ITL over the baseline's at matched running batches, and how many requests
    (the smaller side, summed over bands) were matched; None when no band has MIN_MATCHED on both."""
    bands: list[dict[int, list[float]]] = []
    for decoded, samples in (baseline, candidate):
        ordered = sorted(samples, key=lambda s: s.time)
        by_band: dict[int, list[float]] = {}
        for decode in decoded:
            batch = batch_during(decode, ordered)
            if batch is not None:
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
    ratio, matched = itl_at_matched_batch((baseline[0], base_samples), (candidate[0], cand_samples))
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
    if max(base_waiting) > 0 and cand_peak >= base_peak + max(1.0, MORE_AT_ONCE * base_peak):
        capacity = True
        reasons.append(
            f"more ran at once: {cand_name} {cand_peak:.0f} running (p95) against {base_peak:.0f} while "
            f"up to {max(base_waiting):.0f} waited on {base_name}"
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
            f"{cand_mean:.1f} against {base_mean:.1f}, preempted {_count(cand_pre)} against {_count(base_pre)}"
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
