"""`python -m moe_lm.bench <what> [flags]`; `python -m moe_lm.bench --help` lists the benchmarks."""

from moe_lm.bench.cli import main

if __name__ == "__main__":
    main()
