"""The split-KV decode path of attention_paged (method "split"): its host logic, without a GPU.

The kernels themselves (backends/{cuda,hip}/attention.*: attention_split_scores, _values, _combine)
are checked bitwise against the reference by `rlportable conform --only attention` on a device
(rlportable/conform/attention.py: every paged check runs every method, plus attention.split_decode
and attention.split_nonfinite_rows); their sources compile in tests/test_kernel_sources.py. Here: the
split plan (launch shapes that depend on nothing a captured decode graph changes), method selection,
and the launches' arguments against the kernels' parameter lists in both sources.
"""

from __future__ import annotations

import numpy as np
import pytest
from recording_device import RecordingDevice, kernel_parameters

from rlportable.errors import InputError
from rlportable.ops import attention as op

SPLIT_KERNELS = ("attention_split_scores", "attention_split_values", "attention_split_combine")  # groups > 2
PAIR_SPLIT_KERNELS = ("attention_split_scores", "attention_split_values_h2", "attention_split_combine")
ONE_SPLIT_KERNELS = PAIR_SPLIT_KERNELS[:2]  # one split (groups of 2 here): the value kernel writes o, no combine
_SCALARS = {"long long": np.int64, "int": np.int32, "double": np.float64}


def same_array(a: np.ndarray, b: np.ndarray) -> bool:
    """a is b or a whole view of it (the op passes its output sliced by rows)."""
    return a.shape == b.shape and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]


def decode_call(backend, rows: int, hq: int, hkv: int, d: int, width: int, block_size: int = 16,
                positions=None, **options):
    """attention_paged of `rows` decode rows (one per sequence) over tables `width` blocks wide."""
    cache = op.KVCache.allocate(backend, (width + 1) * block_size, hkv, d, block_size)
    tables = np.tile(np.arange(width, dtype=np.int32), (rows, 1))
    q_pos = np.full(rows, width * block_size - 1, np.int32) if positions is None else np.asarray(positions, np.int32)
    q = np.zeros((rows, hq, d), np.float32)
    return op.attention_paged(backend, q, np.arange(rows, dtype=np.int32), q_pos, cache, tables, method="split",
                              **options)


def test_split_plan_covers_the_tables_and_fills_the_device():
    # the profiled decode step (256 sequences x 8 kv heads, 25 blocks of 16): one split, 2048 blocks
    assert op.split_plan(256, 8, 400) == (1, 512)
    # one sequence, a long context: enough splits for ~SPLIT_TARGET_BLOCKS blocks of whole tiles
    splits, keys = op.split_plan(1, 8, 4096)
    assert keys == op.SPLIT_MIN_KEYS and splits * 8 >= 256
    for rows, hkv, capacity in ((1, 1, 1), (3, 2, 129), (16, 8, 2048), (1, 8, 2**17), (512, 8, 2**17), (7, 3, 0)):
        splits, keys = op.split_plan(rows, hkv, capacity)
        assert 1 <= keys <= op.SPLIT_MAX_KEYS
        assert splits * keys >= max(capacity, 1) and (splits - 1) * keys < max(capacity, 1)
    assert op.split_plan(16, 8, 2048) == (8, 256)  # 128 (row, kv head) pairs x 8 splits = 1024 blocks
    assert op.split_plan(512, 8, 2**17) == (8, op.SPLIT_MAX_KEYS)  # at most 2^14 keys per split
    assert op.split_plan(2, 2, 1000, keys_per_split=64) == (16, 64)
    assert op.split_plan(2, 2, 1000, keys_per_split=1) == (1000, 1)
    for bad in (0, op.SPLIT_MAX_KEYS + 1, 2.5, "64"):
        with pytest.raises(InputError, match="keys_per_split"):
            op.split_plan(2, 2, 1000, keys_per_split=bad)


def test_methods_pick_split_for_decode():
    cpu = RecordingDevice(None)
    hip = RecordingDevice("hip")
    cuda = RecordingDevice("cuda")
    assert op.available_methods(cpu, 128) == ("portable",)
    assert op.available_methods(hip, 128) == ("portable", "split")
    assert op.available_methods(hip, 512) == ("portable", "split")
    assert op.resolve_method(hip, 256, 256, 128, "auto") == "split"  # decode
    assert op.resolve_method(hip, 4096, 2, 128, "auto") == "portable"  # prefill (no mma on HIP)
    assert op.resolve_method(cuda, 256, 256, 512, "auto") == "split"
    assert op.resolve_method(cuda, 4096, 2, 512, "auto") == "portable"  # prefill, head_dim too wide for mma
    assert op.resolve_method(hip, 1, 1, 64, "split") == "split"
    with pytest.raises(InputError, match="split kernels exist for CUDA and HIP"):
        op.resolve_method(cpu, 1, 1, 64, "split")


@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_split_launches_match_the_kernel_parameters(vendor):
    backend = RecordingDevice(vendor)
    out = decode_call(backend, rows=5, hq=6, hkv=2, d=20, width=9)
    assert out.shape == (5, 6, 20) and out.dtype == np.float32
    parameters = kernel_parameters(vendor, "attention")
    assert [launch.kernel for launch in backend.launches] == list(SPLIT_KERNELS)
    for _, kernel, grid, block, args, _ in backend.launches:
        assert block == (op.SPLIT_THREADS,)
        types = parameters[kernel]
        assert len(args) == len(types), kernel
        for position, (kind, arg) in enumerate(zip(types, args)):
            if "*" in kind:
                assert isinstance(arg, np.ndarray) and arg.flags.c_contiguous, (kernel, position, kind)
            else:
                assert type(arg) is _SCALARS[kind], (kernel, position, kind, type(arg))
    # the scratch arrays the kernels index: scores [tq * hkv, splits * chunk, group], part_num [tq * hq, splits, d]
    splits, chunk = op.split_plan(5, 2, 9 * 16)
    scores, key_rows, split_keys, split_info, query_bad = backend.launches[0].args[-5:]
    assert scores.size == 5 * 2 * splits * chunk * 3 and key_rows.size == 5 * 2 * splits * chunk
    assert key_rows.dtype == np.int64
    assert split_keys.dtype == np.uint32 and split_keys.size == 5 * 6 * splits and split_info.size == 5 * 2 * splits
    assert splits > 1
    part_total, part_num, values_out = backend.launches[1].args[-3:]
    assert part_total.dtype == np.int64 and part_num.size == 5 * 6 * splits * 20 and query_bad.size == 5 * 6
    assert same_array(values_out, out) and same_array(backend.launches[2].args[-1], out)
    assert backend.launches[0].grid == (5 * 2 * splits,) and backend.launches[2].grid == (5 * 6,)


@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_one_split_writes_o_from_the_value_kernel(vendor):
    backend = RecordingDevice(vendor)
    out = decode_call(backend, rows=128, hq=16, hkv=8, d=128, width=25)
    assert op.split_plan(128, 8, 25 * 16)[0] == 1
    assert [launch.kernel for launch in backend.launches] == list(ONE_SPLIT_KERNELS)
    parameters = kernel_parameters(vendor, "attention")["attention_split_values_h2"]
    args = backend.launches[1].args
    assert len(args) == len(parameters) and same_array(args[-1], out)


@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_the_value_kernels_take_the_same_parameters(vendor):
    parameters = kernel_parameters(vendor, "attention")
    assert parameters["attention_split_values_h2"] == parameters["attention_split_values"]


@pytest.mark.parametrize("group, kernel", [(1, "attention_split_values_h2"), (2, "attention_split_values_h2"),
                                           (3, "attention_split_values"), (8, "attention_split_values")])
def test_groups_of_two_take_the_pair_value_kernel(group, kernel):
    assert op.split_values_kernel(group) == kernel
    backend = RecordingDevice("cuda")
    decode_call(backend, rows=3, hq=2 * group, hkv=2, d=64, width=4)
    assert backend.launches[1].kernel == kernel


def test_split_launch_shapes_do_not_depend_on_the_lengths():
    """A decode graph captures one launch per bucket: the same rows and table width must give the same
    grids and scalar arguments whatever the positions (they live in device buffers)."""
    shapes = []
    for positions in ([0, 0, 0], [5, 300, 17], [399, 399, 399]):
        backend = RecordingDevice("cuda")
        decode_call(backend, rows=3, hq=16, hkv=8, d=128, width=25, positions=positions)
        shapes.append([(kernel, grid, block, tuple(a for a in args if not isinstance(a, np.ndarray)))
                       for _, kernel, grid, block, args, _ in backend.launches])
    assert shapes[0] == shapes[1] == shapes[2]


def test_split_scratch_is_cut_into_row_slices(monkeypatch):
    """More rows than SPLIT_SCRATCH_BYTES of scores hold run as several launches over row slices."""
    splits, chunk = op.split_plan(10, 2, 64 * 16)
    per_row = (4 * 4 + 2 * 8) * splits * chunk  # scores (float32, hq = 4) and key rows (int64, hkv = 2)
    monkeypatch.setattr(op, "SPLIT_SCRATCH_BYTES", 3 * per_row)
    backend = RecordingDevice("hip")
    out = decode_call(backend, rows=10, hq=4, hkv=2, d=64, width=64)
    kernels = [launch.kernel for launch in backend.launches]
    assert kernels == list(PAIR_SPLIT_KERNELS) * 4  # rows 0-2, 3-5, 6-8, 9
    firsts = [args[0] for _, kernel, _, _, args, _ in backend.launches if kernel == "attention_split_scores"]
    assert [q.shape[0] for q in firsts] == [3, 3, 3, 1]
    outs = [args[-1] for _, kernel, _, _, args, _ in backend.launches if kernel == "attention_split_combine"]
    assert all(np.shares_memory(o, out) for o in outs)


def test_leading_single_rows_counts_the_decodes_before_the_prefill_chunks():
    assert op.leading_single_rows(np.array([], np.int32)) == 0
    assert op.leading_single_rows(np.array([3, 1, 2], np.int32)) == 3  # a decode step
    assert op.leading_single_rows(np.array([0, 1, 2, 2, 2, 3, 3], np.int32)) == 2
    assert op.leading_single_rows(np.array([4, 4, 5], np.int32)) == 0  # a prefill chunk first
    # a sequence whose rows are not adjacent is not a decode
    assert op.leading_single_rows(np.array([7, 8, 7], np.int32)) == 0


def mixed_step_call(backend, decodes: int, chunk: int, block_size: int = 16):
    """attention_step over `decodes` decode rows (sequences 0..decodes-1) then a `chunk`-row prefill chunk
    of sequence `decodes`, hq 4, hkv 2, d 64 (the mma kernel's width)."""
    width = -(-max(chunk, 1) // block_size) + 1
    cache = op.KVCache.allocate(backend, (width + 1) * block_size, 2, 64, block_size)
    tables = np.tile(np.arange(width, dtype=np.int32), (decodes + 1, 1))
    q_seq = np.concatenate([np.arange(decodes), np.full(chunk, decodes)]).astype(np.int32)
    q_pos = np.concatenate([np.full(decodes, 5), np.arange(chunk)]).astype(np.int32)
    q = np.zeros((decodes + chunk, 4, 64), np.float32)
    return op.attention_step(backend, q, q_seq, q_pos, cache, tables, op.step_parts(q_seq))


def test_a_mixed_step_runs_its_decodes_by_the_split_kernels_and_its_chunk_by_mma():
    backend = RecordingDevice("cuda")
    out = mixed_step_call(backend, decodes=3, chunk=100)
    kernels = [launch.kernel for launch in backend.launches]
    assert kernels == list(ONE_SPLIT_KERNELS) + ["attention_paged_mma_d128"]
    assert backend.launches[0].args[3] == 3  # tq of the split launch: the decode rows
    mma = backend.launches[-1]
    assert mma.args[3] == 100 and mma.grid == (2, 4)
    # each call writes its own rows of the one output
    combine_out, mma_out = backend.launches[1].args[-1], mma.args[-2]  # the mma kernel's last: row_stats (null)
    assert mma.args[-1] == op.NULL_POINTER
    assert combine_out.shape == (3, 4, 64) and mma_out.shape == (100, 4, 64)
    assert np.shares_memory(combine_out, out) and np.shares_memory(mma_out, out)
    assert combine_out.__array_interface__["data"][0] == out.__array_interface__["data"][0]
    assert mma_out.__array_interface__["data"][0] == out[3:].__array_interface__["data"][0]


@pytest.mark.parametrize("decodes, chunk, kernels", [
    (4, 0, list(ONE_SPLIT_KERNELS)),  # a decode step: one call
    (0, 100, ["attention_paged_mma_d128"]),  # prefill only: one call
])
def test_a_step_of_one_kind_is_one_call(decodes, chunk, kernels):
    backend = RecordingDevice("cuda")
    mixed_step_call(backend, decodes, chunk)
    assert [launch.kernel for launch in backend.launches] == kernels


def test_attention_out_must_fit_the_rows():
    backend = RecordingDevice("cuda")
    cache = op.KVCache.allocate(backend, 32, 1, 16, 16)
    args = (np.zeros((2, 2, 16), np.float32), np.zeros(2, np.int32), np.zeros(2, np.int32), cache,
            np.zeros((1, 2), np.int32))
    with pytest.raises(InputError, match=r"out must be a C-contiguous float32 array of shape \[2, 2, 16\]"):
        op.attention_paged(backend, *args, out=np.zeros((3, 2, 16), np.float32))
    with pytest.raises(InputError, match="out= is for device backends"):
        op.attention_paged(RecordingDevice(None), *args, out=np.zeros((2, 2, 16), np.float32))


def test_keys_per_split_is_checked_on_every_backend():
    cpu = RecordingDevice(None)
    with pytest.raises(InputError, match="keys_per_split"):
        op.attention_paged(cpu, np.zeros((1, 2, 16), np.float32), np.zeros(1, np.int32), np.zeros(1, np.int32),
                           op.KVCache.allocate(cpu, 16, 1, 16, 16), np.zeros((1, 1), np.int32), keys_per_split=0)


@pytest.mark.parametrize("name", ["attention.split_decode", "attention.split_nonfinite_rows"])
def test_split_conform_checks_run_on_cpu(name):
    """The conformance checks of the split path (on cpu: the reference against itself) run clean."""
    from rlportable.conform.attention import CHECKS
    from rlportable.runtime import get_backend

    check = dict(CHECKS)[name]
    tally = check(get_backend("cpu"), np.random.default_rng(0), True)
    assert tally.compared > 0 and tally.mismatches == 0


@pytest.mark.parametrize("dp", [64, 128, 192, 256, 512])
def test_value_kernel_keeps_one_numerator_part_per_key_lane(dp):
    """attention_split_values adds its key lanes' numerators without atomics: [lanes, heads, dp] int64
    parts in dynamic shared memory, lanes = threads / (dp / 4 columns per thread); at most 16 KB."""
    lanes = op.SPLIT_THREADS // (dp // op.SPLIT_COLUMNS)
    assert op.split_values_shared_bytes(8, dp) == lanes * op.SPLIT_VALUE_HEADS * 8 * dp <= 16384
    assert op.split_values_shared_bytes(2, dp) == lanes * 2 * 8 * dp
