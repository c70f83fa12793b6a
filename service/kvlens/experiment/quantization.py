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
``/metrics`` series the capacity rule reads) are kept in the folder, so that the report
(:mod:`kvlens.experiment.quantization_report`) computes every comparison (ITL ratios, the byte
model's, what a gain came from) from the finished steps, whichever run made each: endpoints may
be run one at a time. The engine's sample is :mod:`kvlens.experiment.engine_metrics`'s, the text
report :mod:`kvlens.experiment.quantization_text`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvlens.experiment import capacity, outdir
from kvlens.experiment.capacity import ByteModel
from kvlens.experiment.client import MEASURE, Endpoint, Planned, Progress, RecordWriter, replay
from kvlens.experiment.engine_metrics import SCRAPE_SECONDS, sampler
from kvlens.experiment.prompts import PromptSynthesizer
from kvlens.experiment.protocol import ExperimentError, check_reachable, max_model_len, reset_cache
from kvlens.experiment.quantization_report import (
    Targets,
    fixed_section,
    group_of,
    highest_passing,
    load_result,
    rate_rows,
)
from kvlens.experiment.run import Schedule, with_progress
from kvlens.simulate.trace import TraceRequest

BYTE_MODEL = "byte-model.json"  # in the out-dir: the byte model the report uses, kept across runs
SWEEP_DOUBLINGS = 6  # --rate-sweep: at most 64 times the start rate, so a run stays bounded
MAX_DOUBLINGS = 20  # --sweep-doublings: past a million times the start, a typo, not a plan


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


def fixed_groups(requests: list[TraceRequest], targets: Targets) -> dict[str, list[TraceRequest]]:
    """The trace's requests by context group (short, long: ``targets.long_context`` or more),
    the groups it has."""
    groups: dict[str, list[TraceRequest]] = {"short": [], "long": []}
    for request in requests:
        groups["long" if request.prompt_tokens >= targets.long_context else "short"].append(request)
    return {name: chosen for name, chosen in groups.items() if chosen}


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
            if (passing := highest_passing(rows, targets)) is not None
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
