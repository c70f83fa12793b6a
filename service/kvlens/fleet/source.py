"""Subscribe to the fleet's KV event publishers and feed the index (needs the ``kv-events`` extra).

One thread runs every subscription: a ZeroMQ ``SUB`` socket per publisher (vLLM's default
``tcp://*:5557`` binds, so kvlens connects to each replica), polled together. Each message is
``[topic, sequence, payload]``:

- the sequence (8 bytes, big-endian) starts at 0 per publisher and goes up by one. A jump forward
  is a **gap** (the publisher's high-water mark dropped messages, or kvlens was slow): counted, and
  repaired from the publisher's replay endpoint when one is configured (a ``DEALER`` sends the
  first missing sequence to its ``ROUTER``, which answers the buffered ``[sequence, payload]``
  frames and ends with sequence -1). A sequence that goes back (0, or lower than seen) is a
  **restart**: the replica's blocks are all gone (as after ``AllBlocksCleared``);
- a payload that is no ``EventBatch`` is counted and dropped; unknown events and fields are
  counted and skipped (:func:`kvlens.fleet.wire.decode_batch`);
- batches of different publishers are applied in timestamp order after a reorder window
  (:class:`Consumer`), so that every process (shard) sees one order.

A restart is seen only when the sequence goes back: a publisher that restarted while kvlens was
away and is already past the old sequence looks like a gap (its old blocks stay held until their
removals, which never come; ``AllBlocksCleared`` or kvlens's own restart clears them).

A replay that does not answer within ``replay_timeout_seconds`` leaves the gap unrepaired (counted
as such), and that publisher's next gaps for ``REPLAY_QUIET_TIMEOUTS`` timeouts are not asked for;
a gap wider than ``MAX_REPLAY_FRAMES`` is never asked for. Nothing here raises out of the thread:
an unexpected error is logged and counted.
"""

from __future__ import annotations

import heapq
import importlib.util
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Final

from kvlens.errors import SettingsError
from kvlens.fleet.index import FleetIndex, IndexSnapshot
from kvlens.fleet.wire import MALFORMED, OTHER_GROUP, MalformedPayload, apply, batch_ts, decode_batch

log = logging.getLogger(__name__)
END_SEQ: Final = -1
MAX_REPLAY_FRAMES: Final = 100_000  # one replay answer at most (vLLM's buffer_steps is 10,000)
# After a replay that repaired nothing, the publisher's gaps are missed without asking for this
# many replay timeouts: one thread serves every publisher, and a publisher that skips a number in
# every message with a dead replay endpoint would hold it replay_timeout_seconds a message.
REPLAY_QUIET_TIMEOUTS: Final = 10
# A message past this closes the connection (ZMQ_MAXMSGSIZE; ZeroMQ reconnects): a vLLM batch
# is one engine step's events, well under a MiB.
MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
# Batches waiting for the reorder window (kept as received, read when applied) hold at most this
# many bytes; past it the oldest are applied at once (a publisher whose timestamps do not move,
# or a burst, cannot make kvlens hold more).
MAX_WAITING_BYTES: Final = 8 * 1024 * 1024


@dataclass(frozen=True)
class Publisher:
    name: str  # the replica label
    endpoint: str  # tcp://host:port of its PUB socket
    replay_endpoint: str | None = None
    topic: str = ""


@dataclass
class PublisherStatus:
    up: int = 0  # 1 while the SUB socket is connected to the publisher (handshake done)
    next_seq: int | None = None
    events: Counter[str] = field(default_factory=Counter)  # event type -> received
    batches: int = 0
    gaps: int = 0  # gaps seen
    missed: int = 0  # batches lost in gaps not repaired
    replays: int = 0  # replays asked
    replayed: int = 0  # batches a replay brought back
    restarts: int = 0
    malformed_payloads: int = 0
    malformed_events: int = 0
    unknown_events: int = 0
    unknown_fields: int = 0
    other_group_events: int = 0  # events of KV cache groups past the first, left out
    errors: int = 0  # messages whose handling failed unexpectedly (a kvlens bug; logged)
    last_message: float = 0.0


class Consumer:
    """The sequence-checking, decoding, ordering and applying half, without sockets (tested alone).

    Publishers are independent: a process sees their batches interleaved as the network delivers
    them, and two processes (shards) may see another interleaving, which changes causes
    (which replica stored a block first). With ``reorder_seconds`` > 0 batches wait that long
    and are applied in the order of their ``ts`` (the publisher's clock; ties by replica, then
    arrival), a replica's own batches never reordered; a batch is released once a batch
    ``reorder_seconds`` newer has arrived, or, when no publisher has anything more to read, once
    it has waited that long by ``clock``. Processes that receive every batch within the window
    then apply them in the same order."""

    def __init__(
        self,
        index: FleetIndex,
        publishers: list[Publisher],
        *,
        reorder_seconds: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.status = {p.name: PublisherStatus() for p in publishers}
        self.reorder_seconds = reorder_seconds
        self.clock = clock
        # (ts, replica, arrival, received at, payload or None: the replica restarted, bytes)
        self._waiting: list[tuple[float, str, int, float, bytes | None, int]] = []
        self._waiting_bytes = 0
        self._arrival = 0
        self._newest = -math.inf
        self._last_ts: dict[str, float] = {}

    def message(
        self, replica: str, seq: int, payload: bytes, replay: Callable[[int], list[tuple[int, bytes]]] | None
    ) -> None:
        """One message from ``replica``'s publisher; ``replay(first)`` fetches what a gap lost."""
        status = self.status[replica]
        expected = status.next_seq
        payloads = [payload]
        restarted = expected is not None and seq < expected
        if restarted:
            status.restarts += 1
            self._last_ts.pop(replica, None)
        elif expected is not None and seq > expected:
            status.gaps += 1
            repaired = False
            # a gap wider than any replay answer cannot be repaired: not asked, nor its numbers listed
            if replay is not None and seq - expected <= MAX_REPLAY_FRAMES:
                status.replays += 1
                frames = [(s, p) for s, p in replay(expected) if expected <= s < seq]
                if [number for number, _ in frames] == list(range(expected, seq)):
                    payloads = [replayed for _, replayed in frames] + payloads
                    status.replayed += len(frames)
                    repaired = True
            if not repaired:
                status.missed += seq - expected
        status.next_seq = seq + 1
        now = self.clock()
        clear_queued = False
        for position, data in enumerate(payloads):
            try:
                stamp = batch_ts(data)
            except MalformedPayload:
                status.batches += 1
                status.malformed_payloads += 1
                continue
            # a replica's batches keep their order even if its clock steps back
            ts = max(stamp, self._last_ts.get(replica, -math.inf))
            self._last_ts[replica] = ts
            if restarted and position == len(payloads) - 1:
                self._wait(ts, replica, now, None, 0)
                clear_queued = True
            self._wait(ts, replica, now, data, len(data))
        if restarted and not clear_queued:  # the restarting batch was malformed
            self._wait(self._newest, replica, now, None, 0)
        self.release(now, idle=False)

    def _wait(self, ts: float, replica: str, now: float, payload: bytes | None, size: int) -> None:
        heapq.heappush(self._waiting, (ts, replica, self._arrival, now, payload, size))
        self._arrival += 1
        self._waiting_bytes += size
        if ts > self._newest:
            self._newest = ts

    def release(self, now: float | None = None, *, idle: bool = True, everything: bool = False) -> None:
        """Apply the batches whose wait is over: a newer batch came, or (``idle``: nothing left to
        read, so nothing older is on its way) they waited long enough; all with ``everything``."""
        now = self.clock() if now is None else now
        waiting, window = self._waiting, self.reorder_seconds
        while waiting:
            ts, replica, _, received, payload, size = waiting[0]
            if not (
                everything
                or ts <= self._newest - window
                or (idle and received <= now - window)
                or self._waiting_bytes > MAX_WAITING_BYTES
            ):
                return
            heapq.heappop(waiting)
            self._waiting_bytes -= size
            if payload is None:
                with self.index.lock:
                    self.index.cleared(replica)
            else:
                self._apply(replica, self.status[replica], payload)

    def _apply(self, replica: str, status: PublisherStatus, payload: bytes) -> None:
        status.batches += 1
        try:
            decoded = decode_batch(payload)
        except MalformedPayload:  # its ts was readable, its events are not
            status.malformed_payloads += 1
            return
        status.unknown_events += decoded.unknown_events
        status.unknown_fields += decoded.unknown_fields
        status.malformed_events += decoded.malformed_events
        with self.index.lock:
            for event in decoded.events:
                status.events[str(event.__struct_config__.tag)] += 1
                outcome = apply(self.index, replica, event)
                if outcome == MALFORMED:
                    status.malformed_events += 1
                elif outcome == OTHER_GROUP:
                    status.other_group_events += 1


class KVEventsSource:
    """The subscriptions' thread. ``start`` / ``stop`` from the app's lifespan."""

    def __init__(
        self,
        consumer: Consumer,
        publishers: list[Publisher],
        *,
        replay_timeout_seconds: float = 2.0,
        poll_milliseconds: int = 100,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import zmq  # the kv-events extra: imported only when a publisher is configured

        self._zmq = zmq
        self.consumer = consumer
        self.publishers = publishers
        self.replay_timeout_seconds = replay_timeout_seconds
        self.poll_milliseconds = poll_milliseconds
        self.clock = clock
        self.errors = 0
        self._context = zmq.Context()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()  # set once every SUB socket is connected
        self._replay_quiet_until: dict[str, float] = {}  # publisher -> no replay asked before

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvlens-kv-events", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._context.term()

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        sockets: dict[Any, Publisher] = {}
        monitors: dict[Any, Publisher] = {}
        for publisher in self.publishers:
            sub = self._context.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sub.setsockopt(zmq.SUBSCRIBE, publisher.topic.encode())
            # PUB sends nothing while the engine is idle: the connection, not the traffic, says up;
            # a finished ZMTP handshake, not the TCP connect (anything that accepts TCP does that)
            monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            sub.connect(publisher.endpoint)
            sockets[sub] = publisher
            monitors[monitor] = publisher
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
        self.ready.set()
        try:
            while not self._stop.is_set():
                ready = poller.poll(self.poll_milliseconds)
                if not ready:
                    self.consumer.release(idle=True)  # nothing older is on its way
                for socket, _ in ready:
                    publisher = sockets.get(socket) or monitors[socket]
                    try:
                        if socket in sockets:
                            self._receive(socket, publisher)
                        else:
                            self._connection(socket, publisher)
                    except Exception:  # a bug must not end the subscriptions
                        log.exception("kvlens: KV events from %s failed", publisher.name)
                        self.errors += 1
                        self.consumer.status[publisher.name].errors += 1
        finally:
            self.consumer.release(everything=True)
            for sub in sockets:
                sub.disable_monitor()
                sub.close(0)
            for monitor in monitors:
                monitor.close(0)

    def _connection(self, monitor: Any, publisher: Publisher) -> None:
        from zmq.utils.monitor import recv_monitor_message

        event = recv_monitor_message(monitor)["event"]
        status = self.consumer.status[publisher.name]
        status.up = 1 if event == self._zmq.EVENT_HANDSHAKE_SUCCEEDED else 0

    def _receive(self, sub: Any, publisher: Publisher) -> None:
        zmq = self._zmq
        for _ in range(100):  # a few, then the other publishers' turn (their batches may be older)
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            status = self.consumer.status[publisher.name]
            status.last_message = self.clock()
            if len(frames) != 3 or len(frames[1]) != 8:
                status.malformed_payloads += 1
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            quiet = self._replay_quiet_until.get(publisher.name, -math.inf) > status.last_message
            replay = None if publisher.replay_endpoint is None or quiet else self._replayer(publisher)
            self.consumer.message(publisher.name, seq, frames[2], replay)

    def _replayer(self, publisher: Publisher) -> Callable[[int], list[tuple[int, bytes]]]:
        zmq = self._zmq

        endpoint = publisher.replay_endpoint
        assert endpoint is not None

        def replay(first: int) -> list[tuple[int, bytes]]:
            frames = ask(first)
            if not frames:
                quiet = REPLAY_QUIET_TIMEOUTS * self.replay_timeout_seconds
                self._replay_quiet_until[publisher.name] = self.clock() + quiet
            return frames

        def ask(first: int) -> list[tuple[int, bytes]]:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            try:
                socket.connect(endpoint)
                # A ROUTER sees [identity, empty, start] from a REQ; a DEALER adds the empty frame.
                socket.send_multipart([b"", first.to_bytes(8, "big")])
                frames: list[tuple[int, bytes]] = []
                deadline = self.clock() + self.replay_timeout_seconds
                while len(frames) < MAX_REPLAY_FRAMES:
                    left = deadline - self.clock()
                    if left <= 0 or not socket.poll(max(1, int(left * 1000))):
                        return []  # no full answer: the gap stays unrepaired
                    parts = socket.recv_multipart()
                    if len(parts) != 3 or len(parts[1]) != 8:
                        return []
                    seq = int.from_bytes(parts[1], "big", signed=True)
                    if seq == END_SEQ:
                        return frames
                    frames.append((seq, parts[2]))
                return []
            finally:
                socket.close(0)

        return replay


@dataclass
class KVEventsSnapshot:
    index: IndexSnapshot
    publishers: dict[str, PublisherStatus]
    errors: int


class KVEvents:
    """The index, the consumer and (once started) the subscriptions: what ``serve`` runs and what
    the collector reads."""

    def __init__(self, publishers: list[Publisher], index: FleetIndex, reorder_seconds: float = 0.0) -> None:
        if importlib.util.find_spec("zmq") is None:  # before serving, not when the lifespan starts
            raise SettingsError("kv_events needs the kv-events extra: pip install 'kvlens[kv-events]'")
        self.publishers = publishers
        self.index = index
        self.consumer = Consumer(index, publishers, reorder_seconds=reorder_seconds)
        self.source: KVEventsSource | None = None

    def start(self) -> None:
        self.source = KVEventsSource(self.consumer, self.publishers)
        self.source.start()

    def stop(self) -> None:
        if self.source is not None:
            self.source.stop()

    def snapshot(self) -> KVEventsSnapshot:
        index = self.index.snapshot()
        with self.index.lock:  # the consumer counts events under it
            publishers = {
                name: replace(status, events=Counter(status.events))
                for name, status in self.consumer.status.items()
            }
        return KVEventsSnapshot(index, publishers, 0 if self.source is None else self.source.errors)
