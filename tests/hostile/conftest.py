"""The review as a suite: each test attacks a real ``kvlens serve`` over real sockets (and a real
file system) the way an attacker with a few KiB, or an unlucky operator, would."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.live import Running, start_kvlens

Serve = Callable[..., Running]


@pytest.fixture
def serve() -> Iterator[Serve]:
    """Start ``kvlens serve`` with extra arguments and environment; every process is stopped after."""
    started: list[Running] = []

    def start(*args: str, **env: str) -> Running:
        running = start_kvlens("serve", *args, env=env)
        started.append(running)
        return running

    yield start
    for running in started:
        if running.process.poll() is None:
            running.output()
