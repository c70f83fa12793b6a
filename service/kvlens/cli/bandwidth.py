"""``kvlens bandwidth``: the decode traffic model, would W4A16 speed up decode?"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from kvlens import limits, terminal
from kvlens.cli import SUMMARIES
from kvlens.cli.common import examples


def add_parser(commands: Any) -> None:
    decode = commands.add_parser(
        "bandwidth",
        help=SUMMARIES["bandwidth"],
        epilog=examples(
            "kvlens bandwidth --params 8B --layers 32 --kv-heads 8 --head-dim 128 --bandwidth 4.8TB/s",
            "kvlens bandwidth --weight-bytes 14GiB --quantized-weight-bytes 4GiB "
            "--kv-bytes-per-sequence 1GiB --bandwidth 4.8TB/s --json",
            "kvlens bandwidth --measured decode_h200.csv",
        ),
    )
    shape = decode.add_argument_group("model shape: a config.json, the numbers, or the KV bytes directly")
    shape.add_argument("--config-json", type=Path, metavar="FILE", help="a Hugging Face config.json")
    shape.add_argument("--layers", type=int, help="decoder layers")
    shape.add_argument("--kv-heads", type=int, help="key-value heads per layer")
    shape.add_argument("--head-dim", type=int, help="values per head")
    shape.add_argument("--kv-dtype-bytes", type=float, default=None, help="bytes per KV value (default: 2)")
    shape.add_argument(
        "--kv-bytes-per-sequence", help="K: KV bytes one sequence holds at --context, e.g. 1GiB"
    )
    size = decode.add_mutually_exclusive_group()
    size.add_argument("--params", help="parameter count, e.g. 8B (16-bit weights: 2 bytes each)")
    size.add_argument("--weight-bytes", help="16-bit weight bytes, e.g. 14GiB")
    decode.add_argument(
        "--quantized-weight-bytes",
        help="quantized weight bytes, e.g. 4GiB (instead of --bits, --group-size, --quantized-fraction)",
    )
    decode.add_argument("--bits", type=int, default=4, choices=(4, 8), help="quantized weight bits")
    decode.add_argument("--group-size", type=int, default=128, help="weights per 16-bit scale")
    decode.add_argument("--quantized-fraction", type=float, default=0.9, help="share of weights quantized")
    decode.add_argument("--bandwidth", help="memory bandwidth, e.g. 4.8TB/s or 1TiB/s")
    decode.add_argument(
        "--batch",
        default=None,
        help="batch sizes, comma-separated (default: 1,8,32; with --measured: the CSV's)",
    )
    decode.add_argument("--context", default="8192", help="context lengths in tokens, comma-separated")
    decode.add_argument("--compute-floor-ms", type=float, default=0.0, help="a compute-bound floor per step")
    decode.add_argument("--extra-ms", type=float, default=0.0, help="extra time per quantized step")
    decode.add_argument(
        "--measured",
        type=Path,
        metavar="CSV",
        help="measured step times (columns of decode_h200.csv): fit t0 + bytes/BW per path instead",
    )
    decode.add_argument(
        "--json", action="store_true", help="print the result as JSON (schema kvlens.bandwidth/v1)"
    )
    decode.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:

    try:
        result = _bandwidth_measured(args) if args.measured else _bandwidth_model(args)
    except (ValueError, OSError) as error:  # bw.CannotFit and UnsupportedModel are ValueErrors
        print(f"kvlens bandwidth: {error}", file=sys.stderr)
        return 2
    result = _rounded(result)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        columns = terminal.width()
        print(
            _measured_text(result, columns) if args.measured else _model_text(result, args.bits, columns),
            end="",
        )
    return 0


MODEL_SCHEMA = "kvlens.bandwidth/v1"
MEASURED_SCHEMA = "kvlens.bandwidth.measured/v1"
# Quantities that count something (bytes, tokens, sequences, steps): whole numbers in the JSON.
COUNTS = frozenset(
    {"kv_bytes_per_token", "weight_bytes_16", "weight_bytes_quantized", "bandwidth_bytes_per_second",
     "weight_bytes", "batch", "context_tokens", "measured_steps"}
)  # fmt: skip
SIGNIFICANT_DIGITS = 6  # the inputs (a bandwidth, a weight size) are rarely known better


def _rounded(value: Any, key: str = "") -> Any:
    """Counts as integers, other numbers to 6 significant digits: a byte model's 5312499999.999999
    bytes are 5312500000, its 0.0011184810666666667 s are 0.00111848."""
    if isinstance(value, dict):
        return {k: _rounded(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v, key) for v in value]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    if key in COUNTS:
        return round(value)
    return float(f"{value:.{SIGNIFICANT_DIGITS}g}")


def _batches(args: argparse.Namespace, default: str) -> list[int]:
    return [int(b) for b in (args.batch or default).split(",")]


def _bandwidth_model(args: argparse.Namespace) -> dict[str, Any]:
    """The byte model of article 2 for the given shape, sizes and bandwidth."""
    from kvlens import bandwidth as bw
    from kvlens import shapes

    if not (args.params or args.weight_bytes) or not args.bandwidth:
        raise ValueError("give --params or --weight-bytes, and --bandwidth (or --measured CSV)")
    contexts = [float(c) for c in args.context.split(",")]
    if args.kv_bytes_per_sequence:
        if len(contexts) > 1:
            raise ValueError("--kv-bytes-per-sequence is K at one --context")
        kv_per_token = limits.parse_size(args.kv_bytes_per_sequence) / contexts[0]
    elif args.config_json:
        shape = shapes.from_hf_config(json.loads(args.config_json.read_text()))
        if args.kv_dtype_bytes:
            shape = dataclasses.replace(shape, kv_dtype_bytes=args.kv_dtype_bytes)
        kv_per_token = shape.kv_bytes_per_token
    elif args.layers and args.kv_heads and args.head_dim:
        shape = shapes.ModelShape(args.layers, args.kv_heads, args.head_dim, args.kv_dtype_bytes or 2)
        kv_per_token = shape.kv_bytes_per_token
    else:
        raise ValueError("give --config-json, --layers/--kv-heads/--head-dim, or --kv-bytes-per-sequence")
    if args.weight_bytes:
        weights_16 = limits.parse_size(args.weight_bytes)
    else:
        weights_16 = 2 * bw.parse_count(args.params)
    if args.quantized_weight_bytes:
        weights_q = limits.parse_size(args.quantized_weight_bytes)
    else:
        weights_q = weights_16 * bw.quantized_weight_ratio(
            args.quantized_fraction, args.bits, args.group_size
        )
    bandwidth = bw.parse_bandwidth(args.bandwidth)
    steps = [
        bw.compare_step(
            weight_bytes_16=weights_16,
            weight_bytes_q=weights_q,
            kv_bytes_per_token_=kv_per_token,
            batch=batch,
            context_tokens=context,
            bandwidth=bandwidth,
            compute_floor=args.compute_floor_ms / 1000,
            extra_q=args.extra_ms / 1000,
        )
        for context in contexts
        for batch in _batches(args, "1,8,32")
    ]
    return {
        "schema": MODEL_SCHEMA,
        "kv_bytes_per_token": kv_per_token,
        "weight_bytes_16": weights_16,
        "weight_bytes_quantized": weights_q,
        "weight_ratio": weights_q / weights_16,
        "bandwidth_bytes_per_second": bandwidth,
        "break_even_extra_seconds": bw.break_even_extra_seconds(weights_16, weights_q, bandwidth),
        "upper_bound": True,  # the byte model: a real kernel reaches at most this (see --measured)
        "steps": [
            {
                "batch": step.batch,
                "context_tokens": step.context_tokens,
                "step_seconds_16": step.seconds_16,
                "step_seconds_quantized": step.seconds_q,
                "speedup": step.speedup,
                "tokens_per_second_16": step.throughput_16,
                "tokens_per_second_quantized": step.throughput_q,
                "weight_share_16": bw.weight_share(
                    weights_16, step.batch, bw.kv_bytes_per_sequence(step.context_tokens, kv_per_token)
                ),
            }
            for step in steps
        ],
    }


def _model_text(result: dict[str, Any], bits: int, columns: int) -> str:
    gib = 1024**3
    lines = terminal.wrapped(
        [
            f"weights {result['weight_bytes_16'] / gib:.2f} GiB -> "
            f"{result['weight_bytes_quantized'] / gib:.2f} GiB ({1 / result['weight_ratio']:.2f}x smaller), "
            f"KV {result['kv_bytes_per_token'] / 1024:.0f} KiB/token; "
            "quantization pays while its extra time per step is under "
            f"{result['break_even_extra_seconds'] * 1000:.2f} ms",
            "the byte model: an upper bound a bandwidth-bound kernel approaches (--measured CSV for yours)",
        ],
        columns,
    )
    lines.append(
        f"{'batch':>5} {'context':>8} {'16-bit ms':>9} {'W' + str(bits) + ' ms':>8} {'speedup':>7} "
        f"{'tok/s 16-bit':>12} {'tok/s W' + str(bits):>9} {'W share':>7}"
    )
    lines += [
        f"{row['batch']:>5} {row['context_tokens']:>8} {row['step_seconds_16'] * 1000:>9.2f} "
        f"{row['step_seconds_quantized'] * 1000:>8.2f} {row['speedup']:>6.2f}x "
        f"{row['tokens_per_second_16']:>12.1f} {row['tokens_per_second_quantized']:>9.1f} "
        f"{row['weight_share_16']:>7.1%}"
        for row in result["steps"]
    ]
    lines.append("W share: the weights' share of a 16-bit step's bytes")
    return "\n".join(lines) + "\n"


def _bandwidth_measured(args: argparse.Namespace) -> dict[str, Any]:
    """Fit ``t0 + bytes / BW_eff`` per path to measured steps and compare the paths."""
    from kvlens import bandwidth as bw

    fits = bw.fit_paths(bw.read_measured(args.measured))
    return {
        "schema": MEASURED_SCHEMA,
        **bw.measured_comparison(fits, _batches(args, "") if args.batch else ()),
    }


def _measured_text(result: dict[str, Any], columns: int) -> str:
    lines = [
        f"path {p['path']}: step = {p['t0_seconds'] * 1000:.3f} ms + bytes / "
        f"{p['bandwidth_bytes_per_second'] / 1e12:.2f} TB/s ({p['measured_steps']} measured steps)"
        for p in result["paths"]
    ]
    for c in result["comparisons"]:
        lines.append(
            f"{c['path']} vs {result['baseline']}: pays while its extra time per step is under "
            f"{c['break_even_extra_seconds'] * 1000:.3f} ms ((W16 - Wq) / BW_eff of {result['baseline']})"
        )
        lines.append(f"{'batch':>6} {'context':>8} {'measured':>9} {'fitted':>7} {'bytes bound':>12} "
                     f"{'extra ms':>9} {'pays':>5}")  # fmt: skip
        for r in c["rows"]:
            measured = "-" if r["measured_speedup"] is None else f"{r['measured_speedup']:.2f}x"
            lines.append(
                f"{r['batch']:>6} {r['context_tokens']:>8} {measured:>9} {r['fitted_speedup']:>6.2f}x "
                f"{r['bytes_upper_bound']:>11.2f}x {r['extra_seconds'] * 1000:>9.3f} "
                f"{'yes' if r['pays'] else 'no':>5}"
            )
        if c["limited_by"] == "kernel":
            lines.append(
                f"the {c['path']} kernel, not the bytes, limits the gain: it moves bytes at "
                f"{c['bandwidth_share_of_16_bit']:.0%} of {result['baseline']}'s bandwidth, so the byte "
                "model's speedup is an upper bound it does not reach"
            )
        else:
            lines.append(
                f"{c['path']} moves its bytes about as fast as {result['baseline']}: the bytes decide"
            )
    return "\n".join(terminal.wrapped(lines, columns)) + "\n"
