"""Cost of the vLLM plugin's ``record()`` on vLLM's thread, per finished request.

    .venv/bin/python bench/plugin.py

Drives the plugin with objects carrying vLLM 0.33's ``FinishedRequestStats`` field names, 64
finished requests per ``record()`` call, delivering to a sink that discards. The baseline,
measured in the same run, is the floor any plugin pays: reading the same nine attributes and
appending a tuple to a deque. Target: <= 5 microseconds per finished request.
"""

from __future__ import annotations

import collections
import statistics
import time
from types import SimpleNamespace

from kvlens.sources import vllm_plugin

PER_CALL = 64
CALLS = 2000

FIELDS = dict(
    finish_reason="stop",
    request_id="chatcmpl-0123456789abcdef",
    num_prompt_tokens=2048,
    num_cached_tokens=1024,
    num_generation_tokens=128,
    queued_time=0.012,
    prefill_time=0.081,
    decode_time=1.9,
    e2e_latency=2.0,
)


def main() -> None:
    iteration = SimpleNamespace(finished_requests=[SimpleNamespace(**FIELDS) for _ in range(PER_CALL)])
    shipper = vllm_plugin.Shipper(
        SimpleNamespace(send=lambda records, dropped, batch_id: None),
        build=vllm_plugin.records_from_rows,
        capacity=10_000_000,
    )
    recorder = vllm_plugin.RequestRecorder(shipper, "Qwen/Qwen3-8B", "0")
    floor_queue: collections.deque[tuple[object, ...]] = collections.deque(maxlen=10_000_000)
    attributes = tuple(FIELDS)

    def plugin() -> None:
        recorder.record_finished(iteration)

    def floor() -> None:
        for stats in iteration.finished_requests:
            floor_queue.append(tuple(getattr(stats, name, None) for name in attributes))

    costs: dict[str, list[float]] = {"plugin": [], "floor": []}
    for _ in range(7):
        for name, run in (("plugin", plugin), ("floor", floor)):
            start = time.perf_counter()
            for _ in range(CALLS):
                run()
            costs[name].append((time.perf_counter() - start) / (CALLS * PER_CALL) * 1e6)
        floor_queue.clear()
    shipper.close()
    ours, base = statistics.median(costs["plugin"]), statistics.median(costs["floor"])
    print(f"record() per finished request   {ours:5.2f} us (median of 7; target <= 5 us)")
    print(f"  floor: 9 getattr + append      {base:5.2f} us   plugin = {ours / base:.1f}x the floor")


if __name__ == "__main__":
    main()
