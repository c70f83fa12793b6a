"""`kvlens experiment` one endpoint (or arm) at a time into one out-dir, against real `kvlens
simulate serve` processes started one after the other: the merged report, a plan that differs
refused, finished steps skipped on resume, the lock, Ctrl-C, and --dry-run contacting nothing."""

from __future__ import annotations

import json
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlens.cli import main
from tests.live import Running, free_port, start_kvlens

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SHAPE = ("--block-size", "16", "--capacity-blocks", "4000")


def simulated(*flags: str) -> Running:
    return start_kvlens("simulate", "serve", *flags, ready="/health")


def quantization(out: Path, endpoint: str, *extra: str) -> list[str]:
    return [
        "experiment",
        "quantization",
        "shared-prefix",
        "--model",
        "simulated",
        "--endpoint",
        endpoint,
        "--out-dir",
        str(out),
        "--requests",
        "8",
        "--output-tokens",
        "8",
        "--concurrency",
        "4",
        "--prefix-tokens",
        "256",
        "--suffix-tokens",
        "64",
        "--slo-itl",
        "0.025",
        "--slo-attainment",
        "0.8",
        *extra,
    ]


def metas(out: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(out.glob("*.step.json"))}


def test_quantization_one_endpoint_at_a_time_merges_resumes_and_refuses_another_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "quant"
    bf16 = simulated("--weight-bytes", "140GB", *SHAPE)
    try:
        assert main(quantization(out, f"bf16={bf16.url}", "--rates", "8")) == 0
    finally:
        bf16.output()  # gone before the other endpoint starts: one GPU, one server at a time
    first = capsys.readouterr()
    assert "holds one endpoint so far" in first.err
    # stderr is no terminal here: a line as each step ends, for a log
    ended = re.findall(
        r"kvlens experiment: step (\S+): (\d+)/8 sent, (\d+) answered, 0 errors, .* done", first.err
    )
    # the trace has no long prompts: the fixed work makes its own (2 a slot), a step of its own
    assert ended == [("fixed-bf16", "8", "8"), ("fixed-bf16-long", "8", "8"), ("rate-8-bf16", "8", "8")]

    w4a16 = simulated("--weight-bytes", "40GB", *SHAPE)
    try:
        assert main(quantization(out, f"w4a16={w4a16.url}", "--rates", "8", "--json")) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["baseline"] == "bf16"  # the first endpoint run into the folder
        assert list(report["fixed_work"]) == ["bf16", "w4a16"]
        fixed = report["fixed_work"]
        assert fixed["w4a16"]["short"]["itl_p50_seconds"] < fixed["bf16"]["short"]["itl_p50_seconds"]
        load = report["rising_load"]
        assert {name: [step["rate"] for step in steps] for name, steps in load["steps"].items()} == {
            "bf16": [8.0],
            "w4a16": [8.0],
        }
        assert all(step["requests"] == 8 for steps in load["steps"].values() for step in steps)
        assert json.loads((out / "plan.json").read_text())["endpoints"] == ["bf16", "w4a16"]

        # the same command again: every step is finished, none runs, the report is the same
        before = metas(out)
        records = {path.name: path.read_bytes() for path in out.glob("*.jsonl")}
        assert main(quantization(out, f"w4a16={w4a16.url}", "--rates", "8", "--json")) == 0
        again = capsys.readouterr()
        assert json.loads(again.out)["fixed_work"] == report["fixed_work"]
        assert "kvlens experiment: step" not in again.err
        assert metas(out) == before
        assert {path.name: path.read_bytes() for path in out.glob("*.jsonl")} == records

        # --restart redoes this run's steps (w4a16's), not the other endpoint's
        assert main(quantization(out, f"w4a16={w4a16.url}", "--rates", "8", "--restart", "--json")) == 0
        capsys.readouterr()
        redone = metas(out)
        assert {name for name in redone if redone[name] != before[name]} == {
            "fixed-w4a16.step.json",
            "fixed-w4a16-long.step.json",
            "rate-8-w4a16.step.json",
        }
    finally:
        w4a16.output()

    # another plan: refused, naming what differs, before any endpoint is called (none is up)
    down = f"fp8=http://127.0.0.1:{free_port()}"
    assert main(quantization(out, down, "--rates", "4,8")) == 2
    refused = capsys.readouterr().err
    assert refused.endswith(
        "What differs (old -> new): rates: [8.0] -> [4.0,8.0]. Run with the old plan's settings, or into "
        "another --out-dir\n"
    )
    assert main(quantization(out, down, "--rates", "8", "--seed", "1")) == 2
    differs = capsys.readouterr().err.split("What differs (old -> new): ")[1]
    assert re.fullmatch(r'seed: 0 -> 1; trace: "[0-9a-f]{16}" -> "[0-9a-f]{16}"\. Run .*\n', differs)
    assert json.loads((out / "plan.json").read_text())["endpoints"] == ["bf16", "w4a16"]  # untouched

    # --dry-run over the folder: bf16's steps are finished and would be skipped
    assert main(quantization(out, down, "--rates", "8", "--dry-run", "--endpoint", "bf16=http://x")) == 0
    table = capsys.readouterr().out
    assert "fixed-fp8               fp8                 8          -  to run (4 in flight)" in table
    assert (
        "fixed-bf16              bf16                8          -  finished: skipped (4 in flight)" in table
    )
    assert (
        "fixed-bf16-long         bf16                8          -  finished: skipped (4 in flight; made: "
        "the trace has none)" in table
    )
    assert "rate-8-bf16             bf16                8       0:01  finished: skipped" in table


def test_dry_run_prints_the_plan_and_contacts_no_endpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as listener:  # an endpoint that would see any connection queued
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        out = tmp_path / "never"
        args = quantization(out, f"bf16={url}", "--endpoint", f"w4a16={url}", "--rates", "2,4", "--dry-run")
        assert main(args) == 0
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert not out.exists()  # nothing written, not even the folder
    printed = capsys.readouterr().out
    assert printed.startswith(
        "kvlens experiment quantization --dry-run: nothing is sent, nothing written\n\n"
        f"out-dir {out}: new (plan "
    )
    table = printed[printed.index("step ") :]
    assert table == (
        "step                    endpoint     requests   arrivals  state\n"
        "fixed-bf16              bf16                8          -  to run (4 in flight)\n"
        "fixed-w4a16             w4a16               8          -  to run (4 in flight)\n"
        "fixed-bf16-long         bf16                8          -  to run (4 in flight; made: the trace "
        "has none)\n"
        "fixed-w4a16-long        w4a16               8          -  to run (4 in flight; made: the trace "
        "has none)\n"
        "rate-2-bf16             bf16                8       0:02  to run\n"
        "rate-2-w4a16            w4a16               8       0:02  to run\n"
        "rate-4-bf16             bf16                8       0:01  to run\n"
        "rate-4-w4a16            w4a16               8       0:01  to run\n"
        "\n"
        "estimated duration: at least 0:07 (the arrivals of the steps to run), plus 4 fixed-work step(s) "
        "whose time is the server's\n"
    )


def wait_for(condition: object, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {seconds:g} s for {what}")
        time.sleep(0.02)  # polling for an event in another process, not waiting for time


def test_a_second_run_is_refused_ctrl_c_says_how_to_resume_and_the_resume_skips_finished_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "quant"
    bf16 = simulated("--weight-bytes", "140GB", *SHAPE)
    argv = quantization(out, f"bf16={bf16.url}", "--rates", "1")
    run = subprocess.Popen(
        [sys.executable, "-m", "kvlens.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        staged = out / ".unfinished" / "rate-1-bf16.jsonl"

        def a_step_finished_and_the_next_begun() -> bool:
            assert run.poll() is None, run.communicate()
            return (out / "fixed-bf16.jsonl").exists() and staged.exists() and bool(staged.read_bytes())

        wait_for(a_step_finished_and_the_next_begun, "a step")
        # the lock holds: another run into the folder is refused, naming the first
        assert main(quantization(out, f"w4a16={bf16.url}", "--rates", "1")) == 2
        command = "kvlens " + shlex.join(argv)
        assert capsys.readouterr().err == (
            f"kvlens: {out} is in use by another run (pid {run.pid}: {command}); "
            "wait for it to end, or stop it\n"
        )
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=60)
        assert run.returncode == 130
        assert "Traceback" not in err
        assert err.endswith(
            f"kvlens experiment: stopped: 2 finished step(s) kept in {out}: fixed-bf16-long, fixed-bf16\n"
            "the step under way, rate-1-bf16, was not finished: it runs again on resume (its records so far: "
            f"{staged})\n"
            f"to resume (finished steps are skipped): {command}\n"
        )
        assert not (out / "rate-1-bf16.jsonl").exists()
        kept = metas(out)
        assert list(kept) == ["fixed-bf16-long.step.json", "fixed-bf16.step.json"]

        # the command it gave, run again: the fixed work is kept, the rate step runs whole
        assert main(argv) == 0
        resumed = capsys.readouterr().err
        assert "step fixed-bf16" not in resumed and "step rate-1-bf16: 8/8 sent, 8 answered" in resumed
        assert {name: metas(out)[name] for name in kept} == kept
        rows = [json.loads(line) for line in (out / "rate-1-bf16.jsonl").read_text().splitlines()]
        assert sorted(row["trace_index"] for row in rows) == list(range(8))
        assert not (out / ".unfinished").exists()
    finally:
        run.kill()
        run.communicate()
        bf16.output()


def prefix_cache(out: Path, endpoint: str, arms: str, *extra: str) -> list[str]:
    return [
        "experiment",
        "prefix-cache",
        "shared-prefix",
        "--endpoint",
        endpoint,
        "--arms",
        arms,
        "--model",
        "simulated",
        "--out-dir",
        str(out),
        "--requests",
        "20",
        "--groups",
        "2",
        "--prefix-tokens",
        "512",
        "--traffic-rate",
        "20",
        "--max-concurrency",
        "1",
        *extra,
    ]


def test_prefix_cache_arms_one_endpoint_at_a_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "runs"
    unreachable = f"http://127.0.0.1:{free_port()}"
    assert main(prefix_cache(out, unreachable, "off,cold")) == 2
    assert capsys.readouterr().err == (
        "kvlens: --arms off with cold or warm needs --off-endpoint for the off arm (a server without prefix "
        "caching); or run --arms off against it on its own, then the others\n"
    )
    off = simulated("--speed", "1000", "--block-size", "16", "--no-prefix-caching")
    try:
        assert main(prefix_cache(out, off.url, "off")) == 0
    finally:
        off.output()
    assert capsys.readouterr().err.endswith(
        f"kvlens experiment: {out} holds the arm(s) off; no report until another is run into it "
        "(--arms cold,warm)\n"
    )
    on = simulated("--speed", "1000", "--block-size", "16")
    try:
        assert main(prefix_cache(out, on.url, "cold,warm", "--json")) == 0
    finally:
        on.output()
    report = json.loads(capsys.readouterr().out)
    assert report["arms"] == ["off", "cold", "warm"]
    assert json.loads((out / "plan.json").read_text())["endpoints"] == ["off", "cold", "warm"]
    off_rows = [json.loads(line) for line in (out / "off.jsonl").read_text().splitlines()]
    assert len(off_rows) == 10 and all(row["cached_tokens"] == 0 for row in off_rows)
    warm_rows = [json.loads(line) for line in (out / "warm.jsonl").read_text().splitlines()]
    assert [row["trace_index"] for row in warm_rows] == [row["trace_index"] for row in off_rows]
    assert all(row["cached_tokens"] == 512 for row in warm_rows)
    assert report["warmup_recorded_apart"] == {
        "warm": {"file": str(out / "warm.warmup.jsonl"), "requests": 10}
    }
