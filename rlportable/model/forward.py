"""The model forward under the contract: Qwen3, Qwen3-MoE, Qwen2 and Llama decoder layers.

One `Model` holds a config and its weights on a backend, with every projection
encoded once for the exact GEMM. `Model.logprobs` runs packed variable-length
sequences (cu_seqlens) through the layers and returns, for each sequence, the
log-probability of each next token under softmax(logits / T), from the fused
LM-head + log-prob op (the [tokens, vocab] logits never exist at once).

Every op is a contract op (contracts/*.toml), so the same tokens give the same
bits on any backend, whichever other sequences share the pack and at any offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from rlportable.contract import rope as rope_ref
from rlportable.errors import InputError
from rlportable.model import expert_parallel, parallel
from rlportable.model.config import ModelConfig
from rlportable.model.weights import LayerWeights, ModelWeights
from rlportable.ops import activation, attention, embedding, gemm, logprob, moe, norm, residual, rope
from rlportable.runtime.base import Backend
from rlportable.runtime.collectives import Group, SingleGroup


@dataclass
class DeviceLayer:
    """A layer's encoded projections: q, k and v stacked into one encoding, gate and up into
    another (ops/gemm.py StackedWeight: one launch each where the wgmma gemm runs). A sparse
    (Qwen3-MoE) layer has `moe` (ops/moe.py MoeWeight) in place of gate_up and down."""

    attn_norm: object
    qkv: gemm.StackedWeight
    o: gemm.GemmWeight
    q_bias: object | None
    k_bias: object | None
    v_bias: object | None
    q_norm: object | None
    k_norm: object | None
    mlp_norm: object
    gate_up: gemm.StackedWeight | None
    down: gemm.GemmWeight | None
    moe: moe.MoeWeight | None = None

    @property
    def q(self) -> gemm.GemmWeight:
        return self.qkv.parts[0]

    @property
    def k(self) -> gemm.GemmWeight:
        return self.qkv.parts[1]

    @property
    def v(self) -> gemm.GemmWeight:
        return self.qkv.parts[2]

    @property
    def gate(self) -> gemm.GemmWeight:
        return self.gate_up.parts[0]

    @property
    def up(self) -> gemm.GemmWeight:
        return self.gate_up.parts[1]


class StepInputs(NamedTuple):
    """A step's token ids, positions, query rows, block tables and slots (int32), already on the
    device (the engine's packed upload), as `Model.step` would put its host arguments there."""

    tokens: object
    positions: object
    q_seq: object
    block_tables: object
    slots: object


class Model:
    """A model's weights on one backend, ready for the forward pass."""

    def __init__(self, backend: Backend, config: ModelConfig, weights: ModelWeights, trainable: bool = False,
                 tp_group: Group | None = None, ep_group: Group | None = None):
        """trainable: also keep the float32 weights on the device (`params`, the trainer's master
        weights, updated in place by the optimiser; `reencode()` refreshes the GEMM encodings).
        tp_group: this rank's tensor-parallel group (model/parallel.py); the model keeps its shard of
        `weights` (the whole host weights) and every result is bitwise the single-device one. ep_group: its
        expert-parallel group (model/expert_parallel.py): of a Qwen3-MoE's experts the model keeps only
        this rank's (None in the expert lists), the same bits again."""
        self.backend = backend
        self.config = config
        self.trainable = trainable
        self.tp_group = tp_group or SingleGroup()
        self.tp = parallel.TensorParallel.of(self.tp_group)
        self.ep_group = ep_group or SingleGroup()
        self.ep = expert_parallel.ExpertParallel.of(self.ep_group)
        self.ep.check(config)
        #: the shapes this rank computes with (config itself without tensor parallelism)
        self.shape = config
        if self.tp.size > 1:
            self.tp.check(config, trainable)
            weights = parallel.shard_weights(weights, config, self.tp)
            self.shape = self.tp.local_config(config)
        weights = self.ep.shard_weights(weights, config)
        self.vocab_start = self.tp.vocab_start(config)
        self.params = to_device(backend, weights) if trainable else None
        source = self.params if trainable else to_device(backend, weights, projections=False)
        self.embed = source.embed
        self.final_norm = source.final_norm
        self._source = source
        self.layers = self._encode_layers(source if trainable else weights)
        self.lm_head = gemm.encode_weight(backend, backend.asarray(weights.lm_head) if source.lm_head is None
                                         else source.lm_head)
        scaling = config.rope_scaling
        self.rope_scaling = None if scaling is None else rope_ref.Llama3Scaling(
            scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor,
            scaling.original_max_position_embeddings)
        self._rope_tables = None
        self._transposed: dict = {}

    def _encode_layers(self, weights: ModelWeights) -> list[DeviceLayer]:
        return [self._device_layer(layer, self._source.layers[index]) for index, layer in enumerate(weights.layers)]

    def _device_layer(self, w: LayerWeights, small: LayerWeights) -> DeviceLayer:
        """Encode w's projections (host or device arrays); norms and biases come from `small` (device)."""
        backend = self.backend

        def device(array):
            return backend.asarray(array) if isinstance(array, np.ndarray) else array

        def encode_row_parallel(array):
            if self.tp.size > 1:
                return parallel.encode_row_parallel_weight(backend, self.tp_group, device(array))
            return gemm.encode_weight(backend, device(array))

        def stack(*arrays):
            return gemm.encode_stacked_weight(backend, [device(array) for array in arrays])

        sparse = w.router is not None

        return DeviceLayer(
            attn_norm=small.attn_norm, qkv=stack(w.q, w.k, w.v), o=encode_row_parallel(w.o),
            q_bias=small.q_bias, k_bias=small.k_bias, v_bias=small.v_bias,
            q_norm=small.q_norm, k_norm=small.k_norm, mlp_norm=small.mlp_norm,
            gate_up=None if sparse else stack(w.gate, w.up), down=None if sparse else encode_row_parallel(w.down),
            moe=moe.encode(backend, device(w.router), w.expert_gate, w.expert_up, w.expert_down,
                           self.config.num_experts_per_tok, self.config.norm_topk_prob,
                           down_exponents=parallel.expert_down_exponents(backend, self.tp_group, w.expert_down)
                           if self.tp.size > 1 else None) if sparse else None,
        )

    def reencode(self) -> None:
        """Refresh every GEMM encoding from `params` after the optimiser changed them in place."""
        if not self.trainable:
            raise InputError("reencode: the model was not built with trainable=True")
        self.layers = self._encode_layers(self.params)
        self.lm_head = gemm.encode_weight(self.backend, self.params.lm_head)
        self._transposed.clear()

    # ---- positions and RoPE tables
    def rope_tables(self, length: int):
        """Device (cos, sin) for positions 0..length-1, grown on demand (the contract's tables)."""
        if self._rope_tables is None or self._rope_tables[0].shape[0] < length:
            cfg = self.config
            self._rope_tables = rope.tables(self.backend, max(length, 256), cfg.head_dim, cfg.rope_theta,
                                            self.rope_scaling)
        return self._rope_tables

    # ---- forward
    def hidden_states(self, tokens: np.ndarray, cu_seqlens: np.ndarray):
        """Final-norm hidden states [T, H] of packed sequences."""
        tokens = np.asarray(tokens, dtype=np.int32)
        cu_seqlens = check_packing(tokens, cu_seqlens, self.config.vocab_size)
        return self._forward(tokens, packed_positions(cu_seqlens), self.packed_attention(cu_seqlens))

    def packed_attention(self, cu_seqlens: np.ndarray, keep_stats: bool = False):
        """attend(q, k, v, layer_index) over packed sequences (the forward's and the trainer's); keep_stats:
        it returns (o, row_stats) as attention_packed does (the trainer keeps both for the backward)."""
        return lambda q, k, v, _index: attention.attention_packed(self.backend, q, k, v, cu_seqlens,
                                                                  keep_stats=keep_stats)

    def step(self, tokens, positions, q_seq, block_tables, slots, caches: list, device: StepInputs | None = None,
             routing: list | None = None):
        """One engine step over a paged KV cache: final-norm hidden states [T, H].

        Token i (id tokens[i], position positions[i]) belongs to row q_seq[i] of
        block_tables and writes its K and V to cache slot slots[i] of every
        layer's cache (caches[layer], ops.attention.KVCache) before attending to
        positions 0..positions[i] of its sequence (a negative slot writes nothing:
        the engine's padding rows). Prefill, chunked prefill and decode are all this
        call; the attention contract makes their bits equal to the packed forward's.

        `device`: the same arrays already on the device. Then nothing is copied (the
        host arrays are only checked), so the call can be captured in a graph that
        reads its inputs from those device buffers. `routing`, a list, receives each sparse layer's
        expert choices (int32 [T, k] on the host, layer by layer) for the engine to record.
        """
        backend = self.backend
        positions = np.asarray(positions, dtype=np.int32)
        tokens = np.asarray(tokens, np.int32)
        if device is None:
            device = StepInputs(*(backend.asarray(np.asarray(a, np.int32))
                                  for a in (tokens, positions, q_seq, block_tables, slots)))

        parts = attention.step_parts(q_seq)  # the decodes and the prefill chunks, once for every layer

        def paged(q, k, v, index):  # the layer wrote k and v into caches[index] (cache_writes)
            return attention.attention_step(backend, q, device.q_seq, device.positions, caches[index],
                                            device.block_tables, parts)

        return self._forward(tokens, positions, paged, device.positions, device_tokens=device.tokens,
                             cache_writes=lambda index: (caches[index], device.slots), routing=routing)

    def _forward(self, tokens: np.ndarray, positions: np.ndarray, attend, device_positions=None, saved=None,
                 device_tokens=None, cache_writes=None, routing: list | None = None):
        """Embedding, the layers (attention by attend(q, k, v, layer_index)), final norm.
        cache_writes(layer_index) -> (KVCache, slots): each layer writes its k and v there before attend.

        tokens and positions are host arrays: their ranges are checked here once, not by
        every op on the device. `saved`, a list, receives each layer's input and the final
        norm's input (the trainer's activation checkpoints); `routing`, a list, each sparse layer's
        expert choices (int32 [T, k], host)."""
        cfg, backend = self.config, self.backend
        positions = np.asarray(positions, dtype=np.int32)
        cos, sin = self.rope_tables(int(positions.max()) + 1 if positions.size else 1)
        if device_positions is None:
            device_positions = backend.asarray(positions)
        if device_tokens is None:
            device_tokens = backend.asarray(tokens)
        x = self._embed(device_tokens, tokens)
        # h: RMSNorm of x with the weight of what comes next (a layer's attn_norm, then the final norm);
        # each layer's closing residual add runs in one launch with the next one (norm.add_rmsnorm), which
        # also encodes h for the next layer's q/k/v gemm (h_encoded). The first layer's h comes from
        # rmsnorm and is encoded by _projections; the final norm's feeds the LM head on selected rows
        # (Model.logits, logprobs' row gather), so it is left unencoded.
        norms = [layer.attn_norm for layer in self.layers[1:]] + [self.final_norm]
        h = norm.rmsnorm(backend, x, self.layers[0].attn_norm if self.layers else self.final_norm, cfg.rms_norm_eps)
        h_encoded = None
        for index, (layer, next_norm) in enumerate(zip(self.layers, norms)):
            if saved is not None:
                saved.append(x)
            x2, mlp_out = self._layer(layer, x, (device_positions, positions), cos, sin,
                                      lambda q, k, v, i=index: attend(q, k, v, i), h1=h, h1_encoded=h_encoded,
                                      cache_write=cache_writes(index) if cache_writes else None, routing=routing)
            if index + 1 < len(self.layers):
                x, h, h_encoded = norm.add_rmsnorm(backend, x2, mlp_out, next_norm, cfg.rms_norm_eps,
                                                   encode_bits=gemm.DEFAULT_BITS_A)
            else:
                x, h = norm.add_rmsnorm(backend, x2, mlp_out, next_norm, cfg.rms_norm_eps)
        if saved is not None:
            saved.append(x)
        return h

    def _embed(self, device_tokens, tokens: np.ndarray):
        if self.tp.size == 1:
            return embedding.gather(self.backend, self.embed, device_tokens, host_ids=tokens)
        return parallel.embed_tokens(self.backend, self.tp_group, self.embed, self.vocab_start, device_tokens, tokens)

    def _row_parallel(self, x, weight: gemm.GemmWeight, encoded=None):
        """x @ W.T for the o and down projections: K-sharded under tensor parallelism. encoded: x's
        encoding when its producer made it (one device only: the shards are encoded with the
        all-reduced exponents)."""
        if self.tp.size == 1:
            return gemm.gemm(self.backend, x, weight, encoded=encoded)
        return parallel.row_parallel_gemm(self.backend, self.tp_group, x, weight)

    def allocate_caches(self, num_blocks: int, block_size: int) -> list:
        """One encoded KV cache per layer (ops.attention.KVCache) of num_blocks blocks (this rank's KV heads)."""
        cfg = self.shape
        return [attention.KVCache.allocate(self.backend, num_blocks * block_size, cfg.num_key_value_heads,
                                           cfg.head_dim, block_size) for _ in self.layers]

    def logits(self, hidden_rows):
        """float32 logits [rows, V] of final-norm hidden rows (the exact gemm with the LM head)."""
        logits = gemm.gemm(self.backend, hidden_rows, self.lm_head)
        return logits if self.tp.size == 1 else parallel.whole_columns(self.backend, self.tp_group, logits)

    def _projections(self, h, stacked: gemm.StackedWeight, biases, encoded=None) -> list:
        """h @ W_i.T (+ bias_i) for the parts of a stacked weight; gemm_columns encodes h once for all of
        them (devices; the reference quantizes itself). encoded: h's encoding at gemm.DEFAULT_BITS_A already
        made (norm.add_rmsnorm's, written by the launch that made h), used instead of encoding again."""
        outputs = gemm.gemm_columns(self.backend, h, stacked, encoded=encoded)
        return [y if bias is None else residual.add_bias(self.backend, y, bias) for y, bias in zip(outputs, biases)]

    def _rotated_heads(self, layer: DeviceLayer, q_lin, k_lin, positions, cos, sin, v=None, cache_write=None):
        """q and k as [tokens, heads, head_dim], QK-normed (Qwen3) and rotated by RoPE: with QK-norm both
        in one launch (norm.rmsnorm_heads_rope, bitwise the two ops in turn). cache_write = (KVCache, slots):
        k and v also go into the cache (with QK-norm in the same launch: norm.rmsnorm_heads_rope_write_kv)."""
        cfg, backend = self.shape, self.backend
        (device_positions, host_positions), t = positions, q_lin.shape[0]
        q = q_lin.reshape(t, cfg.num_attention_heads, cfg.head_dim)
        k = k_lin.reshape(t, cfg.num_key_value_heads, cfg.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            if cache_write is not None:
                return norm.rmsnorm_heads_rope_write_kv(backend, q, k, v, layer.q_norm, layer.k_norm, cfg.rms_norm_eps,
                                                        device_positions, cos, sin, *cache_write, host_positions)
            return norm.rmsnorm_heads_rope(backend, q, k, layer.q_norm, layer.k_norm, cfg.rms_norm_eps,
                                           device_positions, cos, sin, host_positions)
        if layer.q_norm is not None or layer.k_norm is not None:
            raise InputError("model: a layer has one of q_norm and k_norm without the other")
        q, k = (rope.apply(backend, x, device_positions, cos, sin, host_positions) for x in (q, k))
        if cache_write is not None:
            attention.write_kv(backend, cache_write[0], k, v, cache_write[1])
        return q, k

    def _layer(self, layer: DeviceLayer, x, positions, cos, sin, attend, record: dict | None = None, h1=None,
               h1_encoded=None, cache_write=None, routing: list | None = None):
        """One decoder layer; positions = (device array, the same on the host). Returns (x2, mlp_out): the
        layer's output is residual.add(x2, mlp_out), left to the caller to run with the next RMSNorm in
        one launch. h1: RMSNorm(x) with attn_norm when the caller made it so; h1_encoded: its encoding
        for the q/k/v gemm when the caller has it (norm.add_rmsnorm's). `record`, a dict, receives
        the intermediate values (the trainer's backward recomputes a layer this way). cache_write =
        (KVCache, slots): the layer's k and v go into that cache before attend (the engine's steps).
        routing, a list: a sparse layer appends its expert choices (int32 [T, k])."""
        cfg, backend = self.shape, self.backend
        t = x.shape[0]
        if h1 is None:
            h1, h1_encoded = norm.rmsnorm(backend, x, layer.attn_norm, cfg.rms_norm_eps), None
        q_lin, k_lin, v = self._projections(h1, layer.qkv, (layer.q_bias, layer.k_bias, layer.v_bias), h1_encoded)
        v = v.reshape(t, cfg.num_key_value_heads, cfg.head_dim)
        q, k = self._rotated_heads(layer, q_lin, k_lin, positions, cos, sin, v, cache_write)
        a = attend(q, k, v)
        attn_out = self._row_parallel(a.reshape(t, cfg.num_attention_heads * cfg.head_dim), layer.o)
        # h2 comes with its encoding for the gate/up gemm from the same launch (no separate encode)
        x2, h2, h2_encoded = norm.add_rmsnorm(backend, x, attn_out, layer.mlp_norm, cfg.rms_norm_eps,
                                              encode_bits=gemm.DEFAULT_BITS_A)
        if record is not None:
            record.update(h1=h1, q_lin=q_lin, k_lin=k_lin, q=q, k=k, v=v, a=a, x2=x2, h2=h2)
        if layer.moe is not None:  # a sparse layer: the router, each token's k experts, one exact combine
            if self.ep.size > 1:  # whole experts per rank, their rows exchanged by all-to-all
                out, experts, _ = expert_parallel.moe_block(backend, self.ep_group, self.tp_group, h2, layer.moe,
                                                            encoded=h2_encoded)
            elif self.tp.size > 1:  # the router whole on every rank, each expert column- then row-parallel
                out, experts, _ = parallel.moe_block(backend, self.tp_group, h2, layer.moe, encoded=h2_encoded)
            else:
                out, experts, _ = moe.block(backend, h2, layer.moe, encoded=h2_encoded)
            if routing is not None:
                routing.append(backend.to_numpy(experts))  # the block brought them to the host already
            return x2, out
        gate, up = self._projections(h2, layer.gate_up, (None, None), h2_encoded)
        mlp, mlp_rows = self._activation(gate, up)
        if record is not None:
            record.update(gate=gate, up=up, mlp=mlp)
        return x2, self._row_parallel(mlp, layer.down, encoded=mlp_rows)

    def _activation(self, gate, up):
        """(swiglu(gate, up), its encoding for the down projection or None): on one device the same launch
        encodes it (activation.swiglu_encode); the reference and the K-sharded gemm encode themselves."""
        if self.backend.runs_reference or self.tp.size > 1:
            return activation.swiglu(self.backend, gate, up), None
        return activation.swiglu_encode(self.backend, gate, up, gemm.DEFAULT_BITS_A)

    def transposed_weight(self, w, start: int, stop: int) -> gemm.GemmWeight:
        """(w[start:stop]).T encoded as a GEMM weight, for the backward's dX = dY W; cached until reencode()."""
        key = (id(w), start, stop)
        if key not in self._transposed:
            self._transposed[key] = gemm.encode_weight(self.backend, residual.transpose(self.backend, w[start:stop]))
        return self._transposed[key]

    def transposed_column_shard(self, w) -> gemm.GemmWeight:
        """A column-parallel weight's shard transposed [K, N / size], encoded with the whole rows'
        exponents (the row-parallel gemm's weight, for dX = dY W under tensor parallelism); cached."""
        key = ("column shard", id(w))
        if key not in self._transposed:
            self._transposed[key] = parallel.encode_row_parallel_weight(
                self.backend, self.tp_group, residual.transpose(self.backend, w))
        return self._transposed[key]

    def whole_lm_head(self):
        """The whole float32 LM head [V, H], all-gathered from the vocabulary shards; cached."""
        key = ("whole lm_head",)
        if key not in self._transposed:
            shard = self.params.lm_head
            self._transposed[key] = self.tp_group.all_gather(shard).reshape(self.config.vocab_size, shard.shape[1])
        return self._transposed[key]

    def logprobs(self, tokens: np.ndarray, cu_seqlens: np.ndarray, temperature: float = 1.0,
                 with_entropy: bool = False):
        """Per sequence, float32 log P(token[i+1] | token[:i+1]) for i < len-1 (and the entropies)."""
        if not temperature > 0:
            raise InputError(f"temperature must be positive, got {temperature}")
        cu_seqlens = np.asarray(cu_seqlens, dtype=np.int64)
        hidden = self.hidden_states(tokens, cu_seqlens)
        rows, targets = next_token_rows(np.asarray(tokens, dtype=np.int32), cu_seqlens)
        rows = rows.astype(np.int32)
        picked = embedding.gather(self.backend, hidden, self.backend.asarray(rows), host_ids=rows)  # a row gather
        if self.tp.size > 1:
            lp = parallel.vocab_parallel_logprobs(self.backend, self.tp_group, picked, self.lm_head, self.vocab_start,
                                                  self.backend.asarray(targets), temperature)
            ent = parallel.vocab_parallel_entropy(self.backend, self.tp_group, picked, self.lm_head,
                                                  temperature) if with_entropy else None
        else:
            result = logprob.lm_head_logprobs(self.backend, picked, self.lm_head, self.backend.asarray(targets),
                                              temperature, want_entropy=with_entropy)
            lp, ent = result if with_entropy else (result, None)
        lp = self.backend.to_numpy(lp)
        splits = np.cumsum([max(int(b - a) - 1, 0) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])])[:-1]
        per_sequence = np.split(lp, splits)
        if with_entropy:
            return per_sequence, np.split(self.backend.to_numpy(ent), splits)
        return per_sequence


def to_device(backend: Backend, weights: ModelWeights, projections: bool = True) -> ModelWeights:
    """The weights as backend arrays (tied lm_head stays the embedding's array). Without
    projections, the layers' matrices are left None (inference keeps only their encodings)."""
    put = backend.asarray

    def optional(array):
        return None if array is None else put(array)

    def layer(w: LayerWeights) -> LayerWeights:
        matrices = {name: (optional(getattr(w, name)) if projections else None)
                    for name in ("q", "k", "v", "o", "gate", "up", "down", "router")}
        experts = {name: ([optional(m) for m in getattr(w, name)] if projections and getattr(w, name) is not None
                          else None) for name in ("expert_gate", "expert_up", "expert_down")}
        return LayerWeights(attn_norm=put(w.attn_norm), mlp_norm=put(w.mlp_norm), q_bias=optional(w.q_bias),
                            k_bias=optional(w.k_bias), v_bias=optional(w.v_bias), q_norm=optional(w.q_norm),
                            k_norm=optional(w.k_norm), **matrices, **experts)

    embed = put(weights.embed)
    lm_head = embed if weights.tied else (put(weights.lm_head) if projections else None)
    return ModelWeights(embed=embed, layers=[layer(w) for w in weights.layers], final_norm=put(weights.final_norm),
                        lm_head=lm_head)


def check_packing(tokens: np.ndarray, cu_seqlens, vocab_size: int) -> np.ndarray:
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or cu[-1] != tokens.size or np.any(np.diff(cu) < 1):
        raise InputError(f"cu_seqlens {cu.tolist()} must start at 0, end at the token count {tokens.size} "
                         "and hold sequences of at least one token")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise InputError(f"token ids must lie in [0, {vocab_size}); got [{tokens.min()}, {tokens.max()}]")
    return cu


def packed_positions(cu_seqlens: np.ndarray) -> np.ndarray:
    lengths = np.diff(cu_seqlens)
    starts = np.repeat(cu_seqlens[:-1], lengths)
    return np.arange(int(cu_seqlens[-1]), dtype=np.int64) - starts


def next_token_rows(tokens: np.ndarray, cu_seqlens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows whose next token exists, that next token) over packed sequences."""
    rows = np.concatenate([np.arange(a, b - 1) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])] or [np.zeros(0)])
    rows = rows.astype(np.int64)
    return rows, tokens[rows + 1].astype(np.int32)
