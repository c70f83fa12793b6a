"""State of the scraped engines: reset-aware counters, up, and scrape errors.

An engine counter is tracked per scraped series (its full label set). The first sample of a
series sets a baseline; each later sample adds ``value - previous``, or ``value`` when the series
went down (the engine restarted: PromQL's own rule for resets). So ``kvlens_engine_*`` never go
backwards, and count from kvlens's first scrape of each engine.

An engine is outside input, held to the same rules as pushed records under budgets of its own:
its ``model_name`` values go through a :class:`~kvlens.exporter.labels.ClosedLabels` of their
own (invalid or past the cap: ``other``); at most ``max_series`` series are followed per target,
and only those of the latest scrape are remembered (labels that change every scrape cost nothing
that lasts); a value that is not a finite number in 0..2**53 (past which float64 cannot count
tokens one by one) is refused, never added, and the series keeps its last good value as baseline.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Final

from kvlens.exporter.labels import ClosedLabels
from kvlens.sources.vllm_metrics import EngineScrape

SCRAPE_ERROR_REASONS: Final = ("timeout", "too_large", "http_status", "connect", "parse")
SAMPLE_REJECT_REASONS: Final = ("invalid_value", "series_overflow")
MAX_COUNTER_VALUE: Final = float(2**53)

Series = tuple[str, tuple[tuple[str, str], ...]]  # (kvlens counter, the sample's labels)


@dataclass
class UpstreamSnapshot:
    up: dict[str, int]
    counters: dict[tuple[str, str, str], float]  # (counter, target, model) -> total
    running: dict[tuple[str, str], float]  # (target, model) -> requests running
    errors: dict[tuple[str, str], int]  # (target, reason) -> scrapes failed
    scrapes: dict[str, int]  # target -> scrapes that succeeded
    rejected: dict[tuple[str, str], int]  # (target, reason) -> samples refused


class UpstreamState:
    def __init__(self, targets: tuple[str, ...], labels: ClosedLabels, max_series: int) -> None:
        self.targets = targets
        self._labels = labels
        self._max_series = max_series
        self._lock = threading.Lock()
        self._previous: dict[str, dict[Series, float]] = {}
        self._totals: dict[tuple[str, str, str], float] = {}
        self._running: dict[tuple[str, str], float] = {}
        self._up: dict[str, int] = {}
        self._errors: Counter[tuple[str, str]] = Counter()
        self._scrapes: Counter[str] = Counter()
        self._rejected: Counter[tuple[str, str]] = Counter()

    def _label(self, model: str) -> str:
        return self._labels.label(self._labels.index_of(model or self._labels.default))

    def record_scrape(self, target: str, scrape: EngineScrape) -> None:
        """Add one successful scrape."""
        with self._lock:
            previous = self._previous.get(target, {})
            current: dict[Series, float] = {}
            for sample in scrape.counters:
                value = sample.value
                series = (sample.counter, sample.series)
                if not (math.isfinite(value) and 0 <= value <= MAX_COUNTER_VALUE):
                    self._rejected[(target, "invalid_value")] += 1
                    if series in previous:  # still exported: keep its baseline for the next value
                        current[series] = previous[series]
                    continue
                if series not in current and len(current) >= self._max_series:
                    self._rejected[(target, "series_overflow")] += 1
                    continue
                current[series] = value
                before = previous.get(series)
                # First sight sets the baseline; a drop means the engine restarted from 0.
                delta = 0.0 if before is None else value - before if value >= before else value
                total = (sample.counter, target, self._label(sample.model))
                self._totals[total] = self._totals.get(total, 0.0) + delta
            self._previous[target] = current
            self._running = {k: v for k, v in self._running.items() if k[0] != target}
            for model, running in scrape.running.items():
                if math.isfinite(running) and running >= 0:
                    group = (target, self._label(model))
                    self._running[group] = self._running.get(group, 0.0) + running
            self._up[target] = 1
            self._scrapes[target] += 1

    def record_failure(self, target: str, reason: str) -> None:
        with self._lock:
            self._up[target] = 0
            self._errors[(target, reason)] += 1
            self._running = {k: v for k, v in self._running.items() if k[0] != target}

    def snapshot(self) -> UpstreamSnapshot:
        with self._lock:
            return UpstreamSnapshot(
                up={target: self._up.get(target, 0) for target in self.targets},
                counters=dict(self._totals),
                running=dict(self._running),
                errors={
                    (target, reason): self._errors[(target, reason)]
                    for target in self.targets
                    for reason in SCRAPE_ERROR_REASONS
                },
                scrapes={target: self._scrapes[target] for target in self.targets},
                rejected={
                    (target, reason): self._rejected[(target, reason)]
                    for target in self.targets
                    for reason in SAMPLE_REJECT_REASONS
                },
            )
