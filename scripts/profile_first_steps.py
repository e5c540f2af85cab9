"""Where bench decode's first steps go: the request intake before the first step, then each step's launch
and wait (host clock), for the first steps of a 256 x 128-token run (Qwen3-0.6B shape, random weights).

    PYTHONPATH=$PWD python3 scripts/profile_first_steps.py [new_tokens=24]

Built and warmed up as `bench decode` does (bench.decode.measure_engine: one token budget of other
prompts, then every decode graph captured). Prints one JSON object: intake_s (generate's start to its
first step's launch), and per step its launch and wait seconds and the time at which it was recorded.
"""

import json
import sys
import time

import numpy as np

from rlportable.bench.decode import random_prompts
from rlportable.model.synthetic import IdsOnlyTokenizer
from rlportable.model.synthetic import qwen3_06b_config, random_weights
from rlportable.engine.llm import LLM
from rlportable.engine.sequence import SamplingParams
from rlportable.runtime import get_backend

NEW_TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 else 24
SEQUENCES, PROMPT_LEN, BLOCK_SIZE = 256, 128, 16

backend = get_backend("cuda")
config = qwen3_06b_config()
prompts = random_prompts(config, SEQUENCES, PROMPT_LEN)
max_len = PROMPT_LEN + 512
llm = LLM(device=backend, block_size=BLOCK_SIZE, num_blocks=SEQUENCES * -(-max_len // BLOCK_SIZE),
          max_num_seqs=SEQUENCES, max_num_batched_tokens=4096, max_model_len=max_len,
          loaded=(config, random_weights(config), IdsOnlyTokenizer()), sampler="device")
warm_prompts = (prompts[:32].astype(np.int64) + 1) % config.vocab_size
llm.generate([row.tolist() for row in warm_prompts], SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True,
                                                                    seed=1))
backend.synchronize()
llm.runner.capture_graphs()
backend.synchronize()

events = []  # (what, step index, rows, tokens, start, end) on the host clock
launch, wait = llm.runner.launch, llm.runner.wait
index_of, launched = {}, []  # the launched steps stay referenced, so that no id is reused


def timed_launch(out, after=None):
    start = time.perf_counter()
    step = launch(out, after)
    index_of[id(step)] = len(launched)
    launched.append(step)
    events.append(("launch", index_of[id(step)], len(out.scheduled), sum(e.end - e.start for e in out.scheduled),
                   start, time.perf_counter()))
    return step


def timed_wait(step):
    start = time.perf_counter()
    result = wait(step)
    events.append(("wait", index_of[id(step)], None, None, start, time.perf_counter()))
    return result


llm.runner.launch, llm.runner.wait = timed_launch, timed_wait
params = SamplingParams(n=1, temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True, seed=0)
ids = [row.tolist() for row in prompts]
begin = time.perf_counter()
llm.generate(ids, params)
backend.synchronize()
end = time.perf_counter()
first_launch = min(e[4] for e in events)
print(json.dumps({
    "new_tokens": NEW_TOKENS, "total_s": round(end - begin, 4), "intake_s": round(first_launch - begin, 4),
    "events": [dict(what=w, step=i, rows=r, tokens=t, at_ms=round((s - begin) * 1e3, 2),
                    ms=round((e - s) * 1e3, 2)) for w, i, r, t, s, e in events[:40]],
}, indent=1))
