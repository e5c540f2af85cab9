"""The numerical contract: contract files, fixed-point encoding, the contract's own elementwise functions."""
