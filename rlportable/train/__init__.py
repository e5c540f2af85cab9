"""Training: built-in tasks and datasets, reward functions, atomic checkpoints (and, later, optimiser, SFT, GRPO)."""
