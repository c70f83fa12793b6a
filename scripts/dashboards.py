"""Generate dashboards/kvlens-overview.json (run after editing; a test fails on drift).

    .venv/bin/python scripts/dashboards.py

Panels are declared here once, with the query, unit and description each must carry, so the
dashboard cannot lose a unit or a description by hand-editing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "dashboards" / "kvlens-overview.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job", model=~"$model"'
RATE = "$__rate_interval"
LOST = 'cause=~"held_elsewhere|evicted_here|evicted_elsewhere"'  # reuse lost to routing or capacity
LOST_OR_NEW = 'cause=~"new|held_elsewhere|evicted_here|evicted_elsewhere"'
JOB = 'job=~"$job"'  # KV events carry no model: the fleet row is per job


def ratio(numerator: str, denominator: str, window: str = RATE, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return (
        f"sum{group} (increase({numerator}[{window}])) / sum{group} (increase({denominator}[{window}]))"
        if window == "$__range"
        else f"sum{group} (rate({numerator}[{window}])) / sum{group} (rate({denominator}[{window}]))"
    )


HIT = (f'kvlens_requests_total{{{SEL}, cache="hit"}}', f"kvlens_requests_total{{{SEL}}}")
REUSE = (f"kvlens_cached_tokens_total{{{SEL}}}", f"kvlens_prompt_tokens_total{{{SEL}}}")
# Modelled work per unit (C(h) family, C(n) family): a model counts in one; never added across units.
WORK = {
    "work_units": (f"kvlens_reused_work_units_total{{{SEL}}}", f"kvlens_prompt_work_units_total{{{SEL}}}"),
    "flops": (f"kvlens_reused_flops_total{{{SEL}}}", f"kvlens_prompt_flops_total{{{SEL}}}"),
    "seconds": (
        f"kvlens_saved_prefill_seconds_total{{{SEL}}}",
        f"kvlens_modelled_prefill_seconds_total{{{SEL}}}",
    ),
}


def saved(window: str = RATE, by: str = "") -> str:
    """The compute-saved ratio, per unit (by model, or with a unit label fleet-wide)."""
    if by:
        return " or ".join(f"({ratio(*pair, window=window, by=by)})" for pair in WORK.values())
    return " or ".join(
        f'label_replace({ratio(*pair, window=window)}, "unit", "{unit}", "", "")'
        for unit, pair in WORK.items()
    )


def quantile(q: float, metric: str) -> str:
    return f"histogram_quantile({q}, sum by (prompt_len, cache, le) (rate({metric}_bucket{{{SEL}}}[{RATE}])))"


def target(expr: str, legend: str = "", ref: str = "A", instant: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref}
    if instant:
        out.update({"instant": True, "range": False, "format": "table"})
    return out


def panel(
    kind: str,
    title: str,
    description: str,
    unit: str,
    targets: list[dict[str, Any]],
    grid: tuple[int, int, int, int],
    **options: Any,
) -> dict[str, Any]:
    x, y, w, h = grid
    defaults: dict[str, Any] = {"unit": unit}
    if unit == "percentunit":
        defaults.update({"min": 0, "max": 1})
    defaults.update(options.pop("defaults", {}))
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "targets": targets,
        **options,
    }


def row(title: str, y: int) -> dict[str, Any]:
    return {
        "type": "row",
        "title": title,
        "collapsed": False,
        "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
        "panels": [],
    }


def panels() -> list[dict[str, Any]]:
    stat = {
        "options": {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value", "graphMode": "none"}
    }
    divergence_thresholds = {
        "thresholds": {
            "mode": "absolute",
            "steps": [
                {"color": "green", "value": None},
                {"color": "orange", "value": 0.2},
                {"color": "red", "value": 0.5},
            ],
        }
    }
    out = [
        row("Is the prefix cache paying off? (over the selected time range)", 0),
        panel(
            "stat",
            "Request hit ratio",
            "Share of requests that reused any cached prefix: count(h > 0) / count(requests). "
            "It flatters: a request that reuses 16 of 8,000 tokens counts as a hit.",
            "percentunit",
            [target(ratio(*HIT, window="$__range"))],
            (0, 1, 6, 5),
            **stat,
        ),
        panel(
            "stat",
            "Token reuse ratio",
            "Share of prompt tokens whose KV came from the cache: sum(h) / sum(n).",
            "percentunit",
            [target(ratio(*REUSE, window="$__range"))],
            (6, 1, 6, 5),
            **stat,
        ),
        panel(
            "stat",
            "Compute saved (modelled)",
            "Share of modelled prefill work the cache saved: sum C(h) / sum C(n), "
            "with C(n) = a*n + b*n*(n+1)/2 (attention grows with the square of the length). One value "
            "per unit: FLOPs for models with a shape, seconds for calibrated ones, the article's "
            "illustrative unit otherwise; never added across units.",
            "percentunit",
            [target(saved(window="$__range"), "{{unit}}")],
            (12, 1, 6, 5),
            **stat,
        ),
        panel(
            "stat",
            "Hit ratio minus token reuse",
            "How much the request hit ratio overstates token reuse. "
            "Above 0.5 the hit ratio says little about the cache's value (alert KVLensHitRatioFlatters).",
            "percentunit",
            [target(f"({ratio(*HIT, window='$__range')}) - ({ratio(*REUSE, window='$__range')})")],
            (18, 1, 6, 5),
            defaults=divergence_thresholds,
            **stat,
        ),
        panel(
            "timeseries",
            "Request hit vs token reuse vs compute saved, by model",
            "The three ratios over time, each a ratio of sums over the rate interval. "
            "Diverging lines mean the "
            "hit ratio flatters.",
            "percentunit",
            [
                target(ratio(*HIT, by="model"), "{{model}} request hit", "A"),
                target(ratio(*REUSE, by="model"), "{{model}} token reuse", "B"),
                target(saved(by="model"), "{{model}} compute saved", "C"),
            ],
            (0, 6, 24, 8),
        ),
        row("Latency by prompt length and hit status", 14),
        panel(
            "timeseries",
            "TTFT p50 and p95 by prompt length and hit status",
            "Time to first token, quantiles per prompt_len x cache group from that group's summed buckets.",
            "s",
            [
                target(quantile(0.95, "kvlens_ttft_seconds"), "{{prompt_len}} {{cache}} p95", "A"),
                target(quantile(0.5, "kvlens_ttft_seconds"), "{{prompt_len}} {{cache}} p50", "B"),
            ],
            (0, 15, 12, 8),
        ),
        panel(
            "timeseries",
            "TTFT decomposition",
            "Share of TTFT spent queueing, in prefill, and elsewhere "
            "(ttft - queue - prefill). When queueing dominates, a faster prefill barely moves TTFT.",
            "percentunit",
            [
                target(
                    f"sum by (component) (rate(kvlens_ttft_component_seconds_total{{{SEL}}}[{RATE}]))"
                    " / ignoring "
                    f"(component) group_left sum(rate(kvlens_ttft_component_seconds_total{{{SEL}}}[{RATE}]))",
                    "{{component}}",
                )
            ],
            (12, 15, 12, 8),
            defaults={"custom": {"stacking": {"mode": "normal"}, "fillOpacity": 40}},
        ),
        panel(
            "timeseries",
            "Queue p50 and p95 by prompt length and hit status",
            "Time waiting before scheduling, per prompt_len x cache group.",
            "s",
            [
                target(quantile(0.95, "kvlens_queue_seconds"), "{{prompt_len}} {{cache}} p95", "A"),
                target(quantile(0.5, "kvlens_queue_seconds"), "{{prompt_len}} {{cache}} p50", "B"),
            ],
            (0, 23, 12, 8),
        ),
        panel(
            "timeseries",
            "Prefill p50 and p95 by prompt length and hit status",
            "First scheduled to first token, per prompt_len x cache group: "
            "hits should be faster at equal length.",
            "s",
            [
                target(quantile(0.95, "kvlens_prefill_seconds"), "{{prompt_len}} {{cache}} p95", "A"),
                target(quantile(0.5, "kvlens_prefill_seconds"), "{{prompt_len}} {{cache}} p50", "B"),
            ],
            (12, 23, 12, 8),
        ),
        row("Per model", 31),
        panel(
            "table",
            "Per model",
            "Requests per second and the three ratios per model over the selected range.",
            "none",
            [
                target(
                    f"sum by (model) (increase(kvlens_requests_total{{{SEL}}}[$__range])) / $__range_s",
                    "",
                    "A",
                    instant=True,
                ),
                target(ratio(*HIT, window="$__range", by="model"), "", "B", instant=True),
                target(ratio(*REUSE, window="$__range", by="model"), "", "C", instant=True),
                target(saved(window="$__range", by="model"), "", "D", instant=True),
            ],
            (0, 32, 24, 7),
            transformations=[
                {"id": "merge"},
                {
                    "id": "organize",
                    "options": {
                        "renameByName": {
                            "Value #A": "requests/s",
                            "Value #B": "request hit",
                            "Value #C": "token reuse",
                            "Value #D": "compute saved",
                        },
                        "excludeByName": {"Time": True},
                    },
                },
            ],
        ),
        row("kvlens vs the engine", 39),
        panel(
            "timeseries",
            "Token reuse: kvlens vs the engine's counters",
            "kvlens's token reuse beside vLLM's own (prompt_tokens_cached / prompt_tokens, "
            "and local prefix-cache hits / queries), scraped with --scrape. "
            "Gaps: retries counted twice before vLLM 0.27, preemption, "
            "traffic kvlens does not receive.",
            "percentunit",
            [
                target(ratio(*REUSE, by="model"), "{{model}} kvlens", "A"),
                target(
                    ratio(
                        f"kvlens_engine_cached_prompt_tokens_total{{{SEL}}}",
                        f"kvlens_engine_prompt_tokens_total{{{SEL}}}",
                        by="model",
                    ),
                    "{{model}} engine",
                    "B",
                ),
                target(
                    ratio(
                        f"kvlens_engine_prefix_cache_hit_tokens_total{{{SEL}}}",
                        f"kvlens_engine_prefix_cache_queried_tokens_total{{{SEL}}}",
                        by="model",
                    ),
                    "{{model}} engine local prefix cache",
                    "C",
                ),
            ],
            (0, 40, 16, 8),
        ),
        panel(
            "stat",
            "Engine scrape up",
            "1 when kvlens's last scrape of the engine's /metrics succeeded.",
            "none",
            [target('kvlens_upstream_up{job=~"$job"}', "{{target}}")],
            (16, 40, 8, 8),
            **stat,
        ),
        row("GPU time: prefill the cache saves, and what weight quantization would do to decode", 48),
        panel(
            "timeseries",
            "Prefill GPU time saved",
            "Modelled prefill GPU seconds the cache saved per second, per model calibrated in seconds "
            "(kvlens analyze --calibrate): the GPUs of prefill it frees. Read TTFT gains from the latency "
            "panels by hit status: a request prefilled alone on an under-used GPU saves less time than "
            "FLOPs, and queueing can hide it all.",
            "short",
            [
                target(
                    f"sum by (model) (rate(kvlens_saved_prefill_seconds_total{{{SEL}}}[{RATE}]))",
                    "{{model}} GPUs of prefill freed",
                )
            ],
            (0, 49, 12, 8),
        ),
        panel(
            "timeseries",
            "Would weight-only quantization speed up decode now? (byte model: an upper bound)",
            "The byte model of W4A16 at the current batch (the engine's running requests) and context "
            "(recent prompt + output): (W16 + B*K) / (W4 + B*K), and the share of decode traffic that is "
            "weights. It is an upper bound that only a bandwidth-bound int4 kernel approaches: on an H200 "
            "a tinygemm int4 path measured 1.36x where bytes say 3.14x (batch 1) and 0.89x (batch 8); "
            "calibrate with kvlens bandwidth --measured. Long contexts and big batches make KV reads "
            "dominate: quantizing weights then saves memory but little time. Needs model_shapes.",
            "none",
            [
                target(f"kvlens_w4a16_decode_speedup{{{SEL}}}", "{{model}} W4A16 speedup (x)", "A"),
                target(f"kvlens_decode_weight_share{{{SEL}}}", "{{model}} weights' share of traffic", "B"),
            ],
            (12, 49, 12, 8),
        ),
        row("Ingestion health", 57),
        panel(
            "timeseries",
            "Records received by source",
            "Records per second reaching kvlens, valid or not.",
            "reqps",
            [
                target(
                    f'sum by (source) (rate(kvlens_records_received_total{{job=~"$job"}}[{RATE}]))',
                    "{{source}}",
                )
            ],
            (0, 58, 8, 8),
        ),
        panel(
            "timeseries",
            "Records rejected by reason",
            "Rejected records per second by source and reason; a rejected record is counted nowhere else.",
            "reqps",
            [
                target(
                    f'sum by (source, reason) (rate(kvlens_records_rejected_total{{job=~"$job"}}[{RATE}]))',
                    "{{source}} {{reason}}",
                )
            ],
            (8, 58, 8, 8),
        ),
        panel(
            "timeseries",
            "Records dropped and folded",
            "Records the plugin dropped before delivery, and records "
            "whose model was folded into other by the label cap, per second.",
            "reqps",
            [
                target(
                    f'sum by (source) (rate(kvlens_records_dropped_total{{job=~"$job"}}[{RATE}]))',
                    "dropped {{source}}",
                    "A",
                ),
                target(
                    f'sum(rate(kvlens_series_overflow_total{{job=~"$job"}}[{RATE}]))',
                    "folded into other",
                    "B",
                ),
            ],
            (16, 58, 8, 8),
        ),
        row("Sidecar under load", 66),
        panel(
            "timeseries",
            "Ingest requests refused by reason",
            "Whole requests refused per second: busy and batch_in_progress are retried by the sender; "
            "the others (bombs, oversized, undecodable, unauthorized) lose their records.",
            "reqps",
            [
                target(
                    f'sum by (reason) (rate(kvlens_ingest_refused_total{{job=~"$job"}}[{RATE}]))',
                    "{{reason}}",
                )
            ],
            (0, 67, 8, 8),
        ),
        panel(
            "timeseries",
            "Event-loop lag p99",
            "How late the sidecar's event loop wakes a sleeping task: a blocked loop delays every "
            "request, probes included (README: Reliability and limits).",
            "s",
            [
                target(
                    "histogram_quantile(0.99, sum by (le, instance) "
                    f'(rate(kvlens_event_loop_lag_seconds_bucket{{job=~"$job"}}[{RATE}])))',
                    "{{instance}}",
                )
            ],
            (8, 67, 8, 8),
        ),
        panel(
            "timeseries",
            "Connections",
            "Open connections, and those the sidecar closed: no whole request head in time, or "
            "evicted past max_connections (per second).",
            "short",
            [
                target('sum by (instance) (kvlens_connections_open{job=~"$job"})', "open {{instance}}", "A"),
                target(
                    f'sum by (reason) (rate(kvlens_connections_closed_total{{job=~"$job"}}[{RATE}]))',
                    "closed: {{reason}}",
                    "B",
                ),
            ],
            (16, 67, 8, 8),
        ),
        row("Why reuse is lost (KV events)", 75),
        panel(
            "timeseries",
            "Recomputed prefill by cause",
            "Tokens of the blocks the replicas stored in GPU memory (work they did), stacked by why "
            "they were not reused: new (the workload), evicted_here and evicted_elsewhere "
            "(capacity), held_elsewhere (routing: another replica held them). From the engines' KV "
            "events (kvlens serve --kv-events). Per second.",
            "short",
            [
                target(
                    "sum by (cause) "
                    f"(rate(kvlens_kv_recomputed_tokens_total{{{JOB},{LOST_OR_NEW}}}[{RATE}]))",
                    "{{cause}}",
                )
            ],
            (0, 76, 8, 8),
            defaults={"custom": {"stacking": {"mode": "normal"}, "fillOpacity": 40}},
        ),
        panel(
            "timeseries",
            "Reuse lost to routing and capacity, per replica",
            "Tokens each replica recomputed although another replica held them (held_elsewhere: "
            "routing), or it or another had held them (evicted_here, evicted_elsewhere: capacity). "
            "Per second.",
            "short",
            [
                target(
                    "sum by (replica, cause) "
                    f"(rate(kvlens_kv_recomputed_tokens_total{{{JOB},{LOST}}}[{RATE}]))",
                    "{{replica}} {{cause}}",
                )
            ],
            (8, 76, 8, 8),
        ),
        panel(
            "timeseries",
            "Reachable vs delivered token reuse",
            "Delivered token reuse (records) beside the reachable one: the reused tokens plus those "
            "recomputed although the fleet had cached them. The gap is what routing and capacity lose.",
            "percentunit",
            [
                target(
                    f"(sum(rate(kvlens_cached_tokens_total{{{JOB}}}[{RATE}])) + "
                    f"sum(rate(kvlens_kv_recomputed_tokens_total{{{JOB},{LOST}}}[{RATE}]))) "
                    f"/ sum(rate(kvlens_prompt_tokens_total{{{JOB}}}[{RATE}]))",
                    "reachable",
                ),
                target(
                    ratio(f"kvlens_cached_tokens_total{{{JOB}}}", f"kvlens_prompt_tokens_total{{{JOB}}}"),
                    "delivered",
                    "B",
                ),
            ],
            (16, 76, 8, 8),
        ),
        panel(
            "timeseries",
            "Blocks held and duplicated",
            "Blocks each replica holds now (GPU and offload tiers), and the fleet's duplicated "
            "blocks: holdings beyond the first of each block, KV memory spent holding the same "
            "prefix on several replicas.",
            "short",
            [
                target(
                    'sum by (replica, medium) (kvlens_kv_blocks_held{job=~"$job"})', "{{replica}} {{medium}}"
                ),
                target(
                    'sum(kvlens_kv_fleet_blocks{job=~"$job",kind="duplicated"})', "duplicated (fleet)", "B"
                ),
            ],
            (0, 84, 8, 8),
        ),
        panel(
            "timeseries",
            "KV event publishers",
            "Publishers connected, and the trouble on the way (per second): batches lost in gaps no "
            "replay repaired, publisher restarts, events rejected by reason.",
            "short",
            [
                target('sum(kvlens_kv_publisher_up{job=~"$job"})', "publishers up"),
                target(
                    f'sum by (replica) (rate(kvlens_kv_missed_batches_total{{job=~"$job"}}[{RATE}]))',
                    "missed {{replica}}",
                    "B",
                ),
                target(
                    f'sum by (replica) (rate(kvlens_kv_publisher_restarts_total{{job=~"$job"}}[{RATE}]))',
                    "restarts {{replica}}",
                    "C",
                ),
                target(
                    f'sum by (reason) (rate(kvlens_kv_events_rejected_total{{job=~"$job"}}[{RATE}]))',
                    "rejected: {{reason}}",
                    "D",
                ),
            ],
            (8, 84, 8, 8),
        ),
        panel(
            "timeseries",
            "Block index memory",
            "Estimated memory of kvlens's fleet block index (entries times measured bytes per "
            "entry), per kvlens process (shards add up).",
            "bytes",
            [target('sum by (instance) (kvlens_kv_index_memory_bytes{job=~"$job"})', "{{instance}}")],
            (16, 84, 8, 8),
        ),
    ]
    for number, item in enumerate(out, start=1):
        item["id"] = number
    return out


def variable(name: str, label: str, query: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": name},
        "definition": query,
        "refresh": 2,
        "sort": 1,
        **extra,
    }


def dashboard() -> dict[str, Any]:
    return {
        "uid": "kvlens-overview",
        "title": "kvlens: is the prefix cache paying off?",
        "description": "Request hit ratio, token reuse and modelled compute saved side by side; "
        "latency by prompt "
        "length and hit status; reconciliation with vLLM; ingestion health.",
        "tags": ["kvlens", "vllm", "prefix-cache"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "links": [],
        "annotations": {"list": []},
        "templating": {
            "list": [
                {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus"},
                variable(
                    "job",
                    "Job",
                    "label_values(kvlens_build_info, job)",
                    multi=True,
                    includeAll=True,
                    allValue=".*",
                ),
                variable(
                    "model",
                    "Model",
                    'label_values(kvlens_requests_total{job=~"$job"}, model)',
                    multi=True,
                    includeAll=True,
                    allValue=".*",
                ),
            ]
        },
        "panels": panels(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(render())
