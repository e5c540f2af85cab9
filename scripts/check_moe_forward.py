"""Qwen3-MoE's forward on a device backend against the cpu reference, on raw bits.

    PYTHONPATH=. python3 scripts/check_moe_forward.py --device cuda [--kernel-source hip] [--json OUT]

Random-weight models (model/synthetic.py random_weights, the routers scaled so that tokens spread over
the experts): four tiny configs (k = 1 with and without norm_topk_prob, k = 2, k = 3 with every second
layer sparse) and Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts of width 768, 8 active,
renormalised; --big-layers of its 48 layers, the vocabulary cut to --big-vocab). Per config: the
log-probs, every row's logits and each sparse layer's expert choices of packed sequences (one of them
3 tokens alone, so that most experts get no token), then LLM.generate with the backend's defaults
(decode buckets; graphs are off for MoE) and with the device sampler, against the cpu engine's tokens,
log-prob bits and expert choices. Prints (and writes with --json) one JSON record; exits 1 on any
mismatch. On hip-cpu it runs too (the tiny configs only, unless --big-layers is given).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from rlportable.engine.llm import LLM
from rlportable.engine.sequence import SamplingParams
from rlportable.model import backward
from rlportable.model.config import ModelConfig
from rlportable.model.forward import Model
from rlportable.model.synthetic import IdsOnlyTokenizer, QWEN3_MOE_SHAPES, random_weights
from rlportable.provenance import provenance
from rlportable.runtime import get_backend

TINY = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 40,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False}
TINY_CASES = [dict(num_experts_per_tok=1, norm_topk_prob=True), dict(num_experts_per_tok=1, norm_topk_prob=False),
              dict(num_experts_per_tok=2), dict(num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2,
                                                 num_hidden_layers=3)]


def weights_for(config: ModelConfig, seed: int, router_scale: float):
    weights = random_weights(config, seed)
    for layer in weights.layers:
        if layer.router is not None:
            layer.router = (layer.router * router_scale).astype(np.float32)
    return weights


def raw(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a


class Count:
    def __init__(self):
        self.compared = self.mismatches = 0
        self.where: list[str] = []

    def add(self, name: str, got, want) -> None:
        got, want = raw(got), raw(want)
        self.compared += want.size
        if got.shape != want.shape:
            self.mismatches += want.size
            self.where.append(f"{name}: shape {got.shape} against {want.shape}")
            return
        bad = int(np.count_nonzero(got != want))
        if bad:
            self.mismatches += bad
            self.where.append(f"{name}: {bad} of {want.size}")


def forward(model: Model, tokens, cu):
    fwd = backward.forward(model, tokens, cu, keep_attention=False)
    logits = model.logits(model.hidden_states(tokens, cu))
    return model.backend.to_numpy(fwd.logp), model.backend.to_numpy(logits), fwd.routing


def check_config(name: str, config: ModelConfig, weights, device, cpu, sequences: list[int], count: Count,
                 engine: bool) -> dict:
    rng = np.random.default_rng(len(name))
    started = time.perf_counter()
    on_cpu, on_device = Model(cpu, config, weights), Model(device, config, weights)
    unused = []
    for lengths in (sequences, [3]):
        tokens = rng.integers(0, config.vocab_size, sum(lengths)).astype(np.int32)
        cu = np.concatenate([[0], np.cumsum(lengths)])
        want, got = forward(on_cpu, tokens, cu), forward(on_device, tokens, cu)
        tag = f"{name} T={tokens.size}"
        count.add(f"{tag} logp", got[0], want[0])
        count.add(f"{tag} logits", got[1], want[1])
        for layer, (g, w) in enumerate(zip(got[2], want[2])):
            count.add(f"{tag} experts layer {layer}", g, w)
        unused.append([int(config.num_experts - np.unique(w).size) for w in want[2]])
    record = {"config": name, "experts_without_a_token": unused}
    if engine:
        prompts = [[int(t) for t in rng.integers(0, config.vocab_size, n)] for n in (3, 5, 9)]
        params = SamplingParams(n=2, max_tokens=6, temperature=1.0, ignore_eos=True)
        want = LLM(device=cpu, loaded=(on_cpu, IdsOnlyTokenizer()), max_num_seqs=4, block_size=4,
                   cuda_graphs=True).generate(prompts, params, seed=1)
        for sampler in ("host", "device"):
            llm = LLM(device=device, loaded=(on_device, IdsOnlyTokenizer()), max_num_seqs=4, block_size=4,
                      sampler=sampler)
            got = llm.generate(prompts, params, seed=1)
            record[f"engine_{sampler}_sampler"] = {"graphs": llm.runner.cuda_graphs,
                                                   "async_scheduling": llm.async_scheduling}
            for i, (w, g) in enumerate(zip(want, got)):
                for j, (ws, gs) in enumerate(zip(w.outputs, g.outputs)):
                    tag = f"{name} engine {sampler} prompt {i} sample {j}"
                    count.add(f"{tag} tokens", np.array(gs.token_ids), np.array(ws.token_ids))
                    count.add(f"{tag} logp", np.array(gs.logprobs, np.float32), np.array(ws.logprobs, np.float32))
                    count.add(f"{tag} experts", np.stack(gs.routing), np.stack(ws.routing))
    record["seconds"] = round(time.perf_counter() - started, 2)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kernel-source", default="native")
    parser.add_argument("--big-layers", type=int, default=None,
                        help="layers of the Qwen3-30B-A3B shape (default: 2 on a GPU, none on hip-cpu)")
    parser.add_argument("--big-vocab", type=int, default=8192)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = get_backend(args.device, kernel_source=args.kernel_source)
    cpu = get_backend("cpu")
    big_layers = args.big_layers if args.big_layers is not None else (0 if device.on_host else 2)
    count, records = Count(), []
    for index, overrides in enumerate(TINY_CASES):
        config = ModelConfig.from_dict({**TINY, **overrides})
        name = "tiny " + ", ".join(f"{k}={v}" for k, v in overrides.items())
        records.append(check_config(name, config, weights_for(config, index, 50.0), device, cpu, [1, 4, 21], count,
                                    engine=index in (1, 2)))
        print(json.dumps(records[-1]), flush=True)
    if big_layers:
        shape = {**QWEN3_MOE_SHAPES["qwen3-30b-a3b"], "num_hidden_layers": big_layers, "vocab_size": args.big_vocab}
        config = ModelConfig.from_dict({"architectures": ["Qwen3MoeForCausalLM"], **shape})
        # the routers 0.02 * 8 = 0.16 per weight: logits spread by about 0.16 |h| sqrt(H) / sqrt(H) per token
        records.append(check_config(f"qwen3-30b-a3b shape, {big_layers} layers, vocabulary {args.big_vocab}", config,
                                    weights_for(config, 7, 8.0), device, cpu, [64, 1, 100, 27], count, engine=True))
        print(json.dumps(records[-1]), flush=True)
    result = {"check": "moe forward against the cpu reference, raw bits", "device": device.label,
              "info": device.info(), **provenance(), "compared": count.compared, "mismatches": count.mismatches,
              "where": count.where[:20], "configs": records}
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 1 if count.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
