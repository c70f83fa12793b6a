"""vLLM 0.33's plugin interface (tests/fixtures/vllm_stand_in, names from engines.md) for tests that
load the kvlens plugin through its entry point. vLLM itself cannot run on these machines."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from kvlens.sources import vllm_plugin

STAND_IN = Path(__file__).parent / "fixtures" / "vllm_stand_in"


@pytest.fixture
def vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The stand-in on sys.path, and a fresh plugin module and shipper; yields its stats module."""
    monkeypatch.syspath_prepend(str(STAND_IN))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    vars(vllm_plugin).pop("KVLensStatLogger", None)  # built against another vLLM: build it anew
    importlib.reload(vllm_plugin)
    yield importlib.import_module("vllm.v1.metrics.stats")
    if vllm_plugin._shipper is not None:
        vllm_plugin._shipper.close(timeout=0.2)
    vars(vllm_plugin).pop("KVLensStatLogger", None)
    importlib.reload(vllm_plugin)


def finished(stats: ModuleType, count: int, **overrides: object) -> object:
    """An IterationStats with the article's requests: 90 short hits, then long misses."""
    requests = []
    for i in range(count):
        values = {
            "finish_reason": stats.FinishReason.STOP,
            "request_id": f"chatcmpl-{i}",
            "num_prompt_tokens": 128 if i < 90 else 8192,
            "num_cached_tokens": 16 if i < 90 else 0,
            "num_generation_tokens": 32,
            "queued_time": 0.02,
            "prefill_time": 0.01,
            "decode_time": 0.3,
            "e2e_latency": 0.35,
            **overrides,
        }
        requests.append(stats.FinishedRequestStats(**values))
    return stats.IterationStats(finished_requests=requests)


def vllm_config(name: str | list[str] = "Qwen/Qwen3-8B") -> object:
    return SimpleNamespace(model_config=SimpleNamespace(served_model_name=name))


def load_plugin_class() -> type:
    (entry,) = [e for e in entry_points(group="vllm.stat_logger_plugins") if e.name == "kvlens"]
    return entry.load()  # type: ignore[no-any-return]
