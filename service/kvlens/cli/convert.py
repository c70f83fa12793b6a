"""``kvlens convert``: records as Parquet, what the DuckDB engine reads fastest."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvlens.cli import SUMMARIES
from kvlens.cli.common import examples, scale_flags


def add_parser(commands: Any) -> None:
    convert = commands.add_parser(
        "convert",
        help=SUMMARIES["convert"],
        epilog=examples(
            "kvlens convert logs/*.jsonl.gz --to parquet records.parquet",
            "kvlens convert sglang.log --format sglang --model llama-8b --to parquet sglang.parquet",
        ),
    )
    convert.add_argument(
        "files", nargs="+", metavar="RECORDS", help="JSON-lines or Parquet files, or directories"
    )
    convert.add_argument("--to", nargs=2, required=True, metavar=("FORMAT", "OUT"), help="parquet OUT")
    convert.add_argument(
        "--format", dest="input_format", help="kvlens, sglang or openai-usage (default: detect)"
    )
    convert.add_argument("--model", help="model for records that carry none (SGLang)")
    convert.add_argument("--config", type=Path, help="YAML settings (analyze_memory_limit)")
    scale_flags(convert)
    convert.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvlens.analysis.duckdb import inputs

    target, out = args.to
    if target != "parquet":
        print(f"kvlens convert: --to takes parquet, not {target!r}", file=sys.stderr)
        return 2
    from kvlens.config import load_offline  # pydantic: not for a --help

    settings = load_offline(args.config)
    loaded, written = inputs.convert(
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
