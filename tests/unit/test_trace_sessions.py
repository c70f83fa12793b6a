"""Agentic traces read directly: kv-cache-tester conversations (real files from
callanjfox/kv-cache-tester), Dynamo's agentic Mooncake rows and BurstGPT's CSV; their sessions,
turns, sub-agents and think times, and the theoretical reuse of an unbounded cache."""

from __future__ import annotations

import gzip
import itertools
import shutil
from pathlib import Path

import orjson
import pytest

from kvlens.simulate.cache import PrefixCache
from kvlens.simulate.run import served
from kvlens.simulate.trace import TraceError, open_trace

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CONVERSATIONS = FIXTURES / "kv-cache-tester"
WITH_SUBAGENTS = CONVERSATIONS / "trace_0291.json"
AGENTIC = FIXTURES / "agentic-mooncake" / "agentic.jsonl"
BURSTGPT = FIXTURES / "burstgpt" / "BurstGPT_1_head.csv"


def test_a_conversation_file_is_read_with_its_turns_and_think_times() -> None:
    trace = open_trace(CONVERSATIONS / "trace_0504.json")
    assert (trace.format, trace.block_size) == ("kv-cache-tester", 64)
    requests = list(trace.requests())
    raw = orjson.loads((CONVERSATIONS / "trace_0504.json").read_bytes())["requests"]
    assert [r.prompt_tokens for r in requests] == [entry["in"] for entry in raw]
    assert [r.output_tokens for r in requests] == [entry["out"] for entry in raw]
    assert [r.arrival for r in requests] == [entry["t"] for entry in raw]
    assert [r.turn for r in requests] == list(range(len(raw)))
    assert {r.session for r in requests} == {"trace_0504"}
    assert [r.after for r in requests] == [(), *((i,) for i in range(len(raw) - 1))]
    assert [r.think for r in requests] == [entry["think_time"] for entry in raw]
    assert all(len(r.blocks) == r.prompt_tokens // 64 for r in requests)  # full blocks only


def test_subagents_run_side_by_side_and_the_parent_waits_for_all() -> None:
    requests = list(open_trace(WITH_SUBAGENTS).requests())
    raw = orjson.loads(WITH_SUBAGENTS.read_bytes())["requests"]
    markers = [entry for entry in raw if entry.get("type") == "subagent"]
    assert len(markers) == 2 and len(requests) == 20 + 5 + 7  # parent, agent_001, agent_002
    by_session: dict[str | None, list[int]] = {}
    for r in requests:
        by_session.setdefault(r.session, []).append(r.index)
    assert set(by_session) == {"trace_0291", "trace_0291/agent_001", "trace_0291/agent_002"}
    parent = by_session["trace_0291"]
    spawn = parent[15]  # the parent's 16th request, then the two sub-agents
    for name in ("trace_0291/agent_001", "trace_0291/agent_002"):
        first = requests[by_session[name][0]]
        assert (first.parent, first.turn, first.after) == ("trace_0291", 0, (spawn,))
    join = requests[parent[16]]
    assert join.after == (by_session["trace_0291/agent_001"][-1], by_session["trace_0291/agent_002"][-1])
    assert join.think == 108.0  # its think_time
    # every request comes after those it waits for, in the trace's order and in time
    for r in requests:
        assert all(i < r.index and requests[i].arrival <= r.arrival for i in r.after)


def test_think_time_falls_back_to_the_gap_less_the_answer(tmp_path: Path) -> None:
    conversation = orjson.loads((CONVERSATIONS / "trace_0187.json").read_bytes())
    for entry in conversation["requests"]:
        entry.pop("think_time", None)
    path = tmp_path / "old.json"
    path.write_bytes(orjson.dumps(conversation))
    raw = conversation["requests"]
    requests = list(open_trace(path).requests())
    gaps = [max(0.0, b["t"] - a["t"] - a["api_time"]) for a, b in itertools.pairwise(raw)]
    assert [r.think for r in requests[1:]] == pytest.approx(gaps)


def test_a_directory_of_conversations_and_session_rate(tmp_path: Path) -> None:
    for name in ("trace_0504.json", "trace_0187.json"):
        shutil.copy(CONVERSATIONS / name, tmp_path / name)
    with gzip.open(tmp_path / "trace_0291.json.gz", "wb") as out:
        out.write(WITH_SUBAGENTS.read_bytes())
    (tmp_path / "notes.txt").write_text("not a conversation")
    requests = list(open_trace(tmp_path).requests())
    small = len(_flat(CONVERSATIONS / "trace_0187.json")) + len(_flat(CONVERSATIONS / "trace_0504.json"))
    assert len(requests) == 32 + small
    assert [r.index for r in requests] == list(range(len(requests)))
    arrivals = [r.arrival for r in requests]
    assert arrivals == sorted(arrivals)
    firsts = {r.session: r.arrival for r in requests if r.turn == 0 and r.parent is None}
    assert set(firsts.values()) == {0.0}  # the files record no offset between conversations
    paced = list(open_trace(tmp_path, session_rate=0.5).requests())
    starts = sorted(r.arrival for r in paced if r.turn == 0 and r.parent is None)
    assert starts == [0.0, 2.0, 4.0]  # one conversation every 2 s, in file-name order
    with pytest.raises(TraceError, match="--session-rate starts conversation files"):
        open_trace(AGENTIC, session_rate=1.0)


def _flat(path: Path) -> list[dict[str, object]]:
    return [e for e in orjson.loads(path.read_bytes())["requests"] if e.get("type") != "subagent"]


def test_local_ids_are_the_conversation_s_own(tmp_path: Path) -> None:
    """Two conversations' id 1 are different blocks when the scope is local, the same when global."""
    for name in ("a.json", "b.json"):
        shutil.copy(CONVERSATIONS / "trace_0504.json", tmp_path / name)
        value = orjson.loads((tmp_path / name).read_bytes())
        value["id"] = name
        (tmp_path / name).write_bytes(orjson.dumps(value))
    first = {r.session: r.blocks for r in open_trace(tmp_path).requests() if r.turn == 0}
    assert first["a.json"][0] != first["b.json"][0]
    for name in ("a.json", "b.json"):
        value = orjson.loads((tmp_path / name).read_bytes())
        value["hash_id_scope"] = "global"
        (tmp_path / name).write_bytes(orjson.dumps(value))
    first = {r.session: r.blocks for r in open_trace(tmp_path).requests() if r.turn == 0}
    assert first["a.json"] == first["b.json"]


def test_the_unbounded_cache_reuse_of_a_conversation_is_the_hand_count() -> None:
    """Counted from the file's hash ids alone: a request's leading ids seen in an earlier request
    of the conversation, at most (n - 1) // 64 blocks."""
    raw = _flat(CONVERSATIONS / "trace_0504.json")
    seen: set[int] = set()
    by_hand = []
    for entry in raw:
        ids = entry["hash_ids"][: entry["in"] // 64]
        hits = 0
        while hits < min(len(ids), (entry["in"] - 1) // 64) and ids[hits] in seen:
            hits += 1
        seen.update(ids)
        by_hand.append(hits * 64)
    trace = open_trace(CONVERSATIONS / "trace_0504.json")
    counted = [tokens for _, tokens in served(trace.requests(), PrefixCache(None), trace.block_size)]
    assert counted == by_hand
    assert counted[0] == 0 and sum(counted) == sum(by_hand) > 0
    # the file, read by eye: turn 2 (11,300 tokens) starts with turn 1's 173 full blocks (ids 1 to
    # 173); turn 3 has ids 1 to 170, then 177: a new block (the conversation was edited there)
    assert by_hand == [0, 173 * 64, 170 * 64]


def test_sub_agents_share_their_tool_prefix_in_the_unbounded_cache() -> None:
    trace = open_trace(WITH_SUBAGENTS)
    reused = {r.index: (r, tokens) for r, tokens in served(trace.requests(), PrefixCache(None), 64)}
    firsts = [r for r, _ in reused.values() if r.turn == 0 and r.parent is not None]
    one, two = firsts
    common = 0
    while one.blocks[common] == two.blocks[common]:
        common += 1
    assert reused[two.index][1] == common * 64 > 0  # the second sub-agent reuses the first's prefix


def test_agentic_mooncake_rows() -> None:
    trace = open_trace(AGENTIC)
    assert (trace.format, trace.block_size) == ("agentic-mooncake", 512)
    parent1, child1, child2, parent2 = trace.requests()
    assert (parent1.session, parent1.after, parent1.arrival) == ("root", (), 0.0)
    assert (child1.session, child1.parent, child1.after, child1.think) == ("child", "root", (0,), 0.1)
    assert (child2.turn, child2.parent, child2.after) == (1, None, (1,))
    assert child2.think == pytest.approx(0.15)  # delay 50 ms + tool_wait_ms 100 ms
    assert (parent2.turn, parent2.after, parent2.think) == (1, (0, 2), 0.1)
    assert parent2.blocks == (11, 12, 13)  # Mooncake's ids, already chained
    assert open_trace(AGENTIC, block_size=256).block_size == 256  # the rows do not say theirs


def test_agentic_rows_must_wait_for_earlier_rows(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(
        b'{"request_id":"b","session_id":"s","input_length":10,"output_length":1,"hash_ids":[],'
        b'"timestamp":0,"wait_for":["a"]}\n'
    )
    with pytest.raises(TraceError, match=r"line 1: wait_for names 'a', which is on no earlier row"):
        list(open_trace(path).requests())


def test_burstgpt_lengths_and_times_only() -> None:
    trace = open_trace(BURSTGPT)
    assert (trace.format, trace.block_size) == ("burstgpt", 16)
    requests = list(trace.requests())
    assert [(r.arrival, r.prompt_tokens, r.output_tokens) for r in requests] == [
        (5.0, 472, 18),
        (45.0, 1087, 230),
        (118.0, 417, 276),
    ]
    keys = [set(r.blocks) for r in requests]
    assert all(not (a & b) for i, a in enumerate(keys) for b in keys[i + 1 :])  # no hashes: nothing shared
    assert [tokens for _, tokens in served(requests, PrefixCache(None), 16)] == [0, 0, 0]


def test_burstgpt_sessions(tmp_path: Path) -> None:
    path = tmp_path / "b3.csv"
    path.write_text(
        "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "10,s1,1.5,ChatGPT,100,50,150,Conversation log\n"
        "20,s1,2.0,ChatGPT,200,60,260,Conversation log\n"
        "21,,1.0,GPT-4,30,5,35,API log\n"
    )
    _, two, api = open_trace(path).requests()
    assert (two.session, two.turn, two.after, two.think) == ("s1", 1, (0,), 8.5)
    assert (api.session, api.after) == (None, ())


def test_the_format_can_be_forced(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="--trace-format 'nope'"):
        open_trace(AGENTIC, trace_format="nope")
    plain = list(open_trace(AGENTIC, trace_format="mooncake").requests())  # rows read as Mooncake
    assert [r.session for r in plain] == [None] * 4 and [r.arrival for r in plain] == [0.0, 0.2, 0.45, 0.7]
    with pytest.raises(TraceError, match="line 1: unexpected character"):
        list(open_trace(BURSTGPT, trace_format="mooncake").requests())


def test_a_conversation_past_the_bound_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlens.sources import jsonlines

    monkeypatch.setattr(jsonlines, "MAX_LINE_BYTES", 1000)
    pretty = tmp_path / "pretty.json"
    pretty.write_text('{\n  "block_size": 64,\n  "requests": []\n' + " " * 2000 + "}\n")
    with pytest.raises(TraceError, match="longer than 1,000 bytes"):
        open_trace(tmp_path)


def test_a_conversation_with_a_bad_request_names_it(tmp_path: Path) -> None:
    value = orjson.loads(WITH_SUBAGENTS.read_bytes())
    value["requests"][16]["requests"][2]["in"] = -5
    path = tmp_path / "bad.json"
    path.write_bytes(orjson.dumps(value))
    with pytest.raises(TraceError, match=r"bad.json: trace_0291/agent_001 request 2: in must be an integer"):
        open_trace(path).requests().__next__()


def test_the_bundled_agentic_slice_and_the_demo_on_it() -> None:
    from kvlens.simulate.demo import CAPACITY_TOKENS, ReplayTraffic
    from kvlens.simulate.trace import BUNDLED_AGENTIC

    assert (BUNDLED_AGENTIC / "NOTICE").read_text().count("Apache License 2.0") == 1
    trace = open_trace(BUNDLED_AGENTIC, session_rate=1 / 30)
    requests = list(trace.requests())
    assert (trace.format, trace.block_size, len(requests)) == ("kv-cache-tester", 64, 104)
    assert len({r.session for r in requests if r.parent is None}) == 8
    assert sorted(r.arrival for r in requests if r.turn == 0 and r.parent is None) == [
        30.0 * i for i in range(8)
    ]
    replay = ReplayTraffic(speed=1.0, trace=str(BUNDLED_AGENTIC), session_rate=1 / 30, origin=0.0)
    assert (replay.block_size, replay.capacity_blocks) == (64, CAPACITY_TOKENS // 64)
    first = replay.records(0.0, replay.loop_seconds)  # one loop (speed 1, from 0)
    assert len(first) == 104 and first[0]["request_id"] == "kv-cache-tester-0-0"
    assert first[0]["cached_tokens"] == 0 and sum(r["cached_tokens"] for r in first) > 0


def test_simulate_keeps_each_session_in_order(tmp_path: Path) -> None:
    from kvlens.cli import main

    out = tmp_path / "records.jsonl"
    flags = ["--replicas", "2", "--policy", "round_robin", "--capacity-blocks", "unbounded"]
    assert main(["simulate", str(CONVERSATIONS), *flags, "--emit-records", str(out), "--json"]) == 0
    records = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    requests = list(open_trace(CONVERSATIONS).requests())
    assert len(records) == len(requests)
    arrival = {int(r["request_id"]): r["arrival_time"] for r in records}
    for r in requests:  # a turn arrives no sooner than the requests it waits for
        assert all(arrival[i] <= arrival[r.index] for i in r.after)
    assert [arrival[r.index] for r in requests] == [r.arrival for r in requests]


def test_sub_agents_nested_past_the_bound_and_too_many_files_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvlens.simulate import conversations

    leaf: dict[str, object] = {"t": 0.0, "in": 64, "out": 1, "hash_ids": [1]}
    entries: list[dict[str, object]] = [leaf]
    for depth in range(conversations.MAX_DEPTH + 1):
        entries = [leaf, {"type": "subagent", "agent_id": f"a{depth}", "t": 1.0, "requests": entries}]
    deep = tmp_path / "deep" / "c.json"
    deep.parent.mkdir()
    deep.write_bytes(orjson.dumps({"block_size": 64, "requests": entries}))
    with pytest.raises(TraceError, match=f"sub-agents nested deeper than {conversations.MAX_DEPTH}"):
        list(open_trace(deep).requests())
    monkeypatch.setattr(conversations, "MAX_FILES", 2)
    for name in ("a.json", "b.json", "c.json"):
        shutil.copy(CONVERSATIONS / "trace_0504.json", tmp_path / name)
    with pytest.raises(TraceError, match="more than 2 conversation files"):
        open_trace(tmp_path)
