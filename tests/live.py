"""Helpers for tests that run a real ``kvlens`` process and talk to it over real sockets."""

from __future__ import annotations

import itertools
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Running:
    process: subprocess.Popen[str]
    url: str

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def output(self) -> str:
        """Stop the process (SIGTERM, so it shuts down cleanly) and return what it printed."""
        self.process.terminate()
        try:
            out, _ = self.process.communicate(timeout=20)
        except subprocess.TimeoutExpired:  # a defect: kill it, so it cannot outlive its test
            self.process.kill()
            self.process.communicate()
            raise
        return out

    def samples(self, **headers: str) -> Samples:
        return parse_samples(httpx.get(f"{self.url}/metrics", headers=headers, timeout=10).text)

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` whose labels include ``labels``."""
        return total(self.samples(), name, **labels)

    def wait_for(self, name: str, expected: float, timeout: float = 20, **labels: str) -> float:
        """Poll /metrics until ``name`` reaches ``expected`` (the sidecar works on its own clock)."""
        deadline = time.monotonic() + timeout
        while (found := self.value(name, **labels)) < expected and time.monotonic() < deadline:
            time.sleep(0.05)
        return found

    def memory(self) -> Memory:
        return Memory(self.process.pid)


def start_kvlens(
    *args: str,
    env: dict[str, str] | None = None,
    port: int | None = None,
    scheme: str = "http",
    wait: bool = True,
    ready: str = "/healthz",
    start_seconds: float = 20,
    sigint_ignored: bool = False,
    prefix: Sequence[str] = (),
) -> Running:
    """Start ``kvlens ARGS --port P`` and, unless ``wait`` is False, wait until ``ready`` answers
    200 (``kvlens simulate serve`` answers on vLLM's ``/health``; a test that counts connections
    may want no probe of its own to have been one), at most ``start_seconds``. ``prefix``: a
    command that runs it (``setpriv ...``)."""
    port = port or free_port()
    process = subprocess.Popen(
        [*prefix, sys.executable, "-m", "kvlens.cli", *args, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "KVLENS_LOG_LEVEL": "WARNING", **(env or {})},
        # as a job started in the background of a script (POSIX shells ignore SIGINT there)
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None,
    )
    url = f"{scheme}://127.0.0.1:{port}"
    if not wait:
        return Running(process, url)
    deadline = time.monotonic() + start_seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kvlens exited early:\n{process.communicate()[0]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                pass
            if scheme != "http" or httpx.get(f"{url}{ready}", timeout=2).status_code == 200:
                return Running(process, url)
        except (OSError, httpx.TransportError):
            time.sleep(0.05)  # waiting for a process to bind, not for time to pass
    # Reaped here: a process left running would fail the next test too (its ResourceWarning).
    process.kill()
    out, _ = process.communicate()
    raise RuntimeError(f"kvlens did not start within {start_seconds:g} s:\n{out}")


def parse_samples(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    wanted = set(labels.items())
    return sum(value for (found, keys), value in samples.items() if found == name and wanted <= keys)


class Memory:
    """Resident memory of another process: its current size, and its peak since :meth:`reset`.

    The peak is the kernel's high-water mark (VmHWM), reset through ``/proc/PID/clear_refs``, so a
    spike between two samples is never missed.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.baseline = 0.0

    def _status(self, field: str) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        raise LookupError(field)

    def rss_mib(self) -> float:
        return self._status("VmRSS")

    def reset(self) -> None:
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")
        self.baseline = self.rss_mib()

    def peak_growth_mib(self) -> float:
        """How far the peak rose above the resident size at :meth:`reset`."""
        return self._status("VmHWM") - self.baseline


def raise_open_files_limit(wanted: int = 8192) -> None:
    """Let this process (and the servers it starts) hold ``wanted`` sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))


class TextHandler(BaseHTTPRequestHandler):
    """A quiet request handler with a helper to answer a Prometheus exposition."""

    def answer(self, body: bytes, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("content-type", "text/plain; version=0.0.4")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class EngineServer:
    """An engine /metrics on loopback whose text is made anew for every scrape by
    ``exposition(n)`` (n counts the scrapes); None answers 503, as an engine restarting."""

    def __init__(self, exposition: Callable[[int], str | None]) -> None:
        scrapes = itertools.count()
        self.served = 0  # scrapes answered
        server = self

        class Handler(TextHandler):
            def do_GET(self) -> None:
                text = exposition(next(scrapes))
                self.answer(b"" if text is None else text.encode(), 200 if text is not None else 503)
                server.served += 1

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"

    def wait_for_scrapes(self, count: int, timeout: float = 30) -> int:
        """Wait until ``count`` scrapes were answered (the sidecar scrapes on its own clock)."""
        deadline = time.monotonic() + timeout
        while self.served < count and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.served

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def in_thread(target: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def until(condition: Callable[[], bool], timeout: float = 20) -> None:
    """Poll ``condition`` (an in-process state another thread changes) until it holds, or fail."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the condition did not come true")
        time.sleep(0.01)


# kvlens ARGS, printing its peak resident size (MiB, VmHWM: this process's own; getrusage's
# ru_maxrss keeps the parent's peak across fork and exec) as the last line on stderr.
_PEAK_MAIN = (
    "import atexit, sys; from kvlens.cli import main; atexit.register(lambda: print(next(int(line.split()[1])"
    " // 1024 for line in open('/proc/self/status') if line.startswith('VmHWM')), file=sys.stderr)); "
    "sys.exit(main(sys.argv[1:]))"
)


@dataclass
class Measured:
    returncode: int
    stderr: str  # without the peak's line
    peak_mib: int


def run_measured(*args: str, address_space: int = 1 << 30, timeout: float = 60) -> Measured:
    """Run ``kvlens ARGS`` with its address space capped at ``address_space`` bytes (a defect
    that grows without bound ends in a MemoryError there, not in the machine's memory) and at
    most ``timeout`` seconds (subprocess.TimeoutExpired past it); its exit code, stderr, peak."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    done = subprocess.run(
        [sys.executable, "-c", _PEAK_MAIN, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit,
        env={**os.environ, "KVLENS_LOG_LEVEL": "WARNING"},
    )
    lines = done.stderr.rstrip("\n").split("\n")
    return Measured(done.returncode, "\n".join(lines[:-1]), int(lines[-1]))
