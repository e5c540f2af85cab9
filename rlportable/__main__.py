"""`python -m rlportable ...`: the same commands as the `rlportable` script (what `--tp N` spawns)."""

from rlportable.cli import main

if __name__ == "__main__":
    main()
