"""The benchmarks behind `rlportable bench`: ratios against a peer measured in the same run."""
