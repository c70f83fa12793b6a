"""The vLLM stat-logger plugin, loaded through its entry point, delivering to a real sidecar."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from types import ModuleType, SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvlens.sources import vllm_plugin
from tests.integration.conftest import free_port, start_kvlens
from tests.stand_in import finished, load_plugin_class, vllm_config

pytestmark = pytest.mark.integration


def sums(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            key = sample.name + "|" + ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[key] = sample.value
    return out


def total(values: dict[str, float], name: str, *fragments: str) -> float:
    return sum(v for k, v in values.items() if k.split("|")[0] == name and all(f in k for f in fragments))


def test_importing_the_plugin_module_pulls_nothing_heavy() -> None:
    code = (
        "import sys, kvlens.sources.vllm_plugin as p; "
        "heavy = ('vllm', 'numpy', 'fastapi', 'pydantic', 'prometheus_client');"
        "print(sorted({m.split('.')[0] for m in sys.modules} & set(heavy)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_entry_point_gives_a_stat_logger_subclass(vllm: ModuleType) -> None:
    from vllm.v1.metrics.loggers import StatLoggerBase  # the stand-in on sys.path

    cls = load_plugin_class()
    assert issubclass(cls, StatLoggerBase)
    assert not getattr(cls, "__abstractmethods__", None)


def test_plugin_delivers_the_article_to_the_sidecar(
    vllm: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = start_kvlens("serve")
    try:
        monkeypatch.setenv("KVLENS_PLUGIN_URL", f"{server.url}/v1/records")
        logger = load_plugin_class()(vllm_config(["Qwen/Qwen3-8B"]), 0)  # served names come as a list
        logger.log_engine_initialized()
        logger.record(None, finished(vllm, 100))
        logger.record(None, None)
        vllm_plugin.shared_shipper().close(timeout=10)
        values = sums(server.url)
    finally:
        server.output()
    requests = total(values, "kvlens_requests_total")
    assert requests == 100
    assert total(values, "kvlens_requests_total", "cache=hit", "model=Qwen/Qwen3-8B") == 90
    assert total(values, "kvlens_cached_tokens_total") / total(
        values, "kvlens_prompt_tokens_total"
    ) == pytest.approx(1440 / 93440)
    assert total(values, "kvlens_records_received_total", "source=vllm_plugin") == 100
    assert total(values, "kvlens_ttft_seconds_sum") == pytest.approx(100 * 0.03)  # queued + prefill
    assert total(values, "kvlens_e2e_seconds_count") == 100


def test_old_vllm_without_cached_tokens_sends_nothing(
    vllm: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    class OldStats:  # vLLM 0.12: FinishedRequestStats without num_cached_tokens
        num_prompt_tokens = 100
        queued_time = 0.1
        prefill_time = 0.1

    sent: list[object] = []
    shipper = vllm_plugin.Shipper(
        SimpleNamespace(send=lambda records, dropped, batch_id: sent.append(records)), flush_seconds=0.05
    )
    recorder = vllm_plugin.RequestRecorder(shipper, "m", "0")
    with caplog.at_level(logging.ERROR, logger="kvlens.vllm_plugin"):
        for _ in range(3):
            recorder.record_finished(SimpleNamespace(finished_requests=[OldStats()]))
    shipper.close()
    assert sent == []
    assert len([r for r in caplog.records if "num_cached_tokens" in r.getMessage()]) == 1


def test_record_stays_fast_when_the_sidecar_port_is_dead(
    vllm: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVLENS_PLUGIN_URL", f"http://127.0.0.1:{free_port()}/v1/records")
    monkeypatch.setenv("KVLENS_PLUGIN_QUEUE", "500")
    logger = load_plugin_class()(vllm_config(), 0)
    batch = finished(vllm, 100)
    start = time.perf_counter()
    for _ in range(20):
        logger.record(None, batch)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, "record() must only enqueue (a blocked call would take seconds)"
    assert vllm_plugin.shared_shipper().dropped >= 1500


def test_record_stays_fast_while_the_sidecar_hangs(vllm: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()
    accepted = threading.Event()

    def hang() -> None:  # accepts, reads, answers only after 10 s (or when the test ends)
        connection, _ = listener.accept()
        accepted.set()
        with connection:
            stop.wait(10)
            connection.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")

    thread = threading.Thread(target=hang, daemon=True)
    thread.start()
    monkeypatch.setenv("KVLENS_PLUGIN_URL", f"http://127.0.0.1:{listener.getsockname()[1]}/v1/records")
    monkeypatch.setenv("KVLENS_PLUGIN_FLUSH_SECONDS", "0.01")
    logger = load_plugin_class()(vllm_config(), 0)
    logger.record(None, finished(vllm, 10))
    assert accepted.wait(10), "the shipper should be inside its POST now"
    start = time.perf_counter()
    for _ in range(20):
        logger.record(None, finished(vllm, 100))
    assert time.perf_counter() - start < 1.0
    stop.set()
    listener.close()


def test_drops_while_down_are_reported_once_the_sidecar_is_back() -> None:
    port = free_port()
    sink = vllm_plugin.HttpSink(f"http://127.0.0.1:{port}/v1/records", None, deadline=2)
    shipper = vllm_plugin.Shipper(
        sink, capacity=50, batch_size=1000, flush_seconds=0.05, max_backoff_seconds=0.2
    )
    for i in range(200):
        shipper.offer({"prompt_tokens": 100, "cached_tokens": i % 2})
    assert shipper.dropped == 150
    server = start_kvlens("serve", port=port)
    try:
        deadline = time.monotonic() + 20
        while shipper.delivered < 50 and time.monotonic() < deadline:
            time.sleep(0.05)  # the shipper retries on its own backoff
        values = sums(server.url)
    finally:
        shipper.close()
        server.output()
    assert total(values, "kvlens_requests_total") == 50
    assert total(values, "kvlens_records_dropped_total", "source=vllm_plugin") == 150
    assert shipper.dropped == 0


def test_a_retried_batch_keeps_its_id_and_its_drop_count() -> None:
    calls: list[tuple[int, int, str]] = []

    class FlakySink:
        def send(self, records: list[dict[str, object]], dropped: int, batch_id: str) -> None:
            calls.append((len(records), dropped, batch_id))
            if len(calls) == 1:
                raise ConnectionError("the answer was lost")

    # A batch bigger than the queue, and a flush long after the offers: the 3 oldest are dropped.
    shipper = vllm_plugin.Shipper(
        FlakySink(), capacity=5, batch_size=10, flush_seconds=0.3, max_backoff_seconds=0.05
    )
    for i in range(8):
        shipper.offer({"prompt_tokens": 10, "cached_tokens": i})
    deadline = time.monotonic() + 10
    while shipper.delivered < 5 and time.monotonic() < deadline:
        time.sleep(0.01)  # the shipper retries on its own backoff
    shipper.close()
    assert calls[0] == calls[1] == (5, 3, calls[0][2])  # the same records, drops and id, twice
    assert shipper.dropped == 0
