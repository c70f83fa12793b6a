"""DNS discovery of the KV event publishers (a headless Service): each address a replica, new ones
subscribed, vanished ones left and their blocks counted removed, a failed lookup keeping the last
set. The lookups are injected; one test subscribes over real ZeroMQ sockets on two loopback
addresses."""

from __future__ import annotations

import logging
import socket

import pytest

from kvlens.config import load_settings
from kvlens.errors import SettingsError
from kvlens.exporter.aggregator import Aggregator
from kvlens.exporter.background import BackgroundSources
from kvlens.exporter.collector import kv_families
from kvlens.fleet import schema
from kvlens.fleet.causes import EVICTED_ELSEWHERE, HELD_ELSEWHERE, NEW
from kvlens.fleet.discovery import MAX_DISCOVERED, DnsTarget, resolve_addresses, wanted_publishers
from kvlens.fleet.index import FleetIndex
from kvlens.fleet.kernels import rules
from kvlens.fleet.limits import MAX_VANISHED, VANISHED_RETENTION_SECONDS
from kvlens.fleet.ordering import Consumer, Publisher
from kvlens.fleet.publisher import EventPublisher
from kvlens.fleet.settings import parse_dns_target
from kvlens.fleet.subscriber import KVEvents
from tests import vllm_kv_events as vllm
from tests.live import free_port, until

TOKENS = [1, 2, 3, 4]


class Answers:
    """A resolver that gives the queued answers in turn (an exception is raised), then the last."""

    def __init__(self, *answers: list[str] | Exception) -> None:
        self.answers = list(answers)
        self.asked: list[tuple[str, int]] = []

    def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


def names(target: DnsTarget) -> list[str]:
    return [p.name for p in target.publishers()]


def test_each_address_is_a_replica_and_a_failed_lookup_keeps_the_last_set(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answers = Answers(
        ["10.0.0.6", "10.0.0.5", "10.0.0.5"],
        socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
        [],
        ["fd00::7", "10.0.0.6"],
    )
    target = DnsTarget("vllm-headless.ns.svc", 5557, answers)
    target.refresh()
    assert names(target) == ["10.0.0.5:5557", "10.0.0.6:5557"]
    assert [p.endpoint for p in target.publishers()] == ["tcp://10.0.0.5:5557", "tcp://10.0.0.6:5557"]
    with caplog.at_level(logging.WARNING, logger="kvlens.fleet.discovery"):
        target.refresh()  # NXDOMAIN
        target.refresh()  # an empty answer
    assert names(target) == ["10.0.0.5:5557", "10.0.0.6:5557"]
    assert (target.failures, target.lookups) == (2, 3)
    assert len([r for r in caplog.records if "did not resolve" in r.getMessage()]) == 1
    target.refresh()
    assert names(target) == ["10.0.0.6:5557", "[fd00::7]:5557"]
    assert target.publishers()[1].endpoint == "tcp://[fd00::7]:5557"
    assert (target.failures, target.failing) == (2, False)
    assert answers.asked == [("vllm-headless.ns.svc", 5557)] * 4


def test_each_address_s_replay_endpoint_is_on_the_replay_port() -> None:
    target = DnsTarget("svc", 5557, Answers(["10.0.0.5", "fd00::7"]), replay_port=5558)
    target.refresh()
    assert target.publishers() == [
        Publisher("10.0.0.5:5557", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558"),
        Publisher("[fd00::7]:5557", "tcp://[fd00::7]:5557", "tcp://[fd00::7]:5558"),
    ]


def test_addresses_past_the_cap_are_left_out_and_counted() -> None:
    many = [f"10.{i // 65536}.{i // 256 % 256}.{i % 256}" for i in range(MAX_DISCOVERED + 3)]
    target = DnsTarget("big", 1, Answers(many))
    target.refresh()
    assert (len(target.addresses), target.too_many) == (MAX_DISCOVERED, 3)


def test_a_publisher_is_subscribed_once_however_often_it_is_named() -> None:
    static = [
        Publisher("10.0.0.5:5557", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558"),
        Publisher("r0", "tcp://10.0.0.6:5557"),
    ]
    first = DnsTarget("a", 5557, Answers(["10.0.0.5", "10.0.0.6", "10.0.0.7"]))
    second = DnsTarget("b", 5557, Answers(["10.0.0.7"]))
    first.refresh()
    second.refresh()
    wanted = wanted_publishers(static, [first, second])
    assert list(wanted.values()) == [*static, Publisher("10.0.0.7:5557", "tcp://10.0.0.7:5557")]


def test_a_vanished_replica_s_blocks_are_removed_and_a_later_store_is_evicted_elsewhere() -> None:
    """A vanished address's slot is forgotten: if it comes back (a new pod given an old IP), it
    is a new replica, and the blocks the old one held were held by the fleet, not by it."""
    index = FleetIndex(hashes_alike=True)
    consumer = Consumer(index, [])
    consumer.add(Publisher("10.0.0.5:5557", "tcp://10.0.0.5:5557"))
    batch = vllm.encode(
        vllm.KVEventBatch(ts=1.0, events=[vllm.BlockStored([11, 12], None, TOKENS * 2, 4, None, "GPU", None)])
    )
    consumer.message("10.0.0.5:5557", 0, batch, None)
    consumer.release(everything=True)
    assert index.snapshot().held == {("10.0.0.5:5557", "GPU"): 2}
    consumer.vanished("10.0.0.5:5557")
    consumer.release(everything=True)
    after = index.snapshot()
    assert (after.held[("10.0.0.5:5557", "GPU")], after.removed[("10.0.0.5:5557", "GPU")]) == (0, 2)
    status = consumer.status["10.0.0.5:5557"]
    assert (status.up, status.next_seq, status.restarts) == (0, None, 0)
    consumer.add(Publisher("10.0.0.5:5557", "tcp://10.0.0.5:5557"))  # back, its counters kept
    assert consumer.status["10.0.0.5:5557"] is status
    consumer.message("10.0.0.5:5557", 5, batch, None)  # a new sequence: neither a gap nor a restart
    consumer.release(everything=True)
    assert (status.gaps, status.restarts, status.batches) == (0, 0, 2)
    assert index.recomputed == {("10.0.0.5:5557", NEW): 2, ("10.0.0.5:5557", EVICTED_ELSEWHERE): 2}


def test_localhost_resolves_with_the_real_resolver() -> None:
    assert "127.0.0.1" in resolve_addresses("localhost", 5557)


@pytest.mark.parametrize(
    "text",
    ["svc", "svc:", ":5557", "svc:0", "svc:70000", "tcp://svc:5557", "svc:5557/", "svc:5557/x", "svc/1:2"],
)
def test_a_bad_target_is_a_named_settings_error(text: str) -> None:
    with pytest.raises(SettingsError, match="kv_events_dns"):
        load_settings(None, kv_events_dns=[text])


def test_a_target_parses() -> None:
    assert parse_dns_target("kvlens-vllm-headless.ns.svc.cluster.local:5557") == (
        "kvlens-vllm-headless.ns.svc.cluster.local",
        5557,
        None,
    )
    assert parse_dns_target("svc:5557/5558") == ("svc", 5557, 5558)
    settings = load_settings(None, kv_events_dns=["a:1"], kv_events_dns_interval_seconds=5)
    assert (settings.kv_events_dns, settings.kv_events_dns_interval_seconds) == (["a:1"], 5)


def stored(block: int) -> schema.BlockStored:
    return schema.BlockStored(
        block_hashes=[block],
        parent_block_hash=None,
        token_ids=[block] * 4,
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def test_subscriptions_follow_the_answers_over_real_sockets() -> None:
    port = free_port()
    one = EventPublisher(f"tcp://127.0.0.1:{port}")
    two = EventPublisher(f"tcp://127.0.0.2:{port}")
    answers = Answers(["127.0.0.1", "127.0.0.2"], ["127.0.0.2"], OSError("resolver down"))
    events = KVEvents([], FleetIndex(hashes_alike=True), dns=[DnsTarget("fleet", port, answers)])
    first, second = f"127.0.0.1:{port}", f"127.0.0.2:{port}"
    status = events.consumer.status
    events.start()
    source = events.source
    assert source is not None
    try:
        one.wait_subscribed()
        two.wait_subscribed()
        until(lambda: first in status and second in status and status[first].up == status[second].up == 1)
        one.publish_events([stored(1)])
        two.publish_events([stored(2)])
        until(lambda: status[first].batches == 1 and status[second].batches == 1)
        source.resolve_now()  # 127.0.0.1 left the answer
        until(lambda: status[first].up == 0 and events.index.snapshot().removed.get((first, "GPU")) == 1)
        source.resolve_now()  # the lookup fails: 127.0.0.2 stays subscribed
        until(lambda: events.dns[0].failures == 1)
        two.publish_events([schema.BlockRemoved(block_hashes=[2], medium="GPU")])
        until(lambda: status[second].batches == 2)
        snapshot = events.snapshot()
        assert snapshot.dns == {f"fleet:{port}": (1, 1)}
        assert snapshot.index.held == {(first, "GPU"): 0, (second, "GPU"): 0}
        assert snapshot.index.removed == {(first, "GPU"): 1, (second, "GPU"): 1}
        assert status[second].up == 1
    finally:
        events.stop()
        one.close()
        two.close()
    assert source.errors == 0


def rollouts(count: int, pods: int) -> list[list[str]]:
    """Each rollout's answer: every pod a new address (Kubernetes gives a new pod a new IP)."""
    return [[f"10.1.{r}.{p + 1}" for p in range(pods)] for r in range(count)]


def shared_and_own(block: int) -> bytes:
    """A batch storing the block every pod computes (the system prompt) and one of its own."""
    events = [
        vllm.BlockStored([1], None, TOKENS, 4, None, "GPU", None),
        vllm.BlockStored([block], None, [block] * 4, 4, None, "GPU", None),
    ]
    return vllm.encode(vllm.KVEventBatch(ts=float(block), events=events))


def follow(consumer: Consumer, target: DnsTarget) -> None:
    consumer.follow(wanted_publishers([], [target]))
    consumer.release(everything=True)


def test_addresses_churning_past_the_index_s_replicas_keep_being_classified() -> None:
    """13 rollouts of 16 pods: 208 addresses, far past the index's 64 replica slots. Each
    vanished pod's slot is freed, so every pod's blocks are classified: the first pod of the
    fleet computes the shared block new, the first of each later rollout finds it evicted
    elsewhere (the fleet held it before: the last rollout's pods), the others held elsewhere."""
    answers = rollouts(13, 16)
    target = DnsTarget("vllm-headless", 5557, Answers(*answers))
    index = FleetIndex(hashes_alike=True)
    consumer = Consumer(index, [])
    for r, answer in enumerate(answers):
        target.refresh()
        follow(consumer, target)
        for p, address in enumerate(answer):
            consumer.message(f"{address}:5557", 0, shared_and_own(1000 * (r + 1) + p), None)
        consumer.release(everything=True)
    expected = {}
    for r, answer in enumerate(answers):
        for p, address in enumerate(answer):
            name = f"{address}:5557"
            first = NEW if r == 0 else EVICTED_ELSEWHERE
            expected[name, first if p == 0 else HELD_ELSEWHERE] = 1
            expected[name, NEW] = expected.get((name, NEW), 0) + 1
    assert index.recomputed == expected
    assert sum(status.errors for status in consumer.status.values()) == 0
    snapshot = index.snapshot()
    # the vanished pods' counters stay (their blocks counted removed), the last rollout holds 32
    assert sum(snapshot.stored.values()) == 13 * 16 * 2
    assert sum(snapshot.removed.values()) == 12 * 16 * 2
    assert sum(snapshot.held.values()) == 16 * 2
    assert (snapshot.distinct_blocks, snapshot.duplicated_blocks) == (17, 15)


def test_a_replica_past_the_slots_in_use_is_refused_once_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """65 live addresses: the 65th's batches are dropped, counted (rejected, reason
    replica_limit) and logged once; once a pod leaves, its slot takes the waiting one."""
    many = [f"10.2.0.{p + 1}" for p in range(65)]
    target = DnsTarget("big", 5557, Answers(many, many[1:]))
    index = FleetIndex(hashes_alike=True)
    consumer = Consumer(index, [])
    target.refresh()
    follow(consumer, target)
    with caplog.at_level(logging.ERROR, logger="kvlens.fleet.ordering"):
        for seq in range(2):
            for p, address in enumerate(many):
                consumer.message(f"{address}:5557", seq, shared_and_own(1000 * (seq + 1) + p), None)
            consumer.release(everything=True)
    last = f"{many[-1]}:5557"
    refusals = [r.getMessage() for r in caplog.records if "replica" in r.getMessage()]
    assert refusals == [
        f"kvlens: KV events replica {last} refused: the index follows at most 64 replicas at once, "
        "all in use; its events are dropped (counted) until a replica leaves"
    ]
    assert consumer.status[last].refused_batches == 2
    assert sum(status.refused_batches for status in consumer.status.values()) == 2
    assert not any(name == last for name, _ in index.recomputed)
    target.refresh()  # the first pod leaves
    follow(consumer, target)
    consumer.message(last, 2, shared_and_own(5000), None)
    consumer.release(everything=True)
    assert index.recomputed[last, HELD_ELSEWHERE] == 1
    assert index.recomputed[last, NEW] == 1
    assert consumer.status[last].refused_batches == 2


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def exported_replicas(events: KVEvents) -> set[str]:
    """The replicas any KV-event series on /metrics names."""
    return {
        sample.labels["replica"]
        for family in kv_families(events)
        for sample in family.samples
        if "replica" in sample.labels
    }


def test_a_vanished_replica_s_series_go_after_the_retention_and_a_comeback_keeps_them() -> None:
    """Every rollout gives each pod a new address: the vanished ones' series (about 30 each) go
    once they have been exported for kv_events_vanished_retention_seconds, so that a scrape saw
    their last counts (Prometheus's rate() and increase() keep the samples of a series that
    stops; what they cannot take is a counter that goes back within a series). A name that
    comes back within the retention keeps adding to its counters; one that comes back after
    starts again from zero, a new series."""
    clock = Clock()
    events = KVEvents(
        [], FleetIndex(hashes_alike=True), in_process=True, vanished_retention_seconds=600, clock=clock
    )
    consumer, index = events.consumer, events.index
    a, b, c = "10.0.0.1:5557", "10.0.0.2:5557", "10.0.0.3:5557"
    target = DnsTarget(
        "fleet", 5557, Answers(["10.0.0.1", "10.0.0.2"], ["10.0.0.3"], ["10.0.0.2", "10.0.0.3"])
    )
    target.refresh()
    follow(consumer, target)
    consumer.message(a, 0, shared_and_own(11), None)
    consumer.message(b, 0, shared_and_own(12), None)
    consumer.release(everything=True)
    assert exported_replicas(events) == {a, b}
    clock.now = 100.0
    target.refresh()  # a rollout: a and b leave, c comes
    follow(consumer, target)
    consumer.message(c, 0, shared_and_own(13), None)
    consumer.release(everything=True)
    assert exported_replicas(events) == {a, b, c}
    assert index.snapshot().removed[a, "GPU"] == 2  # its last counts, exported for a while
    clock.now = 300.0
    target.refresh()  # b comes back (a new pod given b's address) within the retention
    follow(consumer, target)
    consumer.message(b, 0, shared_and_own(14), None)
    consumer.release(everything=True)
    clock.now = 699.9
    consumer.release()
    assert exported_replicas(events) == {a, b, c}
    memory = index.memory_bytes()
    clock.now = 700.0
    consumer.release()
    assert exported_replicas(events) == {b, c}
    assert memory - index.memory_bytes() == rules.STATS * 8  # a's counter row, no more
    assert set(consumer.status) == {b, c}
    snapshot = index.snapshot()
    assert {replica for replica, _ in snapshot.stored} == {b, c}
    assert snapshot.stored[b, "GPU"] == 4  # the comeback added to b's counters
    assert snapshot.recomputed_tokens[b, HELD_ELSEWHERE] == 8  # shared block twice, 4 tokens
    clock.now = 800.0
    target.resolve = Answers(["10.0.0.3"])
    target.refresh()  # b leaves again: its retention starts now
    follow(consumer, target)
    clock.now = 1399.9
    consumer.release()
    assert exported_replicas(events) == {b, c}
    clock.now = 1400.0
    consumer.release()
    assert exported_replicas(events) == {c}
    target.resolve = Answers(["10.0.0.2", "10.0.0.3"])
    target.refresh()  # b back after its series went: a new series from zero
    follow(consumer, target)
    consumer.message(b, 0, shared_and_own(15), None)
    consumer.release(everything=True)
    after = index.snapshot()
    assert after.stored[b, "GPU"] == 2
    assert consumer.status[b].batches == 1


def test_vanished_replicas_past_the_cap_go_oldest_first() -> None:
    """At most max_vanished vanished names are kept, however fast the pods churn."""
    clock = Clock()
    index = FleetIndex(hashes_alike=True)
    consumer = Consumer(index, [], clock=clock, vanished_retention_seconds=600, max_vanished=2)
    answers = rollouts(4, 1)
    target = DnsTarget("fleet", 5557, Answers(*answers))
    for r in range(4):
        clock.now = float(r)
        target.refresh()
        follow(consumer, target)
        consumer.message(f"10.1.{r}.1:5557", 0, shared_and_own(100 + r), None)
        consumer.release(everything=True)
    # rollout 3 is live; 1 and 2 are the two newest vanished; 0 went first
    assert set(consumer.status) == {f"10.1.{r}.1:5557" for r in (1, 2, 3)}
    assert {replica for replica, _ in index.snapshot().stored} == set(consumer.status)


def test_the_retention_is_a_setting() -> None:
    settings = load_settings(None, kv_events_dns=["a:1"], kv_events_vanished_retention_seconds=120)
    kv_events = BackgroundSources(settings, Aggregator(settings)).kv_events
    assert kv_events is not None and kv_events.consumer.vanished_retention_seconds == 120
    assert load_settings(None).kv_events_vanished_retention_seconds == VANISHED_RETENTION_SECONDS == 900
    assert MAX_VANISHED == 1024  # the setting's description says so
    with pytest.raises(SettingsError, match="kv_events_vanished_retention_seconds"):
        load_settings(None, kv_events_vanished_retention_seconds=-1)
