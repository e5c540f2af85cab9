"""The compiler options every kernel is built with: the contract's rules for IEEE arithmetic.

The runtime (NVRTC, hiprtc) and CI's offline compile (nvcc, hipcc) both take
their options from here, so what CI proves compiles is what runs.
"""

# NVRTC and nvcc spell these options alike. No contraction into fma, no
# flush-to-zero, IEEE division and square root, no fast math (NVRTC's default,
# stated anyway so a change of default cannot slip in).
CUDA_OPTIONS = (
    "--std=c++17",
    "--fmad=false",
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
)

# hiprtc and hipcc (clang) spellings of the same rules. Denormals are kept for
# float32 unless -fgpu-flush-denormals-to-zero is given; it is turned off
# explicitly.
HIP_OPTIONS = (
    "-std=c++17",
    "-fno-fast-math",
    "-ffp-contract=off",  # after -fno-fast-math, so the last word on contraction is "off"
    "-fno-gpu-flush-denormals-to-zero",
)


#: Compute capabilities built for their arch-specific target ("sm_90a"): the Hopper-only
#: instructions (wgmma, backends/cuda/pipeline.h) exist only there. The code runs on that
#: compute capability only, which is the one the runtime compiles for anyway.
ARCH_SPECIFIC = {"90": "a"}
#: compute capabilities whose builds have wgmma (the gemm's and attention's warpgroup kernels)
WGMMA_CAPABILITIES = ("90",)


def has_wgmma(backend) -> bool:
    return getattr(backend, "compute_capability", None) in WGMMA_CAPABILITIES


def cuda_arch_option(compute_capability: str) -> str:
    """'80' -> '--gpu-architecture=sm_80', '90' -> '--gpu-architecture=sm_90a' (real machine code, not
    PTX left to the driver)."""
    return f"--gpu-architecture=sm_{compute_capability}{ARCH_SPECIFIC.get(compute_capability, '')}"


def hip_arch_option(gcn_arch: str) -> str:
    """'gfx942:sramecc+:xnack-' -> '--offload-arch=gfx942' (target features kept off the name)."""
    return f"--offload-arch={gcn_arch.split(':')[0]}"
