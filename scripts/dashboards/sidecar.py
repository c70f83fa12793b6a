"""The sidecar dashboard: is kvlens up and fed? Scrape and engine status, ingestion, refusals,
the event loop, connections, tails, collector errors."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash

from kvlens.exporter import metrics, promql
from scripts.dashboards.panels import base, query, series, single, states, thresholds
from scripts.dashboards.queries import RANGE, RATE, SEL, SIDECAR, gauge, series_of, summed


def sidecar() -> dash.Dashboard:
    board = base(
        "kvlens-sidecar",
        "kvlens: sidecar health",
        "Is kvlens up and fed: scrape and engine status, ingestion, refusals, the event loop, "
        "connections, tails, collector errors.",
        with_model=False,
    )
    board = board.with_row(dash.Row("Status"))
    board = board.with_panel(
        single(
            "Sidecars down",
            "Targets of the selected jobs whose last scrape failed (up == 0); red from one. "
            "Alert KVLensDown.",
            "none",
            query(f"count(up{{{SEL}}} == 0) or vector(0)", instant=True),
            width=4,
        ).thresholds(thresholds((None, "green"), (1, "red")))
    )
    board = board.with_panel(
        single(
            "Engine scrape",
            "kvlens's last scrape of each engine's /metrics (--scrape): up or down (red). "
            "Alert KVLensUpstreamDown.",
            "none",
            query(series_of(metrics.UPSTREAM_UP), "{{instance}} → {{target}}", instant=True),
            width=5,
        )
        .mappings(states(**{"0": ("down", "red"), "1": ("up", "green")}))
        .thresholds(thresholds((None, "red"), (1, "green")))
    )
    board = board.with_panel(
        single(
            "Ingest without a token",
            "Whether a sidecar accepts records beyond loopback without a bearer token. "
            "Alert KVLensIngestOpen.",
            "none",
            query(f"max({series_of(metrics.INGEST_OPEN)})", instant=True),
            width=5,
        )
        .mappings(states(**{"0": ("token set or loopback", "green"), "1": ("open", "red")}))
        .thresholds(thresholds((None, "green"), (1, "red")))
    )
    board = board.with_panel(
        single(
            "Tail checkpoints",
            "Each followed file's checkpoint: written, or failing (red; a restart would count its "
            "lines again). Alert KVLensTailCheckpointFailing.",
            "none",
            query(series_of(metrics.TAIL_CHECKPOINT_OK), "{{instance}} {{path}}", instant=True),
            width=5,
        )
        .mappings(states(**{"0": ("failing", "red"), "1": ("written", "green")}))
        .thresholds(thresholds((None, "red"), (1, "green")))
        .no_value("no tails")
    )
    board = board.with_panel(
        single(
            "Collector errors (selected range)",
            "Metric families that failed to render and were left out of /metrics: a kvlens bug. "
            "Alert KVLensCollectorErrors.",
            "short",
            query(f"sum({promql.rate(series_of(metrics.SCRAPE_ERRORS), RANGE)})", instant=True),
            width=5,
        ).thresholds(thresholds((None, "green"), (1, "red")))
    )

    by_sidecar = (*promql.SIDECAR, "source")
    board = board.with_row(dash.Row("Ingestion"))
    board = board.with_panel(
        series(
            "Records received by source",
            "Records per second reaching kvlens, valid or not.",
            "cps",
            [query(summed(metrics.RECEIVED, "source"), "{{source}}")],
            width=6,
        )
    )
    board = board.with_panel(
        series(
            "Records rejected by reason",
            "Rejected records per second by source and reason; a rejected record is counted nowhere else.",
            "cps",
            [
                query(
                    summed(metrics.REJECTED, "source", "reason"),
                    "{{source}} {{reason}}",
                )
            ],
            width=6,
        )
    )
    board = board.with_panel(
        series(
            "Share rejected per sidecar",
            "Rejected records / received records of each sidecar, source and reason: what "
            "KVLensRecordsRejected compares with 1 %. One broken sidecar shows here even when the "
            "fleet's share is small.",
            "percentunit",
            [
                query(
                    promql.share(
                        series_of(metrics.REJECTED),
                        series_of(metrics.RECEIVED),
                        RATE,
                        by_sidecar,
                        ("reason",),
                    ),
                    "{{instance}} {{source}} {{reason}}",
                )
            ],
            width=6,
        )
    )
    board = board.with_panel(
        series(
            "Records dropped and folded",
            "Records the plugin dropped before delivery, and records whose model (tenant) was folded "
            "into other by its label cap, per second.",
            "cps",
            [
                query(
                    summed(metrics.DROPPED, "source"),
                    "dropped {{source}}",
                    "A",
                ),
                query(
                    f"sum({promql.rate(series_of(metrics.OVERFLOW), RATE)})", "models folded into other", "B"
                ),
                query(
                    f"sum({promql.rate(series_of(metrics.TENANT_OVERFLOW), RATE)})",
                    "tenants folded into other",
                    "C",
                ),
            ],
            width=6,
        )
    )

    board = board.with_row(dash.Row("Sidecar under load"))
    board = board.with_panel(
        series(
            "Ingest requests refused by reason",
            "Whole requests refused per second: busy, displaced and batch_in_progress are retried by the "
            "sender; the others (bombs, oversized, undecodable, unauthorized) lose their records.",
            "reqps",
            [query(summed(metrics.INGEST_REFUSED, "reason"), "{{reason}}")],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Event-loop lag p99",
            "How late the sidecar's event loop wakes a sleeping task: a blocked loop delays every "
            "request, probes included (README: Reliability and limits).",
            "s",
            [
                query(
                    promql.quantile(0.99, metrics.LOOP_LAG, SEL, RATE, promql.SIDECAR),
                    "{{instance}}",
                )
            ],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Collector errors",
            "Metric families left out of /metrics per second, per sidecar.",
            "cps",
            [
                query(
                    summed(metrics.SCRAPE_ERRORS, *promql.SIDECAR),
                    "{{instance}}",
                )
            ],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Open connections",
            "Open HTTP connections per sidecar.",
            "short",
            [query(gauge(metrics.CONNECTIONS_OPEN, SIDECAR), "{{instance}}")],
        )
    )
    board = board.with_panel(
        series(
            "Connections closed by the sidecar",
            "Connections closed per second: no whole request head in time, or evicted past max_connections.",
            "cps",
            [query(summed(metrics.CONNECTIONS_CLOSED, "reason"), "{{reason}}")],
        )
    )
    return board
