"""Running arms: a replay per arm into a records file, resets and checks around it, and the
prefix-cache experiment's three arms handed to ``analysis/compare``."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from kvlens.accounting import Accounting
from kvlens.analysis import compare, run_facts
from kvlens.experiment import outdir
from kvlens.experiment.client import MEASURE, WARMUP, Endpoint, Planned, Progress, RecordWriter, replay
from kvlens.experiment.prompts import PromptSynthesizer
from kvlens.experiment.protocol import (
    ExperimentError,
    Window,
    block_size_warning,
    check_context,
    check_reachable,
    engine_block_size,
    plan,
    reset_cache,
)
from kvlens.experiment.sessions import SessionPlan, replay_sessions, salted
from kvlens.records import MAX_TOKENS
from kvlens.simulate.cache import PrefixCache
from kvlens.simulate.run import served
from kvlens.simulate.trace import TraceRequest
from kvlens.stats import DEFAULT_PERCENTILES

log = logging.getLogger("kvlens.experiment")

SHARED_PREFIX = "shared-prefix"  # the built-in trace's name on the command line
SHARED_PREFIX_BLOCK = 16  # vLLM's block size
# System prompts of three lengths by default, so that the report's rows span three prompt-length
# groups of the default edges (0-511, 512-2047, 2048-8191 with the 128-token suffix): how much a
# hit saves depends on how long the prefix is, which one length cannot show.
SHARED_PREFIX_TOKENS = (256, 1024, 4096)


@dataclass(frozen=True)
class SharedPrefixTraffic:
    """Groups of requests sharing a system prompt and each adding its own ``suffix_tokens``,
    arriving as a Poisson process at ``rate`` per second, a group drawn uniformly for each: the
    article's workload in miniature. Group ``g``'s system prompt is ``prefix_tokens[g %
    len(prefix_tokens)]`` tokens long (one number: every group alike)."""

    requests: int = 200
    groups: int = 4
    prefix_tokens: tuple[int, ...] = SHARED_PREFIX_TOKENS
    suffix_tokens: int = 128
    output_tokens: int = 32
    rate: float = 4.0
    seed: int = 0

    def trace(self) -> list[TraceRequest]:
        if not self.prefix_tokens:
            raise ExperimentError("shared-prefix traffic needs a prefix length (0 or more tokens)")
        if min(self.requests, self.groups, self.output_tokens) < 1 or min(self.prefix_tokens) < 0:
            raise ExperimentError("shared-prefix traffic needs requests, groups and output tokens >= 1")
        if self.suffix_tokens < 1:
            raise ExperimentError("shared-prefix traffic needs suffix tokens >= 1 (each prompt its own end)")
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise ExperimentError("shared-prefix traffic needs a positive rate")
        if max(self.prefix_tokens) + self.suffix_tokens > MAX_TOKENS:  # a trace file's bound too
            raise ExperimentError(f"shared-prefix traffic takes prompts of {MAX_TOKENS:,} tokens at most")
        rng = np.random.default_rng(self.seed)
        arrivals = np.cumsum(rng.exponential(1 / self.rate, self.requests)) - 1 / self.rate
        groups = rng.integers(0, self.groups, self.requests)
        requests = []
        for index in range(self.requests):
            group = int(groups[index])
            prefix = self.prefix_tokens[group % len(self.prefix_tokens)]
            length = prefix + self.suffix_tokens
            shared = prefix // SHARED_PREFIX_BLOCK
            # Keys stand for a block and its prefix: the group's blocks, then the request's own.
            own = length // SHARED_PREFIX_BLOCK - shared
            keys = [(1 << 62) | (group << 32) | i for i in range(shared)]
            keys += [(2 << 60) | (index << 24) | j for j in range(own)]
            requests.append(
                TraceRequest(index, float(max(0.0, arrivals[index])), length, self.output_tokens, tuple(keys))
            )
        return requests


@dataclass(frozen=True)
class ArmResult:
    name: str
    records: Path
    progress: Progress
    warmup_records: Path | None = None
    warmup: Progress | None = None
    reset: str | None = None  # the path that emptied the cache


@dataclass(frozen=True)
class Schedule:
    """How the measured window is sent: the trace's times scaled by ``speed``, or ``rate`` requests
    per second (gamma inter-arrivals of shape ``burstiness``: 1 is Poisson, below 1 burstier)."""

    speed: float = 1.0
    rate: float | None = None
    burstiness: float = 1.0
    max_output_tokens: int | None = None
    seed: int = 0
    sessions: SessionPlan | None = None  # the session schedule (None: by timestamps)
    salt: str | None = None  # this run's: each conversation's cache_salt is made from it

    def __post_init__(self) -> None:
        if self.sessions is not None and self.rate is not None:
            raise ExperimentError(
                "--rate sets the timestamp schedule's arrivals; with --schedule sessions, "
                "conversations start at --session-rate"
            )

    def planned(self, requests: list[TraceRequest], phase: str) -> list[Planned]:
        planned = self._planned(requests, phase)
        return planned if self.salt is None else salted(planned, self.salt)

    def _planned(self, requests: list[TraceRequest], phase: str) -> list[Planned]:
        start = requests[0].arrival if requests else 0.0
        planned = list(
            plan(
                requests, start=start, speed=self.speed, max_output_tokens=self.max_output_tokens, phase=phase
            )
        )
        if self.rate is None:
            return planned
        if not (
            math.isfinite(self.rate)
            and self.rate > 0
            and math.isfinite(self.burstiness)
            and self.burstiness > 0
        ):
            raise ExperimentError("--rate and --burstiness must be positive numbers")
        rng = np.random.default_rng(self.seed)
        gaps = rng.gamma(self.burstiness, 1 / (self.rate * self.burstiness), len(planned))
        dues = np.concatenate([[0.0], np.cumsum(gaps[1:])]) if planned else gaps
        return [dataclasses.replace(p, due=float(due)) for p, due in zip(planned, dues, strict=True)]


def run_arm(
    name: str,
    endpoint: Endpoint,
    window: Window,
    out: Path,
    prompts: PromptSynthesizer,
    schedule: Schedule,
    *,
    reset: bool = False,
    assume_empty: bool = False,
    warm: bool = False,
    push: Callable[[dict[str, Any]], None] | None = None,
    progress: Callable[[str, Progress, int], None] | None = None,
) -> ArmResult:
    """Replay the window against ``endpoint`` as arm ``name``, its records into ``out`` (and the
    warm-up's, when ``warm``, into ``out`` with ``.warmup`` before its suffix)."""
    check_reachable(endpoint)
    check_context(endpoint, [*window.warmup, *window.measure])
    warning = block_size_warning(prompts.block_size, engine_block_size(endpoint))
    if warning:
        log.warning("%s", warning)
    sent = [*(window.warmup if warm else []), *window.measure]
    reusable = {r.index: tokens for r, tokens in served(sent, PrefixCache(None), prompts.block_size)}
    reset_by = None
    if reset:
        reset_by = reset_cache(endpoint)
        if reset_by is None and not assume_empty:
            raise ExperimentError(
                f"{endpoint.url} cannot empty its prefix cache (POST /reset_prefix_cache needs vLLM's "
                "VLLM_SERVER_DEV_MODE=1; SGLang has /flush_cache): arm "
                f"{name!r} would not start cold. Restart the server, then pass --assume-empty"
            )
    warmup_path = warmup_progress = None
    if warm:
        if not window.warmup:
            raise ExperimentError(f"arm {name!r} warms up, but no request arrives before --measure-from")
        warmup_path = run_facts.warmup_file(out)
        warmup = theoretical(schedule.planned(window.warmup, WARMUP), reusable)
        warmup_progress = _replay_into(
            warmup_path, f"{name}", warmup, endpoint, prompts, push, progress, schedule.sessions
        )
    measure = theoretical(schedule.planned(window.measure, MEASURE), reusable)
    measured = _replay_into(out, name, measure, endpoint, prompts, push, progress, schedule.sessions)
    return ArmResult(name, out, measured, warmup_path, warmup_progress, reset_by)


def _replay_into(
    path: Path,
    arm: str,
    planned: list[Planned],
    endpoint: Endpoint,
    prompts: PromptSynthesizer,
    push: Callable[[dict[str, Any]], None] | None,
    progress: Callable[[str, Progress, int], None] | None,
    sessions: SessionPlan | None = None,
) -> Progress:
    state = Progress()
    try:
        out = path.open("wb")
    except OSError as error:
        raise ExperimentError(f"cannot write {path}: {error.strerror or error}") from None
    with out:
        writer = RecordWriter(out, push)
        phase = planned[0].phase if planned else MEASURE
        task = (
            replay(planned, prompts, endpoint, arm, writer, state)
            if sessions is None
            else replay_sessions(planned, prompts, endpoint, arm, writer, sessions, state)
        )
        if progress is None:
            asyncio.run(task)
        else:
            asyncio.run(with_progress(task, lambda: progress(f"{arm} {phase}", state, len(planned))))
    _in_trace_order(path)
    return state


def theoretical(planned: list[Planned], reusable: dict[int, int]) -> list[Planned]:
    """Each request with what an unbounded cache would serve it, in the order the arm sends."""
    return [dataclasses.replace(p, reusable_tokens=reusable.get(p.index)) for p in planned]


def _in_trace_order(path: Path) -> None:
    """Records are written as requests end (an interrupted run keeps them); a finished arm is
    rewritten in the trace's order, which ``compare`` pairs position by position."""
    lines = [line for line in path.read_bytes().splitlines() if line.strip()]
    lines.sort(key=lambda line: int(orjson.loads(line)["trace_index"]))
    staged = path.with_name(path.name + ".sorting")
    staged.write_bytes(b"".join(line + b"\n" for line in lines))
    staged.replace(path)


async def with_progress(task: Any, show: Callable[[], None]) -> None:
    running = asyncio.ensure_future(task)
    while not running.done():
        show()
        await asyncio.wait({running}, timeout=0.5)
    show()
    running.result()


def prefix_cache_experiment(
    endpoint: Endpoint,
    off_endpoint: Endpoint | None,
    window: Window,
    out_dir: Path,
    prompts: PromptSynthesizer,
    schedule: Schedule,
    *,
    assume_empty: bool = False,
    push: Callable[[dict[str, Any]], None] | None = None,
    progress: Callable[[str, Progress, int], None] | None = None,
    only: Collection[str] | None = None,
    steps: outdir.OutDir | None = None,
) -> tuple[list[ArmResult], list[str]]:
    """Off (when an endpoint without prefix caching is given), cold, then warm, in that order
    (those in ``only``, when given), each into ``out_dir/ARM.jsonl``; the warnings to show (an off
    arm that hit the cache). An arm finished in ``steps`` (a resumed out-dir) is read, not run."""
    arms: list[tuple[str, Endpoint, bool]] = [("cold", endpoint, False), ("warm", endpoint, True)]
    if off_endpoint is not None:
        arms.insert(0, ("off", off_endpoint, False))
    arms = [arm for arm in arms if only is None or arm[0] in only]
    for each in dict.fromkeys(target for _, target, _ in arms):  # every endpoint, before any arm
        check_reachable(each)
        check_context(each, [*window.warmup, *window.measure])
    runs = steps or outdir.OutDir(out_dir, outdir.Plan("prefix-cache", {}), restart=True)
    results, warnings = [], []
    ran_now: dict[str, ArmResult] = {}
    for name, target, warm in arms:

        def body(
            staged: Path, name: str = name, target: Endpoint = target, warm: bool = warm
        ) -> dict[str, Any]:
            ran = run_arm(
                name,
                target,
                window,
                staged,
                prompts,
                schedule,
                reset=name != "off",
                assume_empty=assume_empty,
                warm=warm,
                push=push,
                progress=progress,
            )
            ran_now[name] = ran
            warmup = [ran.warmup_records.name] if ran.warmup_records else []
            return {"files": warmup, "reset": ran.reset, "requests": ran.progress.done}

        found = runs.run(outdir.Step(name, name, "arm"), body)
        result = arm_result(found)
        if name in ran_now:  # this run's counts, with the files where the step left them
            result = dataclasses.replace(result, progress=ran_now[name].progress, warmup=ran_now[name].warmup)
        if name == "off" and (warning := off_check(result)):
            warnings.append(warning)
        results.append(result)
    return results, warnings


ARM_ORDER = ("off", "cold", "warm")  # the protocol's order: the first present is the baseline


def arm_result(found: outdir.Found) -> ArmResult:
    """A finished arm as its files say (its counts are in its records)."""
    files = found.meta.get("files") or []
    warmup = found.records.with_name(files[0]) if files else None
    return ArmResult(found.step.name, found.records, Progress(), warmup, None, found.meta.get("reset"))


def arms_found(found: list[outdir.Found]) -> list[ArmResult]:
    """Every arm finished in an out-dir, whichever run made it, in the protocol's order."""
    arms = {f.step.name: f for f in found if f.step.kind == "arm"}
    return [arm_result(arms[name]) for name in ARM_ORDER if name in arms]


def compare_arms(
    results: list[ArmResult], settings: Accounting, *, percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
) -> dict[str, Any]:
    """``kvlens compare`` of the arms' measured windows, the first arm the baseline."""
    # Read back from the arms' files alone, as `kvlens compare` over them reads them, so that
    # both give one report: the warm-up recorded apart beside an arm (what warmed the cache,
    # never timed), the failed requests per arm and reason, those compared in no arm.
    specs = [(result.name, str(result.records)) for result in results]
    arms, left_out = compare.load_answered(specs, settings)
    report = compare.compare(arms, percentiles=percentiles)
    run_facts.add_file_facts(report, specs, left_out)
    return report


def off_check(result: ArmResult) -> str | None:
    """A warning when an arm meant to run without prefix caching was served from cache."""
    cached = 0
    with result.records.open("rb") as lines:
        for line in lines:
            value = orjson.loads(line).get("cached_tokens") if line.strip() else None
            cached += value if isinstance(value, int) else 0
    if cached:
        return (
            f"arm {result.name!r}: the endpoint served {cached} prompt tokens from cache; it does not "
            "run without prefix caching (vLLM: --no-enable-prefix-caching)"
        )
    return None
