"""Op family "moe": route, combine and the whole sparse MLP block of a Qwen3-MoE layer.

Contract: contracts/moe.toml; reference: rlportable/contract/moe.py. route and combine run the kernels of
backends/portable/moe.hip on a device (both vendors, HIP-CPU) and the reference on cpu; the experts'
products are the gemm family's (weights encoded once, as the dense layers'), so the block's bits are
the reference's moe_block. The block's forward runs on every backend: the expert ids come back to the
host (the group sizes set the products' shapes); on a device each token's row is gathered once per
chosen expert (the embedding family's row gather, a bit copy), each expert runs its gate/up, SwiGLU
and down products over its run of rows, and a second gather puts the outputs back in (token, slot)
order for the combine; on cpu the host groups the rows as the reference does. The backward has no
kernels: block_backward (the reference's moe_block_backward on the float32 weights, the trainer's
masters) runs on cpu only and raises BackendUnavailable elsewhere, never falling back to the host;
model/forward.py refuses a trainable MoE model off cpu before any work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlportable.contract import moe as reference
from rlportable.errors import BackendUnavailable, InputError
from rlportable.ops import activation, embedding, gemm
from rlportable.ops.checks import require_contiguous, require_matrix, shape_of

ROUTE_THREADS = 256  # moe_route: one block per row, a multiple of 32 (common.h's block reductions)
COMBINE_THREADS = 256
GRID_LIMIT = 65535  # both kernels walk their rows grid-stride beyond this


@dataclass
class MoeWeight:
    """One sparse layer's weights, encoded for the gemm: the router [E, H], each expert's gate and up
    stacked ([2I, H], one product) and its down [H, I]."""

    router: gemm.GemmWeight
    gate_up: list[gemm.StackedWeight]
    down: list[gemm.GemmWeight]
    top_k: int
    norm_topk_prob: bool

    @property
    def num_experts(self) -> int:
        return self.router.n


def require_reference(backend, op: str) -> None:
    if not backend.runs_reference:
        raise BackendUnavailable(f"moe.{op}: no kernel on the {backend.label} backend yet; the MoE family "
                                 "runs on the cpu reference only (contracts/moe.toml)")


def _check_top_k(num_experts: int, top_k: int) -> None:
    try:
        reference.check_top_k(num_experts, top_k)
    except ValueError as error:
        raise InputError(str(error)) from None


def encode(backend, router, gate: list, up: list, down: list, top_k: int, norm_topk_prob: bool) -> MoeWeight:
    """Encode a sparse layer's weights once (router [E, H]; per expert gate, up [I, H] and down [H, I])."""
    experts, hidden = require_matrix("moe router", router)
    if not len(gate) == len(up) == len(down) == experts:
        raise InputError(f"moe: the router has {experts} experts but gate, up, down hold "
                         f"{len(gate)}, {len(up)}, {len(down)}")
    _check_top_k(experts, top_k)
    for e in range(experts):
        if shape_of(gate[e]) != shape_of(up[e]) or shape_of(gate[e])[1:] != (hidden,) \
                or shape_of(down[e]) != (hidden, shape_of(gate[e])[0]):
            raise InputError(f"moe: expert {e} has gate {shape_of(gate[e])}, up {shape_of(up[e])}, down "
                             f"{shape_of(down[e])}; expected [I, {hidden}], [I, {hidden}], [{hidden}, I]")
    def put(array):  # host experts go to the device one at a time (only their encodings stay)
        return backend.asarray(array) if isinstance(array, np.ndarray) else array

    return MoeWeight(router=gemm.encode_weight(backend, put(router)),
                     gate_up=[gemm.encode_stacked_weight(backend, [put(gate[e]), put(up[e])]) for e in range(experts)],
                     down=[gemm.encode_weight(backend, put(down[e])) for e in range(experts)],
                     top_k=int(top_k), norm_topk_prob=bool(norm_topk_prob))


def route(backend, logits, top_k: int, norm_topk_prob: bool):
    """(experts int32 [T, k], weights float32 [T, k]) of router logits [T, E] (contracts/moe.toml route)."""
    rows, experts = require_matrix("moe route: logits", logits, np.float32)
    _check_top_k(experts, top_k)
    if backend.runs_reference:
        return reference.route(backend.to_numpy(logits), top_k, norm_topk_prob)
    chosen, weights = backend.empty((rows, top_k), np.int32), backend.empty((rows, top_k), np.float32)
    if rows:
        backend.launch("moe", "moe_route", (min(rows, GRID_LIMIT),), (ROUTE_THREADS,),
                       (logits, np.int64(rows), np.int32(experts), np.int32(top_k), np.int32(bool(norm_topk_prob)),
                        chosen, weights))
    return chosen, weights


def combine(backend, weights, outputs):
    """out [T, H] float32 = sum_j weights[t, j] outputs[t, j] (contracts/moe.toml combine)."""
    t, k = require_matrix("moe combine: weights", weights, np.float32)
    if len(shape_of(outputs)) != 3 or shape_of(outputs)[:2] != (t, k) or np.dtype(outputs.dtype) != np.float32:
        raise InputError(f"moe combine: outputs must be float32 [{t}, {k}, H], got "
                         f"{np.dtype(outputs.dtype).name} {shape_of(outputs)}")
    if backend.runs_reference:
        return reference.combine(backend.to_numpy(weights), backend.to_numpy(outputs))
    require_contiguous("moe combine: outputs", outputs)
    hidden = shape_of(outputs)[2]
    out = backend.empty((t, hidden), np.float32)
    if t and hidden:
        blocks = min(-(-t * hidden // COMBINE_THREADS), GRID_LIMIT)
        backend.launch("moe", "moe_combine", (blocks,), (COMBINE_THREADS,),
                       (weights, outputs, np.int64(t), np.int32(k), np.int32(hidden), out))
    return out


def block(backend, h, weight: MoeWeight, encoded=None):
    """(out [T, H], experts int32 [T, k], weights float32 [T, k]): the sparse MLP of hidden rows h [T, H]
    (contracts/moe.toml block), on any backend. encoded: h's encoding at the gemm's activation bits when
    its producer made it (the router's product reads it; an expert's rows are encoded by its own product)."""
    t, hidden = require_matrix("moe block: h", h)
    if hidden != weight.router.k:
        raise InputError(f"moe block: h has {hidden} columns but the router takes {weight.router.k}")
    logits = gemm.gemm(backend, h, weight.router, encoded=encoded)
    experts, weights = route(backend, logits, weight.top_k, weight.norm_topk_prob)
    outputs = expert_outputs(backend, h, weight, backend.to_numpy(experts))
    return combine(backend, weights, outputs), experts, weights


def expert_outputs(backend, h, weight: MoeWeight, host_experts: np.ndarray):
    """y float32 [T, k, H] (contiguous, on the backend): y[t, j] = expert host_experts[t, j]'s SwiGLU MLP of
    h[t] (the reference's expert_outputs), one gate/up product, SwiGLU and one down product per expert
    over the tokens that chose it (reference.expert_groups: experts ascending, tokens ascending within).

    On cpu the groups are indexed out of h and written back on the host, as the reference does. On a
    device the T k (token, slot) pairs' rows of h are gathered into that grouped order by one row gather
    (embedding.gather, a bit copy), each expert's products read its contiguous run of rows and write its
    run of the grouped outputs, and a second gather puts them back in (token, slot) order.

    Every row of the exact gemm is independent of the others (its encoding is the row's own, its sums
    exact, rounded once), and the gathers copy whole rows bit for bit, so gathering rows, grouping them
    by expert and the size of each group change no bit: y[t, j] is that row's product alone."""
    t, k = host_experts.shape
    pairs, hidden = t * k, weight.router.k
    groups = list(reference.expert_groups(host_experts))  # one product per expert that some token chose
    if backend.runs_reference:
        host = backend.to_numpy(h)
        outputs = np.zeros((t, k, hidden), dtype=np.float32)
        for expert, chosen in groups:
            rows, slots = chosen // k, chosen % k
            gate, up = gemm.gemm_columns(backend, host[rows], weight.gate_up[expert])
            outputs[rows, slots] = gemm.gemm(backend, activation.swiglu(backend, gate, up), weight.down[expert])
        return outputs
    if pairs == 0 or hidden == 0:
        return backend.zeros((t, k, hidden), np.float32)
    order = np.concatenate([chosen for _, chosen in groups])  # pair indices, grouped by expert
    rows = (order // k).astype(np.int32)
    x = embedding.gather(backend, h, backend.asarray(rows), host_ids=rows)  # [pairs, H], a row per pair
    y = backend.empty((pairs, hidden), np.float32)
    start = 0
    for expert, chosen in groups:
        stop = start + chosen.size
        gate, up = gemm.gemm_columns(backend, x[start:stop], weight.gate_up[expert])
        # one launch gives the activation and its encoding for the down product (the gemm's own bits)
        act, act_encoded = activation.swiglu_encode(backend, gate, up, gemm.DEFAULT_BITS_A)
        backend.copy_into(y[start:stop], gemm.gemm(backend, act, weight.down[expert], encoded=act_encoded))
        start = stop
    slot_of = np.empty(pairs, np.int32)
    slot_of[order] = np.arange(pairs, dtype=np.int32)  # pair p's row in y
    return embedding.gather(backend, y, backend.asarray(slot_of), host_ids=slot_of).reshape(t, k, hidden)


def block_backward(backend, h, router, gate: list, up: list, down: list, top_k: int, norm_topk_prob: bool, d_out):
    """The sparse MLP's gradients for the upstream d_out [T, H] (contracts/moe.toml block_backward): a
    contract.moe.BlockGradients (d_h, d_router, per expert d_gate, d_up, d_down) of float32 arrays.
    router, gate, up, down: the float32 weights (router [E, H]; per expert [I, H], [I, H], [H, I])."""
    require_reference(backend, "block_backward")
    t, hidden = require_matrix("moe block_backward: h", h)
    experts, router_hidden = require_matrix("moe block_backward: router", router)
    if router_hidden != hidden or shape_of(d_out) != (t, hidden):
        raise InputError(f"moe block_backward: h {shape_of(h)}, router {shape_of(router)} and d_out "
                         f"{shape_of(d_out)} must be [T, H], [E, H] and [T, H]")
    _check_top_k(experts, top_k)
    host = backend.to_numpy
    return reference.moe_block_backward(host(h), host(router), [host(w) for w in gate], [host(w) for w in up],
                                        [host(w) for w in down], top_k, norm_topk_prob, host(d_out))
