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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
from prometheus_client.parser import text_string_to_metric_families

from kvlens.errors import ScrapeError
from kvlens.experiment import calls, outdir
from kvlens.experiment.client import MEASURE, Endpoint, Planned, Progress, RecordWriter, replay
from kvlens.experiment.prompts import PromptSynthesizer
from kvlens.experiment.protocol import ExperimentError, check_reachable, reset_cache
from kvlens.experiment.run import Schedule, with_progress
from kvlens.simulate.trace import TraceRequest
from kvlens.sources.vllm_metrics import MAX_LINE_CHARS, longest_line
from kvlens.terminal import NARROWEST, wrap, wrapped

log = logging.getLogger("kvlens.experiment")

SCHEMA = "kvlens.quantization/v1"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # 0.10+, 0.8/0.9
QUERIES, HITS = "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"
NEAR_FULL = 0.9  # KV usage at which an engine starts to queue for memory, not for compute
SWEEP_DOUBLINGS = 6  # --rate-sweep: at most 64 times the start rate, so a run stays bounded
MAX_DOUBLINGS = 20  # --sweep-doublings: past a million times the start, a typo, not a plan


@dataclass(frozen=True)
class Targets:
    ttft_seconds: float = 2.0
    itl_seconds: float = 0.05  # a request's mean inter-token latency (vLLM's TPOT)
    attainment: float = 0.9
    long_context: int = 4096  # prompts this long or longer are "long"


@dataclass
class EngineSample:
    """What an endpoint's ``/metrics`` said during one step."""

    kv_usage_max: float | None = None
    queries: float = 0.0
    hits: float = 0.0
    scrapes: int = 0

    @property
    def token_reuse(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None


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
) -> dict[str, Any]:
    """Experiment 1: every request, ``concurrency`` in flight (each starts when one ends), per
    endpoint (cache emptied first where it can be); per endpoint x context group the medians.
    A step finished in ``steps`` (the out-dir of a resumed run) is read, not run."""
    planned = [Planned(r, 0.0, _output(r, max_output_tokens), MEASURE) for r in requests]
    result: dict[str, Any] = {}
    runs = _steps_in(out_dir, steps)
    for endpoint in endpoints.values():
        check_reachable(endpoint)
    for name, endpoint in endpoints.items():
        # All due at once through `concurrency` slots: each request starts when one ends.
        closed = dataclasses.replace(endpoint, max_concurrency=concurrency, late_after_seconds=math.inf)

        def body(staged: Path, name: str = name, closed: Endpoint = closed) -> dict[str, Any]:
            reset_cache(closed)
            _run(staged, name, planned, closed, prompts, runs.progress, f"fixed-{name}")
            return {}

        found = runs.run(outdir.Step(f"fixed-{name}", name, "fixed"), body)
        result[name] = _fixed_row(_read(found.records), targets)
    return result


def _fixed_row(records: list[dict[str, Any]], targets: Targets) -> dict[str, Any]:
    return {group: _latency(rows) for group, rows in _by_context(records, targets).items()}


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
    scrape_seconds: float = 0.5,
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
    scrape_seconds: float = 0.5,
    steps: outdir.OutDir | None = None,
) -> Callable[[float], dict[str, dict[str, Any]]]:
    """One step of experiment 2 at a rate: the same arrivals on each endpoint in turn (cache
    emptied first), its records in ``out_dir/rate-R-NAME.jsonl`` and the engine's sample in its
    ``.step.json`` (a step finished in ``steps`` is read from them, not run)."""
    runs = _steps_in(out_dir, steps)
    for endpoint in endpoints.values():
        check_reachable(endpoint)

    def step(rate: float) -> dict[str, dict[str, Any]]:
        schedule = Schedule(rate=rate, max_output_tokens=max_output_tokens, seed=seed)
        planned = schedule.planned(requests, MEASURE)
        rows = {}
        for name, endpoint in endpoints.items():

            def body(staged: Path, name: str = name, endpoint: Endpoint = endpoint) -> dict[str, Any]:
                reset_cache(endpoint)
                with _engine_sampler(endpoint, scrape_seconds) as sample:
                    _run(staged, f"{name}@{rate:g}", planned, endpoint, prompts, runs.progress, staged.stem)
                return {"sample": dataclasses.asdict(sample)}

            found = runs.run(rate_step(rate, name), body)
            rows[name] = _rate_row(found, targets)
        return rows

    return step


def rate_step(rate: float, name: str) -> outdir.Step:
    return outdir.Step(f"rate-{rate:g}-{name}", name, "rate", rate)


def _rate_row(found: outdir.Found, targets: Targets) -> dict[str, Any]:
    sample = EngineSample(**found.meta.get("sample", {}))
    return _step(float(found.meta["rate"]), _read(found.records), sample, targets)


def merged(
    found: list[outdir.Found], names: list[str], targets: Targets, sweep: dict[str, Any] | None
) -> dict[str, Any]:
    """The report over every endpoint's finished steps in an out-dir (``names`` in the order
    they were first run: the first is the baseline), whichever run made each step. A sweep run one
    endpoint at a time doubles per endpoint: its halfway rates and the endpoints that never fell
    under are taken from every endpoint's steps, its stop from the last run."""
    names = [*names, *sorted({f.step.endpoint for f in found} - set(names))]
    fixed = {
        name: _fixed_row(_read(f.records), targets)
        for name in names
        for f in found
        if f.step.kind == "fixed" and f.step.endpoint == name
    }
    steps = {name: [f for f in found if f.step.kind == "rate" and f.step.endpoint == name] for name in names}
    load = None
    if any(steps.values()):
        rows = {
            name: sorted((_rate_row(f, targets) for f in each), key=lambda row: float(row["rate"]))
            for name, each in steps.items()
            if each
        }
        load = load_result(rows, targets)
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
    return report(fixed or None, load, targets, names[0])


def _read(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def load_result(steps: dict[str, list[dict[str, Any]]], targets: Targets) -> dict[str, Any]:
    best = {name: _highest_passing(rows, targets) for name, rows in steps.items()}
    return {"steps": steps, "highest_rate": best, "attribution": _attribution(steps, best, targets)}


def report(
    fixed: dict[str, Any] | None, load: dict[str, Any] | None, targets: Targets, baseline: str
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


def _by_context(records: list[dict[str, Any]], targets: Targets) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {"short": [], "long": []}
    for record in records:
        groups["long" if record["prompt_tokens"] >= targets.long_context else "short"].append(record)
    return {name: rows for name, rows in groups.items() if rows}


def _values(rows: list[dict[str, Any]], key: str) -> np.ndarray[Any, np.dtype[np.float64]]:
    return np.array([row[key] for row in rows if isinstance(row.get(key), (int, float))], dtype=np.float64)


def _median(values: np.ndarray[Any, np.dtype[np.float64]]) -> float | None:
    return float(np.median(values)) if values.size else None


def _latency(rows: list[dict[str, Any]]) -> dict[str, Any]:
    finished = [row for row in rows if "error" not in row]
    return {
        "requests": len(rows),
        "errors": len(rows) - len(finished),
        "ttft_p50_seconds": _median(_values(finished, "ttft_seconds")),
        "itl_p50_seconds": _median(_values(finished, "client_itl_p50_seconds")),
        "itl_p99_seconds_median": _median(_values(finished, "client_itl_p99_seconds")),
        "e2e_p50_seconds": _median(_values(finished, "e2e_seconds")),
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
    rate: float, records: list[dict[str, Any]], sample: EngineSample, targets: Targets
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
        **_latency(records),
        "engine_kv_usage_max": sample.kv_usage_max,
        "engine_token_reuse": sample.token_reuse,
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
            usage = failing.get("engine_kv_usage_max") if failing else None
            why = (
                f"{loser}'s KV cache was {usage:.0%} full at {failing['rate']:g} req/s: the gain came from "
                "holding more KV (capacity), not from faster requests"
                if failing and usage is not None and usage >= NEAR_FULL
                else "faster steps (the byte model: fewer weight bytes read per decode step)"
                if usage is not None
                else "unknown: the endpoint reports no KV cache usage"
            )
            lines.append(f"{winner} holds {won:g} req/s, {loser} {lost or 0:g}: {why}")
    return lines


@contextlib.contextmanager
def _engine_sampler(endpoint: Endpoint, every: float) -> Iterator[EngineSample]:
    """Scrape the endpoint's ``/metrics`` every ``every`` seconds while the step runs, on a thread
    of its own (the replay's loop only sends and times): the highest KV usage seen, and the
    prefix-cache counters' increase over the step. Each scrape goes through the one bounded
    client (SAMPLE_SECONDS in all, at most MAX_CALL_BYTES once inflated); the step's end cancels
    the scrape under way, so a sampler never outlives its step by more than STOP_SECONDS."""
    sample = EngineSample()
    sampler = _Sampler(endpoint, every, sample)
    sampler.start()
    try:
        yield sample
    finally:
        sampler.stop()


STOP_SECONDS = 5.0  # a cancelled scrape ends at its next await; a parse under way runs to its end


class _Sampler(threading.Thread):
    def __init__(self, endpoint: Endpoint, every: float, sample: EngineSample) -> None:
        super().__init__(name="kvlens-engine-sampler", daemon=True)
        self._endpoint, self._every, self._sample = endpoint, every, sample
        self._loop = asyncio.new_event_loop()
        # made here, run by the thread: stop() may come before the thread has begun
        self._task = self._loop.create_task(self._sampling())

    def run(self) -> None:
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        except Exception:  # a bug must not end the step: the step goes on unsampled
            log.exception("the engine sampler of %s failed", self._endpoint.url)
        finally:
            self._loop.close()

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop already ended and closed
            self._loop.call_soon_threadsafe(self._task.cancel)
        self.join(STOP_SECONDS)
        if self.is_alive():
            log.warning("the engine sampler of %s did not stop within %g s", self._endpoint.url, STOP_SECONDS)

    async def _sampling(self) -> None:
        sample, first = self._sample, dict[str, float]()
        async with calls.client() as pool:
            while True:
                values = await _scrape(pool, self._endpoint)
                if values is not None:
                    sample.scrapes += 1
                    if not first:
                        first.update(values)
                    usage = values.get("kv_usage")
                    if usage is not None:
                        sample.kv_usage_max = max(sample.kv_usage_max or 0.0, usage)
                    sample.queries = values.get("queries", 0.0) - first.get("queries", 0.0)
                    sample.hits = values.get("hits", 0.0) - first.get("hits", 0.0)
                await asyncio.sleep(self._every)


async def _scrape(pool: httpx.AsyncClient, endpoint: Endpoint) -> dict[str, float] | None:
    try:
        answer = await calls.call(
            pool, endpoint.url, "GET", "/metrics", headers=endpoint.headers, seconds=calls.SAMPLE_SECONDS
        )
    except ScrapeError:
        return None
    if answer.status != 200:
        return None
    text = answer.body.decode("utf-8", "replace")
    if longest_line(text) > MAX_LINE_CHARS:  # the parser holds several times a line
        return None
    return _engine_values(text)


def _engine_values(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError, KeyError):  # as the sidecar's parse: bad text
        return values
    for family in families:
        for s in family.samples:
            if s.name in KV_USAGE:
                values["kv_usage"] = max(values.get("kv_usage", 0.0), s.value)
            elif s.name == f"{QUERIES}_total":
                values["queries"] = values.get("queries", 0.0) + s.value
            elif s.name == f"{HITS}_total":
                values["hits"] = values.get("hits", 0.0) + s.value
    return values


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


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ExperimentError(f"--rates takes requests per second, comma-separated, not {text!r}") from None
    if not rates or not all(math.isfinite(rate) and rate > 0 for rate in rates):
        raise ExperimentError("--rates takes positive requests per second")
    return sorted(rates)


def text(result: dict[str, Any]) -> str:
    """The report for a terminal (80 columns): experiment 1 per endpoint and context group, then
    experiment 2 per rate, the highest rates and what the gain came from."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f}"

    lines = [f"# kvlens quantization (baseline: {result['baseline']})", ""]
    fixed = result.get("fixed_work")
    if fixed:
        lines += ["Experiment 1, fixed work (ms, medians)", ""]
        columns = "".join(f"{heading:>10}" for heading in ("TTFT", "ITL p50", "ITL p99", "e2e"))
        lines.append(f"{'endpoint':<12}{'context':<8}{'requests':>9}{columns}")
        for name, groups in fixed.items():
            for group, stats in groups.items():
                lines.append(
                    f"{name[:11]:<12}{group:<8}{stats['requests']:>9}{ms(stats['ttft_p50_seconds']):>10}"
                    f"{ms(stats['itl_p50_seconds']):>10}{ms(stats['itl_p99_seconds_median']):>10}"
                    f"{ms(stats['e2e_p50_seconds']):>10}"
                )
        lines.append("")
    load = result.get("rising_load")
    if load:
        targets = result["targets"]
        lines += wrap(
            f"Experiment 2, rising load (targets: TTFT <= {targets['ttft_seconds']:g} s, "
            f"ITL mean <= {targets['tpot_seconds'] * 1000:g} ms, {targets['attainment']:.0%} of requests)",
            NARROWEST,
        )
        lines += [
            "",
            f"{'endpoint':<12}{'req/s':>7}{'attain':>8}{'goodput':>9}{'TTFT p50':>10}"
            f"{'KV max':>8}{'reuse':>8}",
        ]
        for name, steps in load["steps"].items():
            for step in steps:
                usage, reuse = step["engine_kv_usage_max"], step["engine_token_reuse"]
                lines.append(
                    f"{name[:11]:<12}{step['rate']:>7g}{step['attainment']:>8.0%}{step['goodput_rps']:>9.2f}"
                    f"{ms(step['ttft_p50_seconds']):>10}{'-' if usage is None else f'{usage:.0%}':>8}"
                    f"{'-' if reuse is None else f'{reuse:.0%}':>8}"
                )
        lines.append("")
        sweep = load.get("sweep")
        if sweep:
            middles = ", ".join(f"{rate:g}" for rate in sweep["bisected"]) or "none"
            lines += [
                f"Sweep from {sweep['start']:g} req/s: {sweep['stopped']}; halfway steps: {middles}",
                "",
            ]
        unbounded = (sweep or {}).get("never_fell_under", [])
        for name, rate in load["highest_rate"].items():
            lines += wrap(
                f"{name}: highest rate meeting the targets: {'none' if rate is None else f'{rate:g} req/s'}"
                + (" (never fell under: a lower bound)" if name in unbounded else ""),
                NARROWEST,
            )
        lines += wrapped(load["attribution"], NARROWEST)
    return "\n".join(lines) + "\n"
