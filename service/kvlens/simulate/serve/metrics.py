"""The simulated fleet's ``/metrics``, in vLLM 0.33's names, types, help texts, labels
(``model_name``, ``engine`` = the replica's index) and buckets (``reference/engines.md``
section 1), for what the simulation knows.

When a counter moves differs from vLLM in one documented way: a request's prompt, prefix-cache
query and hit tokens are counted when it finishes (vLLM: when it is admitted), so that the
counters and the records ``--push`` sends cover the same requests at every moment and ``kvlens
serve --scrape`` reconciles them exactly. A request that leaves before it started (its client went
away while it waited) is counted only in ``vllm:request_success{finished_reason="abort"}``.
Durations are the modelled ones as the client lives them (virtual seconds / ``--speed``).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvlens.simulate.replica import Replica

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
LABELS = ("model_name", "engine")


def request_token_buckets(max_model_len: int) -> list[float]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return buckets
            buckets.append(float(value))
        exponent += 1


class FleetMetrics:
    """One set of families per server (no global registry); a child per replica."""

    def __init__(
        self, model: str, replicas: list[Replica], max_model_len: int, block_size: int, prefix_caching: bool
    ) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        tokens = request_token_buckets(max_model_len)

        def counter(name: str, text: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, text, (*LABELS, *extra), registry=registry)

        def histogram(name: str, text: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(name, text, LABELS, buckets=buckets, registry=registry)

        queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        prompt = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        cached = counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).")
        by_source = counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", ("source",))
        generation = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = counter(
            "vllm:request_success", "Count of successfully processed requests.", ("finished_reason",)
        )
        ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        prompt_hist = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        generation_hist = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        computed_hist = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tokens,
        )
        # The children per replica, bound once (labels() is a dict lookup under a lock).
        self._children = []
        for replica in replicas:
            labels = (model, str(replica.index))
            self._children.append(
                (
                    queries.labels(*labels),
                    hits.labels(*labels),
                    prompt.labels(*labels),
                    cached.labels(*labels),
                    by_source.labels(*labels, "local_compute"),
                    by_source.labels(*labels, "local_cache_hit"),
                    generation.labels(*labels),
                    success.labels(*labels, "length"),
                    success.labels(*labels, "abort"),
                    ttft.labels(*labels),
                    e2e.labels(*labels),
                    queue.labels(*labels),
                    prefill.labels(*labels),
                    decode.labels(*labels),
                    prompt_hist.labels(*labels),
                    generation_hist.labels(*labels),
                    computed_hist.labels(*labels),
                )
            )
            by_source.labels(*labels, "external_kv_transfer")  # always 0: no connector is modelled
        registry.register(_Gauges(model, replicas, block_size, prefix_caching))

    def finished(
        self,
        replica: int,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        output_tokens: int,
        started: bool,
        aborted: bool,
        queue: float,
        prefill: float,
        decode: float,
    ) -> None:
        (
            queries, hits, prompt, cached, computed_source, cached_source, generation, length, abort,
            ttft, e2e, queue_hist, prefill_hist, decode_hist, prompt_hist, generation_hist, computed_hist,
        ) = self._children[replica]  # fmt: skip
        (abort if aborted else length).inc()
        if not started:
            return
        queries.inc(prompt_tokens)
        hits.inc(cached_tokens)
        prompt.inc(prompt_tokens)
        cached.inc(cached_tokens)
        computed_source.inc(prompt_tokens - cached_tokens)
        cached_source.inc(cached_tokens)
        generation.inc(output_tokens)
        ttft.observe(queue + prefill)
        e2e.observe(queue + prefill + decode)
        queue_hist.observe(queue)
        prefill_hist.observe(prefill)
        decode_hist.observe(decode)
        prompt_hist.observe(prompt_tokens)
        generation_hist.observe(output_tokens)
        computed_hist.observe(prompt_tokens - cached_tokens)


class _Gauges(Collector):
    """What the replicas hold at scrape time."""

    def __init__(self, model: str, replicas: list[Replica], block_size: int, prefix_caching: bool) -> None:
        self.model, self.replicas, self.block_size = model, replicas, block_size
        self.prefix_caching = str(prefix_caching)

    def collect(self) -> Iterator[Metric]:
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels=LABELS
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=LABELS
        )
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-Cache usage. 1 means 100 percent usage.", labels=LABELS
        )
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels=LABELS
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[*LABELS, "block_size", "enable_prefix_caching", "num_gpu_blocks"],
        )
        for replica in self.replicas:
            labels = [self.model, str(replica.index)]
            running.add_metric(labels, replica.running)
            preemptions.add_metric(labels, replica.preemptions)
            waiting.add_metric(labels, replica.queued)
            capacity = replica.cache.capacity
            # vLLM counts cached blocks nobody holds as free: usage is the held share.
            usage.add_metric(labels, replica.cache.held_blocks / capacity if capacity else 0.0)
            info.add_metric(
                [
                    *labels,
                    str(self.block_size),
                    self.prefix_caching,
                    str(capacity) if capacity is not None else "None",
                ],
                1.0,
            )
        yield from (running, waiting, usage, preemptions, info)
