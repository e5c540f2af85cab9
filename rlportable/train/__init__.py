"""Training: the optimiser, SFT and GRPO trainers, built-in tasks and datasets, reward functions, atomic checkpoints."""
