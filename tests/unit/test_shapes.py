"""Model shapes from Hugging Face configs: KV bytes, weights, and the prefill cost model in FLOPs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvlens import shapes
from kvlens.accounting import ModelShapeSetting
from kvlens.definitions import FLOPS

# The config.json fields of meta-llama/Llama-3.1-8B and Qwen/Qwen2.5-1.5B that the shape reads.
LLAMA_31_8B = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
QWEN25_15B = {
    "model_type": "qwen2",
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "sliding_window": 32768,
    "use_sliding_window": False,
}


def test_kv_shape_from_a_config() -> None:
    shape = shapes.from_hf_config(LLAMA_31_8B)
    kv = (shape.num_hidden_layers, shape.num_key_value_heads, shape.head_dim, shape.kv_dtype_bytes)
    assert kv == (32, 8, 128, 2)
    assert shape.kv_bytes_per_token == 128 * 1024


@pytest.mark.parametrize(("config", "ratio"), [(LLAMA_31_8B, 26_624), (QWEN25_15B, 15_232)])
def test_flops_cost_model_of_real_shapes(config: dict[str, object], ratio: int) -> None:
    cost = shapes.from_hf_config(config).prefill_cost_model()
    assert cost.unit == FLOPS
    assert cost.a / cost.b == ratio  # gpu-measurements.md: 1/26,600 and 1/15,200


def test_the_8b_shape_saves_0_467_of_its_flops_at_half_a_cached_prompt() -> None:
    cost = shapes.from_hf_config(LLAMA_31_8B).prefill_cost_model()
    assert f"{float(cost.work(4096) / cost.work(8192)):.3f}" == "0.467"
    assert cost.a == 2 * 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)


def test_weights_of_the_8b_shape() -> None:
    weight_bytes = shapes.from_hf_config(LLAMA_31_8B).weight_bytes()
    assert weight_bytes is not None and weight_bytes / 2 == pytest.approx(8.03e9, rel=0.001)


def test_a_mixture_of_experts_counts_the_experts_a_token_meets() -> None:
    mixtral = {**LLAMA_31_8B, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}
    dense, moe = shapes.from_hf_config(LLAMA_31_8B), shapes.from_hf_config(mixtral)
    mlp = 3 * 4096 * 14336 * 32
    assert moe.linear_weights_per_token() - dense.linear_weights_per_token() == mlp
    assert (moe.weight_bytes() or 0) - (dense.weight_bytes() or 0) == 2 * 7 * mlp


def test_a_plain_mlp_has_two_matrices() -> None:
    gpt2 = {**LLAMA_31_8B, "model_type": "gpt2"}
    assert (
        shapes.from_hf_config(LLAMA_31_8B).linear_weights_per_token()
        - shapes.from_hf_config(gpt2).linear_weights_per_token()
        == 32 * 4096 * 14336
    )


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"model_type": "deepseek_v3", "kv_lora_rank": 512}, "latent attention"),
        ({"sliding_window": 4096, "use_sliding_window": True}, "sliding-window"),
        ({"layers_block_type": ["mamba", "attention"]}, "hybrid"),
    ],
)
def test_models_the_formulas_do_not_fit_are_refused(extra: dict[str, object], why: str) -> None:
    with pytest.raises(shapes.UnsupportedModel, match=why):
        shapes.from_hf_config({**LLAMA_31_8B, **extra})


def test_a_shape_without_its_mlp_has_no_flops() -> None:
    shape = shapes.ModelShape(num_hidden_layers=32, num_key_value_heads=8, head_dim=128)
    assert not shape.has_flops and shape.weight_bytes() is None
    with pytest.raises(shapes.UnsupportedModel):
        shape.prefill_cost_model()


def test_the_settings_take_the_hugging_face_names_and_the_short_ones(tmp_path: Path) -> None:
    # one field map: a setting's shape fields are the shape's, named as in config.json
    assert set(shapes.FIELDS) <= set(ModelShapeSetting.model_fields)
    full = {k: v for k, v in dataclasses.asdict(shapes.from_hf_config(LLAMA_31_8B)).items() if v is not None}
    by_names = ModelShapeSetting.model_validate(full).shape()
    assert by_names == shapes.from_hf_config(LLAMA_31_8B)
    short = {next((s for s, n in shapes.SHORT_NAMES.items() if n == k), k): v for k, v in full.items()}
    assert "layers" in short and ModelShapeSetting.model_validate(short).shape() == by_names
    with pytest.raises(ValidationError, match="give layers or num_hidden_layers, not both"):
        ModelShapeSetting.model_validate({**full, "layers": 32})
    # beside hf_config, a field given wins in either spelling
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_31_8B))
    for name in ("layers", "num_hidden_layers"):
        read = ModelShapeSetting.model_validate({"hf_config": str(config), name: 40}).shape()
        assert read == dataclasses.replace(by_names, num_hidden_layers=40)
