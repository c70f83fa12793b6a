"""``kvlens audit isolation``: paired probes of an endpoint's cache isolation
(:mod:`kvlens.audit.isolation`); exit 0 pass, 1 leak, 3 inconclusive, 2 a usage or endpoint error."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from kvlens.cli import SUMMARIES
from kvlens.cli.common import examples
from kvlens.cli.replay import api_key, api_key_flags

DEFAULT_BLOCK_SIZE = 16  # vLLM's, when neither the flag nor the endpoint's /metrics says


def add_parser(commands: Any) -> None:
    audit = commands.add_parser(
        "audit",
        help=SUMMARIES["audit"],
        epilog=examples("kvlens audit isolation --endpoint http://vllm:8000 --model llama-8b"),
    )
    checks = audit.add_subparsers(required=True, metavar="CHECK")
    isolation = checks.add_parser(
        "isolation",
        help="paired probes: does a different cache_salt (or none, or a LoRA) get another's cached prefix?",
        description="Paired probes with fresh random canary prefixes: the same salt must hit, a different "
        "salt (or none) must not, by cached_tokens and by time to first token. Exit 0 pass, 1 leak, "
        "3 inconclusive (the same salt did not hit: nothing could be shown).",
        epilog=examples(
            "kvlens audit isolation --endpoint http://vllm:8000 --model llama-8b",
            "kvlens audit isolation --endpoint http://gateway --model m --salt-field tenant_salt --json",
            "kvlens audit isolation --endpoint http://vllm:8000 --model base --lora sql-adapter",
        ),
    )
    isolation.add_argument(
        "--endpoint", required=True, metavar="URL", help="the server's base URL (without /v1)"
    )
    isolation.add_argument("--model", required=True, help="the served model to probe")
    isolation.add_argument(
        "--block-size",
        type=int,
        metavar="B",
        help="the engine's KV block size (default: its /metrics' vllm:cache_config_info, else "
        f"{DEFAULT_BLOCK_SIZE})",
    )
    isolation.add_argument("--repeats", type=int, default=5, help="pairs per case (1 to 30)")
    isolation.add_argument(
        "--canary-tokens",
        type=int,
        default=1024,
        metavar="N",
        help="canary length, rounded up to whole blocks, at least 4: a prefill long enough for a hit "
        "to be measurably faster",
    )
    isolation.add_argument(
        "--salt-field",
        default="cache_salt",
        metavar="NAME",
        help="the request body's salt field: cache_salt (vLLM and SGLang), or a gateway's own name",
    )
    isolation.add_argument(
        "--lora", metavar="NAME", help="also probe this LoRA adapter against the base model"
    )
    isolation.add_argument(
        "--rate", type=float, default=5.0, help="requests per second at most (one at a time)"
    )
    isolation.add_argument("--timeout", type=float, default=60.0, help="seconds for one probe request")
    isolation.add_argument("--json", action="store_true", help="the audit as JSON")
    api_key_flags(isolation)
    isolation.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvlens.audit.isolation import Plan, audit, table
    from kvlens.experiment.client import Endpoint
    from kvlens.experiment.protocol import check_reachable, engine_block_size

    endpoint = Endpoint(args.endpoint.rstrip("/"), args.model, api_key(args, args.endpoint), args.timeout)
    check_reachable(endpoint)  # down, or not serving --model: one line, exit 2
    block_size, source = args.block_size, "flag"
    if block_size is None:
        block_size, source = engine_block_size(endpoint), "endpoint"
        if block_size is None:
            block_size, source = DEFAULT_BLOCK_SIZE, "assumed"
    plan = Plan(block_size, args.repeats, args.canary_tokens, args.salt_field, args.rate, args.lora)
    result = asyncio.run(audit(endpoint, plan, block_size_from=source))
    print(json.dumps(result.as_json(), indent=2) if args.json else table(result))
    return result.exit_code
