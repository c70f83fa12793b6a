"""``kvlens replay`` (a real process) against an endpoint that misbehaves one request at a time:
endless streams, a line that never ends, compressed and bombed answers, usage numbers that
cannot be, error bodies that never end, redirects away, and silence. Each request is recorded
with the reason it failed, the run goes on to the next, and the records file stays valid."""

from __future__ import annotations

import itertools
import json
import socket
import subprocess
import sys
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvlens.cli import main
from kvlens.experiment.client import MAX_LINE_BYTES

pytestmark = pytest.mark.integration
MIB = 1024 * 1024
TOKEN = b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'


def usage(prompt: object, cached: object) -> bytes:
    details = {
        "prompt_tokens": prompt,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    return b"data: " + json.dumps({"choices": [], "usage": details}).encode() + b"\n\n"


def good(cached: object = 16, prompt: object = 1152) -> bytes:
    return TOKEN + TOKEN + usage(prompt, cached) + b"data: [DONE]\n\n"


def odd(chunk: bytes) -> bytes:
    """A stream with one chunk of a shape the client does not expect after its first token."""
    return TOKEN + b"data: " + chunk + b"\n\n" + TOKEN + b"data: [DONE]\n\n"


SSE = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"


def head(extra: bytes = b"", length: int | None = None) -> bytes:
    framing = b"connection: close\r\n" if length is None else b"content-length: %d\r\n" % length
    return SSE + extra + framing + b"\r\n"


def forever(sock: socket.socket, piece: bytes, first: bytes = b"") -> int:
    """Send ``first`` then ``piece`` until the client hangs up; bytes sent."""
    sent = 0
    try:
        sock.sendall(first)
        while True:
            sock.sendall(piece)
            sent += len(piece)
    except OSError:
        return sent


def whole(answer: bytes) -> Callable[[socket.socket], int]:
    def send(sock: socket.socket) -> int:
        sock.sendall(answer)
        return len(answer)

    return send


def silent(sock: socket.socket) -> int:
    sock.recv(1)  # until the client gives up and closes
    return 0


def bomb(mebibytes: int) -> bytes:
    """gzip of ``mebibytes`` MiB of zeros (about a KiB a MiB), made a MiB at a time."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: the gzip container
    zeros = bytes(MIB)
    return b"".join(packer.compress(zeros) for _ in range(mebibytes)) + packer.flush()


BOMB = bomb(64)  # 64 KiB that inflate to 64 MiB
SCENARIOS: list[tuple[str | None, Callable[[socket.socket], int]]] = [
    (None, whole(head(length=len(good())) + good())),
    ("too_many_tokens", lambda s: forever(s, TOKEN, head())),  # an endless stream of tokens
    ("timeout", lambda s: forever(s, b": keep-alive\n\n", head())),  # an endless stream of nothing
    ("line_too_long", lambda s: forever(s, b"a" * 65536, head() + b"data: ")),  # one endless line
    ("content_encoding", whole(head(b"content-encoding: gzip\r\n", len(BOMB)) + BOMB)),
    ("content_encoding", whole(head(b"content-encoding: gzip\r\n", 12) + b"not gzip at all")),
    ("content_encoding", whole(head(b"content-encoding: deflate\r\n", 11) + zlib.compress(b"x")[:11])),
    ("invalid_usage", whole(head(length=len(good(-5))) + good(-5))),
    ("invalid_usage", whole(head(length=len(good(2000))) + good(2000))),  # cached > prompt
    ("malformed_stream", whole(head(length=len(good(True))) + good(True))),  # a boolean is no count
    ("malformed_stream", whole(head(length=len(odd(b'{"choices":5}'))) + odd(b'{"choices":5}'))),
    ("malformed_stream", whole(head(length=len(odd(b'{"choices":[7]}'))) + odd(b'{"choices":[7]}'))),
    ("malformed_stream", whole(head(length=len(odd(b'{"usage":"7"}'))) + odd(b'{"usage":"7"}'))),
    ("invalid_usage", whole(head(length=len(good(16, 2**63))) + good(16, 2**63))),
    ("http_500", lambda s: forever(s, b"x" * 65536, b"HTTP/1.1 500 Oops\r\nconnection: close\r\n\r\n")),
    (
        "http_307",
        whole(b"HTTP/1.1 307 Away\r\nlocation: http://192.0.2.1/v1/completions\r\ncontent-length: 0\r\n\r\n"),
    ),
    ("timeout", silent),  # never answers its head
    (None, whole(head(length=len(good())) + good())),
]
MODELS = b'{"object":"list","data":[{"id":"m","object":"model"}]}'


class Hostile:
    """One misbehaviour per POST, in the order of SCENARIOS; the bytes each one managed to send."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.sent: dict[int, int] = {}
        self.count = itertools.count()
        self.threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}"

    def serve(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self.answer, args=(sock,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def answer(self, sock: socket.socket) -> None:
        with sock:
            data = b""
            while b"\r\n\r\n" not in data:
                more = sock.recv(65536)
                if not more:
                    return
                data += more
            head_bytes, _, body = data.partition(b"\r\n\r\n")
            lines = head_bytes.decode("latin-1").split("\r\n")
            length = next((int(h.split(":")[1]) for h in lines if h.lower().startswith("content-length:")), 0)
            while len(body) < length:
                body += sock.recv(65536)
            if not lines[0].startswith("POST /v1/completions"):
                sock.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(MODELS)
                )
                sock.sendall(MODELS)
                return
            number = next(self.count)
            self.sent[number] = SCENARIOS[number % len(SCENARIOS)][1](sock)

    def __enter__(self) -> Hostile:
        threading.Thread(target=self.serve, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.listener.close()


@pytest.fixture
def hostile() -> Iterator[Hostile]:
    with Hostile() as server:
        yield server


def test_each_misbehaving_answer_is_one_error_record_and_the_run_goes_on(
    hostile: Hostile, tmp_path: Path
) -> None:
    out = tmp_path / "arm.jsonl"
    flags = ["--model", "m", "--arm", "a", "--out", str(out), "--requests", str(len(SCENARIOS))]
    replay = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvlens.cli",
            "replay",
            "shared-prefix",
            "--endpoint",
            hostile.url,
            *flags,
            "--traffic-rate",
            "1000",
            "--max-concurrency",
            "1",
            "--timeout",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,  # a hang check: before the fixes an endless stream held the run forever
    )
    assert replay.returncode == 1, replay.stderr[-3000:]  # most failed: past --max-error-rate
    assert "Traceback" not in replay.stderr
    rows = [json.loads(line) for line in out.read_bytes().splitlines()]
    assert [row.get("error") for row in rows] == [reason for reason, _ in SCENARIOS]
    assert [row["cached_tokens"] for row in rows if "error" not in row] == [16, 16]
    for row in rows:
        assert ("ttft_seconds" in row) == ("error" not in row)
    # the client hung up once it knew: no endless answer was read far past the line cap
    for number, (reason, _) in enumerate(SCENARIOS):
        if reason in ("too_many_tokens", "line_too_long", "http_500"):
            assert hostile.sent[number] < MAX_LINE_BYTES + 16 * MIB, (reason, hostile.sent[number])


@pytest.mark.parametrize("seconds", ["nan", "0", "-1"])
def test_a_timeout_that_is_no_duration_is_refused_before_any_request(
    hostile: Hostile, tmp_path: Path, seconds: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # --timeout nan went to asyncio as a deadline: "ValueError: deadline must not be NaN" out of
    # the run, a traceback and exit 1; 0 and -1 failed every request as a timeout.
    out = tmp_path / "arm.jsonl"
    flags = ["--model", "m", "--arm", "a", "--out", str(out), "--requests", "2", "--timeout", seconds]
    assert main(["replay", "shared-prefix", "--endpoint", hostile.url, *flags]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"kvlens: --timeout must be a positive number of seconds, not {seconds}"
    )
    assert hostile.sent == {}
