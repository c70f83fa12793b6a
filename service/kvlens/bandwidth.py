"""The decode traffic model of weight-only quantization (seed article 2, DESIGN section 1).

Each decode step of a dense model reads every weight once and every running sequence's KV
history: ``bytes per step ~ W + B*K`` with ``K = S*c``. Quantizing weights (W4A16: 4-bit
weights, 16-bit activations) shrinks only ``W``, so its speedup ``(W16 + B*K) / (W4 + B*K)``
tends to 1 as the batch or the context grows. A step takes at least
``max(bytes / bandwidth, compute floor)``, plus any extra time the quantized kernels add
(dequantization not hidden behind memory traffic); quantization pays only while that extra is
under ``(W16 - W4) / bandwidth``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

GIB = 1024**3


def quantized_weight_ratio(quantized_fraction: float, bits: int = 4, group_size: int = 128) -> float:
    """Quantized weight bytes / 16-bit weight bytes: ``(1-f) + f*bits/16 + f/G`` (one 16-bit
    scale per ``G`` weights; ``f`` is the share of weights quantized, the rest stay 16-bit)."""
    if not 0 <= quantized_fraction <= 1 or bits <= 0 or group_size <= 0:
        raise ValueError("need 0 <= fraction <= 1, bits > 0 and group size > 0")
    return (1 - quantized_fraction) + quantized_fraction * bits / 16 + quantized_fraction / group_size


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: float = 2) -> float:
    """``c = 2 * L * Hkv * D * bytes`` (a key and a value per layer and KV head)."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


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


# --- units ------------------------------------------------------------------------------


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> float:
    """``14GiB``, ``16 GB``, ``1.5e10`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]i?b|b)?\s*", text.lower())
    if not match or (match.group(2) not in _SIZE_UNITS and match.group(2) is not None):
        raise ValueError(f"not a size: {text!r} (examples: 14GiB, 16GB, 1.5e10)")
    value = float(match.group(1)) * _SIZE_UNITS[match.group(2) or ""]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"not a positive size: {text!r}")
    return value


def parse_bandwidth(text: str) -> float:
    """``4.8TB/s``, ``1TiB/s``, ``900 GB/s`` -> bytes per second."""
    stripped = text.strip()
    if not stripped.lower().endswith("/s"):
        raise ValueError(f"not a bandwidth: {text!r} (examples: 4.8TB/s, 1TiB/s)")
    return parse_bytes(stripped[:-2])


def parse_count(text: str) -> float:
    """``8B``, ``70b``, ``7.6e9``, ``13M`` -> a parameter count."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmbt])?\s*", text.lower())
    if not match:
        raise ValueError(f"not a parameter count: {text!r} (examples: 8B, 70B, 7.6e9)")
    return float(match.group(1)) * {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12, None: 1}[match.group(2)]
