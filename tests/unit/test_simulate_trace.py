"""Trace readers: Mooncake, Bailian and kvlens records, their block sizes, chaining, time and rate
scaling, and errors that name the line."""

from __future__ import annotations

import gzip
import itertools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from kvlens.simulate.trace import BUNDLED, TraceError, chain, open_trace
from kvlens.sources import jsonlines


def write(path: Path, lines: list[Any]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return path


def test_the_bundled_mooncake_trace() -> None:
    trace = open_trace(BUNDLED)
    assert (trace.format, trace.block_size) == ("mooncake", 512)
    requests = list(trace.requests())
    assert len(requests) == 3993
    first = requests[0]
    assert (first.arrival, first.prompt_tokens, first.output_tokens) == (0.0, 40160, 6)
    assert len(first.blocks) == 40160 // 512  # the partial 79th block is never cached
    assert requests[-1].arrival == pytest.approx(1022.025)


def test_mooncake_lines(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 1500, "input_length": 1100, "output_length": 0, "hash_ids": [1, 2, 3]},
    ])  # fmt: skip
    first, second = open_trace(path).requests()
    assert first.blocks == (1, 2) and second.blocks == (1, 2)  # 1100 tokens: 2 full blocks
    assert second.arrival == 1.5


def test_bailian_blocks_are_chained(tmp_path: Path) -> None:
    """Bailian hashes each 16-token block alone: the same block after different prefixes must
    not be the same cache entry."""
    common = {"type": "text", "turn": 1, "parent_chat_id": -1, "output_length": 3}
    path = write(tmp_path / "b.jsonl", [
        {**common, "chat_id": 1, "timestamp": 0.5, "input_length": 32, "hash_ids": [7, 9]},
        {**common, "chat_id": 2, "timestamp": 1.0, "input_length": 32, "hash_ids": [8, 9]},
        {**common, "chat_id": 3, "parent_chat_id": 1, "turn": 2, "timestamp": 2.0, "input_length": 40,
         "hash_ids": [7, 9, 4]},
    ])  # fmt: skip
    trace = open_trace(path)
    assert (trace.format, trace.block_size) == ("bailian", 16)
    one, two, three = trace.requests()
    assert one.blocks[1] != two.blocks[1]  # block 9 after 7 is not block 9 after 8
    assert three.blocks == one.blocks  # the next turn shares its chat's prefix (40 tokens: 2 full blocks)
    assert one.blocks == chain((7, 9))


def test_kvlens_records_are_sorted_by_arrival(tmp_path: Path) -> None:
    base = {"cached_tokens": 0, "block_size": 16}
    path = write(tmp_path / "r.jsonl", [
        {**base, "prompt_tokens": 40, "prefix_hashes": ["a", "b"], "arrival_time": 5.0},
        {**base, "prompt_tokens": 20, "prefix_hashes": ["a"], "arrival_time": 1.0},
    ])  # fmt: skip
    trace = open_trace(path)
    assert trace.format == "kvlens"
    assert [r.arrival for r in trace.requests()] == [1.0, 5.0]


def test_time_and_rate_scaling(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 1000 * i, "input_length": 512, "output_length": 1, "hash_ids": [i]} for i in range(11)
    ]
    path = write(tmp_path / "t.jsonl", lines)
    assert [r.arrival for r in open_trace(path, time_scale=0.5).requests()][-1] == 5.0
    assert [r.arrival for r in open_trace(path, rate=2.0).requests()][-1] == pytest.approx(
        5.0
    )  # 10 gaps at 2/s


def test_a_gzipped_trace(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress(orjson.dumps({"timestamp": 0, "input_length": 512, "output_length": 1,
                                                 "hash_ids": [1]}) + b"\n"))  # fmt: skip
    assert len(list(open_trace(path).requests())) == 1


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1]}],
         "line 1: hash_ids has 1 blocks; 1024 tokens make 2 full blocks"),
        ([{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]},
          {"timestamp": 0, "input_length": "512", "output_length": 1, "hash_ids": [1]}],
         "line 2: input_length must be an integer"),
        ([{"timestamp": 5, "input_length": 512, "output_length": 1, "hash_ids": [1]},
          {"timestamp": 4, "input_length": 512, "output_length": 1, "hash_ids": [1]}],
         "line 2: timestamp goes back in time"),
        ([{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}, "oops"],
         "line 2: not a JSON object"),
        ([{"timestamp": -1, "input_length": 512, "output_length": 1, "hash_ids": [1]}],
         "line 1: timestamp must be a number >= 0"),
        ([{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": ["x"]}],
         "line 1: hash_ids must hold integers"),
        ([{"prompt": "hello"}], "line 1: not a trace kvlens reads"),
    ],
)  # fmt: skip
def test_bad_lines_are_named(tmp_path: Path, lines: list[Any], message: str) -> None:
    path = write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(TraceError, match=message):
        list(open_trace(path).requests())


def test_block_size_must_be_the_traces(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="the trace's blocks are 512 tokens, not --block-size 16"):
        open_trace(BUNDLED, block_size=16)
    path = write(
        tmp_path / "r.jsonl", [{"prompt_tokens": 40, "cached_tokens": 0, "prefix_hashes": ["a", "b"]}]
    )
    with pytest.raises(TraceError, match="records without block_size need --block-size"):
        open_trace(path)
    assert open_trace(path, block_size=16).block_size == 16


def test_string_prefix_hashes_give_the_same_keys_in_every_process(tmp_path: Path) -> None:
    """Before: keys were Python's ``hash(str)``, salted per process, so arms replayed in separate
    processes sent different prompts for the same records."""
    base = {"cached_tokens": 0, "block_size": 16, "arrival_time": 1.0}
    path = write(tmp_path / "r.jsonl", [{**base, "prompt_tokens": 48, "prefix_hashes": ["a1f", "9c0", 7]}])
    code = (
        "import sys; from kvlens.simulate.trace import open_trace; "
        "print([r.blocks for r in open_trace(sys.argv[1]).requests()])"
    )
    keys = {
        subprocess.run(
            [sys.executable, "-c", code, str(path)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(keys) == 1, keys
    (request,) = open_trace(path).requests()
    assert request.blocks[2] == hash(7)  # integers are keys as they were
    assert len(set(request.blocks)) == 3


def test_a_line_past_the_limit_is_named_and_the_lines_before_it_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jsonlines, "MAX_LINE_BYTES", 64 * 1024)
    good = {"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}
    path = tmp_path / "t.jsonl"
    path.write_bytes(
        orjson.dumps(good) + b"\n" + orjson.dumps(good) + b"\n" + b"[" * (3 * 1024 * 1024) + b"\n"
    )
    requests = open_trace(path).requests()
    assert [r.index for r in itertools.islice(requests, 2)] == [0, 1]
    with pytest.raises(TraceError) as raised:
        next(requests)
    assert str(raised.value) == f"{path} line 3: longer than {64 * 1024:,} bytes: not read"


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]},
          {"timestamp": 86_400_001, "input_length": 512, "output_length": 1, "hash_ids": [1]}],
         "line 2: timestamp is 86,400.001 s after the request before it"),
        ([{"chat_id": 1, "parent_chat_id": -1, "timestamp": 5, "input_length": 16, "output_length": 1,
           "hash_ids": [1]},
          {"chat_id": 2, "parent_chat_id": -1, "timestamp": 86_406, "input_length": 16, "output_length": 1,
           "hash_ids": [1]}],
         "line 2: timestamp is 86,401 s after the request before it"),
        # records are sorted first: the request after the gap is named by its own line
        ([{"prompt_tokens": 16, "prefix_hashes": ["a"], "block_size": 16, "arrival_time": 1.7e9},
          {"prompt_tokens": 16, "prefix_hashes": ["a"], "block_size": 16}],
         "line 1: arrival_time is 1,700,000,000 s after the request before it"),
    ],
)  # fmt: skip
def test_a_gap_over_a_day_between_requests_is_refused(tmp_path: Path, lines: list[Any], message: str) -> None:
    """Before: read as it was; a replay then waited that long for the next request, silently."""
    path = write(tmp_path / "t.jsonl", lines)
    with pytest.raises(TraceError, match=message):
        list(open_trace(path).requests())
    with pytest.raises(TraceError, match=message):
        open_trace(path, rate=1.0)  # the rate's pass reads them too


def test_a_gap_of_a_day_is_kept(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]},
        {"timestamp": 86_400_000, "input_length": 512, "output_length": 1, "hash_ids": [1]},
    ]
    assert [r.arrival for r in open_trace(write(tmp_path / "t.jsonl", lines)).requests()] == [0.0, 86_400.0]


def test_standard_input_is_no_trace() -> None:
    with pytest.raises(TraceError, match="-: a trace is read more than once: name a file"):
        open_trace("-")


def test_a_gzip_trace_cut_short_is_named(tmp_path: Path) -> None:
    """Before: gzip's EOFError went up as a traceback."""
    line = orjson.dumps({"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]})
    packed = gzip.compress(line + b"\n" + line + b"\n")
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(packed[: len(packed) - 12])  # no trailer, the last bytes of the stream gone
    with pytest.raises(TraceError) as raised:
        list(open_trace(path).requests())
    assert str(raised.value).startswith(
        f"{path}: the gzip stream ends before its end (the file was cut short)"
    )


def test_salts_are_mixed_into_the_first_key_and_inherited_as_vllm_does() -> None:
    """vLLM 0.33 mixes ``cache_salt`` into the first block's hash only; later blocks inherit it
    through the chain. So one salt shares the whole common prefix, two salts share nothing, and
    no salt (None or empty) keys the blocks as they were."""
    from kvlens.simulate.trace import salted

    blocks = chain((1, 2, 3, 4))
    assert salted(blocks, None) == blocks and salted(blocks, "") == blocks
    a, b = salted(blocks, "tenant-a"), salted(blocks, "tenant-b")
    assert a == salted(blocks, "tenant-a")  # the same salt: every block shared
    assert not set(a) & set(b) and not set(a) & set(blocks)  # different salts, or none: nothing
    assert salted(blocks[:2], "tenant-a") == a[:2]  # a shorter prompt shares the salted prefix
    assert salted(chain((1, 2, 9)), "tenant-a")[:2] == a[:2]  # and a diverging one up to the fork
    # a digest of the salt, not hash(str): the same keys in every process (records carry them)
    script = "from kvlens.simulate.trace import salted; print(salted((1, 2), 's'))"
    env = {**os.environ, "PYTHONHASHSEED": "random"}
    runs = {
        subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        ).stdout
        for _ in range(2)
    }
    assert runs == {f"{salted((1, 2), 's')}\n"}


def test_a_trace_lines_cache_salt_partitions_the_offline_fleet(tmp_path: Path) -> None:
    from kvlens.simulate.run import Fleet, simulate

    line = {"input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 3]}
    salts = [None, "a", "a", "b", None, "a"]
    path = write(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 1000 * i, **line, **({"cache_salt": salt} if salt else {})}
            for i, salt in enumerate(salts)
        ],
    )
    records: list[dict[str, Any]] = []
    requests = list(open_trace(path).requests())
    assert [r.cache_salt for r in requests] == salts
    simulate(requests, Fleet(1, None, 512), "round_robin", records=records.extend)
    # 1100 tokens: 2 full blocks of 512 can hit. The first of each scope misses, the rest hit.
    assert [r["cached_tokens"] for r in records] == [0, 0, 1024, 0, 1024, 1024]
    bad = write(tmp_path / "bad.jsonl", [{"timestamp": 0, **line, "cache_salt": 7}])
    with pytest.raises(TraceError, match="line 1: cache_salt must be a string"):
        list(open_trace(bad).requests())


def test_the_simulated_engines_publish_a_salt_as_vllm_does(tmp_path: Path) -> None:
    """A salted request's chain start is published with the salt in its first block's extra keys
    (vLLM 0.33's BlockStored), so a kvlens with --require-cache-salt counts only the unsalted."""
    from kvlens.fleet.index import FleetIndex
    from kvlens.fleet.simulated import SimulatedEngine, into_index
    from kvlens.simulate.run import Fleet, simulate

    line = {"input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 3]}
    salts = ["a", None, "b"]
    path = write(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 1000 * i, **line, "hash_ids": [10 * i + 1, 10 * i + 2, 10 * i + 3],
             **({"cache_salt": salt} if salt else {})}
            for i, salt in enumerate(salts)
        ],
    )  # fmt: skip
    index = FleetIndex(require_cache_salt=True)
    events = lambda replica: SimulatedEngine(str(replica), 512, into_index(index))  # noqa: E731
    simulate(open_trace(path).requests(), Fleet(1, None, 512), "round_robin", events=events)
    assert index.snapshot().unsalted_blocks == {"0": 2}  # the unsalted request's 2 full blocks


def test_extra_keys_carry_the_lora_on_every_block_and_the_salt_on_a_chains_first() -> None:
    from kvlens.fleet.simulated import extra_keys

    assert extra_keys(3, True, "s", "sql") == [["sql", "s"], ["sql"], ["sql"]]
    assert extra_keys(2, False, "s", None) == [None, None]  # a store past the chain's start
    assert extra_keys(2, True, "s", None) == [["s"], None]
