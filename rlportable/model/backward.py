"""The trainer's forward and backward through the model, under the contracts.

`forward` runs the packed forward exactly as `Model.logprobs` does (so the
log-prob of every next token is bitwise the engine's), keeping each layer's
input as an activation checkpoint. `backward` takes the loss's gradient with
respect to those log-probs and returns the gradient of every weight.

How gradients are computed (docs/training.md, "Gradients under the contracts"):
  * every matrix product is the exact GEMM (ops.gemm): dX = dY W uses W's
    transpose encoded as a weight (15 bits); dW = dY^T X encodes dY^T rows at
    23 bits and X^T rows at 15 bits; K is cut into fixed chunks of GEMM_K_CHUNK
    whose float32 partial results are added in chunk order (ops.residual.add);
  * each op's backward is its family's backward kernel (norm, rope, attention,
    activation, logprob, embedding; a Qwen3-MoE sparse layer's MLP the moe
    family's block_backward), exact sums inside, under its contract;
  * several contributions to one gradient are added in a fixed order.
So the same batch gives the same gradient bits on every backend and vendor,
and the same run twice gives the same weights.

Per-layer activation checkpointing: each layer's input is kept, and by default
its attention output too (keep_attention: 4 * Hq * D bytes a token a layer, twice
the input's for Qwen3-0.6B); the backward recomputes the rest of the layer's
forward (the same bits) before going through it. The attention is the one
recomputed op whose time grows with the square of the sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from rlportable.contract import moe as moe_reference
from rlportable.errors import InputError
from rlportable.model import expert_parallel, parallel
from rlportable.model.forward import Model, check_packing, next_token_rows, packed_positions
from rlportable.model.weights import LayerWeights, ModelWeights
from rlportable.ops import activation, attention, embedding, gemm, logprob, moe, norm, residual, rope, rowsum
from rlportable.ops.checks import shape_of
from rlportable.ops.gemm import weight_grad, weight_grad_operand

LM_HEAD_ROW_CHUNK = 1024  # next-token rows per LM-head backward pass: the [rows, V] gradient never exists whole


@dataclass
class TrainingForward:
    """What the backward needs from the forward (host arrays, and the device checkpoints)."""

    tokens: np.ndarray         # int32 [T]
    cu_seqlens: np.ndarray     # int64 [S+1]
    positions: np.ndarray      # int32 [T]
    rows: np.ndarray           # int32 [R]: token rows whose next token is predicted
    targets: np.ndarray        # int32 [R]: that next token
    checkpoints: list          # device [T, H]: each layer's input, then the final norm's input
    attention_outputs: list | None  # each layer's (attention output [T, Hq, D], its row_stats or None) (keep_attention)
    picked: object             # device [R, H]: final-norm hidden states of `rows`
    logp: object               # device float32 [R]
    temperature: float
    routing: list | None = None  # Qwen3-MoE: each sparse layer's expert choices, int32 [T, k] (host)
    aux_loss: float | None = None  # the load-balancing loss's value (host float64), set by a backward that adds it


def forward(model: Model, tokens, cu_seqlens, temperature: float = 1.0, rows=None,
            keep_attention: bool = True) -> TrainingForward:
    """Packed forward keeping activation checkpoints; logp[r] = log P(tokens[rows[r] + 1] | tokens up to
    rows[r]). rows (token indices, each followed by a token of its own sequence) defaults to every
    next-token row; a trainer passes only the completion tokens' rows. keep_attention: keep each
    layer's attention output (and its m and L, where the kernel gives them) too, so that the backward runs
    neither the attention forward nor its statistics pass again."""
    backend = model.backend
    tokens = np.asarray(tokens, dtype=np.int32)
    cu_seqlens = check_packing(tokens, cu_seqlens, model.config.vocab_size)
    temperature = logprob.check_temperature(temperature)
    positions = packed_positions(cu_seqlens).astype(np.int32)
    checkpoints: list = []
    kept: list | None = [] if keep_attention else None
    if kept is None:
        attend = model.packed_attention(cu_seqlens)
    else:
        def attend(q, k, v, index, packed=model.packed_attention(cu_seqlens, keep_stats=True)):
            kept.append(packed(q, k, v, index))  # (o, row_stats): the backward skips its statistics pass
            return kept[-1][0]
    routing: list | None = [] if model.config.is_moe else None
    hidden = model._forward(tokens, positions, attend, saved=checkpoints, routing=routing)
    rows, targets = next_token_rows(tokens, cu_seqlens) if rows is None else _check_rows(rows, cu_seqlens, tokens)
    rows = rows.astype(np.int32)
    picked = embedding.gather(backend, hidden, backend.asarray(rows), host_ids=rows)
    if model.tp.size > 1:
        logp = parallel.vocab_parallel_logprobs(backend, model.tp_group, picked, model.lm_head, model.vocab_start,
                                                backend.asarray(targets), temperature)
    else:
        logp = logprob.lm_head_logprobs(backend, picked, model.lm_head, backend.asarray(targets), temperature)
    return TrainingForward(tokens, cu_seqlens, positions, rows, targets, checkpoints, kept, picked, logp,
                           temperature, routing)


def _check_rows(rows, cu_seqlens: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows = np.asarray(rows, dtype=np.int64)
    if rows.ndim != 1:
        raise InputError(f"forward: rows must be one-dimensional, got shape {rows.shape}")
    inside = rows.size == 0 or (rows.min() >= 0 and rows.max() < tokens.size)
    if not inside or (rows.size and np.any(rows + 1 >= cu_seqlens[np.searchsorted(cu_seqlens, rows, side="right")])):
        raise InputError("forward: every row must be a token followed by another token of its own sequence")
    return rows, tokens[rows + 1].astype(np.int32)


def backward(model: Model, fwd: TrainingForward, grad_logp: np.ndarray, on_layer=None,
             aux_scale: float = 0.0) -> ModelWeights:
    """Gradients of sum_r grad_logp[r] * logp[r] with respect to every weight (device float32,
    shaped like model.params; a tied lm_head's gradient is the embedding's, summed). on_layer(index,
    LayerWeights): takes each layer's gradients as soon as they exist (last layer first), which the
    result then leaves out (its layers list is empty). aux_scale (Qwen3-MoE): nonzero adds aux_scale
    times the load-balancing loss of this forward's router rows (contract.moe.load_balancing_coefficients;
    its gradient enters each sparse layer's router logits), and sets fwd.aux_loss to the loss's value."""
    if not model.trainable:
        raise InputError("backward: build the Model with trainable=True (the trainer needs its float32 weights)")
    grad_logp = np.asarray(grad_logp, dtype=np.float32)
    if grad_logp.shape != fwd.rows.shape:
        raise InputError(f"backward: grad_logp has shape {grad_logp.shape}, expected {fwd.rows.shape} "
                         "(one value per predicted token)")
    backend, cfg, params = model.backend, model.config, model.params
    d_picked_full, d_lm_head = _lm_head_backward(model, fwd, grad_logp)
    x_final = fwd.checkpoints[-1]
    dx, d_final_norm = norm.rmsnorm_backward(backend, x_final, params.final_norm, cfg.rms_norm_eps, d_picked_full)
    layer_grads: list[LayerWeights] = [None] * len(model.layers)  # type: ignore[list-item]
    aux = None
    if aux_scale and fwd.routing:  # the counts of every sparse layer's choices before any layer's backward
        aux = moe_reference.load_balancing_coefficients(fwd.routing, cfg.num_experts, aux_scale)
        probability_sums = np.zeros(cfg.num_experts)
    for index in reversed(range(len(model.layers))):
        dx, grads, logits = _layer_backward(model, index, fwd, dx, aux)
        if aux is not None and logits is not None:
            probability_sums += moe_reference.router_probability_sums(backend.to_numpy(logits))
        if on_layer is None:
            layer_grads[index] = grads
        else:
            on_layer(index, grads)
    if on_layer is not None:
        layer_grads = []
    if aux is not None:
        fwd.aux_loss = moe_reference.load_balancing_loss(fwd.routing, probability_sums)
    d_embed = _embedding_backward(model, fwd.tokens, dx)
    if params.tied:
        d_embed = residual.add(backend, d_embed, d_lm_head)
        d_lm_head = d_embed
    return ModelWeights(embed=d_embed, layers=layer_grads, final_norm=d_final_norm, lm_head=d_lm_head)


def _embedding_backward(model: Model, tokens: np.ndarray, dx):
    """d embedding [V, H], or this rank's vocabulary rows of it: the rows of the tokens it owns, each a
    sum over its tokens in increasing token index (the single-device sums)."""
    backend = model.backend
    if model.tp.size == 1:
        return embedding.gather_backward(backend, backend.asarray(tokens), tokens, dx, model.config.vocab_size)
    rows = model.tp.columns(model.config.vocab_size)
    mine = np.flatnonzero((tokens >= rows.start) & (tokens < rows.stop)).astype(np.int32)
    ids = (tokens[mine] - rows.start).astype(np.int32)
    dy = embedding.gather(backend, dx, backend.asarray(mine), host_ids=mine)
    return embedding.gather_backward(backend, backend.asarray(ids), ids, dy, rows.stop - rows.start)


# ----------------------------------------------------------------------------- LM head and log-prob


def _lm_head_backward(model: Model, fwd: TrainingForward, grad_logp: np.ndarray):
    """(d final hidden [T, H], d lm_head [V, H]) from the log-prob gradients, LM_HEAD_ROW_CHUNK rows at a time."""
    backend, sharded = model.backend, model.tp.size > 1
    tokens, hidden_size = shape_of(fwd.checkpoints[-1])
    vocab = model.tp.columns(model.config.vocab_size)
    # under tensor parallelism: whole logit rows for the softmax's backward, the whole LM head for dX
    lm_head = model.whole_lm_head() if sharded else model.params.lm_head
    d_hidden = d_weight = None
    for start in range(0, fwd.rows.size, LM_HEAD_ROW_CHUNK):
        stop = min(start + LM_HEAD_ROW_CHUNK, fwd.rows.size)
        picked = fwd.picked[start:stop]
        logits = gemm.gemm(backend, picked, model.lm_head)
        if sharded:
            logits = parallel.whole_columns(backend, model.tp_group, logits)
        d_logits = logprob.logprobs_backward(backend, logits, backend.asarray(fwd.targets[start:stop]),
                                             fwd.temperature, backend.asarray(grad_logp[start:stop]))
        d_picked = input_grad(model, d_logits, lm_head)
        rows = fwd.rows[start:stop]
        d_rows = embedding.gather_backward(backend, backend.asarray(rows), rows, d_picked, tokens)  # scatter
        d_hidden = _accumulate(backend, d_hidden, d_rows)
        if sharded:
            d_logits = parallel.take_columns(backend, d_logits, vocab.start, vocab.stop)
        d_weight = _accumulate(backend, d_weight, weight_grad(backend, d_logits, picked))
    if d_hidden is None:  # no predicted token at all: zero gradients
        d_hidden = backend.zeros((tokens, hidden_size), np.float32)
        d_weight = backend.zeros(shape_of(model.params.lm_head), np.float32)
    return d_hidden, d_weight


def _accumulate(backend, total, part):
    return part if total is None else residual.add(backend, total, part)


# ----------------------------------------------------------------------------- matrix products


def input_grad(model: Model, dy, w):
    """dX = dY W for y = x W^T (ops/gemm.py input_grad), W^T's encodings from the model's cache."""
    return gemm.input_grad(model.backend, dy, w, model.transposed_weight)


def column_input_grad(model: Model, dy, w):
    """input_grad of a column-parallel weight: under tensor parallelism dY and W are shards of the
    summed axis, so the product is the row-parallel gemm (exact partial sums, one all-reduce)."""
    if model.tp.size == 1:
        return input_grad(model, dy, w)
    # one exact product, not K chunks: TensorParallel.check keeps the outputs within GEMM_K_CHUNK
    return parallel.row_parallel_gemm(model.backend, model.tp_group, dy, model.transposed_column_shard(w))


def bias_grad(backend, dy):
    """d bias [N] = sum over tokens of dY [M, N]: the exact row sum of dY^T."""
    return rowsum.rowsum(backend, residual.transpose(backend, dy))


# ----------------------------------------------------------------------------- one decoder layer


def _recompute(model: Model, index: int, fwd: TrainingForward, x) -> dict:
    """The layer's forward again from its checkpointed input (the same ops, so the same bits),
    with its intermediate values; the attention output is the forward's when it was kept."""
    cos, sin = model.rope_tables(int(fwd.positions.max()) + 1 if fwd.positions.size else 1)
    positions = (model.backend.asarray(fwd.positions), fwd.positions)
    record: dict = {}
    if fwd.attention_outputs is not None:
        def attend(q, k, v):
            return fwd.attention_outputs[index][0]
    else:
        def attend(q, k, v, packed=model.packed_attention(fwd.cu_seqlens)):
            return packed(q, k, v, index)
    model._layer(model.layers[index], x, positions, cos, sin, attend, record)
    return record


def _layer_backward(model: Model, index: int, fwd: TrainingForward, d_out, aux=None):
    """(d layer input, the layer's weight gradients, a sparse layer's router logits or None) from d layer
    output; aux: the load-balancing loss's coefficients for a sparse layer's block_backward."""
    cfg, backend = model.shape, model.backend  # this rank's heads and columns under tensor parallelism
    w = model.params.layers[index]
    x = fwd.checkpoints[index]
    t = shape_of(x)[0]
    f = SimpleNamespace(**_recompute(model, index, fwd, x))
    grads: dict = {}
    logits = None
    if w.router is not None:  # a sparse layer: out = x2 + moe_block(h2), its contract's backward
        if model.ep.size > 1:  # this rank's whole experts, rows exchanged with the others: the same bits
            moe_grads = expert_parallel.moe_block_backward(
                backend, model.ep_group, model.tp_group, f.h2, w.router, w.expert_gate, w.expert_up, w.expert_down,
                model.layers[index].moe, d_out, model.transposed_weight, model.transposed_column_shard, aux=aux)
        elif model.tp.size > 1:  # the router whole, every expert's shards: the same bits as one device
            moe_grads = parallel.moe_block_backward(backend, model.tp_group, f.h2, w.router, w.expert_gate,
                                                    w.expert_up, w.expert_down, model.layers[index].moe, d_out,
                                                    model.transposed_weight, model.transposed_column_shard, aux=aux)
        else:
            moe_grads = moe.block_backward(backend, f.h2, w.router, w.expert_gate, w.expert_up, w.expert_down,
                                           model.config.num_experts_per_tok, model.config.norm_topk_prob, d_out,
                                           weight=model.layers[index].moe, transposed=model.transposed_weight,
                                           aux=aux)

        def put(array):  # the cpu reference gives host arrays, a device the backend's own
            return backend.asarray(array) if isinstance(array, np.ndarray) else array

        grads.update(router=put(moe_grads.d_router), expert_gate=[put(a) for a in moe_grads.d_gate],
                     expert_up=[put(a) for a in moe_grads.d_up], expert_down=[put(a) for a in moe_grads.d_down],
                     gate=None, up=None, down=None)
        d_h2 = put(moe_grads.d_h)
        logits = moe_grads.logits
    else:  # MLP: out = x2 + swiglu(h2 Wg^T, h2 Wu^T) Wd^T
        grads["down"] = weight_grad(backend, d_out, f.mlp)
        d_gate, d_up = activation.swiglu_backward(backend, f.gate, f.up, input_grad(model, d_out, w.down))
        h2_operand = weight_grad_operand(backend, f.h2)
        grads["gate"] = weight_grad(backend, d_gate, f.h2, h2_operand)
        grads["up"] = weight_grad(backend, d_up, f.h2, h2_operand)
        d_h2 = residual.add(backend, column_input_grad(model, d_gate, w.gate), column_input_grad(model, d_up, w.up))
    d_x2, grads["mlp_norm"] = norm.rmsnorm_backward(backend, f.x2, w.mlp_norm, cfg.rms_norm_eps, d_h2)
    d_x2 = residual.add(backend, d_out, d_x2)
    # attention: x2 = x + attn(rope(norm(h1 Wq^T)), rope(norm(h1 Wk^T)), h1 Wv^T) Wo^T
    a_flat = f.a.reshape(t, cfg.num_attention_heads * cfg.head_dim)
    grads["o"] = weight_grad(backend, d_x2, a_flat)
    d_a = input_grad(model, d_x2, w.o).reshape(t, cfg.num_attention_heads, cfg.head_dim)
    row_stats = fwd.attention_outputs[index][1] if fwd.attention_outputs is not None else None
    d_q, d_k, d_v = attention.attention_packed_backward(backend, f.q, f.k, f.v, d_a, fwd.cu_seqlens, o=f.a,
                                                        row_stats=row_stats)
    d_q_lin = _head_backward(model, f.q_lin, w.q_norm, d_q, fwd, grads, "q_norm")
    d_k_lin = _head_backward(model, f.k_lin, w.k_norm, d_k, fwd, grads, "k_norm")
    d_v_lin = d_v.reshape(t, cfg.num_key_value_heads * cfg.head_dim)
    d_h1, h1_operand = None, weight_grad_operand(backend, f.h1)
    for name, d_lin in (("q", d_q_lin), ("k", d_k_lin), ("v", d_v_lin)):
        grads[name] = weight_grad(backend, d_lin, f.h1, h1_operand)
        if getattr(w, f"{name}_bias") is not None:
            grads[f"{name}_bias"] = bias_grad(backend, d_lin)
        d_h1 = _accumulate(backend, d_h1, column_input_grad(model, d_lin, getattr(w, name)))
    d_x, grads["attn_norm"] = norm.rmsnorm_backward(backend, x, w.attn_norm, cfg.rms_norm_eps, d_h1)
    return residual.add(backend, d_x2, d_x), LayerWeights(**grads), logits


def _head_backward(model: Model, lin, head_norm, d_rotated, fwd: TrainingForward, grads: dict, norm_name: str):
    """Through RoPE and (Qwen3) the per-head QK-norm back to the projection's output [T, heads * D].
    Under tensor parallelism the norm's weight gradient sums over every rank's heads: it is taken from
    the whole heads (gathered copies), the same on every rank, and each rank keeps its heads' d_lin."""
    cfg, backend = model.config, model.backend
    t, heads, dim = shape_of(d_rotated)
    cos, sin = model.rope_tables(int(fwd.positions.max()) + 1 if fwd.positions.size else 1)
    d_normed = rope.apply_backward(backend, d_rotated, backend.asarray(fwd.positions), cos, sin, fwd.positions)
    if head_norm is None:
        return d_normed.reshape(t, heads * dim)
    size = model.tp.size
    if size > 1:
        lin = parallel.whole_columns(backend, model.tp_group, lin.reshape(t, heads * dim))
        d_normed = parallel.whole_columns(backend, model.tp_group, d_normed.reshape(t, heads * dim))
    d_lin, grads[norm_name] = norm.rmsnorm_heads_backward(backend, lin.reshape(t, heads * size, dim), head_norm,
                                                          cfg.rms_norm_eps, d_normed.reshape(t, heads * size, dim))
    d_lin = d_lin.reshape(t, heads * size * dim)
    if size > 1:
        d_lin = parallel.take_columns(backend, d_lin, model.tp.rank * heads * dim, (model.tp.rank + 1) * heads * dim)
    return d_lin
