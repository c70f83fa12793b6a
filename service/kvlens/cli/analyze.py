"""``kvlens analyze``: report, diagnose and calibrate recorded traffic."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvlens.cli import SUMMARIES
from kvlens.cli.common import check_writable, engine_flag, examples, input_flags, read_progress, scale_flags


def add_parser(commands: Any) -> None:
    analyze = commands.add_parser(
        "analyze",
        help=SUMMARIES["analyze"],
        description="Report, diagnose and calibrate recorded traffic: a table at a terminal, "
        "--markdown, --json (schema kvlens.analyze/v1) or --html.",
        epilog=examples(
            "kvlens analyze records.jsonl",
            "kvlens analyze logs/*.jsonl.gz --json > report.json",
            "kvlens analyze records.jsonl --html report.html",
            "kvlens analyze --prefill-points prefill_h200.csv --config shapes.yaml --calibrate costs.yaml",
        ),
    )
    analyze.add_argument(
        "files",
        nargs="*",
        metavar="FILE",
        help="JSON-lines (.gz allowed; - for stdin) or Parquet files, or directories (a name is "
        "the path it spells: let the shell expand patterns)",
    )
    input_flags(analyze)
    scale_flags(analyze)
    engine_flag(analyze)
    analyze.add_argument(
        "--print-sql",
        action="store_true",
        help="print the reducer as portable SQL (for a warehouse) and exit",
    )
    analyze.add_argument(
        "--from-aggregates",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="the results of the --print-sql statements run in a warehouse (CSV or JSON lines) -> the report",
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
    analyze.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvlens.analysis import calibration, reader, render
    from kvlens.analysis.analyze import analyze, choose_engine, from_aggregates
    from kvlens.config import load_offline  # pydantic: not for a --help

    settings = load_offline(args.config)
    if args.print_sql:
        from kvlens.analysis import warehouse

        print(warehouse.script(settings), end="")
        return 0
    if args.from_aggregates and args.files:
        print("kvlens analyze: give record files or --from-aggregates, not both", file=sys.stderr)
        return 2
    if not args.files and not args.prefill_points and not args.from_aggregates:
        print("kvlens analyze: give record files, --prefill-points CSV, or both", file=sys.stderr)
        return 2
    check_writable(args.html, args.calibrate)
    if args.from_aggregates:
        report, fits = from_aggregates(args.from_aggregates, settings, prefill_points=args.prefill_points)
    else:
        files = reader.resolve(args.files)  # once: the engine is chosen by, and reads, these files
        with read_progress(files) as progress:
            report, fits = analyze(
                files,
                settings,
                format_name=args.input_format,
                model=args.model,
                progress=progress,
                prefill_points=args.prefill_points,
                engine=choose_engine(args.engine, files),
                memory_limit=args.memory_limit or settings.analyze_memory_limit,
            )
    accepted = report["input"]["records"]
    if not accepted and not args.prefill_points:
        skipped = report["input"]["skipped"]
        why = ", ".join(f"{reason}: {count}" for reason, count in skipped.items()) or "no line in the input"
        print(f"kvlens analyze: no record accepted (skipped, by reason: {why})", file=sys.stderr)
        return 1
    if args.calibrate:
        import yaml  # only here: 0.03 CPU s of every other run

        args.calibrate.write_text(yaml.safe_dump(calibration.cost_model_file(fits), sort_keys=False))
    if args.html:
        from kvlens.analysis import html_report

        args.html.write_text(html_report.page(report, settings.cost_model_for))
    if args.json:
        print(json.dumps(report, indent=2))
    elif args.markdown:
        print(render.markdown(report), end="")
    elif not args.html:
        render.terminal(report)
    return 0
