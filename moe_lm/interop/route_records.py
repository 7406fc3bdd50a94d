"""What a record of routes is, whoever recorded it (a serving engine, a trainer): sequences of token ids from their
first position, the experts each routed token went to, and what was left out. Read by engine_routes.py (vLLM,
SGLang) and megatron_routes.py (Megatron-Core); a subject by moe_lm/analysis/subjects/recorded.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Sequence:
    """One request's tokens from position 0 and the routes of its routed tokens, `routes[i]` for `tokens[i]`
    ([n, engine layers, k], n <= len(tokens)); `domain`: what the record says it is (None: not said)."""

    tokens: np.ndarray
    routes: np.ndarray
    domain: str | None = None


@dataclass
class Record:
    """What a file held: its format, its sequences, and what was left out (and why), for the console. `layers`: the
    decoder layers a sequence's routes hold, in order, where the record names them (None: every decoder layer, the
    serving engines' axis); `ranked`: whether each token's experts come first choice first."""

    format: str
    sequences: list[Sequence]
    skipped: dict[str, int] = field(default_factory=dict)  # why -> tokens (responses, for NO_ROUTES)
    layers: list[int] | None = None
    ranked: bool = True
