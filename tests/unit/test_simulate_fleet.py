"""The fleet: replicas that queue, the policies on hand-made situations (the articles' routing
example among them), the load guard, the last-token rule, and invariants on random traces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.definitions import CostModel
from kvlens.simulate import policies
from kvlens.simulate.cache import PrefixCache
from kvlens.simulate.policies import Guard
from kvlens.simulate.replica import Job, Replica, ServiceModel
from kvlens.simulate.run import Fleet, simulate, walk
from kvlens.simulate.trace import TraceRequest, chain

BLOCK = 1000
# 40 us per token and nothing per pair: a prefill of m new tokens takes m * 40 us.
LINEAR = ServiceModel(prefill=CostModel(a=4e-5, b=0.0, unit="seconds"))


def request(
    index: int, arrival: float, tokens: int, blocks: tuple[object, ...], output: int = 1
) -> TraceRequest:
    return TraceRequest(index, arrival, tokens, output, blocks)


def replica(index: int, done: list[Job], model: ServiceModel = LINEAR) -> Replica:
    return Replica(index, None, BLOCK, model, done)


def test_the_articles_routing_example() -> None:
    """Replica A holds the prefix but has 600 ms of prefill queued; B has 20 ms queued and no
    cache. The request takes 40 ms of prefill on A and 200 ms on B: prefix_affinity picks A (640
    ms to first token), cost_aware picks B (220 ms)."""
    done: list[Job] = []
    a, b = replica(0, done), replica(1, done)
    shared = ("s1", "s2", "s3", "s4")
    a.enqueue(Job(request(0, 0.0, 4000, shared), 0, BLOCK), 0.0)  # leaves the prefix cached on A
    a.advance(10.0)
    assert a.cache.cached_prefix(shared, 4) == 4
    a.enqueue(Job(request(1, 10.0, 15_000, tuple(f"l{i}" for i in range(15))), 1, BLOCK), 10.0)  # 600 ms
    b.enqueue(Job(request(2, 10.0, 500, ()), 2, BLOCK), 10.0)  # 20 ms
    new = Job(request(3, 10.0, 5000, (*shared, "n5")), 3, BLOCK)
    assert a.expected_wait(10.0) == pytest.approx(0.6) and b.expected_wait(10.0) == pytest.approx(0.02)
    assert a.prefill_seconds(new, 4) == pytest.approx(0.04) and b.prefill_seconds(new, 0) == pytest.approx(
        0.2
    )
    assert policies.prefix_affinity(Guard())(new, [a, b], 10.0) == 0
    assert policies.cost_aware(new, [a, b], 10.0) == 1
    assert new.estimate == pytest.approx(0.2)  # what B's expected wait now counts for it


def test_round_robin_and_least_queue_by_hand() -> None:
    done: list[Job] = []
    fleet = [replica(i, done) for i in range(3)]
    jobs = [Job(request(i, 0.0, 1000, ()), i, BLOCK) for i in range(5)]
    assert [policies.round_robin(job, fleet, 0.0) for job in jobs] == [0, 1, 2, 0, 1]
    fleet[0].enqueue(jobs[0], 0.0)
    fleet[0].enqueue(jobs[1], 0.0)
    fleet[2].enqueue(jobs[2], 0.0)
    assert policies.least_queue(jobs[3], fleet, 0.0) == 1  # the only one with nothing
    fleet[1].enqueue(jobs[3], 0.0)
    # 1 and 2 tie with one each: the tie goes to tied[order % 2]; job 4 -> tied[0] = replica 1
    assert policies.least_queue(jobs[4], fleet, 0.0) == 1


def test_a_replica_queues_first_in_first_out_with_one_prefill_at_a_time() -> None:
    done: list[Job] = []
    only = replica(0, done)
    for i in range(3):
        only.enqueue(Job(request(i, 0.0, 1000, ()), i, BLOCK), 0.0)  # 40 ms of prefill each
    only.advance(float("inf"))
    first_tokens = sorted(job.first_token for job in done)
    assert first_tokens == pytest.approx([0.04, 0.08, 0.12])
    assert sorted(job.start - job.arrival for job in done) == pytest.approx([0.0, 0.04, 0.08])


def test_max_running_holds_requests_back_until_one_finishes() -> None:
    done: list[Job] = []
    model = ServiceModel(prefill=LINEAR.prefill, max_running=1)
    only = replica(0, done, model)
    long_decode = Job(request(0, 0.0, 1000, (), output=101), 0, BLOCK)
    only.enqueue(long_decode, 0.0)
    only.enqueue(Job(request(1, 0.0, 1000, ()), 1, BLOCK), 0.0)
    only.advance(float("inf"))
    first, second = sorted(done, key=lambda job: job.order)
    assert second.start == pytest.approx(first.finish)  # waited for the first to finish decoding
    step = model.decode.step_seconds(1, 1000 + 101)
    assert first.finish - first.first_token == pytest.approx(100 * step)


def test_without_chunked_prefill_a_prefill_pauses_running_decodes() -> None:
    def decode_time(chunked: bool) -> float:
        done: list[Job] = []
        only = replica(0, done, ServiceModel(prefill=LINEAR.prefill, chunked_prefill=chunked))
        decoding = Job(request(0, 0.0, 1000, (), output=1001), 0, BLOCK)
        only.enqueue(decoding, 0.0)
        only.advance(0.05)  # decoding now
        only.enqueue(Job(request(1, 0.05, 10_000, ()), 1, BLOCK), 0.05)  # 400 ms of prefill
        only.advance(float("inf"))
        return decoding.finish - decoding.first_token

    assert decode_time(False) == pytest.approx(decode_time(True) + 0.4)


def test_the_last_token_is_recomputed() -> None:
    """vLLM caps a hit at n - 1 tokens, block-aligned: an identical prompt of whole blocks
    reuses one block less; one token more and it reuses them all."""
    for tokens, expected in ((2 * BLOCK, BLOCK), (2 * BLOCK + 1, 2 * BLOCK)):
        trace = [request(0, 0.0, tokens, ("b1", "b2")), request(1, 1.0, tokens, ("b1", "b2"))]
        outcome = simulate(trace, Fleet(1, None, BLOCK, LINEAR), "round_robin")
        assert outcome.totals.cached_tokens == expected


def shared_first_block(count: int) -> list[TraceRequest]:
    """Everything shares block 0 (a system prompt), then diverges; all arrive together."""
    return [request(i, 0.0, 4 * BLOCK, ("system", f"u{i}a", f"u{i}b", f"u{i}c")) for i in range(count)]


def test_prefix_affinity_needs_its_load_guard() -> None:
    trace = shared_first_block(400)
    unguarded = simulate(trace, Fleet(4, None, BLOCK, LINEAR, guard=None), "prefix_affinity")
    guarded = simulate(trace, Fleet(4, None, BLOCK, LINEAR, guard=Guard(8, 1.5)), "prefix_affinity")
    assert unguarded.requests_per_replica == [400, 0, 0, 0]  # the first one cached block 0 there
    assert max(guarded.requests_per_replica) < 0.3 * 400
    assert guarded.summary()["load_imbalance"] < 1.2


# --- invariants on random traces ---------------------------------------------------------------

random_traces = st.lists(
    st.tuples(
        st.floats(0, 2),  # gap to the previous arrival, seconds
        st.integers(1, 5 * 64),  # prompt tokens (64-token blocks)
        st.lists(st.integers(0, 2), min_size=5, max_size=5),  # a path in a small tree of blocks
        st.integers(0, 20),  # output tokens
    ),
    min_size=1,
    max_size=40,
)


def build(raw: list[tuple[float, int, list[int], int]]) -> list[TraceRequest]:
    now, made = 0.0, []
    for index, (gap, tokens, path, output) in enumerate(raw):
        now += gap
        made.append(TraceRequest(index, now, tokens, output, chain(tuple(path))[: tokens // 64]))
    return made


@settings(max_examples=150, deadline=None)
@given(random_traces, st.sampled_from(policies.POLICIES), st.integers(1, 3), st.integers(0, 12))
def test_every_policy_keeps_the_invariants(
    raw: list[tuple[float, int, list[int], int]], name: str, replicas: int, capacity: int
) -> None:
    trace = build(raw)
    model = ServiceModel(prefill=CostModel(a=1e-4, b=1e-8, unit="seconds"), max_running=4)
    played: list[dict[str, object]] = []
    outcome = simulate(trace, Fleet(replicas, capacity, 64, model), name, records=played.extend)
    assert outcome.totals.requests == len(trace) == len(played)
    assert [r["request_id"] for r in played] == [str(i) for i in range(len(trace))]  # arrival order
    for r, asked in zip(played, trace, strict=True):
        cached, prompt = r["cached_tokens"], r["prompt_tokens"]
        assert isinstance(cached, int) and isinstance(prompt, int)
        assert cached <= (prompt - 1) // 64 * 64 and cached % 64 == 0  # block-aligned, last token recomputed
        assert r["queue_seconds"] >= 0 and r["ttft_seconds"] >= r["queue_seconds"]  # type: ignore[operator]
        assert r["arrival_time"] == asked.arrival
    assert sum(outcome.requests_per_replica) == len(trace)


@settings(max_examples=100, deadline=None)
@given(random_traces)
def test_one_unbounded_replica_delivers_the_reachable_reuse(
    raw: list[tuple[float, int, list[int], int]],
) -> None:
    trace = build(raw)
    delivered = simulate(trace, Fleet(1, None, 64, LINEAR), "round_robin").totals
    reachable = walk(trace, None, 64, "reachable").totals
    assert (delivered.cached_tokens, delivered.hit_requests) == (
        reachable.cached_tokens,
        reachable.hit_requests,
    )


def test_a_cache_with_every_block_in_use_caches_nothing_more() -> None:
    cache = PrefixCache(1)
    assert cache.acquire(("a",), 1) == (0, 1)
    assert cache.acquire(("b",), 1) == (0, 0)


def test_a_replay_makes_no_reference_cycle_and_runs_with_the_cyclic_collector_paused() -> None:
    """simulate() pauses Python's cyclic collector while it replays (its walks over the process's
    long-lived objects were a tenth of a long replay): safe only while a replay, with its records
    and its KV events into a fleet index, leaves no cycle behind for it to find."""
    import gc
    import io

    from kvlens.fleet.index import FleetIndex
    from kvlens.simulate.funnel import events_into
    from kvlens.simulate.run import write_records
    from kvlens.simulate.trace import BUNDLED, open_trace

    trace = open_trace(BUNDLED)
    requests = list(trace.requests())[:1500]
    fleet = Fleet(3, 300, trace.block_size)
    seen: list[bool] = []
    index = FleetIndex(hashes_alike=True)
    out = io.BytesIO()
    gc.collect()
    was = gc.get_threshold()
    try:
        gc.set_threshold(0)  # nothing collected but by the calls below
        simulate(
            requests,
            fleet,
            "round_robin",
            records=write_records(out),
            progress=lambda _: seen.append(gc.isenabled()),
            events=events_into(index, trace.block_size),
        )
        assert gc.collect() == 0
    finally:
        gc.set_threshold(*was)
    assert seen and not any(seen) and gc.isenabled() and out.getvalue()
    gc.disable()
    try:
        simulate(requests[:10], fleet, "round_robin")
        assert not gc.isenabled()  # set back as it was
    finally:
        gc.enable()
