"""``kvlens analyze`` on 1M records, beside the raw parse of the same file (same run).

    .venv/bin/python bench/analyze.py [--records N]

Target: 1M records in <= 10 s on one core. The baseline is orjson parsing every line of the
same file and nothing else; "analyze" is the whole report (read, validate, groups, exact
percentiles, diagnosis, calibration).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import orjson

from kvlens.analysis.analyze import analyze
from kvlens.config import load_settings
from kvlens.sources.demo import DemoTraffic


def write_records(path: Path, count: int) -> None:
    traffic = DemoTraffic(rate_per_second=10_000, seed=11)
    written = 0
    second = 0.0
    with open(path, "wb") as out:
        while written < count:
            records = traffic.records(second, second + 1.0)[: count - written]
            out.write(b"".join(orjson.dumps(r, option=orjson.OPT_APPEND_NEWLINE) for r in records))
            written += len(records)
            second += 1.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, as the target says
    settings = load_settings()
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "records.jsonl"
        write_records(path, args.records)
        size = path.stat().st_size
        parse_times, analyze_times = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            with open(path, "rb") as stream:
                for line in stream:
                    orjson.loads(line)
            parse_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            report, _ = analyze([str(path)], settings)
            analyze_times.append(time.perf_counter() - start)
        assert report["overall"]["requests"] == args.records
    parse, whole = statistics.median(parse_times), statistics.median(analyze_times)
    print(f"file: {args.records:,} records, {size / 2**20:.0f} MiB; one core; median of {args.repeats}")
    rate = args.records / whole
    print(f"kvlens analyze      {whole:6.2f} s  ({rate:,.0f} records/s; target <= 10 s for 1M)")
    print(f"  raw orjson parse  {parse:6.2f} s  analyze = {whole / parse:.2f}x the parse")


if __name__ == "__main__":
    main()
