"""The session schedule of ``kvlens replay`` over real HTTP against a scripted server: a turn is
never sent before the answers it waits for have ended, sub-agents run side by side (the server
holds their answers until both have arrived: a schedule that sent them one after the other would
hang, and the timeout mark fails it), the parent waits for all of them, conversations are bounded
by --max-sessions, and salts per conversation keep two replays of one trace apart. Real
kv-cache-tester conversation files (tests/fixtures/kv-cache-tester)."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from kvlens.experiment.client import MEASURE, Endpoint, Progress, RecordWriter
from kvlens.experiment.prompts import PromptSynthesizer
from kvlens.experiment.run import Schedule
from kvlens.experiment.sessions import SessionPlan, replay_sessions
from kvlens.simulate.trace import TraceRequest, open_trace

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kv-cache-tester"
WITH_SUBAGENTS = FIXTURES / "trace_0291.json"


def answer(prompt_tokens: int) -> bytes:
    events = (
        b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
        + b'data: {"choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":1,'
        b'"prompt_tokens_details":{"cached_tokens":0}}}\n\n' % prompt_tokens + b"data: [DONE]\n\n"
    )
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(events), events)


Gate = Callable[[dict[str, Any]], "asyncio.Future[None] | None"]


class Server:
    """Answers every completion at once (unless ``gate`` holds it), logging ("received", body) and
    ("answered", body) in the order they happen."""

    def __init__(self, gate: Gate | None = None) -> None:
        self.log: list[tuple[str, dict[str, Any]]] = []
        self.gate = gate
        self.connections: set[asyncio.Task[Any]] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.connections.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                body = orjson.loads(await reader.readexactly(length))
                body["prompt_tokens"] = len(body.pop("prompt"))
                self.log.append(("received", body))
                held = self.gate(body) if self.gate else None
                if held is not None:
                    await held
                self.log.append(("answered", body))
                writer.write(answer(body["prompt_tokens"]))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def order(self, event: str) -> list[int]:
        return [body["prompt_tokens"] for kind, body in self.log if kind == event]


async def run_sessions(
    server: Server, requests: list[TraceRequest], block_size: int, plan: SessionPlan, salt: str | None = None
) -> list[dict[str, Any]]:
    listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    out = io.BytesIO()
    planned = Schedule(sessions=plan, salt=salt).planned(requests, MEASURE)
    endpoint = Endpoint(f"http://127.0.0.1:{port}", "m", timeout_seconds=60, max_concurrency=64)
    try:
        await replay_sessions(
            planned, PromptSynthesizer(block_size), endpoint, "arm", RecordWriter(out), plan, Progress()
        )
    finally:
        listening.close()
        await asyncio.gather(*server.connections)  # the client closed them: each ends at its EOF
    return [orjson.loads(line) for line in out.getvalue().splitlines()]


@pytest.mark.timeout(60)
def test_turns_wait_for_their_answers_sub_agents_overlap_and_the_parent_waits() -> None:
    trace = open_trace(WITH_SUBAGENTS)
    requests = list(trace.requests())
    length = {r.index: r.prompt_tokens for r in requests}
    firsts = {r.prompt_tokens for r in requests if r.parent is not None and r.turn == 0}
    assert len(firsts) == 2
    both_arrived: asyncio.Future[None] | None = None

    def gate(body: dict[str, Any]) -> asyncio.Future[None] | None:
        """Hold each sub-agent's first answer until both sub-agents have sent their first request."""
        nonlocal both_arrived
        if body["prompt_tokens"] not in firsts:
            return None
        if both_arrived is None:
            both_arrived = asyncio.get_running_loop().create_future()
            return both_arrived
        both_arrived.set_result(None)
        return None

    server = Server(gate)
    records = asyncio.run(run_sessions(server, requests, trace.block_size, SessionPlan(think_scale=0.0)))
    received = server.order("received")
    assert sorted(received) == sorted(length.values())  # every request once
    events = [(kind, body["prompt_tokens"]) for kind, body in server.log]
    for r in requests:
        sent_at = events.index(("received", r.prompt_tokens))
        for before in r.after:
            assert events.index(("answered", length[before])) < sent_at, (r.index, before)
    one, two = sorted(firsts, key=received.index)
    assert events.index(("received", two)) < events.index(("answered", one))  # side by side
    join = next(r for r in requests if len(r.after) == 2)
    joined_at = events.index(("received", join.prompt_tokens))
    assert all(events.index(("answered", length[i])) < joined_at for i in join.after)
    sessions = {record["trace_index"]: record["session_id"] for record in records}
    assert sessions == {r.index: r.session for r in requests}
    assert all("error" not in record for record in records)


@pytest.mark.timeout(60)
def test_max_sessions_runs_conversations_one_after_the_other() -> None:
    trace = open_trace(FIXTURES)  # three conversations, all starting at 0
    requests = list(trace.requests())
    server = Server()
    plan = SessionPlan(think_scale=0.0, max_sessions=1)
    asyncio.run(run_sessions(server, requests, trace.block_size, plan))
    conversation = {r.prompt_tokens: (r.session or "").split("/")[0] for r in requests}
    order = [conversation[n] for n in server.order("received")]
    runs = [name for i, name in enumerate(order) if i == 0 or order[i - 1] != name]
    assert sorted(runs) == sorted(set(order)) and len(runs) == 3  # each conversation whole, in turn


@pytest.mark.timeout(60)
def test_salts_per_session_keep_two_concurrent_replays_apart() -> None:
    """Two replays of one trace at once, each with its own salt: no request of one carries a salt
    of the other, and each conversation (sub-agents with it) has one salt. The simulated server
    does not honour cache_salt yet (another branch adds it): the bodies are what is checked."""
    trace = open_trace(FIXTURES)
    requests = list(trace.requests())
    server = Server()

    async def both() -> None:
        plan = SessionPlan(think_scale=0.0)
        await asyncio.gather(
            run_sessions(server, requests, trace.block_size, plan, salt="run1"),
            run_sessions(server, requests, trace.block_size, plan, salt="run2"),
        )

    asyncio.run(both())
    bodies = [body for kind, body in server.log if kind == "received"]
    assert len(bodies) == 2 * len(requests)
    salts = {body["cache_salt"] for body in bodies}
    one = {salt for salt in salts if salt.startswith("run1-")}
    two = {salt for salt in salts if salt.startswith("run2-")}
    assert one | two == salts and not (one & two)
    conversations = {(r.session or "").split("/")[0] for r in requests}
    assert one == {f"run1-{name}" for name in conversations}  # sub-agents share their parent's salt
    by_length: dict[int, set[str]] = {}
    for body in bodies:
        by_length.setdefault(body["prompt_tokens"], set()).add(body["cache_salt"].split("-", 1)[0])
    assert all(runs == {"run1", "run2"} for runs in by_length.values())


def test_the_timestamp_schedule_stays_the_default_for_mooncake(tmp_path: Path) -> None:
    from kvlens.cli import replay
    from kvlens.cli.common import Parser
    from kvlens.simulate.trace import BUNDLED

    parser = Parser(prog="kvlens")
    replay.add_parser(parser.add_subparsers())

    def schedule(trace: Path, *more: str) -> Schedule:
        flags = ["--endpoint", "http://127.0.0.1:1", "--model", "m", "--arm", "a", "--out", f"{tmp_path}/o"]
        return replay.setup(parser.parse_args(["replay", str(trace), *flags, *more]), warms=False)[2]

    mooncake = schedule(BUNDLED, "--requests", "5")
    assert mooncake.sessions is None and mooncake.salt is None
    conversations = schedule(FIXTURES, "--salt-per-session", "--think-scale", "0.5")
    assert conversations.sessions == SessionPlan(think_scale=0.5) and conversations.salt is not None
    assert schedule(FIXTURES, "--schedule", "timestamps").sessions is None


@pytest.mark.timeout(60)
def test_an_interrupted_session_replay_records_nothing_for_what_was_in_flight() -> None:
    """Ctrl-C during a session replay: the requests in flight are not measured (no record, not an
    error), as the timestamp schedule leaves them."""
    trace = open_trace(FIXTURES / "trace_0504.json")
    requests = list(trace.requests())

    async def run() -> list[dict[str, Any]]:
        received = asyncio.Event()
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def gate(body: dict[str, Any]) -> asyncio.Future[None] | None:
            if body["prompt_tokens"] == requests[1].prompt_tokens:
                received.set()
                return never  # the second turn is never answered
            return None

        server = Server(gate)
        listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        port = listening.sockets[0].getsockname()[1]
        out = io.BytesIO()
        plan = SessionPlan(think_scale=0.0)
        planned = Schedule(sessions=plan).planned(requests, MEASURE)
        endpoint = Endpoint(f"http://127.0.0.1:{port}", "m", timeout_seconds=60)
        replaying = asyncio.ensure_future(
            replay_sessions(planned, PromptSynthesizer(64), endpoint, "arm", RecordWriter(out), plan)
        )
        await received.wait()
        replaying.cancel()
        await asyncio.gather(replaying, return_exceptions=True)
        listening.close()
        for connection in server.connections:
            connection.cancel()
        await asyncio.gather(*server.connections, return_exceptions=True)
        return [orjson.loads(line) for line in out.getvalue().splitlines()]

    records = asyncio.run(run())
    assert [r["trace_index"] for r in records] == [0]  # the first answered; the second not recorded
    assert "error" not in records[0]


def test_every_experiment_reads_every_trace_format() -> None:
    """`experiment quantization` reads its trace as `replay` does (conversations included)."""
    from kvlens.cli import experiment
    from kvlens.cli.common import Parser
    from kvlens.cli.replay import read_requests

    parser = Parser(prog="kvlens")
    experiment.add_parser(parser.add_subparsers())
    flags = ["--endpoint", "a=http://127.0.0.1:1", "--model", "m", "--out-dir", "unused"]
    args = parser.parse_args(
        ["experiment", "quantization", str(FIXTURES), *flags, "--trace-format", "kv-cache-tester"]
    )
    requests, _, block_size = read_requests(args)
    assert (len(requests), block_size) == (38, 64)
