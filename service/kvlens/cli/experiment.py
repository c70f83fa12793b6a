"""``kvlens experiment``: the articles' experiments (prefix-cache arms; BF16 vs W4A16) against
endpoints."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvlens.analysis import run_facts
from kvlens.cli.common import examples, make_room_for, percentiles_flag, print_report
from kvlens.cli.replay import (
    api_key,
    api_key_flags,
    arm_failures,
    endpoint,
    endpoint_flags,
    error_rate_flag,
    failure_exit,
    progress_line,
    pusher,
    read_requests,
    setup,
    summary,
    trace_flags,
    traffic_flags,
)
from kvlens.config import Settings, load_settings
from kvlens.experiment import reports
from kvlens.experiment import run as arms
from kvlens.experiment.client import Endpoint
from kvlens.experiment.prompts import PromptSynthesizer
from kvlens.experiment.protocol import ExperimentError, check_context


def add_parser(commands: Any) -> None:
    experiment = commands.add_parser(
        "experiment",
        help="the articles' experiments against endpoints",
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
    prefix.add_argument("--out-dir", type=Path, required=True, help="where the arms' records go")
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
    quant.add_argument("trace", metavar="TRACE", help=f"a trace file, or '{arms.SHARED_PREFIX}'")
    quant.add_argument(
        "--endpoint",
        action="append",
        required=True,
        metavar="NAME=URL",
        help="an endpoint to compare, twice or more; the first is the baseline",
    )
    quant.add_argument("--model", required=True, help="the served model name (the same on every endpoint)")
    api_key_flags(quant)
    quant.add_argument("--timeout", type=float, default=600, help="seconds one request may take")
    quant.add_argument("--out-dir", type=Path, required=True, help="where each run's records go")
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
    error_rate_flag(quant)
    traffic_flags(quant)
    quant.set_defaults(run=_quantization, warmup_trace=None)


def _prefix_cache(args: argparse.Namespace) -> int:
    reports.check_error_rate(args.max_error_rate)
    window, prompts, schedule = setup(args, warms=True)
    settings = load_settings(args.config)
    args.out_dir.mkdir(parents=True, exist_ok=True)  # first: --html may be inside it
    make_room_for(args.html)  # before the arms run, not after
    with pusher(args.push) as push:
        results, warnings = arms.prefix_cache_experiment(
            endpoint(args, args.endpoint),
            endpoint(args, args.off_endpoint) if args.off_endpoint else None,
            window,
            args.out_dir,
            prompts,
            schedule,
            assume_empty=args.assume_empty,
            push=push,
            progress=progress_line,
        )
    if sys.stderr.isatty():
        print(file=sys.stderr)
    for result in results:
        print(summary(result), file=sys.stderr)
    for warning in warnings:
        print(f"kvlens experiment: {warning}", file=sys.stderr)
    return _prefix_cache_report(args, results, settings)


def _prefix_cache_report(args: argparse.Namespace, results: list[arms.ArmResult], settings: Settings) -> int:
    """The compare report of the arms, into the out-dir (and --html) and printed; the exit code
    from the arms' failures, once the report is written."""
    from kvlens.analysis import compare, html_compare

    runs = [run for result in results for run in arm_failures(result)]
    try:
        report = arms.compare_arms(results, settings, percentiles=args.percentiles)
    except (compare.ArmsDiffer, compare.NoRecordsOfArm, compare.GroupTooLarge) as error:
        failed = failure_exit("experiment", runs, args.max_error_rate)  # maybe why the arms differ
        if not failed:
            raise ExperimentError(f"no report: {error}") from None
        print(f"kvlens experiment: no report: {error}", file=sys.stderr)
        return failed
    page = html_compare.page(report)
    reports.write_reports(args.out_dir, markdown=compare.markdown(report), page=page, report=report)
    if args.html:
        args.html.write_text(page)
    if args.json:
        print(json.dumps(report, indent=2))
    else:  # as kvlens compare: a table at a terminal, Markdown into a file
        print_report(compare.markdown(report), lambda: compare.terminal(report))
    return failure_exit("experiment", runs, args.max_error_rate)


def _quantization(args: argparse.Namespace) -> int:
    from kvlens.experiment import quantization

    reports.check_error_rate(args.max_error_rate)
    requests, _, block_size = read_requests(args)
    prompts = PromptSynthesizer(block_size, args.vocab_size, args.seed)
    endpoints = quantization.endpoints_from(
        args.endpoint, lambda url: Endpoint(url.rstrip("/"), args.model, api_key(args, url), args.timeout)
    )
    targets = quantization.Targets(args.slo_ttft, args.slo_itl, args.slo_attainment, args.long_context)
    if args.concurrency < 1:
        raise ExperimentError("--concurrency must be at least 1")
    for each in endpoints.values():  # before any prompt is built
        check_context(each, requests)
    rates = quantization.parse_rates(args.rates) if args.rates else None
    quantization.check_sweep(args.rate_sweep, args.sweep_doublings)
    if args.plot and not (rates or args.rate_sweep):
        raise ExperimentError("--plot draws experiment 2: give --rates or --rate-sweep")
    if args.plot:
        from kvlens.experiment.plot import check_path

        check_path(args.plot)
    args.out_dir.mkdir(parents=True, exist_ok=True)  # first: --plot may be inside it
    make_room_for(args.plot)
    fixed = quantization.fixed_work(
        endpoints,
        requests,
        prompts,
        args.out_dir,
        concurrency=args.concurrency,
        targets=targets,
        max_output_tokens=args.max_output_tokens,
    )
    load = None
    if rates or args.rate_sweep:
        step = quantization.stepper(
            endpoints, requests, prompts, args.out_dir, targets, args.max_output_tokens, args.seed
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
    result = quantization.report(fixed, load, targets, next(iter(endpoints)))
    # each step's records file an arm of its own: its failures counted as prefix-cache arms' are
    steps = [*sorted(args.out_dir.glob("fixed-*.jsonl")), *sorted(args.out_dir.glob("rate-*.jsonl"))]
    result["errors"] = {path.stem: run_facts.errors_in(str(path), None) for path in steps}
    text = reports.with_facts(quantization.text(result), result)
    reports.write_reports(
        args.out_dir,
        markdown=text,
        page=reports.text_page(f"kvlens quantization: {', '.join(endpoints)}", text),
        report=result,
    )
    if args.plot:
        from kvlens.experiment.plot import write_plot

        try:
            write_plot(result, args.plot)
        except ValueError as error:  # a PNG without matplotlib
            print(f"kvlens experiment: {error}", file=sys.stderr)
            return 2
    print(json.dumps(result, indent=2) if args.json else text, end="\n" if args.json else "")
    return failure_exit("experiment", list(result["errors"].items()), args.max_error_rate)
