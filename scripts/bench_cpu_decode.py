"""Greedy decode speed of the cpu backend on a SmolLM-135M-shaped Llama (30 layers, hidden 576,
9 / 3 heads, vocabulary 49152; random weights), one sequence.

    PYTHONPATH=. python3 scripts/bench_cpu_decode.py [new_tokens] > result.json
The first call (one token) builds the cached weight integers and prefills; the tokens/s are those
of the second call's tokens after its first.
"""

import json
import os
import sys
import time

from rlportable.model.synthetic import IdsOnlyTokenizer
from rlportable.model.synthetic import random_weights
from rlportable.engine.llm import LLM
from rlportable.engine.sequence import SamplingParams
from rlportable.model.config import ModelConfig
from rlportable.model.forward import Model
from rlportable.provenance import provenance
from rlportable.runtime import get_backend

new_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 32
config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                     rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None, max_position_embeddings=2048,
                     tie_word_embeddings=True, qkv_bias=False, qk_norm=False)
backend = get_backend("cpu")
model = Model(backend, config, random_weights(config))
llm = LLM(device=backend, loaded=(model, IdsOnlyTokenizer()), max_num_seqs=1)
prompt = [[1, 2, 3, 4, 5, 6, 7, 8]]
start = time.perf_counter()
llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
first_s = time.perf_counter() - start
start = time.perf_counter()
llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
one_s = time.perf_counter() - start
start = time.perf_counter()
llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens + 1, ignore_eos=True))
total_s = time.perf_counter() - start
print(json.dumps({"model": "SmolLM-135M shape (Llama), random weights", "cpus": os.cpu_count(),
                  "first_call_s": first_s, "one_token_call_s": one_s, "new_tokens": new_tokens,
                  "call_s": total_s, "tokens_per_s_after_first": new_tokens / (total_s - one_s),
                  "target_tokens_per_s": 8, "provenance": provenance()}, indent=1))
