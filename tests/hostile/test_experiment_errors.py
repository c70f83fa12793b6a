"""Nothing silent: endpoints that fail some or all requests, with error bodies long, hostile or
never ending. Failures are counted per arm and reason, the server's reason kept (bounded and
printable) in the records and the report; a run past --max-error-rate exits 1 after writing its
report, one with nothing answered exits 2."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvlens.cli import main
from tests.json_outputs import validate
from tests.live import start_kvlens

GOOD_STREAM = (
    b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
    b'data: {"choices":[{"index":0,"text":"b"}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":1152,"completion_tokens":2,'
    b'"prompt_tokens_details":{"cached_tokens":0}}}\n\ndata: [DONE]\n\n'
)
HOSTILE_MESSAGE = "context too long:\x1b[31m 4096 > 2048\x00\r\nsecond line\u202e" + "x" * 5000
# What the record keeps of it: control characters and other non-printables dropped, line breaks
# and runs of spaces as one space, at most 200 characters.
KEPT = ("context too long:[31m 4096 > 2048 second line" + "x" * 200)[:200]

Answer = Callable[[BaseHTTPRequestHandler, int], None]


def stream(handler: BaseHTTPRequestHandler, _: int) -> None:
    handler.send_response(200)
    handler.send_header("content-type", "text/event-stream")
    handler.send_header("content-length", str(len(GOOD_STREAM)))
    handler.end_headers()
    handler.wfile.write(GOOD_STREAM)


def status(code: int, body: bytes) -> Answer:
    def answer(handler: BaseHTTPRequestHandler, _: int) -> None:
        handler.send_response(code)
        handler.send_header("content-type", "application/json")
        handler.send_header("content-length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    return answer


def openai_error(code: int, message: str) -> Answer:
    return status(code, json.dumps({"error": {"message": message, "type": "BadRequestError"}}).encode())


class Endpoint:
    """An OpenAI-compatible endpoint serving ``simulated`` whose n-th completion is answered by
    ``answers[n % len(answers)]``."""

    def __init__(self, answers: list[Answer]) -> None:
        count = itertools.count()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = b'{"object":"list","data":[{"id":"simulated","object":"model"}]}'
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path != "/v1/completions":
                    status(404, b"")(self, 0)
                    return
                n = next(count)
                answers[n % len(answers)](self, n)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True

    def __enter__(self) -> str:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def records(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def replay(url: str, out: Path, *flags: str) -> int:
    argv = ["replay", "shared-prefix", "--endpoint", url, "--model", "simulated", "--arm", "a"]
    argv += ["--out", str(out), "--requests", "8", "--traffic-rate", "200", "--max-concurrency", "1"]
    return main([*argv, *flags])


@pytest.mark.timeout(60)
def test_a_replay_past_the_error_rate_exits_1_with_the_servers_reason_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "a.jsonl"
    with Endpoint([stream, stream, stream, openai_error(400, HOSTILE_MESSAGE)]) as url:
        code = replay(url, out)
    assert code == 1
    rows = records(out)
    assert [r.get("error") for r in rows] == [None, None, None, "http_400"] * 2
    assert [r.get("error_message") for r in rows] == [None, None, None, KEPT] * 2
    err = capsys.readouterr().err
    assert (
        "kvlens replay: arm a: 2 of 8 requests failed (25.0 %, more than --max-error-rate 5.0 %): "
        f"http_400 x2 ({KEPT!r})\n"
    ) in err


@pytest.mark.timeout(60)
def test_a_replay_within_the_error_rate_asked_exits_0(tmp_path: Path) -> None:
    with Endpoint([stream, stream, stream, openai_error(400, "no")]) as url:
        assert replay(url, tmp_path / "a.jsonl", "--max-error-rate", "0.25") == 0
        assert replay(url, tmp_path / "b.jsonl", "--max-error-rate", "0.24") == 1


@pytest.mark.timeout(60)
def test_a_replay_with_nothing_answered_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "a.jsonl"
    with Endpoint([openai_error(503, "overloaded"), status(500, b"\xff\xfeplain\x07 text")]) as url:
        assert replay(url, out) == 2
    assert [(r["error"], r["error_message"]) for r in records(out)] == [
        ("http_503", "overloaded"),
        ("http_500", "\ufffd\ufffdplain text"),
    ] * 4
    assert (
        "kvlens replay: arm a: no request was answered (8 of 8 failed: http_503 x4 ('overloaded'), "
        "http_500 x4 ('\ufffd\ufffdplain text'))\n"
    ) in capsys.readouterr().err


def never_ending(handler: BaseHTTPRequestHandler, n: int) -> None:
    """A 500 whose body is announced long and never ends: the request ends as http_500 (with the
    part that came) long before its deadline, and nothing past the bound is kept."""
    handler.send_response(500)
    handler.send_header("content-length", str(10**9))
    handler.end_headers()
    handler.wfile.write(b'{"error": {"message": "' + b"y" * 1000)
    handler.wfile.flush()
    time.sleep(30)  # the server's thread holds the connection open (it is not waited for)


@pytest.mark.timeout(30)
def test_an_error_body_that_never_ends_is_read_to_a_bound(tmp_path: Path) -> None:
    out = tmp_path / "a.jsonl"
    with Endpoint([never_ending]) as url:
        assert replay(url, out, "--requests", "2", "--timeout", "600") == 2
    assert [(r["error"], r["error_message"]) for r in records(out)] == [
        ("http_500", '{"error": {"message": "' + "y" * 177)
    ] * 2


@pytest.fixture
def simulated() -> Iterator[str]:
    running = start_kvlens("simulate", "serve", "--speed", "1000", "--block-size", "16", ready="/health")
    yield running.url
    running.output()


@pytest.mark.timeout(120)
def test_an_arm_past_the_error_rate_exits_1_after_the_report_is_written(
    simulated: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    with Endpoint([stream, stream, stream, openai_error(400, "bad prompt")]) as off:
        code = main(
            [
                "experiment",
                "prefix-cache",
                "shared-prefix",
                "--endpoint",
                simulated,
                "--off-endpoint",
                off,
                "--model",
                "simulated",
                "--out-dir",
                str(runs),
                "--requests",
                "16",
                "--traffic-rate",
                "200",
                "--max-concurrency",
                "1",
                "--prefix-tokens",  # one prompt length, the one the stand-in off endpoint answers
                "1024",
            ]
        )
    assert code == 1
    report = json.loads((runs / "report.json").read_text())
    validate(report)
    assert report["errors"] == {
        "off": {
            "requests": 8,
            "failed": 2,
            "reasons": {"http_400": {"requests": 2, "message": "bad prompt"}},
        },
        "cold": {"requests": 8, "failed": 0, "reasons": {}},
        "warm": {"requests": 8, "failed": 0, "reasons": {}},
    }
    # the requests that failed in one arm are compared in none
    assert report["requests"] == 6
    markdown = (runs / "report.md").read_text()
    assert "- off: 2 of 8 requests failed: http_400 x2 ('bad prompt')\n" in markdown
    assert "- cold: 0 of 8 requests failed\n" in markdown
    assert (
        "<li>off: 2 of 8 requests failed: http_400 x2 (&#x27;bad prompt&#x27;)</li>"
        in (runs / "report.html").read_text()
    )
    err = capsys.readouterr().err
    assert (
        "kvlens experiment: arm off: 2 of 8 requests failed (25.0 %, more than --max-error-rate 5.0 %): "
        "http_400 x2 ('bad prompt')\n"
    ) in err


def test_compare_of_fewer_than_two_arms_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arm = tmp_path / "a.jsonl"
    arm.write_text(
        '{"request_id": "trace-0", "prompt_tokens": 10, "cached_tokens": 0, "ttft_seconds": 0.1}\n'
    )
    assert main(["compare", "--arm", f"a={arm}"]) == 2
    assert capsys.readouterr().err == (
        "kvlens compare: compare needs two arms or more (--arm NAME=FILE, the first the baseline); 1 given\n"
    )
