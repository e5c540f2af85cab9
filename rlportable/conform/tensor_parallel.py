"""`rlportable conform --tp N`: tensor parallelism on real ranks, bitwise against one device.

Every rank runs every check (the collectives need all of them); rank 0 also computes the
single-device result and compares, bit for bit:
  * tp.row_parallel_gemm: K-shards of X and W through the exact all-reduces == gemm(X, W);
  * tp.vocab_embedding / tp.vocab_logprobs: vocabulary shards == embedding.gather / logprob.logprobs;
  * tp.model.<model>: Model.logprobs at TP=N == at TP=1 (packed sequences, two temperatures);
  * tp.engine.<model>: the engine at TP=N samples the same tokens with the same log-prob bits as at
    TP=1, and the single-device trainer's forward recomputes those log-probs bit for bit.
The ranks are processes with NCCL / RCCL (one per GPU: `--tp N` or torchrun) or, with --emulate
and on cpu, threads of one process (runtime/collectives.py).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from rlportable.conform import selected
from rlportable.conform.tally import CheckResult, Tally, check_rng
from rlportable.engine.sequence import SamplingParams
from rlportable.model import parallel
from rlportable.ops import embedding, gemm, logprob

MODELS = {"cpu": ("tiny",), "device": ("tiny", "qwen3-0.6b-shape")}


def _shard(array: np.ndarray, tp_group, axis: int) -> np.ndarray:
    return np.ascontiguousarray(np.split(array, tp_group.size, axis=axis)[tp_group.rank])


def _inputs(rng, rows: int, columns: int) -> np.ndarray:
    """Random rows with the awkward cases: a zero row, subnormals, a huge row, a NaN row."""
    x = rng.standard_normal((rows, columns)).astype(np.float32)
    if rows >= 4:
        x[0] = 0.0
        x[1] *= np.float32(1e-40)
        x[2] *= np.float32(1e30)
        x[3, -1] = np.nan  # in the last rank's shard only
    return x


def check_row_parallel_gemm(backend, tp_group, rng, quick: bool) -> Tally:
    tally = Tally()
    for rows, n, k in ((1, 64, 256), (7, 96, 512), (300, 128, 1024)) + (() if quick else ((2048, 256, 3072),)):
        x, w = _inputs(rng, rows, k), rng.standard_normal((n, k)).astype(np.float32)
        weight = parallel.encode_row_parallel_weight(backend, tp_group, backend.asarray(_shard(w, tp_group, 1)))
        y = parallel.row_parallel_gemm(backend, tp_group, backend.asarray(_shard(x, tp_group, 1)), weight)
        if tp_group.rank == 0:
            expected = gemm.gemm(backend, backend.asarray(x), gemm.encode_weight(backend, backend.asarray(w)))
            tally.add(backend.to_numpy(y), backend.to_numpy(expected))
    return tally


def check_vocab_embedding(backend, tp_group, rng, quick: bool) -> Tally:
    tally = Tally()
    vocab, hidden = 64 * tp_group.size, 96
    table = rng.standard_normal((vocab, hidden)).astype(np.float32)
    table[3] = -0.0  # signed zeros survive the bit-pattern sum
    ids = rng.integers(0, vocab, 257).astype(np.int32)
    ids[:2] = (3, vocab - 1)
    shard = _shard(table, tp_group, 0)
    rows = parallel.embed_tokens(backend, tp_group, backend.asarray(shard), tp_group.rank * shard.shape[0],
                                 backend.asarray(ids), ids)
    if tp_group.rank == 0:
        expected = embedding.gather(backend, backend.asarray(table), backend.asarray(ids), host_ids=ids)
        tally.add(backend.to_numpy(rows), backend.to_numpy(expected))
    return tally


def check_vocab_logprobs(backend, tp_group, rng, quick: bool) -> Tally:
    tally = Tally()
    for rows, hidden, vocab in ((5, 64, 128 * tp_group.size), (130, 128, 1000 * tp_group.size)):
        h = _inputs(rng, rows, hidden)
        w = rng.standard_normal((vocab, hidden)).astype(np.float32)
        targets = rng.integers(0, vocab, rows).astype(np.int32)
        shard = gemm.encode_weight(backend, backend.asarray(_shard(w, tp_group, 0)))
        for temperature in (1.0, 0.7):
            got = parallel.vocab_parallel_logprobs(backend, tp_group, backend.asarray(h), shard,
                                                   tp_group.rank * (vocab // tp_group.size), backend.asarray(targets),
                                                   temperature)
            if tp_group.rank == 0:
                whole = gemm.encode_weight(backend, backend.asarray(w))
                expected = logprob.lm_head_logprobs(backend, backend.asarray(h), whole, backend.asarray(targets),
                                                    temperature)
                tally.add(backend.to_numpy(got), backend.to_numpy(expected))
    return tally


def _loaded(spec: str, quick: bool):
    """(config, host weights, tokenizer) of the tiny model or the seeded Qwen3-0.6B-shaped one."""
    if spec == "tiny":
        from rlportable.model.tiny import tiny_model

        return tiny_model()
    from rlportable.model.synthetic import IdsOnlyTokenizer
    from rlportable.model.synthetic import qwen3_06b_config, random_weights

    config = qwen3_06b_config(2 if quick else None)
    return config, random_weights(config, 0), IdsOnlyTokenizer()


def _packed(rng, vocab: int, count: int, longest: int):
    lengths = rng.integers(2, longest + 1, count)
    tokens = rng.integers(0, vocab, int(lengths.sum())).astype(np.int32)
    return tokens, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def model_check(spec: str) -> Callable:
    def check(backend, tp_group, rng, quick: bool) -> Tally:
        from rlportable.model.forward import Model

        config, weights, _ = _loaded(spec, quick)
        tokens, cu = _packed(rng, config.vocab_size, 6 if quick else 24, 64 if quick else 400)
        sharded = Model(backend, config, weights, tp_group=tp_group)
        tally = Tally()
        for temperature in (1.0, 0.7):
            got = sharded.logprobs(tokens, cu, temperature)
            if tp_group.rank == 0:
                expected = Model(backend, config, weights).logprobs(tokens, cu, temperature)
                tally.add(np.concatenate(got), np.concatenate(expected))
        return tally

    return check


def engine_check(spec: str) -> Callable:
    def check(backend, tp_group, rng, quick: bool) -> Tally:
        from rlportable.engine.llm import LLM
        from rlportable.model.forward import Model
        from rlportable.train.trainer import Sample, completion_logprobs, pack

        config, weights, tokenizer = _loaded(spec, quick)
        requests = 8 if quick else 64
        prompts = [rng.integers(0, config.vocab_size, int(rng.integers(1, 60))).tolist() for _ in range(requests)]
        params = SamplingParams(n=2, temperature=1.0, max_tokens=8 if quick else 64, seed=int(rng.integers(1 << 62)),
                                ignore_eos=True)
        engine = dict(block_size=16, max_num_seqs=128, max_model_len=256,
                      sampler="device" if backend.kernel_vendor else "host")
        model = Model(backend, config, weights, tp_group=tp_group)
        sharded = LLM(device=backend, loaded=(model, tokenizer), **engine).generate(prompts, params)
        tally = Tally()
        if tp_group.rank:
            return tally
        single_model = Model(backend, config, weights)
        single = LLM(device=backend, loaded=(single_model, tokenizer), **engine).generate(prompts, params)
        samples = []
        for got, expected in zip(sharded, single):
            for a, b in zip(got.outputs, expected.outputs):
                tally.add(np.asarray(a.token_ids, np.int32), np.asarray(b.token_ids, np.int32))
                tally.add(np.asarray(a.logprobs, np.float32), np.asarray(b.logprobs, np.float32))
                samples.append(Sample(got.prompt_token_ids, a.token_ids, logp=np.asarray(a.logprobs, np.float32)))
        for batch in pack(samples, 16384):  # the single-device trainer recomputes what TP=N recorded
            _, logps = completion_logprobs(single_model, batch, 1.0)
            for sample, logp in zip(batch.samples, logps):
                tally.add(np.asarray(logp, np.float32), sample.logp)
        return tally

    return check


def checks(backend) -> list[tuple[str, Callable]]:
    models = MODELS["cpu" if backend.on_host else "device"]
    return ([("tp.row_parallel_gemm", check_row_parallel_gemm), ("tp.vocab_embedding", check_vocab_embedding),
             ("tp.vocab_logprobs", check_vocab_logprobs)]
            + [(f"tp.model.{spec}", model_check(spec)) for spec in models]
            + [(f"tp.engine.{spec}", engine_check(spec)) for spec in models])


def run(backend, tp_group, quick: bool = False, seed: int = 0, only: str | None = None,
        progress: Callable[[str], None] | None = None) -> list[CheckResult]:
    """Every TP check on this rank; rank 0's results carry the comparisons."""
    results = []
    for name, check in checks(backend):
        if not selected(name, only):
            continue
        if progress and tp_group.rank == 0:
            progress(name)
        rng = check_rng(seed, name)  # the same inputs on every rank
        tally = check(backend, tp_group, rng, quick)
        results.append(CheckResult(name, tally.compared, tally.mismatches,
                                   {"tp": tp_group.size, "group": tp_group.label}))
    return results
