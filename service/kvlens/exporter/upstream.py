"""State of the scraped engines: reset-aware counters, up, and scrape errors.

An engine counter is tracked per scraped series (its full label set). The first sample of a
series sets a baseline; each later sample adds ``value - previous``, or ``value`` when the series
went down (the engine restarted: PromQL's own rule for resets). So ``kvlens_engine_*`` never go
backwards, and count from kvlens's first scrape of each engine.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kvlens.sources.vllm_metrics import EngineScrape

SCRAPE_ERROR_REASONS = ("timeout", "too_large", "http_status", "connect", "parse")


@dataclass
class UpstreamSnapshot:
    up: dict[str, int]
    counters: dict[tuple[str, str, str], float]  # (counter, target, model) -> total
    running: dict[tuple[str, str], float]  # (target, model) -> requests running
    errors: dict[tuple[str, str], int]  # (target, reason) -> scrapes failed


@dataclass
class UpstreamState:
    targets: tuple[str, ...]
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _previous: dict[tuple[str, str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)
    _totals: dict[tuple[str, str, str], float] = field(default_factory=dict)
    _running: dict[tuple[str, str], float] = field(default_factory=dict)
    _up: dict[str, int] = field(default_factory=dict)
    _errors: Counter[tuple[str, str]] = field(default_factory=Counter)

    def record_scrape(self, target: str, scrape: EngineScrape, label: Callable[[str], str]) -> None:
        """Add one successful scrape; ``label`` maps the engine's model name to a label value."""
        with self._lock:
            for sample in scrape.counters:
                series = (target, sample.counter, sample.series)
                previous = self._previous.get(series)
                self._previous[series] = sample.value
                # First sight sets the baseline; a drop means the engine restarted from 0.
                if previous is None:
                    delta = 0.0
                else:
                    delta = sample.value - previous if sample.value >= previous else sample.value
                total = (sample.counter, target, label(sample.model))
                self._totals[total] = self._totals.get(total, 0.0) + delta
            self._running = {k: v for k, v in self._running.items() if k[0] != target}
            for model, running in scrape.running.items():
                group = (target, label(model))
                self._running[group] = self._running.get(group, 0.0) + running
            self._up[target] = 1

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
            )
