"""Subscribe to the fleet's KV event publishers and feed the index (needs the ``kv-events`` extra).

One thread runs every subscription: a ZeroMQ ``SUB`` socket per publisher (vLLM's default
``tcp://*:5557`` binds, so kvlens connects to each replica), polled together. Each message is
``[topic, sequence, payload]``:

- the sequence (8 bytes, big-endian) starts at 0 per publisher and goes up by one. A jump forward
  is a **gap** (the publisher's high-water mark dropped messages, or kvlens was slow): counted, and
  repaired from the publisher's replay endpoint when one is configured (a ``DEALER`` sends the
  first missing sequence to its ``ROUTER``, which answers the buffered ``[sequence, payload]``
  frames and ends with sequence -1; :mod:`kvlens.fleet.replay`). A jump wider than
  ``MAX_SEQUENCE_GAP`` (2^32) is no loss but a **jump**, counted once. A sequence that goes back
  (0, or lower than seen) is a **restart**: the replica's blocks are all gone (as after
  ``AllBlocksCleared``);
- a payload that is no ``EventBatch`` is counted and dropped; unknown events and fields are
  counted and skipped (:func:`kvlens.fleet.wire.decode_batch`);
- batches of different publishers are applied in timestamp order after a reorder window
  (:mod:`kvlens.fleet.reorder`: the timestamp rule, one queue per replica), so that every
  process (shard) sees one order.

A restart is seen when the sequence goes back, or when the topic names another lifecycle of the
publisher than before (SGLang with a ``snapshot_endpoint``: ``\x00sgl-kv-epoch=<uuid>``, a new
one at each start; :func:`kvlens.fleet.wire.sglang_epoch`): that lifecycle's sequence began at
0, so the batches before the first one kvlens gets are a gap, asked of the replay endpoint. A
vLLM publisher (no epoch) that restarted while kvlens was away and is already past the old
sequence looks like a gap (its old blocks stay held until their removals, which never come;
``AllBlocksCleared`` or kvlens's own restart clears them). SGLang's snapshot barriers (an empty
batch at the next sequence number, on the same socket) are applied as the empty batches they are.

A replay's ``DEALER`` is polled with the ``SUB`` sockets: only the gappy publisher's stream waits
for it (its ``SUB`` is not read meanwhile), the others are read and applied. A replay that does
not answer within ``replay_timeout_seconds``, or answers one wrong frame, leaves the gap
unrepaired (counted as such); the bounds on replays per publisher are
:class:`~kvlens.fleet.replay.ReplayBudget`'s. A gap wider than ``MAX_REPLAY_FRAMES`` is never
asked for, an answer past ``MAX_REPLAY_BYTES`` is given up. libzmq reads at most
``KV_RECEIVE_HWM`` messages of at most ``MAX_MESSAGE_BYTES`` ahead per socket (past them TCP
pushes back to the publisher). Nothing here raises out of the thread: an unexpected error is
logged and counted.

**DNS discovery** (Kubernetes: a headless Service's name, ``HOST:PORT``, or
``HOST:PORT/REPLAY_PORT`` when the publishers have a replay endpoint): a resolver thread looks
the name up (``socket.getaddrinfo``, A and AAAA) at start and every ``interval`` seconds. Each
address is a replica named ``ADDRESS:PORT`` (``[ADDRESS]:PORT`` for IPv6; no reverse lookup: a
pod's PTR record names its address, not the pod). A new address is subscribed; a vanished one is
unsubscribed, its blocks counted removed, as after ``AllBlocksCleared``, and its slot in the index
freed (:meth:`~kvlens.fleet.index.FleetIndex.forget_replica`: a rollout gives every pod a new
address, and the index has :data:`~kvlens.fleet.index.MAX_REPLICAS` slots). Its blocks stay
remembered as held before by the fleet, not by any replica: a later store of one, even by an
address that comes back (a new pod given an old IP), is ``evicted_elsewhere``. Its ``up`` goes to
0; its counters stay, exported, for ``vanished_retention_seconds`` (a comeback within it adds to
them and ends the wait), then they are dropped, series and all: every rollout gives each pod a new
address, and each name has some 30 series. Prometheus keeps what it scraped of a series that stops
(``rate()`` and ``increase()`` over a window use its samples), so dropping loses nothing once a
scrape has seen the last counts; a name that comes back after its drop starts a new series from
zero, which ``rate()`` reads as a reset, rightly. At most :data:`MAX_VANISHED` vanished names are
kept, the oldest dropped first past it. When all the slots are in use by live replicas, a
further one's batches are dropped and counted (``kvlens_kv_events_rejected_total{reason=
"replica_limit"}``), logged once, until a replica leaves and its slot takes the waiting one.
A failed or empty answer keeps the last set (a fleet scaled to zero keeps its subscriptions,
down), counted and logged once until a lookup succeeds again. At most :data:`MAX_DISCOVERED`
addresses per name, and as many subscriptions as the open files allow (:data:`FILES_KEPT_FREE`);
one that cannot be made is counted as an error of its replica and tried again at the next lookup.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import resource
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Final

from kvlens.errors import SettingsError
from kvlens.fleet.index import FleetIndex, IndexSnapshot
from kvlens.fleet.limits import MAX_REPLICAS
from kvlens.fleet.reorder import MAX_TIMESTAMP_LEAD_SECONDS, ReorderQueue, usable_timestamp
from kvlens.fleet.replay import MAX_REPLAY_FRAMES, ReplayAnswer, ReplayBudget
from kvlens.fleet.wire import (
    EVENT_TYPES,
    MALFORMED,
    OTHER_GROUP,
    MalformedPayload,
    apply,
    batch_ts,
    decode_batch,
    sglang_epoch,
)

log = logging.getLogger(__name__)
# A message past this closes the connection (ZMQ_MAXMSGSIZE; subscribed afresh, see _renew): a vLLM batch
# is one engine step's events, well under a MiB (16 MiB: some 2.5M tokens stored in one step).
MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024
# Messages libzmq reads ahead per socket (ZMQ_RCVHWM; its default is 1,000, up to 1,000 x
# MAX_MESSAGE_BYTES held while the thread is busy). Past it libzmq stops reading, TCP pushes back
# and the publisher holds the rest (vLLM's PUB keeps 100,000 messages before it drops, a gap).
KV_RECEIVE_HWM: Final = 8
# Addresses kept per DNS name: a fleet-level kvlens follows one deployment's replicas, and each
# costs a socket and its series.
MAX_DISCOVERED: Final = 1024
# A vanished replica's series are exported this long before they are dropped: well past any
# scrape interval, so that Prometheus saw its last counts (its blocks removed when it left).
VANISHED_RETENTION_SECONDS: Final = 900.0
# Vanished names kept at most (oldest dropped first), whatever the churn within the retention.
MAX_VANISHED: Final = 1024
# ZeroMQ sockets a subscription takes (the SUB, its monitor's PAIR, and the PAIR libzmq's monitor
# writes to), and four files (those three's mailboxes and the TCP connection). ZeroMQ allows
# 1,023 sockets a context by default: 341 subscriptions, far under MAX_DISCOVERED.
SOCKETS_PER_SUBSCRIPTION: Final = 3
FILES_PER_SUBSCRIPTION: Final = 4
# Open files the discovered subscriptions leave to the rest of the process (HTTP connections,
# the checkpoint, numba's cache): past them a further address is not subscribed (counted as an
# error of that replica, logged, tried again at the next lookup), so a big answer cannot starve
# /metrics of sockets. `kvlens serve` raises the soft limit to the hard one at start.
FILES_KEPT_FREE: Final = 1024
# A forward jump of a publisher's sequence wider than this is no loss (a vLLM engine, one batch a
# step, takes over a year at 100 steps a second to send as many): counted as one jump, not as
# missed batches (a jump to 2^63 - 1 added 9.2e18 to a counter that then shows no +1).
MAX_SEQUENCE_GAP: Final = 2**32
# What waits in the reorder queue in place of a payload: the replica's blocks are all gone (a
# restart), or the replica left the fleet (its slot in the index is freed too).
CLEARED: Final = "cleared"
VANISHED: Final = "vanished"
STORED, REMOVED, CLEARED_EVENT = EVENT_TYPES  # the keys of PublisherStatus.events


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
    other_group_events: int = 0  # events of KV cache groups past the first, left out
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
        if expected is not None and seq > expected:
            if seq - expected > MAX_SEQUENCE_GAP:
                # more than any publisher sends in a year: no loss to count, a jump (garbage,
                # or a publisher that does not number from 0); the blocks it held stay
                status.jumps += 1
            else:
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
        key = max(stamp, self._last_ts.get(replica, -math.inf))
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

    def _admitted(self, replica: str, status: PublisherStatus) -> bool:
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
        with self.index.lock:
            if not self._admitted(replica, status):
                return
            # the usual payload: read and applied in one compiled call
            tally = self.index.apply_payload(replica, payload)
            if tally is not None:
                stored, removed, cleared, malformed, other_group = tally
                events = status.events
                if stored:
                    events[STORED] += stored
                if removed:
                    events[REMOVED] += removed
                if cleared:
                    events[CLEARED_EVENT] += cleared
                status.malformed_events += malformed
                status.other_group_events += other_group
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


Resolver = Callable[[str, int], list[str]]


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


def resolve_addresses(host: str, port: int) -> list[str]:
    """The A and AAAA records of ``host`` (blocking: called on the resolver thread)."""
    return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})


def address_name(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


@dataclass
class DnsTarget:
    """One DNS name whose addresses are replicas; :meth:`refresh` runs on the resolver thread."""

    host: str
    port: int
    resolve: Resolver = resolve_addresses
    replay_port: int | None = None  # each address's replay endpoint, to repair gaps
    addresses: tuple[str, ...] = ()
    lookups: int = 0
    failures: int = 0  # lookups that failed or found nothing (the last set was kept)
    failing: bool = False
    too_many: int = 0  # addresses past MAX_DISCOVERED left out, at the last lookup

    @property
    def name(self) -> str:
        return address_name(self.host, self.port)  # as written: [fd00::1]:5557 for an IPv6 literal

    def refresh(self) -> None:
        self.lookups += 1
        try:
            found = sorted(set(self.resolve(self.host, self.port)))
        except (OSError, UnicodeError, ValueError) as error:  # gaierror is an OSError
            self._failed(str(error))
            return
        if not found:
            self._failed("no address")
            return
        if self.failing:
            log.info("kvlens: KV events DNS %s resolves again: %d addresses", self.name, len(found))
        self.failing = False
        self.too_many = max(0, len(found) - MAX_DISCOVERED)
        self.addresses = tuple(found[:MAX_DISCOVERED])

    def _failed(self, why: str) -> None:
        self.failures += 1
        if not self.failing:  # once per failing streak, not every interval
            log.warning(
                "kvlens: KV events DNS %s did not resolve (%s): keeping its %d replicas",
                self.name,
                why,
                len(self.addresses),
            )
        self.failing = True

    def publishers(self) -> list[Publisher]:
        replay = self.replay_port
        return [
            Publisher(
                address_name(address, self.port),
                f"tcp://{address_name(address, self.port)}",
                None if replay is None else f"tcp://{address_name(address, replay)}",
            )
            for address in self.addresses
        ]


def wanted_publishers(static: list[Publisher], targets: list[DnsTarget]) -> dict[str, Publisher]:
    """The publishers to subscribe to now: the configured ones, then each name's addresses (a name
    given twice, or an address a configured replica already has, is subscribed once: two
    subscriptions to one publisher would count its blocks as held by two replicas)."""
    wanted = {publisher.name: publisher for publisher in static}
    endpoints = {publisher.endpoint for publisher in static}
    for target in targets:
        for publisher in target.publishers():
            if publisher.endpoint not in endpoints:
                wanted.setdefault(publisher.name, publisher)
    return wanted


class KVEventsSource:
    """The subscriptions' thread (and, with DNS targets, the resolver's). ``start`` / ``stop``
    from the app's lifespan."""

    def __init__(
        self,
        consumer: Consumer,
        publishers: list[Publisher],
        *,
        dns: list[DnsTarget] | None = None,
        dns_interval_seconds: float = 30.0,
        replay_timeout_seconds: float = 2.0,
        poll_milliseconds: int = 100,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import zmq  # the kv-events extra: imported only when a publisher is configured

        self._zmq = zmq
        self.consumer = consumer
        self.publishers = publishers
        self.dns = dns or []
        self.dns_interval_seconds = dns_interval_seconds
        self.replay_timeout_seconds = replay_timeout_seconds
        self.poll_milliseconds = poll_milliseconds
        self.clock = clock
        self.errors = 0
        self._context = zmq.Context()
        # set before any socket is made; the replays' DEALERs (one at a time) and room to spare
        most = len(publishers) + MAX_DISCOVERED * len(self.dns)
        self._context.set(zmq.MAX_SOCKETS, SOCKETS_PER_SUBSCRIPTION * most + 16)
        self._files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self._most_subscribed = (
            most
            if self._files == resource.RLIM_INFINITY
            else (self._files - FILES_KEPT_FREE) // FILES_PER_SUBSCRIPTION
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._resolver: threading.Thread | None = None
        self._wake = threading.Event()  # look the names up now (stop, or resolve_now)
        self._wanted_lock = threading.Lock()
        self._wanted: dict[str, Publisher] | None = None  # a new set from the resolver, not yet applied
        self.ready = threading.Event()  # set once every configured SUB socket is connected
        self.resolved = threading.Event()  # set once every DNS target was looked up (tests wait on it)
        self._poller: Any = None
        self._subscribed: dict[str, tuple[Any, Any]] = {}  # replica -> (SUB socket, its monitor)
        self._sockets: dict[Any, Publisher] = {}
        self._monitors: dict[Any, Publisher] = {}
        self._budgets: dict[str, ReplayBudget] = {}  # replica -> when its replays may be asked
        self._replays: dict[str, Replay] = {}  # replica -> its replay under way (its SUB not read)
        self._dealers: dict[Any, str] = {}  # a replay's socket -> its replica
        self._renew: set[str] = set()  # subscriptions to make afresh (their connection closed)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvlens-kv-events", daemon=True)
        self._thread.start()
        if self.dns:
            self._resolver = threading.Thread(target=self._resolve_forever, name="kvlens-kv-dns", daemon=True)
            self._resolver.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        for thread in (self._resolver, self._thread):
            if thread is not None:
                thread.join(timeout)
        self._context.term()

    def _resolve_forever(self) -> None:
        while not self._stop.is_set():
            for target in self.dns:
                try:
                    target.refresh()
                except Exception:  # a bug must not end the discovery
                    log.exception("kvlens: KV events DNS %s failed", target.name)
                    self.errors += 1
            with self._wanted_lock:
                self._wanted = wanted_publishers(self.publishers, self.dns)
            self.resolved.set()
            self._wake.wait(self.dns_interval_seconds)
            self._wake.clear()

    def resolve_now(self) -> None:
        """Look the DNS names up again without waiting for the interval."""
        self.resolved.clear()
        self._wake.set()

    def _apply_wanted(self) -> None:
        """Subscribe to new publishers and leave vanished ones (on the subscriptions' thread)."""
        with self._wanted_lock:
            wanted, self._wanted = self._wanted, None
        if wanted is None:
            return
        gone, new = self.consumer.follow(wanted)
        for name in gone:
            self._unsubscribe(name)
            log.info("kvlens: KV events replica %s left the DNS answer: unsubscribed", name)
        failed: list[str] = []
        for publisher in new:
            why = None
            if len(self._subscribed) >= self._most_subscribed:
                why = f"{self._files} open files allowed, {FILES_KEPT_FREE} kept free"
            else:
                try:
                    self._subscribe(publisher)
                except self._zmq.ZMQError as error:  # out of files all the same: the others go on
                    why = str(error)
            if why is not None:
                failed.append(f"{publisher.name} ({why})")
                # not followed, so the next lookup's answer, still naming it, tries again
                self.consumer.following.pop(publisher.name, None)
                self.consumer.status[publisher.name].errors += 1
                self.errors += 1
        if failed:
            log.error(
                "kvlens: KV events: %d replicas could not be subscribed, tried again at the next "
                "lookup (raise the open-files limit): %s",
                len(failed),
                ", ".join(failed[:3]) + (", ..." if len(failed) > 3 else ""),
            )

    def _subscribe(self, publisher: Publisher) -> None:
        zmq = self._zmq
        sub = self._context.socket(zmq.SUB)
        monitor = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sub.setsockopt(zmq.RCVHWM, KV_RECEIVE_HWM)
            sub.setsockopt(zmq.IPV6, 1)  # a discovered AAAA address; harmless for IPv4
            sub.setsockopt(zmq.SUBSCRIBE, publisher.topic.encode())
            # PUB sends nothing while the engine is idle: the connection, not the traffic, says up;
            # a finished ZMTP handshake, not the TCP connect (anything that accepts TCP does that)
            monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            sub.connect(publisher.endpoint)
        except zmq.ZMQError:  # no socket left half made
            if monitor is not None:
                sub.disable_monitor()
                monitor.close(0)
            sub.close(0)
            raise
        self._subscribed[publisher.name] = (sub, monitor)
        self._sockets[sub] = publisher
        self._monitors[monitor] = publisher
        self._poller.register(sub, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)

    def _unsubscribe(self, name: str) -> None:
        if name in self._replays:  # the replica left: its replay and the message it held dropped
            self._close_replay(name)
            self._poller.register(self._subscribed[name][0], self._zmq.POLLIN)
        sub, monitor = self._subscribed.pop(name)
        for socket_ in (sub, monitor):
            self._poller.unregister(socket_)
        del self._sockets[sub], self._monitors[monitor]
        sub.disable_monitor()
        sub.close(0)
        monitor.close(0)

    def _run(self) -> None:
        zmq = self._zmq
        self._poller = zmq.Poller()
        sockets, monitors = self._sockets, self._monitors
        for publisher in self.publishers:
            self._subscribe(publisher)
        self.ready.set()
        try:
            while not self._stop.is_set():
                try:
                    self._apply_wanted()
                except Exception:  # a bug must not end the subscriptions
                    log.exception("kvlens: KV events: following the DNS answer failed")
                    self.errors += 1
                wait = self.poll_milliseconds
                if self._replays:  # woken in time to give up a replay that is not answered
                    wait = min(wait, max(1, math.ceil(self._expire_replays() * 1000)))
                ready = self._poller.poll(wait)
                if not ready:
                    self.consumer.release()
                for socket_, _ in ready:
                    name = self._dealers.get(socket_)
                    if name is not None:  # a replay's answer
                        try:
                            self._answer(socket_)
                        except Exception:  # a bug must not end the subscriptions
                            log.exception("kvlens: KV events replay of %s failed", name)
                            self.errors += 1
                            self.consumer.status[name].errors += 1
                        continue
                    found = sockets.get(socket_) or monitors.get(socket_)
                    if found is None:  # a replay's socket closed earlier in this turn
                        continue
                    publisher = found
                    try:
                        if socket_ in sockets:
                            self._receive(socket_, publisher)
                        else:
                            self._connection(socket_, publisher)
                    except Exception:  # a bug must not end the subscriptions
                        log.exception("kvlens: KV events from %s failed", publisher.name)
                        self.errors += 1
                        self.consumer.status[publisher.name].errors += 1
                if self._renew:
                    self._renew_subscriptions()
        finally:
            for name in list(self._replays):  # their gaps stay unrepaired
                self._replay_ended(name, repaired=False)
            self.consumer.release(everything=True)
            for name in list(self._subscribed):
                self._unsubscribe(name)

    def _connection(self, monitor: Any, publisher: Publisher) -> None:
        from zmq.utils.monitor import recv_monitor_message

        event = recv_monitor_message(monitor)["event"]
        status = self.consumer.status[publisher.name]
        status.up = 1 if event == self._zmq.EVENT_HANDSHAKE_SUCCEEDED else 0
        if event == self._zmq.EVENT_DISCONNECTED:
            self._renew.add(publisher.name)

    def _renew_subscriptions(self) -> None:
        """Make the subscriptions whose connection closed afresh, after reading what they hold.
        libzmq reconnects after a network error, but never after a protocol error, and a
        message past MAX_MESSAGE_BYTES is one: that publisher would be lost for good."""
        renew, self._renew = self._renew, set()
        for name in renew:
            if name not in self._subscribed:  # left the DNS answer meanwhile
                continue
            if name in self._replays:  # its stream waits for the replay: renewed after it
                self._renew.add(name)
                continue
            sub, _ = self._subscribed[name]
            publisher = self._sockets[sub]
            try:
                self._receive(sub, publisher)  # at most KV_RECEIVE_HWM wait: one call reads them
            except Exception:  # a bug must not end the subscriptions
                log.exception("kvlens: KV events from %s failed", name)
                self.errors += 1
                self.consumer.status[name].errors += 1
            if name in self._replays:  # what it read showed a gap: renewed after the replay
                self._renew.add(name)
                continue
            self._unsubscribe(name)
            try:
                self._subscribe(publisher)
            except self._zmq.ZMQError:  # out of files: counted, and the next DNS lookup tries again
                log.exception("kvlens: KV events: subscribing to %s again failed", name)
                self.errors += 1
                self.consumer.status[name].errors += 1
                self.consumer.following.pop(name, None)

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
            epoch = sglang_epoch(frames[0])
            first = (
                None
                if publisher.replay_endpoint is None
                else self.consumer.replay_from(publisher.name, seq, epoch)
            )
            if first is not None:
                budget = self._budgets.setdefault(publisher.name, ReplayBudget(self.replay_timeout_seconds))
                if budget.allows(status.last_message):
                    budget.asked(status.last_message)
                    self._ask(publisher, first, seq, frames[2], epoch)
                    return  # its stream waits for the replay; the others go on
            self.consumer.message(publisher.name, seq, frames[2], None, epoch)

    def _ask(self, publisher: Publisher, first: int, seq: int, payload: bytes, epoch: bytes | None) -> None:
        """Ask ``publisher``'s replay endpoint for ``[first, seq)`` and stop reading its SUB until
        the answer ends (:meth:`_replay_ended`); the message that showed the gap waits with it."""
        zmq = self._zmq
        assert publisher.replay_endpoint is not None
        dealer = self._context.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.IPV6, 1)  # as the SUB: else libzmq never connects to [ADDRESS]
            dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            dealer.setsockopt(zmq.RCVHWM, KV_RECEIVE_HWM)
            dealer.connect(publisher.replay_endpoint)
            # A ROUTER sees [identity, empty, start] from a REQ; a DEALER adds the empty frame.
            dealer.send_multipart([b"", first.to_bytes(8, "big")], zmq.NOBLOCK)
        except zmq.ZMQError:
            dealer.close(0)
            raise
        sub, _ = self._subscribed[publisher.name]
        self._poller.unregister(sub)
        self._poller.register(dealer, zmq.POLLIN)
        self._dealers[dealer] = publisher.name
        deadline = self.clock() + self.replay_timeout_seconds
        self._replays[publisher.name] = Replay(
            ReplayAnswer(first, seq), dealer, deadline, seq, payload, epoch
        )

    def _answer(self, dealer: Any) -> None:
        """Read what a replay endpoint sent; the replay ends when its answer is whole or wrong."""
        zmq = self._zmq
        name = self._dealers[dealer]
        answer = self._replays[name].answer
        for _ in range(1000):  # a bounded turn; the poll comes back for the rest
            try:
                parts = dealer.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            outcome = answer.take(parts[1:] if len(parts) == 3 else [])
            if outcome is not None:
                self._replay_ended(name, repaired=outcome)
                return

    def _expire_replays(self) -> float:
        """End the replays whose time is up; returns the seconds until the next one's (the poll's
        longest wait when none is left)."""
        now = self.clock()
        for name in [name for name, replay in self._replays.items() if replay.deadline <= now]:
            self._replay_ended(name, repaired=False)
        left = [replay.deadline - now for replay in self._replays.values()]
        return min(left) if left else self.poll_milliseconds / 1000

    def _replay_ended(self, name: str, *, repaired: bool) -> None:
        """Hand the message that showed the gap, with what the replay brought (nothing unless it
        filled the gap), to the consumer, and read the replica's stream again."""
        replay = self._close_replay(name)
        if not repaired:
            self._budgets[name].failed(self.clock())
        frames = replay.answer.frames if repaired else []
        sub, _ = self._subscribed[name]
        self._poller.register(sub, self._zmq.POLLIN)
        self.consumer.message(name, replay.seq, replay.payload, lambda first: frames, replay.epoch)

    def _close_replay(self, name: str) -> Replay:
        replay = self._replays.pop(name)
        del self._dealers[replay.dealer]
        self._poller.unregister(replay.dealer)
        replay.dealer.close(0)
        return replay


@dataclass
class Replay:
    """A replay under way: its answer so far, its socket, when it is given up, and the message
    that showed the gap (handed to the consumer when the replay ends)."""

    answer: ReplayAnswer
    dealer: Any
    deadline: float
    seq: int
    payload: bytes
    epoch: bytes | None


@dataclass
class KVEventsSnapshot:
    index: IndexSnapshot
    publishers: dict[str, PublisherStatus]
    errors: int
    dns: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (replicas, failed lookups)


class KVEvents:
    """The index, the consumer and (once started) the subscriptions: what ``serve`` runs and what
    the collector reads."""

    def __init__(
        self,
        publishers: list[Publisher],
        index: FleetIndex,
        reorder_seconds: float = 0.0,
        *,
        dns: list[DnsTarget] | None = None,
        dns_interval_seconds: float = 30.0,
        in_process: bool = False,
        vanished_retention_seconds: float = VANISHED_RETENTION_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``in_process``: nothing is subscribed (no pyzmq needed); the events are applied to
        ``index`` by the caller (the demo's simulated fleet)."""
        self.in_process = in_process
        if not in_process and importlib.util.find_spec("zmq") is None:  # before serving, not at start
            raise SettingsError("kv_events needs the kv-events extra: pip install 'kvlens[kv-events]'")
        self.publishers = publishers
        self.index = index
        self.dns = dns or []
        self.dns_interval_seconds = dns_interval_seconds
        self.consumer = Consumer(
            index,
            publishers,
            reorder_seconds=reorder_seconds,
            clock=clock,
            vanished_retention_seconds=vanished_retention_seconds,
        )
        self.source: KVEventsSource | None = None

    def start(self) -> None:
        if self.in_process:
            return
        self.source = KVEventsSource(
            self.consumer, self.publishers, dns=self.dns, dns_interval_seconds=self.dns_interval_seconds
        )
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
        dns = {target.name: (len(target.addresses), target.failures) for target in self.dns}
        return KVEventsSnapshot(index, publishers, 0 if self.source is None else self.source.errors, dns)
