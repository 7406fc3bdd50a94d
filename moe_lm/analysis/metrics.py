"""Routing metrics as pure functions of counts and traces."""

from __future__ import annotations

import numpy as np


def max_vio(counts: np.ndarray) -> float:
    """MaxVio = (max_i c_i - mean c) / mean c over experts (Wang et al. 2024); 0 is perfect balance."""
    counts = np.asarray(counts, dtype=np.float64)
    mean = counts.mean()
    return float((counts.max() - mean) / mean) if mean > 0 else 0.0
