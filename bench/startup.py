"""What one start of ``kvlens`` costs, beside the interpreter's own start in the same run.

    .venv/bin/python bench/startup.py [--repeat 15]

Each case runs in a fresh interpreter, as the ``kvlens`` script starts (``kvlens.console``),
byte-compiled, the cases taken in turn round after round so a drift of the machine's speed falls
on all of them alike; the figures are medians of the wall-clock time (and of the CPU time, which
another job on the machine disturbs less). Baselines: ``python -c pass`` (the
interpreter) and ``python -c "import json"`` (a module of the standard library). Goals (issue 31):
``kvlens --help`` under 0.15 s and ``kvlens analyze`` on 100 records under 0.3 s.

The code measured is the ``kvlens`` on ``PYTHONPATH`` (or installed); ``--before DIR`` runs each
``kvlens`` case also with ``PYTHONPATH=DIR`` (another checkout's ``service/``, where it may write
its ``__pycache__``), in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KVLENS = "import sys; from kvlens.console import main; sys.exit(main())"


def records(path: Path, count: int) -> Path:
    rng = random.Random(1)
    with path.open("w") as out:
        for i in range(count):
            prompt = rng.randint(100, 8000)
            record = {
                "request_id": f"r{i}",
                "model": "m",
                "prompt_tokens": prompt,
                "cached_tokens": rng.choice([0, prompt // 2]),
                "output_tokens": 100,
                "ttft_seconds": 0.05 + prompt / 1e5,
                "queue_seconds": 0.01,
                "prefill_seconds": prompt / 1e5,
            }
            out.write(json.dumps(record) + "\n")
    return path


def run_once(argv: list[str], env: dict[str, str] | None) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system) of one run: on a machine others share, the CPU
    time moves less than the wall time."""
    # byte-compiled, as installed: a PYTHONDONTWRITEBYTECODE of the caller's would compile every
    # module at every start
    env = {k: v for k, v in (env or os.environ).items() if k != "PYTHONDONTWRITEBYTECODE"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=15, help="rounds (each case once per round)")
    parser.add_argument("--before", metavar="DIR", help="also run the kvlens cases from this PYTHONPATH")
    args = parser.parse_args()
    now = os.environ.get("PYTHONPATH") or "the installed package"
    envs: dict[str, dict[str, str] | None] = {"": None}
    if args.before:
        envs = {" (before)": {**os.environ, "PYTHONPATH": args.before}, "": None}
    python = sys.executable
    with tempfile.TemporaryDirectory() as directory:
        hundred = records(Path(directory) / "records.jsonl", 100)
        commands = {
            "kvlens --help": ["--help"],
            "kvlens analyze --help": ["analyze", "--help"],
            "kvlens analyze (100 records)": ["analyze", str(hundred)],
            "kvlens analyze --json (100 records)": ["analyze", str(hundred), "--json"],
        }
        cases: dict[str, tuple[list[str], dict[str, str] | None]] = {
            "python -c pass": ([python, "-c", "pass"], None),
            'python -c "import json"': ([python, "-c", "import json"], None),
        }
        for name, argv in commands.items():
            for label, env in envs.items():
                cases[name + label] = ([python, "-c", KVLENS, *argv], env)
        for argv, env in cases.values():  # byte-compile and warm the page cache, unmeasured
            run_once(argv, env)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
        for _ in range(args.repeat):
            for name, (argv, env) in cases.items():
                times[name].append(run_once(argv, env))
    base = statistics.median(wall for wall, _ in times["python -c pass"])
    print(f"kvlens from {now}" + (f", before: {args.before}" if args.before else ""))
    print(f"load {os.getloadavg()[0]:.2f}, {args.repeat} rounds")
    print(f"{'case':47} {'wall s':>7} {'min s':>6} {'- python':>8} {'CPU s':>6}")
    for name, measured in times.items():
        median = statistics.median(wall for wall, _ in measured)
        cpu = statistics.median(cpu for _, cpu in measured)
        low = min(wall for wall, _ in measured)
        print(f"{name:47} {median:7.3f} {low:6.3f} {median - base:8.3f} {cpu:6.3f}")


if __name__ == "__main__":
    main()
