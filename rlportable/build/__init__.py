"""Build and CI tools, outside the runtime: compiling every kernel source offline as the runtime would
(offline_compile: nvcc, hipcc, hiprtc) and checking the HIP kernels' resources for AMD targets
(amd_resources: clang-19 for gfx942 and gfx90a). The package never imports them at run time."""
