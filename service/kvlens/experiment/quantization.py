"""The second article's two experiments on weight-only quantization (BF16 against W4A16), kept
apart as it asks:

1. **Fixed work**: the same requests (token prompts, output lengths) at a fixed concurrency on
   each endpoint; short and long contexts apart; TTFT (prefill), inter-token latency (decode) and
   end to end apart. Quantization shrinks the bytes a decode step reads, so it helps ITL most
   where weights dominate the traffic (short contexts, small batches) and little where the KV
   cache does (long contexts, large batches).
2. **Rising load**: the same trace at request rates step by step; at each, the share of requests
   meeting the TTFT and ITL targets (attainment) and the goodput (requests per second meeting
   both); the highest rate each endpoint holds at the target attainment. The endpoint's own
   ``/metrics`` is scraped during each step (KV cache usage, prefix-cache reuse), so the report
   can say whether a higher goodput came from faster steps or from holding more KV (a smaller
   checkpoint leaves memory for more cache).

Every step (an endpoint's fixed work of one context group, an endpoint at one rate) runs through
the out-dir (:mod:`kvlens.experiment.outdir`): its records and its engine sample (with the
``/metrics`` series the capacity rule reads) are kept in the folder, so that :func:`merged`
computes every comparison (ITL ratios, the byte model's, what a gain came from) from the finished
steps, whichever run made each: endpoints may be run one at a time. The engine's sample is
:mod:`kvlens.experiment.engine_metrics`'s, the text report
:mod:`kvlens.experiment.quantization_text`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import orjson

from kvlens.experiment import capacity, outdir
from kvlens.experiment.capacity import ByteModel
from kvlens.experiment.client import MEASURE, Endpoint, Planned, Progress, RecordWriter, replay
from kvlens.experiment.engine_metrics import SCRAPE_SECONDS, EngineSample, sampler
from kvlens.experiment.prompts import PromptSynthesizer
from kvlens.experiment.protocol import ExperimentError, check_reachable, max_model_len, reset_cache
from kvlens.experiment.run import Schedule, with_progress
from kvlens.simulate.trace import TraceRequest
from kvlens.stats import DEFAULT_PERCENTILES, named_percentiles

SCHEMA = "kvlens.quantization/v1"
BYTE_MODEL = "byte-model.json"  # in the out-dir: the byte model the report uses, kept across runs
SWEEP_DOUBLINGS = 6  # --rate-sweep: at most 64 times the start rate, so a run stays bounded
MAX_DOUBLINGS = 20  # --sweep-doublings: past a million times the start, a typo, not a plan


@dataclass(frozen=True)
class Targets:
    ttft_seconds: float = 2.0
    itl_seconds: float = 0.05  # a request's mean inter-token latency (vLLM's TPOT)
    attainment: float = 0.9
    long_context: int = 4096  # prompts this long or longer are "long"


def fixed_work(
    endpoints: dict[str, Endpoint],
    requests: list[TraceRequest],
    prompts: PromptSynthesizer,
    out_dir: Path,
    *,
    concurrency: int,
    targets: Targets,
    max_output_tokens: int | None = None,
    steps: outdir.OutDir | None = None,
    scrape_seconds: float = SCRAPE_SECONDS,
    byte_model: ByteModel | None = None,
) -> dict[str, Any]:
    """Experiment 1: ``concurrency`` in flight (each starts when one ends), per endpoint (cache
    emptied first where it can be), short and long contexts each a step of their own
    (:func:`fixed_step`: the trace's requests; long ones made when it has none,
    :func:`capacity.long_requests`, or why not kept in the short step's ``not_measured``), the
    engine sampled throughout. A step finished in ``steps`` (the out-dir of a resumed run) is
    read, not run. The fixed-work section over this run's endpoints (:func:`fixed_section`)."""
    runs = _steps_in(out_dir, steps)
    for endpoint in endpoints.values():
        check_reachable(endpoint)
    groups = fixed_groups(requests, targets)
    notes: list[str] = []
    if "long" not in groups:
        limits = {name: max_model_len(endpoint) for name, endpoint in endpoints.items()}
        made, why = capacity.long_requests(
            requests, targets.long_context, concurrency, limits, max_output_tokens, prompts.block_size
        )
        if made:
            groups["long"] = made
        else:
            notes.append(why)
    found: list[outdir.Found] = []
    for group, chosen in groups.items():
        planned = [Planned(r, 0.0, _output(r, max_output_tokens), MEASURE) for r in chosen]
        for name, endpoint in endpoints.items():
            # All due at once through `concurrency` slots: each request starts when one ends.
            closed = dataclasses.replace(endpoint, max_concurrency=concurrency, late_after_seconds=math.inf)
            step = fixed_step(name, group)

            def body(
                staged: Path,
                closed: Endpoint = closed,
                step: outdir.Step = step,
                planned: list[Planned] = planned,
            ) -> dict[str, Any]:
                reset_cache(closed)
                with sampler(closed, scrape_seconds) as sample:
                    _run(staged, step.endpoint, planned, closed, prompts, runs.progress, step.name)
                meta = {"concurrency": concurrency, "sample": sample.as_json()}
                return meta | ({"not_measured": notes} if notes and group_of(step) == "short" else {})

            found.append(runs.run(step, body))
    return fixed_section(found, list(endpoints), byte_model)


def fixed_step(name: str, group: str) -> outdir.Step:
    """An endpoint's fixed work of one context group: ``fixed-NAME`` (short), ``fixed-NAME-long``."""
    return outdir.Step(f"fixed-{name}" if group == "short" else f"fixed-{name}-{group}", name, "fixed")


def group_of(step: outdir.Step) -> str:
    suffix = step.name.removeprefix(f"fixed-{step.endpoint}")
    return suffix.removeprefix("-") or "short"


def fixed_groups(requests: list[TraceRequest], targets: Targets) -> dict[str, list[TraceRequest]]:
    """The trace's requests by context group (short, long: ``targets.long_context`` or more),
    the groups it has."""
    groups: dict[str, list[TraceRequest]] = {"short": [], "long": []}
    for request in requests:
        groups["long" if request.prompt_tokens >= targets.long_context else "short"].append(request)
    return {name: chosen for name, chosen in groups.items() if chosen}


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
            row = _latency(records, percentiles) | {
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


def _steps_in(out_dir: Path, steps: outdir.OutDir | None) -> outdir.OutDir:
    """The run's out-dir, or one that runs every step (no plan, no lock: a caller of its own)."""
    return steps or outdir.OutDir(out_dir, outdir.Plan("quantization", {}), restart=True)


def rising_load(
    endpoints: dict[str, Endpoint],
    requests: list[TraceRequest],
    prompts: PromptSynthesizer,
    out_dir: Path,
    *,
    rates: list[float],
    targets: Targets,
    max_output_tokens: int | None = None,
    seed: int = 0,
    scrape_seconds: float = SCRAPE_SECONDS,
) -> dict[str, Any]:
    """Experiment 2: the trace at each rate (Poisson arrivals) on each endpoint; attainment,
    goodput and the engine's KV usage and reuse per step; the highest rate that meets the target."""
    step = stepper(endpoints, requests, prompts, out_dir, targets, max_output_tokens, seed, scrape_seconds)
    return run_rates(step, list(endpoints), rates, targets)


def run_rates(
    step: Callable[[float], dict[str, dict[str, Any]]], names: list[str], rates: list[float], targets: Targets
) -> dict[str, Any]:
    """Experiment 2 at the rates given, each on every endpoint."""
    steps: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for rate in rates:
        for name, row in step(rate).items():
            steps[name].append(row)
    return load_result(steps, targets)


def check_sweep(start: float | None, max_doublings: int) -> None:
    if start is not None and not (math.isfinite(start) and start > 0):
        raise ExperimentError("--rate-sweep takes a positive start rate (requests per second)")
    if not 0 <= max_doublings <= MAX_DOUBLINGS:
        raise ExperimentError(f"--sweep-doublings takes 0 to {MAX_DOUBLINGS}, not {max_doublings}")


def rate_sweep(
    step: Callable[[float], dict[str, dict[str, Any]]],
    names: list[str],
    *,
    start: float,
    targets: Targets,
    max_doublings: int = SWEEP_DOUBLINGS,
) -> dict[str, Any]:
    """Experiment 2 without a list of rates: ``start``, then double while any endpoint still meets
    the target attainment, at most ``max_doublings`` times; then once, for each endpoint that met
    it at a rate ``r`` and fell under at ``2 r``, the rate halfway (``1.5 r``), run on every
    endpoint so that each rate's arrivals are the same everywhere. At most ``max_doublings + 1 +
    len(names)`` steps; ``sweep.stopped`` says why the doubling ended."""
    steps: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    done: set[float] = set()

    def run(rate: float) -> None:
        done.add(rate)
        for name, row in step(rate).items():
            steps[name].append(row)

    rate = start
    for doubling in range(max_doublings + 1):
        run(rate)
        if not any(rows[-1]["attainment"] >= targets.attainment for rows in steps.values()):
            stopped = f"every endpoint fell under {targets.attainment:.0%} at {rate:g} req/s"
            break
        if doubling == max_doublings:
            plural = "" if max_doublings == 1 else "s"
            stopped = f"the step limit ({max_doublings} doubling{plural}) was reached at {rate:g} req/s"
            break
        rate *= 2
    middles = sorted(
        {
            1.5 * passing
            for rows in list(steps.values())
            if (passing := _highest_passing(rows, targets)) is not None
            and any(row["rate"] == 2 * passing and row["attainment"] < targets.attainment for row in rows)
        }
        - done
    )
    for middle in middles:
        run(middle)
    for rows in steps.values():
        rows.sort(key=lambda row: float(row["rate"]))
    result = load_result(steps, targets)
    result["sweep"] = {
        "start": start,
        "max_doublings": max_doublings,
        "bisected": middles,
        "stopped": stopped,
        # met the target at every rate run: its highest rate is a lower bound, not its limit
        "never_fell_under": [
            name
            for name, rows in steps.items()
            if all(row["attainment"] >= targets.attainment for row in rows)
        ],
    }
    return result


def stepper(
    endpoints: dict[str, Endpoint],
    requests: list[TraceRequest],
    prompts: PromptSynthesizer,
    out_dir: Path,
    targets: Targets,
    max_output_tokens: int | None = None,
    seed: int = 0,
    scrape_seconds: float = SCRAPE_SECONDS,
    steps: outdir.OutDir | None = None,
) -> Callable[[float], dict[str, dict[str, Any]]]:
    """One step of experiment 2 at a rate: the same arrivals on each endpoint in turn (cache
    emptied first), its records in ``out_dir/rate-R-NAME.jsonl`` and the engine's sample in its
    ``.step.json`` (a step finished in ``steps`` is read from them, not run); each row with what
    its endpoint gained over each other (:func:`rate_rows`)."""
    runs = _steps_in(out_dir, steps)
    for endpoint in endpoints.values():
        check_reachable(endpoint)

    def step(rate: float) -> dict[str, dict[str, Any]]:
        schedule = Schedule(rate=rate, max_output_tokens=max_output_tokens, seed=seed)
        planned = schedule.planned(requests, MEASURE)
        found = []
        for name, endpoint in endpoints.items():

            def body(staged: Path, name: str = name, endpoint: Endpoint = endpoint) -> dict[str, Any]:
                reset_cache(endpoint)
                with sampler(endpoint, scrape_seconds) as sample:
                    _run(staged, f"{name}@{rate:g}", planned, endpoint, prompts, runs.progress, staged.stem)
                return {"sample": sample.as_json()}

            found.append(runs.run(rate_step(rate, name), body))
        return rate_rows(found, targets)

    return step


def rate_step(rate: float, name: str) -> outdir.Step:
    return outdir.Step(f"rate-{rate:g}-{name}", name, "rate", rate)


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
    best = {name: _highest_passing(rows, targets) for name, rows in steps.items()}
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


def _output(request: TraceRequest, cap: int | None) -> int:
    output = max(1, request.output_tokens)
    return min(output, cap) if cap is not None else output


def _run(
    path: Path,
    arm: str,
    planned: list[Planned],
    endpoint: Endpoint,
    prompts: PromptSynthesizer,
    progress: Callable[[str, Progress, int], None] | None = None,
    label: str = "",
) -> None:
    try:
        out = path.open("wb")
    except OSError as error:
        raise ExperimentError(f"cannot write {path}: {error.strerror or error}") from None
    with out:
        state = Progress()
        task = replay(planned, prompts, endpoint, arm, RecordWriter(out), state)
        if progress is None:
            asyncio.run(task)
        else:
            asyncio.run(with_progress(task, lambda: progress(label or arm, state, len(planned))))


def _values(rows: list[dict[str, Any]], key: str) -> np.ndarray[Any, np.dtype[np.float64]]:
    return np.array([row[key] for row in rows if isinstance(row.get(key), (int, float))], dtype=np.float64)


def _median(values: np.ndarray[Any, np.dtype[np.float64]]) -> float | None:
    return float(np.median(values)) if values.size else None


# The per-request figures whose percentiles over the requests a row gives (--percentiles): TTFT,
# the request's mean inter-token latency (vLLM's TPOT, what the ITL target counts) and end to end.
PERCENTILE_METRICS: Final = {
    "ttft_seconds": "ttft_seconds",
    "tpot_seconds": "client_tpot_seconds",
    "e2e_seconds": "e2e_seconds",
}


def _latency(
    rows: list[dict[str, Any]], percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
) -> dict[str, Any]:
    finished = [row for row in rows if "error" not in row]
    return {
        "requests": len(rows),
        "errors": len(rows) - len(finished),
        "ttft_p50_seconds": _median(_values(finished, "ttft_seconds")),
        "itl_p50_seconds": _median(_values(finished, "client_itl_p50_seconds")),
        "itl_p99_seconds_median": _median(_values(finished, "client_itl_p99_seconds")),
        "e2e_p50_seconds": _median(_values(finished, "e2e_seconds")),
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
        **_latency(records, percentiles),
        "output_tokens_per_second": capacity.output_tokens_per_second(records),
        "engine_kv_usage_max": sample.kv_usage_max,
        "engine_token_reuse": sample.token_reuse,
        **capacity.scheduler_summary(sample.series),
    }


def _highest_passing(steps: list[dict[str, Any]], targets: Targets) -> float | None:
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


def endpoints_from(specs: list[str], make: Callable[[str], Endpoint]) -> dict[str, Endpoint]:
    """``NAME=URL`` pairs, in order (the first run into an out-dir is the baseline)."""
    endpoints: dict[str, Endpoint] = {}
    for spec in specs:
        name, separator, url = spec.partition("=")
        if not separator or not name or not url:
            # not echoed: a URL given without its NAME= may carry a password
            raise ExperimentError("--endpoint takes NAME=URL (e.g. bf16=http://host:8000)")
        if name in endpoints:
            raise ExperimentError(f"--endpoint {name!r} is given twice")
        endpoints[name] = make(url)
    if not endpoints:  # one is enough: the others may be run into the same --out-dir later
        raise ExperimentError("the quantization experiment takes an endpoint (--endpoint NAME=URL)")
    return endpoints


def check_names(names: Iterable[str]) -> None:
    """Refuse endpoints whose steps would share a file: ``a``'s long fixed work is
    ``fixed-a-long``, as is the short fixed work of an endpoint named ``a-long``."""
    known = set(names)
    for name in sorted(known):
        if name.endswith("-long") and name.removesuffix("-long") in known:
            raise ExperimentError(
                f"--endpoint {name!r} and {name.removesuffix('-long')!r} would share the step "
                f"fixed-{name}: rename one"
            )


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ExperimentError(f"--rates takes requests per second, comma-separated, not {text!r}") from None
    if not rates or not all(math.isfinite(rate) and rate > 0 for rate in rates):
        raise ExperimentError("--rates takes positive requests per second")
    return sorted(rates)
