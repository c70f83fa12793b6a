"""The overview dashboard: is the prefix cache paying off? The three ratios side by side, per
pod, per model, latency per model by prompt length with hits beside misses, kvlens against the
engine's own counters, why reuse is lost (kv_events), and the GPU time of prefill and decode.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import heatmap, table
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models.heatmap import HeatmapColorMode
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from kvlens.exporter import metrics, promql
from scripts.dashboards.isolation import tenant_isolation
from scripts.dashboards.kv_events import why_reuse_is_lost
from scripts.dashboards.panels import DATASOURCE, base, query, series, single, stacked, thresholds
from scripts.dashboards.queries import (
    MODEL,
    RANGE,
    RATE,
    REUSE,
    gauge,
    hit_ratio,
    quantile,
    ratio,
    saved,
    series_of,
    summed,
)
from scripts.dashboards.tenants import tenants


def overview() -> dash.Dashboard:
    board = base(
        "kvlens-overview",
        "kvlens: is the prefix cache paying off?",
        "Request hit ratio, token reuse and modelled compute saved side by side; per pod; latency per "
        "model by prompt length, hit beside miss; reconciliation with the engine's counters.",
        with_model=True,
    )
    for row in (
        paying_off,
        per_pod,
        per_model,
        latency,
        against_the_engine,
        why_reuse_is_lost,
        gpu_time,
        tenant_isolation,
        tenants,
    ):
        board = row(board)
    return board


def paying_off(board: dash.Dashboard) -> dash.Dashboard:
    """The three ratios over the selected range, and over time by model."""
    range_hit = hit_ratio(RANGE)
    range_reuse = ratio(*REUSE, window=RANGE)
    board = board.with_row(dash.Row("Is the prefix cache paying off? (over the selected time range)"))
    board = board.with_panel(
        single(
            "Request hit ratio",
            "Share of requests that reused any cached prefix: count(h > 0) / count(requests). "
            "It flatters: a request that reuses 16 of 8,000 tokens counts as a hit.",
            "percentunit",
            query(range_hit, instant=True),
        ).thresholds(thresholds((None, "text")))
    )
    board = board.with_panel(
        single(
            "Token reuse ratio",
            "Share of prompt tokens whose KV came from the cache: sum(h) / sum(n).",
            "percentunit",
            query(range_reuse, instant=True),
        ).thresholds(thresholds((None, "text")))
    )
    board = board.with_panel(
        single(
            "Compute saved (modelled)",
            "Share of modelled prefill work the cache saved: sum C(h) / sum C(n), with "
            "C(n) = a*n + b*n*(n+1)/2 (attention grows with the square of the length). One value per "
            "unit: FLOPs for models with a shape, seconds for calibrated ones, the article's "
            "illustrative unit otherwise; never added across units.",
            "percentunit",
            query(saved(window=RANGE), "{{unit}}", instant=True),
        ).thresholds(thresholds((None, "text")))
    )
    board = board.with_panel(
        single(
            "Hit ratio minus token reuse",
            "How much the request hit ratio overstates token reuse: orange above 0.2, red above 0.5, "
            "where the hit ratio says little about the cache's value (RUNBOOK: the request hit ratio "
            "flatters). A description of the workload, so a stat here and not an alert.",
            "percentunit",
            query(f"({range_hit}) - ({range_reuse})", instant=True),
        ).thresholds(thresholds((None, "green"), (0.2, "orange"), (0.5, "red")))
    )
    board = board.with_panel(
        series(
            "Request hit vs token reuse vs compute saved, by model",
            "The three ratios over time, each a ratio of sums over the rate interval. Diverging "
            "lines mean the hit ratio flatters.",
            "percentunit",
            [
                query(hit_ratio(by="model"), "{{model}} request hit", "A"),
                query(ratio(*REUSE, by="model"), "{{model}} token reuse", "B"),
                query(saved(by="model"), "{{model}} compute saved", "C"),
            ],
            width=24,
        )
    )
    return board


def per_pod(board: dash.Dashboard) -> dash.Dashboard:
    """Per sidecar (pod): the recording rules' ratios; routing problems show here first."""
    board = board.with_row(dash.Row("Per pod: routing problems show here first"))
    board = board.with_panel(
        series(
            "Token reuse per pod",
            "Token reuse of each sidecar (one vLLM pod) and model over 5 minutes, from the recording "
            "rule instance_model:kvlens_token_reuse_ratio:ratio_rate5m. A pod far below the others "
            "receives requests whose prefixes live on another replica: check the router's affinity.",
            "percentunit",
            [
                query(
                    promql.INSTANCE_REUSE.on_dashboard(),
                    "{{instance}} {{model}}",
                )
            ],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Request hit per pod",
            "Request hit ratio of each sidecar and model over 5 minutes "
            "(instance_model:kvlens_request_hit_ratio:ratio_rate5m).",
            "percentunit",
            [
                query(
                    promql.INSTANCE_HIT.on_dashboard(),
                    "{{instance}} {{model}}",
                )
            ],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Token reuse vs its 6 h baseline (what KVLensTokenReuseDropWhileHitHigh sees)",
            "Per namespace and model, the recording rules the alert compares: token reuse and request "
            "hit over 5 minutes and over 6 hours. The alert fires when reuse falls under half of the "
            "6 h value as it was an hour ago while the hit ratio holds: a prompt template change.",
            "percentunit",
            [
                query(
                    promql.NAMESPACE_MODEL_REUSE.on_dashboard(),
                    "{{model}} token reuse 5m",
                    "A",
                ),
                query(
                    promql.NAMESPACE_MODEL_REUSE_6H.on_dashboard(),
                    "{{model}} token reuse 6h",
                    "B",
                ),
                query(
                    promql.NAMESPACE_MODEL_HIT.on_dashboard(),
                    "{{model}} request hit 5m",
                    "C",
                ),
                query(
                    promql.NAMESPACE_MODEL_HIT_6H.on_dashboard(),
                    "{{model}} request hit 6h",
                    "D",
                ),
            ],
            width=8,
        )
    )
    return board


def per_model(board: dash.Dashboard) -> dash.Dashboard:
    """Requests per second and the three ratios, one row per model."""
    board = board.with_row(dash.Row("Per model (over the selected time range)"))
    columns = {
        "A": ("requests/s", "reqps"),
        "B": ("request hit", "percentunit"),
        "C": ("token reuse", "percentunit"),
        "D": ("compute saved", "percentunit"),
    }
    per_model = (
        table.Panel()
        .title("Per model")
        .description("Requests per second and the three ratios per model over the selected range.")
        .datasource(DATASOURCE)
        .span(24)
        .height(7)
        .unit("percentunit")
        .decimals(1)
        .with_target(
            query(
                summed(metrics.REQUESTS, "model", matchers=MODEL, window=RANGE) + " / $__range_s",
                ref="A",
                rows=True,
            )
        )
        .with_target(query(hit_ratio(RANGE, by="model"), ref="B", rows=True))
        .with_target(query(ratio(*REUSE, window=RANGE, by="model"), ref="C", rows=True))
        .with_target(query(saved(window=RANGE, by="model"), ref="D", rows=True))
        .with_transformation(model.DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(
            model.DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True},
                    "renameByName": {f"Value #{ref}": name for ref, (name, _) in columns.items()},
                },
            )
        )
        .override_by_name("requests/s", [model.DynamicConfigValue(id_val="unit", value="reqps")])
    )
    board = board.with_panel(per_model)
    return board


def latency(board: dash.Dashboard) -> dash.Dashboard:
    """A row repeated per model: latency by prompt length, hit beside miss."""
    latency = (
        "Quantiles of this model by prompt length and hit status, each from its own summed buckets. "
        "At equal prompt length a hit should be faster than a miss"
    )
    board = board.with_row(
        dash.Row("Latency of $model: hit beside miss at equal prompt length").repeat("model")
    )
    board = board.with_panel(latency_table(MODEL))
    for metric, name, extra in (
        (metrics.TTFT, "TTFT", "; the prefix cache shortens prefill, not queueing."),
        (metrics.QUEUE, "Queue", ": time waiting before scheduling."),
        (metrics.PREFILL, "Prefill", ": first scheduled to first token, what the cache saves."),
        (metrics.E2E, "End-to-end", ": the whole request, decode included."),
    ):
        board = board.with_panel(
            series(
                f"{name} p50 and p95 by prompt length, hit vs miss",
                latency + extra,
                "s",
                [
                    query(quantile(0.95, metric), "{{prompt_len}} {{cache}} p95", "A"),
                    query(quantile(0.5, metric), "{{prompt_len}} {{cache}} p50", "B"),
                ],
                width=8,
            )
        )
    board = board.with_panel(
        stacked(
            series(
                "TTFT decomposition",
                "Share of this model's TTFT spent queueing, in prefill, and elsewhere (ttft - queue - "
                "prefill). When queueing dominates, a faster prefill barely moves TTFT.",
                "percentunit",
                [
                    query(
                        summed(metrics.TTFT_COMPONENT, "model", "component", matchers=MODEL)
                        + " / ignoring (component) group_left "
                        + summed(metrics.TTFT_COMPONENT, "model", matchers=MODEL),
                        "{{component}}",
                    )
                ],
                width=8,
            )
        )
    )
    board = board.with_panel(
        heatmap.Panel()
        .title("Per-request token reuse (h/n)")
        .description(
            "How many requests reused what share of their prompt, per rate interval "
            "(kvlens_request_reuse_ratio): a mean hides that most requests reuse nothing while a few "
            "reuse almost all."
        )
        .datasource(DATASOURCE)
        .span(8)
        .height(8)
        .with_target(
            query(
                f"sum by (le) ({promql.rate(promql.buckets(metrics.REUSE_RATIO, MODEL), RATE, 'increase')})",
                "{{le}}",
            ).format(PromQueryFormat.HEATMAP)
        )
        .unit("short")  # the cells: requests per rate interval
        .calculate(False)
        .y_axis(heatmap.YAxisConfig().unit("percentunit"))
        .color(heatmap.HeatmapColorOptions().mode(HeatmapColorMode.SCHEME).scheme("Oranges").steps(64))
        .cell_values(heatmap.CellValues().unit("short"))
        .show_legend()
    )
    return board


def against_the_engine(board: dash.Dashboard) -> dash.Dashboard:
    """kvlens's token reuse beside the engine's own counters."""
    board = board.with_row(dash.Row("kvlens vs the engine"))
    board = board.with_panel(
        series(
            "Token reuse per pod: kvlens vs the engine's counters",
            "kvlens's token reuse beside the engine's own (prompt_tokens_cached / prompt_tokens) as the "
            "same sidecar sees them over 5 minutes: the recording rules KVLensEngineReuseDisagrees "
            "compares. Gaps: retries counted twice before vLLM 0.27, preemption, traffic kvlens does "
            "not receive.",
            "percentunit",
            [
                query(
                    promql.INSTANCE_REUSE.on_dashboard(),
                    "{{instance}} {{model}} kvlens",
                    "A",
                ),
                query(
                    promql.INSTANCE_ENGINE_REUSE.on_dashboard(),
                    "{{instance}} {{model}} engine",
                    "B",
                ),
                query(
                    ratio(
                        series_of(metrics.ENGINE_COUNTERS["prefix_cache_hit_tokens"], MODEL),
                        series_of(metrics.ENGINE_COUNTERS["prefix_cache_queried_tokens"], MODEL),
                        by="model",
                    ),
                    "{{model}} engine local prefix cache",
                    "C",
                ),
            ],
            width=24,
        )
    )
    return board


def gpu_time(board: dash.Dashboard) -> dash.Dashboard:
    """Prefill GPU time the cache saves; the byte model of W4A16 decode."""
    board = board.with_row(
        dash.Row("GPU time: prefill the cache saves, and what weight quantization would do to decode")
    )
    board = board.with_panel(
        series(
            "Prefill GPU time saved",
            "Modelled prefill GPU seconds the cache saved per second, per model calibrated in seconds "
            "(kvlens analyze --calibrate): the GPUs of prefill it frees. Read TTFT gains from the "
            "latency rows: a request prefilled alone on an under-used GPU saves less time than FLOPs, "
            "and queueing can hide it all.",
            "short",
            [
                query(
                    summed(metrics.SAVED_PREFILL, "model", matchers=MODEL),
                    "{{model}} GPUs of prefill freed",
                )
            ],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "W4A16 decode speedup now (byte model: an upper bound)",
            "The byte model of W4A16 at the current batch (the engine's running requests) and context "
            "(recent prompt + output): (W16 + B*K) / (W4 + B*K). An upper bound that only a "
            "bandwidth-bound int4 kernel approaches: on an H200 a tinygemm int4 path measured 1.36x where "
            "bytes say 3.14x (batch 1) and 0.89x (batch 8); calibrate with kvlens bandwidth --measured. "
            "Needs model_shapes.",
            "suffix:x",
            [query(gauge(metrics.W4A16_SPEEDUP, "model", "max", MODEL), "{{model}}")],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Weights' share of decode traffic",
            "Modelled share of decode memory traffic that is weights, W / (W + B*K). Long contexts and "
            "big batches make KV reads dominate: quantizing weights then saves memory but little time.",
            "percentunit",
            [query(gauge(metrics.DECODE_WEIGHT_SHARE, "model", "max", MODEL), "{{model}}")],
            width=8,
        )
    )
    return board


def latency_table(selection: str) -> table.Panel:
    """Hit beside miss per prompt length: p50 and p95 over the range, one row per length, in
    length order (a numeric `length_from` label, hidden, because "512-2047" sorts after
    "2048-8191" as text)."""
    refs = {"A": (0.5, "hit"), "B": (0.5, "miss"), "C": (0.95, "hit"), "D": (0.95, "miss")}
    transforms = [
        ("merge", {}),
        (
            "convertFieldType",
            {"fields": {}, "conversions": [{"targetField": "length_from", "destinationType": "number"}]},
        ),
        ("sortBy", {"fields": {}, "sort": [{"field": "length_from", "desc": False}]}),
        (
            "organize",
            {
                "excludeByName": {"Time": True, "length_from": True},
                "renameByName": {
                    f"Value #{ref}": f"{cache} p{round(q * 100)}" for ref, (q, cache) in refs.items()
                },
            },
        ),
    ]
    panel = (
        table.Panel()
        .title("TTFT by prompt length: hit beside miss (selected range)")
        .description(
            "TTFT quantiles of this model over the selected range, one row per prompt length, hits "
            "beside misses. An empty cell: no such request in the range."
        )
        .datasource(DATASOURCE)
        .span(24)
        .height(6)
        .unit("s")
    )
    for transform, options in transforms:
        panel = panel.with_transformation(model.DataTransformerConfig(id_val=transform, options=options))
    for ref, (q, cache) in refs.items():
        expr = quantile(q, metrics.TTFT, f'{selection}, cache="{cache}"', window=RANGE, by=("prompt_len",))
        panel = panel.with_target(
            query(f'label_replace({expr}, "length_from", "$1", "prompt_len", `(\\d+).*`)', ref=ref, rows=True)
        )
    return panel
