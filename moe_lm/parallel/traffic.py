"""What one token costs on the wire under expert parallelism: the byte formulas the dispatcher (dispatch.py) counts
with and the planner (moe_lm/planning/comm_plan.py) plans with, so the two agree by construction."""

from __future__ import annotations

KINDS = ("self", "intra", "inter")  # a pair to the token's own rank, to another rank of its node, to another node
INDEX_BYTES = 8  # the dispatcher sends each slot's local expert id as int64


def dispatch_row_bytes(dim: int, k: int, elem: int) -> int:
    """Bytes of one dispatched pair: the token's row, and for its K slots a gate weight and a local expert id."""
    return dim * elem + k * (elem + INDEX_BYTES)


def combine_row_bytes(dim: int, elem: int) -> int:
    """Bytes of one combined pair: the weighted sum of the pair's expert outputs, sent back to the token's rank."""
    return dim * elem


def pair_kind(src: int, dst: int, nodes: list[int]) -> str:
    return "self" if src == dst else "intra" if nodes[src] == nodes[dst] else "inter"
