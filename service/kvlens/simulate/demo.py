"""Built-in traffic for ``kvlens demo``, behind one seam (:class:`TrafficSource`):

- :class:`ReplayTraffic` (the default): the bundled Mooncake trace (a real public one) replayed
  by the simulator on a fleet of replicas with prefix caches and a cache-aware router, sped up
  and looping, so the sidecar shows a realistic fleet with no setup; with ``kv_events`` its caches'
  KV events too (:class:`ReplayKVEvents` feeds them to the sidecar's block index in process);
- :class:`DemoTraffic` (``--traffic synthetic``, and the benchmarks' record generator): the shape
  of the articles' fleet. Many short chat requests share a small template prefix (one or two
  16-token blocks) and hit; a few long prompts (documents, RAG) miss. The request hit ratio looks
  excellent while token reuse and modelled compute saved stay small.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

import numpy as np
import numpy.typing as npt

from kvlens.definitions import DEFAULT_COST_MODEL, CostModel, reusable_full_block_tokens

if TYPE_CHECKING:
    from kvlens.fleet.subscriber import KVEvents
    from kvlens.simulate.trace import TraceRequest

SOURCE = "demo"
REPLAY_MODEL: Final = "llama-3.1-8b"
# The shape the replay's prefill times were measured for (the simulator's default service
# model): the demo gives it to the sidecar, so compute saved reads in FLOPs and the decode
# panel has a model.
REPLAY_SHAPE: Final = {
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "intermediate_size": 14336,
    "vocab_size": 128256,
}


class TrafficSource(Protocol):
    def records(self, start: float, end: float) -> list[dict[str, Any]]:
        """Records of the requests that finished between ``start`` and ``end`` (unix seconds)."""
        ...


@dataclass
class DemoTraffic:
    rate_per_second: float = 20.0
    seed: int = 0
    cost_model: CostModel = DEFAULT_COST_MODEL
    seconds_per_work_unit: float = 1e-5
    block_size: int = 16
    models: tuple[str, ...] = ("llama-3.1-8b-instruct", "qwen2.5-7b-instruct")
    _rng: np.random.Generator = field(init=False, repr=False)
    _issued: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)

    def records(self, start: float, end: float) -> list[dict[str, Any]]:
        rng = self._rng
        count = int(rng.poisson(self.rate_per_second * max(end - start, 0.0)))
        if count == 0:
            return []
        kind = rng.choice(3, size=count, p=[0.85, 0.05, 0.10])  # short chat, RAG, long document
        short, rag, long = kind == 0, kind == 1, kind == 2
        prompt = np.where(
            short,
            rng.integers(96, 400, count),
            np.where(rag, rng.integers(1024, 3072, count), rng.integers(4096, 24576, count)),
        )
        template = reusable_full_block_tokens(rng.choice([20, 36], size=count), self.block_size)
        warm = rng.random(count) < 0.95
        shared_document = long & (rng.random(count) < 0.05)
        cached = np.where(short & warm, template, 0)
        cached = np.where(shared_document, reusable_full_block_tokens(4100, self.block_size), cached)
        cached = np.minimum(cached, prompt)

        prefill = self.cost_model.remaining_work(prompt, cached) * self.seconds_per_work_unit + 0.002
        burst = rng.random(count) < 0.08
        queue = rng.exponential(0.03, count) + np.where(burst, rng.exponential(0.8, count), 0.0)
        other = 0.002 + rng.exponential(0.002, count)
        ttft = queue + prefill + other
        output = rng.integers(16, 512, count)
        decode = output * 0.015
        arrival = np.sort(rng.uniform(start, end, count))
        model = rng.choice(len(self.models), size=count, p=[0.9, 0.1] if len(self.models) == 2 else None)

        out = []
        for i in range(count):
            self._issued += 1
            out.append(
                {
                    "request_id": f"demo-{self._issued}",
                    "model": self.models[int(model[i])],
                    "prompt_tokens": int(prompt[i]),
                    "cached_tokens": int(cached[i]),
                    "output_tokens": int(output[i]),
                    "queue_seconds": round(float(queue[i]), 6),
                    "prefill_seconds": round(float(prefill[i]), 6),
                    "ttft_seconds": round(float(ttft[i]), 6),
                    "decode_seconds": round(float(decode[i]), 6),
                    "e2e_seconds": round(float(ttft[i] + decode[i]), 6),
                    "arrival_time": round(float(arrival[i]), 3),
                    "block_size": self.block_size,
                    "finish_reason": "stop",
                }
            )
        return out


CAPACITY_TOKENS = 1800 * 512  # a replica's KV room: about an H200's serving 8B (1,800 blocks of 512)

# One cache event of the replay: (trace seconds, replica, stored (else removed), blocks, parent)
CacheEvent = tuple[float, int, bool, tuple[object, ...], object | None]


@dataclass
class ReplayTraffic:
    """The bundled Mooncake trace (3,993 requests over 17 minutes) as the simulator plays it on
    ``replicas`` replicas under ``policy``, replayed ``speed`` times faster than recorded and
    looping. Arrivals are sped up; each request's latencies are the simulated ones. With
    ``kv_events`` the replicas' cache events are kept too (:meth:`cache_events`), each timed at
    the arrival the simulator was routing when it happened (events are in the simulator's order)."""

    speed: float = 4.0
    replicas: int = 4
    capacity_blocks: int = 0  # per replica; 0: CAPACITY_TOKENS in the trace's blocks
    policy: str = "prefix_affinity"
    model: str = REPLAY_MODEL
    origin: float = field(default_factory=time.time)  # the wall clock of the trace's start
    kv_events: bool = False
    trace: str | None = None  # default: the bundled Mooncake trace
    session_rate: float | None = None  # conversations: one starts every 1/session_rate s
    block_size: int = field(init=False)
    _records: list[dict[str, Any]] = field(init=False, repr=False)
    _finish: npt.NDArray[np.float64] = field(init=False, repr=False)
    _span: float = field(init=False, repr=False)
    _events: list[CacheEvent] = field(init=False, repr=False, default_factory=list)
    _event_times: npt.NDArray[np.float64] = field(init=False, repr=False)
    _name: str = field(init=False, repr=False, default="mooncake")

    def __post_init__(self) -> None:
        from kvlens.simulate import run
        from kvlens.simulate.trace import BUNDLED, open_trace

        if not self.speed > 0:
            raise ValueError("speed must be > 0")
        trace = open_trace(self.trace or BUNDLED, session_rate=self.session_rate)
        self._name = trace.format
        self.capacity_blocks = self.capacity_blocks or CAPACITY_TOKENS // trace.block_size
        self.block_size = trace.block_size
        played: list[dict[str, Any]] = []
        fleet = run.Fleet(self.replicas, self.capacity_blocks, trace.block_size)
        now = [0.0]
        events = self._events

        def arrivals(requests: Iterable[TraceRequest]) -> Iterator[TraceRequest]:
            for request in requests:
                now[0] = request.arrival
                yield request

        class Capture:
            def __init__(self, replica: int) -> None:
                self.replica = replica

            def stored(self, blocks: Sequence[object], parent: object | None, scope: object = None) -> None:
                events.append((now[0], self.replica, True, tuple(blocks), parent))

            def removed(self, blocks: Sequence[object]) -> None:
                events.append((now[0], self.replica, False, tuple(blocks), None))

        run.simulate(
            arrivals(trace.requests()),
            fleet,
            self.policy,
            records=played.extend,
            events=Capture if self.kv_events else None,
        )
        finish = np.array([r["arrival_time"] + r["e2e_seconds"] for r in played])
        order = np.argsort(finish, kind="stable")
        self._records = [played[i] for i in order]
        self._finish = finish[order]
        self._span = float(finish.max()) + 1.0  # trace seconds before it starts again
        self._event_times = np.array([event[0] for event in events], dtype=np.float64)

    @property
    def loop_seconds(self) -> float:
        """Trace seconds of one loop."""
        return self._span

    def _windows(
        self, start: float, end: float, times: npt.NDArray[np.float64]
    ) -> Iterator[tuple[int, int, int]]:
        """(loop, first, last): the items of ``times`` (trace seconds, sorted) in each loop of the
        wall-clock window [start, end)."""
        low, high = ((t - self.origin) * self.speed for t in (start, end))
        for loop in range(max(int(low // self._span), 0), int(high // self._span) + 1):
            offset = loop * self._span
            first, last = np.searchsorted(times, [low - offset, high - offset], side="left")
            yield loop, int(first), int(last)

    def records(self, start: float, end: float) -> list[dict[str, Any]]:
        out = []
        for loop, first, last in self._windows(start, end, self._finish):
            offset = loop * self._span
            for played in self._records[first:last]:
                record = {k: v for k, v in played.items() if k not in ("prefix_hashes", "arm")}
                record["model"] = self.model
                record["request_id"] = f"{self._name}-{loop}-{played['request_id']}"
                record["arrival_time"] = self.origin + (played["arrival_time"] + offset) / self.speed
                out.append(record)
        return out

    def cache_events(self, start: float, end: float) -> list[tuple[int, CacheEvent]]:
        """(loop, event) for the cache events of the wall-clock window [start, end)."""
        return [
            (loop, event)
            for loop, first, last in self._windows(start, end, self._event_times)
            for event in self._events[first:last]
        ]


class ReplayKVEvents:
    """The replay's cache events as vLLM ``EventBatch`` messages into ``kv_events``'s consumer,
    in process: the decoding, ordering and classifying of ``kvlens serve --kv-events``, without
    the socket (so without pyzmq). Each loop of the trace is a new fleet: its replicas' blocks are
    cleared (``AllBlocksCleared``) and its blocks are new content (keys salted by the loop), so
    every loop shows the first loop's causes."""

    def __init__(self, traffic: ReplayTraffic, kv_events: KVEvents) -> None:
        import msgspec

        from kvlens.fleet.simulated import SimulatedEngine

        self.traffic = traffic
        self.consumer = kv_events.consumer
        self._encode = msgspec.msgpack.Encoder().encode
        self.engines = [
            SimulatedEngine(f"r{i}", traffic.block_size, self._emit) for i in range(traffic.replicas)
        ]
        self._seq = [0] * traffic.replicas
        self.loop = 0

    @staticmethod
    def names(replicas: int) -> list[str]:
        """The replicas' names: the ``replica`` the replay's records carry."""
        return [f"r{i}" for i in range(replicas)]

    def _emit(self, replica: str, event: Any) -> None:
        from kvlens.fleet.schema import KVEventBatch

        rank = int(replica[1:])
        batch = KVEventBatch(ts=time.time(), events=[event], data_parallel_rank=rank)
        self.consumer.message(replica, self._seq[rank], self._encode(batch), None)
        self._seq[rank] += 1

    def feed(self, start: float, end: float) -> None:
        from kvlens.fleet.keys import MASK64
        from kvlens.fleet.schema import AllBlocksCleared

        for loop, (_, replica, stored, blocks, parent) in self.traffic.cache_events(start, end):
            if loop != self.loop:
                for engine in self.engines:
                    self._emit(engine.name, AllBlocksCleared())
                self.loop = loop

            engine = self.engines[replica]
            keys = blocks if loop == 0 else [hash((loop, key)) & MASK64 for key in blocks]
            if not stored:
                engine.removed(keys)
            elif parent is None or loop == 0:
                engine.stored(keys, parent)
            else:
                engine.stored(keys, hash((loop, parent)) & MASK64)
