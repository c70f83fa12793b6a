"""``kvlens compare``: cache-off / cold / warm replays of one request sequence."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from kvlens.cli import SUMMARIES
from kvlens.cli.common import (
    check_writable,
    engine_flag,
    examples,
    input_flags,
    percentiles_flag,
    scale_flags,
)
from kvlens.errors import ArmsDiffer, GroupTooLarge, NoRecordsOfArm


def add_parser(commands: Any) -> None:
    compare = commands.add_parser(
        "compare",
        help=SUMMARIES["compare"],
        description="Compare arms that replay one fixed request sequence (the first is the baseline): "
        "a table at a terminal; Markdown with --markdown or when stdout is not a terminal; --json.",
        epilog=examples(
            "kvlens compare --arm off=off.jsonl --arm cold=cold.jsonl --arm warm=warm.jsonl",
            "kvlens compare --arm cold=cold.jsonl --arm warm=warm.jsonl --warmup 200 --markdown",
            "kvlens compare --arm round_robin=sim.jsonl --arm prefix_affinity=sim.jsonl --json",
        ),
    )
    compare.add_argument(
        "--arm", action="append", required=True, metavar="NAME=FILE", help="an arm; the first is the baseline"
    )
    input_flags(compare)
    scale_flags(compare)
    engine_flag(compare)
    warm = compare.add_mutually_exclusive_group()
    warm.add_argument(
        "--warmup", type=_count, default=0, metavar="N", help="the first N requests are warm-up"
    )
    warm.add_argument(
        "--warmup-until", type=_time, metavar="T", help="requests arriving before T are warm-up"
    )
    compare.add_argument("--html", type=Path, metavar="OUT", help="also write the report as one HTML file")
    percentiles_flag(compare)
    compare.set_defaults(run=run)


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"a count of requests is 0 or more, not {value}")
    return value


def _time(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # NaN is before no arrival time: no warm-up, silently
        raise argparse.ArgumentTypeError(f"a time is a finite number of seconds, not {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    from kvlens.analysis import compare, compare_text, reader, run_facts
    from kvlens.analysis.analyze import choose_engine

    specs = []
    for spec in args.arm:
        name, separator, path = spec.partition("=")
        if not separator or not name or not path:
            print(f"kvlens: --arm takes NAME=FILE, not {spec!r}", file=sys.stderr)
            return 2
        specs.append((name, path))
    if len(specs) < 2:  # one arm compared with nothing is an empty report, not an answer
        print(
            "kvlens compare: compare needs two arms or more (--arm NAME=FILE, the first the "
            f"baseline); {len(specs)} given",
            file=sys.stderr,
        )
        return 2
    check_writable(args.html)
    from kvlens.config import load_offline  # pydantic: not for a --help

    settings = load_offline(args.config)
    # Every arm's files, by the one rule of names, before any arm is read: a missing arm is
    # refused first, and the engine is chosen by the files it will read.
    files = [file for path in sorted({path for _, path in specs}) for file in reader.resolve([path])]
    engine = choose_engine(args.engine, files)
    try:
        if engine == "duckdb":
            from kvlens.analysis.duckdb import compare as in_duckdb

            result = in_duckdb.compare_files(
                specs,
                settings,
                format_name=args.input_format,
                model=args.model,
                warmup=args.warmup,
                warmup_until=args.warmup_until,
                memory_limit=args.memory_limit or settings.analyze_memory_limit,
                percentiles=args.percentiles,
            )
            left_out = 0
        else:
            arms, left_out = compare.load_answered(
                specs, settings, format_name=args.input_format, model=args.model
            )
            result = compare.compare(
                arms, warmup=args.warmup, warmup_until=args.warmup_until, percentiles=args.percentiles
            )
    except (NoRecordsOfArm, ArmsDiffer, GroupTooLarge) as error:
        print(f"kvlens compare: {error}", file=sys.stderr)
        return 2
    run_facts.add_file_facts(result, specs, left_out)
    if args.html:
        from kvlens.analysis import html_compare

        html_compare.write(result, args.html)
    if args.json:
        print(json.dumps(result, indent=2))
    elif args.markdown or not sys.stdout.isatty():  # a file, a pipe, a CI step's summary
        print(compare_text.markdown(result), end="")
    else:
        compare_text.terminal(result)
    return 0
