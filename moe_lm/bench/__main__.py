"""`python -m moe_lm.bench <what> [flags]` = `moe-lm bench <what>`; `--help` lists the benchmarks."""

from moe_lm.cli.bench import main

if __name__ == "__main__":
    main()
