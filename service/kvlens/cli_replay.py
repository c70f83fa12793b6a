"""``kvlens replay`` and ``kvlens experiment prefix-cache``: parse, call ``experiment/``, print."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvlens.config import load_settings
from kvlens.experiment import run
from kvlens.experiment.client import Endpoint, Progress
from kvlens.experiment.prompts import DEFAULT_VOCAB_SIZE, PromptSynthesizer
from kvlens.experiment.protocol import ExperimentError, Window, measured_window
from kvlens.simulate.trace import TraceRequest, open_trace


def add_commands(commands: Any) -> None:
    replay = commands.add_parser(
        "replay",
        help="replay a trace against an OpenAI-compatible endpoint as one arm; kvlens records out",
        description="Send a trace's requests (token-id prompts that keep its shared prefixes, its "
        "lengths and arrivals) to an endpoint, open loop, and write one kvlens record per request.",
        epilog="example: kvlens replay shared-prefix --endpoint http://127.0.0.1:8000 "
        "--model simulated --arm cold --reset --out cold.jsonl",
    )
    _trace_flags(replay)
    _endpoint_flags(replay)
    replay.add_argument("--arm", required=True, help="the arm's name, written into each record")
    replay.add_argument("--out", type=Path, required=True, metavar="RECORDS.jsonl", help="records file")
    replay.add_argument("--reset", action="store_true", help="empty the endpoint's prefix cache first")
    replay.add_argument(
        "--warm", action="store_true", help="replay the warm-up (before --measure-from) first, apart"
    )
    replay.set_defaults(run=_replay)

    experiment = commands.add_parser("experiment", help="the articles' experiments against endpoints")
    kinds = experiment.add_subparsers(required=True, metavar="EXPERIMENT")
    prefix = kinds.add_parser(
        "prefix-cache",
        help="cache off / cold / warm under the same arrivals, then a compare report",
        description="Runs the off arm (when --off-endpoint is given), then cold (cache emptied) and "
        "warm (emptied, warmed by the traffic before --measure-from, timed apart) on --endpoint, "
        "one records file per arm in --out-dir, and prints the compare report.",
        epilog="example: kvlens experiment prefix-cache shared-prefix --endpoint http://127.0.0.1:8000 "
        "--off-endpoint http://127.0.0.1:8001 --model simulated --out-dir runs/",
    )
    _trace_flags(prefix)
    _endpoint_flags(prefix)
    prefix.add_argument("--off-endpoint", metavar="URL", help="the same model served without prefix caching")
    prefix.add_argument("--out-dir", type=Path, required=True, help="where the arms' records go")
    prefix.add_argument("--config", type=Path, help="YAML settings (prompt-length groups, cost models)")
    prefix.add_argument("--json", action="store_true", help="print the compare result as JSON")
    prefix.set_defaults(run=_prefix_cache)

    quant = kinds.add_parser(
        "quantization",
        help="BF16 vs W4A16: fixed work at a fixed concurrency, then rising load against targets",
        description="Experiment 1 sends every request at --concurrency to each endpoint (short and "
        "long contexts apart; TTFT, inter-token latency and e2e apart). Experiment 2 (--rates) replays "
        "the trace at each rate and reports attainment of --slo-ttft and --slo-itl, goodput, the "
        "highest rate each endpoint holds, and whether a gain came from faster steps or more KV.",
        epilog="example: kvlens experiment quantization shared-prefix --endpoint bf16=http://127.0.0.1:8000 "
        "--endpoint w4a16=http://127.0.0.1:8001 --model simulated --out-dir quant/ --rates 2,4,8",
    )
    quant.add_argument("trace", metavar="TRACE", help=f"a trace file, or '{run.SHARED_PREFIX}'")
    quant.add_argument(
        "--endpoint",
        action="append",
        required=True,
        metavar="NAME=URL",
        help="an endpoint to compare, twice or more; the first is the baseline",
    )
    quant.add_argument("--model", required=True, help="the served model name (the same on every endpoint)")
    quant.add_argument("--api-key", help="bearer token for the endpoints")
    quant.add_argument("--timeout", type=float, default=600, help="seconds one request may take (600)")
    quant.add_argument("--out-dir", type=Path, required=True, help="where each run's records go")
    quant.add_argument("--concurrency", type=int, default=8, help="experiment 1: requests in flight (8)")
    quant.add_argument("--rates", help="experiment 2: requests per second, comma-separated (none: skip)")
    quant.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT target, seconds (2)")
    quant.add_argument(
        "--slo-itl", type=float, default=0.05, help="mean inter-token latency target, s (0.05)"
    )
    quant.add_argument("--slo-attainment", type=float, default=0.9, help="share that must meet both (0.9)")
    quant.add_argument("--long-context", type=int, default=4096, help="prompts this long are long (4096)")
    quant.add_argument("--max-output-tokens", type=int, help="cap the trace's output lengths")
    quant.add_argument("--json", action="store_true", help="print the report as JSON")
    _traffic_flags(quant)
    quant.set_defaults(run=_quantization, warmup_trace=None)


def _trace_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "trace",
        metavar="TRACE",
        help=f"Mooncake, Bailian or kvlens-record JSONL, or '{run.SHARED_PREFIX}' (built-in traffic)",
    )
    parser.add_argument("--speed", type=float, default=1.0, help="play the trace this much faster (1)")
    parser.add_argument("--rate", type=float, help="requests per second instead of the trace's times")
    parser.add_argument("--burstiness", type=float, default=1.0, help="with --rate: 1 Poisson, <1 burstier")
    parser.add_argument("--max-output-tokens", type=int, help="cap the trace's output lengths")
    parser.add_argument(
        "--measure-from", type=float, metavar="T", help="trace seconds where measuring begins"
    )
    parser.add_argument("--warmup-trace", metavar="FILE", help="warm up with this trace instead")
    _traffic_flags(parser)


def _traffic_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="token ids below it (32000)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts and --rate arrivals (0)")
    parser.add_argument("--requests", type=int, default=200, help=f"{run.SHARED_PREFIX}: requests (200)")
    parser.add_argument("--groups", type=int, default=4, help=f"{run.SHARED_PREFIX}: system prompts (4)")
    parser.add_argument("--prefix-tokens", type=int, default=1024, help=f"{run.SHARED_PREFIX}: shared (1024)")
    parser.add_argument("--suffix-tokens", type=int, default=128, help=f"{run.SHARED_PREFIX}: own (128)")
    parser.add_argument("--output-tokens", type=int, default=32, help=f"{run.SHARED_PREFIX}: output (32)")
    parser.add_argument("--traffic-rate", type=float, default=4.0, help=f"{run.SHARED_PREFIX}: per s (4)")


def _endpoint_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", required=True, metavar="URL", help="the server's base URL (no /v1)")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--api-key", help="bearer token for the endpoint")
    parser.add_argument("--max-concurrency", type=int, default=256, help="requests in flight at most (256)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one request may take (600)")
    parser.add_argument("--assume-empty", action="store_true", help="call an arm cold without a reset")
    parser.add_argument(
        "--missing-cached-is-zero", action="store_true", help="a usage without cached_tokens means 0"
    )
    parser.add_argument("--push", metavar="URL", help="also send the records to a kvlens serve")


def _requests(args: argparse.Namespace) -> tuple[list[TraceRequest], list[TraceRequest] | None, int]:
    if args.trace == run.SHARED_PREFIX:
        traffic = run.SharedPrefixTraffic(
            args.requests,
            args.groups,
            args.prefix_tokens,
            args.suffix_tokens,
            args.output_tokens,
            args.traffic_rate,
            args.seed,
        )
        requests, block_size = traffic.trace(), run.SHARED_PREFIX_BLOCK
    else:
        trace = open_trace(args.trace)
        requests, block_size = list(trace.requests()), trace.block_size
    warmup = None
    if args.warmup_trace:
        extra = open_trace(args.warmup_trace, block_size=block_size)
        warmup = list(extra.requests())
    return requests, warmup, block_size


def _setup(args: argparse.Namespace, *, warms: bool) -> tuple[Window, PromptSynthesizer, run.Schedule]:
    """``warms``: the run has a warm-up, so the trace is split (see ``protocol.split``); a single
    arm that does not warm up measures the whole trace."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would drown the run
    requests, warmup, block_size = _requests(args)
    if warms or args.measure_from is not None or warmup is not None:
        window = measured_window(requests, args.measure_from, warmup)
    else:
        window = measured_window(requests, -math.inf, None)
    prompts = PromptSynthesizer(block_size, args.vocab_size, args.seed)
    schedule = run.Schedule(args.speed, args.rate, args.burstiness, args.max_output_tokens, args.seed)
    return window, prompts, schedule


def _endpoint(args: argparse.Namespace, url: str) -> Endpoint:
    if args.max_concurrency < 1:
        raise ExperimentError("--max-concurrency must be at least 1")
    return Endpoint(
        url.rstrip("/"),
        args.model,
        args.api_key,
        args.timeout,
        args.max_concurrency,
        args.missing_cached_is_zero,
    )


@contextlib.contextmanager
def _pusher(url: str | None) -> Iterator[Callable[[dict[str, Any]], None] | None]:
    if not url:
        yield None
        return
    from kvlens.sources.vllm_plugin import HttpSink, Shipper, plugin_settings

    shipper = Shipper(HttpSink(url, plugin_settings({}).token), flush_seconds=0.5)
    try:
        yield shipper.offer
    finally:
        shipper.close(timeout=10)


def _progress_line(label: str, progress: Progress, total: int) -> None:
    if sys.stderr.isatty():
        print(
            f"\r{label}: {progress.done}/{total} done, {progress.in_flight} in flight, "
            f"{progress.late} late, {progress.errors} errors ",
            end="",
            file=sys.stderr,
            flush=True,
        )


def _summary(result: run.ArmResult) -> str:
    progress = result.progress
    lags = sorted(progress.lags)
    p99 = lags[int(0.99 * (len(lags) - 1))] if lags else 0.0
    text = (
        f"arm {result.name}: {progress.done} requests -> {result.records} "
        f"({progress.errors} errors, {progress.late} late, send lag p99 {p99 * 1000:.1f} ms)"
    )
    if result.warmup is not None:
        text += f"; warm-up {result.warmup.done} requests -> {result.warmup_records}"
    return text


def _replay(args: argparse.Namespace) -> int:
    window, prompts, schedule = _setup(args, warms=args.warm)
    with _pusher(args.push) as push:
        result = run.run_arm(
            args.arm,
            _endpoint(args, args.endpoint),
            window,
            args.out,
            prompts,
            schedule,
            reset=args.reset,
            assume_empty=args.assume_empty,
            warm=args.warm,
            push=push,
            progress=_progress_line,
        )
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print(_summary(result))
    return 0


def _prefix_cache(args: argparse.Namespace) -> int:
    from kvlens.analysis import compare

    window, prompts, schedule = _setup(args, warms=True)
    settings = load_settings(args.config)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with _pusher(args.push) as push:
        results, warnings = run.prefix_cache_experiment(
            _endpoint(args, args.endpoint),
            _endpoint(args, args.off_endpoint) if args.off_endpoint else None,
            window,
            args.out_dir,
            prompts,
            schedule,
            assume_empty=args.assume_empty,
            push=push,
            progress=_progress_line,
        )
    if sys.stderr.isatty():
        print(file=sys.stderr)
    for result in results:
        print(_summary(result), file=sys.stderr)
    for warning in warnings:
        print(f"kvlens experiment: {warning}", file=sys.stderr)
    report = run.compare_arms(results, settings)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(compare.markdown(report), end="")
        print(
            "\nReuse is not speedup: a warm arm's cached tokens save prefill work, and TTFT falls only "
            "where prefill, not queueing, was the wait."
        )
    return 0


def _quantization(args: argparse.Namespace) -> int:
    from kvlens.experiment import quantization

    logging.getLogger("httpx").setLevel(logging.WARNING)
    requests, _, block_size = _requests(args)
    prompts = PromptSynthesizer(block_size, args.vocab_size, args.seed)
    endpoints = quantization.endpoints_from(
        args.endpoint, lambda url: Endpoint(url.rstrip("/"), args.model, args.api_key, args.timeout)
    )
    targets = quantization.Targets(args.slo_ttft, args.slo_itl, args.slo_attainment, args.long_context)
    if args.concurrency < 1:
        raise ExperimentError("--concurrency must be at least 1")
    rates = quantization.parse_rates(args.rates) if args.rates else None
    args.out_dir.mkdir(parents=True, exist_ok=True)
    fixed = quantization.fixed_work(
        endpoints,
        requests,
        prompts,
        args.out_dir,
        concurrency=args.concurrency,
        targets=targets,
        max_output_tokens=args.max_output_tokens,
    )
    load = (
        quantization.rising_load(
            endpoints,
            requests,
            prompts,
            args.out_dir,
            rates=rates,
            targets=targets,
            max_output_tokens=args.max_output_tokens,
            seed=args.seed,
        )
        if rates
        else None
    )
    result = quantization.report(fixed, load, targets, next(iter(endpoints)))
    print(
        json.dumps(result, indent=2) if args.json else quantization.text(result),
        end="\n" if args.json else "",
    )
    return 0
