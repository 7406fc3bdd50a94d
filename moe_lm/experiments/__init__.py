"""Experiments that test the claims moe-lm rests on: arms x seeds of training runs, a final evaluation on the
whole validation split, seed-paired intervals and a verdict fixed in advance (`moe-lm experiment`). The research
variants the arms use (variants/) are registered with the core on import."""

import moe_lm.experiments.variants  # noqa: F401
