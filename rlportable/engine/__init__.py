"""The rollout engine: sequences and sampling parameters, the paged KV block manager, the scheduler."""
