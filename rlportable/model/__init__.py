"""Models: config, safetensors weights and tokenizer of Qwen3 / Qwen2 / Llama checkpoints, the tiny model."""

from rlportable.model.config import ModelConfig, ModelError, RopeScaling
from rlportable.model.load import load_model, save_model
from rlportable.model.tiny import tiny_model
from rlportable.model.tokenizer import Tokenizer, load_tokenizer
from rlportable.model.weights import LayerWeights, ModelWeights, load_weights, save_safetensors

__all__ = [
    "LayerWeights", "ModelConfig", "ModelError", "ModelWeights", "RopeScaling", "Tokenizer",
    "load_model", "load_tokenizer", "load_weights", "save_model", "save_safetensors", "tiny_model",
]
