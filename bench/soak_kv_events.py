"""The soak's ``kv-events`` attack: honest replicas publishing KV events beside a hostile one.

Three honest replicas publish in vLLM's wire format (:class:`tests.kv_publisher.TestPublisher`,
every message kept: SNDHWM 0; each with its replay endpoint):
- ``honest-0`` and ``honest-1`` each one ``EventBatch`` every HONEST_EVERY_SECONDS: a chain of 4
  blocks stored and the chain stored HONEST_HELD_CHAINS batches before removed, over a pool of
  HONEST_CHAINS chains the two share (so the index reaches its size in the warm-up and stays
  there: RSS is to be flat). Two publishers at that pace keep kvlens's subscriber thread from
  ever being idle for its 100 ms poll, as a real fleet does;
- ``large`` every LARGE_EVERY_SECONDS (first within the warm-up) stores LARGE_REPLICA_BLOCKS
  blocks (20 batches of 10,000, the same blocks each time, so the index does not grow from one
  to the next), then clears them all (``AllBlocksCleared``).

A hostile replica (``hostile``) takes one step every HOSTILE_STEP_SECONDS, in turn, each storing
chains of a pool of HOSTILE_CHAINS:
- ``nan-ts``: a batch whose ``ts`` is NaN; ``absurd-ts``: a batch whose ``ts`` is 1e18;
- ``wrong-replay``: GAP_BURST sequence gaps in a row; its replay endpoint (a ROUTER of ours, not
  the publisher's) answers each request WRONG_FRAME_AFTER_SECONDS after it, just before
  kvlens's 2 s replay timeout, with one wrong frame (another sequence number) and the end marker;
- ``seq-jump``: a batch at sequence 2^63-1, then the sequence starts again from 0 (a restart);
- ``re-store-tiers``: the same chain stored again in GPU, CPU, CPU_PINNED and DISK, then in GPU
  once more (blocks already held, stored again in several tiers).

Pass conditions (:meth:`KVEventsAttack.failures`): every honest batch applied by the end
(``kvlens_kv_event_batches_total{replica}`` == batches sent, after the soak's settle), no honest
batch waiting more than HONEST_DELAY_BOUND_SECONDS to be applied (seen from the soak's scrapes:
the oldest batch not yet counted), ``kvlens_kv_missed_batches_total`` below MISSED_BOUND in every
scrape, no ``kvlens_kv_events_rejected_total{reason="error"}`` (a kvlens bug), and no
``kvlens_kv_blocks_held`` below 0 or above what the replica stored and kept (MOST_HELD).
"""

from __future__ import annotations

import itertools
import json
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable

import msgspec
import zmq
from prometheus_client.metrics_core import Metric
from tests.kv_publisher import TestPublisher
from tests.live import free_port

from kvlens.fleet.publisher import END_SEQ
from kvlens.fleet.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

HONEST = ("honest-0", "honest-1")
LARGE = "large"
COUNTED = (*HONEST, LARGE)  # the honest replicas: every batch they send must be applied
HOSTILE = "hostile"
BLOCK_SIZE = 16
HONEST_EVERY_SECONDS = 0.05
# stride 7 is prime to it: a chain comes back only after every other one, within the warm-up
HONEST_CHAINS = 256
HONEST_HELD_CHAINS = 64
CHAIN_BLOCKS = 4
HOSTILE_STEP_SECONDS = 2.0
HOSTILE_CHAINS = 16
LARGE_REPLICA_BLOCKS = 200_000
LARGE_BATCH_BLOCKS = 10_000
LARGE_EVERY_SECONDS = 12.0
GAP_BURST = 5
WRONG_FRAME_AFTER_SECONDS = 1.8  # kvlens's replay timeout is 2 s
SEQ_JUMP = 2**63 - 1
HONEST_DELAY_BOUND_SECONDS = 10.0  # the reorder window (0.25 s) and one replay timeout (2 s), with room
MISSED_BOUND = 1e6
HOSTILE_STEPS = ("nan-ts", "absurd-ts", "wrong-replay", "seq-jump", "re-store-tiers")
HONEST_BASE, HOSTILE_BASE, LARGE_BASE = 1 << 40, 2 << 40, 3 << 40
# The most blocks a replica can hold in a tier (medium label): what it stored there and did not
# remove or clear. Any other tier: none.
MOST_HELD = {
    **{(name, "GPU"): (HONEST_HELD_CHAINS + 1) * CHAIN_BLOCKS for name in HONEST},
    (LARGE, "GPU"): LARGE_REPLICA_BLOCKS,
    (HOSTILE, "GPU"): HOSTILE_CHAINS * CHAIN_BLOCKS,
    (HOSTILE, "CPU"): HOSTILE_CHAINS * CHAIN_BLOCKS,  # CPU and CPU_PINNED
    (HOSTILE, "STORAGE"): HOSTILE_CHAINS * CHAIN_BLOCKS,  # DISK
}


def chain(first_hash: int, blocks: int, medium: str = "GPU") -> BlockStored:
    """A store of ``blocks`` chained blocks (each the parent of the next), token ids drawn from
    the hashes (the index keys blocks by content: equal hashes, equal tokens, one block)."""
    hashes: list[int | bytes] = list(range(first_hash, first_hash + blocks))
    tokens = [(h * 31 + j) % 128 for h in range(first_hash, first_hash + blocks) for j in range(BLOCK_SIZE)]
    return BlockStored(hashes, None, tokens, BLOCK_SIZE, None, medium, None)


class KVEventsAttack:
    def __init__(self, attacked: Callable[[str], None]) -> None:
        self.attacked = attacked
        self.honest = {name: TestPublisher(free_port(), replay_port=free_port()) for name in COUNTED}
        self.hostile = TestPublisher(free_port())
        self.hostile_replay = f"tcp://127.0.0.1:{free_port()}"
        self.router: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(self.hostile_replay)
        self.sent = dict.fromkeys(COUNTED, 0)
        self.sent_at: dict[str, list[float]] = {name: [] for name in COUNTED}  # monotonic, in order
        self.applied = dict.fromkeys(COUNTED, 0.0)
        self.steps: Counter[str] = Counter()
        self.large_clears = 0
        self.replays_answered = 0
        self.worst_delay, self.worst_delayed = 0.0, ""  # the oldest honest batch not counted, at worst
        self.worst_missed = 0.0
        self.errors = 0.0
        self.lowest_held = 0.0
        self.held_too_many: dict[str, float] = {}  # replica/medium past MOST_HELD: the most seen
        self.index_bytes = self.warm_index_bytes = 0.0  # kvlens_kv_index_memory_bytes: now, after warm-up

    def settings(self) -> dict[str, str]:
        publishers = [
            {"name": name, "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint}
            for name, pub in self.honest.items()
        ]
        publishers.append(
            {"name": HOSTILE, "endpoint": self.hostile.endpoint, "replay_endpoint": self.hostile_replay}
        )
        return {"KVLENS_KV_EVENTS": json.dumps(publishers)}

    def wait_subscribed(self, timeout_seconds: float) -> None:
        for pub in (*self.honest.values(), self.hostile):
            pub.wait_subscribed(timeout_seconds)

    def jobs(self, stop: threading.Event) -> list[tuple[Callable[..., None], tuple[object, ...]]]:
        jobs: list[tuple[Callable[..., None], tuple[object, ...]]] = [
            (self.publish_honestly, (name, number, stop)) for number, name in enumerate(HONEST)
        ]
        jobs.append((self.publish_large, (stop,)))
        return [*jobs, (self.publish_hostile, (stop,)), (self.answer_replays, (stop,))]

    def _send(self, name: str, events: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> None:
        self.sent_at[name].append(time.monotonic())  # before the send: a delay is never understated
        self.honest[name].publish_events(events)
        self.sent[name] += 1

    def publish_honestly(self, name: str, number: int, stop: threading.Event) -> None:
        stored = []
        for step in itertools.count():
            if stop.wait(HONEST_EVERY_SECONDS):
                return
            chain_number = (step * 7 + number * 13) % HONEST_CHAINS
            first = HONEST_BASE + chain_number * CHAIN_BLOCKS
            events: list[BlockStored | BlockRemoved | AllBlocksCleared] = [chain(first, CHAIN_BLOCKS)]
            stored.append(first)
            if len(stored) > HONEST_HELD_CHAINS:
                old = stored.pop(0)
                events.append(BlockRemoved(list(range(old, old + CHAIN_BLOCKS)), "GPU"))
            self._send(name, events)

    def publish_large(self, stop: threading.Event) -> None:
        stores = [
            chain(LARGE_BASE + first, LARGE_BATCH_BLOCKS)
            for first in range(0, LARGE_REPLICA_BLOCKS, LARGE_BATCH_BLOCKS)
        ]
        for number in itertools.count():
            if stop.wait(HOSTILE_STEP_SECONDS if number == 0 else LARGE_EVERY_SECONDS):
                return
            for store in stores:
                self._send(LARGE, [store])
            self._send(LARGE, [AllBlocksCleared()])
            self.large_clears += 1

    def publish_hostile(self, stop: threading.Event) -> None:
        pub = self.hostile
        small = itertools.cycle(range(HOSTILE_CHAINS))
        encode = msgspec.msgpack.Encoder().encode

        def batch(ts: float | None = None, medium: str = "GPU") -> bytes:
            events: list[BlockStored | BlockRemoved | AllBlocksCleared] = [
                chain(HOSTILE_BASE + next(small) * CHAIN_BLOCKS, CHAIN_BLOCKS, medium)
            ]
            return encode(KVEventBatch(ts=time.time() if ts is None else ts, events=events))

        for step in itertools.cycle(HOSTILE_STEPS):
            if stop.wait(HOSTILE_STEP_SECONDS):
                return
            self.steps[step] += 1
            self.attacked("kv-events")
            if step == "nan-ts":
                pub.publish(batch(math.nan))
            elif step == "absurd-ts":
                pub.publish(batch(1e18))
            elif step == "wrong-replay":
                for _ in range(GAP_BURST):
                    pub.drop(batch())  # never sent: a gap, asked of the hostile replay endpoint
                    pub.publish(batch())
            elif step == "seq-jump":
                with pub._lock:
                    pub.seq = SEQ_JUMP
                pub.publish(batch())
                pub.restart()
                pub.publish(batch())
            else:  # re-store-tiers
                first = HOSTILE_BASE + next(small) * CHAIN_BLOCKS
                tiers = ("GPU", "CPU", "CPU_PINNED", "DISK", "GPU")
                pub.publish_events([chain(first, CHAIN_BLOCKS, medium) for medium in tiers])

    def answer_replays(self, stop: threading.Event) -> None:
        """Each replay request: nothing until just before kvlens's timeout, then one frame of
        another sequence than asked, then the end marker."""
        router = self.router
        while not stop.is_set():
            if not router.poll(100):
                continue
            frames = router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            if stop.wait(WRONG_FRAME_AFTER_SECONDS):
                return
            wrong = int.from_bytes(start, "big") + 1000
            empty_batch = b"\x93\xcb" + bytes(8) + b"\x90\xc0"  # [0.0, [], None]
            router.send_multipart([client, b"", wrong.to_bytes(8, "big"), empty_batch])
            router.send_multipart([client, b"", END_SEQ, b""])
            self.replays_answered += 1

    def observe(self, at: float, families: Iterable[Metric]) -> None:
        """A scrape's figures, ``at`` its start (monotonic): what was counted then was applied
        before it, so a batch sent before ``at`` and not counted had waited at least that long."""
        for family in families:
            for sample in family.samples:
                name, replica = sample.name, sample.labels.get("replica")
                if name == "kvlens_kv_event_batches_total" and replica in self.applied:
                    self.applied[replica] = sample.value
                    sent_at = self.sent_at[replica]
                    oldest = int(sample.value)
                    if oldest < len(sent_at) and at - sent_at[oldest] > self.worst_delay:
                        self.worst_delay, self.worst_delayed = at - sent_at[oldest], replica
                elif name == "kvlens_kv_missed_batches_total":
                    self.worst_missed = max(self.worst_missed, sample.value)
                elif name == "kvlens_kv_events_rejected_total" and sample.labels.get("reason") == "error":
                    self.errors = max(self.errors, sample.value)
                elif name == "kvlens_kv_blocks_held":
                    self.lowest_held = min(self.lowest_held, sample.value)
                    medium = sample.labels.get("medium")
                    if sample.value > MOST_HELD.get((str(replica), str(medium)), 0):
                        where = f"{replica}/{medium}"
                        self.held_too_many[where] = max(sample.value, self.held_too_many.get(where, 0))
                elif name == "kvlens_kv_index_memory_bytes":
                    self.index_bytes = sample.value

    def warmed_up(self) -> None:
        self.warm_index_bytes = self.index_bytes

    def settled(self) -> bool:
        """Every honest batch sent was applied (by the last observation)."""
        return all(self.applied[name] >= self.sent[name] for name in COUNTED)

    def report(self) -> list[str]:
        sent, applied = sum(self.sent.values()), int(sum(self.applied.values()))
        steps = ", ".join(f"{step} {self.steps[step]}" for step in HOSTILE_STEPS)
        return [
            f"  KV honest batches sent {sent:,}  applied {applied:,}  ({', '.join(COUNTED)}; "
            f"{self.large_clears} large clears)",
            f"  KV honest delay   at worst {self.worst_delay:.1f} s (bound {HONEST_DELAY_BOUND_SECONDS:g})",
            f"  KV hostile steps  {steps}; wrong replays answered {self.replays_answered}",
            f"  KV missed batches at most {self.worst_missed:.3g} (bound {MISSED_BOUND:.0e}), "
            f"errors {self.errors:g}, lowest blocks held {self.lowest_held:g}",
            f"  KV index memory   {self.warm_index_bytes / 2**20:.1f} MiB after warm-up, "
            f"{self.index_bytes / 2**20:.1f} MiB at the end (kvlens_kv_index_memory_bytes)",
        ]

    def failures(self) -> list[str]:
        failed = []
        for name in COUNTED:
            if self.applied[name] != self.sent[name]:
                failed.append(
                    f"kv-events: {name} sent {self.sent[name]} batches, {self.applied[name]:g} applied"
                )
        if self.worst_delay > HONEST_DELAY_BOUND_SECONDS:
            failed.append(
                f"kv-events: a batch of {self.worst_delayed} waited {self.worst_delay:.1f} s to be applied "
                f"(bound {HONEST_DELAY_BOUND_SECONDS:g} s)"
            )
        if not self.worst_missed < MISSED_BOUND:
            failed.append(f"kv-events: kvlens_kv_missed_batches_total reached {self.worst_missed:.3g}")
        if self.errors:
            failed.append(
                f'kv-events: {self.errors:g} errors (kvlens_kv_events_rejected_total{{reason="error"}})'
            )
        if self.lowest_held < 0:
            failed.append(f"kv-events: kvlens_kv_blocks_held fell to {self.lowest_held:g}")
        if self.held_too_many:
            held = ", ".join(f"{where} {most:g}" for where, most in sorted(self.held_too_many.items()))
            failed.append(
                f"kv-events: kvlens_kv_blocks_held above what the replica stored and kept in that tier "
                f"(0 in a tier it never stored in): {held}"
            )
        return failed

    def close(self) -> None:
        for pub in (*self.honest.values(), self.hostile):
            pub.close()
        self.router.close(0)
