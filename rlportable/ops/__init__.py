"""One module per op family: input checks, the reference on cpu, kernel dispatch on devices."""
