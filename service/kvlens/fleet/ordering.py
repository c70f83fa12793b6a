"""A publisher's messages checked, ordered and applied to the index (no sockets: tested alone).

Each message is ``[topic, sequence, payload]``:

- the sequence (8 bytes, big-endian) starts at 0 per publisher and goes up by one. A jump forward
  is a **gap** (the publisher's high-water mark dropped messages, or kvlens was slow): counted, and
  repaired from the publisher's replay endpoint when one is configured (a ``DEALER`` sends the
  first missing sequence to its ``ROUTER``, which answers the buffered ``[sequence, payload]``
  frames and ends with sequence -1; :mod:`kvlens.fleet.replay`, asked by
  :mod:`kvlens.fleet.subscriber`). A jump wider than ``MAX_SEQUENCE_GAP`` (2^32) is no loss but a
  **jump**, counted once. A sequence that goes back (0, or lower than seen) is a **restart**: the
  replica's blocks are all gone (as after ``AllBlocksCleared``);
- a payload that is no ``EventBatch`` is counted and dropped; unknown events and fields are
  counted and skipped (:func:`kvlens.fleet.wire.decode_batch`);
- batches of different publishers are applied in timestamp order after a reorder window
  (:mod:`kvlens.fleet.reorder`: the timestamp rule, one queue per replica), so that every
  process (shard) sees one order.

A restart is seen when the sequence goes back, or when the topic names another lifecycle of the
publisher than before (SGLang with a ``snapshot_endpoint``: ``\\x00sgl-kv-epoch=<uuid>``, a new
one at each start; :func:`kvlens.fleet.wire.sglang_epoch`): that lifecycle's sequence began at
0, so the batches before the first one kvlens gets are a gap, asked of the replay endpoint. A
vLLM publisher (no epoch) that restarted while kvlens was away and is already past the old
sequence looks like a gap (its old blocks stay held until their removals, which never come;
``AllBlocksCleared`` or kvlens's own restart clears them). SGLang's snapshot barriers (an empty
batch at the next sequence number, on the same socket) are applied as the empty batches they are.

A replica that left the fleet (:meth:`Consumer.vanished`; :mod:`kvlens.fleet.discovery`) has its
blocks removed and its slot in the index freed, in order with the batches still waiting; its
counters are kept for ``vanished_retention_seconds``, at most
:data:`~kvlens.fleet.limits.MAX_VANISHED` names. Past
:data:`~kvlens.fleet.limits.MAX_REPLICAS` live replicas a further one's batches are dropped and
counted, logged once, until a replica leaves.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from kvlens.fleet.index import FleetIndex
from kvlens.fleet.limits import MAX_REPLICAS, MAX_VANISHED, VANISHED_RETENTION_SECONDS
from kvlens.fleet.reorder import MAX_TIMESTAMP_LEAD_SECONDS, ReorderQueue, usable_timestamp
from kvlens.fleet.replay import MAX_REPLAY_FRAMES
from kvlens.fleet.schema import CLEARED as CLEARED_EVENT
from kvlens.fleet.schema import REMOVED, STORED
from kvlens.fleet.wire import MALFORMED, OTHER_GROUP, MalformedPayload, apply, batch_ts, decode_batch

log = logging.getLogger(__name__)
# A forward jump of a publisher's sequence wider than this is no loss (a vLLM engine, one batch a
# step, takes over a year at 100 steps a second to send as many; TensorRT-LLM's event_id, an event
# each, 5 days at 10k events a second between two drains): counted as one jump, not as missed
# batches or events (a jump to 2^63 - 1 added 9.2e18 to a counter that then shows no +1).
MAX_SEQUENCE_GAP: Final = 2**32
# What waits in the reorder queue in place of a payload: the replica's blocks are all gone (a
# restart), or the replica left the fleet (its slot in the index is freed too).
CLEARED: Final = "cleared"
VANISHED: Final = "vanished"
# STORED, REMOVED, CLEARED_EVENT: the keys of PublisherStatus.events


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
    gaps: int = 0  # gaps seen (jumps apart)
    jumps: int = 0  # forward jumps wider than MAX_SEQUENCE_GAP: no loss counted
    missed: int = 0  # batches lost in gaps not repaired
    replays: int = 0  # replays asked
    replayed: int = 0  # batches a replay brought back
    restarts: int = 0
    malformed_payloads: int = 0
    bad_timestamps: int = (
        0  # batches whose ts was absurd (reorder.usable_timestamp), ordered as of the newest
    )
    malformed_events: int = 0
    unknown_events: int = 0
    unknown_fields: int = 0
    other_group_events: int = 0  # events of KV cache groups not followed (kvlens.fleet.groups)
    errors: int = 0  # messages whose handling failed unexpectedly (a kvlens bug; logged)
    refused_batches: int = 0  # dropped: every replica slot of the index in use by others
    last_message: float = 0.0
    epoch: bytes | None = None  # the publisher's lifecycle, when its topic names one (SGLang)


class Consumer:
    """The sequence-checking, decoding, ordering and applying half, without sockets (tested alone).

    Publishers are independent: a process sees their batches interleaved as the network delivers
    them, and two processes (shards) may see another interleaving, which changes causes
    (which replica stored a block first). With ``reorder_seconds`` > 0 batches wait at most that
    long and are applied in the order of their ``ts`` (the publisher's clock, when usable; ties by
    replica, then arrival), a replica's own batches never reordered; a batch is released once a
    batch ``reorder_seconds`` newer has arrived, or once it has waited that long by ``clock``,
    whatever the other replicas send (:class:`~kvlens.fleet.reorder.ReorderQueue`). Processes
    that receive every batch within the window then apply them in the same order."""

    def __init__(
        self,
        index: FleetIndex,
        publishers: list[Publisher],
        *,
        reorder_seconds: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        vanished_retention_seconds: float = VANISHED_RETENTION_SECONDS,
        max_vanished: int = MAX_VANISHED,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """``clock`` times the waits (monotonic); ``wall_clock`` is what a batch's stamp may not
        run ahead of (:func:`~kvlens.fleet.reorder.usable_timestamp`)."""
        self.index = index
        self.status = {p.name: PublisherStatus() for p in publishers}
        self.reorder_seconds = reorder_seconds
        self.clock = clock
        self.wall_clock = wall_clock
        self._waiting = ReorderQueue(reorder_seconds)
        self._last_ts: dict[str, float] = {}  # each replica's last ordering timestamp
        self._bad_stamp_logged: set[str] = set()  # replicas whose absurd stamp was logged
        self.following = {p.name: p for p in publishers}
        self._refused: set[str] = set()  # replicas refused a slot, logged once each time
        self.vanished_retention_seconds = vanished_retention_seconds
        self.max_vanished = max_vanished
        self._vanished: dict[str, float] = {}  # forgotten replica -> when, oldest first

    def follow(self, wanted: dict[str, Publisher]) -> tuple[list[str], list[Publisher]]:
        """Follow the ``wanted`` publishers (a DNS answer's): the ones gone are :meth:`vanished`,
        the new ones added. Returns (gone, new), for the caller's subscriptions."""
        gone = [name for name in self.following if name not in wanted]
        for name in gone:
            self.vanished(name)
        new = [publisher for name, publisher in wanted.items() if name not in self.following]
        for publisher in new:
            self.add(publisher)
        return gone, new

    def add(self, publisher: Publisher) -> None:
        """A replica found after start (DNS discovery); one seen before keeps its counters."""
        with self.index.lock:  # snapshots copy the statuses under it
            self.status.setdefault(publisher.name, PublisherStatus())
        self.following[publisher.name] = publisher
        self._vanished.pop(publisher.name, None)  # back within the retention: its series stay

    def vanished(self, replica: str) -> None:
        """The replica left the fleet (its address left the DNS answer): its blocks are removed
        and its slot in the index freed, in order with the batches still waiting; if it comes
        back it starts a new sequence, as a new replica, its batches after the removal."""
        status = self.status[replica]
        status.up = 0
        status.next_seq = None
        status.epoch = None
        self.following.pop(replica, None)
        # not popped: a batch of its comeback stamped earlier must not pass the removal
        self._last_ts[replica] = self._waiting.newest
        now = self.clock()
        self._waiting.push(self._waiting.newest, replica, now, VANISHED, 0)
        self.release(now)

    def replay_from(self, replica: str, seq: int, epoch: bytes | None = None) -> int | None:
        """The first sequence number a replay should bring back before this message (the one
        :meth:`message` would ask ``replay`` for), or None: no gap, or one no replay answers."""
        expected, _ = _expected(self.status[replica], seq, epoch)
        if expected is None or seq <= expected or seq - expected > MAX_REPLAY_FRAMES:
            return None
        return expected

    def message(
        self,
        replica: str,
        seq: int,
        payload: bytes,
        replay: Callable[[int], list[tuple[int, bytes]]] | None,
        epoch: bytes | None = None,
    ) -> None:
        """One message from ``replica``'s publisher; ``replay(first)`` fetches what a gap lost.
        ``epoch``: the publisher's lifecycle, when its topic names one (SGLang); another than
        the last is a restart whatever the sequence, and the new lifecycle's sequence began at
        0, so what comes before ``seq`` is a gap."""
        status = self.status[replica]
        if epoch is None and seq == status.next_seq:  # the usual: _expected's answer, without the call
            expected: int | None = seq
            restarted = False
        else:
            expected, restarted = _expected(status, seq, epoch)
            if epoch is not None:
                status.epoch = epoch
        if seq == expected and not restarted and not self.reorder_seconds and not self._waiting:
            # the usual message (the next one, no window, nothing queued): applied now, as the
            # queue would at once, without its cost
            status.next_seq = seq + 1
            stamp = _stamp(status, payload)
            if stamp is not None:
                self._key(replica, status, stamp)
                self._waiting.arrived()
                self._apply(replica, status, payload)
            return
        payloads = [payload]
        if restarted:
            status.restarts += 1
            self._last_ts.pop(replica, None)
        if expected is not None and seq > expected and gap_or_jump(status, expected, seq):
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
        for data in payloads:
            stamp = _stamp(status, data)
            if stamp is None:
                continue
            key = self._key(replica, status, stamp)
            if restarted and not clear_queued:  # before the first batch of the new sequence
                self._waiting.push(key, replica, now, CLEARED, 0)
                clear_queued = True
            self._waiting.push(key, replica, now, data, len(data))
        if restarted and not clear_queued:  # the restarting batch was malformed
            self._waiting.push(self._waiting.newest, replica, now, CLEARED, 0)
        self.release(now)

    def _key(self, replica: str, status: PublisherStatus, stamp: float) -> float:
        """The batch's place in the order: its stamp when usable (:func:`usable_timestamp`), else
        the newest read (counted), never before the replica's previous batch."""
        if not usable_timestamp(stamp, self.wall_clock()):
            status.bad_timestamps += 1
            if replica not in self._bad_stamp_logged:
                self._bad_stamp_logged.add(replica)
                log.warning(
                    "kvlens: KV events replica %s sent a batch stamped %r, not within 0 and %.0f s ahead "
                    "of kvlens's clock: its events are used, ordered as of the newest batch read "
                    '(counted in kvlens_kv_events_rejected_total{reason="bad_timestamp"}; check its clock)',
                    replica,
                    stamp,
                    MAX_TIMESTAMP_LEAD_SECONDS,
                )
            stamp = self._waiting.newest
        last = self._last_ts.get(replica, -math.inf)
        key = last if last > stamp else stamp  # max(stamp, last), without the call
        self._last_ts[replica] = key
        if key > self._waiting.newest:
            self._waiting.newest = key
        return key

    def release(self, now: float | None = None, *, everything: bool = False) -> None:
        """Apply the batches whose wait is over (:class:`~kvlens.fleet.reorder.ReorderQueue`):
        a batch ``reorder_seconds`` newer came, or they waited that long; all with ``everything``."""
        now = self.clock() if now is None else now
        for replica, waiting in self._waiting.due(now, everything=everything):
            payload = waiting.payload
            if isinstance(payload, bytes):
                self._apply(replica, self.status[replica], payload)
                continue
            with self.index.lock:
                self.index.cleared(replica)
                if payload == VANISHED:
                    self.index.forget_replica(replica)
            if payload == VANISHED:  # a comeback refused again is logged again
                self._refused.discard(replica)
                if replica not in self.following:  # not back already: its series' wait starts
                    self._vanished.pop(replica, None)  # kept in order of time
                    self._vanished[replica] = now
        self._drop_vanished(now)

    def _drop_vanished(self, now: float) -> None:
        """Drop the status and counters of the replicas gone for the retention, and of the
        oldest past :attr:`max_vanished` (cheap when none is due: the oldest is looked at)."""
        vanished = self._vanished
        while vanished:
            name, since = next(iter(vanished.items()))
            if len(vanished) <= self.max_vanished and now < since + self.vanished_retention_seconds:
                return
            del vanished[name]
            with self.index.lock:  # snapshots copy the statuses under it
                self.status.pop(name, None)
                self.index.drop_forgotten(name)
            self._last_ts.pop(name, None)

    def admitted(self, replica: str, status: PublisherStatus) -> bool:
        """Whether the index has a slot for ``replica`` (called under the index's lock); else its
        batch is dropped and counted, and the refusal logged once (not per batch) until a slot
        frees up and takes it."""
        if self.index.admit(replica):
            self._refused.discard(replica)
            return True
        status.refused_batches += 1
        if replica not in self._refused:
            self._refused.add(replica)
            log.error(
                "kvlens: KV events replica %s refused: the index follows at most %d replicas at once, "
                "all in use; its events are dropped (counted) until a replica leaves",
                replica,
                MAX_REPLICAS,
            )
        return False

    def _apply(self, replica: str, status: PublisherStatus, payload: bytes) -> None:
        status.batches += 1
        index = self.index
        with index.lock:
            # admitted() only when a slot is refused, now or before (its log to reset)
            if (self._refused or not index.admit(replica)) and not self.admitted(replica, status):
                return
            # the usual payload: read and applied in one compiled call
            tally = index.apply_payload(replica, payload)
            if tally is not None:
                stored, removed, cleared, malformed = tally  # other groups' events: msgspec's path
                events = status.events
                if stored:
                    events[STORED] += stored
                if removed:
                    events[REMOVED] += removed
                if cleared:
                    events[CLEARED_EVENT] += cleared
                status.malformed_events += malformed
                return
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


def gap_or_jump(status: PublisherStatus, expected: int, seq: int) -> bool:
    """A replica's numbering went forward from ``expected`` (due next) to ``seq``: a **gap**,
    counted, whose skipped numbers the caller repairs or counts missed (True); or, wider than
    :data:`MAX_SEQUENCE_GAP`, a **jump**, counted once, no loss (False: garbage, or a publisher
    that does not number from 0; the blocks held stay). The one rule of both numberings, a
    ZeroMQ publisher's sequence and TensorRT-LLM's ``event_id`` (:mod:`kvlens.fleet.trtllm`)."""
    if seq - expected > MAX_SEQUENCE_GAP:
        status.jumps += 1
        return False
    status.gaps += 1
    return True


def _expected(status: PublisherStatus, seq: int, epoch: bytes | None) -> tuple[int | None, bool]:
    """(the sequence number due next, whether the publisher restarted) for a message numbered
    ``seq`` of lifecycle ``epoch``: a new lifecycle numbers from 0 again; a number that went back
    is a restart with nothing due (no gap before it)."""
    expected = status.next_seq
    if expected is None:
        return None, False
    if epoch is not None and status.epoch is not None and epoch != status.epoch:
        return 0, True
    if seq < expected:
        return None, True
    return expected, False


def _stamp(status: PublisherStatus, payload: bytes) -> float | None:
    """The batch's timestamp, or None for a payload too broken to have one (counted, dropped)."""
    try:
        return batch_ts(payload)
    except MalformedPayload:
        status.batches += 1
        status.malformed_payloads += 1
        return None
