"""The flags and messages of an experiment run into an out-dir, one endpoint or arm at a time:
``--restart``, ``--dry-run``, progress for a terminal or a log, and what Ctrl-C leaves."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from kvlens.cli.replay import progress_line
from kvlens.experiment import outdir
from kvlens.experiment import run as arms
from kvlens.experiment.client import MEASURE, WARMUP, Progress
from kvlens.experiment.protocol import ExperimentError, Window
from kvlens.simulate.trace import TraceRequest


def run_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--restart", action="store_true", help="redo this run's steps already finished in --out-dir"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (steps, requests, estimated duration) and what --out-dir holds; send nothing",
    )


def out_dir(args: argparse.Namespace, plan: outdir.Plan) -> outdir.OutDir:
    """The out-dir of ``plan``, refused now when it holds another plan's steps (nothing written)."""
    out = outdir.OutDir(args.out_dir, plan, restart=args.restart, command=command(args), progress=progress())
    out.check_plan()
    return out


def command(args: argparse.Namespace) -> str:
    """This run's command line (secrets left out), to resume with and to name in the lock."""
    program = sys.argv[0] if Path(sys.argv[0]).name == "kvlens" else "kvlens"
    return outdir.command_line(program, getattr(args, "argv", None) or sys.argv[1:])


def progress() -> Callable[[str, Progress, int], None]:
    """A line rewritten in place at a terminal; a line every 10 s into a log."""
    if sys.stderr.isatty():
        return progress_line
    return outdir.Heartbeat(lambda line: print(line, file=sys.stderr, flush=True))


@contextlib.contextmanager
def resumable(out: outdir.OutDir) -> Iterator[None]:
    """On Ctrl-C, say what was kept and how to resume (the command line ends it: exit 130)."""
    try:
        yield
    except KeyboardInterrupt:
        if sys.stderr.isatty():
            print(file=sys.stderr)  # past the progress line
        print(f"kvlens experiment: {out.interrupted()}", file=sys.stderr, flush=True)
        raise


def arms_of(args: argparse.Namespace) -> list[str]:
    """``--arms`` (default: off, cold and warm with ``--off-endpoint``, else cold and warm), in
    the protocol's order. The off arm runs against ``--off-endpoint``, or ``--endpoint`` when it
    is the run's only arm; an arm without prefix caching and one with it need two endpoints."""
    if args.arms is None:
        return [*(["off"] if args.off_endpoint else []), "cold", "warm"]
    asked = {part.strip() for part in args.arms.split(",") if part.strip()}
    unknown = asked - set(arms.ARM_ORDER)
    if unknown or not asked:
        raise ExperimentError(f"--arms takes off, cold and warm, comma-separated, not {args.arms!r}")
    if "off" in asked and len(asked) > 1 and not args.off_endpoint:
        raise ExperimentError(
            "--arms off with cold or warm needs --off-endpoint for the off arm (a server without "
            "prefix caching); or run --arms off against it on its own, then the others"
        )
    return [name for name in arms.ARM_ORDER if name in asked]


def planned_arms(names: list[str], window: Window, schedule: arms.Schedule) -> list[outdir.PlannedStep]:
    def span(requests: list[TraceRequest], phase: str) -> float:
        planned = schedule.planned(requests, phase)
        return planned[-1].due if planned else 0.0

    measured = span(window.measure, MEASURE)
    steps = []
    for name in names:
        warm = name == "warm"
        requests = len(window.measure) + (len(window.warmup) if warm else 0)
        seconds = measured + (span(window.warmup, WARMUP) if warm else 0.0)
        note = f"{len(window.warmup)} of them warm up, apart" if warm else ""
        steps.append(outdir.PlannedStep(outdir.Step(name, name, "arm"), requests, seconds, note))
    return steps


def planned_quantization(
    names: list[str],
    requests: list[TraceRequest],
    *,
    long_context: int,
    concurrency: int,
    rates: list[float] | None,
    sweep: tuple[float, int] | None,
    max_output_tokens: int | None,
    seed: int,
) -> list[outdir.PlannedStep]:
    from kvlens.experiment import (
        capacity,
        quantization,
        quantization_report,
    )  # as the command does: only when it runs

    by_context = quantization.fixed_groups(requests, quantization_report.Targets(long_context=long_context))
    groups = {group: (len(chosen), "") for group, chosen in by_context.items()}
    if "long" not in groups:  # made by the run, unless an endpoint's context cannot take them
        groups["long"] = (capacity.LONG_PER_SLOT * concurrency, "; made: the trace has none")
    steps = [
        outdir.PlannedStep(
            quantization.fixed_step(name, group), count, None, f"{concurrency} in flight{note}"
        )
        for group, (count, note) in groups.items()
        for name in names
    ]
    ladder = rates or []
    if sweep is not None:
        ladder = [sweep[0] * 2**k for k in range(sweep[1] + 1)]
    for index, rate in enumerate(ladder):
        planned = arms.Schedule(rate=rate, max_output_tokens=max_output_tokens, seed=seed).planned(
            requests, MEASURE
        )
        note = "if the sweep gets there" if sweep is not None and index else ""
        steps += [
            outdir.PlannedStep(quantization.rate_step(rate, name), len(requests), planned[-1].due, note)
            for name in names
        ]
    if sweep is not None:
        halfway = outdir.Step("(halfway rates)", "each", "rate")
        steps.append(outdir.PlannedStep(halfway, 0, 0.0, "at most one per endpoint, where it fell under"))
    return steps
