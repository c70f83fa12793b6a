"""``kvlens replay`` (a real process) against an endpoint whose answers to the runner's checks
(``/v1/models``, ``/metrics``, the cache reset) misbehave: a trickle that never ends, or an
endless body at full speed. Each check is bounded as a whole (time and bytes), so the run either
says the endpoint does not answer, or goes on without what the check would have told."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

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
        f"kvlens: {endpoint.url} does not answer (ReadTimeout: no whole answer within 10 s)"
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
