"""Where an end-to-end mismatch starts: the first diverging op, layer, token and element, and a reproducer.

Given the first completion token whose engine log-prob differs from the trainer's (end_to_end.Failure),
both sides are replayed with every intermediate value of the forward recorded for the tokens of that
sequence up to the diverging one (the prefix of positions 0..p):
  * the engine: the same generate() call again (a fresh LLM, the same arguments; on a device without
    graphs, since a replayed graph runs no Python), its runner's steps mapped row by row to positions
    of the sequence (any sequence with the same token prefix counts: forks, prefix-cache donors), the
    values kept from the last computation before the step that samples the diverging token;
  * the trainer: the same micro-batch through the same forward (train.trainer.completion_logprobs).
The chain embedding -> each layer's ops in Model._layer's order -> final norm -> LM head + log-prob
is walked in order; the first op whose output differs at any position (smallest position first) is
reported with its first differing element, and whether its own inputs agreed (then the op itself
diverged) or not. The op's inputs from both sides, its small weights and the token ids go to an .npz,
the configuration and the command that reruns the check to a .json, in the run's repro_dir.

The hooks are instance attributes on the Model and the runner, removed afterwards; engine and model
code are unchanged.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from rlportable.ops import residual

#: (op, the Model._layer record key of its output), in the order a layer computes them
LAYER_OPS = (("attn_norm", "h1"), ("q_proj", "q_lin"), ("k_proj", "k_lin"), ("v_proj", "v"),
             ("q_norm_rope", "q"), ("k_norm_rope", "k"), ("attention", "a"), ("o_proj_residual", "x2"),
             ("mlp_norm", "h2"), ("gate_proj", "gate"), ("up_proj", "up"), ("swiglu", "mlp"),
             ("down_proj_residual", "out"))
#: each op's inputs (record keys; "x" is the layer's input) and weights (LayerWeights fields)
OP_INPUTS = {"attn_norm": ("x",), "q_proj": ("h1",), "k_proj": ("h1",), "v_proj": ("h1",),
             "q_norm_rope": ("q_lin",), "k_norm_rope": ("k_lin",), "attention": ("q", "k", "v"),
             "o_proj_residual": ("a", "x"), "mlp_norm": ("x2",), "gate_proj": ("h2",), "up_proj": ("h2",),
             "swiglu": ("gate", "up"), "down_proj_residual": ("mlp", "x2")}
OP_WEIGHTS = {"attn_norm": ("attn_norm",), "q_proj": ("q", "q_bias"), "k_proj": ("k", "k_bias"),
              "v_proj": ("v", "v_bias"), "q_norm_rope": ("q_norm",), "k_norm_rope": ("k_norm",),
              "o_proj_residual": ("o",), "mlp_norm": ("mlp_norm",), "gate_proj": ("gate",), "up_proj": ("up",),
              "down_proj_residual": ("down",)}
#: what each op computes, in the contract ops' terms (for the reproducer's reader)
OP_CALLS = {
    "embedding": "ops.embedding.gather(embed, tokens)",
    "attn_norm": "ops.norm.rmsnorm(x, weight_attn_norm, eps)",
    "q_proj": "ops.gemm.gemm(h1, encode_weight(weight_q)) (+ q_bias)",
    "k_proj": "ops.gemm.gemm(h1, encode_weight(weight_k)) (+ k_bias)",
    "v_proj": "ops.gemm.gemm(h1, encode_weight(weight_v)) (+ v_bias)",
    "q_norm_rope": "ops.rope.apply(ops.norm.rmsnorm_heads(q_lin per head, weight_q_norm, eps), positions)",
    "k_norm_rope": "ops.rope.apply(ops.norm.rmsnorm_heads(k_lin per head, weight_k_norm, eps), positions)",
    "attention": "causal attention of q over k, v of positions 0..p (trainer: ops.attention.attention_packed; "
                 "engine: write_kv into the paged cache, then attention_paged)",
    "o_proj_residual": "ops.residual.add(x, ops.gemm.gemm(a flattened, encode_weight(weight_o)))",
    "mlp_norm": "ops.norm.rmsnorm(x2, weight_mlp_norm, eps)",
    "gate_proj": "ops.gemm.gemm(h2, encode_weight(weight_gate))",
    "up_proj": "ops.gemm.gemm(h2, encode_weight(weight_up))",
    "swiglu": "ops.activation.swiglu(gate, up)",
    "down_proj_residual": "ops.residual.add(x2, ops.gemm.gemm(mlp, encode_weight(weight_down)))",
    "final_norm": "ops.norm.rmsnorm(out of the last layer, weight_final_norm, eps)",
    "lm_head_logprob": "log-prob of the sampled token under (final @ lm_head^T) / T (trainer: "
                       "ops.logprob.lm_head_logprobs; engine: model.logits, then the sampler's sampled_logprobs)",
}
MAX_WEIGHT_ELEMENTS = 1 << 22  # larger weights are named in the JSON (seeded), not copied into the .npz


class Recorder:
    """Rows of one sequence prefix (target token ids, positions 0..p), every op's output, host copies."""

    def __init__(self, backend, target: np.ndarray, owner: tuple[int, int] | None = None):
        self.backend = backend
        self.target = np.asarray(target, dtype=np.int64)
        self.owner = owner  # (request, sample) whose sampling step at position p ends an engine recording
        self.values: dict = defaultdict(dict)  # (key, layer) -> {position: row}
        self.shapes: dict = {}  # (key, layer) -> the per-token shape
        self.rows = self.positions = None  # rows of the running forward to keep, and their positions
        self.done = False

    # ---- what to keep
    def keep(self, key: str, layer: int | None, array) -> None:
        shape = tuple(int(d) for d in array.shape)
        self.shapes[(key, layer)] = shape[1:]
        for position, row in zip(self.positions, _host_rows(self.backend, array, self.rows)):
            self.values[(key, layer)][int(position)] = row

    @contextmanager
    def watching(self, model):
        """Record model._layer and model._forward (instance attributes shadowing the methods)."""
        layer_method, forward_method = model._layer, model._forward
        index = {id(layer): i for i, layer in enumerate(model.layers)}

        def layer(device_layer, x, positions, cos, sin, attend, record=None, **given):
            # given: h1 (and its gemm encoding) when the caller normalised x itself (Model._forward)
            if self.rows is None:
                return layer_method(device_layer, x, positions, cos, sin, attend, record, **given)
            record = {} if record is None else record
            out = layer_method(device_layer, x, positions, cos, sin, attend, record, **given)
            # the layer's output residual.add(x2, mlp_out): the caller adds it in the next norm's launch
            # (norm.add_rmsnorm, whose sum is bitwise this one)
            total = residual.add(self.backend, *out)
            for key, array in {**record, "x": x, "out": total}.items():
                self.keep(key, index[id(device_layer)], array)
            return out

        def forward(*args, **kwargs):
            out = forward_method(*args, **kwargs)
            if self.rows is not None:
                self.keep("final", None, out)
            return out

        model._layer, model._forward = layer, forward
        try:
            yield self
        finally:
            del model._layer, model._forward

    # ---- the engine's steps
    def attach_engine(self, runner) -> None:
        execute = runner.execute

        def recorded(out):
            if self.done:
                return execute(out)
            rows, positions, last_step = self._engine_rows(out.scheduled)
            if rows.size:
                self.rows, self.positions = rows, positions
            try:
                return execute(out)
            finally:
                self.rows = self.positions = None
                self.done = last_step

        runner.execute = recorded

    def detach_engine(self, runner) -> None:
        del runner.execute

    def _engine_rows(self, scheduled) -> tuple[np.ndarray, np.ndarray, bool]:
        """Rows of this step (entries in order, num_new_tokens rows each) whose sequence shares the
        target's tokens up to their position; whether this step samples the target's diverging token."""
        last = self.target.size - 1
        rows, positions, last_step, offset = [], [], False, 0
        for entry in scheduled:
            common = _common_prefix(entry.seq.all_token_ids, self.target)
            for position in range(entry.start, min(entry.end, common)):
                rows.append(offset + position - entry.start)
                positions.append(position)
            if entry.end - 1 == last and common > last and entry.needs_sample and any(
                    (s.request_id, s.sample_index) == self.owner for s in entry.sample_seqs):
                last_step = True
            offset += entry.num_new_tokens
        return np.asarray(rows, np.int64), np.asarray(positions, np.int64), last_step


def _common_prefix(tokens: list[int], target: np.ndarray) -> int:
    n = min(len(tokens), target.size)
    differ = np.flatnonzero(np.asarray(tokens[:n], dtype=np.int64) != target[:n])
    return int(differ[0]) if differ.size else n


def _host_rows(backend, array, rows: np.ndarray) -> np.ndarray:
    """Host copies of rows of a [T, ...] float32 backend array, flattened to [len(rows), elements]:
    the contract's row gather (a bit copy), so only these rows come back from a device."""
    from rlportable.ops import embedding

    shape = tuple(int(d) for d in array.shape)
    flat = array.reshape(shape[0], int(np.prod(shape[1:], dtype=np.int64)))
    ids = rows.astype(np.int32)
    return np.array(backend.to_numpy(embedding.gather(backend, flat, backend.asarray(ids), host_ids=ids)))


# ----------------------------------------------------------------------------- the chain


def chain(num_layers: int):
    """(op, layer, output key) from the embedding to the LM head's log-prob."""
    yield "embedding", None, ("x", 0)
    for layer in range(num_layers):
        for op, key in LAYER_OPS:
            yield op, layer, (key, layer)
    yield "final_norm", None, ("final", None)
    yield "lm_head_logprob", None, ("logprob", None)


def op_inputs(op: str, layer: int | None, num_layers: int) -> list[tuple[str, int | None]]:
    if op == "embedding":
        return []
    if op == "final_norm":
        return [("out", num_layers - 1)]
    if op == "lm_head_logprob":
        return [("final", None)]
    return [(key, layer) for key in OP_INPUTS[op]]


def _differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))


def first_divergence(engine: Recorder, trainer: Recorder, num_layers: int) -> dict | None:
    """The first op along the chain whose output differs at some position, the smallest such position,
    its first differing element; None when every recorded value agrees."""
    for op, layer, key in chain(num_layers):
        ours, theirs = engine.values.get(key, {}), trainer.values.get(key, {})
        common = sorted(set(ours) & set(theirs))
        for position in common:
            differ = _differ(ours[position], theirs[position])
            if not differ.size:
                continue
            element = int(differ[0])
            shape = engine.shapes.get(key, (ours[position].size,))
            return {"op": op, "layer": layer, "position": position, "element": element,
                    "element_index": [int(i) for i in np.unravel_index(element, shape)],
                    "engine_value": float(ours[position][element]), "trainer_value": float(theirs[position][element]),
                    "engine_bits": f"0x{int(ours[position].view(np.uint32)[element]):08x}",
                    "trainer_bits": f"0x{int(theirs[position].view(np.uint32)[element]):08x}",
                    "differing_elements": int(differ.size), "positions_compared": len(common),
                    "inputs_agree": _inputs_agree(engine, trainer, op_inputs(op, layer, num_layers), position)}
    return None


def _inputs_agree(engine: Recorder, trainer: Recorder, keys, position: int) -> bool | None:
    """Whether the op's inputs agree at every recorded position up to `position` (None: nothing to compare)."""
    seen = False
    for key in keys:
        ours, theirs = engine.values.get(key, {}), trainer.values.get(key, {})
        for p in sorted(set(ours) & set(theirs)):
            if p <= position:
                seen = True
                if _differ(ours[p], theirs[p]).size:
                    return False
    return True if seen else None


# ----------------------------------------------------------------------------- replay and report


def replay(loaded, failure) -> tuple[Recorder, Recorder, np.float32 | None]:
    """Both sides again with recorders; returns them and the engine's replayed log-prob."""
    from rlportable.train.trainer import completion_logprobs

    completion, j = failure.completion, failure.index
    target = np.asarray(completion.prompt + completion.tokens[:j], dtype=np.int64)  # positions 0..p
    backend, model = loaded.model.backend, loaded.model
    engine = Recorder(backend, target, owner=(completion.request, completion.sample))
    with engine.watching(model):
        completions, _ = failure.run.generate(loaded, recorder=engine, eager=True)
    again = next((c for c in completions if (c.request, c.sample) == (completion.request, completion.sample)), None)
    replayed = again.logprobs[j] if again is not None and again.logprobs.size > j else None
    trainer = Recorder(backend, target)
    trainer.rows = failure.pack.start + np.arange(target.size)
    trainer.positions = np.arange(target.size)
    with trainer.watching(model):
        _, logps = completion_logprobs(model, failure.pack.batch, failure.pack.temperature)
    trainer.rows = trainer.positions = None
    p = target.size - 1
    trainer.values[("logprob", None)][p] = np.asarray(logps[failure.pack.index][j:j + 1], np.float32)
    if replayed is not None:
        engine.values[("logprob", None)][p] = np.array([replayed], np.float32)
    return engine, trainer, replayed


def locate(loaded, failure, command: str, repro_dir: Path) -> dict:
    """{"first_divergence": ..., "reproducer": [files in repro_dir]} for the check's report."""
    engine, trainer, replayed = replay(loaded, failure)
    num_layers = len(loaded.model.layers)
    where = first_divergence(engine, trainer, num_layers)
    completion = failure.completion
    report = {
        "request": completion.request, "sample": completion.sample, "output_index": failure.index,
        "diverging_position": len(completion.prompt) + failure.index - 1,
        "engine_logprob": float(failure.engine_logprob), "trainer_logprob": float(failure.trainer_logprob),
        "reproduced": bool(replayed is not None and np.float32(replayed).view(np.uint32)
                           == np.float32(failure.engine_logprob).view(np.uint32)),
        "replayed_without_graphs": bool(loaded.model.backend.supports_graphs),
        "trainer_packing": failure.pack.packing,
    }
    if where is None:
        report["note"] = "no recorded value differs in the replay (the mismatch did not reproduce)"
        where = {"op": "none", "layer": None, "position": report["diverging_position"]}
    files = write_reproducer(Path(repro_dir), loaded, failure, engine, trainer, where, report, command)
    return {"first_divergence": {**where, **report}, "reproducer": [str(f) for f in files]}


def _stack(recorder: Recorder, key, position: int, causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """The recorded rows of `key` at `position` (and before it, for attention's keys and values)."""
    values = recorder.values.get(key, {})
    positions = np.array(sorted(p for p in values if p == position or (causal and p < position)), dtype=np.int64)
    shape = recorder.shapes.get(key)
    rows = [values[p] if shape is None else values[p].reshape(shape) for p in positions]
    return positions, (np.stack(rows) if rows else np.zeros((0,), np.float32))


def _weights(loaded, op: str, layer: int | None) -> dict[str, np.ndarray]:
    weights = loaded.weights
    if op == "final_norm":
        arrays = {"final_norm": weights.final_norm}
    elif op == "lm_head_logprob":
        arrays = {"lm_head": weights.lm_head}
    else:
        arrays = {name: getattr(weights.layers[layer], name) for name in OP_WEIGHTS.get(op, ())}
    return {f"weight_{name}": np.asarray(a) for name, a in arrays.items()
            if a is not None and np.asarray(a).size <= MAX_WEIGHT_ELEMENTS}


def write_reproducer(folder: Path, loaded, failure, engine: Recorder, trainer: Recorder, where: dict,
                     report: dict, command: str) -> list[Path]:
    """<check>.<model>.<op>[.layerL].npz (the op's inputs and outputs from both sides, token ids, small
    weights) and the .json beside it (configuration, divergence, command)."""
    from rlportable.provenance import provenance

    op, layer, upto = where["op"], where.get("layer"), where["position"]
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{failure.check}.{loaded.spec}.{op}"
                  + ("" if layer is None else f".layer{layer}"))
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {"tokens": engine.target.astype(np.int32)}
    num_layers = len(loaded.model.layers)
    output = next((key for o, l, key in chain(num_layers) if o == op and l == layer), None)
    for side, recorder in (("engine", engine), ("trainer", trainer)):
        for key in op_inputs(op, layer, num_layers) + ([output] if output else []):
            name = "output" if key == output else key[0]
            causal = op == "attention" and name in ("k", "v")
            arrays[f"{side}_{name}_positions"], arrays[f"{side}_{name}"] = _stack(recorder, key, upto, causal)
    arrays.update(_weights(loaded, op, layer))
    completion = failure.completion
    if op == "lm_head_logprob":
        arrays["target_token"] = np.int32(completion.tokens[failure.index])
        arrays["temperature"] = np.float64(failure.pack.temperature)
    params = failure.run.params[completion.request]
    npz = folder / f"{stem}.npz"
    np.savez_compressed(npz, **arrays)
    meta = {
        "check": failure.check, "model": {**loaded.describe, "config": _config(loaded.model.config)},
        "device": loaded.model.backend.label, "op_computes": OP_CALLS.get(op),
        "backend": loaded.model.backend.info(), "command": command,
        "first_divergence": {**where, **report},
        "engine": failure.run.engine, "run": failure.run.label,
        "sampling": {name: getattr(params, name) for name in params.__dataclass_fields__},
        "prompt_token_ids": completion.prompt, "completion_token_ids": completion.tokens,
        "trainer": {"packing": failure.pack.packing, "temperature": failure.pack.temperature,
                    "micro_batch_tokens": int(failure.pack.batch.tokens.size), "offset": int(failure.pack.start)},
        "npz": npz.name, "npz_arrays": sorted(arrays),
        "provenance": provenance(),
    }
    path = folder / f"{stem}.json"
    path.write_text(json.dumps(meta, indent=2, default=_json_default) + "\n")
    return [npz, path]


def _config(config) -> dict:
    import dataclasses

    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(vars(config))


def _json_default(value):
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if isinstance(value, (tuple, set)):
        return list(value)
    return str(value)
