"""Benchmarks, one module each, over one shared timing method (timing.py): `moe-lm bench <what>` (moe_lm/cli/bench.py),
also `python -m moe_lm.bench <what>`."""
