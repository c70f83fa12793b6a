"""The isolation audit run continuously by the sidecar (``kvlens serve --isolation-probe
NAME=URL[#MODEL]``): each target is audited every ``every_seconds`` (jittered), in the
background on the server's event loop (its requests are asynchronous; the one parse of an
engine's ``/metrics`` runs on a thread), so ``/metrics`` never waits for a probe.

What is exported (read by the collector at scrape time, never computed there):
``kvlens_isolation_probe_result{target,case}`` (1 pass, 0 leak, -1 inconclusive; ``no_salt`` is
sharing as designed and no verdict, so it is not exported) and
``kvlens_isolation_probe_last_success_timestamp_seconds{target}``, the end of the last run that
could show something (verdict pass or leak: its ``same_salt`` hit). A run that cannot be made
(the endpoint down, its model not found) sets every case of its target to -1: a result that
is not fresh is not kept as a pass.

The model: ``#MODEL`` after the URL, else the endpoint's ``/v1/models`` when it serves exactly
one (several: the run fails, naming how many, until ``#MODEL`` is given). The block size: the
endpoint's ``/metrics`` (``vllm:cache_config_info``), else 16.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from kvlens.audit.isolation import INCONCLUSIVE, LEAK, METRIC_VALUES, NO_SALT, Plan, audit
from kvlens.audit.settings import ProbeTarget
from kvlens.errors import InputError, ScrapeError
from kvlens.experiment import calls
from kvlens.experiment.client import Endpoint
from kvlens.experiment.protocol import block_size_in, model_ids

log = logging.getLogger(__name__)
DEFAULT_BLOCK_SIZE: Final = 16
JITTER: Final = 0.2  # each wait is every_seconds x U(1 - JITTER, 1 + JITTER)
FIRST_RUN_WITHIN_SECONDS: Final = 60.0  # the first run starts within this (or every_seconds)


@dataclass(frozen=True)
class ProbeSnapshot:
    results: dict[tuple[str, str], int]  # (target, case) -> 1, 0 or -1
    last_success: dict[str, float]  # target -> unix seconds


class IsolationProbes:
    def __init__(
        self,
        targets: list[ProbeTarget],
        every_seconds: float,
        *,
        plan: Callable[[int, str | None], Plan] | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """``plan(block_size, lora)`` makes each run's plan (default: :class:`Plan`'s defaults)."""
        self.targets = targets
        self.every_seconds = every_seconds
        self._plan = plan or (lambda block_size, lora: Plan(block_size, lora=lora))
        self._rng = rng or random.Random()
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()  # written on the loop, read by the collector's thread
        self._results: dict[tuple[str, str], int] = {}
        self._last_success: dict[str, float] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._forever(target)) for target in self.targets]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def snapshot(self) -> ProbeSnapshot:
        with self._lock:
            return ProbeSnapshot(dict(self._results), dict(self._last_success))

    async def _forever(self, target: ProbeTarget) -> None:
        await self._sleep(self._rng.uniform(0, min(self.every_seconds, FIRST_RUN_WITHIN_SECONDS)))
        while True:
            await self.run_once(target)
            await self._sleep(self.every_seconds * self._rng.uniform(1 - JITTER, 1 + JITTER))

    async def run_once(self, target: ProbeTarget) -> None:
        """One audit of ``target``, its results then exported; never raises but for cancellation."""
        try:
            endpoint, block_size = await _resolve(target)
            result = await audit(endpoint, self._plan(block_size, target.lora), block_size_from="endpoint")
        except (InputError, ScrapeError) as error:
            log.warning("kvlens: isolation probe of %s could not run: %s", target.name, error)
            self._record(target.name, dict.fromkeys(self._cases(target), METRIC_VALUES[INCONCLUSIVE]), None)
            return
        except Exception:  # a bug must not end the probing: the target is inconclusive until fixed
            log.exception("kvlens: isolation probe of %s failed", target.name)
            self._record(target.name, dict.fromkeys(self._cases(target), METRIC_VALUES[INCONCLUSIVE]), None)
            return
        values = {case.case: METRIC_VALUES[case.verdict] for case in result.cases if case.case != NO_SALT}
        if result.verdict == LEAK:
            leaked = ", ".join(case.case for case in result.cases if case.verdict == LEAK)
            log.error("kvlens: isolation probe of %s found a cross-scope cache hit: %s", target.name, leaked)
        conclusive = result.verdict != INCONCLUSIVE
        self._record(target.name, values, self._clock() if conclusive else None)

    def _cases(self, target: ProbeTarget) -> tuple[str, ...]:
        return tuple(case for case in self._plan(DEFAULT_BLOCK_SIZE, target.lora).cases if case != NO_SALT)

    def _record(self, name: str, values: dict[str, int], success: float | None) -> None:
        with self._lock:
            for key in [key for key in self._results if key[0] == name]:
                del self._results[key]
            self._results.update({(name, case): value for case, value in values.items()})
            if success is not None:
                self._last_success[name] = success


async def _resolve(target: ProbeTarget) -> tuple[Endpoint, int]:
    """The target's endpoint (its model named, or the one it serves) and its block size."""
    endpoint = Endpoint(target.url, target.model or "?", timeout_seconds=60.0)
    async with calls.client() as pool:
        model = target.model
        if model is None:
            answer = await calls.call(
                pool, endpoint.url, "GET", "/v1/models", headers=endpoint.headers, seconds=calls.CHECK_SECONDS
            )
            served = model_ids(answer.body) if answer.status == 200 else None
            if served is None or len(served) != 1:
                count = "no model list" if served is None else f"{len(served)} models"
                raise InputError(f"{target.name} serves {count}: name one, NAME=URL#MODEL")
            model = served[0]
        block_size = None
        try:
            metrics = await calls.call(
                pool, endpoint.url, "GET", "/metrics", headers=endpoint.headers, seconds=calls.CHECK_SECONDS
            )
            if metrics.status == 200:
                block_size = await asyncio.to_thread(block_size_in, metrics.body)
        except ScrapeError:  # no /metrics within its bounds: the default block size
            block_size = None
    return Endpoint(target.url, model, timeout_seconds=60.0), block_size or DEFAULT_BLOCK_SIZE
