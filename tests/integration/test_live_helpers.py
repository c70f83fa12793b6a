"""The helpers that start real processes for the tests (tests/live.py) clean up after a failure:
one slow start must fail its own test only, not the next one too."""

from __future__ import annotations

import psutil
import pytest

from tests.live import start_kvlens

pytestmark = pytest.mark.integration


def test_a_kvlens_that_does_not_start_in_time_is_reaped_and_its_output_said() -> None:
    ours = psutil.Process()
    before = {child.pid for child in ours.children()}
    with pytest.raises(RuntimeError, match=r"kvlens did not start within 0\.01 s"):
        start_kvlens("serve", start_seconds=0.01)
    # Killed and waited for: no zombie, no Popen left to warn "still running" in a later test.
    assert [child.pid for child in ours.children() if child.pid not in before] == []
