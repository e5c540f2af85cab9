"""Tensor parallelism: how a model is cut over ranks, and the exact collectives between the cuts.

Megatron's layout, one rank per GPU (docs/parallelism.md, "Megatron's layout"):
  * column-parallel q/k/v (whole heads), gate and up: rank r computes its own output columns. Each
    output element depends on one activation row and one weight row, both whole on every rank:
    the same bits as one device, with no communication.
  * row-parallel o and down: rank r holds a K-shard of the activation row and of every weight row.
    The gemm contract is exact in K: every rank encodes its shard with the exponent of the WHOLE
    row (all-reduce MAX of the row exponents), computes the exact integer partial sums, and the
    int64 sums are all-reduced (SUM) and rounded once: bitwise the single-device gemm.
  * vocabulary-parallel embedding: a rank copies the rows of the ids it owns and +0 bits
    elsewhere; the uint32 SUM of the bit patterns is the gather (one owner per id).
  * vocabulary-parallel LM head: logits shards are exact (column-parallel). The engine's sampler
    reads whole rows: the shards are all-gathered (a copy). The trainer's log-prob never builds a
    whole row: MAX of the rows' maximum keys, SUM of the int64 fixed-point exp sums and of the
    target's bits, then the contract's last step: bitwise logprob.logprobs of the whole row.
Norms, RoPE, residual adds and attention are per row or per head: every rank runs them on the
rows and heads it has, identically.

A Qwen3-MoE sparse layer (moe_block, moe_block_backward below): the router is held whole and computed by
every rank from the whole rows, so every rank picks the same experts; each expert is cut as a dense
MLP (gate/up column-parallel over moe_intermediate_size, down row-parallel), with one all-reduce of
the int64 sums over all experts' gathered rows per layer; the combine runs on every rank. Its backward
follows the dense rules below: the router's gradient replicated, one all-reduce of the d g / d u sums.

The trainer's backward under the same layout (model/backward.py, docs/parallelism.md):
  * a column-parallel weight's input gradient dX = dY W sums over the rank's output columns: it is
    a row-parallel gemm of dY's column shard with W's transposed shard, encoded with the whole
    rows' exponents (row_parallel_gemm): bitwise the single-device product;
  * a row-parallel weight's input gradient and every weight gradient are the rank's own rows or
    columns of the single-device result: no communication;
  * the LM head: the log-prob's backward reads whole logit rows (whole_columns), the input gradient
    uses the whole LM head (all-gathered once per update), each rank keeps its vocabulary rows of
    the weight gradient;
  * the QK-norm weights are shared by all heads: their gradient is computed from the whole heads
    (whole_columns), identically on every rank; the embedding's from the tokens each rank owns.
Training needs the KV heads divisible by the TP size (a shared KV head's gradient would be split).

What must divide: the query heads, the intermediate size (a MoE model's moe_intermediate_size, and its
intermediate_size where some layer is dense) and the vocabulary by the TP size; the
key/value heads either by the TP size or the TP size by them (then ranks share a KV head, each
keeping a copy, as vLLM does).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from rlportable.contract import fixedpoint as fixedpoint_reference, moe as moe_reference
from rlportable.contract.exact import GEMM_K_CHUNK
from rlportable.errors import InputError
from rlportable.model.config import ModelConfig
from rlportable.model.weights import ModelWeights
from rlportable.ops import activation, embedding, fixedpoint, gemm, logprob, moe
from rlportable.ops.checks import shape_of
from rlportable.runtime.collectives import Group, SingleGroup

#: rows of the LM head handled at once by the vocabulary-parallel log-prob (its [rows, V / size]
#: logits shard is the largest buffer); any value gives the same bits
LOGPROB_BLOCK_ROWS = 1024


@dataclass(frozen=True)
class GroupRank:
    """Rank `rank` of the `size` ranks of one parallel group (TensorParallel, expert_parallel.ExpertParallel)."""

    rank: int
    size: int

    @classmethod
    def of(cls, group: Group | None):
        """This rank's place in `group` (None: the one rank of one)."""
        group = group or SingleGroup()
        return cls(group.rank, group.size)


@dataclass(frozen=True)
class TensorParallel(GroupRank):
    """Rank `rank` of `size`: which heads, columns and vocabulary rows it holds."""

    def check(self, config: ModelConfig, trainable: bool = False) -> None:
        """An InputError naming every field the layout cannot cut (training has two more rules)."""
        size = self.size
        problems = []
        fields = ["num_attention_heads", "intermediate_size", "vocab_size"]
        if config.is_moe:  # every expert is cut like a dense MLP; intermediate_size only matters for dense layers
            fields[1:2] = ["moe_intermediate_size"] + (["intermediate_size"] if any(
                not config.sparse_layer(i) for i in range(config.num_hidden_layers)) else [])
        for field in fields:
            if getattr(config, field) % size:
                problems.append(f"{field}={getattr(config, field)} is not divisible by the TP size {size}")
        kv = config.num_key_value_heads
        if kv % size and size % kv:
            problems.append(f"num_key_value_heads={kv} and the TP size {size}: neither divides the other")
        elif trainable and size > 1 and kv % size:
            # ranks sharing a KV head would each hold a part of its gradient
            problems.append(f"training needs num_key_value_heads ({kv}) divisible by the TP size ({size})")
        if trainable and size > 1:
            widest = max(config.intermediate_size, config.num_attention_heads * config.head_dim,
                         config.moe_intermediate_size if config.is_moe else 0)
            if widest > GEMM_K_CHUNK:  # the column-parallel input gradient is one exact product
                problems.append(f"training needs the column-parallel outputs (intermediate_size, "
                                f"{'moe_intermediate_size, ' if config.is_moe else ''}heads x head_dim "
                                f"= {widest}) at most {GEMM_K_CHUNK}")
        if problems:
            raise InputError(f"tensor parallelism: {'; '.join(problems)}")

    # ---- what this rank holds
    def q_heads(self, config: ModelConfig) -> range:
        per = config.num_attention_heads // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def kv_heads(self, config: ModelConfig) -> range:
        kv = config.num_key_value_heads
        if kv >= self.size:
            per = kv // self.size
            return range(self.rank * per, (self.rank + 1) * per)
        first = self.rank * kv // self.size  # size/kv ranks share (and each keep) one KV head
        return range(first, first + 1)

    def columns(self, total: int) -> slice:
        per = total // self.size
        return slice(self.rank * per, (self.rank + 1) * per)

    def vocab_start(self, config: ModelConfig) -> int:
        return self.columns(config.vocab_size).start

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The shapes one rank computes with (the vocabulary stays whole: ids are global)."""
        return dataclasses.replace(config, num_attention_heads=len(self.q_heads(config)),
                                   num_key_value_heads=len(self.kv_heads(config)),
                                   intermediate_size=config.intermediate_size // self.size,
                                   moe_intermediate_size=config.moe_intermediate_size // self.size)


def _head_rows(heads: range, head_dim: int) -> slice:
    return slice(heads.start * head_dim, heads.stop * head_dim)


def _cut(config: ModelConfig, plan: TensorParallel, name: str) -> tuple[int | None, slice]:
    """(axis, the rank's slice of it) of a tensor by its Hugging Face name; axis None: held whole."""
    axis = tensor_axis(name)
    d = config.head_dim
    if "q_proj" in name or "o_proj" in name:
        cut = _head_rows(plan.q_heads(config), d)
    elif "k_proj" in name or "v_proj" in name:
        cut = _head_rows(plan.kv_heads(config), d)
    elif ".experts." in name:
        cut = plan.columns(config.moe_intermediate_size)
    elif "mlp." in name:
        cut = plan.columns(config.intermediate_size)
    else:  # the embedding and the LM head (the norms: not cut)
        cut = plan.columns(config.vocab_size)
    return (None if plan.size == 1 else axis), cut


def shard_shape(config: ModelConfig, plan: TensorParallel, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of this rank's shard of a tensor of the whole `shape`."""
    axis, cut = _cut(config, plan, name)
    if axis is None:
        return tuple(shape)
    return tuple(cut.stop - cut.start if i == axis else n for i, n in enumerate(shape))


def shard_tensor(config: ModelConfig, plan: TensorParallel, name: str, array: np.ndarray) -> np.ndarray:
    """This rank's shard of one whole host tensor, by its Hugging Face name (the array itself for the norms)."""
    axis, cut = _cut(config, plan, name)
    if axis is None:
        return array
    return np.ascontiguousarray(array[cut] if axis == 0 else array[:, cut])


def shard_weights(weights: ModelWeights, config: ModelConfig, plan: TensorParallel) -> ModelWeights:
    """This rank's host weights."""
    from rlportable.model.weights import from_named

    if plan.size == 1:
        return weights
    plan.check(config)
    return from_named(config, {name: shard_tensor(config, plan, name, array)
                               for name, array in weights.named_tensors(config).items()})


def tensor_axis(name: str) -> int | None:
    """The axis along which a tensor (by Hugging Face name) is cut over the ranks: 0 for the
    column-parallel projections (the experts' gate and up too), their biases and the vocabulary; 1 for
    the row-parallel o and down (every expert's); None for the norm weights and a MoE router (mlp.gate),
    which every rank holds whole."""
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 1
    return None if "norm" in name or name.endswith("mlp.gate.weight") else 0


def unshard(backend, tp_group: Group, name: str, local, keep: bool = True):
    """The whole tensor `name` from every rank's shard (all-gathered, a copy), as a host array, or None
    where keep is False (every rank must call: the gather is collective)."""
    axis = tensor_axis(name)
    if tp_group.size == 1 or axis is None:
        return backend.to_numpy(local) if keep else None
    parts = tp_group.all_gather(local)
    if not keep:
        return None
    return np.concatenate(list(backend.to_numpy(parts)), axis=axis)


# ---- the exact collectives of the forward
def shared_exponents(backend, tp_group: Group, x):
    """Per row, the exponent of the whole row of which x [rows, K / size] is this rank's shard."""
    return tp_group.all_reduce(fixedpoint.row_exponents(backend, x), "max")


def encode_row_parallel_weight(backend, tp_group: Group, w) -> gemm.GemmWeight:
    """A row-parallel weight's K-shard [N, K / size], encoded with its whole rows' exponents."""
    return gemm.encode_weight(backend, w, exponents=shared_exponents(backend, tp_group, w))


def row_parallel_gemm(backend, tp_group: Group, x, weight: gemm.GemmWeight, bits_a: int = gemm.DEFAULT_BITS_A):
    """Y [M, N] = X @ W.T from K-shards of X and W, bitwise gemm.gemm of the whole operands."""
    exponents = shared_exponents(backend, tp_group, x)
    encoded = fixedpoint.encode_rows(backend, x, bits_a, exponents=exponents)
    sums = tp_group.all_reduce(gemm.gemm_sums(backend, encoded, weight), "sum")
    return gemm.round_sums(backend, sums, exponents, bits_a, weight)


def embed_tokens(backend, tp_group: Group, table_shard, vocab_start: int, device_ids, host_ids):
    """Rows of the whole embedding table from the vocabulary shards (one owner per id)."""
    part = embedding.gather_shard(backend, table_shard, device_ids, vocab_start, host_ids=host_ids)
    return tp_group.all_reduce(part.view(np.uint32), "sum").view(np.float32)


def whole_columns(backend, tp_group: Group, logits_shard):
    """[rows, C] from every rank's [rows, C / size] in rank order (an all-gather and a row gather: bit
    copies): the whole logits from their vocabulary shards, the whole heads from each rank's heads."""
    rows, per = logits_shard.shape
    size = tp_group.size
    parts = tp_group.all_gather(logits_shard).reshape(size * rows, per)  # part p's row r at p * rows + r
    order = (np.arange(rows * size) % size) * rows + np.arange(rows * size) // size  # row r, part p at r*size+p
    order = order.astype(np.int32)
    return embedding.gather(backend, parts, backend.asarray(order), host_ids=order).reshape(rows, size * per)


def take_columns(backend, x, start: int, stop: int):
    """x[:, start:stop] of a [rows, C] array, contiguous (two transposes: bit copies)."""
    from rlportable.ops import residual

    return residual.transpose(backend, residual.transpose(backend, x)[start:stop])


def _by_blocks(backend, rows: int, compute):
    """compute(start, stop) -> float32 [stop - start] over blocks of LOGPROB_BLOCK_ROWS rows, joined."""
    out = [compute(start, min(rows, start + LOGPROB_BLOCK_ROWS)) for start in range(0, rows, LOGPROB_BLOCK_ROWS)]
    if len(out) == 1:
        return out[0]
    return backend.asarray(np.concatenate([backend.to_numpy(part) for part in out])) if out else \
        backend.empty((0,), np.float32)


def vocab_parallel_logprobs(backend, tp_group: Group, hidden, lm_head_shard: gemm.GemmWeight, vocab_start: int,
                            targets, temperature: float):
    """float32 [rows]: logprob.lm_head_logprobs of the whole vocabulary, bitwise, from the shards."""
    def block(start, stop):
        logits = gemm.gemm(backend, hidden[start:stop], lm_head_shard)
        keys = tp_group.all_reduce(logprob.shard_max_keys(backend, logits, temperature), "max")
        sums = logprob.shard_sums(backend, logits, keys, targets[start:stop], vocab_start, temperature)
        return logprob.shard_finish(backend, tp_group.all_reduce(sums, "sum"), keys)

    return _by_blocks(backend, hidden.shape[0], block)


def vocab_parallel_entropy(backend, tp_group: Group, hidden, lm_head_shard: gemm.GemmWeight, temperature: float):
    """float32 [rows]: the entropy of logits / T over the whole vocabulary, bitwise logprob.entropy, from
    whole logit rows gathered block by block (copies; the entropy's sums run over the whole row)."""
    def block(start, stop):
        logits = gemm.gemm(backend, hidden[start:stop], lm_head_shard)
        return logprob.entropy(backend, whole_columns(backend, tp_group, logits), temperature)

    return _by_blocks(backend, hidden.shape[0], block)


# ---- a Qwen3-MoE sparse layer: the router whole, every expert cut as a dense MLP
def expert_down_exponents(backend, tp_group: Group, downs: list) -> list:
    """Per expert, its down shard's [H, I / size] whole-row exponents (int32 [H] on the backend): one
    all-reduce MAX for all of a layer's experts, so each shard encodes as a K-shard of the whole weight."""
    held = [e for e, w in enumerate(downs) if w is not None]  # the same on the TP ranks (one EP rank's experts)
    local = np.stack([fixedpoint_reference.row_exponents(w) if isinstance(w, np.ndarray)
                      else backend.to_numpy(fixedpoint.row_exponents(backend, w)) for w in (downs[e] for e in held)])
    shared = backend.to_numpy(tp_group.all_reduce(backend.asarray(local), "max"))
    out = [None] * len(downs)
    for e, row in zip(held, shared):
        out[e] = backend.asarray(np.ascontiguousarray(row))
    return out


def moe_block(backend, tp_group: Group, h, weight: moe.MoeWeight, encoded=None, bits_a: int = gemm.DEFAULT_BITS_A):
    """(out [T, H], experts int32 [T, k], weights float32 [T, k]): ops.moe.block of the whole h [T, H],
    bitwise, from this rank's column shards of every expert's gate/up and K-shards of its down (weight:
    encoded with the whole rows' exponents, expert_down_exponents).

    The router is whole and h is whole on every rank: the same logits, the same experts everywhere. The
    (token, slot) pairs' rows are grouped by expert as ops.moe.expert_outputs does; each expert's gate/up
    and SwiGLU give this rank's columns of its activation rows, whose whole-row exponents come from one
    all-reduce MAX over every pair; each expert's gemm_sums fills its run of one int64 [T k, H] buffer,
    all-reduced once (SUM) and rounded per expert (round_sums): each expert row is the unsharded down
    product's bits, the combine's inputs are the single device's."""
    t, hidden = shape_of(h)
    logits = gemm.gemm(backend, h, weight.router, encoded=encoded)
    experts, weights = moe.route(backend, logits, weight.top_k, weight.norm_topk_prob)
    k = weight.top_k
    if t * k == 0 or hidden == 0:  # the same on every rank (T is): no collective is skipped by one alone
        return moe.combine(backend, weights, backend.zeros((t, k, hidden), np.float32)), experts, weights
    groups = list(moe_reference.expert_groups(backend.to_numpy(experts)))
    outputs = _sharded_experts(backend, tp_group, h, weight, groups, t, bits_a)[0]
    return moe.combine(backend, weights, outputs), experts, weights


def _sharded_experts(backend, tp_group: Group, h, weight: moe.MoeWeight, groups: list, t: int,
                     bits_a: int = gemm.DEFAULT_BITS_A):
    """(outputs [T, k, H] whole, order, slot_of, x, saved) as ops.moe._grouped_experts keeping its saved
    (expert, start, stop, g, u, act): g, u, act this rank's columns; the down product row-parallel."""
    k, hidden = weight.top_k, shape_of(h)[1]
    pairs = t * k
    y, order, x, saved = expert_rows(backend, tp_group, h, weight, groups, bits_a)
    slot_of = np.empty(pairs, np.int32)
    slot_of[order] = np.arange(pairs, dtype=np.int32)  # pair p's row in y
    outputs = embedding.gather(backend, y, backend.asarray(slot_of), host_ids=slot_of).reshape(t, k, hidden)
    return outputs, order, slot_of, x, saved


def expert_rows(backend, tp_group: Group, h, weight: moe.MoeWeight, groups: list, bits_a: int = gemm.DEFAULT_BITS_A):
    """(y [n, H], order, x, saved): the rows of the (token, slot) pairs of `groups` (expert_groups' (expert,
    pair indices), some or all of a layer's) through their experts, in the groups' order (order: the pair
    indices; x: h's rows so gathered; saved: (expert, start, stop, g, u, act) per expert). Under tensor
    parallelism g, u and act are this rank's columns and the down product is row-parallel (the whole rows'
    exponents by one all-reduce MAX, one int64 all-reduce SUM of every expert's sums); without, each expert's
    down is the plain gemm. Every row is the one-device row's bits (each row of the exact gemm is its own)."""
    k, hidden = weight.top_k, shape_of(h)[1]
    order = np.concatenate([chosen for _, chosen in groups]) if groups else np.zeros(0, np.int64)
    n = order.size
    if n == 0:  # none of these experts was chosen (under expert parallelism: a rank's experts, all of them)
        return backend.empty((0, hidden), np.float32), order, backend.empty((0, hidden), np.float32), []
    rows = (order // k).astype(np.int32)
    x = embedding.gather(backend, h, backend.asarray(rows), host_ids=rows)  # [n, H], a row per pair
    runs, start = [], 0
    for expert, chosen in groups:
        runs.append((expert, start, start + chosen.size))
        start += chosen.size
    y = backend.empty((n, hidden), np.float32)
    saved = []
    if tp_group.size == 1:  # whole experts: each down product is the one-device gemm
        for expert, start, stop in runs:
            gate, up = gemm.gemm_columns(backend, x[start:stop], weight.gate_up[expert])
            if backend.runs_reference:  # the reference's gemm encodes its own rows
                act, encoded = activation.swiglu(backend, gate, up), None
            else:  # one launch gives the activation and its encoding, as ops.moe's expert pass
                act, encoded = activation.swiglu_encode(backend, gate, up, bits_a)
            backend.copy_into(y[start:stop], gemm.gemm(backend, act, weight.down[expert], bits_a, encoded=encoded))
            saved.append((expert, start, stop, gate, up, act))
        return y, order, x, saved
    inner = weight.down[groups[0][0]].k if groups else 0
    act = backend.empty((n, inner), np.float32)  # this rank's columns of every pair's activation
    for expert, start, stop in runs:
        gate, up = gemm.gemm_columns(backend, x[start:stop], weight.gate_up[expert])
        backend.copy_into(act[start:stop], activation.swiglu(backend, gate, up))
        saved.append((expert, start, stop, gate, up, act[start:stop]))
    exponents = shared_exponents(backend, tp_group, act)
    sums = backend.empty((n, hidden), np.int64)
    for expert, start, stop in runs:
        part = fixedpoint.encode_rows(backend, act[start:stop], bits_a, exponents=exponents[start:stop])
        backend.copy_into(sums[start:stop], gemm.gemm_sums(backend, part, weight.down[expert]))
    sums = tp_group.all_reduce(sums, "sum")
    for expert, start, stop in runs:
        backend.copy_into(y[start:stop], gemm.round_sums(backend, sums[start:stop], exponents[start:stop], bits_a,
                                                         weight.down[expert]))
    return y, order, x, saved


def gate_up_input_grad(backend, tp_group: Group, gate: list, up: list, column_shard, saved, d_gu, pairs: int, dx):
    """dX(d_g, G_e) and dX(d_u, U_e) of d_gu [2 pairs, I / size] (the d g rows, then the d u rows, grouped by
    expert as saved) into dx's first 2 pairs rows, summed over the ranks' cut I: the rows' whole-row
    exponents by one all-reduce MAX, every expert's exact int64 partial sums all-reduced once (SUM), rounded
    per expert (column_shard(w): the shard transposed with the whole rows' exponents)."""
    hidden = shape_of(dx)[1]
    bits_a = gemm.DEFAULT_BITS_A
    exponents = shared_exponents(backend, tp_group, d_gu)
    sums = backend.empty((2 * pairs, hidden), np.int64)
    for expert, start, stop, _, _, _ in saved:
        for offset, w in ((0, gate[expert]), (pairs, up[expert])):
            rows = slice(offset + start, offset + stop)
            part = fixedpoint.encode_rows(backend, d_gu[rows], bits_a, exponents=exponents[rows])
            backend.copy_into(sums[rows], gemm.gemm_sums(backend, part, column_shard(w)))
    sums = tp_group.all_reduce(sums, "sum")
    for expert, start, stop, _, _, _ in saved:
        for offset, w in ((0, gate[expert]), (pairs, up[expert])):
            rows = slice(offset + start, offset + stop)
            backend.copy_into(dx[rows], gemm.round_sums(backend, sums[rows], exponents[rows], bits_a,
                                                        column_shard(w)))


def moe_block_backward(backend, tp_group: Group, h, router, gate: list, up: list, down: list, weight: moe.MoeWeight,
                       d_out, transposed, column_shard, aux=None) -> moe_reference.BlockGradients:
    """ops.moe.block_backward of the whole block from this rank's expert shards (gate/up [I / size, H], down
    [H, I / size]): the router's d z, d_router and d z W_r come from whole, replicated rows (the same on
    every rank, not all-reduced, as the norms' gradients); each expert's d_gate/d_up rows and d_down columns
    are this rank's slice of the single device's (each an exact sum over whole rows); d_a = d_y D_e is this
    rank's columns. dX(d_g, G_e) and dX(d_u, U_e) sum over the cut I: the d g / d u rows' whole-row exponents
    by one all-reduce MAX, every expert's exact int64 partial sums in one [2 T k, H] buffer all-reduced once
    (SUM), rounded per expert (column_shard(w): the shard transposed with the whole rows' exponents); then
    the single device's moe_combine of the 2k + 1 rows of each token. transposed: Model.transposed_weight."""
    bits_a = gemm.DEFAULT_BITS_A
    return moe.composed_block_backward(
        backend, h, router, gate, up, down, weight, d_out, transposed, aux,
        experts_pass=lambda groups, t: _sharded_experts(backend, tp_group, h, weight, groups, t, bits_a),
        gate_up_input_grad=lambda saved, d_gu, pairs, dx: gate_up_input_grad(
            backend, tp_group, gate, up, column_shard, saved, d_gu, pairs, dx))
