"""``kvlens analyze``: report, diagnose and calibrate recorded traffic."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from kvlens.cli.common import check_writable, input_flags, read_progress
from kvlens.config import load_settings


def add_parser(commands: Any) -> None:
    analyze = commands.add_parser("analyze", help="report, diagnose and calibrate recorded traffic")
    analyze.add_argument(
        "files", nargs="*", metavar="FILE", help="JSON-lines files (.gz allowed; - for stdin)"
    )
    input_flags(analyze)
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
    from kvlens.analysis import calibration, render
    from kvlens.analysis.analyze import analyze

    if not args.files and not args.prefill_points:
        print("kvlens analyze: give record files, --prefill-points CSV, or both", file=sys.stderr)
        return 2
    settings = load_settings(args.config)
    check_writable(args.html, args.calibrate)
    with read_progress(args.files) as progress:
        report, fits = analyze(
            args.files,
            settings,
            format_name=args.input_format,
            model=args.model,
            progress=progress,
            prefill_points=args.prefill_points,
        )
    accepted = report["input"]["records"]
    if not accepted and not args.prefill_points:
        skipped = report["input"]["skipped"]
        why = ", ".join(f"{reason}: {count}" for reason, count in skipped.items()) or "no line in the input"
        print(f"kvlens analyze: no record accepted (skipped, by reason: {why})", file=sys.stderr)
        return 1
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
