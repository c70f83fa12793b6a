"""``kvlens import TOOL FILE``: another benchmark tool's per-request results as kvlens records
(JSON lines), so that ``compare`` and ``analyze`` read runs made with ``vllm bench serve`` or AIPerf.
(The module is not named ``import``: that is a Python keyword.)"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from kvlens.cli import SUMMARIES
from kvlens.cli.common import check_writable, examples


def add_parser(commands: Any) -> None:
    command = commands.add_parser(
        "import",
        help=SUMMARIES["import"],
        description="Write kvlens records (JSON lines) from vllm bench serve's --save-result "
        "--save-detailed JSON or AIPerf's profile_export.jsonl. Entries that cannot be read are "
        "named on stderr and left out (exit 1); the others are written. Then: kvlens compare --arm "
        "off=off.jsonl --arm warm=warm.jsonl",
        epilog=examples(
            "kvlens import vllm-bench off.json -o off.jsonl",
            "kvlens import aiperf artifacts/run/profile_export.jsonl -o warm.jsonl",
        ),
    )
    command.add_argument("tool", choices=("vllm-bench", "aiperf"), help="the tool that wrote FILE")
    command.add_argument("file", metavar="FILE", help="its result file (.gz read; - for stdin)")
    command.add_argument("-o", "--output", type=Path, metavar="OUT", help="write here (default: stdout)")
    command.add_argument("--model", help="model of every record (default: the file's, when it names one)")
    command.add_argument(
        "--missing-cached-is-zero",
        action="store_true",
        help="a request whose tool gave no cached-token count (vllm bench serve never does) has "
        "cached_tokens 0: right only when the server ran with prefix caching off",
    )
    command.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import orjson

    from kvlens.sources import bench_tools

    check_writable(args.output)
    if args.output is not None and args.file != "-" and _same_file(args.output, args.file):
        print(f"kvlens import: {args.output} is {args.file} itself: not overwritten", file=sys.stderr)
        return 2
    try:
        imported = bench_tools.read(
            args.tool, args.file, model=args.model, missing_cached_is_zero=args.missing_cached_is_zero
        )
    except bench_tools.NotThisFormat as error:
        print(f"kvlens import: {args.file}: {error}", file=sys.stderr)
        return 2
    lines = b"".join(orjson.dumps(record) + b"\n" for record in imported.records)
    if args.output is None:
        sys.stdout.buffer.write(lines)
        sys.stdout.flush()
    else:
        try:
            _write(args.output, lines)
        except OSError as error:
            print(f"kvlens import: cannot write {args.output}: {error.strerror or error}", file=sys.stderr)
            return 2
    for problem in imported.bad:
        print(f"kvlens import: {args.file}: {problem}: left out", file=sys.stderr)
    if imported.bad_count > len(imported.bad):
        more = imported.bad_count - len(imported.bad)
        print(f"kvlens import: ... and {more} more entries left out", file=sys.stderr)
    for line in summary(args.tool, imported, args.missing_cached_is_zero):
        print(f"kvlens import: {line}", file=sys.stderr)
    return 1 if imported.bad_count or not imported.records else 0


def _write(path: Path, data: bytes) -> None:
    """``data`` into ``path``; a regular path is written beside it and renamed over it, so a
    write that fails (a full disk) leaves the last OUT whole and no half file. A device or a pipe
    (/dev/stdout, a FIFO) is written to directly: it cannot be renamed over."""
    if path.exists() and not path.is_file():
        with path.open("wb") as stream:
            stream.write(data)
        return
    staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # open(): the umask's mode, as OUT's
    try:
        with staged.open("xb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())  # the bytes on disk before the name points at them
        os.replace(staged, path)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise


def _same_file(output: Path, file: str) -> bool:
    # samefile, not a name compare: a symlink or another spelling of the input is the input too.
    try:
        return os.path.samefile(output, file)
    except OSError:  # one of them does not exist (yet): not the same file
        return False


def summary(tool: str, imported: Any, missing_cached_is_zero: bool) -> list[str]:
    """What was written and what each part of it can answer."""
    written = len(imported.records)
    lines = [
        f"{written} records written ({imported.failed} of failed requests, with their error and no "
        f"timings), {imported.bad_count} entries left out as unreadable"
        + "".join(f", {count} {why} left out" for why, count in sorted(imported.left_out.items()))
    ]
    if imported.without_cached:
        if missing_cached_is_zero:
            lines.append(
                f"{imported.without_cached} records have cached_tokens 0 (--missing-cached-is-zero): "
                "hit ratios and the hit/miss split are right only if the server ran with prefix caching off"
            )
        else:
            lines.append(
                f"{imported.without_cached} records carry no cached_tokens ({tool} does not record "
                "them): analyze and compare count them as skipped (cached_tokens missing), since a "
                "hit ratio cannot be told; --missing-cached-is-zero for a run with prefix caching off"
            )
    return lines
