"""Benchmarks, one module each, over one shared timing method (timing.py): `python -m moe_lm.bench <what>`."""

from moe_lm.bench.cli import BENCHMARKS, main

__all__ = ["BENCHMARKS", "main"]
