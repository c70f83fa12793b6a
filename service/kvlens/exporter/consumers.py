"""The readers of a batch after its sums are counted (the requests' diagnoses, the modelled
caches, the tenants' block storers), each run guarded.

The sums are the sidecar's promise; once a batch is in them, the sender must get its 200: a
500 there makes the sender retry and the batch count twice. So a reader that raises (a bug:
anything bad input can trip is refused by validation, before the sums) costs only its own
state for that batch. It is counted in ``kvlens_ingest_consumer_errors_total{consumer}`` and
logged with its traceback at most once per :data:`LOG_INTERVAL_SECONDS` per consumer and kind
of exception (a sender decides how often a batch trips it, so it must not decide the log volume).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final, ParamSpec

from kvlens.exporter.ingest import LogThrottle

log = logging.getLogger(__name__)

LOG_INTERVAL_SECONDS: Final = 60.0
P = ParamSpec("P")


class GuardedConsumers:
    """Runs the consumers, counting their failures; thread-safe (the ingest worker and the
    tails' threads both count). The failures' kinds are exception classes, a set the code
    bounds; their counters exist from the start (0), so ``increase()`` sees the first one."""

    def __init__(self, names: Sequence[str], clock: Callable[[], float] = time.monotonic) -> None:
        self._errors = dict.fromkeys(names, 0)
        self._throttles: dict[tuple[str, type[BaseException]], LogThrottle] = {}
        self._clock = clock
        self._lock = threading.Lock()

    def run(self, name: str, consume: Callable[P, object], *args: P.args, **kwargs: P.kwargs) -> None:
        try:
            consume(*args, **kwargs)
        except Exception as error:
            with self._lock:
                self._errors[name] += 1
                kind = (name, type(error))
                throttle = self._throttles.get(kind)
                if throttle is None:
                    throttle = self._throttles[kind] = LogThrottle(LOG_INTERVAL_SECONDS, self._clock)
                held = throttle.allow()
            if held is not None:
                log.error(
                    "kvlens: the %s failed on a batch already counted (the batch stays counted and "
                    "answered; %d more like this not logged since the last)",
                    name,
                    held,
                    exc_info=True,
                )

    def errors(self) -> dict[str, int]:
        with self._lock:
            return dict(self._errors)
