"""The simulator's settings: what ``kvlens simulate serve`` reads of ``kvlens serve``'s
(:class:`ServeSettings`), and the sidecar's modelled caches, the causes of recomputed tokens
without KV events from records' prefix ids (:class:`ModelledSettings`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvlens.accounting import Accounting
from kvlens.fleet.limits import MAX_REPLICAS
from kvlens.http.settings import AuthSettings, ServerSettings


class ModelledSettings(BaseModel):
    """One modelled prefix cache per replica, fed by records that carry prefix ids."""

    model_config = ConfigDict(extra="forbid", validate_default=True, defer_build=True)

    modelled_capacity_blocks: int | None = Field(
        None,
        ge=1,
        description="Set: records with prefix_hashes and replica go through one modelled cache of this "
        "many blocks per replica: kvlens_kv_modelled_recomputed_tokens_total (causes without KV events).",
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


class ServeSettings(Accounting, AuthSettings, ServerSettings):
    """``kvlens simulate serve``: ``kvlens serve``'s connection and body rules and admin token, and
    the served model's cost model and shape."""
