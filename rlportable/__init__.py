"""rlportable: the LLM RL loop on NVIDIA and AMD GPUs under bitwise numerical contracts."""

__version__ = "0.1.0"
