"""**DNS discovery**: the replicas behind a name (``--kv-events-dns``; Kubernetes: a headless
Service's name, ``HOST:PORT``, or ``HOST:PORT/REPLAY_PORT`` when the publishers have a replay
endpoint): a resolver thread looks the name up (``socket.getaddrinfo``, A and AAAA) at start and
every ``interval`` seconds. Each address is a replica named ``ADDRESS:PORT`` (``[ADDRESS]:PORT``
for IPv6; no reverse lookup: a pod's PTR record names its address, not the pod). A new address is
subscribed; a vanished one is unsubscribed, its blocks counted removed, as after
``AllBlocksCleared``, and its slot in the index freed
(:meth:`~kvlens.fleet.index.FleetIndex.forget_replica`: a rollout gives every pod a new address,
and the index has :data:`~kvlens.fleet.limits.MAX_REPLICAS` slots). Its blocks stay remembered as
held before by the fleet, not by any replica: a later store of one, even by an address that comes
back (a new pod given an old IP), is ``evicted_elsewhere``. Its ``up`` goes to 0; its counters
stay, exported, for ``vanished_retention_seconds`` (a comeback within it adds to them and ends the
wait), then they are dropped, series and all: every rollout gives each pod a new address, and each
name has some 30 series. Prometheus keeps what it scraped of a series that stops (``rate()`` and
``increase()`` over a window use its samples), so dropping loses nothing once a scrape has seen
the last counts; a name that comes back after its drop starts a new series from zero, which
``rate()`` reads as a reset, rightly. At most :data:`~kvlens.fleet.limits.MAX_VANISHED` vanished
names are kept, the oldest dropped first past it. When all the slots are in use by live replicas,
a further one's batches are dropped and counted (``kvlens_kv_events_rejected_total{reason=
"replica_limit"}``), logged once, until a replica leaves and its slot takes the waiting one. A
failed or empty answer keeps the last set (a fleet scaled to zero keeps its subscriptions, down),
counted and logged once until a lookup succeeds again. At most :data:`MAX_DISCOVERED` addresses
per name, and as many subscriptions as the open files allow
(:data:`~kvlens.fleet.subscriber.FILES_KEPT_FREE`); one that cannot be made is counted as an error
of its replica and tried again at the next lookup.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from kvlens.fleet.ordering import Publisher

log = logging.getLogger(__name__)
# Addresses kept per DNS name: a fleet-level kvlens follows one deployment's replicas, and each
# costs a socket and its series.
MAX_DISCOVERED: Final = 1024

Resolver = Callable[[str, int], list[str]]


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
