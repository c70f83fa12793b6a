from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.live import Running, free_port, start_kvlens

__all__ = ["Running", "free_port", "kvlens_server", "start_kvlens"]


@pytest.fixture
def kvlens_server() -> Iterator[Running]:
    running = start_kvlens("serve")
    yield running
    running.output()
