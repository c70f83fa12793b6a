"""``kvlens serve``: the sidecar."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvlens.cli import SUMMARIES
from kvlens.cli.common import build_server, examples, server_flags, settings_from
from kvlens.limits import ENV_PREFIX


def add_parser(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help=SUMMARIES["serve"],
        epilog=examples(
            "kvlens serve",
            "kvlens serve --host 0.0.0.0 --scrape http://vllm:8000/metrics",
            "kvlens serve --tail '/logs/sglang-*.log' --format sglang --model llama-8b",
            "kvlens serve --kv-events r0=tcp://10.0.0.5:5557 --log-format json",
        ),
    )
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
    serve.add_argument(
        "--scrape-username",
        help=f"basic-auth user for the --scrape targets (env {ENV_PREFIX}SCRAPE_USERNAME)",
    )
    serve.add_argument(
        "--scrape-password-file",
        type=Path,
        metavar="FILE",
        help=f"file holding their password, re-read at each scrape (env {ENV_PREFIX}SCRAPE_PASSWORD_FILE)",
    )
    serve.add_argument(
        "--kv-events",
        action="append",
        metavar="NAME=URL",
        help="a replica's KV event publisher, e.g. r0=tcp://10.0.0.5:5557 (repeatable; kvlens[kv-events])",
    )
    serve.add_argument(
        "--kv-events-dns",
        action="append",
        metavar="HOST:PORT[/REPLAY_PORT]",
        help="a headless Service whose addresses are the replicas' publishers, looked up every "
        "kv_events_dns_interval_seconds (30) "
        "(repeatable; kvlens[kv-events])",
    )
    serve.add_argument(
        "--kv-events-shard", metavar="i/N", help="keep only shard i of N of the fleet's blocks"
    )
    serve.add_argument(
        "--isolation-probe",
        action="append",
        metavar="NAME=URL[#MODEL[@LORA]]",
        help="audit this endpoint's cache isolation in the background (`kvlens audit isolation`), "
        "exported as kvlens_isolation_probe_result (repeatable; MODEL: default the one it serves)",
    )
    serve.add_argument(
        "--isolation-every",
        type=float,
        metavar="SECONDS",
        help="seconds between isolation probes of a target, jittered by 20%% (isolation_every_seconds: 600)",
    )
    serve.add_argument(
        "--kv-events-trtllm",
        action="append",
        metavar="NAME=URL",
        help="a TensorRT-LLM server whose KV cache events kvlens drains (POST URL/kv_cache_events), "
        "e.g. t0=http://10.0.0.7:8000 (repeatable; kvlens[kv-events])",
    )
    serve.add_argument(
        "--require-cache-salt",
        action="store_true",
        default=None,
        help="every tenant must be salted: count KV event stores whose chain starts without a cache salt",
    )
    serve.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    from kvlens.exporter.aggregator import Aggregator
    from kvlens.http.server import run_until_stopped

    server = build_server(settings, Aggregator(settings), args)
    return run_until_stopped(server)
