"""``kvlens simulate serve`` against a client with a socket and a few KiB: bodies that do not say
their length, prompts far past the context. Each answer is a 4xx that says why, and the
server's memory stays near the body cap."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import orjson
import pytest

from kvlens.simulate.serve.api import MAX_BODY_BYTES, MAX_TOKENIZE_BODY_BYTES
from tests.live import Running, start_kvlens

pytestmark = pytest.mark.integration
MIB = 1024 * 1024


@pytest.fixture
def server() -> Iterator[Running]:
    running = start_kvlens("simulate", "serve", "--speed", "1000", ready="/health")
    yield running
    running.output()


def chunked_post(running: Running, path: str, mebibytes: int) -> tuple[bytes, int]:
    """POST ``mebibytes`` MiB to ``path`` in chunked encoding (no Content-Length to refuse by);
    returns the answer's head and how many MiB the server took before it answered."""
    with socket.create_connection(("127.0.0.1", running.port), timeout=30) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        chunk = b"%x\r\n%s\r\n" % (MIB, b"a" * MIB)
        sent = 0
        sock.setblocking(False)
        answer = b""
        while sent < mebibytes and not answer:
            try:
                answer = sock.recv(4096)  # an answer before the body ended: the server refused it
            except BlockingIOError:
                sock.settimeout(30)
                sock.sendall(chunk)
                sock.setblocking(False)
                sent += 1
        sock.settimeout(30)
        if not answer:
            sock.sendall(b"0\r\n\r\n")
        while b'"code":' not in answer:  # the head and the body may come apart
            more = sock.recv(4096)
            if not more:
                break
            answer += more
        return answer, sent


@pytest.mark.parametrize(
    ("path", "cap"),
    [
        ("/tokenize", MAX_TOKENIZE_BODY_BYTES),
        ("/detokenize", MAX_TOKENIZE_BODY_BYTES),
        ("/v1/completions", MAX_BODY_BYTES),
    ],
)
def test_a_chunked_body_past_the_cap_is_refused_as_it_arrives(server: Running, path: str, cap: int) -> None:
    memory = server.memory()
    memory.reset()
    answer, sent = chunked_post(server, path, 200)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert f"larger than {cap} bytes".encode() in answer
    # the answer comes once the cap is passed (the socket buffers hold a few MiB more)
    assert sent < cap / MIB + 48, sent
    assert memory.peak_growth_mib() < 3 * cap / MIB
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_a_text_prompt_far_past_the_context_is_refused_without_tokenizing_it(server: Running) -> None:
    text = "a" * (MAX_BODY_BYTES - 100)
    body = orjson.dumps({"prompt": text, "max_tokens": 1})
    memory = server.memory()
    memory.reset()
    answer = httpx.post(f"{server.url}/v1/completions", content=body, timeout=60)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "prompt"
    assert error["message"] == (
        f"This model's maximum context length is 32768 tokens. However, your request has "
        f"{len(text)} input tokens. Please reduce the length of the input messages."
    )
    # the body, its copy and the parsed string: 3 x 16 MiB; tokenized it was 8 bytes a token more
    assert memory.peak_growth_mib() < 4 * MAX_BODY_BYTES / MIB


def test_streams_nobody_reads_hold_a_socket_buffer_not_their_whole_answer(server: Running) -> None:
    # A client that asks for a long stream and never reads: the answer comes due faster than it is
    # read (here at once: speed 1000). Each stream is written a piece at a time, each piece after
    # the last has drained, so the server holds about a socket buffer per stream (before: the
    # whole answer at once, about 6.8 MiB a stream of 30,000 tokens).
    streams = 40
    body = orjson.dumps({"prompt": "hello world", "max_tokens": 30_000, "stream": True})
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    memory = server.memory()
    memory.reset()
    sockets = []
    try:
        for _ in range(streams):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", server.port))
            sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            sockets.append(sock)
        finished = server.wait_for("vllm:request_success_total", streams, timeout=60)
        assert finished == streams
        assert memory.peak_growth_mib() < 24  # 9.4 MiB measured (load 11); 270 before
    finally:
        for sock in sockets:
            sock.close()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
