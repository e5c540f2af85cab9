"""Where the split-KV decode attention's time goes: its kernels under other tunings, timed alone.

    PYTHONPATH=$PWD python3 scripts/probe_attention.py [path.json]

The Qwen3-0.6B layer shape (16 q heads, 8 KV heads, head_dim 128, KV blocks of 16): 256 query rows,
one per sequence, each attending to KV_LENGTH keys of a cache of random encoded rows
(RLP_PROBE_SEQUENCES=<rows>, RLP_PROBE_HQ=16,32, RLP_PROBE_HKV=<kv heads> for other shapes;
RLP_PROBE_TABLES=ordered puts each sequence's blocks in a row). Variants are
textual edits of backends/cuda/attention.cu (keys in flight, the value kernel's blocks per
multiprocessor) compiled with the runtime's options; each runs ops/attention.attention_paged
(method "split": scores, values, combine) and is timed by CUDA events over repeated calls. Every
variant's output is compared bitwise with the unedited kernels' (the tunings must not move a bit;
conform checks those against the reference). One JSON line per measurement.
RLP_PROBE_VARIANTS=<name>,<name>... runs only those variants ("stamps:<name>": that variant with the stamps); RLP_PROBE_GRID=<blocks> caps the split kernels'
grid (ops/attention.GRID_LIMIT: the blocks then take several items each, grid-stride); RLP_PROBE_KV_LENGTHS=16,128,... the keys per
query row (default 384,1024); RLP_PROBE_EXPONENTS=flat gives
every cache row exponent 0 (scores of a model's spread; default "spread", see EXPONENTS). With RLP_PROBE_BASELINE=<file>, that source (an earlier attention.cu with the same kernel signatures)
runs first as variant "baseline", with enough dynamic shared memory for the earlier value kernel.
"""
import os

import cupy as cp
import numpy as np

from rlportable.ops import attention
from rlportable.runtime import get_backend
from rlportable.resources import _inline_includes, kernel_source_path

from kernel_variants import edit, emit, load, mean_us, write  # scripts/kernel_variants.py

SEQUENCES = int(os.environ.get("RLP_PROBE_SEQUENCES", "256"))
HQS = tuple(int(n) for n in os.environ.get("RLP_PROBE_HQ", "16").split(","))  # q heads (over 8 KV heads)
HKV = int(os.environ.get("RLP_PROBE_HKV", "8"))  # kv heads: 1 makes each block's rows contiguous in the cache
HEAD_DIM, BLOCK = 128, 16
TABLES = os.environ.get("RLP_PROBE_TABLES", "scattered")  # "ordered": each sequence's blocks in a row
KV_LENGTHS = tuple(int(n) for n in os.environ.get("RLP_PROBE_KV_LENGTHS", "384,1024").split(","))
MAX_BLOCKS = max(2048, *KV_LENGTHS) // BLOCK  # the graph tables' width: a 2048-token max_model_len (or the longest)
KEYS_PER_SPLIT = (512, 256, 128)
# RLP_PROBE_EXPONENTS: "spread" (K/V row exponents in [-4, 4): scores over a range so wide that most
# weights underflow, the exp's shortcut; the probes before 2026-11-30 23:10 ran so) or "flat" (all 0:
# q.k / sqrt(D) within a few units, every weight through the whole exp, as in a model)
EXPONENTS = os.environ.get("RLP_PROBE_EXPONENTS", "spread")  # the kernels as built, with the keys cut into more splits than split_plan's
SCORE_PIECES = "#define RLP_ATTS_SCORE_PIECES 4 "
VALUE_BOUNDS = "RLP_LAUNCH_BOUNDS(RLP_ATTS_THREADS, 6) attention_split_values"
SCORE_BOUNDS = "RLP_LAUNCH_BOUNDS(RLP_ATTS_THREADS, 8) attention_split_scores"
VALUE_H2_BOUNDS = "RLP_LAUNCH_BOUNDS(RLP_ATTS_THREADS, 8) attention_split_values_h2("


def _pieces(count: int):
    return lambda s: edit(s, SCORE_PIECES, f"#define RLP_ATTS_SCORE_PIECES {count} ")


def _bounds(anchor: str, blocks: int):
    built = anchor[anchor.index("(RLP_ATTS_THREADS"):anchor.index(")") + 1]
    return lambda s: edit(s, anchor, anchor.replace(built, f"(RLP_ATTS_THREADS, {blocks})"))


WEIGHT_ROW = "const long long info = first ? first_info : key_rows[rowg * keys + j];"
WEIGHT_SCORE = "if (hi < nb) s[u][hi] = first ? first_s[hi] : scores[(rowg * keys + j) * group + h0 + hi];"
V_LOW = "low[u] = *reinterpret_cast<const int*>(row);"
V_HIGH = "high[u] = *reinterpret_cast<const int*>(row + dp);"


def _define(name: str, value: int):
    return lambda s: edit(s, f"#define {name} ", f"#define {name} {value} //")


def _threads(threads: int, score_blocks: int, value_blocks: int):
    """Blocks of `threads` (the op's SPLIT_THREADS follows: THREAD_COUNTS), more of them per multiprocessor."""
    def change(s):
        s = edit(s, "#define RLP_ATTS_THREADS 128 ", f"#define RLP_ATTS_THREADS {threads} ")
        return _bounds(VALUE_H2_BOUNDS, value_blocks)(_bounds(SCORE_BOUNDS, score_blocks)(s))
    return change


#: variant -> the split kernels' block size (ops/attention.SPLIT_THREADS) it is built for
THREAD_COUNTS = {"threads_64": 64, "threads_64_values_10": 64, "threads_32": 32}


def _no_weight_loads(s):  # timing only (other bits): the weight phase without its global loads
    s = edit(s, WEIGHT_ROW, "const long long info = (((j + 16 * seq) * hkv + g) << 16) | RLP_ATT_EV_OFFSET;")
    return edit(s, WEIGHT_SCORE, "if (hi < nb) s[u][hi] = 0.0f;")


def _fast_exp(s):  # timing only (other bits): the weights' exp by the hardware's approximation
    return edit(s, "const double p = (double)rlp_exp_f32(s[u][hi] - head_m[hi]);",
                "const double p = (double)__expf(s[u][hi] - head_m[hi]);")


def _normal_values(s):  # timing only (other bits): the values as normal float64 (2^52 + x), not subnormal
    for c, word in (("0", "c01 & 0xffffu"), ("1", "c01 >> 16"), ("2", "c23 & 0xffffu"), ("3", "c23 >> 16")):
        s = edit(s, f"value[{c}] = __hiloint2double(0, (int)({word}));",
                 f"value[{c}] = __hiloint2double(0x43300000, (int)({word}));")
    return s


def _zero_weights(s):  # timing only (other bits): every weight stored as 0 (the products' operands zero)
    return edit(s, "weights[hi * RLP_ATTS_TILE + k] = w;", "weights[hi * RLP_ATTS_TILE + k] = w * 0.0;")


def _no_value_products(s):  # timing only (other bits): the value phase without its float64 products
    return edit(s, "for (int c = 0; c < RLP_ATTS_COLUMNS; ++c) sums[hi][c] = fma(w, value[c], sums[hi][c]);",
                "for (int c = 0; c < RLP_ATTS_COLUMNS; ++c) sums[hi][c] = __longlong_as_double(__double_as_longlong(sums[hi][c]) ^ __double_as_longlong(w) ^ __double_as_longlong(value[c]));")


def _no_v_loads(s):  # timing only (other bits): the value phase without its V loads
    return edit(edit(s, V_LOW, "low[u] = (int)key_offsets[k0 + u * lanes];"), V_HIGH, "high[u] = column;")


SCORE_SLOT = "j < end ? rlp_att_slot(block_tables, max_blocks, block_size, num_slots, seq, (int)j) : -1;"
SCORE_Q_MAX = "local = rlp_max_u32(local, rlp_magnitude_bits(q[(qrow0 + hi) * d + i]));"
SCORE_Q_DIGITS = "? rlp_quantize(q[(qrow0 + hi) * d + i], RLP_ATT_Q_BITS, eq) : 0;"


SCORE_ROW = "const long long row = slot >= 0 ? slot * hkv + g : 0;"


def _head_major_rows(s):  # timing only (other rows): a block's rows as a head-major cache page would place them
    return edit(s, SCORE_ROW, "const long long row = slot >= 0 ? ((slot / block_size) * hkv + g) * block_size + slot % block_size : 0;")


def _dot4_loop(s):  # the same bits: the byte products as the portable loop (nvcc's byte-by-byte operands)
    return edit(s, "#elif defined(RLP_HIP_ON_CUDA)\n    return __dp4a(a, b, c);", "#elif 0\n    return __dp4a(a, b, c);")


def _scores_no_table(s):  # timing only (other bits): slots by arithmetic (each sequence's rows in a row)
    return edit(s, SCORE_SLOT, "j < end ? (long long)seq * (num_slots / num_seqs) + j : -1;")


def _scores_no_q_loads(s):  # timing only (other bits): the q phase without its q loads
    return edit(edit(s, SCORE_Q_MAX, "local = 0x3f800000u;"), SCORE_Q_DIGITS, "? (long long)(i * 977 % 8191 - 4095) : 0;")


def _empty(s):  # timing only (other bits): both passes return at once (the launch and the blocks' start and end)
    return edit(s, "const long long items = tq * hkv * splits;\n", "const long long items = tq * hkv * splits;\n    if (items > 0) return;\n")


STAMPS_HEAD = """
__device__ unsigned long long rlp_probe_stamps[2][4096][5];  // [pass][block][phase]: %globaltimer, ns
__device__ __forceinline__ unsigned long long rlp_probe_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#define RLP_STAMP(PASS, PHASE) \\
    if (threadIdx.x == 0 && blockIdx.x < 4096) rlp_probe_stamps[PASS][blockIdx.x][PHASE] = rlp_probe_now();
"""
#: (pass, phase, anchor, before): where _stamps reads the clock; phases of the score pass: item start, q digits
#: ready, keys done, item end; of the value pass: item start, E and flags read, weights formed, V added, item end
STAMPS = [
    (0, 0, "        const long long rowg = item / splits;  // token * hkv + g", True),
    (0, 1, "            int eq[RLP_ATTS_SCORE_HEADS];  // RLP_NONFINITE_EXPONENT", True),
    (0, 2, "            rlp_block_max_u32(&max_ev, local_ev);\n            rlp_block_or_u32(&flags, local_flags);\n            __syncthreads();\n            if (threadIdx.x < nb) split_keys", True),
    (0, 3, "        if (threadIdx.x == 0) split_info[rowg * splits + split] = (flags << 16) | max_ev;\n        __syncthreads();\n", False),
    (1, 0, "        const long long first_qrow = token * hq + (long long)g * group;", True),
    (1, 1, "        const bool row_ok = !bad_row && flags == 0u;  // block-uniform\n", False),
    (1, 2, "                const int span = (int)rlp_atts_min_ll(end - base, (long long)RLP_ATTS_TILE);", True),
    (1, 3, "                __syncthreads();  // the next tile overwrites the weights and offsets\n", False),
    (1, 4, "            __syncthreads();  // the next round resets the sums\n", False),
]


def _stamps(s):  # the same bits: each block's phases by %globaltimer (thread 0; its last item's, if several)
    s = STAMPS_HEAD + s
    for pass_, phase, anchor, before in STAMPS:
        stamp = f"RLP_STAMP({pass_}, {phase})\n"
        s = edit(s, anchor, stamp + anchor if before else anchor + stamp)
    return s


def stamp_phases(module) -> dict:
    """Median microseconds of each phase over each wave's blocks (wave: blocks starting within 1 us of the
    earliest, or later), from the stamps the _stamps variant left."""
    address = module.get_global_var("rlp_probe_stamps")  # a device address (int)
    pointer = cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(address, 2 * 4096 * 5 * 8, module), 0)
    stamps = cp.ndarray((2, 4096, 5), np.uint64, pointer).get().astype(np.int64)
    out = {}
    for pass_, (name, phases) in enumerate((("scores", 4), ("values", 5))):
        t = stamps[pass_, :, :phases]
        t = t[t[:, 0] > 0]
        start = t[:, 0] - t[:, 0].min()
        for wave, rows in (("first", start < 1000), ("later", start >= 1000)):
            if rows.any():
                w = t[rows]
                out[f"{name}_{wave}_wave"] = {
                    "blocks": int(rows.sum()), "start_us": round(float(np.median(start[rows])) / 1e3, 2),
                    "phases_us": [round(float(np.median(w[:, k + 1] - w[:, k])) / 1e3, 2) for k in range(phases - 1)]}
        out[f"{name}_span_us"] = round(float(t[:, phases - 1].max() - t[:, 0].min()) / 1e3, 2)
    return out


def _no_prefetch(s):  # the value pass's first loads after the item's, not with them (fewer registers)
    return edit(s, "constexpr bool PREFETCH = HEADS <= 2;", "constexpr bool PREFETCH = false;")


VARIANTS = {
    "as_built": lambda s: s,
    "empty (timing only)": _empty,
    "stamps": _stamps,
    "values_no_weight_loads (timing only)": _no_weight_loads,
    "values_no_v_loads (timing only)": _no_v_loads,
    "values_fast_exp (timing only)": _fast_exp,
    "values_normal_doubles (timing only)": _normal_values,
    "values_zero_weights (timing only)": _zero_weights,
    "values_fast_exp_zero_weights (timing only)": lambda s: _zero_weights(_fast_exp(s)),
    "values_no_products (timing only)": _no_value_products,
    "score_7_blocks": _bounds(SCORE_BOUNDS, 7),
    "scores_no_table (timing only)": _scores_no_table,
    "head_major_rows (timing only)": _head_major_rows,
    "scores_dot4_loop": _dot4_loop,
    "scores_no_q_loads (timing only)": _scores_no_q_loads,
    "scores_neither (timing only)": lambda s: _scores_no_q_loads(_scores_no_table(s)),
    "threads_64": _threads(64, 16, 12),
    "threads_64_values_10": _threads(64, 16, 10),
    "threads_32": _threads(32, 32, 24),
    "value_keys_8": _define("RLP_ATTS_VALUE_KEYS", 8),
    "value_heads_2": _define("RLP_ATTS_VALUE_HEADS", 2),
    "value_keys_16": _define("RLP_ATTS_VALUE_KEYS", 16),
    "weight_keys_2": _define("RLP_ATTS_WEIGHT_KEYS", 2),
    "value_h2_7_blocks": _bounds(VALUE_H2_BOUNDS, 7),
    "value_h2_8_blocks": _bounds(VALUE_H2_BOUNDS, 8),
    "value_h2_5_blocks": _bounds(VALUE_H2_BOUNDS, 5),
    "score_heads_2": _define("RLP_ATTS_SCORE_HEADS", 2),
    "score_heads_2_6_blocks": lambda s: _bounds(SCORE_BOUNDS, 6)(_define("RLP_ATTS_SCORE_HEADS", 2)(s)),
    "score_heads_2_pieces_8": lambda s: _pieces(8)(_define("RLP_ATTS_SCORE_HEADS", 2)(s)),
    "value_heads_2_keys_8": lambda s: _define("RLP_ATTS_VALUE_KEYS", 8)(_define("RLP_ATTS_VALUE_HEADS", 2)(s)),
    "value_keys_2": _define("RLP_ATTS_VALUE_KEYS", 2),
    "weight_keys_4": _define("RLP_ATTS_WEIGHT_KEYS", 4),
    "tile_256": _define("RLP_ATTS_TILE", 256),
    "score_pieces_2": _pieces(2),
    "score_4_blocks": _bounds(SCORE_BOUNDS, 4),
    "score_6_blocks": _bounds(SCORE_BOUNDS, 6),
    "value_h2_8_blocks_keys_4": lambda s: _bounds(VALUE_H2_BOUNDS, 8)(_define("RLP_ATTS_VALUE_KEYS", 4)(s)),
    "value_h2_7_blocks_keys_4": lambda s: _bounds(VALUE_H2_BOUNDS, 7)(_define("RLP_ATTS_VALUE_KEYS", 4)(s)),
    "value_h2_8_blocks_keys_4_no_prefetch": lambda s: _no_prefetch(
        _bounds(VALUE_H2_BOUNDS, 8)(_define("RLP_ATTS_VALUE_KEYS", 4)(s))),
    "value_4_blocks": _bounds(VALUE_BOUNDS, 4),
    "value_8_blocks": _bounds(VALUE_BOUNDS, 8),
}


def random_cache(backend, kv_length: int):
    """A cache holding SEQUENCES sequences of kv_length random encoded rows, and their block tables
    (each sequence's blocks scattered over the cache, as after many steps of continuous batching)."""
    blocks_per_seq = -(-kv_length // BLOCK)
    cache = attention.KVCache.allocate(backend, SEQUENCES * blocks_per_seq * BLOCK, HKV, HEAD_DIM, BLOCK)
    for digits in (cache.k_digits, cache.v_digits):
        digits[...] = cp.random.randint(-128, 128, digits.shape, dtype=np.int32).astype(np.int8)
    if EXPONENTS == "spread":  # else all 0: every score within a few units of the maximum (a model's spread)
        for exponents in (cache.k_exponents, cache.v_exponents):
            exponents[...] = cp.random.randint(-4, 4, exponents.shape, dtype=np.int32)
    rng = np.random.default_rng(0)
    tables = np.zeros((SEQUENCES, MAX_BLOCKS), np.int32)
    order = np.arange(SEQUENCES * blocks_per_seq) if TABLES == "ordered" else rng.permutation(SEQUENCES * blocks_per_seq)
    tables[:, :blocks_per_seq] = order.reshape(SEQUENCES, blocks_per_seq)
    return cache, cp.asarray(tables)


def kernel_times(backend, run, reps: int = 5) -> dict:
    """Microseconds per call of each kernel the op launches (events around each launch; the calls
    run back to back, so each pair times its kernel alone)."""
    launch, events = backend.launch, []

    def timed_launch(family, kernel, *args, **kwargs):
        before, after = cp.cuda.Event(), cp.cuda.Event()
        before.record()
        launch(family, kernel, *args, **kwargs)
        after.record()
        events.append((kernel, before, after))

    backend.launch = timed_launch
    try:
        for _ in range(reps):
            run()
    finally:
        backend.launch = launch
    events[-1][2].synchronize()
    totals = {}
    for kernel, before, after in events:
        totals[kernel] = totals.get(kernel, 0.0) + cp.cuda.get_elapsed_time(before, after) * 1e3 / reps
    return {kernel: round(us, 1) for kernel, us in totals.items()}


def variants(source: str) -> dict:
    """Variant name -> (source, dynamic shared memory of the value kernel or None: the op's own, keys per
    split or None: split_plan's choice)."""
    chosen = os.environ.get("RLP_PROBE_VARIANTS")  # a comma-separated subset of the names
    names = chosen.split(",") if chosen else list(VARIANTS) + [f"keys_per_split_{keys}" for keys in KEYS_PER_SPLIT]
    made = {}
    for name in names:  # only the chosen variants' edits are made: an anchor one of them lost stops only it
        if name.startswith("keys_per_split_"):
            made[name] = (source, None, int(name.rsplit("_", 1)[1]))
        elif name.startswith("stamps:"):  # stamps on another variant's source
            made[name] = (_stamps(VARIANTS[name[len("stamps:"):]](source)), None, None)
        elif name != "baseline":
            made[name] = (VARIANTS[name](source), None, None)
    baseline = os.environ.get("RLP_PROBE_BASELINE")
    if baseline:
        text = _inline_includes(open(baseline).read(), (kernel_source_path("cuda", "attention").parent,), seen=set())
        made = {"baseline": (text, 16384, None), **made}
    return made


def main():
    backend = get_backend("cuda")
    attention.GRID_LIMIT = int(os.environ.get("RLP_PROBE_GRID", attention.GRID_LIMIT))
    source, options = backend.source("attention"), backend.compile_options()
    results, reference = [], {}
    shared_bytes = attention.split_values_shared_bytes
    inputs = {}
    for kv_length in KV_LENGTHS:
        cache, tables = random_cache(backend, kv_length)
        for hq in HQS:
            q = cp.asarray(np.random.default_rng(1).standard_normal((SEQUENCES, hq, HEAD_DIM), np.float32))
            inputs[kv_length, hq] = (q, cp.arange(SEQUENCES, dtype=np.int32), cp.full(SEQUENCES, kv_length - 1, np.int32),
                                     cache, tables)
    for variant, (text, shared, keys) in variants(source).items():
        module = load(text, "attention", options)  # once per variant, for every shape
        attention.split_values_shared_bytes = (lambda group, dp: shared) if shared else shared_bytes
        attention.SPLIT_THREADS = THREAD_COUNTS.get(variant.removeprefix("stamps:"), 128)
        backend._modules["attention"], backend._functions = module, {}
        for (kv_length, hq), (q, q_seq, q_pos, cache, tables) in inputs.items():
            run = lambda: attention.attention_paged(backend, q, q_seq, q_pos, cache, tables, method="split",
                                                    keys_per_split=keys)
            out = run()
            bits = cp.asnumpy(out).view(np.uint32)
            same = bool(np.array_equal(reference.setdefault((kv_length, hq), bits), bits))
            us = mean_us(run)
            kv_bytes = SEQUENCES * kv_length * HKV * 2 * (2 * cache.head_dim_padded + 4)
            row = dict(variant=variant, sequences=SEQUENCES, hq=hq, hkv=HKV, tables=TABLES, kv_length=kv_length, us=round(us, 1),
                       same_bits=same, kv_gb_per_s=round(kv_bytes / (us * 1e-6) / 1e9, 1),
                       kernels_us=kernel_times(backend, run))
            if variant.startswith("stamps"):
                run()
                cp.cuda.Device().synchronize()
                row["phases"] = stamp_phases(module)
            emit(results, row)
    write(results)


if __name__ == "__main__":
    main()
