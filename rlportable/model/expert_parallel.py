"""Expert parallelism for Qwen3-MoE: whole experts per rank, rows exchanged by all-to-all.

The layout (docs/parallelism.md, "Expert parallelism"): the ranks of an `ep_group` are ranks of one model
replica that hold the same tokens, as tensor-parallel ranks do; rank r of EP holds the whole experts
[r E / EP, (r + 1) E / EP) of every sparse layer (each still cut over its tensor-parallel group when TP > 1)
and everything else as it would without EP. A world is DP x EP x TP ranks: consecutive ranks share a
tensor-parallel group, then an expert-parallel one; the data-parallel replicas are the ranks with the
same place in their model (runtime/world.py layout_groups).

A sparse layer under EP (moe_block, moe_block_backward):
  * the router runs whole on every rank, so every rank knows every (token, slot) pair's expert;
  * each rank runs its own experts over the pairs routed to them, grouped as ops.moe groups them on one
    device (experts ascending, pairs ascending within): the same rows, so the same bits;
  * the tokens are dealt in contiguous shares of ceil(T / EP) (rank r combines share r): one all-to-all
    (a copy) sends each expert row to the rank of its token's share, which runs the single device's
    moe_combine over its tokens' k rows in slot order; an all-gather (a copy) makes out [T, H] whole on
    every rank;
  * the backward runs the same exchange in reverse: each share's combine_backward, d_weights all-gathered
    for the replicated router backward, d y rows sent back to the experts' ranks by the all-to-all, each
    rank's experts' gradients (its own, whole), their dX rows sent to the shares, where moe_combine with
    weights 1 adds each token's 2k + 1 rows as one device does; d h all-gathered.
Every exchanged value is a row copied whole, and every sum is the one-device sum over the same rows in
the same order: outputs and gradients are the one-device bits at any EP.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from rlportable.contract import moe as moe_reference
from rlportable.errors import InputError
from rlportable.model import parallel
from rlportable.model.config import ModelConfig
from rlportable.model.weights import ModelWeights
from rlportable.ops import activation, embedding, gemm, moe, residual
from rlportable.ops.checks import shape_of
from rlportable.runtime.collectives import Group


@dataclass(frozen=True)
class ExpertParallel(parallel.GroupRank):
    """Rank `rank` of `size` expert-parallel ranks: which experts it holds."""

    def check(self, config: ModelConfig) -> None:
        """An InputError in one line where the model cannot be cut into whole experts over the ranks."""
        if self.size == 1:
            return
        if not config.is_moe:
            raise InputError(f"expert parallelism: EP {self.size} needs a mixture-of-experts model; this "
                             f"{config.model_type} model has no experts (num_experts=0)")
        if config.num_experts % self.size:
            raise InputError(f"expert parallelism: num_experts={config.num_experts} is not divisible by the "
                             f"EP size {self.size}")

    def experts(self, num_experts: int) -> range:
        """The experts this rank holds: a contiguous num_experts / size of them."""
        per = num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def owner(self, expert: int, num_experts: int) -> int:
        """The rank that holds `expert`."""
        return expert // (num_experts // self.size)

    def shard_weights(self, weights: ModelWeights, config: ModelConfig) -> ModelWeights:
        """This rank's weights: every other rank's experts None (no copy of the arrays it keeps)."""
        if self.size == 1:
            return weights
        mine = self.experts(config.num_experts)

        def keep(arrays):
            return None if arrays is None else [a if e in mine else None for e, a in enumerate(arrays)]

        layers = [dataclasses.replace(layer, expert_gate=keep(layer.expert_gate), expert_up=keep(layer.expert_up),
                                      expert_down=keep(layer.expert_down)) for layer in weights.layers]
        return ModelWeights(embed=weights.embed, layers=layers, final_norm=weights.final_norm, lm_head=weights.lm_head)


def is_expert(name: str) -> bool:
    """Whether a tensor (by Hugging Face name) is one expert's: held by one expert-parallel rank."""
    return ".experts." in name


def expert_of(name: str) -> int:
    """The expert index of an expert's tensor name (model.layers.N.mlp.experts.E.gate_proj.weight)."""
    return int(name.split(".experts.")[1].split(".")[0])


class _Plan:
    """Where every (token, slot) pair's row goes: the experts' ranks compute, the shares' ranks combine.
    Known on every rank without communication (the routing is replicated)."""

    def __init__(self, host_experts: np.ndarray, ep: ExpertParallel, num_experts: int):
        t, k = host_experts.shape
        self.t, self.k, self.size = t, k, ep.size
        self.share = -(-t // ep.size)  # tokens per share, ceil(T / EP)
        groups = list(moe_reference.expert_groups(host_experts))
        #: per rank q, its experts' groups and their pairs in that order (ops.moe's order, restricted)
        self.groups = [[g for g in groups if ep.owner(g[0], num_experts) == q] for q in range(ep.size)]
        self.order = [np.concatenate([c for _, c in gs]) if gs else np.zeros(0, np.int64) for gs in self.groups]
        #: sent[q][d]: positions in order[q] of the pairs whose token is in share d (ascending)
        self.sent = [[np.flatnonzero(order // k // self.share == d) if self.share else np.zeros(0, np.int64)
                      for d in range(ep.size)] for order in self.order]
        self.width = max((p.size for row in self.sent for p in row), default=0)  # the exchange's rows per rank

    def tokens(self, d: int) -> range:
        return range(min(self.t, d * self.share), min(self.t, (d + 1) * self.share))

    def received(self, rank: int) -> np.ndarray:
        """int32 [share tokens x k]: for each pair of rank's share in (token, slot) order, its row in the
        all-to-all's [size x width] received rows."""
        base = self.tokens(rank).start * self.k
        index = np.empty(len(self.tokens(rank)) * self.k, np.int32)
        for q in range(self.size):
            pairs = self.order[q][self.sent[q][rank]]
            index[pairs - base] = q * self.width + np.arange(pairs.size, dtype=np.int32)
        return index

    def returned(self, rank: int) -> np.ndarray:
        """int32 [pairs of rank's experts]: for each row of order[rank], its row in the received rows of the
        reverse all-to-all (share d's rows come back in the order they were sent)."""
        index = np.empty(self.order[rank].size, np.int32)
        for d in range(self.size):
            positions = self.sent[rank][d]
            index[positions] = d * self.width + np.arange(positions.size, dtype=np.int32)
        return index


def _gather(backend, table, index: np.ndarray):
    index = np.ascontiguousarray(index, dtype=np.int32)
    return embedding.gather(backend, table, backend.asarray(index), host_ids=index)


def _to_shares(backend, ep_group: Group, plan: _Plan, rows):
    """The all-to-all of rows [n, C] (this rank's experts' pairs, in order[rank]) to their tokens' shares:
    [size x width, C] received rows (plan.received places them)."""
    columns = shape_of(rows)[1]
    send = backend.zeros((plan.size, plan.width, columns), np.float32)
    for d, positions in enumerate(plan.sent[ep_group.rank]):
        if positions.size:
            backend.copy_into(send[d, :positions.size], _gather(backend, rows, positions))
    return ep_group.all_to_all(send).reshape(plan.size * plan.width, columns)


def _to_experts(backend, ep_group: Group, plan: _Plan, share_rows):
    """The reverse all-to-all: share_rows [share pairs, C] (this rank's share, (token, slot) order) back to
    the ranks of their experts: [size x width, C] received rows (plan.returned places them)."""
    columns = shape_of(share_rows)[1]
    rank, base = ep_group.rank, plan.tokens(ep_group.rank).start * plan.k
    send = backend.zeros((plan.size, plan.width, columns), np.float32)
    for q in range(plan.size):
        pairs = plan.order[q][plan.sent[q][rank]]
        if pairs.size:
            backend.copy_into(send[q, :pairs.size], _gather(backend, share_rows, pairs - base))
    return ep_group.all_to_all(send).reshape(plan.size * plan.width, columns)


def _whole(backend, ep_group: Group, plan: _Plan, part):
    """[T, C] from every rank's share [share tokens, C] (padded to ceil(T / EP) rows, all-gathered: a copy)."""
    columns = shape_of(part)[1]
    padded = backend.zeros((plan.share, columns), np.float32)
    if shape_of(part)[0]:
        backend.copy_into(padded[:shape_of(part)[0]], part)
    everything = ep_group.all_gather(padded).reshape(plan.size * plan.share, columns)
    return everything[:plan.t]


def _share_outputs(backend, ep_group, tp_group, plan: _Plan, h, weight: moe.MoeWeight):
    """(outputs [share tokens, k, H] of this rank's share, and this rank's experts' (y, order, x, saved))."""
    hidden = shape_of(h)[1]
    mine = parallel.expert_rows(backend, tp_group, h, weight, plan.groups[ep_group.rank])
    received = _to_shares(backend, ep_group, plan, mine[0])
    index = plan.received(ep_group.rank)
    outputs = (_gather(backend, received, index) if index.size else backend.zeros((0, hidden), np.float32))
    return outputs.reshape(index.size // plan.k, plan.k, hidden), mine


def moe_block(backend, ep_group: Group, tp_group: Group, h, weight: moe.MoeWeight, encoded=None):
    """(out [T, H], experts int32 [T, k], weights float32 [T, k]): ops.moe.block of h [T, H] (whole on every
    rank), bitwise, from this rank's experts (weight: None for the other ranks' experts)."""
    t, hidden = shape_of(h)
    logits = gemm.gemm(backend, h, weight.router, encoded=encoded)
    experts, weights = moe.route(backend, logits, weight.top_k, weight.norm_topk_prob)
    k = weight.top_k
    if t * k == 0 or hidden == 0:  # the same on every rank (T is): no collective is skipped by one alone
        return moe.combine(backend, weights, backend.zeros((t, k, hidden), np.float32)), experts, weights
    plan = _Plan(backend.to_numpy(experts), ExpertParallel.of(ep_group), weight.num_experts)
    outputs, _ = _share_outputs(backend, ep_group, tp_group, plan, h, weight)
    share = plan.tokens(ep_group.rank)
    out = moe.combine(backend, weights[share.start:share.stop], outputs)
    return _whole(backend, ep_group, plan, out), experts, weights


def moe_block_backward(backend, ep_group: Group, tp_group: Group, h, router, gate: list, up: list, down: list,
                       weight: moe.MoeWeight, d_out, transposed, column_shard=None,
                       aux=None) -> moe_reference.BlockGradients:
    """ops.moe.block_backward of the whole block from this rank's experts (the lists hold None for the other
    ranks' experts, and a None gradient there): h and d_out whole on every rank; d_h, d_router, d_logits and
    d_weights whole and replicated; each held expert's gradients the one-device ones (TP: this rank's
    slices, column_shard as parallel.moe_block_backward's). transposed: Model.transposed_weight."""
    t, hidden = shape_of(h)
    k, num_experts = weight.top_k, weight.num_experts
    zeros = backend.zeros
    logits = gemm.gemm(backend, h, weight.router)
    experts, weights = moe.route(backend, logits, k, weight.norm_topk_prob)
    host_experts = backend.to_numpy(experts)
    ep = ExpertParallel.of(ep_group)
    mine = ep.experts(num_experts)
    d_gate, d_up, d_down = [None] * num_experts, [None] * num_experts, [None] * num_experts
    if t * k == 0 or hidden == 0:
        d_h, d_router = zeros((t, hidden), np.float32), zeros((num_experts, hidden), np.float32)
        d_logits, d_weights = zeros((t, num_experts), np.float32), zeros((t, k), np.float32)
    else:
        plan = _Plan(host_experts, ep, num_experts)
        share = plan.tokens(ep.rank)
        outputs, mine_rows = _share_outputs(backend, ep_group, tp_group, plan, h, weight)
        order, x, saved = mine_rows[1:]  # the experts' output rows went to the shares: not kept
        del mine_rows
        n, share_pairs = order.size, len(share) * k
        d_weights_share, d_y_share = moe.combine_backward(backend, d_out[share.start:share.stop],
                                                         weights[share.start:share.stop], outputs)
        d_weights = _whole(backend, ep_group, plan, d_weights_share)
        d_logits = moe.route_backward(backend, logits, experts, weights, d_weights, weight.norm_topk_prob)
        if aux is not None:
            d_logits = residual.add(backend, d_logits, moe.load_balancing_backward(backend, logits, aux))
        d_router = gemm.weight_grad(backend, d_logits, h)
        router_rows = gemm.input_grad(backend, d_logits, router, transposed)  # d z W_r, every token
        received = _to_experts(backend, ep_group, plan, d_y_share.reshape(share_pairs, hidden))
        d_y = _gather(backend, received, plan.returned(ep.rank)) if n else zeros((0, hidden), np.float32)
        del received, d_y_share
        dx = backend.empty((2 * n, hidden), np.float32)  # this rank's pairs' dX(d g) rows, then dX(d u)
        inner = shape_of(gate[mine.start])[0]
        d_gu = backend.empty((2 * n, inner), np.float32) if tp_group.size > 1 else None
        for expert, start, stop, g, u, act in saved:
            dy = d_y[start:stop]
            d_g, d_u = activation.swiglu_backward(backend, g, u, gemm.input_grad(backend, dy, down[expert], transposed))
            if d_gu is None:
                backend.copy_into(dx[start:stop], gemm.input_grad(backend, d_g, gate[expert], transposed))
                backend.copy_into(dx[n + start:n + stop], gemm.input_grad(backend, d_u, up[expert], transposed))
            else:  # the products sum over the tensor-parallel ranks: all experts' rows at once, after the loop
                backend.copy_into(d_gu[start:stop], d_g)
                backend.copy_into(d_gu[n + start:n + stop], d_u)
            d_down[expert] = gemm.weight_grad(backend, dy, act)
            d_gate[expert] = gemm.weight_grad(backend, d_g, x[start:stop])
            d_up[expert] = gemm.weight_grad(backend, d_u, x[start:stop])
        if d_gu is not None and n:  # n is the same on this rank's tensor-parallel group (the same experts)
            parallel.gate_up_input_grad(backend, tp_group, gate, up, column_shard, saved, d_gu, n, dx)
        index = plan.received(ep.rank)
        terms = backend.empty((2 * share_pairs + len(share), hidden), np.float32)  # input_grad_sum's layout
        if share_pairs:
            backend.copy_into(terms[:share_pairs], _gather(backend, _to_shares(backend, ep_group, plan, dx[:n]), index))
            backend.copy_into(terms[share_pairs:2 * share_pairs],
                              _gather(backend, _to_shares(backend, ep_group, plan, dx[n:]), index))
            backend.copy_into(terms[2 * share_pairs:], router_rows[share.start:share.stop])
            d_h_share = moe.input_grad_sum(backend, terms, np.arange(share_pairs, dtype=np.int32), share_pairs,
                                           len(share), k)
        else:  # this rank's share is empty (T < EP shares): it still takes part in both exchanges
            _to_shares(backend, ep_group, plan, dx[:n])
            _to_shares(backend, ep_group, plan, dx[n:])
            d_h_share = zeros((0, hidden), np.float32)
        d_h = _whole(backend, ep_group, plan, d_h_share)
    for expert in mine:  # an expert of this rank that no token chose: zero gradients (of its TP shard)
        if d_gate[expert] is None:
            inner = shape_of(gate[expert])[0]
            d_gate[expert], d_up[expert] = zeros((inner, hidden), np.float32), zeros((inner, hidden), np.float32)
            d_down[expert] = zeros((hidden, inner), np.float32)
    return moe_reference.BlockGradients(d_h, d_router, d_gate, d_up, d_down, d_logits, d_weights, host_experts,
                                        logits)


def gather_experts(backend, ep_group: Group, config: ModelConfig, named: dict, keep: bool = True) -> dict | None:
    """The whole model's tensors by name, in checkpoint order, from every expert-parallel rank's `named`
    (host arrays: this rank's experts, each whole over tensor parallelism, and where keep the replicated
    tensors): every expert's tensors all-gathered from their ranks (copies); every rank must call,
    keep=False: this rank only takes part and gets None."""
    if ep_group.size == 1:
        return named if keep else None
    from rlportable.model.weights import expected_tensors

    ep = ExpertParallel.of(ep_group)
    mine = ep.experts(config.num_experts)
    first, per = mine.start, len(mine)
    gathered: dict = {}
    for name in named:  # the same local names in the same order on every rank, up to the expert index
        if not is_expert(name):
            continue
        local = expert_of(name) - first
        parts = ep_group.all_gather(backend.asarray(np.ascontiguousarray(named[name])))
        if not keep:  # a rank that only sends holds one tensor's parts at a time
            continue
        parts = backend.to_numpy(parts)
        head, tail = name.split(".experts.")
        rest = tail.split(".", 1)[1]
        for q in range(ep.size):
            gathered[f"{head}.experts.{q * per + local}.{rest}"] = parts[q]
    if not keep:
        return None
    return {name: gathered[name] if is_expert(name) else named[name] for name in expected_tensors(config)}
