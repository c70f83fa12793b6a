"""``kvlens simulate serve``: flags, the service model they make, records to a ``kvlens serve``,
and uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn

from kvlens import limits, logs
from kvlens.accounting import Accounting
from kvlens.errors import MissingExtra, SettingsError
from kvlens.http import bodies, server
from kvlens.http.access import loopback
from kvlens.simulate.cache import CacheEvents
from kvlens.simulate.memory import kv_blocks
from kvlens.simulate.policies import POLICIES, Guard
from kvlens.simulate.replica import DEFAULT_SERVICE, ServiceModel
from kvlens.simulate.run import Fleet, parse_capacity
from kvlens.simulate.run import record as simulated_record
from kvlens.simulate.serve import tokenizer
from kvlens.simulate.serve.api import MAX_BODY_BYTES, MAX_IN_FLIGHT, Api
from kvlens.simulate.serve.engine import RealTimeFleet, Ticket
from kvlens.simulate.serve.requests import Served
from kvlens.simulate.settings import ServeSettings

log = logging.getLogger("kvlens.simulate.serve")
PUSH_QUEUE = 100_000  # records held while the kvlens serve is away; the oldest go first
PUSH_BATCH = 1000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=1, help="replicas behind the endpoint")
    parser.add_argument(
        "--capacity-blocks",
        metavar="C",
        help="prefix cache blocks per replica, or 'unbounded'; 1000 unless --gpu-memory-bytes sizes "
        "them. They bound the cache only, not who runs: --gpu-memory-bytes bounds both",
    )
    parser.add_argument(
        "--gpu-memory-bytes",
        metavar="M",
        help="each replica's GPU memory, e.g. 80GB: its KV blocks are (M x --gpu-memory-utilization "
        "- weights) / bytes per block, as vLLM sizes them, and bound admission and decode "
        "(requests wait for blocks, the newest is preempted when decode runs out)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        metavar="U",
        help="share of --gpu-memory-bytes for weights and KV (vLLM's default 0.9)",
    )
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default="round_robin",
        metavar="POLICY",
        help=f"routing: {', '.join(POLICIES)}",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--model", default="simulated", help="served model name")
    parser.add_argument(
        "--lora-modules",
        action="append",
        metavar="NAME[=PATH]",
        help="a LoRA adapter served beside the model, as vLLM's (the path is not read): a request "
        "naming it as its model has its blocks keyed apart (repeatable)",
    )
    parser.add_argument("--max-model-len", type=int, default=32_768, help="context length")
    parser.add_argument(
        "--vocab-size",
        type=int,
        help=f"token ids allowed in prompts: {tokenizer.DEFAULT_VOCAB_SIZE}, or the --tokenizer's vocabulary",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        metavar="DIR",
        help="a Hugging Face tokenizer directory (its tokenizer.json): text prompts are counted as a "
        "client reading the same directory counts them (kvlens[tokenizer]); default: one token a byte",
    )
    parser.add_argument("--speed", type=float, default=1.0, help="2: twice as fast as the modelled GPU")
    parser.add_argument("--no-prefix-caching", action="store_true", help="nothing is ever served from cache")
    parser.add_argument(
        "--leak-salt",
        action="store_true",
        help="drop each request's cache_salt before its blocks are keyed (a fault, as LMCache #4825 "
        "measured): tenants then share cached prefixes, for `kvlens audit isolation` to catch",
    )
    parser.add_argument("--max-running", type=int, default=256, help="requests holding KV per replica")
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=MAX_IN_FLIGHT,
        metavar="N",
        help="prompts waiting or running in the fleet at most; past it a request gets 503",
    )
    parser.add_argument(
        "--no-chunked-prefill", action="store_true", help="a prefill pauses the running decodes"
    )
    parser.add_argument(
        "--push",
        metavar="URL",
        help="send a kvlens record per finished request to a kvlens serve's /v1/records",
    )
    parser.add_argument(
        "--config",
        type=Path,
        help="YAML settings: the model's cost model in seconds (cost_models), its shape (model_shapes)",
    )
    parser.add_argument(
        "--weight-bytes", help="bytes of weights a decode step reads, e.g. 4.5GiB for a W4A16 checkpoint"
    )
    parser.add_argument(
        "--kv-events",
        metavar="tcp://HOST:PORT",
        help="publish each replica's KV events as vLLM does, replica i on PORT+i (kvlens[kv-events])",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="listen address; beyond loopback, set KVLENS_ADMIN_TOKEN for /reset_prefix_cache",
    )
    parser.add_argument("--port", type=int, default=8000, help="listen port (as vLLM)")


def service_model(args: argparse.Namespace, accounting: Accounting | None = None) -> ServiceModel:
    """The service model of the flags: ``kvlens simulate``'s, with the served model's cost model
    in seconds and decode shape from ``accounting`` (``--config``) when it has them, and
    ``--weight-bytes``."""
    prefill, decode = DEFAULT_SERVICE.prefill, DEFAULT_SERVICE.decode
    if accounting is not None:
        if args.model in accounting.cost_models:
            prefill = accounting.cost_model_for(args.model)
        shape = accounting.model_shapes.get(args.model)
        if shape is not None:
            weights = shape.decode_weight_bytes()
            decode = dataclasses.replace(
                decode,
                kv_bytes_per_token=shape.shape().kv_bytes_per_token,
                weight_bytes=weights if weights is not None else decode.weight_bytes,
            )
    if args.weight_bytes is not None:
        decode = dataclasses.replace(decode, weight_bytes=limits.parse_size(args.weight_bytes))
    return ServiceModel(
        prefill=prefill,
        decode=decode,
        max_running=args.max_running,
        chunked_prefill=not args.no_chunked_prefill,
        admit_by_memory=args.gpu_memory_bytes is not None,
    )


def capacity_blocks(args: argparse.Namespace, service: ServiceModel) -> int | None:
    """Blocks per replica: from the GPU memory the weights leave (``--gpu-memory-bytes``), else
    ``--capacity-blocks`` (None: unbounded)."""
    if args.gpu_memory_bytes is None:
        capacity = parse_capacity(args.capacity_blocks or "1000")
        if capacity is not None and capacity < 0:
            raise ValueError("--capacity-blocks takes a block count >= 0 or 'unbounded'")
        return capacity
    if args.capacity_blocks is not None:
        raise ValueError("--capacity-blocks and --gpu-memory-bytes both size the KV cache: give one")
    blocks = kv_blocks(
        limits.parse_size(args.gpu_memory_bytes),
        args.gpu_memory_utilization,
        service.decode.weight_bytes,
        service.decode.kv_bytes_per_token,
        args.block_size,
    )
    if blocks * args.block_size < args.max_model_len:  # vLLM refuses to start, the same way
        raise ValueError(
            f"the KV cache holds {blocks * args.block_size:,} tokens ({blocks:,} blocks), fewer than "
            f"--max-model-len {args.max_model_len:,}: one request could never fit; lower "
            "--max-model-len or give more memory"
        )
    return blocks


def _checked(args: argparse.Namespace, load: Callable[[Path | None], ServeSettings]) -> tuple[Fleet, Served]:
    if args.block_size < 1:
        raise ValueError("--block-size must be >= 1")
    if args.max_model_len < 2:
        raise ValueError("--max-model-len must be >= 2")
    text: tokenizer.Tokenizer = tokenizer.BYTES
    if args.tokenizer is not None:
        if args.vocab_size is not None:
            raise ValueError("--vocab-size is the --tokenizer's: give one of them")
        text = tokenizer.HuggingFace.load(args.tokenizer)  # TokenizerUnavailable is a ValueError
    vocab_size = text.vocab_size if args.vocab_size is None else args.vocab_size
    if args.tokenizer is None and vocab_size < tokenizer.FIRST_PLAIN_ID:
        raise ValueError(f"--vocab-size must be >= {tokenizer.FIRST_PLAIN_ID} (bytes and special tokens)")
    if not (math.isfinite(args.speed) and args.speed > 0):
        raise ValueError("--speed must be a positive number")
    if args.max_in_flight < 1:
        raise ValueError("--max-in-flight must be >= 1")
    service = service_model(args, load(args.config) if args.config is not None else None)
    fleet = Fleet(args.replicas, capacity_blocks(args, service), args.block_size, service, Guard())
    loras = tuple(dict.fromkeys(spec.partition("=")[0] for spec in args.lora_modules or ()))
    if any(not name or name == args.model for name in loras):
        raise ValueError("--lora-modules takes NAME[=PATH], a NAME other than --model")
    return fleet, Served(args.model, args.max_model_len, vocab_size, text, loras)


def record(ticket: Ticket, engine: RealTimeFleet, model: str, started_epoch: float) -> dict[str, Any]:
    """A finished request as the kvlens record a vLLM replica's plugin would send: ``kvlens
    simulate``'s record of the job, its durations as the client lived them (modelled / speed),
    its arrival in epoch seconds, without the block keys (the plugin sends none)."""
    job = ticket.job
    out = simulated_record(job, engine.fleet.block_size, arm="")
    for name in ("queue_seconds", "prefill_seconds", "ttft_seconds", "decode_seconds", "e2e_seconds"):
        out[name] = engine.wall_seconds(out[name])
    del out["arm"], out["prefix_hashes"]
    return out | {
        "request_id": ticket.request_id,
        "model": model,
        "arrival_time": started_epoch + engine.wall_seconds(job.arrival),
        "finish_reason": "abort" if ticket.aborted else "length",
    }


def run(args: argparse.Namespace, load: Callable[[Path | None], ServeSettings]) -> int:
    """``load``: the settings of ``--config`` (and ``KVLENS_*``), as the command line reads them."""
    try:
        fleet, served = _checked(args, load)
        # the connection and body rules of kvlens serve, from the same settings (KVLENS_*)
        settings = load(args.config)
    except (ValueError, SettingsError) as error:
        print(f"kvlens simulate serve: {error}", file=sys.stderr)
        return 2
    shipper = None
    if args.push:
        from kvlens.sources.vllm_plugin import HttpSink, Shipper

        try:
            sink = HttpSink(args.push, os.environ.get("KVLENS_PLUGIN_TOKEN"))
        except ValueError:
            print("kvlens simulate serve: --push takes an http(s) URL", file=sys.stderr)
            return 2
        shipper = Shipper(sink, capacity=PUSH_QUEUE, batch_size=PUSH_BATCH, flush_seconds=0.5)
    started_epoch = time.time()
    try:
        publishers = kv_event_publishers(args.kv_events, fleet.replicas)
    except (ValueError, MissingExtra) as error:
        print(f"kvlens simulate serve: {error}", file=sys.stderr)
        return 2
    events = None if not publishers else kv_event_sinks(publishers, fleet.block_size)

    def make_engine(on_finish: Any) -> RealTimeFleet:
        engine = RealTimeFleet(
            fleet,
            args.policy,
            speed=args.speed,
            prefix_caching=not args.no_prefix_caching,
            honour_salt=not args.leak_salt,
            loop=asyncio.get_running_loop(),
            on_finish=on_finish,
            events=events,
        )
        nonlocal started_epoch
        started_epoch = time.time()
        return engine

    def push(ticket: Ticket, engine: RealTimeFleet) -> None:
        assert shipper is not None
        shipper.offer(record(ticket, engine, served.model, started_epoch))  # never blocks

    api = Api(
        served,
        make_engine,
        prefix_caching=not args.no_prefix_caching,
        on_record=push if shipper else None,
        body_limits=bodies.body_limits(settings, MAX_BODY_BYTES),
        arriving=bodies.arriving_bodies(settings),
        max_in_flight=args.max_in_flight,
        admin_token=settings.admin_secret,
    )
    # uvicorn alone arms no timer before a request head or while an answer goes unread, and caps
    # no connections: the shared protocol does all three (a silent socket closed past
    # header_timeout_seconds, an unread answer dropped past write_timeout_seconds, the oldest idle
    # one closed past max_connections)
    guard = server.ConnectionGuard(
        settings.max_connections, settings.header_timeout_seconds, settings.write_timeout_seconds
    )
    # an answer dropped at the write deadline (up to 10 MB of /detokenize, 33 MB of a batch) goes
    # back to the kernel, as kvlens serve's refused bodies do, rather than staying in the heap
    server.prepare_process(settings.max_connections)
    level = getattr(args, "log_level", None) or os.environ.get("KVLENS_LOG_LEVEL", "INFO").lower()
    log_config = logs.config(level, getattr(args, "log_format", "text"))
    config = server.config(api.app(), args.host, args.port, guard, level, log_config)
    if settings.admin_secret is None and not loopback(args.host):  # logging is set up now
        log.warning(
            "POST /reset_prefix_cache listens on %s without a token: anyone who reaches this port "
            "can empty every replica's prefix cache (and send it work). Set KVLENS_ADMIN_TOKEN (or "
            "admin_token in --config), or listen on 127.0.0.1.",
            args.host,
        )
    try:
        status = server.run_until_stopped(uvicorn.Server(config))
    finally:
        if shipper is not None:
            shipper.close()
        for publisher in publishers:
            publisher.close()
    return status


def kv_event_publishers(endpoint: str | None, replicas: int) -> list[Any]:
    """One vLLM-format KV event publisher per replica, replica i bound at ``PORT + i`` (as
    vLLM's data-parallel ranks offset theirs), so a ``kvlens serve --kv-events r0=...`` follows
    each."""
    if not endpoint:
        return []
    scheme, _, address = endpoint.partition("://")
    host, _, port = address.rpartition(":")
    if scheme != "tcp" or not host or not port.isdigit() or int(port) + replicas > 65536:
        raise ValueError(
            f"--kv-events takes tcp://HOST:PORT with room for {replicas} ports, not {endpoint!r}"
        )
    from kvlens.fleet.publisher import EventPublisher

    try:  # pyzmq is imported by the first publisher, which says what --kv-events needs without it
        return [
            EventPublisher(f"tcp://{host}:{int(port) + i}", data_parallel_rank=i) for i in range(replicas)
        ]
    except MissingExtra:
        raise MissingExtra("--kv-events", "kv-events") from None


def kv_event_sinks(publishers: list[Any], block_size: int) -> Callable[[int], CacheEvents]:
    """Replica i's cache events, each published as one vLLM ``EventBatch`` by publisher i."""
    from kvlens.fleet.simulated import SimulatedEngine

    def sink(index: int) -> CacheEvents:
        publisher = publishers[index]
        return SimulatedEngine(str(index), block_size, lambda _name, event: publisher.publish_events([event]))

    return sink
