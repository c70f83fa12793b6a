"""The fleet room's own settings models (composed into :class:`kvlens.config.Settings`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvlens.records import MAX_LABEL_BYTES, valid_label


class TrtllmEventsSetting(BaseModel):
    """One ``trtllm-serve`` whose KV cache events kvlens drains (``--kv-events-trtllm NAME=URL``):
    ``POST URL/kv_cache_events`` every ``kv_events_trtllm_poll_seconds`` (:mod:`kvlens.fleet.trtllm`).
    The drain is destructive: nothing else may poll that endpoint."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="The replica's `replica` label (an attention-DP rank r > 0 is NAME/dpr).")
    url: str = Field(description="Its HTTP base URL, http://HOST:PORT (trtllm-serve's).")

    @field_validator("name")
    @classmethod
    def _label(cls, name: str) -> str:
        if not name or not valid_label(name) or "/dp" in name:
            raise ValueError(
                f"a replica name must be non-empty printable UTF-8 of at most {MAX_LABEL_BYTES} bytes, "
                "without /dp"
            )
        return name

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError("a TensorRT-LLM server is http://HOST:PORT or https://HOST:PORT")
        return url.rstrip("/")
