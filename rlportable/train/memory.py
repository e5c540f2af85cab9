"""Memory per rank of a training run, as a number: what each part of the state costs on one GPU.

The model follows what the code allocates (docs/parallelism.md, "Memory per rank"):
  * weights: the float32 master weights (the engine's too), whole on every data-parallel rank and
    cut by the tensor-parallel layout (parallel.py: projections and vocabulary over T ranks), plus,
    under tensor parallelism, the whole LM head the backward gathers;
  * encodings: each projection and the LM head as 15-bit fixed point, two int8 digits an element
    (K padded to 64), plus the transposed copies the backward encodes once per update;
  * gradient: of one micro-batch, one layer's float32 gradient at a time (the backward hands each
    layer's to the optimiser as soon as it is made) plus the embedding's and the LM head's; and the
    exchange's receive buffer of the largest tensor (the send side is the gradient itself where the
    ranks divide the tensor's size);
  * optimiser: AdamW's two moments (kept through the rollout) and the accumulated gradient, float32,
    1/R of every tensor each (train/optimizer.py, ZeRO stages 1 and 2; at R = 1 with one micro-batch
    a step the accumulated gradient is that micro-batch's, which the model still counts: it errs high);
  * activations of one micro-batch of T tokens with per-layer recompute: every layer's input and
    attention output (with its row statistics), one layer's recomputed forward and backward, the LM head's row chunk;
  * KV cache: the engine's encoded K and V (two int8 digits and an int32 exponent per head and token),
    released while training.
Qwen3-MoE (docs/moe.md, "The memory model for MoE"): a sparse layer's MLP is the router [E, H], whole on
every rank, and every expert's gate/up [2I, H] (stacked) and down [H, I], I = moe_intermediate_size / TP;
all of them in every part above (weights, encodings, transposed encodings, one layer's gradient: the
backward makes every expert's, zeros for an expert no token chose). A sparse layer's backward holds,
in place of the dense MLP's working set, what ops/moe.py composed_block_backward keeps alive at once
(moe_block_activations: about (7k + 3) H + 3k I float32 a token). Under expert parallelism
(model/expert_parallel.py) a rank holds E / EP whole experts: their weights, encodings, gradient and
optimiser state are divided by EP (the router's not), and the block's working set holds this rank's
share of the pairs (k / EP a token under even routing) and of the tokens' d h terms (1 / EP).
The peak is the larger of the rollout phase (weights, encodings, moments, KV cache) and the training
phase (everything but the KV cache). Not modelled: the allocator's fragmentation, the CUDA context (about 0.5 GiB),
library workspaces. `rlportable bench memory` prints it; the H100 measurement that checks it is in
bench/results/memory_h100.json.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlportable.errors import InputError
from rlportable.model.config import ModelConfig
from rlportable.model.synthetic import QWEN3_MOE_SHAPES, QWEN3_SHAPES, qwen3_config, qwen3_moe_config  # noqa: F401

GIB = 1 << 30
WEIGHT_DIGITS = 2            # 15-bit weights: two int8 digits (contract/fixedpoint.py slice_count)
K_ALIGN = 64                 # ops/fixedpoint.py: K padded to a multiple of 64
LM_HEAD_ROW_CHUNK = 1024     # model/backward.py: LM-head rows per backward pass
#: one layer's recomputed forward and its backward hold about this many float32 [T, width] tensors
#: for each of the hidden, attention and MLP widths (inputs, outputs, their gradients, encodings)
LAYER_WORKING_SET = 6


def _pad(k: int) -> int:
    return -(-k // K_ALIGN) * K_ALIGN


def shape_config(shape: str, layers: int | None = None) -> ModelConfig:
    """A dense Qwen3 shape or a Qwen3-MoE one (all its layers, or the first `layers`)."""
    if shape in QWEN3_MOE_SHAPES:
        return qwen3_moe_config(shape, layers)
    return qwen3_config(shape, layers)


def moe_block_activations(config: ModelConfig, tp: int = 1, ep: int = 1) -> int:
    """Bytes a token of one sparse layer's backward beyond the dense layer's, at its peak (ops/moe.py
    composed_block_backward's last combine, when all of these are alive): float32 router logits and
    their gradient [E]; the gathered rows x, the expert outputs and the grouped d y [k, H] each; g, u
    and the SwiGLU output [k, I / TP]; the d h rows, their per-token gather [2k + 1, H] each, its
    weights of 1 [2k + 1] and the sum d h [H]; int32 experts (on the device and the host), int64 pair
    order, int32 slots, the gather's int32 index [2k + 1]; the routing weights with their gradient [k];
    and the last expert's d g and d u (its rows: k / E of the pairs under even routing) [2k I / E].
    Under expert parallelism (model/expert_parallel.py moe_block_backward, at its share's last combine) a
    rank holds the rows of its own pairs (k / EP a token under even routing: routing that is not even
    makes one rank's larger, not modelled) and the terms of its share of the tokens (1 / EP): the gathered
    rows x, the grouped d y and the share's expert outputs [k / EP, H] each, g, u and the SwiGLU output
    [k / EP, I / TP], its pairs' d h rows [2k / EP, H] and d z W_r [H] apart, the share's terms and their
    gather [(2k + 1) / EP, H] each, weights of 1 and the share's d h; the rest as one device."""
    h, k, e = config.hidden_size, config.num_experts_per_tok, config.num_experts
    inner = config.moe_intermediate_size // tp
    pairs = k / ep  # this rank's pairs a token (all k without expert parallelism)
    terms = 2 * k + 1  # d h rows a token: k for d g, k for d u, the router's
    if ep == 1:
        floats = 2 * e + 3 * k * h + 3 * k * inner + 2 * terms * h + terms + h + 2 * k + 2 * k * inner / e
    else:
        floats = (2 * e + 3 * pairs * h + 3 * pairs * inner + 2 * pairs * h + h + 2 * terms * h / ep + terms / ep
                  + h / ep + 2 * k + 2 * k * inner / e)
    return round(4 * floats + 4 * k + 4 * k + 8 * pairs + 4 * pairs + 4 * terms / ep)


@dataclass(frozen=True)
class Layout:
    """tp x ep ranks hold one model (ep: expert parallelism, whole experts per rank), dp replicas of it."""

    tp: int = 1
    dp: int = 1
    ep: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.ep * self.dp

    def __post_init__(self):
        for name in ("tp", "dp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"memory: {name} must be a positive integer, got {value!r}")


def parse_layouts(text: str) -> list[Layout]:
    """"8x1,4x2,4x2x1" -> [Layout(8, 1), Layout(4, 2), Layout(4, 1, ep=2)]: TPxDP, or TPxEPxDP with expert
    parallelism; a bad item is an InputError naming it."""
    layouts = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) not in (2, 3) or not all(part.isdigit() for part in parts):
            raise InputError(f"{item!r} is not TPxDP or TPxEPxDP (for example 8x1,4x2,1x8,4x2x1)")
        numbers = [int(part) for part in parts]
        layouts.append(Layout(numbers[0], numbers[-1], numbers[1] if len(numbers) == 3 else 1))
    return layouts


@dataclass(frozen=True)
class Workload:
    micro_batch_tokens: int = 16384   # tokens of one micro-batch (OptimiserSettings' default)
    kv_tokens: int = 0                # tokens the engine's KV cache holds (0: no rollout, SFT)


def check_layout(config: ModelConfig, layout: Layout) -> None:
    """The fields a training layout must divide (model/parallel.py's and model/expert_parallel.py's rules)."""
    from rlportable.model.expert_parallel import ExpertParallel
    from rlportable.model.parallel import TensorParallel

    TensorParallel(0, layout.tp).check(config, trainable=True)
    ExpertParallel(0, layout.ep).check(config)


def components(config: ModelConfig, layout: Layout, work: Workload) -> dict[str, int]:
    """Bytes per rank of each part of the state (see the module docstring)."""
    check_layout(config, layout)
    t, r = layout.tp, layout.dp
    h, d, layers = config.hidden_size, config.head_dim, config.num_hidden_layers
    hq, hkv = config.num_attention_heads // t, max(config.num_key_value_heads // t, 1)
    inter, vocab = config.intermediate_size // t, config.vocab_size // t
    sparse = sum(config.sparse_layer(i) for i in range(layers))
    dense = layers - sparse
    # projections as (rows N, columns K) on this rank: column-parallel q/k/v, gate/up; row-parallel o, down
    attention = [((hq + 2 * hkv) * d, h), (h, hq * d)]
    mlp = [(2 * inter, h), (h, inter)]
    projections = attention + (mlp if dense else [])
    # a sparse layer: the router whole on every rank, every expert of this rank (E / EP of them) cut like a
    # dense MLP
    routed = config.num_experts if sparse else 0
    experts = routed // layout.ep
    moe_inter = config.moe_intermediate_size // t if sparse else 0
    expert = [(2 * moe_inter, h), (h, moe_inter)]
    router = (routed, h)
    norms = 2 * h + (2 * d if config.qk_norm else 0)
    attention_params = sum(n * k for n, k in attention)
    dense_layer = attention_params + sum(n * k for n, k in mlp) + norms
    sparse_layer = attention_params + routed * h + experts * sum(n * k for n, k in expert) + norms
    embed = vocab * h
    lm_head = 0 if config.tie_word_embeddings else vocab * h
    params = dense * dense_layer + sparse * sparse_layer + embed + lm_head + h
    moe_forward = routed * _pad(h) + experts * sum(n * _pad(k) for n, k in expert)
    moe_transposed = h * _pad(routed) + experts * sum(k * _pad(n) for n, k in expert)
    forward = (layers * sum(n * _pad(k) for n, k in attention) + dense * sum(n * _pad(k) for n, k in mlp)
               + sparse * moe_forward + vocab * _pad(h))
    # the LM head's input gradient uses the whole head under tensor parallelism (all-gathered, float32 too)
    whole_vocab = config.vocab_size if t > 1 else vocab
    transposed = (layers * sum(k * _pad(n) for n, k in attention) + dense * sum(k * _pad(n) for n, k in mlp)
                  + sparse * moe_transposed + h * _pad(whole_vocab))
    whole_lm_head = 4 * config.vocab_size * h if t > 1 else 0
    largest = max(embed, lm_head, max(n * k for n, k in projections + ([router] + expert if sparse else [])))
    tokens = work.micro_batch_tokens
    activations = 4 * tokens * (h * (layers + 1) + hq * d * layers)
    activations += 24 * tokens * hq * layers  # the attention forward's row statistics (m, L, delta: float64)
    # one layer's recompute and backward at a time: the larger of a dense layer's and a sparse layer's
    layer_mlp = max(4 * LAYER_WORKING_SET * 2 * inter if dense else 0,
                    moe_block_activations(config, t, layout.ep) if sparse else 0)
    activations += tokens * (4 * LAYER_WORKING_SET * (h + (hq + 2 * hkv) * d) + layer_mlp)
    activations += tokens * (6 * hq + 4 * hkv) * _pad(d)  # the attention backward's int8 digit tiles (CUDA)
    activations += 4 * min(tokens, LM_HEAD_ROW_CHUNK) * whole_vocab * 2  # logits and their gradient, whole rows
    kv = layers * 2 * hkv * (WEIGHT_DIGITS * _pad(d) + 4) * work.kv_tokens
    return {
        "weights": 4 * params,
        "whole lm head": whole_lm_head,
        "encodings": WEIGHT_DIGITS * forward,
        "transposed encodings": WEIGHT_DIGITS * transposed,
        # the backward hands each layer's gradient to the optimiser as it is made (train/data_parallel.py):
        # one layer's, and the embedding's and LM head's, exist at once
        "gradient": 4 * (max(dense_layer if dense else 0, sparse_layer if sparse else 0) + embed + lm_head + h),
        "exchange buffers": 0 if r == 1 else 4 * largest,  # the all-to-all's receive side
        "moments": 2 * 4 * -(-params // r),
        "accumulated gradient": 4 * -(-params // r),
        "activations": activations,
        "kv cache": kv,
    }


#: what the device holds while the engine generates (the whole LM head is gathered for the backward only)
ROLLOUT = ("weights", "encodings", "moments", "kv cache")


def peak(parts: dict[str, int]) -> int:
    """The larger of the rollout phase and the training phase (the KV cache is freed for training)."""
    training = sum(v for k, v in parts.items() if k != "kv cache")
    return max(sum(parts[k] for k in ROLLOUT), training)


def table(shape: str, layouts: list[Layout], work: Workload, layers: int | None = None) -> list[dict]:
    """One row per layout: the components and the peak in GiB, and whether it fits 80 and 141 GB cards."""
    config = shape_config(shape, layers)
    rows = []
    for layout in layouts:
        parts = components(config, layout, work)
        top = peak(parts)
        rows.append({"model": shape, "tp": layout.tp, "ep": layout.ep, "dp": layout.dp, "gpus": layout.gpus,
                     **{k: round(v / GIB, 2) for k, v in parts.items()}, "peak_gib": round(top / GIB, 2),
                     "fits_80gb": top <= 80e9 * 0.95, "fits_141gb": top <= 141e9 * 0.95})
    return rows


SHAPES = tuple(QWEN3_SHAPES) + tuple(QWEN3_MOE_SHAPES)
