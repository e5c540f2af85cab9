"""The integer MFMA builtins on HIP-CPU (backends/hip/cpu_prelude.h) against NumPy's integer product.

A tiny HIP kernel per instruction loads each lane's A and B registers and its C registers from memory,
runs the builtin over the whole 64-lane wavefront and writes D back. The test packs the matrices into
those per-lane registers with the layout AMD documents (written out below, independently of the
prelude's C++), so D = A @ B + C must come back bit for bit; deliberately wrong maps must not. The
same kernel text is compiled for gfx942 (and gfx90a) with clang-19 where the offline AMD toolchain is
installed, which checks the builtins' names and argument types against the real compiler.

The layout (AMD's matrix instruction calculator, checked against composable_kernel and IREE): M = N
(16 or 32), KL int8 of A and of B a lane (8 on gfx942, 4 on gfx90a), G = 64 / M, K = G * KL:
  A[i][k]: lane M * (k // KL) + i, byte k % KL;  B[k][j]: lane M * (k // KL) + j, byte k % KL;
  D[i][j] (and C): lane l with j = l % M, register r with i = 4 G (r // 4) + 4 (l // M) + r % 4.
A machine without HIP-CPU (RLPORTABLE_HIP_CPU unset) skips these, except in CI.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from conftest import hip_cpu_backend, in_ci
WAVE = 64
FAMILY = "test_mfma"


@dataclass(frozen=True)
class Instruction:
    builtin: str
    kernel: str
    m: int  # M = N
    kl: int  # int8 of A (and of B) a lane
    arch: str  # the AMD target that has it

    @property
    def groups(self) -> int:
        return WAVE // self.m

    @property
    def k(self) -> int:
        return self.groups * self.kl

    @property
    def registers(self) -> int:
        return self.m * self.m // WAVE

    @property
    def operand(self) -> type:
        return np.int64 if self.kl == 8 else np.int32


INSTRUCTIONS = [
    Instruction("__builtin_amdgcn_mfma_i32_16x16x32_i8", "mfma_16x16x32", 16, 8, "gfx942"),
    Instruction("__builtin_amdgcn_mfma_i32_32x32x16_i8", "mfma_32x32x16", 32, 8, "gfx942"),
    Instruction("__builtin_amdgcn_mfma_i32_16x16x16i8", "mfma_16x16x16", 16, 4, "gfx90a"),
    Instruction("__builtin_amdgcn_mfma_i32_32x32x8i8", "mfma_32x32x8", 32, 4, "gfx90a"),
]
IDS = [instruction.kernel for instruction in INSTRUCTIONS]

# One kernel per instruction: wave w of the grid multiplies its own matrices, `steps` MFMAs in a row into
# one accumulator (D = sum_s A_s B_s + C), operands at a[(s * waves + w) * 64 + lane]. Each target gets
# the builtins it has (clang defines __gfx942__ / __gfx90a__ for the device; HIP-CPU neither).
KERNELS = r"""
#include <hip/hip_runtime.h>
typedef int rlp_test_i32x4 __attribute__((vector_size(16)));
typedef int rlp_test_i32x16 __attribute__((vector_size(64)));
#define RLP_TEST_MFMA(name, builtin, operand, accumulator, registers)                                 \
    extern "C" __global__ void name(const operand* a, const operand* b, const int* c, int* d, int steps) { \
        const int lane = threadIdx.x % 64;                                                          \
        const int wave = blockIdx.x * (blockDim.x / 64) + threadIdx.x / 64;                         \
        const int waves = gridDim.x * (blockDim.x / 64);                                            \
        accumulator acc;                                                                            \
        for (int r = 0; r < registers; ++r) acc[r] = c[(wave * 64 + lane) * registers + r];         \
        for (int s = 0; s < steps; ++s) {                                                           \
            const long long at = ((long long)s * waves + wave) * 64 + lane;                         \
            acc = builtin(a[at], b[at], acc, 0, 0, 0);                                              \
        }                                                                                           \
        for (int r = 0; r < registers; ++r) d[(wave * 64 + lane) * registers + r] = acc[r];         \
    }
#if !defined(__gfx90a__)
RLP_TEST_MFMA(mfma_16x16x32, __builtin_amdgcn_mfma_i32_16x16x32_i8, long, rlp_test_i32x4, 4)
RLP_TEST_MFMA(mfma_32x32x16, __builtin_amdgcn_mfma_i32_32x32x16_i8, long, rlp_test_i32x16, 16)
// Lanes 32..63 of each wavefront skip the MFMA: the emulation must refuse it (a wavefront executes
// an MFMA whole).
extern "C" __global__ void mfma_divergent(const long* a, const long* b, int* d) {
    rlp_test_i32x4 acc = {0, 0, 0, 0};
    if (threadIdx.x % 64 < 32)
        acc = __builtin_amdgcn_mfma_i32_16x16x32_i8(a[threadIdx.x], b[threadIdx.x], acc, 0, 0, 0);
    d[threadIdx.x] = acc[0];
}
#endif
#if !defined(__gfx942__)
RLP_TEST_MFMA(mfma_16x16x16, __builtin_amdgcn_mfma_i32_16x16x16i8, int, rlp_test_i32x4, 4)
RLP_TEST_MFMA(mfma_32x32x8, __builtin_amdgcn_mfma_i32_32x32x8i8, int, rlp_test_i32x16, 16)
#endif
// v_dot4_i32_i8 (both targets): one lane's c + the four signed byte products, no clamp
extern "C" __global__ void sdot4(const int* a, const int* b, const int* c, int* d, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) d[i] = __builtin_amdgcn_sdot4(a[i], b[i], c[i], false);
}
"""


# ---- the documented layout, in NumPy

def d_coordinates(ins: Instruction) -> tuple[np.ndarray, np.ndarray]:
    """(rows, columns) of shape [64, registers]: the D (and C) element in lane l, register r."""
    lane = np.arange(WAVE)[:, None]
    r = np.arange(ins.registers)[None, :]
    rows = 4 * ins.groups * (r // 4) + 4 * (lane // ins.m) + r % 4
    columns = np.broadcast_to(lane % ins.m, rows.shape)
    return rows, columns


def pack_a(ins: Instruction, a: np.ndarray) -> np.ndarray:
    """A [M, K] int8 -> [64] operand registers: lane M * g + i holds A[i, KL g : KL (g + 1)], byte by byte."""
    lanes = a.reshape(ins.m, ins.groups, ins.kl).transpose(1, 0, 2).reshape(WAVE, ins.kl)
    return np.ascontiguousarray(lanes).view(ins.operand).reshape(WAVE)  # byte 0 the least significant


def pack_b(ins: Instruction, b: np.ndarray) -> np.ndarray:
    """B [K, N] int8 -> [64] operand registers: lane M * g + j holds B[KL g : KL (g + 1), j]."""
    lanes = b.reshape(ins.groups, ins.kl, ins.m).transpose(0, 2, 1).reshape(WAVE, ins.kl)
    return np.ascontiguousarray(lanes).view(ins.operand).reshape(WAVE)


def pack_d(ins: Instruction, d: np.ndarray, coordinates=None) -> np.ndarray:
    rows, columns = coordinates or d_coordinates(ins)
    return d[rows, columns].astype(np.int32)


def unpack_d(ins: Instruction, registers: np.ndarray, coordinates=None) -> np.ndarray:
    rows, columns = coordinates or d_coordinates(ins)
    d = np.zeros((ins.m, ins.m), np.int32)
    d[rows, columns] = registers
    return d


def reference(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """sum_s A_s @ B_s + C, exact in int64; the inputs keep it inside int32."""
    total = c.astype(np.int64) + np.einsum("wsik,wskj->wij", a.astype(np.int64), b.astype(np.int64))
    assert -(2**31) <= total.min() and total.max() < 2**31
    return total.astype(np.int32)


# ---- running the kernels

@pytest.fixture(scope="module")
def backend():
    backend = hip_cpu_backend()
    backend.add_family(FAMILY, KERNELS)
    return backend


def run(backend, ins: Instruction, a_registers: np.ndarray, b_registers: np.ndarray, c_registers: np.ndarray,
        threads: int = WAVE) -> np.ndarray:
    """a_registers, b_registers [steps, waves, 64]; c_registers [waves, 64, registers] -> D registers."""
    steps, waves = a_registers.shape[:2]
    assert threads % WAVE == 0 and (waves * WAVE) % threads == 0
    d = backend.zeros(c_registers.shape, np.int32)
    backend.launch(FAMILY, ins.kernel, ((waves * WAVE) // threads,), (threads,),
                   (backend.asarray(a_registers), backend.asarray(b_registers), backend.asarray(c_registers), d,
                    np.int32(steps)))
    return backend.to_numpy(d)


def multiply(backend, ins, a, b, c, threads=WAVE, pack=None):
    """a [waves, steps, M, K], b [waves, steps, K, N], c [waves, M, N] -> D [waves, M, N] through the
    kernel, with the documented layout or `pack` = (pack_a, pack_b, d coordinates) in its place."""
    pa, pb, coordinates = pack or (pack_a, pack_b, None)
    waves, steps = a.shape[:2]
    a_registers = np.stack([np.stack([pa(ins, a[w, s]) for w in range(waves)]) for s in range(steps)])
    b_registers = np.stack([np.stack([pb(ins, b[w, s]) for w in range(waves)]) for s in range(steps)])
    c_registers = np.stack([pack_d(ins, c[w], coordinates) for w in range(waves)])
    d_registers = run(backend, ins, a_registers, b_registers, c_registers, threads)
    return np.stack([unpack_d(ins, d_registers[w], coordinates) for w in range(waves)])


def random_inputs(ins: Instruction, waves: int, steps: int, seed: int):
    rng = np.random.default_rng(seed)
    a = rng.integers(-128, 128, (waves, steps, ins.m, ins.k), dtype=np.int8)
    b = rng.integers(-128, 128, (waves, steps, ins.k, ins.m), dtype=np.int8)
    a.reshape(-1)[:: 7] = -128  # the extremes, often
    b.reshape(-1)[3:: 11] = 127
    c = rng.integers(-(2**30), 2**30, (waves, ins.m, ins.m), dtype=np.int32)
    return a, b, c


def test_the_documented_d_map_is_one_to_one():
    for ins in INSTRUCTIONS:
        rows, columns = d_coordinates(ins)
        seen = np.zeros((ins.m, ins.m), int)
        np.add.at(seen, (rows, columns), 1)
        assert (seen == 1).all(), ins.kernel
        a = np.arange(ins.m * ins.k).reshape(ins.m, ins.k).astype(np.int8)  # packing is a bijection too
        assert sorted(pack_a(ins, a).view(np.int8)) == sorted(a.reshape(-1))


@pytest.mark.parametrize("ins", INSTRUCTIONS, ids=IDS)
def test_mfma_is_numpys_integer_product(backend, ins):
    # 2 blocks of 2 wavefronts, each wavefront its own matrices
    a, b, c = random_inputs(ins, waves=4, steps=1, seed=ins.m * ins.kl)
    got = multiply(backend, ins, a, b, c, threads=2 * WAVE)
    assert np.array_equal(got, reference(a, b, c))


@pytest.mark.parametrize("ins", INSTRUCTIONS, ids=IDS)
def test_chained_mfmas_accumulate(backend, ins):
    # three MFMAs into one accumulator (the prelude's two slot sets alternate), 4 wavefronts a block
    a, b, c = random_inputs(ins, waves=4, steps=3, seed=100 + ins.m * ins.kl)
    got = multiply(backend, ins, a, b, c, threads=4 * WAVE)
    assert np.array_equal(got, reference(a, b, c))


@pytest.mark.parametrize("ins", INSTRUCTIONS, ids=IDS)
def test_extremes_to_the_edge_of_int32(backend, ins):
    steps = 2
    shape_a, shape_b = (ins.m, ins.k), (ins.k, ins.m)
    high = steps * ins.k * 128 * 128  # every product (-128)(-128)
    low = steps * ins.k * 128 * 127  # every product (-128)(127)
    cases = [
        (np.full(shape_a, -128), np.full(shape_b, -128), 2**31 - 1 - high),  # D reaches INT32_MAX exactly
        (np.full(shape_a, -128), np.full(shape_b, 127), -(2**31) + low),  # D reaches INT32_MIN exactly
        (np.full(shape_a, 127), np.full(shape_b, 127), 0),
    ]
    a = np.stack([np.stack([case[0]] * steps) for case in cases]).astype(np.int8)
    b = np.stack([np.stack([case[1]] * steps) for case in cases]).astype(np.int8)
    c = np.stack([np.full((ins.m, ins.m), case[2]) for case in cases]).astype(np.int32)
    # and a checkerboard of both extremes in a fourth wavefront (not symmetric, not constant)
    rng = np.random.default_rng(7)
    a = np.concatenate([a, rng.choice(np.array([-128, 127], np.int8), (1, steps, *shape_a))])
    b = np.concatenate([b, rng.choice(np.array([-128, 127], np.int8), (1, steps, *shape_b))])
    c = np.concatenate([c, np.full((1, ins.m, ins.m), -1, np.int32)])
    expected = reference(a, b, c)
    assert expected[0].min() == 2**31 - 1 and expected[1].max() == -(2**31)
    assert np.array_equal(multiply(backend, ins, a, b, c, threads=4 * WAVE), expected)


# ---- a layout error shows as a failure: wrong maps (each a plausible mistake) give other bits

def _a_bytes_reversed(ins, a):  # k in the wrong order within A's lanes (B right)
    return pack_a(ins, a.reshape(ins.m, ins.groups, ins.kl)[:, :, ::-1].reshape(ins.m, ins.k))


def _a_lanes_row_major(ins, a):  # lane G i + g instead of M g + i
    lanes = a.reshape(ins.m * ins.groups, ins.kl)
    return np.ascontiguousarray(lanes).view(ins.operand).reshape(WAVE)


def _b_columns_for_rows(ins, b):  # B's lane groups hold columns of B's k-blocks transposed
    blocks = b.reshape(ins.groups, ins.kl, ins.m)
    lanes = blocks.reshape(ins.groups, ins.m, ins.kl)  # rows of a k-block read as if laid out by column
    return np.ascontiguousarray(lanes.reshape(WAVE, ins.kl)).view(ins.operand).reshape(WAVE)


def _d_transposed(ins):
    rows, columns = d_coordinates(ins)
    return columns, rows


def _d_rows_interleaved(ins):  # register r, lane group h: row G r + h (16x16) instead of 4 h + r
    lane = np.arange(WAVE)[:, None]
    r = np.arange(ins.registers)[None, :]
    rows = (ins.groups * r + lane // ins.m) % ins.m
    return rows, np.broadcast_to(lane % ins.m, rows.shape)


WRONG_MAPS = {
    "A k reversed": (_a_bytes_reversed, pack_b, None),
    "A lanes row-major": (_a_lanes_row_major, pack_b, None),
    "B rows for columns": (pack_a, _b_columns_for_rows, None),
    "D transposed": (pack_a, pack_b, "transposed"),
    "D rows interleaved": (pack_a, pack_b, "interleaved"),
}


@pytest.mark.parametrize("ins", INSTRUCTIONS, ids=IDS)
def test_a_wrong_layout_fails(backend, ins):
    a, b, c = random_inputs(ins, waves=1, steps=1, seed=200 + ins.m * ins.kl)
    expected = reference(a, b, c)
    assert np.array_equal(multiply(backend, ins, a, b, c), expected)
    for name, (pa, pb, d_map) in WRONG_MAPS.items():
        coordinates = {None: None, "transposed": _d_transposed(ins), "interleaved": _d_rows_interleaved(ins)}[d_map]
        if coordinates is not None:
            seen = np.zeros((ins.m, ins.m), int)
            np.add.at(seen, coordinates, 1)
            if not (seen == 1).all():
                continue  # not a permutation of D for this shape: nothing to compare
        got = multiply(backend, ins, a, b, c, pack=(pa, pb, coordinates))
        assert not np.array_equal(got, expected), f"{ins.kernel}: the wrong map '{name}' matched the reference"
        assert (got != expected).mean() > 0.5, f"{ins.kernel}: '{name}' differs in only a few elements"


@pytest.mark.parametrize("ins", INSTRUCTIONS, ids=IDS)
def test_swapped_operands_give_the_transpose(backend, ins):
    # A's and B's maps are mirror images: B's registers given as A and A's as B compute B^T A^T = (A B)^T,
    # which on these non-symmetric inputs differs from A B: rows for columns is visible.
    a, b, c = random_inputs(ins, waves=1, steps=1, seed=300 + ins.m * ins.kl)
    swapped = (lambda ins_, a_: pack_b(ins_, a_.T), lambda ins_, b_: pack_a(ins_, b_.T), None)
    got = multiply(backend, ins, np.swapaxes(b, 2, 3), np.swapaxes(a, 2, 3), c, pack=swapped)
    product = reference(a, b, np.zeros_like(c))[0].astype(np.int64)
    assert np.array_equal(got, (product.T + c[0]).astype(np.int32)[None])
    assert not np.array_equal(got, reference(a, b, c))


def test_a_wavefront_that_parts_around_an_mfma_is_refused(backend):
    # in a child process: the emulation aborts the run (as a kernel bug would be undefined on a GPU)
    script = (
        "import numpy as np, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from test_hip_cpu_mfma import KERNELS, FAMILY\n"
        "from rlportable.runtime import hip_cpu\n"
        "backend = hip_cpu.HipCpuBackend()\n"
        "backend.add_family(FAMILY, KERNELS)\n"
        "a = backend.zeros((64,), np.int64)\n"
        "d = backend.zeros((64,), np.int32)\n"
        "backend.launch(FAMILY, 'mfma_divergent', (1,), (64,), (a, a, d))\n"
        "print('returned')\n")
    result = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode != 0 and "returned" not in result.stdout, result.stdout + result.stderr
    assert "rlp_cpu_mfma: lane" in result.stderr and "must execute the same MFMA" in result.stderr, result.stderr


# ---- the same kernels for the real targets

@pytest.mark.parametrize("arch", ["gfx942", "gfx90a"])
def test_the_kernels_compile_for_amd_with_the_real_builtins(arch):
    from rlportable.build import amd_resources

    missing = amd_resources.missing_tools()
    if missing:
        if in_ci():
            pytest.fail(missing)
        pytest.skip(missing)
    with tempfile.TemporaryDirectory(prefix="rlp-mfma-") as folder:
        root = Path(folder)
        source, assembly = root / "mfma.hip", root / "mfma.s"
        source.write_text(KERNELS)
        options = [option for option in amd_resources.CLANG_DEVICE_ONLY if not option.startswith("-Rpass")]
        command = [amd_resources.CLANG, *options, *amd_resources._options(arch),
                   f"--rocm-device-lib-path={amd_resources.device_lib_dir(root)}", "-S", str(source),
                   "-o", str(assembly)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, " ".join(command) + "\n" + done.stderr[-4000:]
        text = assembly.read_text()
    wanted = {"gfx942": ["v_mfma_i32_16x16x32_i8", "v_mfma_i32_32x32x16_i8"],
              "gfx90a": ["v_mfma_i32_16x16x16i8", "v_mfma_i32_32x32x8i8"]}[arch]
    for mnemonic in wanted:
        assert mnemonic in text, f"{arch}: no {mnemonic} in the code"


def test_sdot4_is_c_plus_the_signed_byte_products(backend):
    """__builtin_amdgcn_sdot4(a, b, c, false) against NumPy: every byte value (-128 and 127 often), and c
    near both ends of int32 so that a sum past them wraps as int32 arithmetic does."""
    rng = np.random.default_rng(5)
    n = 4096
    a, b = (rng.integers(-128, 128, (n, 4), dtype=np.int8) for _ in range(2))
    a[::5] = -128
    b[::7] = 127
    b[1::9] = -128
    c = rng.integers(-(2**31), 2**31, n, dtype=np.int64)
    c[:64] = 2**31 - 1
    c[64:128] = -(2**31)
    c = c.astype(np.int32)
    want = (c.astype(np.int64) + (a.astype(np.int64) * b.astype(np.int64)).sum(axis=1)) % 2**32
    want = want.astype(np.uint32).view(np.int32)
    d = backend.zeros((n,), np.int32)
    backend.launch(FAMILY, "sdot4", (n // 256,), (256,),
                   tuple(backend.asarray(np.ascontiguousarray(x).view(np.int32).reshape(n)) for x in (a, b))
                   + (backend.asarray(c), d, np.int32(n)))
    assert np.array_equal(backend.to_numpy(d).view(np.uint32), want.view(np.uint32))
