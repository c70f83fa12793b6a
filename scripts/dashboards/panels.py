"""The Grafana building blocks every kvlens dashboard uses, on grafana-foundation-sdk's typed
builders: a query, a time series, a stat, thresholds and value mappings, the variables, the restart
annotation and the dashboard's frame.

The "All" of `cluster` and `namespace` is `.*`, which also matches a label a setup does not have
(one Prometheus without a `cluster` label, Docker without `namespace`), so the same dashboard
serves a single Prometheus and a Thanos or Mimir holding many clusters. The "All" of `job` and
`instance` is the list of kvlens's own (from `kvlens_build_info`), so that `up` counts kvlens's
targets only, not a vLLM job's or any other.
"""

from __future__ import annotations

from collections.abc import Iterable

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from kvlens.exporter import metrics, promql
from scripts.dashboards.queries import RATE, SEL, series_of

DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
TAG = "kvlens"


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


def stacked(panel: timeseries.Panel) -> timeseries.Panel:
    """Series stacked and filled: parts of one whole (causes, TTFT components)."""
    return panel.stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL)).fill_opacity(40)


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
    def narrowed(*above: str) -> str:
        """kvlens's own series (its build info) on the variables above this one."""
        return promql.selector(metrics.BUILD_INFO.exposed_name, promql.variables(above))

    out: list[cogbuilder.Builder[model.VariableModel]] = [
        dash.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        variable(
            "cluster",
            "Cluster",
            f"label_values({narrowed()}, cluster)",
            "The cluster label of a Thanos, Mimir or federated Prometheus; empty (All) with one Prometheus.",
        ),
        variable(
            "namespace",
            "Namespace",
            f"label_values({narrowed('cluster')}, namespace)",
            "The Kubernetes namespace; empty (All) outside Kubernetes.",
        ),
        variable(
            "job",
            "Job",
            f"label_values({narrowed('cluster', 'namespace')}, job)",
            "Prometheus jobs that scrape kvlens.",
            all_value=None,
        ),
        variable(
            "instance",
            "Instance",
            f"label_values({narrowed('cluster', 'namespace', 'job')}, instance)",
            "One kvlens sidecar (one vLLM pod with the sidecar deployment).",
            all_value=None,
        ),
    ]
    if with_model:
        out.append(
            variable(
                "model",
                "Model",
                f"label_values({series_of(metrics.REQUESTS)}, model)",
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
    """A kvlens dashboard's frame: uid, tags, variables, the restart annotation, the link to the
    other kvlens dashboards (by tag, keeping the time and the variables)."""
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
