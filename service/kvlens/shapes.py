"""A served model's shape, from settings or a Hugging Face ``config.json``, and what follows from it:
the KV bytes a token keeps (decode traffic, :mod:`kvlens.bandwidth`), the weights a decode step
reads, and the prefill work of a token and of a causal query-key pair in FLOPs (the cost model of
:func:`kvlens.definitions.flops_cost_model`).

Models whose attention the formulas do not describe are refused, with the reason: multi-head
latent attention (DeepSeek V2/V3: the KV cache is a compressed latent), sliding-window attention
(the KV read stops growing past the window), hybrid state-space models (not every layer keeps a
KV history). Mixture-of-experts models count the experts a token meets (``num_experts_per_tok``
plus any shared expert) for FLOPs, and every expert for the weights a decode step may read.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Final

from kvlens.definitions import CostModel, flops_cost_model

# Model types whose MLP is two matrices (up, down); every other model gets a gated MLP (gate, up,
# down), as Llama, Mistral, Qwen, Gemma and Phi-3 have.
PLAIN_MLP_TYPES: Final = frozenset(
    {"gpt2", "gpt_neox", "gptj", "gpt_bigcode", "opt", "bloom", "falcon", "starcoder2", "phi", "mpt"}
)
DTYPE_BYTES: Final = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
}


class UnsupportedModel(ValueError):
    """The model's attention is not what ``K = S * 2*L*Hkv*D*bytes`` and the FLOPs formula assume."""


@dataclass(frozen=True)
class ModelShape:
    """The fields are named as a Hugging Face ``config.json`` names them (``model_shapes`` in the
    settings takes the same names, and :data:`SHORT_NAMES`), but ``kv_dtype_bytes`` (from its
    ``torch_dtype``: the bytes of a KV value, and of a weight) and ``gated_mlp`` (from its
    ``model_type``)."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    kv_dtype_bytes: float = 2
    hidden_size: int | None = None  # the rest: needed for FLOPs and for weights from the shape
    num_attention_heads: int | None = None
    intermediate_size: int | None = None  # per expert in a mixture of experts
    gated_mlp: bool = True
    num_experts: int = 1  # experts per layer (1: dense)
    num_experts_per_tok: int = 1
    shared_expert_intermediate_size: int = 0
    vocab_size: int | None = None
    tie_word_embeddings: bool = False

    @property
    def kv_bytes_per_token(self) -> float:
        """``c = 2 * L * Hkv * D * bytes`` (a key and a value per layer and KV head)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def has_flops(self) -> bool:
        return (
            self.hidden_size is not None
            and self.num_attention_heads is not None
            and self.intermediate_size is not None
        )

    def _attention_weights(self) -> int:
        assert self.hidden_size is not None and self.num_attention_heads is not None
        query_and_output = 2 * self.hidden_size * self.num_attention_heads * self.head_dim
        key_and_value = 2 * self.hidden_size * self.num_key_value_heads * self.head_dim
        return query_and_output + key_and_value

    def _mlp_weights(self, intermediate: int) -> int:
        assert self.hidden_size is not None
        return (3 if self.gated_mlp else 2) * self.hidden_size * intermediate

    def linear_weights_per_token(self) -> int:
        """Weights a token multiplies through all layers: attention projections (GQA: the key and
        value projections are ``Hkv`` heads wide), and the MLP of each expert it is routed to."""
        if not self.has_flops:
            raise UnsupportedModel("the shape lacks hidden_size, num_attention_heads or intermediate_size")
        assert self.intermediate_size is not None
        mlp = self.num_experts_per_tok * self._mlp_weights(self.intermediate_size)
        shared = (
            self._mlp_weights(self.shared_expert_intermediate_size)
            if self.shared_expert_intermediate_size
            else 0
        )
        return self.num_hidden_layers * (self._attention_weights() + mlp + shared)

    def prefill_cost_model(self) -> CostModel:
        """``C(n)`` in FLOPs for this shape."""
        linear = self.linear_weights_per_token()  # raises when the shape does not say enough
        assert self.num_attention_heads is not None
        return flops_cost_model(linear, self.num_attention_heads, self.head_dim, self.num_hidden_layers)

    def weight_bytes(self) -> float | None:
        """Bytes of every weight at the shape's dtype (all experts, embeddings and LM head), or
        None when the shape does not say enough."""
        if not self.has_flops or self.vocab_size is None:
            return None
        assert self.intermediate_size is not None and self.hidden_size is not None
        experts = self.num_experts * self._mlp_weights(self.intermediate_size)
        shared = (
            self._mlp_weights(self.shared_expert_intermediate_size)
            if self.shared_expert_intermediate_size
            else 0
        )
        per_layer = self._attention_weights() + experts + shared
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return float((self.num_hidden_layers * per_layer + embeddings) * self.kv_dtype_bytes)


FIELDS: Final = tuple(field.name for field in fields(ModelShape))
# The short names the settings took before they took the Hugging Face ones (still accepted).
SHORT_NAMES: Final = {
    "layers": "num_hidden_layers",
    "kv_heads": "num_key_value_heads",
    "heads": "num_attention_heads",
    "experts": "num_experts",
    "experts_per_token": "num_experts_per_tok",
    "tied_embeddings": "tie_word_embeddings",
}


def from_hf_config(config: dict[str, Any]) -> ModelShape:
    """The shape in a Hugging Face ``config.json``; raises :class:`UnsupportedModel`."""
    config = {**config.get("text_config", {}), **config}
    model_type = str(config.get("model_type", ""))
    if config.get("kv_lora_rank") or model_type.startswith("deepseek_v"):
        raise UnsupportedModel(
            f"{model_type or 'this model'} uses multi-head latent attention (MLA): its KV cache is a "
            "compressed latent, not 2*L*Hkv*D values per token"
        )
    if config.get("use_sliding_window") or (
        config.get("sliding_window") and config.get("use_sliding_window") is not False
    ):
        raise UnsupportedModel(
            "the model uses sliding-window attention: the KV read per step stops growing past the window, "
            "so K = S*c overstates it"
        )
    hybrid_keys = ("layer_types", "layers_block_type", "hybrid_override_pattern", "attn_layer_period")
    if any(key in config for key in hybrid_keys) or any(
        kind in model_type for kind in ("mamba", "jamba", "hybrid")
    ):
        raise UnsupportedModel(
            "the model is hybrid (state-space or mixed attention layers): not every layer keeps a KV history"
        )
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
    except KeyError as missing:
        raise UnsupportedModel(f"config.json lacks {missing.args[0]}") from None
    experts = int(config.get("num_local_experts") or config.get("num_experts") or 1)
    routed = int(config.get("num_experts_per_tok") or 1) if experts > 1 else 1
    intermediate = config.get("moe_intermediate_size") if experts > 1 else None
    intermediate = intermediate or config.get("intermediate_size")
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    vocab = config.get("vocab_size")
    return ModelShape(
        num_hidden_layers=layers,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        kv_dtype_bytes=DTYPE_BYTES.get(dtype, 2),
        hidden_size=hidden,
        num_attention_heads=heads,
        intermediate_size=int(intermediate) if intermediate else None,
        gated_mlp=model_type not in PLAIN_MLP_TYPES,
        num_experts=experts,
        num_experts_per_tok=routed,
        shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0),
        vocab_size=int(vocab) if vocab else None,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
