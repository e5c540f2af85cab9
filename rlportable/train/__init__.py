"""Training: built-in tasks and datasets, reward functions (and, later, optimiser, SFT, GRPO, checkpoints)."""
