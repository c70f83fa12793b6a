"""`kvlens simulate serve` pieces without a process: the toy tokenizer and its block keys, the
service model its flags make (--config, --weight-bytes), and the pacing of streamed tokens."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest
import yaml

from kvlens.config import load_offline
from kvlens.simulate.replica import DEFAULT_SERVICE, Job
from kvlens.simulate.run import Fleet
from kvlens.simulate.serve import main as serve
from kvlens.simulate.serve import tokenizer
from kvlens.simulate.serve.engine import RealTimeFleet, Ticket
from kvlens.simulate.trace import TraceRequest


def flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(argv)


def test_text_round_trips_and_special_tokens_are_one_token() -> None:
    text = "<|im_start|>user\nhé 🙂<|im_end|>\n"
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.IM_START and ids.count(tokenizer.IM_END) == 1
    assert len(ids) == 2 + len("user\nhé 🙂\n".encode())
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode([300, 104]) == "<|300|>h"
    assert tokenizer.generated_text(50, 40) == tokenizer.decode(tokenizer.generated(50, 40))
    assert tokenizer.generated_text(3) == "The"


def test_block_keys_share_exactly_the_equal_full_blocks() -> None:
    a = list(range(100, 150))  # 50 tokens: 3 full blocks of 16
    b = [*a[:40], 7, *a[41:]]  # differs inside the third block
    keys_a, keys_b = tokenizer.block_keys(a, 16), tokenizer.block_keys(b, 16)
    assert len(keys_a) == 3 and keys_a[:2] == keys_b[:2] and keys_a[2] != keys_b[2]
    # The same block after a different prefix is another key (chained).
    assert tokenizer.block_keys([1] * 16 + a[16:32], 16)[1] != keys_a[1]
    assert tokenizer.block_keys(a[:15], 16) == ()


def test_weight_bytes_and_config_shape_the_service_model(tmp_path: Path) -> None:
    assert serve.service_model(flags()) == DEFAULT_SERVICE
    quantized = serve.service_model(flags("--weight-bytes", "4.5GiB"))
    assert quantized.decode.weight_bytes == 4.5 * 2**30
    assert quantized.decode.step_seconds(1, 1000) < DEFAULT_SERVICE.decode.step_seconds(1, 1000)
    config = tmp_path / "kvlens.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "cost_models": {"m": {"a": 1e-5, "b": 1e-9, "unit": "seconds"}},
                "model_shapes": {"m": {"layers": 2, "kv_heads": 4, "head_dim": 8, "weight_bytes": "1GiB"}},
            }
        )
    )
    accounting = load_offline(config)
    model = serve.service_model(flags("--model", "m", "--no-chunked-prefill"), accounting)
    assert (model.prefill.a, model.prefill.b, model.prefill.unit) == (1e-5, 1e-9, "seconds")
    assert model.decode.weight_bytes == 2**30 and model.decode.kv_bytes_per_token == 2 * 2 * 4 * 8 * 2
    assert not model.chunked_prefill
    # --weight-bytes wins over the shape's.
    both = serve.service_model(flags("--model", "m", "--weight-bytes", "1e8"), accounting)
    assert both.decode.weight_bytes == 1e8
    # Another served name takes nothing from the file.
    assert serve.service_model(flags("--model", "other"), accounting) == DEFAULT_SERVICE


def test_streamed_tokens_follow_the_modelled_decode_steps() -> None:
    job = Job(TraceRequest(0, 0.0, 100, 5, ()), 0, 16)
    ticket = Ticket(job, [1] * 100, asyncio.Event(), "cmpl-1")
    assert ticket.tokens_due(10.0) == 0 and ticket.next_token_at(0) == float("inf")
    job.first_token, job.finish = 1.0, 1.4  # four steps of 0.1 s after the first token
    ticket.started = True
    assert [ticket.tokens_due(t) for t in (1.0, 1.05, 1.1, 1.25, 1.39, 5.0)] == [1, 1, 2, 3, 4, 4]
    assert [ticket.next_token_at(n) for n in (1, 2, 3)] == pytest.approx([1.1, 1.2, 1.3])
    assert ticket.next_token_at(4) == float("inf")  # the last one comes when the job finishes
    ticket.finished = True
    assert ticket.tokens_due(1.4) == 5


def test_pushed_records_carry_the_durations_the_client_lived() -> None:
    loop = asyncio.new_event_loop()
    try:
        fleet = RealTimeFleet(Fleet(2, 100, 16), "round_robin", speed=2.0, loop=loop)
        job = Job(TraceRequest(0, 1.0, 40, 5, (11, 12)), 0, 16)
        job.replica, job.cached_tokens = 1, 16
        job.start, job.first_token, job.finish = 1.5, 2.0, 3.0
        ticket = Ticket(job, [1] * 40, asyncio.Event(), "cmpl-7")
        record = serve.record(ticket, fleet, "m", started_epoch=1000.0)
    finally:
        loop.close()
    assert record == {
        "request_id": "cmpl-7",
        "model": "m",
        "replica": "r1",
        "prompt_tokens": 40,
        "cached_tokens": 16,
        "output_tokens": 5,
        "queue_seconds": 0.25,
        "prefill_seconds": 0.25,
        "ttft_seconds": 0.5,
        "decode_seconds": 0.5,
        "e2e_seconds": 1.0,
        "arrival_time": 1000.5,
        "block_size": 16,
        "finish_reason": "length",
    }


@pytest.mark.parametrize(
    "text",
    [
        "",
        "abc",
        "é漢字🙂",
        "<|im_start|>user\nhi<|im_end|>\n",
        "<|endoftext|><|endoftext|>x",
        "<|im_start",
        "a" * 50,
    ],
)
def test_count_is_the_length_of_encode(text: str) -> None:
    assert tokenizer.count(text) == len(tokenizer.encode(text))
