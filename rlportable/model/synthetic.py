"""Synthetic models: the shapes of real ones with seeded random weights, for benchmarks and conformance.

No weights can be downloaded in CI or on the benchmark machines, and neither speed nor bit-exactness
depends on the weights' values. The Qwen3-0.6B shape here is the one `rlportable bench` measures and
the conformance suite's golden digests name in their recipes.
"""

from __future__ import annotations

from rlportable.errors import InputError
from rlportable.model.config import ModelConfig
from rlportable.model.tiny import tiny_weights

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                 rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=True)


#: the shapes of the Qwen3 family's dense models (their config.json fields that set the memory)
QWEN3_SHAPES = {
    "qwen3-0.6b": QWEN3_06B,
    "qwen3-1.7b": dict(QWEN3_06B, hidden_size=2048, intermediate_size=6144),
    "qwen3-4b": dict(QWEN3_06B, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32),
    "qwen3-8b": dict(QWEN3_06B, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, tie_word_embeddings=False),
}


def _shape_config(shapes: dict, architecture: str, kind: str, shape: str, layers: int | None) -> ModelConfig:
    if shape not in shapes:
        raise InputError(f"unknown {kind}shape {shape!r}; known: {', '.join(shapes)}")
    fields = dict(shapes[shape])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    return ModelConfig(architecture=architecture, rope_scaling=None, qkv_bias=False, qk_norm=True, **fields)


def qwen3_config(shape: str, layers: int | None = None) -> ModelConfig:
    """A Qwen3 shape of QWEN3_SHAPES (all its layers, or the first `layers`)."""
    return _shape_config(QWEN3_SHAPES, "Qwen3ForCausalLM", "model ", shape, layers)


#: Qwen3-30B-A3B's shape: every layer sparse, 128 experts of width 768, 8 active, renormalised
QWEN3_MOE_SHAPES = {
    "qwen3-30b-a3b": dict(QWEN3_06B, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                          decoder_sparse_step=1, router_aux_loss_coef=0.001),
}


def qwen3_moe_config(shape: str = "qwen3-30b-a3b", layers: int | None = None) -> ModelConfig:
    """A Qwen3-MoE shape of QWEN3_MOE_SHAPES (all its layers, or the first `layers`: one GPU holds a few of
    Qwen3-30B-A3B's 48)."""
    return _shape_config(QWEN3_MOE_SHAPES, "Qwen3MoeForCausalLM", "MoE model ", shape, layers)


def qwen3_06b_config(layers: int | None = None) -> ModelConfig:
    """Qwen3-0.6B's shape (all 28 layers, or the first `layers`)."""
    return qwen3_config("qwen3-0.6b", layers)


def random_weights(config: ModelConfig, seed: int = 0):
    """Seeded normal(0, 0.02) weights for any config (the tiny model's recipe)."""
    return tiny_weights(config, seed)


class IdsOnlyTokenizer:
    """What the engine asks of a tokenizer when prompts are token ids and nothing stops early."""

    def __init__(self):
        self.eos_token_id = None
        self.stop_token_ids: list[int] = []

    def encode(self, text: str) -> list[int]:
        raise InputError("this model has no tokenizer: give token-id prompts")

    def decode(self, ids) -> str:
        return ""
