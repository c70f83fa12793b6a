"""``kvlens replay`` and ``kvlens experiment quantization`` (real processes) against an endpoint
whose answers to the runner's calls (``/v1/models``, ``/metrics`` for the block size and for the
quantization experiment's samples, the cache reset) misbehave: a head or a body that trickles and
never ends, an endless body at full speed, a gzip bomb. Every call goes through one bounded
client (a deadline over the whole exchange, head included; a cap on the inflated bytes), so the
run either says the endpoint does not answer, or goes on without what the call would have told."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvlens.cli import main

pytestmark = pytest.mark.integration
MODELS = b'{"object":"list","data":[{"id":"m","object":"model"}]}'
USAGE = b'"usage":{"prompt_tokens":1152,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":16}}'
GOOD = b'data: {"choices":[{"index":0,"text":"a"}],' + USAGE + b"}\n\ndata: [DONE]\n\n"
Answer = Callable[[socket.socket], None]


def whole(body: bytes, kind: bytes = b"application/json") -> Answer:
    def send(sock: socket.socket) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (kind, len(body)))
        sock.sendall(body)

    return send


def trickle(sock: socket.socket) -> None:
    """A head, then a byte every half second, for good (each read is quick; the call is not)."""
    sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000000\r\n\r\n")
    stop = threading.Event()
    try:
        while not stop.wait(0.5):
            sock.sendall(b" ")
    except OSError:
        return


def head_trickle(sock: socket.socket) -> None:
    """A head a byte every 2 s, for good: each read is quick (httpx's timeout is per read), the
    head never whole."""
    head = b"HTTP/1.1 200 OK\r\nx-padding: "
    stop = threading.Event()
    try:
        for index in range(10**6):
            sock.sendall(head[index : index + 1] or b"a")
            if stop.wait(2):
                return
    except OSError:
        return


def drip(sock: socket.socket) -> None:
    """A head, then the body a byte a second, for good."""
    sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 1000000\r\n\r\n")
    stop = threading.Event()
    try:
        while not stop.wait(1):
            sock.sendall(b"#")
    except OSError:
        return


def gzip_bomb(mebibytes: int) -> bytes:
    """gzip of ``mebibytes`` MiB of zeros (about a KiB a MiB)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(1024 * 1024)
    return b"".join(packer.compress(zeros) for _ in range(mebibytes)) + packer.flush()


BOMB = gzip_bomb(1024)  # 1 MiB that inflates to 1 GiB


def bombed(sock: socket.socket) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-encoding: gzip\r\n"
    try:
        sock.sendall(head + b"content-length: %d\r\n\r\n" % len(BOMB) + BOMB)
    except OSError:
        return


def endless(sock: socket.socket) -> None:
    """A body to the close, 64 KiB at a time at full speed: 256 MiB (endless, as far as a test
    on a shared machine may go)."""
    sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n\r\n")
    piece = b"# " + b"x" * 65_533 + b"\n"
    try:
        for _ in range(4096):
            sock.sendall(piece)
    except OSError:
        return


class Endpoint:
    """Answers each path with what the test gives it; completions with one good stream."""

    def __init__(self, answers: dict[str, Answer]) -> None:
        self.answers = {
            "/v1/models": whole(MODELS),
            "/v1/completions": whole(GOOD, b"text/event-stream"),
            **answers,
        }
        self.listener = socket.create_server(("127.0.0.1", 0))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}"

    def serve(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self.answer, args=(sock,), daemon=True).start()

    def answer(self, sock: socket.socket) -> None:
        with sock:
            data = b""
            while b"\r\n\r\n" not in data:
                more = sock.recv(65536)
                if not more:
                    return
                data += more
            path = data.split(b" ", 2)[1].decode()
            self.answers.get(path, whole(b"{}"))(sock)


@pytest.fixture
def endpoint(request: pytest.FixtureRequest) -> Iterator[Endpoint]:
    server = Endpoint(request.param)
    threading.Thread(target=server.serve, daemon=True).start()
    yield server
    server.listener.close()


# kvlens replay, printing its peak resident size (MiB) last on stderr: VmHWM, this process's own
# (getrusage's ru_maxrss keeps the parent's peak across fork and exec: pytest's, after other tests)
PEAK = (
    "import atexit, sys; from kvlens.cli import main; atexit.register(lambda: print(next(int(line.split()[1])"
    " // 1024 for line in open('/proc/self/status') if line.startswith('VmHWM')), file=sys.stderr)); "
    "sys.exit(main(sys.argv[1:]))"
)


def replay(endpoint: Endpoint, out: Path) -> subprocess.CompletedProcess[str]:
    flags = ["--model", "m", "--arm", "a", "--out", str(out), "--requests", "1", "--timeout", "5"]
    return subprocess.run(
        [sys.executable, "-c", PEAK, "replay", "shared-prefix", "--endpoint", endpoint.url, *flags],
        capture_output=True,
        text=True,
        timeout=60,  # a hang check: before, a trickling check held the run for good
    )


@pytest.mark.parametrize("endpoint", [{"/v1/models": trickle}], indirect=True)
def test_a_model_list_that_trickles_for_good_is_no_answer(endpoint: Endpoint, tmp_path: Path) -> None:
    """Before: httpx's timeout is per read, and a byte every half second never hit it: the run
    waited for good before its first request."""
    done = replay(endpoint, tmp_path / "arm.jsonl")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-2] == (
        f"kvlens: {endpoint.url} does not answer ({endpoint.url}/v1/models did not finish within 10 s)"
    )


@pytest.mark.parametrize("endpoint", [{"/metrics": endless}], indirect=True)
def test_an_endless_metrics_answer_is_given_up_and_the_run_goes_on(
    endpoint: Endpoint, tmp_path: Path
) -> None:
    """Before: the whole answer was read into memory (an endless one at full speed grew the
    client without bound, also past httpx's per-read timeout)."""
    out = tmp_path / "arm.jsonl"
    done = replay(endpoint, out)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(out.read_bytes().splitlines()) == 1
    assert b'"error"' not in out.read_bytes()
    assert int(done.stderr.strip().splitlines()[-1]) < 200  # MiB; 256 MiB of it were sent


@pytest.mark.parametrize("endpoint", [{"/v1/models": head_trickle}], indirect=True)
def test_a_model_list_whose_head_trickles_is_no_answer_within_its_10_s(
    endpoint: Endpoint, tmp_path: Path
) -> None:
    """Before: a head byte every 2 s never hit httpx's per-read timeout, and the deadline was
    looked at only between body pieces: the run waited for good (150 s and counting)."""
    started = time.monotonic()
    done = replay(endpoint, tmp_path / "arm.jsonl")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-2] == (
        f"kvlens: {endpoint.url} does not answer ({endpoint.url}/v1/models did not finish within 10 s)"
    )
    assert time.monotonic() - started < 25


@pytest.mark.parametrize("endpoint", [{"/metrics": head_trickle}], indirect=True)
def test_a_metrics_head_that_trickles_is_given_up_and_the_run_goes_on(
    endpoint: Endpoint, tmp_path: Path
) -> None:
    out = tmp_path / "arm.jsonl"
    done = replay(endpoint, out)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(out.read_bytes().splitlines()) == 1
    assert b'"error"' not in out.read_bytes()


@pytest.mark.parametrize(
    "endpoint", [{"/reset_prefix_cache": head_trickle, "/flush_cache": head_trickle}], indirect=True
)
@pytest.mark.timeout(60)
def test_resets_whose_heads_trickle_take_their_deadline_together_then_say_so(
    endpoint: Endpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both reset paths together within RESET_SECONDS (30 s; 2 here), not per read nor per path."""
    from kvlens.experiment import calls

    monkeypatch.setattr(calls, "RESET_SECONDS", 2.0)
    flags = ["--model", "m", "--arm", "a", "--out", str(tmp_path / "a.jsonl"), "--requests", "1", "--reset"]
    started = time.monotonic()
    assert main(["replay", "shared-prefix", "--endpoint", endpoint.url, *flags]) == 2
    assert 2 <= time.monotonic() - started < 10
    assert "cannot empty its prefix cache" in capsys.readouterr().err


def quantization(endpoint: Endpoint, out_dir: Path) -> subprocess.CompletedProcess[str]:
    """Experiment 2 at one rate, two endpoints (both this one), the engine sampled during it."""
    flags = ["--model", "m", "--out-dir", str(out_dir), "--requests", "2", "--rates", "4"]
    flags += ["--concurrency", "1", "--timeout", "5", "--json"]
    endpoints = ["--endpoint", f"a={endpoint.url}", "--endpoint", f"b={endpoint.url}"]
    return subprocess.run(
        [sys.executable, "-c", PEAK, "experiment", "quantization", "shared-prefix", *endpoints, *flags],
        capture_output=True,
        text=True,
        timeout=90,  # a hang check: before, a dripping /metrics held the sampler, and its join, for good
    )


@pytest.mark.parametrize("endpoint", [{"/metrics": bombed}], indirect=True)
def test_a_gzip_bomb_from_metrics_costs_the_sampler_its_cap_not_the_bomb(
    endpoint: Endpoint, tmp_path: Path
) -> None:
    """Before: httpx inflated the 1 MiB answer whole (1 GiB) and parsed it: a 9.3 GiB peak."""
    done = quantization(endpoint, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    steps = json.loads(done.stdout)["rising_load"]["steps"]
    assert [(row["requests"], row["engine_kv_usage_max"]) for row in steps["a"] + steps["b"]] == [
        (2, None)
    ] * 2
    assert int(done.stderr.strip().splitlines()[-1]) < 200  # MiB


@pytest.mark.parametrize("endpoint", [{"/metrics": drip}, {"/metrics": head_trickle}], indirect=True)
def test_a_dripping_metrics_ends_with_its_step(endpoint: Endpoint, tmp_path: Path) -> None:
    """Before: a per-read timeout never fired on a byte a second, and the step joined the
    sampler's thread without a timeout: the run never ended."""
    started = time.monotonic()
    done = quantization(endpoint, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    steps = json.loads(done.stdout)["rising_load"]["steps"]
    assert [(row["requests"], row["engine_kv_usage_max"]) for row in steps["a"] + steps["b"]] == [
        (2, None)
    ] * 2
    assert time.monotonic() - started < 45


def late(sock: socket.socket) -> None:
    """A whole answer, after 6 s of silence: slow, not hostile (a reset of a large cache)."""
    if not threading.Event().wait(6):
        whole(b"{}")(sock)


def not_found(sock: socket.socket) -> None:
    sock.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")


@pytest.mark.parametrize(
    "endpoint", [{"/reset_prefix_cache": late, "/flush_cache": not_found}], indirect=True
)
def test_a_reset_that_answers_late_within_its_deadline_is_taken(
    endpoint: Endpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The deadline is the call's only bound: httpx's own per-read timeout (5 s by default) must
    not end a reset that answers in 6 s of its 30."""
    out = tmp_path / "a.jsonl"
    flags = ["--model", "m", "--arm", "a", "--out", str(out), "--requests", "1", "--reset"]
    assert main(["replay", "shared-prefix", "--endpoint", endpoint.url, *flags]) == 0, capsys.readouterr().err
    assert b'"error"' not in out.read_bytes()
