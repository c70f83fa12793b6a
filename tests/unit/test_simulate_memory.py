"""A replica bound by its KV memory (``kvlens simulate serve --gpu-memory-bytes``): blocks sized
as vLLM sizes them, requests waiting for blocks, the newest preempted when decode runs out, and
every decode step timed by the byte model."""

from __future__ import annotations

import math

import pytest

from kvlens.definitions import CostModel
from kvlens.simulate.memory import MemoryReplica, kv_blocks, make_replica
from kvlens.simulate.replica import INF, DecodeModel, Job, Replica, ServiceModel
from kvlens.simulate.trace import TraceRequest

BLOCK = 4
# A step reads 1 GB of weights and 1 MB of KV per token at 1 TB/s: 1 ms + 1 us per token held.
DECODE = DecodeModel(step_overhead_seconds=0.0, weight_bytes=1e9, kv_bytes_per_token=1e6,
                     bandwidth_bytes_per_second=1e12)  # fmt: skip
SERVICE = ServiceModel(prefill=CostModel(a=1e-4, b=0.0, unit="seconds"), decode=DECODE, admit_by_memory=True)


def job(index: int, prompt: int, output: int, arrival: float = 0.0) -> Job:
    blocks = tuple(1000 * (index + 1) + i for i in range(prompt // BLOCK))  # shares nothing
    return Job(TraceRequest(index, arrival, prompt, output, blocks), index, BLOCK)


def replica(blocks: int, service: ServiceModel = SERVICE) -> tuple[MemoryReplica, list[Job]]:
    done: list[Job] = []
    made = make_replica(0, blocks, BLOCK, service, done)
    assert isinstance(made, MemoryReplica)
    return made, done


def test_blocks_are_sized_as_vllm_sizes_them() -> None:
    # 80 GB at 0.9, Llama-3.1-8B's 16.06 GB of weights, 128 KiB a token, 16-token blocks
    blocks = kv_blocks(80e9, 0.9, 16.06e9, 131_072, 16)
    assert blocks == math.floor((72e9 - 16.06e9) / (16 * 131_072)) == 26_674
    with pytest.raises(ValueError, match="no room for the KV cache"):
        kv_blocks(16e9, 0.9, 16.06e9, 131_072, 16)
    with pytest.raises(ValueError, match="utilization"):
        kv_blocks(80e9, 1.5, 16.06e9, 131_072, 16)


def test_without_memory_binding_the_replica_is_the_cache_bound_one() -> None:
    done: list[Job] = []
    plain = make_replica(0, 10, BLOCK, ServiceModel(decode=DECODE), done)
    assert type(plain) is Replica


def test_each_decode_step_takes_what_the_byte_model_gives_for_the_tokens_held() -> None:
    server, done = replica(100)
    one = job(0, 8, 4)
    server.enqueue(one, 0.0)
    server.advance(INF)
    assert done == [one]
    assert one.first_token == pytest.approx(8e-4)  # prefill of 8 tokens at 0.1 ms each
    # three steps after the first token, with 9, 10 and 11 tokens held
    steps = [DECODE.step_seconds(1, tokens) for tokens in (9, 10, 11)]
    assert one.finish - one.first_token == pytest.approx(sum(steps))
    assert one.finish - one.first_token == pytest.approx(0.003 + 30e-6)


def test_a_request_whose_blocks_do_not_fit_waits_and_so_does_everyone_behind_it() -> None:
    server, done = replica(6)  # 24 tokens
    first, second, third = job(0, 16, 2), job(1, 12, 2), job(2, 4, 2)
    for each in (first, second, third):
        server.enqueue(each, 0.0)
    server.advance(1e-3)  # first prefilled (1.6 ms)? not yet: it holds 4 blocks, 2 left
    assert server.running == 1 and server.queued == 2
    server.advance(INF)
    assert [j.index for j in done] == [0, 1, 2]
    # the second (3 blocks) waited for the first to finish, and the third (1 block) behind it
    assert second.start == first.finish
    assert third.start >= second.start
    assert server.preemptions == 0
    assert server.cache.held_blocks == 0


def test_the_newest_running_request_is_preempted_when_decode_runs_out_and_recomputed() -> None:
    server, done = replica(5)  # 20 tokens
    old, new = job(0, 8, 6), job(1, 8, 6)  # each 2 blocks at admission, 4 at its end
    server.enqueue(old, 0.0)
    server.enqueue(new, 0.0)
    server.advance(INF)
    assert sorted(j.index for j in done) == [0, 1]
    assert server.preemptions >= 1
    assert old.finish < new.finish
    assert new.generated == new.output_tokens == 6 and old.generated == 6
    assert new.start < old.finish  # it ran beside the old one before it was preempted
    assert server.cache.held_blocks == 0 and server.running == 0 and server.queued == 0


def test_an_aborted_request_frees_its_blocks_and_the_waiting_one_starts() -> None:
    server, done = replica(8)  # 32 tokens: the first alone reaches 28
    first, second = job(0, 12, 16), job(1, 20, 2)
    server.enqueue(first, 0.0)
    server.enqueue(second, 0.0)
    server.advance(0.01)
    assert second.start == INF
    server.abort(first, 0.01)
    assert first.finish == 0.01 and second.start == 0.01
    server.advance(INF)
    assert done == [first, second] and server.cache.held_blocks == 0


def test_a_request_that_leaves_while_waiting_is_dropped_from_the_line() -> None:
    server, done = replica(6)
    first, second, third = job(0, 12, 10), job(1, 12, 2), job(2, 4, 2)
    for each in (first, second, third):
        server.enqueue(each, 0.0)
    server.abort(second, 0.0)
    assert second in done and server.queued == 1
    server.advance(INF)
    assert [j.index for j in done] == [1, 2, 0]  # the short third one ran beside the first


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--gpu-memory-bytes", "80GB", "--capacity-blocks", "10"], "both size the KV cache: give one"),
        (["--gpu-memory-bytes", "16GB"], "no room for the KV cache"),
        # 18 GB x 0.9 - 16.06 GB leaves 66 blocks of 2 MiB: 1,056 tokens, under 32,768
        (
            ["--gpu-memory-bytes", "18GB"],
            "the KV cache holds 1,056 tokens (66 blocks), fewer than --max-model-len",
        ),
    ],
)
def test_simulate_serve_refuses_memory_that_cannot_serve(
    flags: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvlens.cli import main

    assert main(["simulate", "serve", *flags]) == 2
    assert said in capsys.readouterr().err
