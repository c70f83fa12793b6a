"""The PromQL idioms the recording rules and the dashboards share (kvlens.exporter.promql)."""

from __future__ import annotations

from kvlens.exporter import metrics, promql
from kvlens.fleet.causes import CAUSES


def test_cause_groups_split_the_fleet_index_causes_once_each() -> None:
    """A cause added to the fleet index must be placed in a group (or left out on purpose)."""
    grouped = [*promql.WORKLOAD, *promql.ROUTING, *promql.CAPACITY, *promql.NOT_COUNTED]
    assert sorted(grouped) == sorted(CAUSES)
    assert promql.LOST == ("held_elsewhere", "evicted_here", "evicted_elsewhere")
    assert promql.causes(promql.ROUTING) == 'cause="held_elsewhere"'
    assert promql.causes(promql.RECOMPUTED) == 'cause=~"new|held_elsewhere|evicted_here|evicted_elsewhere"'


def test_a_ratio_is_a_ratio_of_sums_on_one_line_or_as_a_rule_file_writes_it() -> None:
    one_line = promql.ratio("a_total", "b_total", "5m", ("cluster", "model"))
    assert (
        one_line
        == "sum by (cluster, model) (rate(a_total[5m])) / sum by (cluster, model) (rate(b_total[5m]))"
    )
    assert promql.ratio("a_total", "b_total", "5m", ("cluster", "model"), multiline=True) == one_line.replace(
        " / ", "\n  / "
    )
    assert promql.ratio("a_total", "b_total", promql.RANGE) == (
        "sum (increase(a_total[$__range])) / sum (increase(b_total[$__range]))"
    )


def test_the_hit_ratio_is_the_same_expression_in_both_layouts() -> None:
    one_line = promql.hit_ratio("6h", ("namespace",), 'job=~"$job"')
    assert one_line == (
        '(sum by (namespace) (rate(kvlens_requests_total{job=~"$job", cache="hit"}[6h])) '
        'or 0 * sum by (namespace) (rate(kvlens_requests_total{job=~"$job"}[6h]))) '
        '/ sum by (namespace) (rate(kvlens_requests_total{job=~"$job"}[6h]))'
    )
    multiline = promql.hit_ratio("6h", ("namespace",), 'job=~"$job"', multiline=True)
    assert multiline.startswith("(\n  sum by (namespace)")
    assert "".join(multiline.split()) == "".join(one_line.split())


def test_a_rule_on_a_dashboard_selects_every_label_its_level_keeps() -> None:
    assert promql.NAMESPACE_MODEL_HIT_6H.on_dashboard() == (
        "namespace_model:kvlens_request_hit_ratio:ratio_rate6h"
        '{cluster=~"$cluster", namespace=~"$namespace", job=~"$job", model=~"$model"}'
    )
    records = [rule.record for rules in promql.RULE_GROUPS.values() for rule in rules]
    assert len(records) == len(set(records)) == 24


def test_a_quantile_of_a_per_model_histogram_keeps_the_model_by_construction() -> None:
    """An 8B and a 70B model make no one quantile: `model` is kept even where a caller leaves it out."""
    assert promql.quantile(0.95, metrics.TTFT, 'job=~"$job"', "5m", ("prompt_len",)) == (
        "histogram_quantile(0.95, sum by (model, prompt_len, le) "
        '(rate(kvlens_ttft_seconds_bucket{job=~"$job"}[5m])))'
    )
    assert promql.quantile(0.99, metrics.LOOP_LAG, "", "5m", ("instance",)) == (
        "histogram_quantile(0.99, sum by (instance, le) (rate(kvlens_event_loop_lag_seconds_bucket[5m])))"
    )


def test_compute_saved_is_one_ratio_per_unit_never_added_across_units() -> None:
    per_model = promql.compute_saved("5m", ("model",))
    assert per_model.count(" or ") == len(metrics.WORK) - 1
    fleet = promql.compute_saved("5m")
    assert [f'"unit", "{unit}"' in fleet for unit in metrics.WORK] == [True] * len(metrics.WORK)
    assert "+" not in per_model + fleet


def test_a_label_matcher_of_one_value_or_several_or_none_of_them() -> None:
    assert promql.one_of("reason", ("busy",)) == 'reason="busy"'
    assert promql.one_of("reason", ("busy", "displaced"), negate=True) == 'reason!~"busy|displaced"'
    assert promql.one_of("reason", ("busy",), negate=True) == 'reason!="busy"'
