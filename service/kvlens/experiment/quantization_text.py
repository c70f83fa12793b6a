"""The quantization report for a terminal (80 columns) and for ``report.md``: experiment 1 per
endpoint and context group, with throughput, the ITL ratios beside the byte model's and what each
gain came from; then experiment 2 per rate, the highest rates and why. It renders the report
:func:`kvlens.experiment.quantization_report.merged` builds, and computes nothing of its own."""

from __future__ import annotations

from typing import Any

from kvlens.terminal import NARROWEST, visible, wrap, wrapped


def text(result: dict[str, Any]) -> str:
    """The report for a terminal (80 columns): experiment 1 per endpoint and context group, then
    experiment 2 per rate, the highest rates and what the gain came from."""

    lines = [f"# kvlens quantization (baseline: {result['baseline']})", ""]
    fixed = result.get("fixed_work")
    if fixed:
        lines += ["Experiment 1, fixed work (ms, medians)", ""]
        columns = "".join(f"{heading:>10}" for heading in ("TTFT", "ITL p50", "ITL p99", "e2e"))
        lines.append(f"{'endpoint':<12}{'context':<8}{'requests':>9}{columns}")
        for name, groups in fixed.items():
            for group, stats in groups.items():
                lines.append(
                    f"{name[:11]:<12}{group:<8}{stats['requests']:>9}{_ms(stats['ttft_p50_seconds']):>10}"
                    f"{_ms(stats['itl_p50_seconds']):>10}{_ms(stats['itl_p99_seconds_median']):>10}"
                    f"{_ms(stats['e2e_p50_seconds']):>10}"
                )
        lines.append("")
        lines += percentile_lines(
            "Experiment 1 by percentile of the requests (ms)",
            [
                (f"{name[:11]:<12}{group:<7}", stats)
                for name, groups in fixed.items()
                for group, stats in groups.items()
            ],
            result,
        )
        lines += fixed_work_lines(result)
    load = result.get("rising_load")
    if load:
        targets = result["targets"]
        lines += wrap(
            f"Experiment 2, rising load (targets: TTFT <= {targets['ttft_seconds']:g} s, "
            f"ITL mean <= {targets['tpot_seconds'] * 1000:g} ms, {targets['attainment']:.0%} of requests)",
            NARROWEST,
        )
        lines += [
            "",
            f"{'endpoint':<12}{'req/s':>7}{'attain':>8}{'goodput':>9}{'TTFT p50':>10}"
            f"{'KV max':>8}{'reuse':>8}",
        ]
        for name, steps in load["steps"].items():
            for step in steps:
                usage, reuse = step["engine_kv_usage_max"], step["engine_token_reuse"]
                lines.append(
                    f"{name[:11]:<12}{step['rate']:>7g}{step['attainment']:>8.0%}{step['goodput_rps']:>9.2f}"
                    f"{_ms(step['ttft_p50_seconds']):>10}{'-' if usage is None else f'{usage:.0%}':>8}"
                    f"{'-' if reuse is None else f'{reuse:.0%}':>8}"
                )
        lines.append("")
        lines += percentile_lines(
            "Experiment 2 by percentile of the requests (ms)",
            [
                (f"{name[:11]:<12}{step['rate']:<7g}", step)
                for name, steps in load["steps"].items()
                for step in steps
            ],
            result,
        )
        sweep = load.get("sweep")
        if sweep:
            middles = ", ".join(f"{rate:g}" for rate in sweep["bisected"]) or "none"
            lines += [
                f"Sweep from {sweep['start']:g} req/s: {sweep['stopped']}; halfway steps: {middles}",
                "",
            ]
        unbounded = (sweep or {}).get("never_fell_under", [])
        for name, rate in load["highest_rate"].items():
            lines += wrap(
                f"{name}: highest rate meeting the targets: {'none' if rate is None else f'{rate:g} req/s'}"
                + (" (never fell under: a lower bound)" if name in unbounded else ""),
                NARROWEST,
            )
        lines += step_lines(result)
        lines += wrapped(load["attribution"], NARROWEST)
    # the endpoints' names are the user's: a control character in one is shown, never obeyed
    return "\n".join(map(visible, lines)) + "\n"


# The metrics of a row's latency_percentiles, as the table names them
_PERCENTILE_METRICS = (("ttft_seconds", "TTFT"), ("tpot_seconds", "TPOT"), ("e2e_seconds", "e2e"))
_PERCENTILE_WIDTH = 8


def percentile_lines(title: str, rows: list[tuple[str, dict[str, Any]]], result: dict[str, Any]) -> list[str]:
    """A table of TTFT, TPOT (a request's mean inter-token latency) and e2e at each of the
    report's percentiles (--percentiles), one row per labelled row and metric; past 80 columns
    the percentiles go on in a second block of columns."""
    names = [f"p{q:g}" for q in result.get("percentiles") or []]
    if not names or not any("latency_percentiles" in row for _, row in rows):
        return []
    label_width = max(len(label) for label, _ in rows) + 5
    per_block = max(1, (NARROWEST - label_width) // _PERCENTILE_WIDTH)
    lines = [title, ""]
    for start in range(0, len(names), per_block):
        shown = names[start : start + per_block]
        lines.append(" " * label_width + "".join(f"{name:>{_PERCENTILE_WIDTH}}" for name in shown))
        for label, row in rows:
            values = row.get("latency_percentiles") or {}
            for metric, heading in _PERCENTILE_METRICS:
                cells = (values.get(metric) or {}).get
                lines.append(
                    f"{label}{heading:<5}"
                    + "".join(f"{_ms(cells(name)):>{_PERCENTILE_WIDTH}}" for name in shown)
                )
        lines.append("")
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def fixed_work_lines(result: dict[str, Any]) -> list[str]:
    """Experiment 1's throughput, ITL ratios beside the byte model's, and what each gain came
    from; the groups not measured."""
    fixed, baseline = result.get("fixed_work") or {}, result["baseline"]
    lines: list[str] = []
    for name, groups in fixed.items():
        for group, stats in groups.items():
            rate = stats.get("output_tokens_per_second")
            measured, predicted = stats.get("measured_itl_ratio"), stats.get("predicted_itl_ratio")
            line = f"{name} {group}: {'-' if rate is None else f'{rate:,.0f}'} output tokens/s"
            if name != baseline:
                line += (
                    f"; ITL {baseline}/{name} {'-' if measured is None else f'{measured:.2f}x'} measured, "
                    + (
                        "byte model: not given (--weight-bytes, --bandwidth, --kv-bytes-per-token)"
                        if predicted is None
                        else f"{predicted:.2f}x by the byte model (step "
                        f"{stats['predicted_step_seconds'] * 1000:.2f} ms)"
                    )
                )
                gain = stats.get("gain_over_baseline")
                if gain:
                    line += f"; {gain['verdict']}: {'; '.join(gain['reasons'])}"
            lines += wrap(line, NARROWEST)
    for note in result.get("not_measured") or []:
        lines += wrap(note, NARROWEST)
    return [*lines, ""] if lines else []


def step_lines(result: dict[str, Any]) -> list[str]:
    """Experiment 2: per rate, output tokens/s and the scheduler's figures of each endpoint, and
    what each endpoint gained over the baseline, with the figures that decide it."""
    load, baseline = result.get("rising_load") or {}, result["baseline"]
    lines: list[str] = []
    for name, steps in (load.get("steps") or {}).items():
        for step in steps:
            rate = step.get("output_tokens_per_second")
            running, waiting = step.get("engine_running_p95"), step.get("engine_waiting_mean")
            preempted = step.get("engine_preemptions")
            line = (
                f"{name} at {step['rate']:g} req/s: {'-' if rate is None else f'{rate:,.0f}'} "
                "output tokens/s, "
                f"running p95 {'-' if running is None else f'{running:.0f}'}, waiting "
                f"{'-' if waiting is None else f'{waiting:.1f}'} on average, "
                f"{'-' if preempted is None else f'{preempted:.0f}'} preempted"
            )
            gain = (step.get("gain_over") or {}).get(baseline) if name != baseline else None
            if gain:
                line += f"; over {baseline}: {gain['verdict']}: {'; '.join(gain['reasons'])}"
            lines += wrap(line, NARROWEST)
    return [*lines, ""] if lines else []
