"""ModelConfig: the shape of a Qwen3, Qwen3-MoE, Qwen2 or Llama decoder, parsed from a Hugging Face config.json.

Both spellings of config.json are read: the transformers 4 one (top-level
`rope_theta`, `rope_scaling`, `torch_dtype`) and the transformers 5 one
(`rope_parameters`, `dtype`). A field that is absent takes the default of the
transformers config class, so a file means here what it means there; a field
whose value rlportable cannot honour (another activation, sliding-window
attention, another RoPE scaling, a bias on o_proj) is a one-line ModelError.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from rlportable.errors import RlpError


class ModelError(RlpError):
    """A model directory, config, weight file or tokenizer is missing, malformed or unsupported."""


ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}
_MODEL_TYPES = {model_type: arch for arch, model_type in ARCHITECTURES.items()}

# The transformers config classes' defaults for the fields rlportable reads.
_DEFAULTS = {
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768},
    "qwen3_moe": {"num_key_value_heads": 4, "head_dim": None, "max_position_embeddings": 32768},
    "qwen2": {"num_key_value_heads": 32, "head_dim": None, "max_position_embeddings": 32768},
    "llama": {"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048},
}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
DEFAULT_ROPE_THETA = 10000.0
TORCH_DTYPES = ("bfloat16", "float16", "float32")
# Qwen3MoeConfig's defaults (transformers) for the sparse fields
_MOE_DEFAULTS = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                 "decoder_sparse_step": 1, "router_aux_loss_coef": 0.001}


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 RoPE frequency scaling (`rope_type: llama3`), the only scaling supported."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a model's shape.

    head_dim is explicit (Qwen3, or any config that states it) or
    hidden_size // num_attention_heads. qkv_bias: q/k/v projections carry a
    bias (Qwen2). qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
    `raw` keeps the parsed config.json so a save writes the same file back.

    Qwen3-MoE: num_experts > 0 makes the layers that sparse_layer() names a router over
    num_experts SwiGLU experts of width moe_intermediate_size, num_experts_per_tok active
    (contracts/moe.toml); the others keep the dense MLP of intermediate_size. num_experts = 0
    (every dense model) means no sparse layer.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    hidden_act: str = "silu"
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    output_router_logits: bool = False  # with a nonzero coefficient: the load-balancing loss (transformers' rule)
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def model_type(self) -> str:
        return ARCHITECTURES[self.architecture]

    @property
    def is_moe(self) -> bool:
        """Whether any layer is sparse (a Qwen3-MoE config with experts)."""
        return any(self.sparse_layer(index) for index in range(self.num_hidden_layers))

    @property
    def load_balancing(self) -> bool:
        """Whether training adds router_aux_loss_coef x the load-balancing loss: transformers' Qwen3-MoE adds it
        when output_router_logits is true (coef 0 adds 0); docs/moe.md, "The load-balancing loss"."""
        return self.is_moe and self.output_router_logits and self.router_aux_loss_coef != 0.0

    def sparse_layer(self, index: int) -> bool:
        """Whether layer `index` is a mixture of experts, by transformers' Qwen3MoeDecoderLayer rule."""
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ModelConfig":
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except FileNotFoundError:
            raise ModelError(f"{path}: no such file") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ModelError(f"{path}: not a readable JSON file: {_one_line(error)}") from None
        return cls.from_dict(data, source=path)

    @classmethod
    def from_dict(cls, data: Any, source: str = "config.json") -> "ModelConfig":
        return _parse(data, source)

    def to_hf_dict(self, torch_dtype: str | None = None) -> dict:
        """config.json contents that transformers 4 and 5 load as this model.

        The parsed file is written back (with the dtype updated) when it still
        describes this config; otherwise a canonical transformers-4-style dict.
        """
        dtype = torch_dtype if torch_dtype is not None else self.torch_dtype
        if self.raw:
            try:
                same = _parse(self.raw, "config.json") == dataclasses.replace(self, raw={})
            except ModelError:
                same = False
            if same:
                out = json.loads(json.dumps(self.raw))
                if dtype is not None:
                    keys = [key for key in ("torch_dtype", "dtype") if key in out] or ["torch_dtype"]
                    for key in keys:
                        out[key] = dtype
                return out
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dataclasses.asdict(self.rope_scaling) if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if self.model_type in ("qwen3", "qwen3_moe", "llama"):
            out["attention_bias"] = False
        if self.model_type in ("qwen3", "qwen3_moe", "qwen2"):
            out["use_sliding_window"] = False
        if self.model_type == "qwen3_moe":
            out.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                       decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
                       router_aux_loss_coef=self.router_aux_loss_coef,
                       output_router_logits=self.output_router_logits)
        if self.model_type == "llama":
            out["mlp_bias"] = False
        out["bos_token_id"] = self.bos_token_id
        eos = list(self.eos_token_ids)
        out["eos_token_id"] = None if not eos else eos[0] if len(eos) == 1 else eos
        if dtype is not None:
            out["torch_dtype"] = dtype
        return out


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def _parse(data: Any, source: str) -> ModelConfig:
    def fail(problem: str) -> ModelError:
        return ModelError(f"{source}: {problem}")

    if not isinstance(data, dict):
        raise fail("the top level is not a JSON object")

    architecture = _architecture(data, fail)
    model_type = ARCHITECTURES[architecture]
    defaults = _DEFAULTS[model_type]

    def integer(name: str, value: Any = ..., minimum: int = 1) -> int:
        if value is ...:
            value = data[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise fail(f"{name} must be an integer >= {minimum}, got {value!r}")
        return value

    def number(name: str, value: Any, positive: bool = True) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise fail(f"{name} must be a finite number, got {value!r}")
        if positive and value <= 0:
            raise fail(f"{name} must be positive, got {value!r}")
        return float(value)

    def flag(name: str, default: bool) -> bool:
        value = data.get(name, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise fail(f"{name} must be true or false, got {value!r}")
        return value

    for name in _REQUIRED:
        if name not in data:
            raise fail(f"missing field {name}")
    vocab_size = integer("vocab_size")
    hidden_size = integer("hidden_size")
    intermediate_size = integer("intermediate_size")
    num_layers = integer("num_hidden_layers")
    num_heads = integer("num_attention_heads")

    kv_heads = data.get("num_key_value_heads", defaults["num_key_value_heads"])
    kv_heads = num_heads if kv_heads is None else integer("num_key_value_heads", kv_heads)
    if num_heads % kv_heads:
        raise fail(f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({kv_heads})")

    head_dim = data.get("head_dim", defaults["head_dim"])
    if head_dim is None:
        if hidden_size % num_heads:
            raise fail(f"hidden_size ({hidden_size}) is not a multiple of num_attention_heads ({num_heads}) "
                       "and no head_dim is given")
        head_dim = hidden_size // num_heads
    head_dim = integer("head_dim", head_dim)
    if head_dim % 2:
        raise fail(f"head_dim must be even for RoPE, got {head_dim}")

    hidden_act = data.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise fail(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
    rms_norm_eps = number("rms_norm_eps", data.get("rms_norm_eps", 1e-6))
    max_positions = integer("max_position_embeddings",
                            data.get("max_position_embeddings", defaults["max_position_embeddings"]))
    tie = flag("tie_word_embeddings", False)

    if model_type in ("qwen3", "qwen3_moe", "llama") and flag("attention_bias", False):
        raise fail("attention_bias=true (a bias on q/k/v/o projections) is not supported for "
                   f"{architecture}")
    if model_type == "llama" and flag("mlp_bias", False):
        raise fail("mlp_bias=true is not supported")
    if model_type in ("qwen3", "qwen3_moe", "qwen2") and flag("use_sliding_window", False):
        raise fail("use_sliding_window=true is not supported (full attention only)")
    layer_types = data.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list)
                                    or any(kind != "full_attention" for kind in layer_types)):
        raise fail(f"layer_types must all be 'full_attention', got {layer_types!r}")

    rope_theta, rope_scaling = _rope(data, fail, number, integer)

    torch_dtype = data.get("torch_dtype", data.get("dtype"))
    if torch_dtype is not None and torch_dtype not in TORCH_DTYPES:
        raise fail(f"torch_dtype {torch_dtype!r} is not one of {', '.join(TORCH_DTYPES)}")

    bos = data.get("bos_token_id")
    bos = None if bos is None else integer("bos_token_id", bos, minimum=0)
    eos = data.get("eos_token_id")
    eos_list = [] if eos is None else eos if isinstance(eos, list) else [eos]
    eos_ids = tuple(integer("eos_token_id", value, minimum=0) for value in eos_list)
    moe = _moe(data, fail, integer, number, flag) if model_type == "qwen3_moe" else {}

    return ModelConfig(
        architecture=architecture,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=rms_norm_eps,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        hidden_act=hidden_act,
        torch_dtype=torch_dtype,
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        **moe,
        raw=json.loads(json.dumps(data)),
    )


def _moe(data: dict, fail, integer, number, flag) -> dict:
    """Qwen3-MoE's sparse fields. transformers 5 writes num_experts as num_local_experts (its
    attribute_map); the Qwen checkpoints' files say num_experts; either is read."""
    def get(name: str, *aliases: str):
        for key in (name, *aliases):
            if data.get(key) is not None:
                return data[key]
        return _MOE_DEFAULTS[name]

    experts = integer("num_experts", get("num_experts", "num_local_experts"), minimum=0)
    out = {"num_experts": experts, "norm_topk_prob": flag("norm_topk_prob", False),
           "decoder_sparse_step": integer("decoder_sparse_step", get("decoder_sparse_step")),
           "router_aux_loss_coef": number("router_aux_loss_coef", get("router_aux_loss_coef"), positive=False),
           "output_router_logits": flag("output_router_logits", False)}
    if experts:
        out["num_experts_per_tok"] = integer("num_experts_per_tok", get("num_experts_per_tok"))
        if out["num_experts_per_tok"] > experts:
            raise fail(f"num_experts_per_tok ({out['num_experts_per_tok']}) exceeds num_experts ({experts})")
        out["moe_intermediate_size"] = integer("moe_intermediate_size", get("moe_intermediate_size"))
    only = data.get("mlp_only_layers")
    only = [] if only is None else only
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in only):
        raise fail(f"mlp_only_layers must be a list of layer indices, got {only!r}")
    out["mlp_only_layers"] = tuple(sorted(set(only)))
    return out


def _architecture(data: dict, fail) -> str:
    architectures = data.get("architectures")
    if architectures is None:
        model_type = data.get("model_type")
        if model_type in _MODEL_TYPES:
            return _MODEL_TYPES[model_type]
        raise fail(f"no 'architectures' field, and model_type {model_type!r} is not one of "
                   f"{', '.join(_MODEL_TYPES)}")
    if not isinstance(architectures, list) or len(architectures) != 1:
        raise fail(f"'architectures' must list one architecture, got {architectures!r}")
    architecture = architectures[0]
    if architecture not in ARCHITECTURES:
        raise fail(f"unsupported architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    return architecture


def _rope(data: dict, fail, number, integer) -> tuple[float, RopeScaling | None]:
    # transformers 5 order: rope_scaling, else rope_parameters; rope_theta inside it, else top level.
    params = data.get("rope_scaling") or data.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise fail(f"rope_scaling must be an object or null, got {params!r}")
    theta = params.get("rope_theta", data.get("rope_theta", DEFAULT_ROPE_THETA))
    theta = number("rope_theta", theta)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise fail(f"RoPE scaling type {rope_type!r} is not supported (only null, 'default' or 'llama3')")
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
        if name not in params:
            raise fail(f"llama3 rope scaling lacks {name}")
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise fail("llama3 rope scaling lacks original_max_position_embeddings")
    scaling = RopeScaling(
        factor=number("rope_scaling.factor", params["factor"]),
        low_freq_factor=number("rope_scaling.low_freq_factor", params["low_freq_factor"]),
        high_freq_factor=number("rope_scaling.high_freq_factor", params["high_freq_factor"]),
        original_max_position_embeddings=integer("rope_scaling.original_max_position_embeddings", original),
    )
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise fail(f"llama3 rope scaling needs high_freq_factor ({scaling.high_freq_factor}) > "
                   f"low_freq_factor ({scaling.low_freq_factor})")
    return theta, scaling
