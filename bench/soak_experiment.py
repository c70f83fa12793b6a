"""The soak's ``experiment`` attack: a real ``kvlens replay`` against a hostile endpoint, again and again.

Every few seconds (30 in a 10-minute soak; shorter in a short one, so that a one-minute soak
runs each variant once) a ``python -m kvlens.cli replay shared-prefix`` subprocess (8 requests)
is pointed at an OpenAI-compatible endpoint this module serves on 127.0.0.1, whose first path
segment says how it misbehaves (the variants, in turn):
- ``drip-models``: ``/v1/models`` answers its head one byte every DRIP_BYTE_SECONDS, for ever;
- ``drip-metrics``: ``/metrics`` (the block-size check) does so;
- ``drip-reset``: ``/reset_prefix_cache`` does so (``--reset``; ``/flush_cache`` answers 404);
- ``gzip-metrics``: ``/metrics`` answers a gzip bomb (the soak's: 1 MiB inflating to 1 GiB);
- ``choices-int``: the completions stream ``{"choices": 5}`` chunks.
Everything else answers as a vLLM would (a model list, ``vllm:cache_config_info`` with block
size 16, resets, streamed completions with usage).

Pass conditions for each replay: it ends within REPLAY_BOUND_SECONDS (else it is killed), its
peak RSS (its VmHWM, read while it runs) stays under REPLAY_RSS_BOUND_MIB (it is killed past it),
and it ends with a report (exit 0 and its ``arm ...`` line) or a clear error (exit 2 and a
``kvlens: ...`` line), never a traceback.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import orjson

VARIANTS = ("drip-models", "drip-metrics", "drip-reset", "gzip-metrics", "choices-int")
EVERY_SECONDS = 30.0
REPLAY_BOUND_SECONDS = 60.0
REPLAY_RSS_BOUND_MIB = 500.0
DRIP_BYTE_SECONDS = 2.0
DRIP_MOST_SECONDS = 300.0  # a drip ends at the latest after this (or when the client hangs up)
REPLAY_ARGUMENTS = (
    "--model", "soak", "--arm", "soak", "--requests", "8", "--groups", "2", "--prefix-tokens", "64",
    "--suffix-tokens", "16", "--output-tokens", "4", "--traffic-rate", "100", "--timeout", "20",
)  # fmt: skip


class HostileEndpoint:
    """An OpenAI-compatible endpoint whose first path segment (a variant) names its misbehaviour."""

    def __init__(self, bomb: bytes) -> None:
        # Not the soak's stop: a drip outlives it, so that a replay it holds meets its own bound.
        self.closing = closing = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                variant, path = self._route()
                if path == "/v1/models":
                    if variant == "drip-models":
                        return self._drip()
                    return self._json({"object": "list", "data": [{"id": "soak", "object": "model"}]})
                if path == "/metrics":
                    if variant == "drip-metrics":
                        return self._drip()
                    if variant == "gzip-metrics":
                        return self._answer(bomb, "text/plain; version=0.0.4", gzip=True)
                    text = b'vllm:cache_config_info{block_size="16"} 1.0\n'
                    return self._answer(text, "text/plain; version=0.0.4")
                return self._answer(b"{}", "application/json", status=404)

            def do_POST(self) -> None:
                variant, path = self._route()
                length = int(self.headers.get("content-length", "0"))
                body = self.rfile.read(length) if 0 < length <= 2**24 else b"{}"
                if path == "/reset_prefix_cache":
                    if variant == "drip-reset":
                        return self._drip()
                    return self._answer(b"", "text/plain")
                if path == "/v1/completions":
                    return self._stream(variant, orjson.loads(body))
                return self._answer(b"{}", "application/json", status=404)

            def _route(self) -> tuple[str, str]:
                _, variant, rest = (self.path.split("?")[0] + "/").split("/", 2)
                return variant, "/" + rest.rstrip("/")

            def _answer(self, body: bytes, kind: str, *, status: int = 200, gzip: bool = False) -> None:
                self.send_response(status)
                self.send_header("content-type", kind)
                if gzip:
                    self.send_header("content-encoding", "gzip")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                with contextlib.suppress(OSError):  # the client hung up once it had read enough
                    self.wfile.write(body)

            def _json(self, value: object) -> None:
                self._answer(orjson.dumps(value), "application/json")

            def _drip(self) -> None:
                """A status line, then a header one byte at a time until the client hangs up."""
                ends = time.monotonic() + DRIP_MOST_SECONDS
                try:
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nx-drip: ")
                    while not closing.wait(DRIP_BYTE_SECONDS) and time.monotonic() < ends:
                        self.wfile.write(b"a")
                except OSError:
                    pass
                self.close_connection = True

            def _stream(self, variant: str, request: dict[str, object]) -> None:
                """Streamed completions, one text chunk per token, usage, then [DONE] (to the close)."""
                prompt = request.get("prompt")
                tokens = request.get("max_tokens")
                prompt_tokens = len(prompt) if isinstance(prompt, list) else 1
                chunk = (
                    {"choices": 5} if variant == "choices-int" else {"choices": [{"index": 0, "text": "a"}]}
                )
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": tokens,
                    "prompt_tokens_details": {"cached_tokens": 0},
                }
                lines = [orjson.dumps(chunk)] * (tokens if isinstance(tokens, int) else 1)
                lines += [orjson.dumps({"choices": [], "usage": usage}), b"[DONE]"]
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                with contextlib.suppress(OSError):
                    self.wfile.write(b"".join(b"data: " + line + b"\n\n" for line in lines))
                self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


@dataclass
class ReplayRun:
    variant: str
    seconds: float
    peak_mib: float
    exit_code: int
    ended: str  # "report: ...", "error: ..." or what went wrong
    failure: str | None


def _high_water_mib(pid: int) -> float:
    """VmHWM of a running process in MiB (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def replay(variant: str, url: str, workdir: Path, number: int) -> ReplayRun:
    """One ``kvlens replay`` against ``url``/``variant``, bounded in time and memory."""
    out, err = workdir / f"replay-{number}.out", workdir / f"replay-{number}.err"
    command = [sys.executable, "-m", "kvlens.cli", "replay", "shared-prefix"]
    command += ["--endpoint", f"{url}/{variant}", "--out", str(workdir / f"replay-{number}.jsonl")]
    command += [*REPLAY_ARGUMENTS, *(["--reset"] if variant == "drip-reset" else [])]
    started = time.monotonic()
    with out.open("wb") as stdout, err.open("wb") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr)
    killed, peak_mib = None, 0.0
    while True:
        pid, status = os.waitpid(process.pid, 0 if killed else os.WNOHANG)
        if pid:
            break
        # The child's own high-water mark, read while it runs: wait4's ru_maxrss is no measure
        # here, since a child spawned by vfork takes its parent's high-water mark at exec (the
        # soak's own RSS, growing run after run); only a peak in its last 0.1 s can be missed.
        peak_mib = max(peak_mib, _high_water_mib(process.pid))
        if peak_mib > REPLAY_RSS_BOUND_MIB:
            killed = f"peak RSS {peak_mib:.0f} MiB past {REPLAY_RSS_BOUND_MIB:g} MiB: killed"
        if time.monotonic() - started > REPLAY_BOUND_SECONDS:
            killed = f"did not end within {REPLAY_BOUND_SECONDS:g} s: killed"
        if killed:
            process.kill()
        else:
            time.sleep(0.1)  # a sampling interval of another process, not a wait for an event
    process.returncode = code = os.waitstatus_to_exitcode(status)
    seconds = time.monotonic() - started
    text = out.read_text(errors="replace") + err.read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.strip()]
    report = next((line for line in lines if line.startswith("arm soak:")), None)
    # a refusal ("kvlens: ..."), or the arm's failures past --max-error-rate (exit 1; 2 when none
    # was answered, as every request of choices-int fails), said after its records are written
    error = next((line for line in lines if line.startswith(("kvlens: ", "kvlens replay: "))), None)
    failure, ended = killed, ""
    if "Traceback" in text:
        traceback = lines[max(i for i, line in enumerate(lines) if line.startswith("Traceback")) :]
        raised = next((line for line in traceback[1:] if not line[0].isspace()), "(cut short)")
        failure = failure or f"a traceback: {raised[:200]}"
    elif code == 0 and report:
        ended = f"report: {report}"
    elif code in (1, 2) and error:
        ended = f"error: {error}"
    else:
        failure = failure or f"exit {code}: {(lines or ['(no output)'])[-1][:200]}"
    if peak_mib > REPLAY_RSS_BOUND_MIB:
        failure = failure or f"peak RSS {peak_mib:.0f} MiB past {REPLAY_RSS_BOUND_MIB:g} MiB"
    if failure:
        ended = f"FAILED: {failure}"
    return ReplayRun(variant, seconds, peak_mib, code, ended, failure)


class ExperimentAttack:
    def __init__(self, workdir: Path, attacked: Callable[[str], None], minutes: float, bomb: bytes) -> None:
        """``bomb``: the gzip bomb ``/metrics`` answers in the gzip-metrics variant."""
        self.workdir = workdir
        self.attacked = attacked
        # each variant at least once in a short soak; every EVERY_SECONDS in a long one
        self.every = min(EVERY_SECONDS, max(10.0, minutes * 60 / len(VARIANTS)))
        self.endpoint = HostileEndpoint(bomb)
        self.runs: list[ReplayRun] = []
        self.lock = threading.Lock()

    def run(self, stop: threading.Event) -> None:
        """A replay every ``every`` seconds until ``stop``, each in its own thread (one that is
        held does not delay the next); then waits for those running (each ends within its bound)."""
        threads = []
        for number, variant in zip(itertools.count(), itertools.cycle(VARIANTS)):
            if stop.wait(2.0 if number == 0 else self.every):
                break
            self.attacked("experiment")
            thread = threading.Thread(target=self._replay, args=(variant, number), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()  # bounded: a replay is killed past REPLAY_BOUND_SECONDS
        self.endpoint.close()

    def _replay(self, variant: str, number: int) -> None:
        result = replay(variant, self.endpoint.url, self.workdir, number)
        with self.lock:
            self.runs.append(result)

    def report(self) -> list[str]:
        with self.lock:
            runs = sorted(self.runs, key=lambda run: VARIANTS.index(run.variant))
        return [
            f"  replay {run.variant:<13} {run.seconds:5.1f} s {run.peak_mib:4.0f} MiB peak  {run.ended[:90]}"
            for run in runs
        ]

    def failures(self) -> list[str]:
        with self.lock:
            return [f"experiment: replay {run.variant}: {run.failure}" for run in self.runs if run.failure]
