"""The decode traffic model of weight-only quantization (seed article 2, DESIGN section 1).

Each decode step of a dense model reads every weight once and every running sequence's KV
history: ``bytes per step ~ W + B*K`` with ``K = S*c``. Quantizing weights (W4A16: 4-bit
weights, 16-bit activations) shrinks only ``W``, so its speedup ``(W16 + B*K) / (W4 + B*K)``
tends to 1 as the batch or the context grows. A step takes at least
``max(bytes / bandwidth, compute floor)``, plus any extra time the quantized kernels add
(dequantization not hidden behind memory traffic); quantization pays only while that extra is
under ``(W16 - W4) / bandwidth``.

The byte model is an upper bound: a real quantized kernel may move its bytes far slower than the
16-bit one (an H200 with PyTorch's int4 tinygemm: 1.36x at batch 1 where the bytes promise
3.14x, 0.89x at batch 8). :func:`fit_paths` calibrates ``step ~ t0 + bytes / BW_eff`` per path
from measured steps at two or more batch sizes, so the comparison can be made on what a kernel
really does.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvlens import limits

GIB = 1024**3


def quantized_weight_ratio(quantized_fraction: float, bits: int = 4, group_size: int = 128) -> float:
    """Quantized weight bytes / 16-bit weight bytes: ``(1-f) + f*bits/16 + f/G`` (one 16-bit
    scale per ``G`` weights; ``f`` is the share of weights quantized, the rest stay 16-bit)."""
    if not 0 <= quantized_fraction <= 1 or bits <= 0 or group_size <= 0:
        raise ValueError("need 0 <= fraction <= 1, bits > 0 and group size > 0")
    return (1 - quantized_fraction) + quantized_fraction * bits / 16 + quantized_fraction / group_size


def kv_bytes_per_sequence(context_tokens: float, bytes_per_token: float) -> float:
    """``K = S * c``: the KV history one sequence of ``S`` tokens holds."""
    return context_tokens * bytes_per_token


def step_bytes(weight_bytes: float, batch: float, kv_bytes_per_seq: float) -> float:
    """Bytes read per decode step: ``W + B*K``."""
    return weight_bytes + batch * kv_bytes_per_seq


def step_seconds(
    bytes_read: float, bandwidth: float, compute_floor: float = 0.0, extra: float = 0.0
) -> float:
    """``max(bytes / bandwidth, compute floor) + extra``."""
    return max(bytes_read / bandwidth, compute_floor) + extra


def weight_share(weight_bytes: float, batch: float, kv_bytes_per_seq: float) -> float:
    """Share of a decode step's traffic that is weights: ``W / (W + B*K)``."""
    return weight_bytes / step_bytes(weight_bytes, batch, kv_bytes_per_seq)


def break_even_extra_seconds(weight_bytes_16: float, weight_bytes_q: float, bandwidth: float) -> float:
    """Quantization pays only while its extra time per step is under ``(W16 - Wq) / BW``."""
    return (weight_bytes_16 - weight_bytes_q) / bandwidth


@dataclass(frozen=True)
class Step:
    batch: float
    context_tokens: float
    seconds_16: float
    seconds_q: float

    @property
    def speedup(self) -> float:
        return self.seconds_16 / self.seconds_q

    @property
    def throughput_16(self) -> float:
        """Tokens per second: ``B / step``."""
        return self.batch / self.seconds_16

    @property
    def throughput_q(self) -> float:
        return self.batch / self.seconds_q


def compare_step(
    *,
    weight_bytes_16: float,
    weight_bytes_q: float,
    kv_bytes_per_token_: float,
    batch: float,
    context_tokens: float,
    bandwidth: float,
    compute_floor: float = 0.0,
    extra_q: float = 0.0,
) -> Step:
    """One decode step in 16-bit weights and quantized, at batch ``B`` and context ``S``."""
    kv = kv_bytes_per_sequence(context_tokens, kv_bytes_per_token_)
    return Step(
        batch,
        context_tokens,
        step_seconds(step_bytes(weight_bytes_16, batch, kv), bandwidth, compute_floor),
        step_seconds(step_bytes(weight_bytes_q, batch, kv), bandwidth, compute_floor, extra_q),
    )


# --- calibration by measured decode steps ----------------------------------------------


@dataclass(frozen=True)
class MeasuredStep:
    path: str  # e.g. bf16, int4_g128
    batch: int
    context_tokens: int
    weight_bytes: float
    kv_bytes_per_sequence: float
    seconds: float

    @property
    def bytes_read(self) -> float:
        return step_bytes(self.weight_bytes, self.batch, self.kv_bytes_per_sequence)


@dataclass(frozen=True)
class PathFit:
    """``step ~ t0 + bytes / BW_eff`` for one path (a weight format and its kernel)."""

    path: str
    weight_bytes: float
    t0: float  # seconds per step that do not scale with bytes (launches, norms, sampling)
    bandwidth: float  # effective bytes per second: what the path's kernels really move
    steps: list[MeasuredStep]

    def seconds(self, batch: float, kv_bytes_per_seq: float) -> float:
        return self.t0 + step_bytes(self.weight_bytes, batch, kv_bytes_per_seq) / self.bandwidth


class CannotFit(ValueError):
    """Measured steps that cannot calibrate the model (with the reason)."""


MEASURED_COLUMNS = ("path", "batch", "context_tokens", "weight_bytes", "kv_bytes_per_sequence", "step_ms")


def read_measured(path: Path) -> list[MeasuredStep]:
    """Measured decode steps from a CSV with the columns of ``decode_h200.csv``: ``path, batch,
    context_tokens, weight_bytes, kv_bytes_per_sequence, step_ms`` (others are ignored)."""
    try:
        rows = csv.DictReader(path.read_text(encoding="utf-8").splitlines())
    except (OSError, UnicodeDecodeError) as error:
        raise CannotFit(f"{path}: cannot read: {error}") from None
    missing = [c for c in MEASURED_COLUMNS if c not in (rows.fieldnames or ())]
    if missing:
        raise CannotFit(f"{path}: the measured steps lack the column(s) {', '.join(missing)}")
    steps = []
    for line, row in enumerate(rows, start=2):
        try:
            step = MeasuredStep(
                path=row["path"].strip(),
                batch=int(row["batch"]),
                context_tokens=int(row["context_tokens"]),
                weight_bytes=float(row["weight_bytes"]),
                kv_bytes_per_sequence=float(row["kv_bytes_per_sequence"]),
                seconds=float(row["step_ms"]) / 1000,
            )
        except (TypeError, ValueError) as error:
            raise CannotFit(f"{path} line {line}: {error}") from None
        numbers = (step.batch, step.weight_bytes, step.kv_bytes_per_sequence, step.seconds)
        if not step.path or not all(math.isfinite(v) and v > 0 for v in numbers):
            raise CannotFit(f"{path} line {line}: needs a path and positive batch, bytes and step_ms")
        steps.append(step)
    return steps


def fit_paths(steps: Iterable[MeasuredStep]) -> list[PathFit]:
    """One fit per path, by least squares with ``t0 >= 0`` and ``BW_eff > 0``; a path needs
    steps at two or more different byte counts (batch sizes or contexts) and one weight size."""
    from kvlens.nnls import nnls

    by_path: dict[str, list[MeasuredStep]] = {}
    for step in steps:
        by_path.setdefault(step.path, []).append(step)
    fits = []
    for name, measured in by_path.items():
        weights = {s.weight_bytes for s in measured}
        if len(weights) > 1:
            raise CannotFit(f"path {name}: one path, one weight size (found {len(weights)})")
        read = np.array([s.bytes_read for s in measured])
        if np.unique(read).size < 2:
            raise CannotFit(f"path {name}: needs steps at two or more batch sizes or contexts to fit")
        seconds = np.array([s.seconds for s in measured])
        scale = read.max()
        (t0, per_byte), _ = nnls(np.column_stack([np.ones_like(read), read / scale]), seconds)
        if per_byte <= 0:
            raise CannotFit(f"path {name}: step time does not grow with the bytes read")
        fits.append(PathFit(name, weights.pop(), float(t0), float(scale / per_byte), measured))
    return fits


def measured_comparison(fits: list[PathFit], batches: Iterable[int] = ()) -> dict[str, Any]:
    """The 16-bit path (the one with the most weight bytes) against each other path: at every
    measured batch and context, and at ``batches`` at the measured contexts, the measured speedup
    (where both paths were measured), the fitted one, and the byte model's upper bound; and
    article 2's break-even on the fitted numbers: the quantized path pays while its extra time
    per step, over what its bytes take at the 16-bit path's bandwidth, is under the time its
    smaller weights save, ``(W16 - Wq) / BW_16``."""
    if len(fits) < 2:
        raise CannotFit("needs a 16-bit path and a quantized one")
    base = max(fits, key=lambda f: f.weight_bytes)
    kv_per_context = {s.context_tokens: s.kv_bytes_per_sequence for f in fits for s in f.steps}
    measured = {(f.path, s.batch, s.context_tokens): s.seconds for f in fits for s in f.steps}
    points = sorted(
        {(batch, context) for _, batch, context in measured}
        | {(b, c) for b in batches for c in kv_per_context}
    )
    comparisons = []
    for quantized in (f for f in fits if f is not base):
        saved = (base.weight_bytes - quantized.weight_bytes) / base.bandwidth
        rows = []
        falls_short = False  # a measured speedup far under the byte model's bound
        for batch, context in points:
            k = kv_per_context[context]
            t_base, t_q = base.seconds(batch, k), quantized.seconds(batch, k)
            at_base_bandwidth = base.t0 + step_bytes(quantized.weight_bytes, batch, k) / base.bandwidth
            bound = step_bytes(base.weight_bytes, batch, k) / step_bytes(quantized.weight_bytes, batch, k)
            m_base = measured.get((base.path, batch, context))
            m_q = measured.get((quantized.path, batch, context))
            speedup = m_base / m_q if m_base and m_q else None
            falls_short |= speedup is not None and speedup < KERNEL_LIMITS_BELOW * bound
            rows.append(
                {
                    "batch": batch,
                    "context_tokens": context,
                    "measured_speedup": speedup,
                    "fitted_speedup": t_base / t_q,
                    "bytes_upper_bound": bound,
                    "extra_seconds": t_q - at_base_bandwidth,
                    "pays": t_q - at_base_bandwidth < saved,
                }
            )
        share = quantized.bandwidth / base.bandwidth
        kernel_limits = share < KERNEL_LIMITS_BELOW or falls_short
        comparisons.append(
            {
                "path": quantized.path,
                "bandwidth_share_of_16_bit": share,
                "break_even_extra_seconds": saved,
                "limited_by": "kernel" if kernel_limits else "bytes",
                "rows": rows,
            }
        )
    return {
        "paths": [
            {
                "path": f.path,
                "weight_bytes": f.weight_bytes,
                "t0_seconds": f.t0,
                "bandwidth_bytes_per_second": f.bandwidth,
                "measured_steps": len(f.steps),
            }
            for f in fits
        ],
        "baseline": base.path,
        "comparisons": comparisons,
    }


# A quantized path is kernel-limited when it moves its bytes at under this share of the 16-bit
# path's bandwidth, or its measured speedup falls this far short of the byte model's bound.
KERNEL_LIMITS_BELOW = 0.8


# --- units ------------------------------------------------------------------------------


def parse_bandwidth(text: str) -> float:
    """``4.8TB/s``, ``1TiB/s``, ``900 GB/s`` -> bytes per second."""
    stripped = text.strip()
    if not stripped.lower().endswith("/s"):
        raise ValueError(f"not a bandwidth: {text!r} (examples: 4.8TB/s, 1TiB/s)")
    return limits.parse_size(stripped[:-2])


def parse_count(text: str) -> float:
    """``8B``, ``70b``, ``7.6e9``, ``13M`` -> a parameter count."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmbt])?\s*", text.lower())
    if not match:
        raise ValueError(f"not a parameter count: {text!r} (examples: 8B, 70B, 7.6e9)")
    return float(match.group(1)) * {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12, None: 1}[match.group(2)]
