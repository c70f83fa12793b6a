"""``kvlens serve|demo``: the command line."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import uvicorn
import yaml
from prometheus_client import CollectorRegistry, ProcessCollector

from kvlens import __version__
from kvlens.config import ENV_PREFIX, Settings, load_settings
from kvlens.errors import InputError, SettingsError
from kvlens.exporter import server
from kvlens.exporter.aggregator import Aggregator
from kvlens.exporter.app import create_app
from kvlens.records import batch_from_objects
from kvlens.sources import demo

log = logging.getLogger("kvlens")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get(f"{ENV_PREFIX}LOG_LEVEL", "INFO"), format="%(levelname)s %(name)s: %(message)s"
    )
    command: Callable[[argparse.Namespace], int] = args.run
    try:
        return command(args)
    except (SettingsError, InputError) as error:
        print(f"kvlens: {error}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] not in ("rich", "scipy"):
            raise
        print("kvlens: this command needs the analyze extra: pip install 'kvlens[analyze]'", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlens", description="Is your prefix cache actually paying off?")
    parser.add_argument("--version", action="version", version=f"kvlens {__version__}")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    def server_flags(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--host", help=f"listen address (env {ENV_PREFIX}HOST; default 127.0.0.1)")
        sub.add_argument("--port", type=int, help=f"listen port (env {ENV_PREFIX}PORT; default 9433)")
        sub.add_argument(
            "--config",
            type=Path,
            default=os.environ.get(f"{ENV_PREFIX}CONFIG") or None,
            help=f"YAML settings file (env {ENV_PREFIX}CONFIG); environment variables override it",
        )

    serve = commands.add_parser("serve", help="run the sidecar: POST /v1/records, GET /metrics")
    server_flags(serve)
    serve.add_argument(
        "--tail",
        action="append",
        metavar="GLOB",
        help="follow JSON-lines files (repeatable; each takes the --format given after it)",
    )
    serve.add_argument(
        "--format",
        action="append",
        dest="formats",
        metavar="F",
        help="format of the --tail before it: kvlens (default), sglang, openai-usage",
    )
    serve.add_argument("--model", help="model label for tailed lines that carry none (SGLang)")
    serve.add_argument(
        "--scrape",
        action="append",
        metavar="URL",
        help=f"a vLLM /metrics URL to reconcile with (repeatable; env {ENV_PREFIX}SCRAPE_TARGETS as JSON)",
    )
    serve.set_defaults(run=_serve)

    run_demo = commands.add_parser(
        "demo", help="run the sidecar fed live by the simulator replaying a real trace (bundled)"
    )
    server_flags(run_demo)
    run_demo.add_argument(
        "--traffic",
        choices=("replay", "synthetic"),
        default="replay",
        help="replay: the bundled Mooncake trace on a simulated fleet (default); synthetic: article-shaped",
    )
    run_demo.add_argument(
        "--speed", type=float, default=4.0, help="replay this many times faster (default 4)"
    )
    run_demo.add_argument(
        "--policy",
        default="prefix_affinity",
        choices=("round_robin", "least_queue", "prefix_affinity", "cost_aware"),
        help="the replay fleet's router (default prefix_affinity)",
    )
    run_demo.add_argument("--rate", type=float, default=20.0, help="synthetic: requests per second (20)")
    run_demo.add_argument("--seed", type=int, default=0, help="synthetic: random seed")
    run_demo.add_argument("--every", type=float, default=5.0, help="seconds between summary lines")
    run_demo.add_argument("--duration", type=float, help="stop after this many seconds (default: run)")
    run_demo.set_defaults(run=_demo)

    def input_flags(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--format", dest="input_format", help="kvlens, sglang or openai-usage (default: detect)"
        )
        sub.add_argument("--model", help="model for records that carry none (SGLang)")
        sub.add_argument("--config", type=Path, help="YAML settings: prompt_length_edges, cost_models, ...")
        sub.add_argument(
            "--json", action="store_true", help="print the report as JSON (schema in the README)"
        )
        sub.add_argument("--markdown", action="store_true", help="print the report as Markdown")

    def scale_flags(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--memory-limit", metavar="SIZE", help="DuckDB's memory before it spills, e.g. 2GiB (the default)"
        )

    analyze = commands.add_parser("analyze", help="report, diagnose and calibrate recorded traffic")
    analyze.add_argument(
        "files",
        nargs="*",
        metavar="FILE",
        help="JSON-lines (.gz allowed; - for stdin) or Parquet files, directories, globs",
    )
    input_flags(analyze)
    scale_flags(analyze)
    analyze.add_argument(
        "--engine",
        choices=("auto", "numpy", "duckdb"),
        default="auto",
        help="duckdb: out of core (the scale extra); auto: duckdb for Parquet or large input",
    )
    analyze.add_argument(
        "--print-sql",
        action="store_true",
        help="print the reducer as portable SQL (for a warehouse) and exit",
    )
    analyze.add_argument("--html", type=Path, metavar="OUT", help="write a self-contained HTML report")
    analyze.add_argument(
        "--calibrate", type=Path, metavar="OUT", help="write fitted cost models in seconds (YAML settings)"
    )
    analyze.add_argument(
        "--prefill-points",
        type=Path,
        action="append",
        default=[],
        metavar="CSV",
        help="measured prefill points to calibrate from (columns of prefill_h200.csv; see README)",
    )
    analyze.set_defaults(run=_analyze)

    convert = commands.add_parser(
        "convert", help="write records as Parquet (what the duckdb engine reads fastest)"
    )
    convert.add_argument(
        "files", nargs="+", metavar="RECORDS", help="JSON-lines or Parquet files, directories, globs"
    )
    convert.add_argument("--to", nargs=2, required=True, metavar=("FORMAT", "OUT"), help="parquet OUT")
    convert.add_argument(
        "--format", dest="input_format", help="kvlens, sglang or openai-usage (default: detect)"
    )
    convert.add_argument("--model", help="model for records that carry none (SGLang)")
    convert.add_argument("--config", type=Path, help="YAML settings (analyze_memory_limit)")
    scale_flags(convert)
    convert.set_defaults(run=_convert)

    compare = commands.add_parser(
        "compare", help="compare cache-off / cold / warm replays of one request sequence"
    )
    compare.add_argument(
        "--arm", action="append", required=True, metavar="NAME=FILE", help="an arm; the first is the baseline"
    )
    input_flags(compare)
    warm = compare.add_mutually_exclusive_group()
    warm.add_argument("--warmup", type=int, default=0, metavar="N", help="the first N requests are warm-up")
    warm.add_argument(
        "--warmup-until", type=float, metavar="T", help="requests arriving before T are warm-up"
    )
    compare.set_defaults(run=_compare)

    sim = commands.add_parser(
        "simulate", help="replay a trace on a fleet: reachable vs delivered reuse per policy and capacity"
    )
    sim.add_argument(
        "trace",
        nargs="?",
        metavar="TRACE",
        help="Mooncake, Bailian or kvlens-record JSONL (default: bundled Mooncake)",
    )
    sim.add_argument("--replicas", type=int, default=4, help="replicas in the fleet (default 4)")
    sim.add_argument(
        "--capacity-blocks",
        default="1000",
        metavar="C[,C...]",
        help="KV cache blocks per replica; several for a sweep; 'unbounded' allowed (default 1000)",
    )
    sim.add_argument(
        "--policy",
        action="append",
        choices=("round_robin", "least_queue", "prefix_affinity", "cost_aware"),
        help="routing policy, repeatable (default: all four)",
    )
    sim.add_argument("--block-size", type=int, help="refuse a trace whose blocks are not this size")
    sim.add_argument(
        "--time-scale", type=float, default=1.0, help="multiply arrival times (0.5: twice the rate)"
    )
    sim.add_argument("--rate", type=float, help="requests per second on average (rescales arrival times)")
    sim.add_argument("--max-running", type=int, default=256, help="requests holding KV per replica (256)")
    sim.add_argument("--no-chunked-prefill", action="store_true", help="a prefill pauses the running decodes")
    sim.add_argument("--no-guard", action="store_true", help="prefix_affinity without its load guard")
    sim.add_argument("--balance-abs", type=int, default=64, help="load guard: outstanding gap (64)")
    sim.add_argument("--balance-rel", type=float, default=1.5, help="load guard: busiest/idlest ratio (1.5)")
    sim.add_argument("--config", type=Path, help="YAML settings: a cost model in seconds under cost_models")
    sim.add_argument(
        "--model", help="whose cost model in seconds (from --config) times prefill (default: an H200, 8B)"
    )
    sim.add_argument("--json", action="store_true", help="print the result as JSON")
    sim.add_argument(
        "--plot", type=Path, metavar="FILE", help="write the reuse-vs-capacity curve (.svg, .png)"
    )
    sim.add_argument(
        "--emit-records", type=Path, metavar="FILE", help="write the simulated requests as kvlens records"
    )
    sim.set_defaults(run=_simulate)

    decode = commands.add_parser("bandwidth", help="decode traffic model: would W4A16 speed up decode?")
    shape = decode.add_argument_group("model shape: a config.json, the numbers, or the KV bytes directly")
    shape.add_argument("--config-json", type=Path, help="a Hugging Face config.json")
    shape.add_argument("--layers", type=int)
    shape.add_argument("--kv-heads", type=int)
    shape.add_argument("--head-dim", type=int)
    shape.add_argument("--kv-dtype-bytes", type=float, default=None, help="bytes per KV value (default 2)")
    shape.add_argument(
        "--kv-bytes-per-sequence", help="K: KV bytes one sequence holds at --context, e.g. 1GiB"
    )
    size = decode.add_mutually_exclusive_group()
    size.add_argument("--params", help="parameter count, e.g. 8B (16-bit weights: 2 bytes each)")
    size.add_argument("--weight-bytes", help="16-bit weight bytes, e.g. 14GiB")
    decode.add_argument(
        "--quantized-weight-bytes",
        help="quantized weight bytes, e.g. 4GiB (instead of --bits, --group-size, --quantized-fraction)",
    )
    decode.add_argument(
        "--bits", type=int, default=4, choices=(4, 8), help="quantized weight bits (default 4)"
    )
    decode.add_argument("--group-size", type=int, default=128, help="weights per 16-bit scale (default 128)")
    decode.add_argument("--quantized-fraction", type=float, default=0.9, help="share of weights quantized")
    decode.add_argument("--bandwidth", help="memory bandwidth, e.g. 4.8TB/s or 1TiB/s")
    decode.add_argument("--batch", default=None, help="batch sizes, comma-separated (default 1,8,32)")
    decode.add_argument("--context", default="8192", help="context lengths in tokens, comma-separated")
    decode.add_argument("--compute-floor-ms", type=float, default=0.0, help="a compute-bound floor per step")
    decode.add_argument("--extra-ms", type=float, default=0.0, help="extra time per quantized step")
    decode.add_argument(
        "--measured",
        type=Path,
        metavar="CSV",
        help="measured step times (columns of decode_h200.csv): fit t0 + bytes/BW per path instead",
    )
    decode.add_argument("--json", action="store_true")
    decode.set_defaults(run=_bandwidth)
    return parser


def _settings(args: argparse.Namespace, **overrides: Any) -> Settings:
    return load_settings(
        args.config,
        **overrides,
        host=args.host,
        port=args.port,
        scrape_targets=getattr(args, "scrape", None),
        tails=_tails(
            getattr(args, "tail", None), getattr(args, "formats", None), getattr(args, "model", None)
        ),
    )


def _tails(
    globs: list[str] | None, formats: list[str] | None, model: str | None
) -> list[dict[str, str]] | None:
    """Pair each --tail with the --format given for it (kvlens when none)."""
    if not globs:
        if formats:
            raise SettingsError("--format needs a --tail to apply to")
        return None
    formats = formats or []
    if len(formats) > len(globs):
        raise SettingsError("more --format than --tail flags")
    padded = formats + ["kvlens"] * (len(globs) - len(formats))
    return [
        {"path": path, "format": format_name, **({"model": model} if model else {})}
        for path, format_name in zip(globs, padded, strict=True)
    ]


def _server(settings: Settings, aggregator: Aggregator, log_level: str) -> uvicorn.Server:
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)  # process_start_time_seconds shows restarts
    app = create_app(settings, registry, aggregator)
    sockets = server.raise_open_files_limit()
    if sockets < settings.max_connections + 64:
        log.warning(
            "kvlens: the open-files limit (%d) is under max_connections (%d): raise it or lower the cap",
            sockets,
            settings.max_connections,
        )
    if settings.ingest_open:
        log.warning(
            "ingest (POST /v1/records, /v1/traces) listens on %s without a token: anyone "
            "who reaches this port can push records. Set KVLENS_INGEST_TOKEN (and KVLENS_PLUGIN_TOKEN in "
            "vLLM), or listen on 127.0.0.1.",
            settings.host,
        )
    for note in settings.cost_model_notes():
        log.info("%s", note)
    guard = app.state.sidecar.health.connections
    assert guard is not None
    return server.build_server(settings, app, guard, log_level)


def _serve(args: argparse.Namespace) -> int:
    settings = _settings(args)
    server = _server(settings, Aggregator(settings), "info")
    server.run()
    return 0


def _demo(args: argparse.Namespace) -> int:
    settings = _settings(args, docs=True)
    traffic: demo.TrafficSource
    if args.traffic == "synthetic":
        traffic = demo.DemoTraffic(rate_per_second=args.rate, seed=args.seed)
        what = (
            "built-in traffic shaped like the articles' fleet (many short requests that hit a small\n"
            "shared prefix, a few long ones that miss)"
        )
    else:
        if not settings.model_shapes:  # the replayed model's shape: compute saved in FLOPs
            settings = _settings(args, docs=True, model_shapes={demo.REPLAY_MODEL: demo.REPLAY_SHAPE})
        replay = demo.ReplayTraffic(speed=args.speed, policy=args.policy)
        traffic = replay
        what = (
            f"the Mooncake trace (kvcache-ai/Mooncake, Apache-2.0) replayed {args.speed:g}x faster by the\n"
            f"simulator on {replay.replicas} replicas of {replay.capacity_blocks:,} cache blocks, routed by "
            f"{args.policy}"
        )
    aggregator = Aggregator(settings, extra_sources=(demo.SOURCE,))
    server = _server(settings, aggregator, "warning")
    stop = threading.Event()
    base = f"http://{settings.host}:{settings.port}"
    print(
        f"kvlens demo: {what}, fed through the live exporter.\n"
        f"  metrics   {base}/metrics\n"
        f"  API docs  {base}/docs\n"
        f"  push your own records: curl -X POST {base}/v1/records "
        '-d \'{"prompt_tokens": 128, "cached_tokens": 16}\'\n'
        "Ctrl-C to stop.",
        flush=True,
    )
    threads = [
        threading.Thread(target=_feed, args=(traffic, aggregator, stop), name="demo-feed", daemon=True),
        threading.Thread(
            target=_summarize,
            args=(aggregator, stop, args.every, sys.stdout),
            name="demo-summary",
            daemon=True,
        ),
    ]
    if args.duration is not None:
        threading.Timer(args.duration, lambda: setattr(server, "should_exit", True)).start()
    for thread in threads:
        thread.start()
    try:
        server.run()
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=2)
    print_summary(aggregator, sys.stdout)
    return 0


def _analyze(args: argparse.Namespace) -> int:
    from kvlens.analysis import calibration, render
    from kvlens.analysis.analyze import analyze, choose_engine

    settings = load_settings(args.config)
    if args.print_sql:
        from kvlens.analysis import warehouse

        print(warehouse.script(settings), end="")
        return 0
    if not args.files and not args.prefill_points:
        print("kvlens analyze: give record files, --prefill-points CSV, or both", file=sys.stderr)
        return 2
    with _progress(args.files) as progress:
        report, fits = analyze(
            args.files,
            settings,
            format_name=args.input_format,
            model=args.model,
            progress=progress,
            prefill_points=args.prefill_points,
            engine=choose_engine(args.engine, args.files),
            memory_limit=args.memory_limit or settings.analyze_memory_limit,
        )
    if args.calibrate:
        args.calibrate.write_text(yaml.safe_dump(calibration.cost_model_file(fits), sort_keys=False))
    if args.html:
        args.html.write_text(render.html_page(report))
    if args.json:
        print(json.dumps(report, indent=2))
    elif args.markdown:
        print(render.markdown(report), end="")
    elif not args.html:
        render.terminal(report)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from kvlens.analysis import columnar

    target, out = args.to
    if target != "parquet":
        print(f"kvlens convert: --to takes parquet, not {target!r}", file=sys.stderr)
        return 2
    settings = load_settings(args.config)
    loaded, written = columnar.convert(
        args.files,
        Path(out),
        format_name=args.input_format,
        model=args.model,
        memory_limit=args.memory_limit or settings.analyze_memory_limit,
    )
    print(
        f"kvlens convert: {written} records to {out} ({loaded.read.skipped_total} lines skipped)",
        file=sys.stderr,
    )
    return 0


def _compare(args: argparse.Namespace) -> int:
    from kvlens.analysis import compare, reader
    from kvlens.analysis.report import Derived

    settings = load_settings(args.config)
    arms = []
    for spec in args.arm:
        name, separator, path = spec.partition("=")
        if not separator or not name or not path:
            print(f"kvlens: --arm takes NAME=FILE, not {spec!r}", file=sys.stderr)
            return 2
        read = reader.read([path], format_name=args.input_format, model=args.model)
        batch = read.batch
        if any(arm is not None for arm in batch.arm):  # a file of several arms (kvlens simulate)
            batch = batch.select(np.array([arm == name for arm in batch.arm], dtype=bool))
            if not len(batch):
                print(f"kvlens compare: {path} has no records of arm {name!r}", file=sys.stderr)
                return 2
        derived = Derived.of(
            batch, settings.prompt_length_edges, settings.cost_model_for, settings.default_model
        )
        arms.append(compare.Arm(name, derived))
    try:
        result = compare.compare(arms, warmup=args.warmup, warmup_until=args.warmup_until)
    except compare.ArmsDiffer as error:
        print(f"kvlens compare: {error}", file=sys.stderr)
        return 2
    print(
        json.dumps(result, indent=2) if args.json else compare.markdown(result),
        end="" if not args.json else "\n",
    )
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from kvlens.simulate import render, sweep
    from kvlens.simulate.policies import POLICIES, Guard
    from kvlens.simulate.replica import DEFAULT_SERVICE, ServiceModel
    from kvlens.simulate.run import write_records
    from kvlens.simulate.trace import BUNDLED, open_trace

    try:
        capacities = [
            None if c.strip() == "unbounded" else int(c) for c in args.capacity_blocks.split(",") if c.strip()
        ]
        if not capacities or any(c is not None and c < 0 for c in capacities):
            raise ValueError("--capacity-blocks takes block counts >= 0 (or 'unbounded'), comma-separated")
        if args.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        prefill = DEFAULT_SERVICE.prefill
        if args.model or args.config:
            settings = load_settings(args.config)
            prefill = settings.cost_model_for(args.model or settings.default_model)
        service = ServiceModel(
            prefill=prefill, max_running=args.max_running, chunked_prefill=not args.no_chunked_prefill
        )
        trace = open_trace(
            args.trace or BUNDLED, block_size=args.block_size, time_scale=args.time_scale, rate=args.rate
        )
    except ValueError as error:  # TraceError is an InputError: main reports it
        print(f"kvlens simulate: {error}", file=sys.stderr)
        return 2
    plan = sweep.Plan(
        trace,
        args.replicas,
        capacities,
        args.policy or list(POLICIES),
        service,
        None if args.no_guard else Guard(args.balance_abs, args.balance_rel),
    )
    with contextlib.ExitStack() as stack:
        records = (
            write_records(stack.enter_context(args.emit_records.open("wb"))) if args.emit_records else None
        )
        progress = stack.enter_context(_run_progress(plan.runs))
        result = sweep.sweep(plan, records=records, progress=progress)
    if args.plot:
        try:
            render.write_plot(result, args.plot)
        except ValueError as error:
            print(f"kvlens simulate: {error}", file=sys.stderr)
            return 2
    print(json.dumps(result, indent=2) if args.json else render.text(result), end="\n" if args.json else "")
    return 0


@contextlib.contextmanager
def _run_progress(runs: int) -> Iterator[Callable[[int], None] | None]:
    """A progress bar on stderr (requests replayed, all runs) when it is a terminal."""
    if not sys.stderr.isatty():
        yield None
        return
    try:
        from rich.progress import Progress
    except ModuleNotFoundError:
        yield None
        return
    with Progress(transient=True) as bar:
        task = bar.add_task(f"simulating {runs} runs", total=None)
        yield lambda count: bar.advance(task, count)


def _bandwidth(args: argparse.Namespace) -> int:

    try:
        result = _bandwidth_measured(args) if args.measured else _bandwidth_model(args)
    except (ValueError, OSError) as error:  # bw.CannotFit and UnsupportedModel are ValueErrors
        print(f"kvlens bandwidth: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(_measured_text(result) if args.measured else _model_text(result, args.bits), end="")
    return 0


def _batches(args: argparse.Namespace, default: str) -> list[int]:
    return [int(b) for b in (args.batch or default).split(",")]


def _bandwidth_model(args: argparse.Namespace) -> dict[str, Any]:
    """The byte model of article 2 for the given shape, sizes and bandwidth."""
    from kvlens import bandwidth as bw
    from kvlens import shapes

    if not (args.params or args.weight_bytes) or not args.bandwidth:
        raise ValueError("give --params or --weight-bytes, and --bandwidth (or --measured CSV)")
    contexts = [float(c) for c in args.context.split(",")]
    if args.kv_bytes_per_sequence:
        if len(contexts) > 1:
            raise ValueError("--kv-bytes-per-sequence is K at one --context")
        kv_per_token = bw.parse_bytes(args.kv_bytes_per_sequence) / contexts[0]
    elif args.config_json:
        shape = shapes.from_hf_config(json.loads(args.config_json.read_text()))
        if args.kv_dtype_bytes:
            shape = dataclasses.replace(shape, dtype_bytes=args.kv_dtype_bytes)
        kv_per_token = shape.kv_bytes_per_token
    elif args.layers and args.kv_heads and args.head_dim:
        shape = shapes.ModelShape(args.layers, args.kv_heads, args.head_dim, args.kv_dtype_bytes or 2)
        kv_per_token = shape.kv_bytes_per_token
    else:
        raise ValueError("give --config-json, --layers/--kv-heads/--head-dim, or --kv-bytes-per-sequence")
    weights_16 = bw.parse_bytes(args.weight_bytes) if args.weight_bytes else 2 * bw.parse_count(args.params)
    if args.quantized_weight_bytes:
        weights_q = bw.parse_bytes(args.quantized_weight_bytes)
    else:
        weights_q = weights_16 * bw.quantized_weight_ratio(
            args.quantized_fraction, args.bits, args.group_size
        )
    bandwidth = bw.parse_bandwidth(args.bandwidth)
    steps = [
        bw.compare_step(
            weight_bytes_16=weights_16,
            weight_bytes_q=weights_q,
            kv_bytes_per_token_=kv_per_token,
            batch=batch,
            context_tokens=context,
            bandwidth=bandwidth,
            compute_floor=args.compute_floor_ms / 1000,
            extra_q=args.extra_ms / 1000,
        )
        for context in contexts
        for batch in _batches(args, "1,8,32")
    ]
    return {
        "kv_bytes_per_token": kv_per_token,
        "weight_bytes_16": weights_16,
        "weight_bytes_quantized": weights_q,
        "weight_ratio": weights_q / weights_16,
        "bandwidth_bytes_per_second": bandwidth,
        "break_even_extra_seconds": bw.break_even_extra_seconds(weights_16, weights_q, bandwidth),
        "upper_bound": True,  # the byte model: a real kernel reaches at most this (see --measured)
        "steps": [
            {
                "batch": step.batch,
                "context_tokens": step.context_tokens,
                "step_seconds_16": step.seconds_16,
                "step_seconds_quantized": step.seconds_q,
                "speedup": step.speedup,
                "tokens_per_second_16": step.throughput_16,
                "tokens_per_second_quantized": step.throughput_q,
                "weight_share_16": bw.weight_share(
                    weights_16, step.batch, bw.kv_bytes_per_sequence(step.context_tokens, kv_per_token)
                ),
            }
            for step in steps
        ],
    }


def _model_text(result: dict[str, Any], bits: int) -> str:
    gib = 1024**3
    lines = [
        f"weights {result['weight_bytes_16'] / gib:.2f} GiB -> "
        f"{result['weight_bytes_quantized'] / gib:.2f} GiB ({1 / result['weight_ratio']:.2f}x smaller), "
        f"KV {result['kv_bytes_per_token'] / 1024:.0f} KiB/token; "
        "quantization pays while its extra time per step is under "
        f"{result['break_even_extra_seconds'] * 1000:.2f} ms",
        "the byte model: an upper bound a bandwidth-bound kernel approaches (--measured CSV for yours)",
        f"{'batch':>6} {'context':>8} {'16-bit ms':>10} {'W' + str(bits) + ' ms':>9} {'speedup':>8} "
        f"{'tok/s 16-bit':>13} {'tok/s W' + str(bits):>10} {'weights share':>14}",
    ]
    lines += [
        f"{row['batch']:>6.0f} {row['context_tokens']:>8.0f} {row['step_seconds_16'] * 1000:>10.2f} "
        f"{row['step_seconds_quantized'] * 1000:>9.2f} {row['speedup']:>7.2f}x "
        f"{row['tokens_per_second_16']:>13.1f} {row['tokens_per_second_quantized']:>10.1f} "
        f"{row['weight_share_16']:>13.1%}"
        for row in result["steps"]
    ]
    return "\n".join(lines) + "\n"


def _bandwidth_measured(args: argparse.Namespace) -> dict[str, Any]:
    """Fit ``t0 + bytes / BW_eff`` per path to measured steps and compare the paths."""
    from kvlens import bandwidth as bw

    fits = bw.fit_paths(bw.read_measured(args.measured))
    return bw.measured_comparison(fits, _batches(args, "") if args.batch else ())


def _measured_text(result: dict[str, Any]) -> str:
    lines = [
        f"path {p['path']}: step = {p['t0_seconds'] * 1000:.3f} ms + bytes / "
        f"{p['bandwidth_bytes_per_second'] / 1e12:.2f} TB/s ({p['measured_steps']} measured steps)"
        for p in result["paths"]
    ]
    for c in result["comparisons"]:
        lines.append(
            f"{c['path']} vs {result['baseline']}: pays while its extra time per step is under "
            f"{c['break_even_extra_seconds'] * 1000:.3f} ms ((W16 - Wq) / BW_eff of {result['baseline']})"
        )
        lines.append(f"{'batch':>6} {'context':>8} {'measured':>9} {'fitted':>7} {'bytes bound':>12} "
                     f"{'extra ms':>9} {'pays':>5}")  # fmt: skip
        for r in c["rows"]:
            measured = "-" if r["measured_speedup"] is None else f"{r['measured_speedup']:.2f}x"
            lines.append(
                f"{r['batch']:>6} {r['context_tokens']:>8} {measured:>9} {r['fitted_speedup']:>6.2f}x "
                f"{r['bytes_upper_bound']:>11.2f}x {r['extra_seconds'] * 1000:>9.3f} "
                f"{'yes' if r['pays'] else 'no':>5}"
            )
        if c["limited_by"] == "kernel":
            lines.append(
                f"the {c['path']} kernel, not the bytes, limits the gain: it moves bytes at "
                f"{c['bandwidth_share_of_16_bit']:.0%} of {result['baseline']}'s bandwidth, so the byte "
                "model's speedup is an upper bound it does not reach"
            )
        else:
            lines.append(
                f"{c['path']} moves its bytes about as fast as {result['baseline']}: the bytes decide"
            )
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _progress(files: list[str]) -> Iterator[Callable[[int], None] | None]:
    """A progress bar on stderr for long inputs read at a terminal."""
    sizes = [Path(f).stat().st_size for f in files if f != "-" and Path(f).is_file()]
    if not sys.stderr.isatty() or sum(sizes) < 64 * 1024 * 1024:
        yield None
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("reading", total=sum(sizes))
        yield lambda count: bar.advance(task, count)


def _feed(
    traffic: demo.TrafficSource, aggregator: Aggregator, stop: threading.Event, tick: float = 0.5
) -> None:
    last = time.time()
    while not stop.wait(tick):
        now = time.time()
        records = traffic.records(last, now)
        last = now
        if records:
            aggregator.add(batch_from_objects(records), demo.SOURCE)


def _summarize(aggregator: Aggregator, stop: threading.Event, every: float, out: TextIO) -> None:
    while not stop.wait(every):
        print_summary(aggregator, out)


def print_summary(aggregator: Aggregator, out: TextIO) -> None:
    totals = aggregator.snapshot().totals()
    if not totals.requests:
        print("  no requests yet", file=out, flush=True)
        return

    def percent(value: float | None, digits: int) -> str:
        return "n/a" if value is None else f"{100 * value:.{digits}f} %"

    print(
        f"  {totals.requests:>8,} requests | request hit {percent(totals.request_hit_ratio, 1)}"
        f" | token reuse {percent(totals.token_reuse_ratio, 2)}"
        f" | compute saved {percent(totals.compute_saved_ratio, 3)}",
        file=out,
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
