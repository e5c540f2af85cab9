"""The model forward under the contract: Qwen3, Qwen2 and Llama decoder layers.

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

import numpy as np

from rlportable.contract import rope as rope_ref
from rlportable.errors import InputError
from rlportable.model.config import ModelConfig
from rlportable.model.weights import LayerWeights, ModelWeights
from rlportable.ops import activation, attention, embedding, gemm, logprob, norm, residual, rope
from rlportable.runtime.base import Backend


@dataclass
class DeviceLayer:
    attn_norm: object
    q: gemm.GemmWeight
    k: gemm.GemmWeight
    v: gemm.GemmWeight
    o: gemm.GemmWeight
    q_bias: object | None
    k_bias: object | None
    v_bias: object | None
    q_norm: object | None
    k_norm: object | None
    mlp_norm: object
    gate: gemm.GemmWeight
    up: gemm.GemmWeight
    down: gemm.GemmWeight


class Model:
    """A model's weights on one backend, ready for the forward pass."""

    def __init__(self, backend: Backend, config: ModelConfig, weights: ModelWeights):
        self.backend = backend
        self.config = config
        put = backend.asarray
        self.embed = put(weights.embed)
        self.layers = [self._device_layer(layer) for layer in weights.layers]
        self.final_norm = put(weights.final_norm)
        self.lm_head = gemm.encode_weight(backend, put(weights.lm_head))
        scaling = config.rope_scaling
        self.rope_scaling = None if scaling is None else rope_ref.Llama3Scaling(
            scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor,
            scaling.original_max_position_embeddings)
        self._rope_tables = None

    def _device_layer(self, w: LayerWeights) -> DeviceLayer:
        put, backend = self.backend.asarray, self.backend

        def optional(array):
            return None if array is None else put(array)

        return DeviceLayer(
            attn_norm=put(w.attn_norm), q=gemm.encode_weight(backend, put(w.q)), k=gemm.encode_weight(backend, put(w.k)),
            v=gemm.encode_weight(backend, put(w.v)), o=gemm.encode_weight(backend, put(w.o)),
            q_bias=optional(w.q_bias), k_bias=optional(w.k_bias), v_bias=optional(w.v_bias),
            q_norm=optional(w.q_norm), k_norm=optional(w.k_norm), mlp_norm=put(w.mlp_norm),
            gate=gemm.encode_weight(backend, put(w.gate)), up=gemm.encode_weight(backend, put(w.up)),
            down=gemm.encode_weight(backend, put(w.down)),
        )

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
        return self._forward(tokens, packed_positions(cu_seqlens),
                             lambda q, k, v, _index: attention.attention_packed(self.backend, q, k, v, cu_seqlens))

    def step(self, tokens, positions, q_seq, block_tables, slots, caches: list):
        """One engine step over a paged KV cache: final-norm hidden states [T, H].

        Token i (id tokens[i], position positions[i]) belongs to row q_seq[i] of
        block_tables and writes its K and V to cache slot slots[i] of every
        layer's cache (caches[layer], ops.attention.KVCache) before attending to
        positions 0..positions[i] of its sequence. Prefill, chunked prefill and
        decode are all this call; the attention contract makes their bits equal
        to the packed forward's.
        """
        backend = self.backend
        positions = np.asarray(positions, dtype=np.int32)
        device_positions = backend.asarray(positions)
        q_seq, slots = backend.asarray(np.asarray(q_seq, np.int32)), backend.asarray(np.asarray(slots, np.int32))
        tables = backend.asarray(np.asarray(block_tables, np.int32))

        def paged(q, k, v, index):
            attention.write_kv(backend, caches[index], k, v, slots)
            return attention.attention_paged(backend, q, q_seq, device_positions, caches[index], tables)

        return self._forward(np.asarray(tokens, np.int32), positions, paged, device_positions)

    def _forward(self, tokens: np.ndarray, positions: np.ndarray, attend, device_positions=None):
        """Embedding, the layers (attention by attend(q, k, v, layer_index)), final norm.

        tokens and positions are host arrays: their ranges are checked here once, not by
        every op on the device."""
        cfg, backend = self.config, self.backend
        positions = np.asarray(positions, dtype=np.int32)
        cos, sin = self.rope_tables(int(positions.max()) + 1 if positions.size else 1)
        if device_positions is None:
            device_positions = backend.asarray(positions)
        x = embedding.gather(backend, self.embed, backend.asarray(tokens), host_ids=tokens)
        for index, layer in enumerate(self.layers):
            x = self._layer(layer, x, (device_positions, positions), cos, sin,
                            lambda q, k, v, i=index: attend(q, k, v, i))
        return norm.rmsnorm(backend, x, self.final_norm, cfg.rms_norm_eps)

    def allocate_caches(self, num_blocks: int, block_size: int) -> list:
        """One encoded KV cache per layer (ops.attention.KVCache) of num_blocks blocks."""
        cfg = self.config
        return [attention.KVCache.allocate(self.backend, num_blocks * block_size, cfg.num_key_value_heads,
                                           cfg.head_dim, block_size) for _ in self.layers]

    def logits(self, hidden_rows):
        """float32 logits [rows, V] of final-norm hidden rows (the exact gemm with the LM head)."""
        return gemm.gemm(self.backend, hidden_rows, self.lm_head)

    def _projection(self, h, weight, bias):
        y = gemm.gemm(self.backend, h, weight)
        return y if bias is None else residual.add_bias(self.backend, y, bias)

    def _heads(self, flat, heads: int, head_norm):
        cfg = self.config
        x = flat.reshape(flat.shape[0], heads, cfg.head_dim)
        if head_norm is not None:  # Qwen3's per-head QK-norm
            x = norm.rmsnorm_heads(self.backend, x, head_norm, cfg.rms_norm_eps)
        return x

    def _layer(self, layer: DeviceLayer, x, positions, cos, sin, attend):
        """One decoder layer; positions = (device array, the same on the host)."""
        cfg, backend = self.config, self.backend
        t = x.shape[0]
        h = norm.rmsnorm(backend, x, layer.attn_norm, cfg.rms_norm_eps)
        q = self._heads(self._projection(h, layer.q, layer.q_bias), cfg.num_attention_heads, layer.q_norm)
        k = self._heads(self._projection(h, layer.k, layer.k_bias), cfg.num_key_value_heads, layer.k_norm)
        v = self._projection(h, layer.v, layer.v_bias).reshape(t, cfg.num_key_value_heads, cfg.head_dim)
        device_positions, host_positions = positions
        q = rope.apply(backend, q, device_positions, cos, sin, host_positions)
        k = rope.apply(backend, k, device_positions, cos, sin, host_positions)
        a = attend(q, k, v)
        x = residual.add(backend, x, gemm.gemm(backend, a.reshape(t, cfg.num_attention_heads * cfg.head_dim), layer.o))
        h = norm.rmsnorm(backend, x, layer.mlp_norm, cfg.rms_norm_eps)
        mlp = activation.swiglu(backend, gemm.gemm(backend, h, layer.gate), gemm.gemm(backend, h, layer.up))
        return residual.add(backend, x, gemm.gemm(backend, mlp, layer.down))

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
        result = logprob.lm_head_logprobs(self.backend, picked, self.lm_head, self.backend.asarray(targets),
                                          temperature, want_entropy=with_entropy)
        lp, ent = result if with_entropy else (result, None)
        lp = self.backend.to_numpy(lp)
        splits = np.cumsum([max(int(b - a) - 1, 0) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])])[:-1]
        per_sequence = np.split(lp, splits)
        if with_entropy:
            return per_sequence, np.split(self.backend.to_numpy(ent), splits)
        return per_sequence


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
