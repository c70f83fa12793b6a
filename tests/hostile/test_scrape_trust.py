"""Issue 15, defects 1 and 4: an engine's /metrics answer must not be able to kill the pod, and a
scrape URL's credentials must not leak.

Requirement: the scrape size cap applies to inflated bytes as they are produced (RSS growth under
50 MiB for a 1 GiB gzip bomb, and for a 100 MB label line, compressed or not); a target is named
without its userinfo or query, in labels and in every log line; credentials can come from a file.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import itertools
import threading
import zlib
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.hostile.conftest import Serve

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
HELP = (
    "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
    "# TYPE vllm:prompt_tokens_total counter\n"
)
LABEL_LINE = b'vllm:prompt_tokens_total{model_name="' + b"x" * (100 * 1000 * 1000) + b'"} 1\n'


def gzipped(chunks: Iterator[bytes]) -> bytes:
    packer = zlib.compressobj(9, wbits=31)
    return b"".join(packer.compress(chunk) for chunk in chunks) + packer.flush()


@functools.cache
def gzip_bomb() -> bytes:
    """1 GiB of comment lines (an exposition may carry any number) in about 1 MiB of gzip."""
    lines = b"# padding\n" * (MIB // 10) + b"# pad\n" * 4  # exactly 1 MiB per piece
    return gzipped(iter([HELP.encode(), *[lines] * 1024]))


@functools.cache
def gzip_bomb_twice() -> bytes:
    """The same bomb in a few KiB: ``Content-Encoding: gzip, gzip`` (httpx undoes each layer)."""
    return gzipped(iter([gzip_bomb()]))


@functools.cache
def gzip_label_line() -> bytes:
    return gzipped(iter([HELP.encode(), LABEL_LINE]))


class Upstream:
    """An engine /metrics on loopback answering the same bytes and headers to every scrape,
    once :attr:`gate` is set (so the test can reset its memory watermark before the first)."""

    def __init__(self, body: Callable[[], bytes], headers: dict[str, str]) -> None:
        self.gate = threading.Event()
        self.requests: list[dict[str, str]] = []  # each scrape's request headers, lower-cased
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                upstream.gate.wait(30)
                upstream.requests.append({k.lower(): v for k, v in self.headers.items()})
                upstream.requests[-1][":path"] = self.path
                payload = body()
                self.send_response(200)
                self.send_header("content-type", "text/plain; version=0.0.4")
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                with contextlib.suppress(OSError):  # the sidecar hung up past its cap
                    self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/metrics"

    def close(self) -> None:
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def upstream() -> Iterator[Callable[..., Upstream]]:
    made: list[Upstream] = []

    def make(body: Callable[[], bytes], **headers: str) -> Upstream:
        made.append(Upstream(body, headers))
        return made[-1]

    yield make
    for server in made:
        server.close()


BOMBS = {  # the answer, its headers, and the reason its scrape fails for
    "1 GiB gzip bomb": (gzip_bomb, {"content-encoding": "gzip"}, "too_large"),
    # only one layer is undone (gzip was asked for): the second is refused before any inflating
    "1 GiB gzip bomb, gzipped twice": (gzip_bomb_twice, {"content-encoding": "gzip, gzip"}, "parse"),
    "100 MB label line, gzip": (gzip_label_line, {"content-encoding": "gzip"}, "too_large"),
    "100 MB label line": (lambda: HELP.encode() + LABEL_LINE, {}, "too_large"),
    # under scrape_max_bytes, but the parser would hold about 8 times it (and take 16 s)
    "15 MiB label line": (lambda: HELP.encode() + LABEL_LINE[: 15 * MIB] + b'"} 1\n', {}, "too_large"),
}


@pytest.mark.parametrize("name", BOMBS)
def test_an_oversized_answer_is_refused_with_flat_memory(
    serve: Serve, upstream: Callable[..., Upstream], name: str
) -> None:
    body, headers, reason = BOMBS[name]
    body()  # built before the watermark is reset
    engine = upstream(body, **headers)
    sidecar = serve("--scrape", engine.url, KVLENS_SCRAPE_INTERVAL_SECONDS="3600")
    memory = sidecar.memory()
    memory.reset()
    engine.gate.set()
    assert sidecar.wait_for("kvlens_upstream_scrape_errors_total", 1, timeout=60) == 1
    growth = memory.peak_growth_mib()
    assert sidecar.value("kvlens_upstream_scrape_errors_total", reason=reason) == 1
    assert sidecar.value("kvlens_upstream_up") == 0
    assert growth < 50, f"peak RSS grew {growth:.0f} MiB"
    assert engine.requests[0].get("accept-encoding") == "gzip"  # compression stays on the wire


REPEATED_BOMBS = 6


def test_repeated_bombs_leave_resident_memory_flat(serve: Serve, upstream: Callable[..., Upstream]) -> None:
    """Each refused bomb frees its 16 MiB, and the process must give it back: glibc otherwise keeps
    it in the inflating thread's arena (after the first, its mmap threshold rises past 16 MiB), and
    a soak with one bomb every 30 s grew 58 MiB in 10 minutes."""
    small = (HELP + 'vllm:prompt_tokens_total{model_name="m"} 7\n').encode()
    bombs_may_start, measured = threading.Event(), threading.Event()
    answered = itertools.count()

    def answer() -> bytes:  # one exposition; the bombs once the baseline is taken; one more; hold
        number = next(answered)
        if number == 1:
            bombs_may_start.wait(30)
        elif number == REPEATED_BOMBS + 2:
            measured.wait(30)  # no scrape runs while the memory is read
        return gzip_bomb() if 1 <= number <= REPEATED_BOMBS else gzipped(iter([small]))

    gzip_bomb()  # built before the baseline
    engine = upstream(answer, **{"content-encoding": "gzip"})
    engine.gate.set()
    sidecar = serve(
        "--scrape",
        engine.url,
        KVLENS_SCRAPE_INTERVAL_SECONDS="0.05",
        KVLENS_SCRAPE_TIMEOUT_SECONDS="60",
    )
    try:
        assert sidecar.wait_for("kvlens_upstream_scrapes_total", 1) == 1
        before = sidecar.memory().rss_mib()
        bombs_may_start.set()
        assert sidecar.wait_for("kvlens_upstream_scrapes_total", 2, timeout=120) == 2  # bombs over
        growth = sidecar.memory().rss_mib() - before
    finally:
        bombs_may_start.set()
        measured.set()
    assert sidecar.value("kvlens_upstream_scrape_errors_total", reason="too_large") == REPEATED_BOMBS
    assert growth < 8, f"RSS grew {growth:.1f} MiB over {REPEATED_BOMBS} refused bombs"


def test_a_gzip_exposition_within_the_cap_is_read(serve: Serve, upstream: Callable[..., Upstream]) -> None:
    text = HELP + "".join(f'vllm:prompt_tokens_total{{model_name="m{i}"}} {i}\n' for i in range(5))
    engine = upstream(lambda: gzipped(iter([text.encode()])), **{"content-encoding": "gzip"})
    engine.gate.set()
    sidecar = serve("--scrape", engine.url, KVLENS_SCRAPE_INTERVAL_SECONDS="3600")
    assert sidecar.wait_for("kvlens_upstream_scrapes_total", 1) == 1
    assert sidecar.value("kvlens_upstream_up") == 1
    assert sidecar.value("kvlens_upstream_scrape_errors_total") == 0


def test_a_refused_encoding_is_a_parse_error(serve: Serve, upstream: Callable[..., Upstream]) -> None:
    engine = upstream(lambda: b"\x00" * 64, **{"content-encoding": "br"})
    engine.gate.set()
    sidecar = serve("--scrape", engine.url, KVLENS_SCRAPE_INTERVAL_SECONDS="3600")
    assert sidecar.wait_for("kvlens_upstream_scrape_errors_total", 1) == 1
    assert sidecar.value("kvlens_upstream_scrape_errors_total", reason="parse") == 1


SECRET = "pa55-in-url"
QUERY_SECRET = "query-t0ken"


def test_url_credentials_never_reach_labels_or_logs(serve: Serve, upstream: Callable[..., Upstream]) -> None:
    engine = upstream(lambda: (HELP + 'vllm:prompt_tokens_total{model_name="m"} 7\n').encode())
    engine.gate.set()
    url = f"http://scraper:{SECRET}@127.0.0.1:{engine.port}/metrics?token={QUERY_SECRET}"
    sidecar = serve("--scrape", url, KVLENS_SCRAPE_INTERVAL_SECONDS="0.05", KVLENS_LOG_LEVEL="DEBUG")
    assert sidecar.wait_for("kvlens_upstream_scrapes_total", 3) >= 3
    page = httpx.get(f"{sidecar.url}/metrics").text
    targets = {
        dict(labels)["target"] for (name, labels), _ in sidecar.samples().items() if "upstream" in name
    }
    assert targets == {f"127.0.0.1:{engine.port}"}
    assert SECRET not in page and QUERY_SECRET not in page
    # the credentials and the query still go to the engine, as given
    assert (
        engine.requests[0]["authorization"]
        == "Basic " + base64.b64encode(f"scraper:{SECRET}".encode()).decode()
    )
    assert engine.requests[0][":path"] == f"/metrics?token={QUERY_SECRET}"
    log = sidecar.output()
    assert SECRET not in log and QUERY_SECRET not in log


def test_a_failing_target_is_logged_without_its_credentials(serve: Serve) -> None:
    url = f"http://scraper:{SECRET}@127.0.0.1:9/metrics?token={QUERY_SECRET}"  # nothing listens
    sidecar = serve("--scrape", url, KVLENS_SCRAPE_INTERVAL_SECONDS="0.05", KVLENS_LOG_LEVEL="DEBUG")
    assert sidecar.wait_for("kvlens_upstream_scrape_errors_total", 3, reason="connect") >= 3
    log = sidecar.output()
    assert "scrape of 127.0.0.1:9 failed" in log
    assert SECRET not in log and QUERY_SECRET not in log


def test_the_password_can_come_from_a_file(
    serve: Serve, upstream: Callable[..., Upstream], tmp_path: Path
) -> None:
    engine = upstream(lambda: (HELP + 'vllm:prompt_tokens_total{model_name="m"} 7\n').encode())
    engine.gate.set()
    password = tmp_path / "password"
    password.write_text("from-a-file\n")  # a trailing newline, as `echo` and most secrets leave
    sidecar = serve(
        "--scrape",
        engine.url,
        "--scrape-username",
        "scraper",
        "--scrape-password-file",
        str(password),
        KVLENS_SCRAPE_INTERVAL_SECONDS="3600",
    )
    assert sidecar.wait_for("kvlens_upstream_scrapes_total", 1) == 1
    expected = "Basic " + base64.b64encode(b"scraper:from-a-file").decode()
    assert engine.requests[0]["authorization"] == expected


def test_a_rotated_or_removed_password_file_is_followed(
    serve: Serve, upstream: Callable[..., Upstream], tmp_path: Path
) -> None:
    engine = upstream(lambda: (HELP + 'vllm:prompt_tokens_total{model_name="m"} 7\n').encode())
    engine.gate.set()
    password = tmp_path / "password"
    password.write_text("first")
    sidecar = serve(
        "--scrape",
        engine.url,
        "--scrape-username",
        "scraper",
        "--scrape-password-file",
        str(password),
        KVLENS_SCRAPE_INTERVAL_SECONDS="0.05",
    )
    assert sidecar.wait_for("kvlens_upstream_scrapes_total", 1) >= 1
    password.write_text("s3cond-secret\n")
    scraped = sidecar.value("kvlens_upstream_scrapes_total")
    assert sidecar.wait_for("kvlens_upstream_scrapes_total", scraped + 2) >= scraped + 2
    rotated = "Basic " + base64.b64encode(b"scraper:s3cond-secret").decode()
    assert engine.requests[-1]["authorization"] == rotated  # re-read, no restart
    password.unlink()
    assert sidecar.wait_for("kvlens_upstream_scrape_errors_total", 2, reason="connect") >= 2
    assert sidecar.value("kvlens_upstream_up") == 0
    log = sidecar.output()
    assert "scrape of 127.0.0.1" in log and "password file: No such file" in log
    assert "s3cond-secret" not in log
