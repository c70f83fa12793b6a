"""What an endpoint's ``/metrics`` said during a step of an experiment: sampled on a thread of
its own while the step runs (the replay's loop only sends and times), kept with the step
(:meth:`EngineSample.as_json`) and read back from it on resume or merge
(:meth:`EngineSample.from_json`). The names are vLLM's (summed over its engines); an endpoint
that exports other names gives an empty sample, which the capacity rule reads as "cannot tell"."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from kvlens.errors import ScrapeError
from kvlens.experiment import calls
from kvlens.experiment.capacity import Sample
from kvlens.experiment.client import Endpoint
from kvlens.sources.vllm_metrics import families

log = logging.getLogger("kvlens.experiment")

KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # 0.10+, 0.8/0.9
# the scheduler's view (vLLM's names; summed over engines): what decides capacity
SCHEDULER = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_preemptions_total": "preemptions",
}
# /metrics sampled this often during a step: the capacity rule needs a running batch for each
# request's decode (a few hundred ms at most) and a line seen more than once
SCRAPE_SECONDS = 0.2
MAX_SAMPLES = 50_000  # per step: ~3 hours at 0.2 s; later scrapes update the peaks, not the series
QUERIES, HITS = "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"


@dataclass
class EngineSample:
    """What an endpoint's ``/metrics`` said during one step."""

    kv_usage_max: float | None = None
    queries: float = 0.0
    hits: float = 0.0
    scrapes: int = 0
    series: list[Sample] = dataclasses.field(default_factory=list)  # for the capacity rule

    @property
    def token_reuse(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None

    def as_json(self) -> dict[str, Any]:
        """For the step's ``.step.json``: the series as rows of ``series_fields`` (a sample's
        names once, not 50,000 times)."""
        return {
            "kv_usage_max": self.kv_usage_max,
            "queries": self.queries,
            "hits": self.hits,
            "scrapes": self.scrapes,
            "series_fields": SERIES_FIELDS,
            "series": [dataclasses.astuple(sample) for sample in self.series],
        }

    @classmethod
    def from_json(cls, value: Any) -> EngineSample:
        """:meth:`as_json` read back (a step without a sample: an empty one). ValueError when it
        is not one."""
        if value is None:
            return cls()
        if not isinstance(value, dict) or value.get("series_fields", SERIES_FIELDS) != SERIES_FIELDS:
            raise ValueError("not an engine sample of this kvlens")
        try:
            series = [Sample(*row) for row in value.get("series") or []]
            return cls(value.get("kv_usage_max"), value["queries"], value["hits"], value["scrapes"], series)
        except (KeyError, TypeError) as error:
            raise ValueError(f"not an engine sample of this kvlens ({error})") from None


SERIES_FIELDS = [field.name for field in dataclasses.fields(Sample)]


@contextlib.contextmanager
def sampler(endpoint: Endpoint, every: float) -> Iterator[EngineSample]:
    """Scrape the endpoint's ``/metrics`` every ``every`` seconds while the step runs, on a thread
    of its own (the replay's loop only sends and times): the highest KV usage seen, and the
    prefix-cache counters' increase over the step. Each scrape goes through the one bounded
    client (SAMPLE_SECONDS in all, at most MAX_CALL_BYTES once inflated); the step's end cancels
    the scrape under way, so a sampler never outlives its step by more than STOP_SECONDS."""
    sample = EngineSample()
    sampler = _Sampler(endpoint, every, sample)
    sampler.start()
    try:
        yield sample
    finally:
        sampler.stop()


STOP_SECONDS = 5.0  # a cancelled scrape ends at its next await; a parse under way runs to its end


class _Sampler(threading.Thread):
    def __init__(self, endpoint: Endpoint, every: float, sample: EngineSample) -> None:
        super().__init__(name="kvlens-engine-sampler", daemon=True)
        self._endpoint, self._every, self._sample = endpoint, every, sample
        self._loop = asyncio.new_event_loop()
        # made here, run by the thread: stop() may come before the thread has begun
        self._task = self._loop.create_task(self._sampling())

    def run(self) -> None:
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        except Exception:  # a bug must not end the step: the step goes on unsampled
            log.exception("the engine sampler of %s failed", self._endpoint.url)
        finally:
            self._loop.close()

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop already ended and closed
            self._loop.call_soon_threadsafe(self._task.cancel)
        self.join(STOP_SECONDS)
        if self.is_alive():
            log.warning("the engine sampler of %s did not stop within %g s", self._endpoint.url, STOP_SECONDS)

    async def _sampling(self) -> None:
        sample, first = self._sample, dict[str, float]()
        async with calls.client() as pool:
            while True:
                values = await _scrape(pool, self._endpoint)
                if values is not None:
                    sample.scrapes += 1
                    if len(sample.series) < MAX_SAMPLES:
                        sample.series.append(
                            Sample(
                                time.time(),  # the records' clock: arrival_time is the client's
                                values.get("running"),
                                values.get("waiting"),
                                values.get("preemptions"),
                                values.get("kv_usage"),
                            )
                        )
                    if not first:
                        first.update(values)
                    usage = values.get("kv_usage")
                    if usage is not None:
                        sample.kv_usage_max = max(sample.kv_usage_max or 0.0, usage)
                    sample.queries = values.get("queries", 0.0) - first.get("queries", 0.0)
                    sample.hits = values.get("hits", 0.0) - first.get("hits", 0.0)
                await asyncio.sleep(self._every)


async def _scrape(pool: httpx.AsyncClient, endpoint: Endpoint) -> dict[str, float] | None:
    try:
        answer = await calls.call(
            pool, endpoint.url, "GET", "/metrics", headers=endpoint.headers, seconds=calls.SAMPLE_SECONDS
        )
    except ScrapeError:
        return None
    if answer.status != 200:
        return None
    try:
        return engine_values(answer.body.decode("utf-8", "replace"))
    except ScrapeError:  # a line past the reader's limit: no sample
        return None


def engine_values(text: str) -> dict[str, float]:
    """The sampled gauges and counters of an exposition, summed over engines; none when the text
    does not parse, ScrapeError("too_large") past the reader's line limit."""
    values: dict[str, float] = {}
    try:
        found = list(families(text))
    except ScrapeError as error:
        if error.reason != "parse":
            raise
        return values
    for family in found:
        for s in family.samples:
            if s.name in KV_USAGE:
                values["kv_usage"] = max(values.get("kv_usage", 0.0), s.value)
            elif s.name == f"{QUERIES}_total":
                values["queries"] = values.get("queries", 0.0) + s.value
            elif s.name == f"{HITS}_total":
                values["hits"] = values.get("hits", 0.0) + s.value
            elif s.name in SCHEDULER:
                key = SCHEDULER[s.name]
                values[key] = values.get(key, 0.0) + s.value
    return values
