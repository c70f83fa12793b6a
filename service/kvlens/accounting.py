"""The accounting settings: how everything that counts tokens and work counts them (floor 2).

The prompt-length edges and the buckets of every histogram, the closed set of ``model`` label
values, and each model's cost model (given, or in FLOPs from its shape). The live sidecar, the
offline analysis, the simulator and the experiments all take an :class:`Accounting`; the offline
commands build nothing else (:func:`kvlens.config.load_offline`)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvlens import limits, shapes
from kvlens.definitions import CostModel
from kvlens.records.labels import MAX_LABEL_BYTES, valid_label

DEFAULT_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
DEFAULT_REUSE_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
DEFAULT_PROMPT_LENGTH_EDGES = (512, 2048, 8192, 32768)
# A block whose storing tenant is remembered (kvlens.tenancy: an OrderedDict entry and its 64-bit
# key; 142 measured by tests/unit/test_tenancy.py): bounds tenant_remember_blocks
TENANT_BLOCK_BYTES = 160


class CostModelSetting(BaseModel):
    """``C(n) = a*n + b*n*(n+1)/2`` for one model (see DESIGN section 1), in ``unit``."""

    model_config = ConfigDict(extra="forbid", defer_build=True)

    a: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 1.0
    b: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 1.0 / 1024.0
    unit: Literal["work_units", "flops", "seconds"] = "work_units"

    def to_cost_model(self) -> CostModel:
        return CostModel(a=self.a, b=self.b, unit=self.unit)


class ModelShapeSetting(BaseModel):
    """A served model's shape: its prefill cost model in FLOPs, and its decode traffic for the
    live W4A16 estimate. Give ``hf_config`` (a Hugging Face ``config.json``) or the fields, named
    as in a ``config.json`` (the short names of :data:`kvlens.shapes.SHORT_NAMES` are accepted);
    fields given beside ``hf_config`` win."""

    model_config = ConfigDict(extra="forbid", defer_build=True)

    hf_config: Path | None = Field(None, description="a Hugging Face config.json to read the shape from")
    num_hidden_layers: int = Field(ge=1, description="layers")
    num_key_value_heads: int = Field(ge=1, description="KV heads")
    head_dim: int = Field(ge=1, description="head_dim (or hidden_size / num_attention_heads)")
    kv_dtype_bytes: float = Field(2, gt=0, description="bytes per KV value")
    hidden_size: int | None = Field(None, ge=1, description="hidden_size (FLOPs)")
    num_attention_heads: int | None = Field(None, ge=1, description="attention heads (FLOPs)")
    intermediate_size: int | None = Field(None, ge=1, description="MLP width, per expert (FLOPs)")
    gated_mlp: bool = Field(True, description="gate, up and down projections (False: up and down)")
    num_experts: int = Field(1, ge=1, description="experts per layer (1: dense)")
    num_experts_per_tok: int = Field(1, ge=1, description="experts a token is routed to")
    shared_expert_intermediate_size: int = Field(0, ge=0, description="a shared expert's MLP width")
    vocab_size: int | None = Field(None, ge=1, description="for the weights read by a decode step")
    tie_word_embeddings: bool = False
    weight_bytes: float | None = Field(
        None, gt=0, description="16-bit weight bytes; a number or a size like 14GiB (default: from the shape)"
    )
    quantized_fraction: float = Field(0.9, ge=0, le=1, description="share of weights W4A16 would quantize")
    group_size: int = Field(128, ge=1, description="weights per 16-bit scale")

    @model_validator(mode="before")
    @classmethod
    def _read_hf_config(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        both = [short for short, name in shapes.SHORT_NAMES.items() if short in value and name in value]
        if both:
            raise ValueError(f"give {both[0]} or {shapes.SHORT_NAMES[both[0]]}, not both")
        value = {shapes.SHORT_NAMES.get(key, key): given for key, given in value.items()}
        if not value.get("hf_config"):
            return value
        try:
            config = json.loads(Path(value["hf_config"]).read_text())
            shape = shapes.from_hf_config(config)
        except (OSError, ValueError) as error:  # UnsupportedModel is a ValueError: its reason
            raise ValueError(f"hf_config: {error}") from None
        found = {name: getattr(shape, name) for name in shapes.FIELDS}
        return {**{k: v for k, v in found.items() if v is not None}, **value}

    @field_validator("weight_bytes", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return limits.parse_size(value) if isinstance(value, str) else value

    def shape(self) -> shapes.ModelShape:
        return shapes.ModelShape(**{name: getattr(self, name) for name in shapes.FIELDS})

    def decode_weight_bytes(self) -> float | None:
        """The 16-bit weights a decode step reads: as given, or from the shape (None: unknown)."""
        return self.weight_bytes if self.weight_bytes is not None else self.shape().weight_bytes()


class Accounting(BaseModel):
    """Edges, buckets, cost models, model shapes and label limits (models, tenants): everything
    that counts."""

    model_config = ConfigDict(extra="forbid", validate_default=True, defer_build=True)
    _cost_models: dict[str, CostModel] = PrivateAttr(
        default_factory=dict
    )  # configured names; "": the default

    prompt_length_edges: list[int] = Field(
        list(DEFAULT_PROMPT_LENGTH_EDGES),
        description="Edges of the `prompt_len` label; `0-511` is below the first edge.",
    )
    latency_buckets_seconds: list[float] = Field(
        list(DEFAULT_LATENCY_BUCKETS), description="Buckets of the latency histograms."
    )
    reuse_ratio_buckets: list[float] = Field(
        list(DEFAULT_REUSE_BUCKETS), description="Buckets of kvlens_request_reuse_ratio."
    )
    default_cost_model: CostModelSetting = Field(
        # its own defaults, unvalidated (they are valid): an instance validated at import would
        # build pydantic's first validator, which looks its plugins up (~20 ms) in every command
        default_factory=CostModelSetting.model_construct,
        description="Cost model for models not in `cost_models`.",
    )
    cost_models: dict[str, CostModelSetting] = Field(
        {}, description='Cost model per model name, e.g. `{"llama": {"a": 1, "b": 0.001}}`.'
    )
    models: list[str] = Field(
        [], description="Allow-list of `model` label values; empty: the first `max_models` seen."
    )
    max_models: int = Field(50, ge=1, le=10_000, description="Cap on `model` values without allow-list.")
    default_model: str = Field("unknown", description="`model` label of records that carry none.")
    tenants: list[str] = Field(
        [],
        description="Allow-list of `tenant` label values (kvlens_tenant_*); empty: the first "
        "`max_tenants` seen.",
    )
    max_tenants: int = Field(50, ge=1, le=10_000, description="Cap on `tenant` values without allow-list.")
    tenant_remember_blocks: int = Field(
        0,
        ge=0,
        **limits.memory_bound(20_000_000, TENANT_BLOCK_BYTES),
        description="Set: blocks whose storing tenant is remembered (least recently seen forgotten "
        "first), from records' tenant and prefix_hashes: kvlens_cross_tenant_cached_tokens_total.",
    )
    model_shapes: dict[str, ModelShapeSetting] = Field(
        {}, description="Per model: decode shape for the live weight-quantization estimate (kvlens_decode_*)."
    )

    @field_validator("prompt_length_edges")
    @classmethod
    def _edges_increase(cls, edges: list[int]) -> list[int]:
        if any(e <= 0 for e in edges) or any(b <= a for a, b in itertools.pairwise(edges)):
            raise ValueError("must be positive and strictly increasing")
        return edges

    @field_validator("latency_buckets_seconds")
    @classmethod
    def _buckets_increase(cls, buckets: list[float]) -> list[float]:
        if not buckets:
            raise ValueError("must not be empty")
        if any(not math.isfinite(b) or b <= 0 for b in buckets) or any(
            b <= a for a, b in itertools.pairwise(buckets)
        ):
            raise ValueError("must be finite, positive and strictly increasing")
        return buckets

    @field_validator("reuse_ratio_buckets")
    @classmethod
    def _ratio_buckets(cls, buckets: list[float]) -> list[float]:
        if (
            not buckets
            or any(not 0 <= b <= 1 for b in buckets)
            or any(b <= a for a, b in itertools.pairwise(buckets))
        ):
            raise ValueError("must be non-empty, within 0..1 and strictly increasing")
        return buckets

    @field_validator("models", "cost_models", "default_model", "model_shapes", "tenants")
    @classmethod
    def _label_values(cls, value: Any, info: ValidationInfo) -> Any:
        names = [value] if isinstance(value, str) else list(value)
        bad = [name for name in names if not name or not valid_label(name) or name == "other"]
        if bad:
            raise ValueError(
                f"{'tenant' if info.field_name == 'tenants' else 'model'} names must be non-empty "
                f"printable UTF-8 of at most {MAX_LABEL_BYTES} bytes, not 'other'"
            )
        return value

    def cost_model_for(self, model: str) -> CostModel:
        """The model's cost model: its own from ``cost_models`` (e.g. calibrated in seconds), else
        FLOPs from its ``model_shapes`` entry, else ``default_cost_model`` (the article's unit).
        Only configured names are remembered, so record-supplied names never grow memory."""
        if not self._cost_models:
            chosen = {name: self._choose_cost_model(name) for name in {*self.cost_models, *self.model_shapes}}
            self._cost_models = {**chosen, "": self.default_cost_model.to_cost_model()}
        return self._cost_models.get(model) or self._cost_models[""]

    def _choose_cost_model(self, model: str) -> CostModel:
        if model in self.cost_models:
            return self.cost_models[model].to_cost_model()
        shape = self.model_shapes[model].shape()
        return shape.prefill_cost_model() if shape.has_flops else self.default_cost_model.to_cost_model()

    def cost_model_notes(self) -> list[str]:
        """What each configured model's compute saved is counted in, for the startup log."""
        notes = []
        for name in sorted({*self.cost_models, *self.model_shapes}):
            cost = self.cost_model_for(name)
            source = {"flops": "from its shape", "seconds": "calibrated"}.get(cost.unit, "as configured")
            ratio = f"b/a = 1/{cost.a / cost.b:,.0f}" if cost.b > 0 else "b = 0"
            notes.append(f"model {name}: compute saved in {cost.unit} ({source}, {ratio})")
        default = self.default_cost_model
        notes.append(
            f"other models: compute saved in {default.unit} (a = {default.a:g}, b = {default.b:g}"
            + (
                "; the article's illustrative unit, not FLOPs or seconds: give model_shapes for FLOPs "
                "or a calibration for seconds)"
                if default.unit == "work_units"
                else ")"
            )
        )
        return notes
