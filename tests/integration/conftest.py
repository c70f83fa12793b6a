from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Running:
    process: subprocess.Popen[str]
    url: str

    def output(self) -> str:
        self.process.terminate()
        out, _ = self.process.communicate(timeout=10)
        return out


def start_kvlens(*args: str, env: dict[str, str] | None = None, port: int | None = None) -> Running:
    port = port or free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvlens.cli", *args, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "KVLENS_LOG_LEVEL": "WARNING", **(env or {})},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kvlens exited early:\n{process.stdout.read() if process.stdout else ''}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return Running(process, url)
        except httpx.TransportError:
            time.sleep(0.05)  # waiting for a process to bind, not for time to pass
    process.kill()
    raise RuntimeError("kvlens did not become ready within 20 s")


@pytest.fixture
def kvlens_server() -> Iterator[Running]:
    running = start_kvlens("serve")
    yield running
    running.output()
