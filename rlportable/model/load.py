"""load_model("tiny" | "tiny-sft" | "tiny-moe" | directory) -> (ModelConfig, ModelWeights, Tokenizer);
save_model."""

from __future__ import annotations

import os

from rlportable.model import manifest
from rlportable.model.config import ModelConfig, ModelError
from rlportable.model.tokenizer import TOKENIZER_FILE, Tokenizer, check_vocab, load_tokenizer
from rlportable.model.weights import ModelWeights, check_weights, load_weights, save_safetensors

TINY = "tiny"
TINY_SFT = "tiny-sft"  # the tiny model after rlportable's own SFT run (docs/training.md), shipped in the package
TINY_SFT_DIR = os.path.join(os.path.dirname(__file__), "data", TINY_SFT)
TINY_MOE = "tiny-moe"  # tiny-sft upcycled to a Qwen3-MoE (model/tiny.py tiny_moe_model), made at load


def load_model(spec: str | os.PathLike) -> tuple[ModelConfig, ModelWeights, Tokenizer]:
    """A built-in model ("tiny", "tiny-sft", "tiny-moe") or a Hugging Face directory (config.json,
    model.safetensors or its sharded index, tokenizer.json)."""
    if isinstance(spec, str) and spec == TINY:
        from rlportable.model.tiny import tiny_model

        return tiny_model()
    if isinstance(spec, str) and spec == TINY_MOE:
        from rlportable.model.tiny import tiny_moe_model

        return tiny_moe_model()
    if isinstance(spec, str) and spec == TINY_SFT:
        if not os.path.isdir(TINY_SFT_DIR):
            raise ModelError(f"model 'tiny-sft': its weights are missing from this installation ({TINY_SFT_DIR})")
        spec = TINY_SFT_DIR
    directory = os.fspath(spec)
    if not os.path.exists(directory):
        raise ModelError(f"model {directory!r}: no such directory (give a Hugging Face model directory or 'tiny')")
    if not os.path.isdir(directory):
        raise ModelError(f"model {directory!r}: not a directory (give a Hugging Face model directory or 'tiny')")
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise ModelError(f"{directory}: no config.json")
    if not os.path.isfile(os.path.join(directory, TOKENIZER_FILE)):
        raise ModelError(f"{directory}: no {TOKENIZER_FILE}")
    problem = manifest.directory_problem(directory)  # a checkpoint's step directory: its files as written
    if problem:
        raise ModelError(problem)
    config = ModelConfig.from_file(config_path)
    tokenizer = load_tokenizer(directory, config)
    weights = load_weights(directory, config)
    return config, weights, tokenizer


def save_model(directory: str | os.PathLike, config: ModelConfig, weights: ModelWeights,
               tokenizer: Tokenizer, dtype: str = "bf16") -> None:
    """A directory load_model (and transformers) read back: config.json, model.safetensors,
    tokenizer.json, tokenizer_config.json; each file written atomically."""
    check_weights(weights, config)
    check_vocab(tokenizer, config)
    save_safetensors(weights, config, directory, dtype=dtype)
    tokenizer.save(directory)
