"""Generate kvlens's Grafana dashboards (dashboards/*.json) with grafana-foundation-sdk's typed
builders. Run after editing; a test fails when the committed JSON drifts from this script.

    .venv/bin/python scripts/dashboards.py

The SDK is a development dependency (the `test` extra): users import the generated JSON and
never need it. Its builders type every option, so a unit, a transform's options or a mapping
cannot be misspelt or left out as in hand-written dicts.

Selection: every query matches `cluster`, `namespace`, `job` and `instance` with `=~` on the
dashboard's variables. The "All" of `cluster` and `namespace` is `.*`, which also matches a label
a setup does not have (one Prometheus without a `cluster` label, Docker without `namespace`), so
the same dashboard serves a single Prometheus and a Thanos or Mimir holding many clusters. The
"All" of `job` and `instance` is the list of kvlens's own (from `kvlens_build_info`), so that
`up` counts kvlens's targets only, not a vLLM job's or any other.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import heatmap, prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models.heatmap import HeatmapColorMode
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from kvlens.exporter import promql
from kvlens.exporter.promql import RANGE, causes, selector

OUT = Path(__file__).resolve().parent.parent / "dashboards"
DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
TAG = "kvlens"
# Every query's selection: one sidecar's labels on their variables; MODEL adds the model variable
# for per-model series. The idioms (ratios of sums, the hit ratio, windows, label and cause lists)
# are kvlens.exporter.promql's, which writes the recording rules too.
SEL = promql.variables(promql.SIDECAR)
MODEL = promql.variables(promql.LEVELS["instance_model"])
RATE = promql.RATE_INTERVAL
SIDECAR = promql.labels(promql.SIDECAR)


# ------------------------------------------------------------------------------ PromQL ----------
def summed(metric: str, *by: str, matchers: str = SEL, window: str = RATE) -> str:
    """``sum by (...) (rate(metric{selection}[$__rate_interval]))``."""
    return promql.summed(selector(metric, matchers), window, by)


def ratio(numerator: str, denominator: str, window: str = RATE, by: str = "") -> str:
    """A ratio of sums over the window (never a mean of ratios)."""
    return promql.ratio(numerator, denominator, window, (by,) if by else ())


def hit_ratio(window: str = RATE, by: str = "") -> str:
    """The request hit ratio; 0 (not absent) where requests arrived and none hit."""
    return promql.hit_ratio(window, (by,) if by else (), MODEL)


REUSE = (f"kvlens_cached_tokens_total{{{MODEL}}}", f"kvlens_prompt_tokens_total{{{MODEL}}}")
# Modelled work per unit (C(h) family, C(n) family): a model counts in one; never added across units.
WORK = {
    "work_units": (
        f"kvlens_reused_work_units_total{{{MODEL}}}",
        f"kvlens_prompt_work_units_total{{{MODEL}}}",
    ),
    "flops": (f"kvlens_reused_flops_total{{{MODEL}}}", f"kvlens_prompt_flops_total{{{MODEL}}}"),
    "seconds": (
        f"kvlens_saved_prefill_seconds_total{{{MODEL}}}",
        f"kvlens_modelled_prefill_seconds_total{{{MODEL}}}",
    ),
}


def saved(window: str = RATE, by: str = "") -> str:
    """The compute-saved ratio: per model (unit-free), or fleet-wide with a `unit` label."""
    if by:
        return " or ".join(f"({ratio(*pair, window=window, by=by)})" for pair in WORK.values())
    return " or ".join(
        f'label_replace({ratio(*pair, window=window)}, "unit", "{unit}", "", "")'
        for unit, pair in WORK.items()
    )


def quantile(
    q: float, metric: str, selection: str = MODEL, window: str = RATE, by: str = "prompt_len, cache"
) -> str:
    """A quantile per model (never across models: an 8B and a 70B model make no one quantile)."""
    buckets = promql.rate(selector(f"{metric}_bucket", selection), window)
    return f"histogram_quantile({q}, sum by (model, {by}, le) ({buckets}))"


# ----------------------------------------------------------------------------- builders ---------
def query(
    expr: str, legend: str = "", ref: str = "A", instant: bool = False, rows: bool = False
) -> prometheus.Dataquery:
    """A Prometheus query; `instant` for stats and tables (one value at the range's end), `rows`
    for a table's columns (merged on their labels)."""
    built = (
        prometheus.Dataquery().expr(expr).legend_format(legend or "__auto").ref_id(ref).datasource(DATASOURCE)
    )
    if instant or rows:
        built = built.instant()
    if rows:
        built = built.format(PromQueryFormat.TABLE)
    return built


def thresholds(*steps: tuple[float | None, str]) -> dash.ThresholdsConfig:
    return (
        dash.ThresholdsConfig()
        .mode(model.ThresholdsMode.ABSOLUTE)
        .steps([model.Threshold(value=value, color=color) for value, color in steps])
    )


def states(**texts: tuple[str, str]) -> list[model.ValueMapping]:
    """Value mappings: value -> (text, colour)."""
    return [
        model.ValueMap(
            options={
                value: model.ValueMappingResult(text=text, color=color, index=i)
                for i, (value, (text, color)) in enumerate(texts.items())
            }
        )
    ]


def legend_table() -> common_builders.VizLegendOptions:
    """A legend as a table with the last and the largest value: ratios are not averaged."""
    return (
        common_builders.VizLegendOptions()
        .display_mode(common.LegendDisplayMode.TABLE)
        .placement(common.LegendPlacement.BOTTOM)
        .show_legend(True)
        .calcs(["lastNotNull", "max"])
    )


def series(
    title: str,
    description: str,
    unit: str,
    targets: Iterable[prometheus.Dataquery],
    width: int = 12,
    height: int = 8,
) -> timeseries.Panel:
    """A time series panel: one unit on its one axis, a table legend, the shared tooltip."""
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(height)
        .legend(legend_table())
        .tooltip(
            common_builders.VizTooltipOptions()
            .mode(common.TooltipDisplayMode.MULTI)
            .sort(common.SortOrder.DESCENDING)
        )
        .line_width(1)
        .fill_opacity(0)
    )
    if unit == "percentunit":
        panel = panel.min(0).max(1)
    for target in targets:
        panel = panel.with_target(target)
    return panel


def single(
    title: str,
    description: str,
    unit: str,
    target: prometheus.Dataquery,
    width: int = 6,
    height: int = 5,
) -> stat.Panel:
    """A stat: an instant query, its last value, coloured by its thresholds."""
    panel = (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(height)
        .with_target(target)
        .graph_mode(common.BigValueGraphMode.NONE)
        .color_mode(common.BigValueColorMode.VALUE)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    if unit == "percentunit":
        panel = panel.min(0).max(1).decimals(1)
    return panel


# ----------------------------------------------------------------------------- variables --------
def variable(
    name: str, label: str, query_text: str, description: str, all_value: str | None = ".*"
) -> dash.QueryVariable:
    """A multi-value variable. "All" is `all_value`, or, without one, Grafana's alternation of the
    listed values (so that `up{job=~"$job"}` counts kvlens's targets, not every job's)."""
    built = (
        dash.QueryVariable(name)
        .label(label)
        .description(description)
        .datasource(DATASOURCE)
        .query(query_text)
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(model.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
    )
    return built if all_value is None else built.all_value(all_value)


def variables(with_model: bool) -> list[cogbuilder.Builder[model.VariableModel]]:
    out: list[cogbuilder.Builder[model.VariableModel]] = [
        dash.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        variable(
            "cluster",
            "Cluster",
            "label_values(kvlens_build_info, cluster)",
            "The cluster label of a Thanos, Mimir or federated Prometheus; empty (All) with one Prometheus.",
        ),
        variable(
            "namespace",
            "Namespace",
            'label_values(kvlens_build_info{cluster=~"$cluster"}, namespace)',
            "The Kubernetes namespace; empty (All) outside Kubernetes.",
        ),
        variable(
            "job",
            "Job",
            'label_values(kvlens_build_info{cluster=~"$cluster", namespace=~"$namespace"}, job)',
            "Prometheus jobs that scrape kvlens.",
            all_value=None,
        ),
        variable(
            "instance",
            "Instance",
            'label_values(kvlens_build_info{cluster=~"$cluster", namespace=~"$namespace", job=~"$job"}, '
            "instance)",
            "One kvlens sidecar (one vLLM pod with the sidecar deployment).",
            all_value=None,
        ),
    ]
    if with_model:
        out.append(
            variable(
                "model",
                "Model",
                f"label_values(kvlens_requests_total{{{SEL}}}, model)",
                "Served model names; each latency row repeats per model.",
            )
        )
    return out


def restarts() -> dash.AnnotationQuery:
    return (
        dash.AnnotationQuery()
        .name("kvlens restarts")
        .datasource(DATASOURCE)
        .enable(True)
        .icon_color("orange")
        .expr(f"changes(process_start_time_seconds{{{SEL}}}[{RATE}]) > 0")
    )


def base(uid: str, title: str, description: str, with_model: bool) -> dash.Dashboard:
    return (
        dash.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags([TAG, "vllm", "prefix-cache"])
        .editable()
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .time("now-6h", "now")
        .refresh("30s")
        .timezone(common.TimeZoneBrowser)
        .variables(variables(with_model))
        .annotation(restarts())
        .link(
            dash.DashboardLink("kvlens dashboards")
            .type(model.DashboardLinkType.DASHBOARDS)
            .tags([TAG])
            .as_dropdown(False)
            .include_vars(True)
            .keep_time(True)
            .target_blank(False)
            .icon("external link")
            .tooltip("")
            .url("")
        )
    )


# ----------------------------------------------------------------------------- overview ---------

RECOMPUTED = "kvlens_kv_recomputed_tokens_total"
# Without KV events: records' prefix_hashes through one modelled cache per replica. Its own
# panels, titled modelled, never summed with the observed family.
MODELLED_RECOMPUTED = "kvlens_kv_modelled_recomputed_tokens_total"
LOST = causes(promql.LOST)  # reuse lost to routing or capacity
LOST_OR_NEW = causes(promql.RECOMPUTED)
# The KV-event metrics come from the kvlens that subscribes to the replicas (--kv-events), not
# from the sidecars: the fleet row selects cluster and namespace, and job/instance of that kvlens.


def why_reuse_is_lost(board: dash.Dashboard) -> dash.Dashboard:
    board = board.with_row(dash.Row("Why reuse is lost (KV events, or modelled)"))
    board = board.with_panel(
        series(
            "Recomputed prefill by cause",
            "Tokens of the blocks the replicas stored in GPU memory (work they did), stacked by why "
            "they were not reused: new (the workload), evicted_here and evicted_elsewhere "
            "(capacity), held_elsewhere (routing: another replica held them). From the engines' KV "
            "events (kvlens serve --kv-events). Per second.",
            "short",
            [
                query(
                    summed(RECOMPUTED, "cause", matchers=f"{SEL}, {LOST_OR_NEW}"),
                    "{{cause}}",
                )
            ],
            width=8,
        )
        .stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL))
        .fill_opacity(40)
    )
    board = board.with_panel(
        series(
            "Reuse lost to routing and capacity, per replica",
            "Tokens each replica recomputed although another replica held them (held_elsewhere: "
            "routing), or it or another had held them (evicted_here, evicted_elsewhere: capacity). "
            "Per second.",
            "short",
            [
                query(
                    summed(RECOMPUTED, "replica", "cause", matchers=f"{SEL}, {LOST}"),
                    "{{replica}} {{cause}}",
                )
            ],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Reachable vs delivered token reuse",
            "Per namespace: delivered token reuse (records) beside the reachable one, the reused "
            "tokens plus those recomputed although the fleet had cached them. The gap is what "
            "routing and capacity lose.",
            "percentunit",
            [
                query(
                    promql.REACHABLE_REUSE.on_dashboard(),
                    "{{namespace}} reachable",
                    "A",
                ),
                query(promql.NAMESPACE_REUSE.on_dashboard(), "{{namespace}} delivered", "B"),
            ],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Recomputed prefill lost to routing and to capacity",
            "Per namespace, the shares of recomputed prefill that another replica held (routing) "
            "or that had been evicted (capacity); the rest is new work. The routing share of the "
            "reusable tokens is what KVLensReuseLostToRouting compares with 20 %.",
            "percentunit",
            [
                query(
                    promql.ROUTING_LOSS.on_dashboard(),
                    "{{namespace}} routing",
                    "A",
                ),
                query(
                    promql.CAPACITY_LOSS.on_dashboard(),
                    "{{namespace}} capacity",
                    "B",
                ),
                query(
                    promql.ROUTING_SHARE_OF_REUSABLE.on_dashboard(),
                    "{{namespace}} routing, share of reusable (the alert's)",
                    "C",
                ),
            ],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Blocks held per replica",
            "Blocks each replica holds now, by medium (GPU and offload tiers).",
            "short",
            [query(f"sum by (replica, medium) (kvlens_kv_blocks_held{{{SEL}}})", "{{replica}} {{medium}}")],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Duplicated blocks (fleet)",
            "Holdings beyond the first of each block: KV memory spent holding the same prefix on "
            "several replicas.",
            "short",
            [query(f'sum(kvlens_kv_fleet_blocks{{{SEL}, kind="duplicated"}})', "duplicated")],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "KV event trouble",
            "Per second: batches lost in gaps no replay repaired, publisher restarts, events rejected "
            "by reason.",
            "cps",
            [
                query(
                    summed("kvlens_kv_missed_batches_total", "replica"),
                    "missed {{replica}}",
                    "A",
                ),
                query(
                    summed("kvlens_kv_publisher_restarts_total", "replica"),
                    "restarts {{replica}}",
                    "B",
                ),
                query(
                    summed("kvlens_kv_events_rejected_total", "reason"),
                    "rejected: {{reason}}",
                    "C",
                ),
            ],
            width=12,
        )
    )
    board = board.with_panel(
        series(
            "Block index memory",
            "Estimated memory of kvlens's fleet block index (entries times measured bytes per "
            "entry), per kvlens process (shards add up).",
            "bytes",
            [query(f"sum by ({SIDECAR}) (kvlens_kv_index_memory_bytes{{{SEL}}})", "{{instance}}")],
            width=12,
        )
    )
    return modelled_causes(board)


def modelled_causes(board: dash.Dashboard) -> dash.Dashboard:
    """The same causes without KV events (modelled_capacity_blocks): a model, so apart."""
    board = board.with_panel(
        series(
            "Recomputed prefill by cause (modelled)",
            "MODELLED, not observed: records' prefix_hashes (a gateway's, with replica) through one "
            "modelled cache of modelled_capacity_blocks per replica, stacked by cause as above. "
            "For fleets without KV events; never add it to the observed panels. Per second.",
            "short",
            [
                query(
                    summed(MODELLED_RECOMPUTED, "cause", matchers=f"{SEL}, {LOST_OR_NEW}"),
                    "{{cause}} (modelled)",
                )
            ],
            width=8,
        )
        .stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL))
        .fill_opacity(40)
    )
    board = board.with_panel(
        series(
            "Reuse lost to routing and capacity, per replica (modelled)",
            "MODELLED, not observed: the tokens each replica's modelled cache recomputed although "
            "another modelled replica held them (held_elsewhere: routing) or they had been evicted "
            "(evicted_here, evicted_elsewhere: capacity). Per second.",
            "short",
            [
                query(
                    summed(MODELLED_RECOMPUTED, "replica", "cause", matchers=f"{SEL}, {LOST}"),
                    "{{replica}} {{cause}} (modelled)",
                )
            ],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Records modelled and left out (modelled)",
            "Records with prefix_hashes that fed the modelled caches, and those left out: no "
            "replica, another block_size than modelled_block_size, a replica past "
            "modelled_max_replicas. Left-out records make the modelled causes partial. Per second.",
            "reqps",
            [
                query(
                    summed("kvlens_kv_modelled_records_total", "outcome"),
                    "{{outcome}}",
                )
            ],
            width=8,
        )
    )
    return board


def overview() -> dash.Dashboard:
    range_hit = hit_ratio(RANGE)
    range_reuse = ratio(*REUSE, window=RANGE)
    board = base(
        "kvlens-overview",
        "kvlens: is the prefix cache paying off?",
        "Request hit ratio, token reuse and modelled compute saved side by side; per pod; latency per "
        "model by prompt length, hit beside miss; reconciliation with the engine's counters.",
        with_model=True,
    )
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
                summed("kvlens_requests_total", "model", matchers=MODEL, window=RANGE) + " / $__range_s",
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

    latency = (
        "Quantiles of this model by prompt length and hit status, each from its own summed buckets. "
        "At equal prompt length a hit should be faster than a miss"
    )
    board = board.with_row(
        dash.Row("Latency of $model: hit beside miss at equal prompt length").repeat("model")
    )
    one_model = MODEL
    board = board.with_panel(latency_table(one_model))
    for metric, name, extra in (
        ("kvlens_ttft_seconds", "TTFT", "; the prefix cache shortens prefill, not queueing."),
        ("kvlens_queue_seconds", "Queue", ": time waiting before scheduling."),
        ("kvlens_prefill_seconds", "Prefill", ": first scheduled to first token, what the cache saves."),
        ("kvlens_e2e_seconds", "End-to-end", ": the whole request, decode included."),
    ):
        board = board.with_panel(
            series(
                f"{name} p50 and p95 by prompt length, hit vs miss",
                latency + extra,
                "s",
                [
                    query(quantile(0.95, metric, one_model), "{{prompt_len}} {{cache}} p95", "A"),
                    query(quantile(0.5, metric, one_model), "{{prompt_len}} {{cache}} p50", "B"),
                ],
                width=8,
            )
        )
    board = board.with_panel(
        series(
            "TTFT decomposition",
            "Share of this model's TTFT spent queueing, in prefill, and elsewhere (ttft - queue - "
            "prefill). When queueing dominates, a faster prefill barely moves TTFT.",
            "percentunit",
            [
                query(
                    summed("kvlens_ttft_component_seconds_total", "model", "component", matchers=one_model)
                    + " / ignoring (component) group_left "
                    + summed("kvlens_ttft_component_seconds_total", "model", matchers=one_model),
                    "{{component}}",
                )
            ],
            width=8,
        )
        .stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL))
        .fill_opacity(40)
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
                f"sum by (le) (increase(kvlens_request_reuse_ratio_bucket{{{one_model}}}[{RATE}]))", "{{le}}"
            ).format(PromQueryFormat.HEATMAP)
        )
        .unit("short")  # the cells: requests per rate interval
        .calculate(False)
        .y_axis(heatmap.YAxisConfig().unit("percentunit"))
        .color(heatmap.HeatmapColorOptions().mode(HeatmapColorMode.SCHEME).scheme("Oranges").steps(64))
        .cell_values(heatmap.CellValues().unit("short"))
        .show_legend()
    )

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
                        f"kvlens_engine_prefix_cache_hit_tokens_total{{{MODEL}}}",
                        f"kvlens_engine_prefix_cache_queried_tokens_total{{{MODEL}}}",
                        by="model",
                    ),
                    "{{model}} engine local prefix cache",
                    "C",
                ),
            ],
            width=24,
        )
    )
    board = why_reuse_is_lost(board)

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
                    summed("kvlens_saved_prefill_seconds_total", "model", matchers=MODEL),
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
            [query(f"max by (model) (kvlens_w4a16_decode_speedup{{{MODEL}}})", "{{model}}")],
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Weights' share of decode traffic",
            "Modelled share of decode memory traffic that is weights, W / (W + B*K). Long contexts and "
            "big batches make KV reads dominate: quantizing weights then saves memory but little time.",
            "percentunit",
            [query(f"max by (model) (kvlens_decode_weight_share{{{MODEL}}})", "{{model}}")],
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
        expr = quantile(
            q, "kvlens_ttft_seconds", f'{selection}, cache="{cache}"', window=RANGE, by="prompt_len"
        )
        panel = panel.with_target(
            query(f'label_replace({expr}, "length_from", "$1", "prompt_len", `(\\d+).*`)', ref=ref, rows=True)
        )
    return panel


# ------------------------------------------------------------------------------ sidecar ---------
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
            query(f"kvlens_upstream_up{{{SEL}}}", "{{instance}} → {{target}}", instant=True),
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
            query(f"max(kvlens_ingest_open{{{SEL}}})", instant=True),
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
            query(f"kvlens_tail_checkpoint_ok{{{SEL}}}", "{{instance}} {{path}}", instant=True),
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
            query(f"sum(increase(kvlens_collector_errors_total{{{SEL}}}[{RANGE}]))", instant=True),
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
            [query(summed("kvlens_records_received_total", "source"), "{{source}}")],
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
                    summed("kvlens_records_rejected_total", "source", "reason"),
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
                        selector("kvlens_records_rejected_total", SEL),
                        selector("kvlens_records_received_total", SEL),
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
            "Records the plugin dropped before delivery, and records whose model was folded into "
            "other by the label cap, per second.",
            "cps",
            [
                query(
                    summed("kvlens_records_dropped_total", "source"),
                    "dropped {{source}}",
                    "A",
                ),
                query(f"sum(rate(kvlens_series_overflow_total{{{SEL}}}[{RATE}]))", "folded into other", "B"),
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
            [query(summed("kvlens_ingest_refused_total", "reason"), "{{reason}}")],
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
                    f"histogram_quantile(0.99, sum by ({SIDECAR}, le) "
                    f"(rate(kvlens_event_loop_lag_seconds_bucket{{{SEL}}}[{RATE}])))",
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
                    summed("kvlens_collector_errors_total", *promql.SIDECAR),
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
            [query(f"sum by ({SIDECAR}) (kvlens_connections_open{{{SEL}}})", "{{instance}}")],
        )
    )
    board = board.with_panel(
        series(
            "Connections closed by the sidecar",
            "Connections closed per second: no whole request head in time, or evicted past max_connections.",
            "cps",
            [query(summed("kvlens_connections_closed_total", "reason"), "{{reason}}")],
        )
    )
    return board


# ------------------------------------------------------------------------------ output ----------
DASHBOARDS = {"kvlens-overview.json": overview, "kvlens-sidecar.json": sidecar}


def number_panels(document: dict[str, Any]) -> dict[str, Any]:
    """Ids in layout order (Grafana needs them unique; the builders leave them unset)."""
    for number, panel in enumerate(document["panels"], start=1):
        panel["id"] = number
    return document


def build(name: str) -> dict[str, Any]:
    document = json.loads(json.dumps(DASHBOARDS[name]().build(), cls=JSONEncoder))
    return number_panels(document)


def render(name: str = "kvlens-overview.json") -> str:
    return json.dumps(build(name), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    for file_name in DASHBOARDS:
        (OUT / file_name).write_text(render(file_name))
