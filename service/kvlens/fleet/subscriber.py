"""Subscribe to the fleet's KV event publishers and feed the index (needs the ``kv-events`` extra).

One thread runs every subscription: a ZeroMQ ``SUB`` socket per publisher (vLLM's default
``tcp://*:5557`` binds, so kvlens connects to each replica), polled together; each message goes
to the :class:`~kvlens.fleet.ordering.Consumer` (sequences, gaps, restarts, the reorder window),
and with DNS targets a resolver thread follows the replicas behind each name
(:mod:`kvlens.fleet.discovery`): a new address is subscribed, a vanished one unsubscribed. As many
subscriptions as the open files allow (:data:`FILES_KEPT_FREE`); one that cannot be made is
counted as an error of its replica and tried again at the next lookup.

A replay's ``DEALER`` is polled with the ``SUB`` sockets: only the gappy publisher's stream waits
for it (its ``SUB`` is not read meanwhile), the others are read and applied. A replay that does
not answer within ``replay_timeout_seconds``, or answers one wrong frame, leaves the gap
unrepaired (counted as such); the bounds on replays per publisher are
:class:`~kvlens.fleet.replay.ReplayBudget`'s. A gap wider than ``MAX_REPLAY_FRAMES`` is never
asked for, an answer past ``MAX_REPLAY_BYTES`` is given up. libzmq reads at most
``KV_RECEIVE_HWM`` messages of at most ``MAX_MESSAGE_BYTES`` ahead per socket (past them TCP
pushes back to the publisher). Nothing here raises out of the thread: an unexpected error is
logged and counted.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import resource
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Final

from kvlens.errors import MissingExtra
from kvlens.fleet.discovery import MAX_DISCOVERED, DnsTarget, wanted_publishers
from kvlens.fleet.index import FleetIndex
from kvlens.fleet.limits import VANISHED_RETENTION_SECONDS
from kvlens.fleet.ordering import Consumer, Publisher, PublisherStatus
from kvlens.fleet.replay import ReplayAnswer, ReplayBudget
from kvlens.fleet.snapshot import IndexSnapshot
from kvlens.fleet.wire import sglang_epoch

log = logging.getLogger(__name__)
# A message past this closes the connection (ZMQ_MAXMSGSIZE; subscribed afresh, see _renew): a vLLM batch
# is one engine step's events, well under a MiB (16 MiB: some 2.5M tokens stored in one step).
MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024
# Messages libzmq reads ahead per socket (ZMQ_RCVHWM; its default is 1,000, up to 1,000 x
# MAX_MESSAGE_BYTES held while the thread is busy). Past it libzmq stops reading, TCP pushes back
# and the publisher holds the rest (vLLM's PUB keeps 100,000 messages before it drops, a gap).
KV_RECEIVE_HWM: Final = 8
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
            raise MissingExtra("kv_events", "kv-events")
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
