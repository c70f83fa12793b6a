"""The report of the second article's experiments (:mod:`kvlens.experiment.quantization` runs
them): every figure computed from the finished steps' records and engine samples in an out-dir,
whichever run made each step. Per endpoint and context group the fixed work's latencies against
the baseline's and the byte model's; per rate the attainment, goodput and what a gain came from
(:func:`kvlens.experiment.capacity.attribute`); the highest rate each endpoint holds. Nothing here
talks to an endpoint; the text report is :mod:`kvlens.experiment.quantization_text`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import orjson

from kvlens.experiment import capacity, outdir
from kvlens.experiment.capacity import ByteModel
from kvlens.experiment.engine_metrics import EngineSample
from kvlens.experiment.protocol import ExperimentError
from kvlens.stats import DEFAULT_PERCENTILES, named_percentiles

SCHEMA = "kvlens.quantization/v1"


@dataclass(frozen=True)
class Targets:
    ttft_seconds: float = 2.0
    itl_seconds: float = 0.05  # a request's mean inter-token latency (vLLM's TPOT)
    attainment: float = 0.9
    long_context: int = 4096  # prompts this long or longer are "long"


def group_of(step: outdir.Step) -> str:
    suffix = step.name.removeprefix(f"fixed-{step.endpoint}")
    return suffix.removeprefix("-") or "short"


def fixed_section(
    found: list[outdir.Found],
    names: list[str],
    byte_model: ByteModel | None,
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """Experiment 1 over the finished fixed steps of ``names`` (the first the baseline): per
    endpoint x context group the medians and output tokens/s, and against the baseline's row of
    the same group the ITL ratio beside the byte model's and what a gain came from."""
    read = {
        (f.step.endpoint, group_of(f.step)): (
            _read(f.records),
            _sample(f),
            int(f.meta.get("concurrency") or 1),
        )
        for f in found
        if f.step.kind == "fixed"
    }
    result: dict[str, Any] = {}
    for name in names:
        for group in ("short", "long"):
            if (name, group) not in read:
                continue
            records, sample, concurrency = read[name, group]
            row = latency(records, percentiles) | {
                "output_tokens_per_second": capacity.output_tokens_per_second(records)
            }
            base = read.get((names[0], group))
            if base is not None:
                row |= capacity.fixed_work_comparison(
                    (names[0], base[0], base[1].series),
                    (name, records, sample.series),
                    concurrency,
                    byte_model,
                )
            result.setdefault(name, {})[group] = row
    return result


def rate_rows(
    found: list[outdir.Found], targets: Targets, percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
) -> dict[str, dict[str, Any]]:
    """The rows of one rate's finished steps, one per endpoint, each with what it gained over
    each other endpoint at that rate (``gain_over``: :func:`capacity.attribute`)."""
    rows, seen = {}, {}
    for each in found:
        records, sample = _read(each.records), _sample(each)
        rows[each.step.endpoint] = _step(float(each.meta["rate"]), records, sample, targets, percentiles)
        seen[each.step.endpoint] = (capacity.decodes(records), sample.series)
    for name, row in rows.items():
        row["gain_over"] = {
            other: capacity.attribute(seen[other], seen[name], (other, name)).as_json()
            for other in rows
            if other != name
        }
    return rows


def _sample(found: outdir.Found) -> EngineSample:
    try:
        return EngineSample.from_json(found.meta.get("sample"))
    except ValueError as error:
        raise ExperimentError(
            f"{found.records.with_suffix(outdir.STEP_SUFFIX)}: its engine sample cannot be read ({error}); "
            "redo the step with --restart"
        ) from None


def merged(
    found: list[outdir.Found],
    names: list[str],
    targets: Targets,
    sweep: dict[str, Any] | None,
    *,
    byte_model: ByteModel | None = None,
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """The report over every endpoint's finished steps in an out-dir (``names`` in the order
    they were first run: the first is the baseline), whichever run made each, every comparison
    made here from the steps' records and engine samples. A sweep run one endpoint at a time
    doubles per endpoint: its halfway rates and the endpoints that never fell under are taken
    from every endpoint's steps, its stop from the last run."""
    names = [*names, *sorted({f.step.endpoint for f in found} - set(names))]
    fixed = fixed_section(found, names, byte_model, percentiles)
    by_rate: dict[float, list[outdir.Found]] = {}
    for f in found:
        if f.step.kind == "rate":
            by_rate.setdefault(float(f.meta["rate"]), []).append(f)
    rows: dict[str, list[dict[str, Any]]] = {}
    for rate in sorted(by_rate):
        at = rate_rows(by_rate[rate], targets, percentiles)
        for name in names:
            if name in at:
                rows.setdefault(name, []).append(at[name])
    load = None
    if rows:
        load = load_result({name: rows[name] for name in names if name in rows}, targets)
        if sweep is not None:
            ladder = {sweep["start"] * 2**k for k in range(sweep["max_doublings"] + 1)}
            load["sweep"] = {
                **sweep,
                "bisected": sorted({row["rate"] for each in rows.values() for row in each} - ladder),
                "never_fell_under": [
                    name
                    for name, each in rows.items()
                    if all(r["attainment"] >= targets.attainment for r in each)
                ],
            }
    notes = [note for f in found if f.step.kind == "fixed" for note in f.meta.get("not_measured") or []]
    result = report(
        fixed or None, load, targets, names[0], byte_model=byte_model, not_measured=list(dict.fromkeys(notes))
    )
    result["percentiles"] = list(percentiles)
    return result


def _read(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def load_result(steps: dict[str, list[dict[str, Any]]], targets: Targets) -> dict[str, Any]:
    best = {name: highest_passing(rows, targets) for name, rows in steps.items()}
    return {"steps": steps, "highest_rate": best, "attribution": _attribution(steps, best, targets)}


def report(
    fixed: dict[str, Any] | None,
    load: dict[str, Any] | None,
    targets: Targets,
    baseline: str,
    *,
    byte_model: ByteModel | None = None,
    not_measured: list[str] | None = None,
) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "baseline": baseline,
        "targets": {
            "ttft_seconds": targets.ttft_seconds,
            "tpot_seconds": targets.itl_seconds,
            "attainment": targets.attainment,
            "long_context_tokens": targets.long_context,
        },
        "fixed_work": fixed,
        "rising_load": load,
        "byte_model": capacity.byte_model_json(byte_model),
        "not_measured": not_measured or [],
    }


def _values(rows: list[dict[str, Any]], key: str) -> np.ndarray[Any, np.dtype[np.float64]]:
    return np.array([row[key] for row in rows if isinstance(row.get(key), (int, float))], dtype=np.float64)


# The per-request figures whose percentiles over the requests a row gives (--percentiles): TTFT,
# the request's mean inter-token latency (vLLM's TPOT, what the ITL target counts) and end to end.
PERCENTILE_METRICS: Final = {
    "ttft_seconds": "ttft_seconds",
    "tpot_seconds": "client_tpot_seconds",
    "e2e_seconds": "e2e_seconds",
}


def latency(
    rows: list[dict[str, Any]], percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
) -> dict[str, Any]:
    finished = [row for row in rows if "error" not in row]
    return {
        "requests": len(rows),
        "errors": len(rows) - len(finished),
        "ttft_p50_seconds": capacity.median_of(finished, "ttft_seconds"),
        "itl_p50_seconds": capacity.median_of(finished, "client_itl_p50_seconds"),
        "itl_p99_seconds_median": capacity.median_of(finished, "client_itl_p99_seconds"),
        "e2e_p50_seconds": capacity.median_of(finished, "e2e_seconds"),
        "latency_percentiles": {
            metric: named_percentiles(_values(finished, field), percentiles)
            for metric, field in PERCENTILE_METRICS.items()
        },
    }


def meets(record: dict[str, Any], targets: Targets) -> bool:
    """A request meets the targets: it finished, its TTFT and its mean inter-token latency (vLLM's
    TPOT, as ``vllm bench serve --goodput tpot:...`` counts it) within them; a one-token answer
    has no inter-token latency to miss. The mean, not the p99: one stall behind another request's
    prefill is a TTFT matter of that request, and a p99 of a few dozen gaps is their maximum."""
    if "error" in record or not isinstance(record.get("ttft_seconds"), (int, float)):
        return False
    itl = record.get("client_tpot_seconds")
    return bool(
        record["ttft_seconds"] <= targets.ttft_seconds and (itl is None or itl <= targets.itl_seconds)
    )


def _step(
    rate: float,
    records: list[dict[str, Any]],
    sample: EngineSample,
    targets: Targets,
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    met = sum(meets(record, targets) for record in records)
    starts = _values(records, "arrival_time")
    ends = np.array(
        [r["arrival_time"] + r["e2e_seconds"] for r in records if isinstance(r.get("e2e_seconds"), float)]
    )
    span = float(max(ends.max() if ends.size else 0.0, starts.max()) - starts.min()) if starts.size else 0.0
    return {
        "rate": rate,
        "requests": len(records),
        "attainment": met / len(records) if records else 0.0,
        "goodput_rps": met / span if span > 0 else 0.0,
        **latency(records, percentiles),
        "output_tokens_per_second": capacity.output_tokens_per_second(records),
        "engine_kv_usage_max": sample.kv_usage_max,
        "engine_token_reuse": sample.token_reuse,
        **capacity.scheduler_summary(sample.series),
    }


def highest_passing(steps: list[dict[str, Any]], targets: Targets) -> float | None:
    passing = [step["rate"] for step in steps if step["attainment"] >= targets.attainment]
    return max(passing) if passing else None


def _attribution(
    steps: dict[str, list[dict[str, Any]]], best: dict[str, float | None], targets: Targets
) -> list[str]:
    """Per endpoint that holds a higher rate than another, why: at the first rate the other
    misses, was the other's KV cache near full (capacity) or not (faster steps)?"""
    lines = []
    names = list(steps)
    for winner in names:
        for loser in names:
            won, lost = best[winner], best[loser]
            if winner == loser or won is None or (lost is not None and won <= lost):
                continue
            failing = next(
                (s for s in steps[loser] if s["attainment"] < targets.attainment and s["rate"] <= won), None
            )
            at = (
                None
                if failing is None
                else next((s for s in steps[winner] if s["rate"] == failing["rate"]), None)
            )
            verdict = (at or {}).get("gain_over", {}).get(loser)
            why = (
                f"at {failing['rate']:g} req/s, {verdict['verdict']}: {'; '.join(verdict['reasons'])}"
                if failing is not None and verdict is not None
                else "cannot tell: no step at which both were measured"
            )
            lines.append(f"{winner} holds {won:g} req/s, {loser} {lost or 0:g}: {why}")
    return lines
