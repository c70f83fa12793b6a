"""`kvlens simulate serve` as a real process, driven by the official `openai` client and raw HTTP:
completions and chat (streaming and not), cached tokens by prompt content under the simulator's
block rules, vLLM-shaped errors, a client that leaves mid-stream, and the same cached tokens as
an offline `kvlens simulate` of the same prompts."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest

from kvlens.cli import main
from kvlens.simulate.serve import tokenizer
from tests.live import Running, TextHandler, free_port, in_thread, start_kvlens, total

pytestmark = pytest.mark.integration
B = 16  # block size


def serve(*flags: str, port: int | None = None) -> Running:
    return start_kvlens("simulate", "serve", "--block-size", str(B), *flags, ready="/health", port=port)


@pytest.fixture
def server() -> Iterator[Running]:
    running = serve("--speed", "1000")
    yield running
    running.output()


def client(running: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)


def cached(usage: object) -> int:
    details = getattr(usage, "prompt_tokens_details", None)
    assert details is not None
    return int(details.cached_tokens)


def ids(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(tokenizer.FIRST_PLAIN_ID, 30_000) for _ in range(count)]


def complete(api: openai.OpenAI, prompt: list[int] | str, max_tokens: int = 4) -> int:
    answer = api.completions.create(model="simulated", prompt=prompt, max_tokens=max_tokens)
    assert answer.usage is not None
    return cached(answer.usage)


def test_completions_stream_and_not_cache_by_content(server: Running) -> None:
    api = client(server)
    first = ids(40, 1)
    answer = api.completions.create(model="simulated", prompt=first, max_tokens=5, user="u1")
    assert answer.choices[0].text == "The q" and answer.choices[0].finish_reason == "length"
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, cached(answer.usage)) == (40, 5, 0)
    # The same prompt again: its 2 full blocks of 16 (the last token is never served from cache).
    assert complete(api, first) == 32
    # Sharing the first block only (the second differs at its last token): 1 block.
    other = [*first[:31], first[31] + 1, *first[32:]]
    assert complete(api, other) == 16
    # 48 tokens = 3 full blocks, all cached by an earlier 64-token prompt, but the last token is
    # recomputed: 2 blocks; one token more and the third block counts.
    long = ids(64, 2)
    assert complete(api, long) == 0
    assert complete(api, long[:48]) == 32
    assert complete(api, long[:49]) == 48
    # Text goes through the byte tokenizer: 40 ASCII characters are 40 tokens.
    text = "abcdefghij" * 4
    assert complete(api, text) == 0
    assert complete(api, text + "!") == 32

    stream = api.completions.create(
        model="simulated", prompt=long, max_tokens=7, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert [c.choices[0].text for c in chunks[:-1]] == list("The qui")
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * 6 + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (64, 7)
    assert cached(chunks[-1].usage) == 48
    assert len({c.id for c in chunks}) == 1

    # Without include_usage no usage chunk: one chunk per token, then [DONE].
    raw = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": long, "max_tokens": 3, "stream": True}, timeout=10
    )
    events = [line for line in raw.text.split("\n\n") if line]
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert len(events) == 4 and events[-1] == "data: [DONE]"
    assert all("usage" not in json.loads(e.removeprefix("data: ")) for e in events[:-1])
    # Byte for byte what serializing vLLM's chunk gives (the server pre-renders the JSON around the text).
    for event, text, reason in zip(events[:-1], "The", [None, None, "length"], strict=True):
        parsed = json.loads(event.removeprefix("data: "))
        chunk = {
            "id": parsed["id"],
            "object": "text_completion",
            "created": parsed["created"],
            "model": "simulated",
            "choices": [
                {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": None}
            ],
        }
        assert event == "data: " + json.dumps(chunk, separators=(",", ":"))

    # A batch of prompts: a choice each, usage summed, cached tokens the last prompt's.
    batch = api.completions.create(model="simulated", prompt=[first, ids(20, 3)], max_tokens=2)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.usage is not None and (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (60, 4)
    assert cached(batch.usage) == 0


def test_chat_template_tokens_are_prompt_tokens_and_are_cached(server: Running) -> None:
    api = client(server)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three prime numbers, please."},
    ]
    rendered = tokenizer.chat_prompt([(m["role"], m["content"]) for m in messages])
    count = len(tokenizer.encode(rendered))
    # Two special tokens per message and one to open the answer; the rest is one token per byte.
    texts = (b"system\nYou are terse.\n", b"user\nName three prime numbers, please.\n", b"assistant\n")
    assert count == 5 + sum(len(t) for t in texts)
    tokenized = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()
    assert tokenized["count"] == count and tokenized["max_model_len"] == 32_768

    answer = api.chat.completions.create(model="simulated", messages=messages, max_tokens=4)  # type: ignore[arg-type]
    assert answer.choices[0].message.content == "The " and answer.choices[0].message.role == "assistant"
    assert answer.usage is not None and answer.usage.prompt_tokens == count and cached(answer.usage) == 0

    stream = api.chat.completions.create(
        model="simulated",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in chunks[1:-1]) == "The"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and cached(chunks[-1].usage) == (count - 1) // B * B
    raw = httpx.post(
        f"{server.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "stream": True}
    )
    events = [e.removeprefix("data: ") for e in raw.text.split("\n\n") if e]
    parsed = json.loads(events[0])
    head = {
        "id": parsed["id"],
        "object": "chat.completion.chunk",
        "created": parsed["created"],
        "model": "simulated",
    }
    expected = [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
        {"index": 0, "delta": {"content": "T"}, "logprobs": None, "finish_reason": None},
        {
            "index": 0,
            "delta": {"content": "h"},
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        },
    ]
    compact = [json.dumps({**head, "choices": [choice]}, separators=(",", ":")) for choice in expected]
    assert events == [*compact, "[DONE]"]  # byte for byte what serializing vLLM's chunks gives


def test_errors_are_shaped_as_vllm_shapes_them(server: Running) -> None:
    api = client(server)
    with pytest.raises(openai.NotFoundError) as missing:
        api.completions.create(model="other", prompt="hi", max_tokens=1)
    assert missing.value.status_code == 404
    assert missing.value.body == {
        "message": "The model `other` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    with pytest.raises(openai.BadRequestError) as too_long:
        api.completions.create(model="simulated", prompt=[300] * 32_768, max_tokens=1)
    assert "maximum context length is 32768 tokens" in str(too_long.value.body)
    for bad in (
        {"prompt": "hi", "n": 2},
        {"prompt": [40_000]},
        {"prompt": []},
        {"prompt": "hi", "max_tokens": 0},
        {"prompt": "hi", "max_tokens": 2, "min_tokens": 3},
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        {"prompt": 7},
    ):
        answer = httpx.post(f"{server.url}/v1/completions", json={"model": "simulated", **bad})
        assert answer.status_code == 400, bad
        assert answer.json()["error"]["code"] == 400 and answer.json()["error"]["type"] == "BadRequestError"
    # The documented limits: 1,024 prompts in a batch, 16 MiB of body.
    many = httpx.post(f"{server.url}/v1/completions", json={"prompt": [[300]] * 1025, "max_tokens": 1})
    assert many.status_code == 400 and "at most 1024 prompts" in many.json()["error"]["message"]
    assert (
        httpx.post(
            f"{server.url}/v1/completions", json={"prompt": [[300]] * 1024, "max_tokens": 1}
        ).status_code
        == 200
    )
    huge = b'{"prompt": "x"' + b" " * (16 * 1024 * 1024) + b"}"
    for path in ("/v1/completions", "/tokenize"):
        too_large = httpx.post(f"{server.url}{path}", content=huge, timeout=30)
        assert too_large.status_code == 413 and too_large.json()["error"]["code"] == 413
    garbage = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json")
    assert garbage.status_code == 400 and "not JSON" in garbage.json()["error"]["message"]
    no_messages = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []})
    assert no_messages.status_code == 400 and no_messages.json()["error"]["param"] == "messages"

    models = api.models.list()
    assert [m.id for m in models.data] == ["simulated"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "héllo<|im_end|>"}).json()["tokens"]
    assert tokens == [104, 195, 169, 108, 108, 111, tokenizer.IM_END]
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()
    assert back == {"prompt": "héllo<|im_end|>"}


HOSTILE = [
    b"",
    b"[]",
    b"null",
    b'"prompt"',
    b'{"prompt": null}',
    b'{"prompt": [[1, 2], "x", 3]}',
    b'{"prompt": [true, false]}',
    b'{"prompt": [1.5]}',
    b'{"prompt": [-1]}',
    b'{"prompt": [[]]}',
    b'{"prompt": "x", "max_tokens": 1e3}',
    b'{"prompt": "x", "max_tokens": "7"}',
    b'{"prompt": "x", "max_tokens": -1}',
    b'{"prompt": "x", "n": 0}',
    b'{"prompt": "x", "stream": "yes"}',
    b'{"prompt": "x", "stream": true, "stream_options": []}',
    b'{"prompt": "x", "stream": true, "stream_options": {"include_usage": 1}}',
    b'{"prompt": "x", "ignore_eos": "no"}',
    b'{"prompt": "x", "user": 5}',
    b'{"prompt": "x", "logprobs": 2}',
    b'{"prompt": "x", "echo": true}',
    b'{"prompt": "x", "model": 7}',
    b'{"messages": "hi"}',
    b'{"messages": [1]}',
    b'{"messages": [{"content": "no role"}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
    b'{"messages": [{"role": "user", "content": 5}]}',
    b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}',
    b'{"prompt": "' + b"x" * 40_000 + b'"}',
    b"\xff\xfe not utf-8",
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_bad_input_gets_a_vllm_shaped_4xx_never_a_5xx(server: Running, path: str) -> None:
    for body in HOSTILE:
        answer = httpx.post(f"{server.url}{path}", content=body, timeout=10)
        if answer.status_code == 200:  # tokenizing reads only the text: these prompts are fine
            valid_text = body.startswith(
                (b'{"prompt": "x', b'{"messages": [{"role": "user", "content": "x"}]')
            )
            assert path == "/tokenize" and valid_text, (path, body[:80])
            continue
        assert 400 <= answer.status_code < 500, (path, body[:80], answer.text[:200])
        error = answer.json()["error"]
        assert error["code"] == answer.status_code and error["message"], (path, body[:80])
    assert httpx.get(f"{server.url}/v1/completions").status_code == 405
    assert total(server.samples(), "vllm:num_requests_running") == 0


def test_no_prefix_caching_never_serves_from_cache() -> None:
    running = serve("--speed", "1000", "--no-prefix-caching")
    try:
        api = client(running)
        prompt = ids(100, 4)
        assert [complete(api, prompt) for _ in range(3)] == [0, 0, 0]
        samples = running.samples()
        assert total(samples, "vllm:prefix_cache_queries_total") == 300
        assert total(samples, "vllm:prefix_cache_hits_total") == 0
    finally:
        running.output()


def test_reset_prefix_cache_empties_every_replica() -> None:
    running = serve("--speed", "1000", "--replicas", "2", "--policy", "round_robin")
    try:
        api = client(running)
        prompt = ids(50, 5)
        assert [complete(api, prompt) for _ in range(4)] == [0, 0, 48, 48]  # r0, r1, r0, r1
        assert httpx.post(f"{running.url}/reset_prefix_cache").status_code == 200
        assert [complete(api, prompt) for _ in range(4)] == [0, 0, 48, 48]
    finally:
        running.output()


def test_a_client_that_leaves_mid_stream_frees_its_blocks_and_is_counted() -> None:
    running = serve("--speed", "1")  # 2,000 tokens take ~13 s: the client leaves long before
    try:
        prompt = ids(80, 6)
        with httpx.stream(
            "POST",
            f"{running.url}/v1/completions",
            json={"prompt": prompt, "max_tokens": 2000, "stream": True},
        ) as answer:
            first = next(answer.iter_lines())
            assert first.startswith("data: ")
        assert running.wait_for("vllm:request_success_total", 1, finished_reason="abort") == 1
        samples = running.samples()
        assert total(samples, "vllm:kv_cache_usage_perc") == 0  # nothing held
        assert total(samples, "vllm:num_requests_running") == 0
        assert complete(client(running), prompt, max_tokens=1) == 64  # its blocks stayed cached
        # Not streaming: a client that gives up waiting is heard too.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{running.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2000}, timeout=0.5
            )
        assert running.wait_for("vllm:request_success_total", 2, finished_reason="abort") == 2
        assert total(running.samples(), "vllm:num_requests_running") == 0
    finally:
        running.output()


@pytest.mark.parametrize("policy", ["prefix_affinity", "cost_aware", "least_queue"])
def test_one_at_a_time_cached_tokens_equal_the_offline_simulation(tmp_path: Path, policy: str) -> None:
    rng = random.Random(7)
    stems = [ids(rng.randrange(16, 200), seed) for seed in range(6)]  # shared system prompts
    prompts = []
    for _ in range(60):
        stem = rng.choice(stems)
        prompts.append(
            stem[: rng.randrange(1, len(stem) + 1)] + ids(rng.randrange(0, 40), rng.randrange(10**6))
        )
    outputs = [rng.randrange(1, 20) for _ in prompts]
    flags = ("--replicas", "3", "--capacity-blocks", "24", "--policy", policy)
    running = serve("--speed", "1000", *flags)
    try:
        api = client(running)
        online = [complete(api, p, max_tokens=o) for p, o in zip(prompts, outputs, strict=True)]
    finally:
        running.output()

    trace = tmp_path / "prompts.jsonl"
    write_trace(trace, prompts, outputs, [i * 1000.0 for i in range(len(prompts))])  # no overlap
    records = tmp_path / "records.jsonl"
    assert main(["simulate", str(trace), *flags, "--emit-records", str(records), "--json"]) == 0
    offline = [json.loads(line)["cached_tokens"] for line in records.read_text().splitlines()]
    assert online == offline
    assert sum(online) > 20 * B  # the workload shares prefixes: the comparison is not of zeros


def write_trace(path: Path, prompts: list[list[int]], outputs: list[int], arrivals: list[float]) -> None:
    """The prompts as a kvlens-record trace: what `kvlens simulate` replays offline."""
    with path.open("w") as out:
        for index, (prompt, output, arrival) in enumerate(zip(prompts, outputs, arrivals, strict=True)):
            line = {
                "request_id": str(index),
                "arrival_time": arrival,
                "prompt_tokens": len(prompt),
                "output_tokens": output,
                "block_size": B,
                "prefix_hashes": list(tokenizer.block_keys(prompt, B)),
            }
            out.write(json.dumps(line) + "\n")


class Collector:
    """A records endpoint on loopback that keeps what ``--push`` sends."""

    def __init__(self) -> None:
        self.records: list[dict[str, object]] = []
        self.arrived = threading.Condition()
        collector = self

        class Handler(TextHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                with collector.arrived:
                    collector.records.extend(json.loads(body))
                    collector.arrived.notify_all()
                self.answer(b"{}")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        in_thread(self.server.serve_forever)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/records"

    def wait_for(self, count: int, timeout: float = 20) -> int:
        with self.arrived:  # woken by each delivery, not by a clock
            self.arrived.wait_for(lambda: len(self.records) >= count, timeout)
            return len(self.records)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize(
    "prefill", [(), ("--no-chunked-prefill",)], ids=["chunked", "prefill_pauses_decodes"]
)
def test_overlapping_requests_get_what_offline_gives_them_at_the_same_arrivals(
    tmp_path: Path, prefill: tuple[str, ...]
) -> None:
    """Requests sent on a schedule that overlaps them (queues, running batches and evictions on
    every replica): replayed offline at the arrival times the server gave them (the records it
    pushed), every request gets the same cached tokens and the same replica."""
    rng = random.Random(11)
    stems = [ids(rng.randrange(32, 300), seed) for seed in range(8)]
    prompts = [rng.choice(stems)[: rng.randrange(16, 300)] + ids(rng.randrange(1, 60), i) for i in range(120)]
    outputs = [rng.randrange(5, 40) for _ in prompts]
    gap = 0.02  # 20 ms between arrivals; answers take 50-300 ms
    flags = ("--replicas", "3", "--capacity-blocks", "40", "--policy", "prefix_affinity", *prefill)
    collector = Collector()
    running = serve("--speed", "1", *flags, "--push", collector.url)
    try:

        async def send_all() -> list[int]:
            api = openai.AsyncOpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
            start = time.perf_counter()

            async def one(index: int) -> int:
                await asyncio.sleep(max(0.0, start + index * gap - time.perf_counter()))
                answer = await api.completions.create(
                    model="simulated",
                    prompt=prompts[index],
                    max_tokens=outputs[index],
                    extra_headers={"x-request-id": str(index)},
                )
                assert answer.usage is not None
                return cached(answer.usage)

            found = await asyncio.gather(*(one(i) for i in range(len(prompts))))
            await api.close()
            return list(found)

        online = asyncio.run(send_all())
        assert collector.wait_for(len(prompts)) == len(prompts)
    finally:
        running.output()
        collector.close()
    pushed = sorted(collector.records, key=lambda r: float(r["arrival_time"]))  # type: ignore[arg-type]
    order = [int(str(r["request_id"]).removeprefix("cmpl-")) for r in pushed]
    assert [r["cached_tokens"] for r in pushed] == [online[i] for i in order]
    first = float(pushed[0]["arrival_time"])  # type: ignore[arg-type]
    trace, records = tmp_path / "prompts.jsonl", tmp_path / "records.jsonl"
    write_trace(
        trace,
        [prompts[i] for i in order],
        [outputs[i] for i in order],
        [float(r["arrival_time"]) - first for r in pushed],  # type: ignore[arg-type]
    )
    assert main(["simulate", str(trace), *flags, "--emit-records", str(records), "--json"]) == 0
    replayed = [json.loads(line) for line in records.read_text().splitlines()]
    assert [r["cached_tokens"] for r in replayed] == [r["cached_tokens"] for r in pushed]
    assert [r["replica"] for r in replayed] == [r["replica"] for r in pushed]
    # And the same modelled times (--speed 1: the client's seconds are the model's).
    for name in ("queue_seconds", "ttft_seconds", "e2e_seconds"):
        assert [r[name] for r in pushed] == pytest.approx([r[name] for r in replayed], abs=1e-6), name
    prompt_tokens = sum(len(p) for p in prompts)
    assert sum(online) / prompt_tokens > 0.3
    # They did overlap: most requests arrived while an earlier one was still running.
    finishes = [r["arrival_time"] + r["e2e_seconds"] for r in replayed]
    overlapped = sum(r["arrival_time"] < max(finishes[:i]) for i, r in enumerate(replayed) if i)
    assert overlapped > len(replayed) // 2


def test_kvlens_scrape_reconciles_with_the_pushed_records() -> None:
    sidecar_port, engine_port = free_port(), free_port()
    engine = serve(
        "--speed", "1000", "--replicas", "2", "--push", f"http://127.0.0.1:{sidecar_port}/v1/records",
        port=engine_port,
    )  # fmt: skip
    host = f"127.0.0.1:{engine_port}"
    env = {"KVLENS_SCRAPE_TARGETS": f'["{engine.url}/metrics"]', "KVLENS_SCRAPE_INTERVAL_SECONDS": "0.2"}
    sidecar = start_kvlens("serve", env=env, port=sidecar_port)
    try:
        api = client(engine)
        rng = random.Random(3)
        stem = ids(120, 9)
        for _ in range(40):
            complete(api, stem[: rng.randrange(20, 121)] + ids(rng.randrange(1, 30), rng.randrange(10**6)))
        prompt_total = total(engine.samples(), "vllm:prompt_tokens_total")
        hits_total = total(engine.samples(), "vllm:prefix_cache_hits_total")
        assert hits_total > 0
        assert sidecar.wait_for("kvlens_requests_total", 40) == 40
        assert (
            sidecar.wait_for("kvlens_engine_prefix_cache_hit_tokens_total", hits_total, target=host)
            == hits_total
        )
        samples = sidecar.samples()
        engine_queried = total(samples, "kvlens_engine_prefix_cache_queried_tokens_total", target=host)
        assert engine_queried == prompt_total
        kvlens_prompt = total(samples, "kvlens_prompt_tokens_total")
        kvlens_cached = total(samples, "kvlens_cached_tokens_total")
        assert (kvlens_prompt, kvlens_cached) == (prompt_total, hits_total)
        assert kvlens_cached / kvlens_prompt == hits_total / engine_queried
    finally:
        engine.output()
        sidecar.output()


def test_speed_paces_the_stream() -> None:
    """At --speed 1 a 200-token answer takes the modelled decode time, not less."""
    running = serve("--speed", "1")
    try:
        started = time.monotonic()
        complete(client(running), ids(20, 8), max_tokens=200)
        elapsed = time.monotonic() - started
        step = 1.7e-3 + (16.06e9 + 220 * 131_072) / 3.27e12  # t0 + (W + K) / BW at batch 1
        assert elapsed >= 199 * step
    finally:
        running.output()


def salted(
    running: Running,
    prompt: list[int],
    salt: str | None,
    path: str = "/v1/completions",
    model: str = "simulated",
) -> int:
    body: dict[str, object] = {"model": model, "max_tokens": 2}
    if path == "/v1/completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": " ".join(map(str, prompt))}]
    if salt is not None:
        body["cache_salt"] = salt
    answer = httpx.post(f"{running.url}{path}", json=body, timeout=10)
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.timeout(60)
def test_cache_salt_partitions_the_cache_as_vllm_and_leak_salt_drops_it() -> None:
    """vLLM mixes ``cache_salt`` into the first block's hash: a salt shares with itself only, and
    an unsalted request with no salted one; ``--leak-salt`` (LMCache #4825's fault) shares all."""
    honest = serve("--speed", "1000", "--lora-modules", "sql=/adapters/sql")
    leaking = None
    try:
        leaking = serve("--speed", "1000", "--leak-salt")
        for path in ("/v1/completions", "/v1/chat/completions"):
            prompt = ids(70, 7 if path == "/v1/completions" else 8)
            steps = [("a", 0), ("a", 1), ("b", 0), (None, 0), (None, 1), ("b", 1)]
            full = 64 if path == "/v1/completions" else 400  # chat: the digits' bytes and the template
            got = [salted(honest, prompt, salt, path) for salt, _ in steps]
            assert got == [full * hit for _, hit in steps]
            assert [salted(leaking, prompt, salt, path) for salt, _ in steps] == [0, *[full] * 5]
        # a LoRA adapter keys its blocks apart from the base model's, as vLLM's name in every block
        prompt = ids(70, 9)
        models = ["simulated", "sql", "sql", "simulated"]
        got = [salted(honest, prompt, None, model=model) for model in models]
        assert got == [0, 0, 64, 64]
        cards = httpx.get(f"{honest.url}/v1/models").json()["data"]
        assert [(card["id"], card["parent"]) for card in cards] == [("simulated", None), ("sql", "simulated")]
        for bad in ("", "x" * 129, "a/b", "a@b", "a\\b", "a\0b", 7):
            answer = httpx.post(f"{honest.url}/v1/completions", json={"prompt": [5] * 20, "cache_salt": bad})
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "cache_salt"
            assert not (isinstance(bad, str) and bad and bad in answer.text)  # never the salt itself
    finally:
        honest.output()
        if leaking is not None:
            leaking.output()
