"""Op family "moe": route, combine and the whole sparse MLP block of a Qwen3-MoE layer.

Contract: contracts/moe.toml; reference: rlportable/contract/moe.py. route and combine run the kernels of
backends/portable/moe.hip on a device (both vendors, HIP-CPU) and the reference on cpu; the experts'
products are the gemm family's (weights encoded once, as the dense layers'), so the block's bits are
the reference's moe_block. The block's forward runs on every backend: the expert ids come back to the
host (the group sizes set the products' shapes); on a device each token's row is gathered once per
chosen expert (the embedding family's row gather, a bit copy), each expert runs its gate/up, SwiGLU
and down products over its run of rows, and a second gather puts the outputs back in (token, slot)
order for the combine; on cpu the host groups the rows as the reference does. The backward runs on
every backend too: on cpu the reference's moe_block_backward; on a device the forward recomputed as
above, moe_combine_backward and moe_route_backward (this family's kernels), the experts' products as
the dense backward's (gemm.input_grad and gemm.weight_grad: dX = dY W, dW = dY^T X at 23 x 15 bits, the
summed axis cut at GEMM_K_CHUNK) and the activation family's swiglu_backward over the same grouped
rows, and d h as moe_combine with weights 1 over the 2k + 1 rows of each token (the reference's one
exact sum), gathered into place by one row gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlportable.contract import moe as reference
from rlportable.errors import InputError
from rlportable.ops import activation, embedding, gemm, residual
from rlportable.ops.checks import require_contiguous, require_matrix, shape_of

ROUTE_THREADS = 256  # moe_route: one block per row, a multiple of 32 (common.h's block reductions)
COMBINE_THREADS = 256
BACKWARD_THREADS = 256  # moe_route_backward and moe_combine_backward: one block per row (slot)
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


def _check_top_k(num_experts: int, top_k: int) -> None:
    try:
        reference.check_top_k(num_experts, top_k)
    except ValueError as error:
        raise InputError(str(error)) from None


def encode(backend, router, gate: list, up: list, down: list, top_k: int, norm_topk_prob: bool,
           down_exponents: list | None = None) -> MoeWeight:
    """Encode a sparse layer's weights once (router [E, H]; per expert gate, up [I, H] and down [H, I]).
    down_exponents: per expert int32 [H] (on the backend) to encode down with, not its rows' own: under
    tensor parallelism down is a K-shard encoded with the whole rows' exponents (gemm.encode_weight).
    An expert whose three matrices are None is another rank's (expert parallelism): None in the lists."""
    experts, hidden = require_matrix("moe router", router)
    if not len(gate) == len(up) == len(down) == experts:
        raise InputError(f"moe: the router has {experts} experts but gate, up, down hold "
                         f"{len(gate)}, {len(up)}, {len(down)}")
    _check_top_k(experts, top_k)
    held = [e for e in range(experts) if not (gate[e] is None and up[e] is None and down[e] is None)]
    for e in held:
        if shape_of(gate[e]) != shape_of(up[e]) or shape_of(gate[e])[1:] != (hidden,) \
                or shape_of(down[e]) != (hidden, shape_of(gate[e])[0]):
            raise InputError(f"moe: expert {e} has gate {shape_of(gate[e])}, up {shape_of(up[e])}, down "
                             f"{shape_of(down[e])}; expected [I, {hidden}], [I, {hidden}], [{hidden}, I]")
    def put(array):  # host experts go to the device one at a time (only their encodings stay)
        return backend.asarray(array) if isinstance(array, np.ndarray) else array

    return MoeWeight(router=gemm.encode_weight(backend, put(router)),
                     gate_up=[gemm.encode_stacked_weight(backend, [put(gate[e]), put(up[e])]) if e in held else None
                              for e in range(experts)],
                     down=[gemm.encode_weight(backend, put(down[e]),
                                              exponents=None if down_exponents is None else down_exponents[e])
                           if e in held else None for e in range(experts)],
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
    return _grouped_experts(backend, h, weight, groups, t)[0]


def _grouped_experts(backend, h, weight: MoeWeight, groups: list, t: int, keep: bool = False):
    """The device side of expert_outputs for T > 0 tokens: (outputs [T, k, H], order, slot_of, x, saved).
    order: the (token, slot) pair indices grouped by expert; slot_of[p]: pair p's row in that order; x:
    h's rows in that order; saved: (expert, start, stop, g, u, act) per expert when keep (the backward's)."""
    k, hidden = weight.top_k, weight.router.k
    pairs = t * k
    order = np.concatenate([chosen for _, chosen in groups])  # pair indices, grouped by expert
    rows = (order // k).astype(np.int32)
    x = embedding.gather(backend, h, backend.asarray(rows), host_ids=rows)  # [pairs, H], a row per pair
    y = backend.empty((pairs, hidden), np.float32)
    saved = []
    start = 0
    for expert, chosen in groups:
        stop = start + chosen.size
        gate, up = gemm.gemm_columns(backend, x[start:stop], weight.gate_up[expert])
        # one launch gives the activation and its encoding for the down product (the gemm's own bits)
        act, act_encoded = activation.swiglu_encode(backend, gate, up, gemm.DEFAULT_BITS_A)
        backend.copy_into(y[start:stop], gemm.gemm(backend, act, weight.down[expert], encoded=act_encoded))
        if keep:
            saved.append((expert, start, stop, gate, up, act))
        start = stop
    slot_of = np.empty(pairs, np.int32)
    slot_of[order] = np.arange(pairs, dtype=np.int32)  # pair p's row in y
    outputs = embedding.gather(backend, y, backend.asarray(slot_of), host_ids=slot_of).reshape(t, k, hidden)
    return outputs, order, slot_of, x, saved


def route_backward(backend, logits, experts, weights, d_weights, norm_topk_prob: bool):
    """d_logits float32 [T, E] of sum_j d_weights[t, j] weights[t, j] through route's softmax, the experts
    held fixed (contracts/moe.toml route_backward); experts and weights: route's of these logits."""
    rows, num_experts = require_matrix("moe route_backward: logits", logits, np.float32)
    t, k = require_matrix("moe route_backward: experts", experts, np.int32)
    for name, array in (("weights", weights), ("d_weights", d_weights)):
        if shape_of(array) != (rows, k) or np.dtype(array.dtype) != np.float32:
            raise InputError(f"moe route_backward: {name} must be float32 [{rows}, {k}], got "
                             f"{np.dtype(array.dtype).name} {shape_of(array)}")
    if t != rows:
        raise InputError(f"moe route_backward: experts has {t} rows, the logits {rows}")
    _check_top_k(num_experts, k)
    if backend.runs_reference:
        host = backend.to_numpy
        return reference.route_backward(host(logits), host(experts), host(weights), host(d_weights), norm_topk_prob)
    out = backend.empty((rows, num_experts), np.float32)
    if rows:
        backend.launch("moe", "moe_route_backward", (min(rows, GRID_LIMIT),), (BACKWARD_THREADS,),
                       (logits, experts, weights, d_weights, np.int64(rows), np.int32(num_experts), np.int32(k),
                        np.int32(bool(norm_topk_prob)), out))
    return out


def load_balancing_backward(backend, logits, coefficients):
    """d_logits float32 [T, E] of sum_e coefficients[e] softmax(z)_e per row of router logits z [T, E], the
    load-balancing loss's (contract.moe.load_balancing_backward): route with every expert chosen, then
    route_backward with the coefficient of each slot's expert (moe_route and moe_route_backward on a
    device, the choices' permutation applied to the coefficients on the host)."""
    rows, num_experts = require_matrix("moe load_balancing_backward: logits", logits, np.float32)
    coefficients = np.asarray(coefficients, dtype=np.float32)
    if coefficients.shape != (num_experts,):
        raise InputError(f"moe load_balancing_backward: coefficients must be [{num_experts}], got {coefficients.shape}")
    if backend.runs_reference:
        return reference.load_balancing_backward(backend.to_numpy(logits), coefficients)
    experts, weights = route(backend, logits, num_experts, False)
    d_weights = backend.asarray(np.ascontiguousarray(coefficients[backend.to_numpy(experts)]))
    return route_backward(backend, logits, experts, weights, d_weights, False)


def combine_backward(backend, d_out, weights, outputs):
    """(d_weights float32 [T, k], d_outputs float32 [T, k, H]) of out = combine(weights, outputs) for the
    upstream d_out [T, H] (contracts/moe.toml combine_backward)."""
    t, k = require_matrix("moe combine_backward: weights", weights, np.float32)
    if len(shape_of(outputs)) != 3 or shape_of(outputs)[:2] != (t, k) or np.dtype(outputs.dtype) != np.float32:
        raise InputError(f"moe combine_backward: outputs must be float32 [{t}, {k}, H], got "
                         f"{np.dtype(outputs.dtype).name} {shape_of(outputs)}")
    hidden = shape_of(outputs)[2]
    if shape_of(d_out) != (t, hidden) or np.dtype(d_out.dtype) != np.float32:
        raise InputError(f"moe combine_backward: d_out must be float32 [{t}, {hidden}], got "
                         f"{np.dtype(d_out.dtype).name} {shape_of(d_out)}")
    if backend.runs_reference:
        host = backend.to_numpy
        return reference.combine_backward(host(d_out), host(weights), host(outputs))
    require_contiguous("moe combine_backward: outputs", outputs)
    require_contiguous("moe combine_backward: d_out", d_out)
    if t * k == 0 or hidden == 0:
        return backend.zeros((t, k), np.float32), backend.zeros((t, k, hidden), np.float32)
    d_weights, d_outputs = backend.empty((t, k), np.float32), backend.empty((t, k, hidden), np.float32)
    backend.launch("moe", "moe_combine_backward", (min(t * k, GRID_LIMIT),), (BACKWARD_THREADS,),
                   (d_out, weights, outputs, np.int64(t), np.int32(k), np.int32(hidden), d_weights, d_outputs))
    return d_weights, d_outputs


def input_grad_sum(backend, dx, slot_of, pairs: int, t: int, k: int):
    """d h [t, H]: each token's 2k + 1 input-gradient rows of dx [2 pairs + t, H] (its k pairs' d g rows,
    their d u rows, then its router row), gathered in that order and added as moe_combine does with
    weights 1: one exact sum, one rounding."""
    hidden = shape_of(dx)[1]
    index = np.empty((t, 2 * k + 1), np.int32)
    index[:, 0:2 * k:2] = slot_of.reshape(t, k)
    index[:, 1:2 * k:2] = pairs + slot_of.reshape(t, k)
    index[:, 2 * k] = 2 * pairs + np.arange(t, dtype=np.int32)
    index = index.reshape(-1)
    terms = embedding.gather(backend, dx, backend.asarray(index), host_ids=index).reshape(t, 2 * k + 1, hidden)
    return combine(backend, backend.asarray(np.ones((t, 2 * k + 1), np.float32)), terms)


def block_backward(backend, h, router, gate: list, up: list, down: list, top_k: int, norm_topk_prob: bool, d_out,
                   weight: MoeWeight | None = None, transposed=None, aux: np.ndarray | None = None):
    """The sparse MLP's gradients for the upstream d_out [T, H] (contracts/moe.toml block_backward): a
    contract.moe.BlockGradients (d_h, d_router, per expert d_gate, d_up, d_down, d_logits, d_weights as
    backend arrays; experts on the host). router, gate, up, down: the float32 weights (router [E, H]; per
    expert [I, H], [I, H], [H, I]). weight: their encoding for the forward's products (encode's), when
    the caller has it; transposed(w, start, stop): the encoded (w[start:stop]).T for dX (a cache, as
    Model.transposed_weight), else gemm.encode_transposed. aux: the load-balancing loss's coefficients,
    float32 [E] on the host (contract.moe.load_balancing_coefficients), whose gradient is added to d_logits.

    On cpu: the reference's moe_block_backward. On a device (composed_block_backward): the same steps over
    the forward's grouping of the (token, slot) pairs by expert, the same bits."""
    t, hidden = require_matrix("moe block_backward: h", h)
    experts, router_hidden = require_matrix("moe block_backward: router", router)
    if router_hidden != hidden or shape_of(d_out) != (t, hidden):
        raise InputError(f"moe block_backward: h {shape_of(h)}, router {shape_of(router)} and d_out "
                         f"{shape_of(d_out)} must be [T, H], [E, H] and [T, H]")
    _check_top_k(experts, top_k)
    if backend.runs_reference:
        host = backend.to_numpy
        return reference.moe_block_backward(host(h), host(router), [host(w) for w in gate], [host(w) for w in up],
                                            [host(w) for w in down], top_k, norm_topk_prob, host(d_out),
                                            aux=None if aux is None else np.asarray(aux, dtype=np.float32))
    if weight is None:
        weight = encode(backend, router, gate, up, down, top_k, norm_topk_prob)
    return composed_block_backward(backend, h, router, gate, up, down, weight, d_out, transposed, aux)


def composed_block_backward(backend, h, router, gate, up, down, weight: MoeWeight, d_out, transposed, aux=None,
                            experts_pass=None, gate_up_input_grad=None):
    """The reference's moe_block_backward composed from device ops (its steps, named as there):
      forward: z = the router's gemm, route (moe_route), x = h's rows gathered into the pairs' grouped
        order (expert_groups: experts ascending, tokens ascending within; embedding.gather), per expert
        its g, u (gate/up gemm), a = swiglu(g, u) and y (down gemm), gathered back to [T, k, H];
      d_weights, d_y = moe_combine_backward;  d_z = moe_route_backward, plus (aux) load_balancing_backward's
        d z by residual.add, the reference's one float32 addition;
      d_router = dW(d_z, h) (every token in order), d_z W_r = dX(d_z, W_r);
      d_y's rows gathered into the grouped order; per expert over its run of rows: d_a = dX(d_y, D_e),
        d_g, d_u = swiglu_backward(g, u, d_a), dX(d_g, G_e), dX(d_u, U_e), and d_D_e = dW(d_y, a),
        d_G_e = dW(d_g, x), d_U_e = dW(d_u, x): the expert's pairs in ascending pair index, which is the
        reference's ascending token order;
      d_h = moe_combine(1, the 2k + 1 rows of each token): one row gather puts dX(d_g), dX(d_u) of every
        slot and d_z W_r in [T, 2k + 1, H]; with weights 1 every term is the row itself (exact), so it
        is the reference's exact_sum_f32 of those rows.
    Each product is row-independent (gemm contract) and the gathers copy rows, so the grouping is free.
    Tensor parallelism (model/parallel.py moe_block_backward) swaps the two steps that cross ranks:
    experts_pass(groups, t) -> _grouped_experts(keep=True)'s tuple, and gate_up_input_grad(saved, d_gu,
    pairs, dx), which writes dX(d_g, G_e) and dX(d_u, U_e) of d_gu [2 pairs, I] into dx's first 2 pairs rows."""
    t, hidden = shape_of(h)
    k = weight.top_k
    num_experts, inner = weight.num_experts, shape_of(gate[0])[0]
    zeros = backend.zeros
    logits = gemm.gemm(backend, h, weight.router)
    experts, weights = route(backend, logits, k, weight.norm_topk_prob)
    host_experts = backend.to_numpy(experts)
    pairs = t * k
    groups = list(reference.expert_groups(host_experts))
    d_gate = [None] * num_experts
    d_up = [None] * num_experts
    d_down = [None] * num_experts
    if pairs:
        outputs, order, slot_of, x, saved = (experts_pass(groups, t) if experts_pass else
                                             _grouped_experts(backend, h, weight, groups, t, keep=True))
        d_weights, d_y = combine_backward(backend, d_out, weights, outputs)
        d_logits = route_backward(backend, logits, experts, weights, d_weights, weight.norm_topk_prob)
        if aux is not None:
            d_logits = residual.add(backend, d_logits, load_balancing_backward(backend, logits, aux))
        d_y = embedding.gather(backend, d_y.reshape(pairs, hidden), backend.asarray(order.astype(np.int32)),
                               host_ids=order.astype(np.int32))
        dx = backend.empty((2 * pairs + t, hidden), np.float32)  # d g rows, d u rows (grouped), router rows
        d_gu = backend.empty((2 * pairs, inner), np.float32) if gate_up_input_grad else None
        for expert, start, stop, g, u, act in saved:
            dy = d_y[start:stop]
            d_g, d_u = activation.swiglu_backward(backend, g, u, gemm.input_grad(backend, dy, down[expert], transposed))
            if d_gu is None:
                backend.copy_into(dx[start:stop], gemm.input_grad(backend, d_g, gate[expert], transposed))
                backend.copy_into(dx[pairs + start:pairs + stop], gemm.input_grad(backend, d_u, up[expert], transposed))
            else:  # the products sum over ranks: all experts' rows at once, after the loop
                backend.copy_into(d_gu[start:stop], d_g)
                backend.copy_into(d_gu[pairs + start:pairs + stop], d_u)
            d_down[expert] = gemm.weight_grad(backend, dy, act)
            d_gate[expert] = gemm.weight_grad(backend, d_g, x[start:stop])
            d_up[expert] = gemm.weight_grad(backend, d_u, x[start:stop])
        if d_gu is not None:
            gate_up_input_grad(saved, d_gu, pairs, dx)
        backend.copy_into(dx[2 * pairs:], gemm.input_grad(backend, d_logits, router, transposed))
        d_h = input_grad_sum(backend, dx, slot_of, pairs, t, k)
        d_router = gemm.weight_grad(backend, d_logits, h)
    else:
        d_h, d_router = zeros((0, hidden), np.float32), zeros((num_experts, hidden), np.float32)
        d_logits, d_weights = zeros((0, num_experts), np.float32), zeros((0, k), np.float32)
    for expert in range(num_experts):  # an expert no token chose: zero gradients (of this rank's shard)
        if d_gate[expert] is None:
            d_gate[expert], d_up[expert] = zeros((inner, hidden), np.float32), zeros((inner, hidden), np.float32)
            d_down[expert] = zeros((hidden, inner), np.float32)
    return reference.BlockGradients(d_h, d_router, d_gate, d_up, d_down, d_logits, d_weights, host_experts, logits)
