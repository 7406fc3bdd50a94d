"""Benchmarks, one module each, over one shared timing method (timing.py): `moe-lm bench <what>` (moe_lm/cli/bench.py),
also `python -m moe_lm.bench <what>`. A benchmark's helpers take a typed request (a frozen dataclass of the settings
they read), built from its flags by `from_flags` (moe_lm/flags.py, as the analytics' requests are), so that they
can be called from Python as well."""
