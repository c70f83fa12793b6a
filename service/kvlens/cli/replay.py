"""``kvlens replay``: one arm of a trace against an OpenAI-compatible endpoint; the flags and steps
``kvlens experiment`` shares."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import math
import os
import secrets
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvlens.analysis import run_facts
from kvlens.cli import SUMMARIES
from kvlens.cli.common import examples, trace_format_flags
from kvlens.experiment import reports
from kvlens.experiment import run as arms
from kvlens.experiment.client import CHAT, COMPLETIONS, Endpoint, Progress, base_url
from kvlens.experiment.prompts import DEFAULT_VOCAB_SIZE, PromptSynthesizer
from kvlens.experiment.protocol import ExperimentError, Window, measured_window
from kvlens.experiment.sessions import SessionPlan
from kvlens.simulate.trace import TraceRequest, open_trace
from kvlens.sources.vllm_metrics import read_password

log = logging.getLogger("kvlens.experiment")
TIMESTAMPS, SESSIONS = "timestamps", "sessions"


def add_parser(commands: Any) -> None:
    replay = commands.add_parser(
        "replay",
        help=SUMMARIES["replay"],
        description="Send a trace's requests (token-id prompts that keep its shared prefixes, its "
        "lengths and arrivals) to an endpoint, open loop, and write one kvlens record per request.",
        epilog=examples(
            "kvlens replay shared-prefix --endpoint http://127.0.0.1:8000 --model simulated "
            "--arm cold --reset --out cold.jsonl",
            "kvlens replay trace.jsonl --endpoint http://127.0.0.1:8000 --model llama-8b --arm warm "
            "--warm --measure-from 600 --out warm.jsonl",
        ),
    )
    trace_flags(replay)
    endpoint_flags(replay)
    replay.add_argument("--arm", required=True, help="the arm's name, written into each record")
    replay.add_argument("--out", type=Path, required=True, metavar="RECORDS.jsonl", help="records file")
    replay.add_argument("--reset", action="store_true", help="empty the endpoint's prefix cache first")
    replay.add_argument(
        "--warm", action="store_true", help="replay the warm-up (before --measure-from) first, apart"
    )
    replay.set_defaults(run=run)


def trace_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "trace",
        metavar="TRACE",
        help="a trace file (Mooncake, agentic Mooncake, Bailian, BurstGPT, kvlens records), "
        "kv-cache-tester conversations (a file or a directory), "
        f"or '{arms.SHARED_PREFIX}' (built-in traffic)",
    )
    trace_format_flags(parser)
    parser.add_argument("--speed", type=float, default=1.0, help="play the trace this much faster")
    parser.add_argument("--rate", type=float, help="requests per second instead of the trace's times")
    parser.add_argument("--burstiness", type=float, default=1.0, help="with --rate: 1 Poisson, <1 burstier")
    parser.add_argument("--max-output-tokens", type=int, help="cap the trace's output lengths")
    parser.add_argument(
        "--measure-from", type=float, metavar="T", help="trace seconds where measuring begins"
    )
    parser.add_argument("--warmup-trace", metavar="FILE", help="warm up with this trace instead")
    session_flags(parser)
    traffic_flags(parser)


def session_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--schedule",
        choices=(TIMESTAMPS, SESSIONS),
        help="timestamps: every request at its recorded time (open loop); sessions: a turn when the "
        "answers it waits for have ended, plus its think time (default: sessions for a trace whose "
        "requests wait for others, as conversations' do; timestamps otherwise, as Mooncake's)",
    )
    parser.add_argument(
        "--think-scale", type=float, default=1.0, help="sessions: multiply the recorded think times"
    )
    parser.add_argument("--max-sessions", type=int, help="sessions: conversations running at once, at most")
    parser.add_argument(
        "--salt-per-session",
        action="store_true",
        help="a cache_salt per conversation, new each run: concurrent replays of one trace share nothing",
    )


def traffic_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="token ids below it")
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts and --rate arrivals")
    parser.add_argument(
        "--requests",
        type=int,
        help=f"the first N requests of the trace (default: all; {arms.SHARED_PREFIX}: 200)",
    )
    parser.add_argument("--groups", type=int, default=4, help=f"{arms.SHARED_PREFIX}: system prompts")
    parser.add_argument(
        "--prefix-tokens",
        type=_token_counts,
        default=",".join(str(n) for n in arms.SHARED_PREFIX_TOKENS),
        metavar="N[,N...]",
        help=f"{arms.SHARED_PREFIX}: each group's shared system prompt, cycled over the groups",
    )
    parser.add_argument("--suffix-tokens", type=int, default=128, help=f"{arms.SHARED_PREFIX}: own")
    parser.add_argument("--output-tokens", type=int, default=32, help=f"{arms.SHARED_PREFIX}: output")
    parser.add_argument("--traffic-rate", type=float, default=4.0, help=f"{arms.SHARED_PREFIX}: per s")


def _token_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"token counts such as 256,1024,4096, not {text!r}") from None
    if any(count < 0 for count in counts):
        raise argparse.ArgumentTypeError(f"a token count is 0 or more, not {text!r}")
    return counts


def endpoint_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", required=True, metavar="URL", help="the server's base URL (no /v1)")
    parser.add_argument("--model", required=True, help="the served model name")
    api_key_flags(parser)
    parser.add_argument("--max-concurrency", type=int, default=256, help="requests in flight at most")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one request may take")
    parser.add_argument("--assume-empty", action="store_true", help="call an arm cold without a reset")
    parser.add_argument(
        "--missing-cached-is-zero", action="store_true", help="a usage without cached_tokens means 0"
    )
    parser.add_argument("--push", metavar="URL", help="also send the records to a kvlens serve")
    error_rate_flag(parser)
    parser.add_argument(
        "--api",
        choices=(COMPLETIONS, CHAT),
        default=COMPLETIONS,
        help="completions: token ids, exact lengths (default); chat: text from /detokenize, approximate",
    )


def error_rate_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-error-rate",
        type=float,
        default=reports.DEFAULT_MAX_ERROR_RATE,
        metavar="SHARE",
        help="an arm with more of its requests failed exits 1 (after the report); none answered exits 2",
    )


def failure_exit(command: str, runs: list[tuple[str, dict[str, Any] | None]], max_error_rate: float) -> int:
    """The run's exit code from its arms' failures, each arm past the bound said on stderr."""
    code, lines = reports.failures(runs, max_error_rate)
    for line in lines:
        print(f"kvlens {command}: {line}", file=sys.stderr)
    return code


def arm_failures(result: arms.ArmResult) -> list[tuple[str, dict[str, Any] | None]]:
    """An arm's failures, its warm-up's apart (a warm-up that failed warmed nothing)."""
    runs = [(result.name, run_facts.errors_in(str(result.records), result.name))]
    if result.warmup_records is not None:
        runs.append(
            (f"{result.name} (warm-up)", run_facts.errors_in(str(result.warmup_records), result.name))
        )
    return runs


API_KEY_VARIABLE = "OPENAI_API_KEY"


def api_key_flags(parser: argparse.ArgumentParser) -> None:
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument(
        "--api-key-file",
        type=Path,
        metavar="FILE",
        help=f"bearer token for the endpoints, read from FILE (default: ${API_KEY_VARIABLE}, if set)",
    )
    keys.add_argument("--api-key", help="bearer token given here (seen in the process list: prefer the file)")


def api_key(args: argparse.Namespace, url: str) -> str | None:
    """The bearer token: ``--api-key-file``'s text (without surrounding white space), or
    ``--api-key``, or ``$OPENAI_API_KEY`` unless ``url`` carries credentials of its own."""
    path: Path | None = args.api_key_file
    if path is not None:
        try:
            return read_password(path)
        except OSError as error:
            raise ExperimentError(
                f"--api-key-file {path}: {error.strerror or type(error).__name__}"
            ) from None
        except ValueError as error:
            raise ExperimentError(f"--api-key-file {path}: {error}") from None
    if args.api_key is not None:
        if not args.api_key.strip():
            raise ExperimentError("--api-key is blank")
        return str(args.api_key)
    if base_url(url)[1] is not None:
        return None  # a URL's own credentials win over a key from the environment
    return os.environ.get(API_KEY_VARIABLE, "").strip() or None


def read_requests(args: argparse.Namespace) -> tuple[list[TraceRequest], list[TraceRequest] | None, int]:
    if args.requests is not None and args.requests < 1:
        raise ExperimentError("--requests must be at least 1")
    if args.trace == arms.SHARED_PREFIX:
        traffic = arms.SharedPrefixTraffic(
            args.requests or arms.SharedPrefixTraffic.requests,
            args.groups,
            args.prefix_tokens,
            args.suffix_tokens,
            args.output_tokens,
            args.traffic_rate,
            args.seed,
        )
        requests, block_size = traffic.trace(), arms.SHARED_PREFIX_BLOCK
    else:
        trace = open_trace(args.trace, trace_format=args.trace_format, session_rate=args.session_rate)
        requests, block_size = list(itertools.islice(trace.requests(), args.requests)), trace.block_size
    warmup = None
    if args.warmup_trace:
        extra = open_trace(args.warmup_trace, block_size=block_size)
        warmup = list(extra.requests())
    return requests, warmup, block_size


def setup(args: argparse.Namespace, *, warms: bool) -> tuple[Window, PromptSynthesizer, arms.Schedule]:
    """``warms``: the run has a warm-up, so the trace is split (see ``protocol.split``); a single
    arm that does not warm up measures the whole trace."""
    requests, warmup, block_size = read_requests(args)
    if warms or args.measure_from is not None or warmup is not None:
        window = measured_window(requests, args.measure_from, warmup)
    else:
        window = measured_window(requests, -math.inf, None)
    prompts = PromptSynthesizer(block_size, args.vocab_size, args.seed)
    kind = args.schedule or (SESSIONS if any(r.after for r in requests) else TIMESTAMPS)
    try:
        sessions = SessionPlan(args.think_scale, args.max_sessions) if kind == SESSIONS else None
    except ValueError as error:
        raise ExperimentError(str(error)) from None
    if args.schedule is None and kind == SESSIONS:
        log.info("schedule: sessions (its requests wait for answers; --schedule timestamps to send by time)")
    schedule = arms.Schedule(
        args.speed,
        args.rate,
        args.burstiness,
        args.max_output_tokens,
        args.seed,
        sessions=sessions,
        salt=secrets.token_hex(6) if args.salt_per_session else None,
    )
    return window, prompts, schedule


def endpoint(args: argparse.Namespace, url: str) -> Endpoint:
    if args.max_concurrency < 1:
        raise ExperimentError("--max-concurrency must be at least 1")
    if args.api == CHAT:
        log.warning(
            "--api chat: prompts go through the server's /detokenize and its chat template, so their "
            "lengths (and shared prefixes) are approximate; records carry the server's token counts"
        )
    return Endpoint(
        url.rstrip("/"),
        args.model,
        api_key(args, url),
        args.timeout,
        args.max_concurrency,
        args.missing_cached_is_zero,
        api=args.api,
    )


@contextlib.contextmanager
def pusher(url: str | None) -> Iterator[Callable[[dict[str, Any]], None] | None]:
    if not url:
        yield None
        return
    from kvlens.sources.vllm_plugin import HttpSink, Shipper, plugin_settings

    shipper = Shipper(HttpSink(url, plugin_settings({}).token), flush_seconds=0.5)
    try:
        yield shipper.offer
    finally:
        shipper.close(timeout=10)


def progress_line(label: str, progress: Progress, total: int) -> None:
    if sys.stderr.isatty():
        print(
            f"\r{label}: {progress.done}/{total} done ({progress.rate():.1f}/s), "
            f"{progress.in_flight} in flight, {progress.late} late, {progress.errors} errors ",
            end="",
            file=sys.stderr,
            flush=True,
        )


def summary(result: arms.ArmResult) -> str:
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


def run(args: argparse.Namespace) -> int:
    reports.check_error_rate(args.max_error_rate)
    window, prompts, schedule = setup(args, warms=args.warm)
    with pusher(args.push) as push:
        result = arms.run_arm(
            args.arm,
            endpoint(args, args.endpoint),
            window,
            args.out,
            prompts,
            schedule,
            reset=args.reset,
            assume_empty=args.assume_empty,
            warm=args.warm,
            push=push,
            progress=progress_line,
        )
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print(summary(result))
    return failure_exit("replay", arm_failures(result), args.max_error_rate)
