"""Rows moved between tokens and a buffer of slots by gathers only (moe_lm/ops/slot_rows.py): equal to the
index_select / index_add pair they replace, with exact gradients, and no floating-point scatter-add anywhere in the
CUDA expert path or the expert-parallel dispatch (a GPU's atomics make such a sum depend on thread order)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_lm.ops.grouped import grouped_mm
from moe_lm.ops.slot_rows import combine_slots, gather_slots, slot_map


def random_map(M: int, K: int, kept: float, padding: int, seed: int = 0):
    """A map of some of the M x K slots (each kept with probability `kept`) shuffled into a buffer with `padding`
    rows more than slots."""
    g = torch.Generator().manual_seed(seed)
    slot_N = torch.nonzero(torch.rand(M * K, generator=g) < kept).squeeze(1)
    P = len(slot_N) + padding
    row_N = torch.randperm(P, generator=g)[: len(slot_N)]
    return slot_map(slot_N, row_N, M, K, P, complete=len(slot_N) == M * K), slot_N, row_N


@pytest.mark.parametrize("kept, padding", [(1.0, 0), (1.0, 5), (0.6, 3)])
def test_gather_and_combine_equal_the_scatter_add_they_replace(kept, padding):
    M, K, D = 12, 3, 5
    smap, slot_N, row_N = random_map(M, K, kept, padding)
    x = torch.randn(M, D, dtype=torch.float64, requires_grad=True)
    y = torch.randn(smap.slot_P.numel(), D, dtype=torch.float64, requires_grad=True)
    w = torch.rand(M, K, dtype=torch.float64, requires_grad=True)
    token_N = slot_N // K
    # the reference: index_select into the buffer's rows, index_add of weighted rows back
    buf = x.new_zeros(y.shape).index_copy(0, row_N, x.index_select(0, token_N))
    torch.testing.assert_close(gather_slots(x, smap), buf, rtol=0, atol=0)
    ref = x.new_zeros(M, D).index_add(0, token_N, y.index_select(0, row_N) * w.flatten()[slot_N, None])
    torch.testing.assert_close(combine_slots(y, smap, w), ref)
    torch.testing.assert_close(combine_slots(y, smap), x.new_zeros(M, D).index_add(0, token_N, y[row_N]))
    assert torch.autograd.gradcheck(lambda a: gather_slots(a, smap), (x,))
    assert torch.autograd.gradcheck(lambda b, v: combine_slots(b, smap, v), (y, w))


def test_the_weighted_sum_is_accumulated_in_float32():
    """bf16 rows summed over K slots are rounded once, at the end (a bf16 running sum rounds at every slot)."""
    M, K, D = 64, 8, 32
    smap, slot_N, row_N = random_map(M, K, 1.0, 0)
    y = torch.randn(M * K, D).bfloat16()
    w = torch.rand(M, K).bfloat16()  # the weights meet the rows in their dtype, as the scatter-add path's did
    exact = (y.double()[smap.table_MK] * w.double()[..., None]).sum(1).bfloat16()
    running = torch.zeros(M, D, dtype=torch.bfloat16)
    for k in range(K):
        running += y[smap.table_MK[:, k]] * w[:, k, None]
    assert (combine_slots(y, smap, w) != exact).float().mean() < 0.01  # float32 near a bf16 tie, at most
    assert (running != exact).float().mean() > 0.1  # what rounding at every slot gives


FLOAT_ACCUMULATING = {"index_add", "scatter_add", "scatter_reduce", "index_reduce", "put", "_index_put_impl",
                      "index_put", "embedding_dense_backward"}  # fmt: skip


class FloatScatterAdds(TorchDispatchMode):
    """The floating-point ops that accumulate into an output by index (what a GPU runs with atomics)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__.rstrip("_")
        accumulates = name != "index_put" and name != "_index_put_impl" or (kwargs or {}).get("accumulate") or (
            len(args) > 3 and args[3] is True)  # fmt: skip
        if name in FLOAT_ACCUMULATING and accumulates and isinstance(out, torch.Tensor) and out.is_floating_point():
            self.seen.append(str(func))
        return out


def test_the_cuda_expert_path_accumulates_by_index_nowhere():
    """Forward and backward of the grouped_mm route (run here on CPU): no index_add / scatter_add of floats, so on a
    GPU no atomics; the integer counts (expert_counts) are exact in any order and allowed."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not in this torch build")
    E, D, I, M, K = 4, 16, 8, 24, 2
    x = torch.randn(M, D, requires_grad=True)
    w = torch.rand(M, K, requires_grad=True)
    gu, dn = torch.randn(E, 2 * I, D, requires_grad=True), torch.randn(E, D, I, requires_grad=True)
    expert = torch.stack([torch.randperm(E)[:K] for _ in range(M)])
    with FloatScatterAdds() as mode:
        grouped_mm(x, expert, w, gu, dn).square().sum().backward()
    assert mode.seen == [] and x.grad is not None and w.grad is not None
    with FloatScatterAdds() as reference:  # the check sees the scatter-add it guards against
        x.new_zeros(M, D).index_add(0, torch.arange(M).repeat_interleave(K), x.repeat_interleave(K, 0))
    assert reference.seen
