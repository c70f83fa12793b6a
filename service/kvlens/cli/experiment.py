"""``kvlens experiment``: the articles' experiments (prefix-cache arms; BF16 vs W4A16) against
endpoints."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvlens.analysis import run_facts
from kvlens.analysis.settings import AnalysisSettings
from kvlens.cli import SUMMARIES
from kvlens.cli import outdir as runs
from kvlens.cli.common import examples, make_room_for, percentiles_flag, print_report, trace_format_flags
from kvlens.cli.replay import (
    api_key,
    api_key_flags,
    arm_failures,
    endpoint,
    endpoint_flags,
    error_rate_flag,
    failure_exit,
    pusher,
    read_requests,
    setup,
    summary,
    trace_flags,
    traffic_flags,
)
from kvlens.config import load_offline
from kvlens.errors import ArmsDiffer, GroupTooLarge, MissingExtra, NoRecordsOfArm
from kvlens.experiment import outdir, reports
from kvlens.experiment import run as arms
from kvlens.experiment.client import Endpoint
from kvlens.experiment.prompts import PromptSynthesizer
from kvlens.experiment.protocol import ExperimentError, check_context, check_reachable

if TYPE_CHECKING:
    from kvlens.experiment.capacity import ByteModel


def add_parser(commands: Any) -> None:
    experiment = commands.add_parser(
        "experiment",
        help=SUMMARIES["experiment"],
        epilog=examples("kvlens experiment prefix-cache --help", "kvlens experiment quantization --help"),
    )
    kinds = experiment.add_subparsers(required=True, metavar="EXPERIMENT")
    prefix = kinds.add_parser(
        "prefix-cache",
        help="cache off / cold / warm under the same arrivals, then a compare report",
        description="Runs the off arm (when --off-endpoint is given), then cold (cache emptied) and "
        "warm (emptied, warmed by the traffic before --measure-from, timed apart) on --endpoint, "
        "one records file per arm in --out-dir, and prints the compare report.",
        epilog=examples(
            "kvlens experiment prefix-cache shared-prefix --endpoint http://127.0.0.1:8000 "
            "--off-endpoint http://127.0.0.1:8001 --model simulated --out-dir runs/",
        ),
    )
    trace_flags(prefix)
    endpoint_flags(prefix)
    prefix.add_argument("--off-endpoint", metavar="URL", help="the same model served without prefix caching")
    prefix.add_argument(
        "--arms",
        metavar="LIST",
        help="the arms this run adds to --out-dir, comma-separated (off runs against --off-endpoint, or "
        "--endpoint when alone; default: off,cold,warm with --off-endpoint, else cold,warm)",
    )
    prefix.add_argument("--out-dir", type=Path, required=True, help="where the arms' records go")
    runs.run_flags(prefix)
    prefix.add_argument("--config", type=Path, help="YAML settings (prompt-length groups, cost models)")
    prefix.add_argument("--json", action="store_true", help="print the compare result as JSON")
    prefix.add_argument("--html", type=Path, metavar="OUT", help="also write the compare report as HTML")
    percentiles_flag(prefix)
    prefix.set_defaults(run=_prefix_cache)

    quant = kinds.add_parser(
        "quantization",
        help="BF16 vs W4A16: fixed work at a fixed concurrency, then rising load against targets",
        description="Experiment 1 sends every request at --concurrency to each endpoint (short and "
        "long contexts apart; TTFT, inter-token latency and e2e apart). Experiment 2 (--rates) replays "
        "the trace at each rate and reports attainment of --slo-ttft and --slo-itl, goodput, the "
        "highest rate each endpoint holds, and whether a gain came from faster steps or more KV.",
        epilog=examples(
            "kvlens experiment quantization shared-prefix --endpoint bf16=http://127.0.0.1:8000 "
            "--endpoint w4a16=http://127.0.0.1:8001 --model simulated --out-dir quant/ --rates 2,4,8",
        ),
    )
    quant.add_argument(
        "trace",
        metavar="TRACE",
        help=f"a trace (a file or a directory of conversations), or '{arms.SHARED_PREFIX}'",
    )
    quant.add_argument(
        "--endpoint",
        action="append",
        required=True,
        metavar="NAME=URL",
        help="an endpoint to run into --out-dir (repeatable; others may be run into it later); "
        "the first run into it is the baseline",
    )
    quant.add_argument("--model", required=True, help="the served model name (the same on every endpoint)")
    api_key_flags(quant)
    quant.add_argument("--timeout", type=float, default=600, help="seconds one request may take")
    quant.add_argument("--out-dir", type=Path, required=True, help="where each run's records go")
    runs.run_flags(quant)
    quant.add_argument("--concurrency", type=int, default=8, help="experiment 1: requests in flight")
    load = quant.add_mutually_exclusive_group()
    load.add_argument("--rates", help="experiment 2: requests per second, comma-separated (none: skip)")
    load.add_argument(
        "--rate-sweep",
        type=float,
        metavar="START",
        help="experiment 2: START req/s, doubled until every endpoint falls under --slo-attainment, "
        "then once halfway at each endpoint's limit",
    )
    quant.add_argument(
        "--sweep-doublings", type=int, default=6, metavar="N", help="--rate-sweep doubles at most N times"
    )
    quant.add_argument(
        "--plot", type=Path, metavar="FILE", help="attainment against rate per endpoint (.svg, .png)"
    )
    quant.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT target, seconds")
    quant.add_argument("--slo-itl", type=float, default=0.05, help="mean inter-token latency target, s")
    quant.add_argument("--slo-attainment", type=float, default=0.9, help="share that must meet both")
    quant.add_argument("--long-context", type=int, default=4096, help="prompts this long are long")
    quant.add_argument("--max-output-tokens", type=int, help="cap the trace's output lengths")
    quant.add_argument("--json", action="store_true", help="print the report as JSON")
    percentiles_flag(quant)
    error_rate_flag(quant)
    byte_model_flags(quant)
    traffic_flags(quant)
    trace_format_flags(quant)
    quant.set_defaults(run=_quantization, warmup_trace=None)


def byte_model_flags(parser: argparse.ArgumentParser) -> None:
    """The byte model (``kvlens bandwidth``) whose decode step the report shows beside the
    measured ITL ratio."""
    parser.add_argument(
        "--weight-bytes",
        action="append",
        metavar="NAME=SIZE",
        help="the weight bytes an endpoint's decode step reads, e.g. bf16=16GB (once per endpoint)",
    )
    parser.add_argument("--bandwidth", metavar="BW", help="the byte model's memory bandwidth, e.g. 3.35TB/s")
    parser.add_argument("--kv-bytes-per-token", metavar="SIZE", help="c = 2*L*Hkv*D*bytes, e.g. 128KiB")
    parser.add_argument(
        "--step-overhead-ms",
        type=float,
        help="time per step beside the bytes (t0); 0 unless a run into --out-dir gave it",
    )


def _prefix_cache(args: argparse.Namespace) -> int:
    reports.check_error_rate(args.max_error_rate)
    window, prompts, schedule = setup(args, warms=True)
    settings = load_offline(args.config)
    selected = runs.arms_of(args)
    plan = outdir.prefix_cache_plan(
        window,
        schedule,
        block_size=prompts.block_size,
        vocab_size=args.vocab_size,
        max_concurrency=args.max_concurrency,
        api=args.api,
    )
    out = runs.out_dir(args, plan)
    if args.dry_run:
        print(outdir.dry_run(out, runs.planned_arms(selected, window, schedule)), end="")
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)  # first: --html may be inside it
    make_room_for(args.html)  # before the arms run, not after
    off = args.off_endpoint or args.endpoint  # the off arm alone may run against --endpoint
    treated, untreated = endpoint(args, args.endpoint), endpoint(args, off) if "off" in selected else None
    for each in (treated, untreated):  # served and able to take the trace, before the out-dir is written
        if each is not None:
            check_reachable(each)
            check_context(each, [*window.warmup, *window.measure])
    with out.open(selected), runs.resumable(out), pusher(args.push) as push:
        results, warnings = arms.prefix_cache_experiment(
            treated,
            untreated,
            window,
            args.out_dir,
            prompts,
            schedule,
            assume_empty=args.assume_empty,
            push=push,
            progress=out.progress,
            only=selected,
            steps=out,
        )
        found = arms.arms_found(out.found())
    if sys.stderr.isatty():
        print(file=sys.stderr)
    for result in results:
        kept = any(step.name == result.name for step in out.kept)
        print(
            f"arm {result.name}: kept from an earlier run: {result.records}" if kept else summary(result),
            file=sys.stderr,
        )
    for warning in warnings:
        print(f"kvlens experiment: {warning}", file=sys.stderr)
    ran = [run for result in results for run in arm_failures(result)]  # this run's arms are judged
    if len(found) < 2:
        missing = [name for name in arms.ARM_ORDER if name not in {arm.name for arm in found}]
        print(
            f"kvlens experiment: {args.out_dir} holds the arm(s) {', '.join(a.name for a in found)}; "
            f"no report until another is run into it (--arms {','.join(missing)})",
            file=sys.stderr,
        )
        return failure_exit("experiment", ran, args.max_error_rate)
    return _prefix_cache_report(args, found, ran, settings)


def _prefix_cache_report(
    args: argparse.Namespace,
    found: list[arms.ArmResult],
    ran: list[tuple[str, dict[str, Any] | None]],
    settings: AnalysisSettings,
) -> int:
    """The compare report of every arm in the out-dir, into it (and --html) and printed; the exit
    code from the failures of the arms this run ran (``ran``), once the report is written."""
    from kvlens.analysis import compare_text, html_compare

    try:
        report = arms.compare_arms(found, settings, percentiles=args.percentiles)
    except (ArmsDiffer, NoRecordsOfArm, GroupTooLarge) as error:
        failed = failure_exit("experiment", ran, args.max_error_rate)  # maybe why the arms differ
        if not failed:
            raise ExperimentError(f"no report: {error}") from None
        print(f"kvlens experiment: no report: {error}", file=sys.stderr)
        return failed
    page = html_compare.page(report)
    reports.write_reports(args.out_dir, markdown=compare_text.markdown(report), page=page, report=report)
    if args.html:
        args.html.write_text(page)
    if args.json:
        print(json.dumps(report, indent=2))
    else:  # as kvlens compare: a table at a terminal, Markdown into a file
        print_report(compare_text.markdown(report), lambda: compare_text.terminal(report))
    return failure_exit("experiment", ran, args.max_error_rate)


def _quantization(args: argparse.Namespace) -> int:
    from kvlens.experiment import capacity, quantization, quantization_report, quantization_text

    reports.check_error_rate(args.max_error_rate)
    requests, _, block_size = read_requests(args)
    prompts = PromptSynthesizer(block_size, args.vocab_size, args.seed)
    endpoints = quantization.endpoints_from(
        args.endpoint, lambda url: Endpoint(url.rstrip("/"), args.model, api_key(args, url), args.timeout)
    )
    targets = quantization_report.Targets(args.slo_ttft, args.slo_itl, args.slo_attainment, args.long_context)
    if args.concurrency < 1:
        raise ExperimentError("--concurrency must be at least 1")
    rates = quantization.parse_rates(args.rates) if args.rates else None
    quantization.check_sweep(args.rate_sweep, args.sweep_doublings)
    if args.plot and not (rates or args.rate_sweep):
        raise ExperimentError("--plot draws experiment 2: give --rates or --rate-sweep")
    if args.plot:
        from kvlens.experiment.plot import check_path

        check_path(args.plot)
    sweep = None if args.rate_sweep is None else (args.rate_sweep, args.sweep_doublings)
    plan = outdir.quantization_plan(
        requests,
        targets=targets,
        block_size=block_size,
        vocab_size=args.vocab_size,
        seed=args.seed,
        concurrency=args.concurrency,
        max_output_tokens=args.max_output_tokens,
        rates=rates,
        sweep=sweep,
    )
    out = runs.out_dir(args, plan)
    byte_model = _byte_model(args, out, list(endpoints))
    if args.dry_run:
        planned = runs.planned_quantization(
            list(endpoints),
            requests,
            long_context=args.long_context,
            concurrency=args.concurrency,
            rates=rates,
            sweep=sweep,
            max_output_tokens=args.max_output_tokens,
            seed=args.seed,
        )
        print(outdir.dry_run(out, planned), end="")
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)  # first: --plot may be inside it
    make_room_for(args.plot)
    for each in endpoints.values():  # before any prompt is built and the out-dir is written
        check_reachable(each)
        check_context(each, requests)
    with out.open(endpoints), runs.resumable(out):  # a folder of another plan: refused first
        if byte_model is not None:
            out.keep_json(quantization.BYTE_MODEL, capacity.byte_model_json(byte_model))
        quantization.fixed_work(
            endpoints,
            requests,
            prompts,
            args.out_dir,
            concurrency=args.concurrency,
            targets=targets,
            max_output_tokens=args.max_output_tokens,
            steps=out,
        )
        load = None
        if rates or args.rate_sweep:
            step = quantization.stepper(
                endpoints,
                requests,
                prompts,
                args.out_dir,
                targets,
                args.max_output_tokens,
                args.seed,
                steps=out,
            )
            load = (
                quantization.rate_sweep(
                    step,
                    list(endpoints),
                    start=args.rate_sweep,
                    targets=targets,
                    max_doublings=args.sweep_doublings,
                )
                if args.rate_sweep
                else quantization.run_rates(step, list(endpoints), rates or [], targets)
            )
        if sys.stderr.isatty():
            print(file=sys.stderr)  # past the progress line
        state = out.state() or {}
        result = quantization_report.merged(
            out.found(),
            list(state.get("endpoints", endpoints)),
            targets,
            (load or {}).get("sweep"),
            byte_model=byte_model,
            percentiles=args.percentiles,
        )
    if len(result["fixed_work"] or {}) < 2:
        print(
            f"kvlens experiment: {args.out_dir} holds one endpoint so far; run the others into it "
            "(--endpoint NAME=URL, the same --out-dir and plan) to compare",
            file=sys.stderr,
        )
    # each finished step's records file an arm of its own: its failures counted as prefix-cache
    # arms' are (the folder holds only this plan's steps: plan.json refuses any other)
    steps = [*sorted(args.out_dir.glob("fixed-*.jsonl")), *sorted(args.out_dir.glob("rate-*.jsonl"))]
    result["errors"] = {path.stem: run_facts.errors_in(str(path), None) for path in steps}
    text = reports.with_facts(quantization_text.text(result), result)
    reports.write_reports(
        args.out_dir,
        markdown=text,
        page=reports.text_page(f"kvlens quantization: {', '.join(result['fixed_work'] or endpoints)}", text),
        report=result,
    )
    if args.plot:
        from kvlens.experiment.plot import write_plot

        try:
            write_plot(result, args.plot)
        except (ValueError, MissingExtra) as error:  # a PNG without matplotlib
            print(f"kvlens experiment: {error}", file=sys.stderr)
            return 2
    print(json.dumps(result, indent=2) if args.json else text, end="\n" if args.json else "")
    return failure_exit("experiment", list(result["errors"].items()), args.max_error_rate)


def _byte_model(args: argparse.Namespace, out: outdir.OutDir, names: list[str]) -> ByteModel | None:
    """The byte model of this run's flags over the one kept in the out-dir (None: none); the
    endpoints' names checked against the folder's first (a name that would share a step's file)."""
    from kvlens.experiment import capacity, quantization

    known = list(dict.fromkeys([*names, *(out.state() or {}).get("endpoints", [])]))
    quantization.check_names(known)
    try:
        kept = capacity.byte_model_of(out.kept_json(quantization.BYTE_MODEL))
    except ValueError as error:
        raise ExperimentError(
            f"{out.path / quantization.BYTE_MODEL}: {error}; remove it and give the byte model's flags"
        ) from None
    try:
        return capacity.byte_model_from(
            args.weight_bytes, args.bandwidth, args.kv_bytes_per_token, args.step_overhead_ms, known, kept
        )
    except ValueError as error:
        raise ExperimentError(str(error)) from None
