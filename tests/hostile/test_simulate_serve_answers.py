"""``kvlens simulate serve`` against clients that ask for much and read nothing: every request's
work and answer are bounded, the heavy work runs off the event loop a few at a time, and an answer
nobody reads is dropped at the write deadline (``write_timeout_seconds``).

Before: six unread 8 MiB ``/tokenize`` answers held +142 MiB and three unread batch completions
+190 MiB, for good; ``/tokenize`` took any text the 16 MiB body held (48 MB answers);
``/detokenize`` of 2.8M ids from two clients took ``/health`` p99 to 1,276 ms; an 8M-id prompt
held the loop 0.78 s before it was refused."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from kvlens.simulate.serve.api import MAX_TOKENIZE_BODY_BYTES, WORK_AT_ONCE
from kvlens.simulate.serve.requests import MAX_TOKEN_IDS
from tests.live import Running, start_kvlens, until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
WRITE_TIMEOUT = 1.0
# 9 bytes of answer per id ("<|31999|>"): about 9.4 MB, far past any socket buffer
LARGE_DETOKENIZE = orjson.dumps({"tokens": [31_999] * MAX_TOKEN_IDS})


# Long enough that the unread answers surely hold their slots while the test looks (on a busy
# 2-core CI machine the slots were freed at a 1 s deadline before the first look came)
HOLDING_WRITE_TIMEOUT = 10.0


def simulated(write_timeout: float) -> Running:
    env = {"KVLENS_WRITE_TIMEOUT_SECONDS": str(write_timeout)}
    return start_kvlens("simulate", "serve", "--speed", "1000", env=env, ready="/health")


@pytest.fixture
def server() -> Iterator[Running]:
    running = simulated(WRITE_TIMEOUT)
    yield running
    running.output()


@pytest.fixture
def holding_server() -> Iterator[Running]:
    running = simulated(HOLDING_WRITE_TIMEOUT)
    yield running
    running.output()


def unread(running: Running, path: str, body: bytes) -> socket.socket:
    """A request whose answer is never read (a 4 KiB receive buffer)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", running.port))
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def read_all(sock: socket.socket) -> bytes:
    """What the server sent until it closed the connection (or reset it)."""
    sock.settimeout(30)
    out = bytearray()
    try:
        while more := sock.recv(1 << 20):
            out += more
    except ConnectionResetError:
        pass
    return bytes(out)


@pytest.mark.parametrize(
    ("path", "body", "size"),
    [
        ("/detokenize", LARGE_DETOKENIZE, 9 * MAX_TOKEN_IDS),
        # 1,024 prompts of 8,000 tokens: an 8 MB answer once they finish (speed 1000: at once)
        ("/v1/completions", orjson.dumps({"prompt": [[1]] * 1024, "max_tokens": 8000}), 8000 * 1024),
    ],
)
def test_an_answer_nobody_reads_is_dropped_at_the_write_deadline(
    server: Running, path: str, body: bytes, size: int
) -> None:
    """The client sends its request and reads nothing for 3 write deadlines: the server drops the
    answer and closes; what the client then finds is a socket buffer's worth, not the answer.
    Before: the whole answer waited in the server for good (the client got all of it)."""
    sock = unread(server, path, body)
    try:
        if path == "/v1/completions":
            assert server.wait_for("vllm:request_success_total", 1024, timeout=60) == 1024
        # the deadline runs in the server's own process and clock: nothing here to wait on but time
        time.sleep(3 * WRITE_TIMEOUT)
        received = read_all(sock)
    finally:
        sock.close()
    assert received.startswith(b"HTTP/1.1 200 ")
    assert len(received) < size // 2, len(received)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_tokenize_and_detokenize_beyond_their_limits_are_refused_400_naming_them(server: Running) -> None:
    url = server.url
    answer = httpx.post(f"{url}/tokenize", json={"prompt": "a" * MAX_TOKEN_IDS}, timeout=30)
    assert answer.status_code == 200 and answer.json()["count"] == MAX_TOKEN_IDS
    answer = httpx.post(f"{url}/tokenize", json={"prompt": "a" * (MAX_TOKEN_IDS + 1)}, timeout=30)
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == (
        f"/tokenize takes a text of at most {MAX_TOKEN_IDS} tokens; this one has {MAX_TOKEN_IDS + 1}"
    )
    assert answer.json()["error"]["param"] == "prompt"
    chat = {"messages": [{"role": "user", "content": "a" * MAX_TOKEN_IDS}]}
    answer = httpx.post(f"{url}/tokenize", json=chat, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"
    answer = httpx.post(f"{url}/detokenize", json={"tokens": [65] * (MAX_TOKEN_IDS + 1)}, timeout=30)
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == (
        f"/detokenize takes at most {MAX_TOKEN_IDS} token ids; this request has {MAX_TOKEN_IDS + 1}"
    )
    answer = httpx.post(f"{url}/detokenize", json={"tokens": [65] * 3}, timeout=30)
    assert answer.json() == {"prompt": "AAA"}


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_a_tokenize_body_past_its_cap_is_refused_from_its_length_before_it_arrives(
    server: Running, path: str
) -> None:
    """A head announcing one byte more than the cap, and no body: 413 at once. Before: the cap
    was the 16 MiB of every route, and the request waited for its body."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {MAX_TOKENIZE_BODY_BYTES + 1}\r\n\r\n".encode()
        )
        head = b""
        while b'"code":' not in head and (more := sock.recv(4096)):  # head and body may come apart
            head += more
    assert head.startswith(b"HTTP/1.1 413 "), head
    assert f"larger than {MAX_TOKENIZE_BODY_BYTES} bytes".encode() in head


def test_a_token_id_prompt_past_the_context_is_refused_from_its_length_before_its_ids_are_read(
    server: Running,
) -> None:
    """Its last id is out of vocabulary: the answer names the context, so the ids were not walked.
    Before: every id was checked first (0.78 s of the loop for 8M ids), then the length."""
    prompt = [1] * 40_000 + [-1]
    answer = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=30)
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert message.startswith("This model's maximum context length is 32768 tokens."), message


def test_heavy_requests_at_work_are_bounded_and_the_rest_refused_503(holding_server: Running) -> None:
    """WORK_AT_ONCE unread 9.4 MB answers hold every slot until their write deadline: one
    more /detokenize is refused 503 with Retry-After (small ones included; /health still
    answers), and once the deadline dropped them it is served. Before: any number were worked on
    at once, on the event loop."""
    holders = [unread(holding_server, "/detokenize", LARGE_DETOKENIZE) for _ in range(WORK_AT_ONCE)]
    try:
        for sock in holders:  # each admitted and answering before anything else asks for a slot
            sock.settimeout(30)
            assert sock.recv(12, socket.MSG_PEEK) == b"HTTP/1.1 200"

        def refused() -> bool:
            answer = httpx.post(f"{holding_server.url}/detokenize", json={"tokens": [65]}, timeout=30)
            return answer.status_code == 503 and answer.headers.get("retry-after") == "1"

        until(refused, timeout=20)
        assert httpx.get(f"{holding_server.url}/health", timeout=10).status_code == 200
        until(lambda: not refused(), timeout=3 * HOLDING_WRITE_TIMEOUT)
    finally:
        for sock in holders:
            sock.close()
