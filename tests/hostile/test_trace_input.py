"""Trace input of ``kvlens simulate``, ``replay`` and ``experiment``, attacked: a trace with no
newline (a link to /dev/zero), a small gzip holding one endless line, a line asking more tokens
than any model takes or than the endpoint's ``max_model_len``, and a timestamp ages ahead. Each
is refused with an error naming the line (or the request) before memory grows or a replay waits
for good; each ran a real process that grew to gigabytes or never ended before."""

from __future__ import annotations

import gzip
import itertools
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvlens.cli import main
from kvlens.sources.jsonlines import MAX_LINE_BYTES
from tests.live import run_measured

pytestmark = pytest.mark.integration
MIB = 1024 * 1024
LINE = {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [0]}
TOO_LONG = f"line 1: longer than {MAX_LINE_BYTES:,} bytes: not read"
STREAM = (
    b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":600,"completion_tokens":1,'
    b'"prompt_tokens_details":{"cached_tokens":0}}}\n\ndata: [DONE]\n\n'
)


class _Endpoint(BaseHTTPRequestHandler):
    """/v1/models naming model ``m`` (with ``max_model_len`` when set), nothing at /metrics, and a
    good stream for each completion, counted."""

    max_model_len: int | None
    posts: itertools.count[int]

    def do_GET(self) -> None:
        card: dict[str, object] = {"id": "m", "object": "model"}
        if self.max_model_len is not None:
            card["max_model_len"] = self.max_model_len
        body = json.dumps({"object": "list", "data": [card]}).encode() if self.path == "/v1/models" else b""
        self.send_response(200 if body else 404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        next(self.posts)
        status = 200 if self.path == "/v1/completions" else 404
        self.send_response(status)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(STREAM) if status == 200 else 0))
        self.end_headers()
        self.wfile.write(STREAM if status == 200 else b"")

    def log_message(self, *args: object) -> None:
        pass


class Endpoint:
    def __init__(self, max_model_len: int | None) -> None:
        self.posts = itertools.count()
        handler = type("Handler", (_Endpoint,), {"max_model_len": max_model_len, "posts": self.posts})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def sent(self) -> int:
        """Completions received so far (reading it counts one more: read it once)."""
        return next(self.posts)


@pytest.fixture
def endpoint(request: pytest.FixtureRequest) -> Iterator[Endpoint]:
    server = Endpoint(getattr(request, "param", 32_768))
    threading.Thread(target=server.server.serve_forever, daemon=True).start()
    yield server
    server.server.shutdown()
    server.server.server_close()


def replay_args(trace: str, url: str, out: Path) -> list[str]:
    return ["replay", trace, "--endpoint", url, "--model", "m", "--arm", "a", "--out", str(out)]


def write(path: Path, *lines: dict[str, object]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def one_endless_line_gzip(path: Path, mebibytes: int) -> Path:
    """A gzip of about a KiB a MiB holding one line of ``mebibytes`` MiB that never ends: one
    gzip member a MiB (a reader takes the members as one stream)."""
    member = gzip.compress(b"x" * MIB, 9)
    path.write_bytes(gzip.compress(b'{"timestamp": 0, "pad": "') + member * mebibytes)
    return path


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["simulate", "replay"])
def test_a_trace_without_a_newline_is_refused_at_the_line_limit(
    command: str, endpoint: Endpoint, tmp_path: Path
) -> None:
    """Before: /dev/zero was read as one line until the process ran out (3 GiB in 3 s; here the
    1 GiB address space ends it in a MemoryError)."""
    args = (
        ["simulate", "/dev/zero"]
        if command == "simulate"
        else replay_args("/dev/zero", endpoint.url, tmp_path / "a.jsonl")
    )
    done = run_measured(*args)
    assert (done.returncode, done.stderr.splitlines()[-1]) == (2, f"kvlens: /dev/zero {TOO_LONG}")
    assert done.peak_mib < 256, done.peak_mib
    assert endpoint.sent == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["simulate", "replay"])
def test_a_small_gzip_of_one_endless_line_is_refused_at_the_line_limit(
    command: str, endpoint: Endpoint, tmp_path: Path
) -> None:
    """Before: a 1 MB gzip holding a 1 GiB line peaked at 2.2 GiB."""
    trace = str(one_endless_line_gzip(tmp_path / "bomb.jsonl.gz", 1024))
    args = (
        ["simulate", trace]
        if command == "simulate"
        else replay_args(trace, endpoint.url, tmp_path / "a.jsonl")
    )
    done = run_measured(*args)
    assert (done.returncode, done.stderr.splitlines()[-1]) == (2, f"kvlens: {trace} {TOO_LONG}")
    assert done.peak_mib < 256, done.peak_mib


@pytest.mark.timeout(120)
def test_a_line_asking_more_tokens_than_any_model_takes_is_refused_before_prompts(
    endpoint: Endpoint, tmp_path: Path
) -> None:
    """Before: one Mooncake line asking 100M input tokens had its prompt built (3.1 GiB; here a
    MemoryError in the 1 GiB address space) and sent, to be refused by the endpoint."""
    tokens = 100_000_000
    trace = write(
        tmp_path / "long.jsonl",
        LINE,
        {"timestamp": 1, "input_length": tokens, "output_length": 1, "hash_ids": list(range(tokens // 512))},
    )
    done = run_measured(*replay_args(str(trace), endpoint.url, tmp_path / "a.jsonl"))
    assert (done.returncode, done.stderr.splitlines()[-1]) == (
        2,
        f"kvlens: {trace} line 2: input_length must be an integer between 1 and 10,000,000",
    )
    assert done.peak_mib < 256, done.peak_mib
    assert endpoint.sent == 0


def test_a_request_longer_than_the_endpoints_max_model_len_is_refused_before_any_is_sent(
    endpoint: Endpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: the endpoint's max_model_len was not read; the prompt was built and sent."""
    trace = write(
        tmp_path / "t.jsonl",
        LINE,
        {"timestamp": 1, "input_length": 40_000, "output_length": 1, "hash_ids": list(range(78))},
        {"timestamp": 2, "input_length": 32_768, "output_length": 1, "hash_ids": list(range(64))},
    )
    assert main(replay_args(str(trace), endpoint.url, tmp_path / "a.jsonl")) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"kvlens: {endpoint.url} serves model 'm' with max_model_len 32,768: 2 requests of the trace "
        "leave no room for it to generate a token (the first: trace_index 1, 40,000 prompt tokens); "
        "nothing was sent"
    )
    assert endpoint.sent == 0


@pytest.mark.parametrize("endpoint", [None], indirect=True)
def test_an_endpoint_that_does_not_say_its_max_model_len_gets_what_the_trace_asks(
    endpoint: Endpoint, tmp_path: Path
) -> None:
    trace = write(
        tmp_path / "t.jsonl",
        LINE,
        {"timestamp": 1, "input_length": 40_000, "output_length": 1, "hash_ids": list(range(78))},
    )
    assert main(replay_args(str(trace), endpoint.url, tmp_path / "a.jsonl")) == 0
    assert endpoint.sent == 2


@pytest.mark.timeout(60)
def test_a_timestamp_ages_ahead_is_refused_not_waited_for(endpoint: Endpoint, tmp_path: Path) -> None:
    """Before: the replay sent the first request and then waited 31,700 years, saying nothing
    (here: subprocess.TimeoutExpired)."""
    trace = write(tmp_path / "t.jsonl", LINE, {**LINE, "timestamp": 10**15})
    done = run_measured(*replay_args(str(trace), endpoint.url, tmp_path / "a.jsonl"), timeout=30)
    assert (done.returncode, done.stderr.splitlines()[-1]) == (
        2,
        f"kvlens: {trace} line 2: timestamp is 1,000,000,000,000 s after the request before it; a gap "
        "over 86,400 s (a day) is refused: a replay would wait that long for its next request (a "
        "timestamp in the wrong unit, or out of place?)",
    )
    assert endpoint.sent == 0


def test_the_quantization_experiment_refuses_what_an_endpoint_cannot_take(
    endpoint: Endpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write(
        tmp_path / "t.jsonl",
        LINE,
        {"timestamp": 1, "input_length": 40_000, "output_length": 1, "hash_ids": list(range(78))},
    )
    flags = ["--model", "m", "--out-dir", str(tmp_path / "quant")]
    assert main(["experiment", "quantization", str(trace), "--endpoint", f"a={endpoint.url}",
                 "--endpoint", f"b={endpoint.url}", *flags]) == 2  # fmt: skip
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"kvlens: {endpoint.url} serves model 'm' with max_model_len 32,768: 1 request of the trace "
        "leaves no room for it to generate a token (the first: trace_index 1, 40,000 prompt tokens); "
        "nothing was sent"
    )
    assert endpoint.sent == 0


@pytest.mark.timeout(120)
def test_built_in_traffic_longer_than_any_model_takes_is_refused_before_it_is_built(
    endpoint: Endpoint, tmp_path: Path
) -> None:
    """Before: two requests of 100M tokens held 6.25M block keys each (a MemoryError in the
    1 GiB address space)."""
    args = replay_args("shared-prefix", endpoint.url, tmp_path / "a.jsonl")
    done = run_measured(*args, "--prefix-tokens", "100000000", "--requests", "2")
    assert (done.returncode, done.stderr.splitlines()[-1]) == (
        2,
        "kvlens: shared-prefix traffic takes prompts of 10,000,000 tokens at most",
    )
    assert done.peak_mib < 256, done.peak_mib
    assert endpoint.sent == 0
