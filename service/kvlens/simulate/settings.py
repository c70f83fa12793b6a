"""The simulator's settings: what ``kvlens simulate serve`` reads of ``kvlens serve``'s
(:class:`ServeSettings`), and the sidecar's modelled caches, the causes of recomputed tokens
without KV events from records' prefix ids (:class:`ModelledSettings`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvlens.accounting import Accounting
from kvlens.fleet.limits import MAX_REPLICAS
from kvlens.http.settings import AuthSettings, ServerSettings
from kvlens.limits import SETTING_MEMORY_BUDGET, SIZE_UNITS, worst_case
from kvlens.simulate.cache import BLOCK_BYTES


class ModelledSettings(BaseModel):
    """One modelled prefix cache per replica, fed by records that carry prefix ids."""

    model_config = ConfigDict(extra="forbid", validate_default=True, defer_build=True)

    modelled_capacity_blocks: int | None = Field(
        None,
        ge=1,
        description="Set: records with prefix_hashes and replica go through one modelled cache of this "
        "many blocks per replica: kvlens_kv_modelled_recomputed_tokens_total (causes without KV events). "
        f"Each block costs up to {BLOCK_BYTES} bytes: times modelled_max_replicas, at most 4 GiB.",
    )
    modelled_block_size: int = Field(
        16,
        ge=1,
        le=1_000_000,
        description="Tokens per block of the modelled caches (records of another are skipped).",
    )
    modelled_max_replicas: int = Field(
        MAX_REPLICAS,  # the modelled caches feed a fleet index
        ge=1,
        description=f"Replicas modelled (at most {MAX_REPLICAS}: the fleet index's replicas); records of "
        "further replicas are skipped (counted).",
    )
    modelled_partial_last_block: bool = Field(
        False,
        description="The last prefix id names the prompt's partial last block (LiteLLM's): dropped when "
        "prompt_tokens is not a whole number of blocks.",
    )

    @field_validator("modelled_max_replicas")
    @classmethod
    def _modelled_replicas_fit_the_index(cls, replicas: int) -> int:
        if replicas > MAX_REPLICAS:
            raise ValueError(f"at most {MAX_REPLICAS} (one bit each in the fleet index's holder masks)")
        return replicas

    @model_validator(mode="after")
    def _modelled_caches_fit_the_budget(self) -> ModelledSettings:
        # a cache of modelled_capacity_blocks for each replica: the product is what may be kept
        capacity, replicas = self.modelled_capacity_blocks, self.modelled_max_replicas
        if capacity is not None and capacity * replicas * BLOCK_BYTES > SETTING_MEMORY_BUDGET:
            budget = SETTING_MEMORY_BUDGET / SIZE_UNITS["gib"]
            raise ValueError(
                f"modelled_capacity_blocks {capacity:,} for each of modelled_max_replicas {replicas} "
                f"replicas may take {worst_case(capacity * replicas, BLOCK_BYTES)}: no setting may ask for "
                f"more than {budget:g} GiB (fewer blocks, or fewer replicas)"
            )
        return self


class ServeSettings(Accounting, AuthSettings, ServerSettings):
    """``kvlens simulate serve``: ``kvlens serve``'s connection and body rules and admin token, and
    the served model's cost model and shape."""
