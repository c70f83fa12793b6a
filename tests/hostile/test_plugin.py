"""Defect 10: one record vLLM hands over, or a sidecar that answers slowly, must not stop the
plugin's delivery for good.

Requirement (reliability.md 5.11): a record that cannot be sent is dropped and counted alone; every
send has a hard total deadline; delivery resumes when the sidecar recovers.
"""

from __future__ import annotations

import decimal
import socket
import threading
import time
from types import ModuleType

import httpx
import pytest

from kvlens.sources import vllm_plugin
from tests.hostile.conftest import Serve
from tests.stand_in import finished, load_plugin_class, vllm_config

pytestmark = pytest.mark.integration


def test_a_record_that_cannot_be_encoded_is_dropped_alone(
    serve: Serve, vllm: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    sidecar = serve()
    monkeypatch.setenv("KVLENS_PLUGIN_URL", f"{sidecar.url}/v1/records")
    monkeypatch.setenv("KVLENS_PLUGIN_FLUSH_SECONDS", "0.05")
    logger = load_plugin_class()(vllm_config(), 0)
    batch = finished(vllm, 100)
    batch.finished_requests[7].e2e_latency = decimal.Decimal("0.35")  # not JSON-serializable
    logger.record(None, batch)
    assert sidecar.wait_for("kvlens_requests_total", 99) == 99
    assert sidecar.wait_for("kvlens_records_dropped_total", 1, source="vllm_plugin") == 1
    logger.record(None, finished(vllm, 10))
    assert sidecar.wait_for("kvlens_requests_total", 109) == 109


class DrippingThenHealthy:
    """A sidecar address that first answers one byte a second, then forwards to a real sidecar."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.healthy = threading.Event()
        self.dripping = threading.Event()  # set once a send is being dripped to
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1/records"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(connection,), daemon=True).start()

    def _answer(self, connection: socket.socket) -> None:
        with connection:
            head, body = self._read(connection)
            if not self.healthy.is_set():
                self.dripping.set()
                for byte in b"HTTP/1.1 200 OK\r\ncontent-length: 20\r\n\r\n" + b"x" * 20:
                    if self.healthy.wait(1.0):
                        return
                    connection.sendall(bytes([byte]))
                return
            headers = dict(
                line.split(": ", 1) for line in head.decode("latin-1").split("\r\n")[1:] if ": " in line
            )
            keep = {k: v for k, v in headers.items() if k.lower().startswith(("kvlens-", "content-type"))}
            answer = httpx.post(self.target, content=body, headers=keep)
            connection.sendall(
                f"HTTP/1.1 {answer.status_code} OK\r\ncontent-length: {len(answer.content)}\r\n\r\n".encode()
                + answer.content
            )

    @staticmethod
    def _read(connection: socket.socket) -> tuple[bytes, bytes]:
        data = b""
        while b"\r\n\r\n" not in data:
            data += connection.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        while len(body) < length:
            body += connection.recv(65536)
        return head, body


def test_a_dripping_sidecar_cannot_stall_delivery(
    serve: Serve, vllm: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    sidecar = serve()
    proxy = DrippingThenHealthy(f"{sidecar.url}/v1/records")
    monkeypatch.setenv("KVLENS_PLUGIN_URL", proxy.url)
    monkeypatch.setenv("KVLENS_PLUGIN_FLUSH_SECONDS", "0.05")
    monkeypatch.setenv("KVLENS_PLUGIN_TIMEOUT_SECONDS", "2")
    logger = load_plugin_class()(vllm_config(), 0)
    logger.record(None, finished(vllm, 100))
    assert proxy.dripping.wait(10)
    started = time.monotonic()
    shipper = vllm_plugin.shared_shipper()
    deadline = started + 30
    while shipper.failures == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # the send in progress is being dripped to
    assert shipper.failures >= 1
    assert time.monotonic() - started < 4  # the 2 s deadline ended the dripped send
    proxy.healthy.set()
    assert sidecar.wait_for("kvlens_requests_total", 100, timeout=30) == 100
    proxy.listener.close()
