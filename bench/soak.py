"""Soak: a real ``kvlens serve`` under mixed traffic and a trickle of abuse, for minutes.

    .venv/bin/python bench/soak.py [--minutes 10] [--attacks slow-body,fifo,kv-events,...]

What runs at once, all against one sidecar on loopback:
- push: NDJSON batches of 100 records every 50 ms (some gzip, all with a ``kvlens-batch-id``,
  one in ten sent twice as a retry after a lost answer);
- OTLP: protobuf exports of 20 spans every 200 ms;
- a tailed file: 50 lines every 100 ms, renamed away and started anew every 15 s;
- scrapes of ``/metrics`` every 100 ms (counters must never go backwards: PromQL's resets() = 0);
- an engine ``/metrics`` that kvlens scrapes every second and that restarts every 20 s (its
  counters fall to 0, and it is down for 2 s);
- abuse at a low rate: gzip bombs, bodies of empty objects, protobuf span bombs, unknown
  encodings, non-ASCII headers, a stalled body, idle sockets that send nothing;
- the attacks of the hostile reviews, each switched on by ``--attacks`` (comma-separated, or
  ``none``; default all):
  ``slow-body``: every 30 s, as many bodies as ingest has slots (4), each its headers then one
  byte every 2 s; ``fifo``: a second tailed glob whose regular file gets 10 lines every 0.5 s
  (counted like the others) and in which a FIFO appears every 30 s; ``gzip-upstream``: a second
  scrape target that answers gzip, one answer in 30 a bomb (1 MiB inflating to 1 GiB);
  ``deep-nesting``: a pushed record whose unknown field nests 100,000 levels and an OTLP JSON
  export nested as deep, in the abuse cycle. All are refused or ignored traffic: none counts as
  sent, and an answer 5xx fails the soak as any other;
- ``kv-events`` (bench/soak_kv_events.py): the sidecar subscribes to four KV event publishers
  in vLLM's wire format: two honest replicas each publishing a batch every 50 ms (stores and
  removals over a bounded set of blocks), a third storing 200,000 blocks then clearing them
  (AllBlocksCleared) every 12 s, and a hostile one that takes a step every 2 s, in turn: a batch
  with ts NaN, one with ts 1e18, five sequence gaps in a row whose replay endpoint answers one
  wrong frame just before kvlens's 2 s timeout, a jump to sequence 2^63-1 then a restart, held
  blocks stored again in several tiers. Every honest batch must be applied
  (kvlens_kv_event_batches_total == sent, after the settle) and none wait more than 10 s,
  kvlens_kv_missed_batches_total must stay under 1e6, and kvlens must count no KV event error
  and no replica holding fewer than 0 or more blocks than it stored and kept;
- ``experiment`` (bench/soak_experiment.py): every 30 s (every 12 s in a one-minute soak, so
  that each variant runs once) a real ``kvlens replay`` subprocess against a hostile
  OpenAI-compatible endpoint on loopback, in turn: /v1/models, /metrics, then
  /reset_prefix_cache answering their head a byte every 2 s, /metrics a gzip bomb, a stream of
  ``"choices": 5`` chunks. Each replay must end within 60 s (else killed), peak under 500 MiB
  RSS (else killed), and end in a report or a clear error (exit 2; or exit 1 or 2 naming its
  arm's failures past --max-error-rate), not a traceback.

It prints records sent vs counted, RSS at start (after warm-up), end and peak, the event loop's
lag p99 (kvlens_event_loop_lag_seconds), 5xx answers, scrape p99 and /healthz p99, and each new
attack's figures; and exits 1, naming each reason, when a record is lost or counted twice, a 5xx
was answered, a counter went backwards, an attack's pass condition failed, or (in a soak of 10
minutes or more) RSS grew by more than 10 MiB from the end of the warm-up to the end ("RSS
flat": the batch-id window fills in ~8 min, so a shorter soak prints the growth and does not
judge it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import httpx
import psutil
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.live import EngineServer, Running, raise_open_files_limit, start_kvlens  # noqa: E402

from bench.soak_load import (  # noqa: E402
    BOMB_INFLATED_BYTES,
    GzipUpstream,
    Tally,
    abuser,
    engine_exposition,
    fifo_glob_writer,
    gzip_bomb,
    otlp_sender,
    pusher,
    slow_bodies,
    tail_writer,
)

WARM_UP_SECONDS = 20
NEW_ATTACKS = ("slow-body", "fifo", "gzip-upstream", "deep-nesting", "kv-events", "experiment")
# the longest a worker takes to stop: a replay started just before the stop ends within its 60 s
WORKER_JOIN_SECONDS = 100
RSS_FLAT_MIB = 10.0  # growth allowed from the end of the warm-up to the end (issue 26)
RSS_FLAT_FROM_MINUTES = 10.0  # judged in soaks this long: the batch-id window fills in ~8 min


Observer = Callable[[float, list[Metric]], None]  # a scrape's start (monotonic) and its families


def scraper(url: str, tally: Tally, stop: threading.Event, observers: Iterable[Observer] = ()) -> None:
    last: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    with httpx.Client(timeout=30) as client:
        while not stop.wait(0.1):
            started = time.monotonic()
            answer = client.get(f"{url}/metrics")
            tally.scrape_seconds.append(time.monotonic() - started)
            tally.answered("scrape", answer.status_code)
            families = list(text_string_to_metric_families(answer.text))
            for observe in observers:
                observe(started, families)
            for family in families:
                if family.type != "counter":
                    continue
                for sample in family.samples:
                    key = (sample.name, frozenset(sample.labels.items()))
                    if sample.value < last.get(key, 0.0):
                        tally.resets += 1
                    last[key] = sample.value


def prober(url: str, tally: Tally, stop: threading.Event) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.wait(0.25):
            started = time.monotonic()
            tally.answered("healthz", client.get(f"{url}/healthz").status_code)
            tally.health_seconds.append(time.monotonic() - started)


def histogram_p99(samples: dict[str, float]) -> float:
    """p99 from cumulative buckets, as histogram_quantile does (upper bound of the bucket)."""
    bounds = sorted((float(le), count) for le, count in samples.items())
    total = bounds[-1][1]
    for bound, count in bounds:
        if total and count >= 0.99 * total:
            return bound
    return float("nan")


def counted(families: list[Metric]) -> tuple[float, dict[str, float]]:
    """Records counted (model soak), and the event-loop lag histogram's buckets."""
    requests, lag = 0.0, {}
    for family in families:
        for sample in family.samples:
            if sample.name == "kvlens_requests_total" and sample.labels.get("model") == "soak":
                requests += sample.value
            elif sample.name == "kvlens_event_loop_lag_seconds_bucket":
                lag[sample.labels["le"]] = sample.value
    return requests, lag


def metric_families(running: Running) -> list[Metric]:
    return list(text_string_to_metric_families(httpx.get(f"{running.url}/metrics", timeout=10).text))


def attack_names(text: str) -> frozenset[str]:
    """``--attacks``: a comma-separated list of NEW_ATTACKS, or "none"."""
    names = frozenset(name.strip() for name in text.split(",")) - {"", "none"}
    if unknown := names - set(NEW_ATTACKS):
        known = ", ".join(NEW_ATTACKS)
        raise argparse.ArgumentTypeError(f"unknown attack {', '.join(sorted(unknown))} (known: {known})")
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument(
        "--attacks",
        type=attack_names,
        default=frozenset(NEW_ATTACKS),
        help=f"the new attacks to run, comma-separated, or none (default: {','.join(NEW_ATTACKS)})",
    )
    args = parser.parse_args()
    attacks: frozenset[str] = args.attacks
    raise_open_files_limit()
    workdir = Path(tempfile.mkdtemp(prefix="kvlens-soak-"))
    log = workdir / "app.log"
    engine = EngineServer(engine_exposition(time.monotonic()))
    tally = Tally()
    sources = ["--tail", str(log), "--scrape", engine.url]
    fifo_dir = workdir / "fifo-glob"
    if "fifo" in attacks:
        fifo_dir.mkdir()
        sources += ["--tail", str(fifo_dir / "*.log")]
    upstream = GzipUpstream(tally) if "gzip-upstream" in attacks else None
    if upstream:
        sources += ["--scrape", upstream.url]
    kv = None
    if "kv-events" in attacks:
        from bench.soak_kv_events import KVEventsAttack  # pyzmq and the fleet index: only when asked

        kv = KVEventsAttack(tally.attacked)  # its publishers bound before kvlens connects
    sidecar = start_kvlens(
        "serve",
        *sources,
        env={
            "KVLENS_STATE_DIR": str(workdir / "state"),
            "KVLENS_TAIL_POLL_SECONDS": "0.2",
            "KVLENS_SCRAPE_INTERVAL_SECONDS": "1",
            "KVLENS_BODY_TIMEOUT_SECONDS": "5",
            **(kv.settings() if kv else {}),
        },
        # the index's loops are compiled at start, once per checkout (~10 s of CPU, more on a busy machine)
        start_seconds=180 if kv else 20,
    )
    process = psutil.Process(sidecar.process.pid)
    stop = threading.Event()
    if kv:
        try:
            kv.wait_subscribed(60)
        except TimeoutError:  # the sidecar is stopped, not left behind
            print(sidecar.output()[-3000:], file=sys.stderr)
            raise
    experiment = None
    if "experiment" in attacks:
        from bench.soak_experiment import ExperimentAttack

        bomb = gzip_bomb(BOMB_INFLATED_BYTES)
        experiment = ExperimentAttack(workdir, tally.attacked, args.minutes, bomb)
    jobs: list[tuple[Callable[..., None], tuple[object, ...]]] = [
        (pusher, (sidecar.url, tally, stop)),
        (otlp_sender, (sidecar.url, tally, stop)),
        (tail_writer, (log, tally, stop)),
        (scraper, (sidecar.url, tally, stop, [kv.observe] if kv else [])),
        (prober, (sidecar.url, tally, stop)),
        (abuser, (sidecar.url, sidecar.port, tally, stop, "deep-nesting" in attacks)),
    ]
    if "slow-body" in attacks:
        jobs.append((slow_bodies, (sidecar.port, tally, stop)))
    if "fifo" in attacks:
        jobs.append((fifo_glob_writer, (fifo_dir, tally, stop)))
    if kv:
        jobs.extend(kv.jobs(stop))
    if experiment:
        jobs.append((experiment.run, (stop,)))
    workers = [threading.Thread(target=target, args=arguments, daemon=True) for target, arguments in jobs]
    for worker in workers:
        worker.start()
    started = time.monotonic()
    rss: list[tuple[float, float]] = []
    deadline = started + args.minutes * 60
    warm_up = min(WARM_UP_SECONDS, args.minutes * 30)
    memory = sidecar.memory()  # the kernel's high-water mark: a bomb's spike between two samples
    while time.monotonic() < deadline:
        rss.append((time.monotonic() - started, process.memory_info().rss / 2**20))
        if rss[-1][0] >= warm_up and not memory.baseline:
            memory.reset()
            if kv:
                kv.warmed_up()
        time.sleep(1.0)  # a sampling interval, not a wait for an event
    spike_mib = memory.peak_growth_mib()
    stop.set()
    for worker in workers:
        worker.join(WORKER_JOIN_SECONDS)
    sent = sum(tally.sent.values())
    settle = time.monotonic() + 30
    while True:
        at, families = time.monotonic(), metric_families(sidecar)
        requests, lag = counted(families)
        if kv:
            kv.observe(at, families)
        if (requests >= sent and (not kv or kv.settled())) or time.monotonic() > settle:
            break
        time.sleep(0.2)  # the tail's last poll, the worker's last batch, the reorder window
    output = sidecar.output()
    engine.close()
    if upstream:
        upstream.close()
    if kv:
        kv.close()

    after_warm_up = [mib for at, mib in rss if at >= warm_up]
    start_mib, end_mib, peak_mib = after_warm_up[0], after_warm_up[-1], max(mib for _, mib in rss)
    lag_p99 = histogram_p99(lag)
    scrape = sorted(tally.scrape_seconds)
    health = sorted(tally.health_seconds)
    print(f"soak: {args.minutes:g} min, {len(scrape)} scrapes, {tally.abuse} attacks")
    new = ", ".join(f"{name} {tally.attacks[name]}" for name in NEW_ATTACKS if name in attacks)
    print(f"  new attacks       {new or 'none'}")
    print(f"  records sent      {sent:>10,}  ({', '.join(f'{k} {v:,}' for k, v in tally.sent.items())})")
    print(f"  records counted   {int(requests):>10,}")
    print(
        f"  RSS MiB           start {start_mib:.1f} (after warm-up)  end {end_mib:.1f}  peak {peak_mib:.1f}"
    )
    judged = args.minutes >= RSS_FLAT_FROM_MINUTES
    growth = end_mib - start_mib
    print(
        f"  RSS flat          {growth:+.1f} MiB from the end of the warm-up to the end "
        f"(bound {RSS_FLAT_MIB:g}, {'judged' if judged else f'judged from {RSS_FLAT_FROM_MINUTES:g} min'})"
    )
    print(f"  RSS high-water    {spike_mib:+.1f} MiB above the start (VmHWM, spikes between samples too)")
    minutes = [f"{mib:.0f}" for at, mib in rss if int(at) % 60 == 0]
    print(f"  RSS each minute   {' '.join(minutes)} MiB (the batch-id window fills in ~8 min)")
    print(f"  event-loop lag    p99 <= {lag_p99 * 1000:.0f} ms (bucket bound)")
    print(f"  5xx answers       {len(tally.server_errors)}")
    print(f"  counter resets    {tally.resets}")
    scrape_p99 = scrape[int(0.99 * len(scrape))]
    print(
        f"  scrape            p50 {statistics.median(scrape) * 1000:.1f} ms  p99 {scrape_p99 * 1000:.1f} ms"
    )
    print(f"  /healthz          p99 {health[int(0.99 * len(health))] * 1000:.1f} ms")
    for attack in (kv, experiment):
        for line in attack.report() if attack else []:
            print(line)
    failures = [f"records: {sent:,} sent, {int(requests):,} counted"] if requests != sent else []
    if tally.server_errors:
        failures.append(f"{len(tally.server_errors)} answers 5xx: {', '.join(tally.server_errors[:10])}")
    if tally.resets:
        failures.append(f"{tally.resets} counter resets")
    if judged and growth > RSS_FLAT_MIB:
        failures.append(f"RSS flat: grew {growth:+.1f} MiB after warm-up (bound {RSS_FLAT_MIB:g})")
    for attack in (kv, experiment):
        failures.extend(attack.failures() if attack else [])
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    if failures:
        print(output[-3000:], file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
