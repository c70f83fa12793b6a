"""``kvlens compare`` of 3 arms (off, cold, warm) of 1M requests each: the numpy engine (every
record of every arm in memory; the baseline) beside the duckdb engine reading the same JSON
lines and reading Parquet, in the same run.

    .venv/bin/python bench/compare.py [--requests 1000000] [--resamples 1000] [--memory-limit 2GiB]

Every case runs in its own process, so each peak RSS is that case's alone; its CPU seconds (all
threads) are printed beside the wall time, since other processes share the cores. Each case
prints a digest of its report (less the file names): the engines must agree. The paired
bootstrap (``--resamples`` per group, arm, metric and quantile) is the same numpy code in both
engines and dominates at 1,000 (3 arms x 100k requests: about 55 of the 60 CPU seconds of either
engine; at 1M, about ten times that); ``--resamples 20`` shows the engines' own cost.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ARMS = ("off", "cold", "warm")
# One request sequence: the prompt lengths and ids do not depend on the arm; the reuse and the
# latencies do (cold reuses a quarter of the requests' prompts by half, warm most of them).
GENERATE = """
SELECT 'r' || i AS request_id, 'model-' || (i % 4) AS model,
  CAST(40 + hash(i) % 32000 AS BIGINT) AS prompt_tokens,
  CAST(CASE {arm} WHEN 0 THEN 0
    WHEN 1 THEN CASE WHEN i % 4 = 0 THEN (40 + hash(i) % 32000) // 2 ELSE 0 END
    ELSE CASE WHEN i % 4 <> 3 THEN (40 + hash(i) % 32000) * 4 // 5 ELSE 0 END END AS BIGINT) AS cached_tokens,
  (hash(i * 7 + {arm}) % 200000) / 1e6 AS queue_seconds,
  0.001 + (hash(i * 11 + {arm}) % 300000) / 1e6 / ({arm} + 1) AS prefill_seconds,
  (hash(i * 7 + {arm}) % 200000) / 1e6 + 0.001 + (hash(i * 11 + {arm}) % 300000) / 1e6 / ({arm} + 1)
    + (hash(i * 13) % 50000) / 1e6 AS ttft_seconds,
  1764547200.0 + i / 1000.0 AS arrival_time
FROM range({count}) t(i) ORDER BY i
"""


def generate(directory: Path, count: int) -> dict[str, dict[str, Path]]:
    """Each arm as JSON lines and as Parquet, in request order."""
    import duckdb

    connection = duckdb.connect()
    connection.execute("SET enable_progress_bar = false")
    out: dict[str, dict[str, Path]] = {"jsonl": {}, "parquet": {}}
    for index, arm in enumerate(ARMS):
        parquet = directory / f"{arm}.parquet"
        rows = GENERATE.format(arm=index, count=count)
        connection.execute(f"COPY ({rows}) TO '{parquet}' (FORMAT parquet, COMPRESSION zstd)")
        jsonl = directory / f"{arm}.jsonl"
        connection.execute(f"COPY (SELECT * FROM '{parquet}') TO '{jsonl}' (FORMAT json)")
        out["parquet"][arm], out["jsonl"][arm] = parquet, jsonl
    connection.close()
    return out


def run_case(engine: str, paths: list[str], memory_limit: str, resamples: int) -> dict[str, Any]:
    """One comparison, in this process (the parent starts one process per case)."""
    from kvlens.analysis import compare
    from kvlens.config import load_settings

    compare.RESAMPLES = resamples
    settings = load_settings()
    start = time.perf_counter()
    if engine == "duckdb":
        from kvlens.analysis.duckdb import compare as in_duckdb

        result = in_duckdb.compare_files(
            list(zip(ARMS, paths, strict=True)), settings, warmup=1000, memory_limit=memory_limit
        )
    else:
        arms = [compare.load_arm(arm, path, settings) for arm, path in zip(ARMS, paths, strict=True)]
        result = compare.compare(arms, warmup=1000)
    seconds = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result.pop("files")
    return {
        "requests": result["requests"],
        "seconds": seconds,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "peak_rss": usage.ru_maxrss * 1024,
        "digest": hashlib.sha256(json.dumps(result, sort_keys=True).encode()).hexdigest()[:12],
    }


def measure(engine: str, paths: list[Path], memory_limit: str, resamples: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--case", engine, "--memory-limit", memory_limit]
    command += ["--resamples", str(resamples), *(str(path) for path in paths)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=1_000_000, help="requests per arm")
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples (compare's: 1000)")
    parser.add_argument("--memory-limit", default="2GiB")
    parser.add_argument("--directory", type=Path, help="where to generate (default: a temporary directory)")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.paths, args.memory_limit, args.resamples)))
        return
    print(
        f"{len(ARMS)} arms x {args.requests:,} requests; resamples {args.resamples}; memory limit "
        f"{args.memory_limit}; each case in its own process; peak RSS of that process"
    )
    print(
        f"{'case':<16} {'seconds':>8} {'cpu s':>8} {'peak RSS':>10}  {'vs numpy (wall, cpu, RSS)':<30} "
        f"{'digest':<13} load average 1/5/15 min after the case"
    )
    with tempfile.TemporaryDirectory(dir=args.directory) as directory:
        start = time.perf_counter()
        files = generate(Path(directory), args.requests)
        print(f"generated in {time.perf_counter() - start:.1f} s", flush=True)
        cases = [("numpy_jsonl", "numpy", "jsonl"), ("duckdb_jsonl", "duckdb", "jsonl")]
        cases.append(("duckdb_parquet", "duckdb", "parquet"))
        baseline: dict[str, Any] | None = None
        for case, engine, form in cases:
            result = measure(engine, [files[form][arm] for arm in ARMS], args.memory_limit, args.resamples)
            assert result["requests"] == args.requests, result
            baseline = baseline or result
            ratio = ", ".join(
                f"{result[key] / baseline[key]:.2f}x" for key in ("seconds", "cpu_seconds", "peak_rss")
            )
            load = "/".join(f"{value:.1f}" for value in os.getloadavg())
            print(
                f"{case:<16} {result['seconds']:8.2f} {result['cpu_seconds']:8.2f} "
                f"{result['peak_rss'] / 2**30:8.2f} GiB  {ratio:<30} {result['digest']:<13} load {load}",
                flush=True,
            )
            assert result["digest"] == baseline["digest"], "the engines disagree"


if __name__ == "__main__":
    main()
