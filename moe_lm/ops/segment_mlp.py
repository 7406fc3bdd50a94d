"""The CPU segment MLP of the "grouped" expert path: every expert over its contiguous run of token-slots.

    y[t_n] += w_n * down_e(silu(gate_e x[t_n]) * up_e x[t_n])      for token-slots n sorted by expert e

Shapes: x [M, D]; token [N] (the row of x of each slot, slots sorted by expert); counts [E] (CPU int64); w [N];
gate_up [E, 2I, D]; down [E, D, I] -> y [M, D].

Two implementations with the same results and gradients:
- the compiled kernel (csrc/segment_mlp.cpp, fp32; see cpu_kernels.py for where it is built and used).
- `SegmentMLP`, per-expert PyTorch matmuls with a hand-written backward: the fallback for other dtypes and
  machines, or when `MOE_LM_CPU_KERNEL=0`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_lm.ops import swiglu
from moe_lm.ops.cpu_kernels import cpu_kernels_for, load_cpu_kernels


def segment_mlp(x, token, counts, w, gate_up, down) -> torch.Tensor:
    """The segments on CPU: the compiled kernel for fp32 where it is available, `SegmentMLP` otherwise."""
    if cpu_kernels_for(x, gate_up) is not None:
        return SegmentMLPKernel.apply(x.contiguous(), token, counts, w, gate_up.contiguous(), down.contiguous())
    return SegmentMLP.apply(x, token, counts, w, gate_up, down)


class SegmentMLPKernel(torch.autograd.Function):
    """The compiled kernel as an autograd function (fp32). Saves each expert's gate/up pre-activations."""

    @staticmethod
    def forward(ctx, x_MD, token_N, counts_E, w_N, gate_up_EFD, down_EDI):
        y_MD, h_per_expert = load_cpu_kernels().segment_mlp_forward(x_MD, token_N, counts_E, w_N, gate_up_EFD, down_EDI)
        ctx.save_for_backward(x_MD, token_N, counts_E, w_N, gate_up_EFD, down_EDI, *h_per_expert)
        return y_MD

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy_MD):
        x_MD, token_N, counts_E, w_N, gate_up_EFD, down_EDI, *h_per_expert = ctx.saved_tensors
        need_dw = ctx.needs_input_grad[3]
        dx, dw, d_gate_up, d_down = load_cpu_kernels().segment_mlp_backward(
            dy_MD, x_MD, token_N, counts_E, w_N, gate_up_EFD, down_EDI, h_per_expert, need_dw
        )
        return dx, None, None, dw if need_dw else None, d_gate_up, d_down


class SegmentMLP(torch.autograd.Function):
    """y[t_n] += w_n * down_e(silu(gate_e x[t_n]) * up_e x[t_n]) for token-slots n sorted by expert e.

    The PyTorch version of the kernel. Work is blocked per expert: each expert gathers its rows, runs its
    two matmuls and the SwiGLU on a cache-sized block, and adds its rows back, with a hand-written backward.
    why: on CPU, full [N, D] temporaries cost more than the matmuls (every fresh buffer above glibc's mmap
    threshold is page-faulted in anew, and every elementwise pass over it runs from DRAM); per-expert blocks
    stay in cache and in the allocator's reused heap.

    Shapes: x [M, D]; token [N] (the row of x of each slot, slots sorted by expert); counts [E]; w [N];
    gate_up [E, 2I, D]; down [E, D, I] -> y [M, D].
    """

    @staticmethod
    def forward(ctx, x_MD, token_N, counts_E, w_N, gate_up_EFD, down_EDI):
        blocks = _blocks(counts_E, token_N)
        y_MD = torch.zeros_like(x_MD)
        saved = []  # per expert: (its gathered rows, its gate/up pre-activation)
        for (start, end, tok), gate_up, down in zip(blocks, gate_up_EFD.unbind(0), down_EDI.unbind(0), strict=True):
            if start == end:
                saved.append(None)
                continue
            x = x_MD.index_select(0, tok)
            h = x @ gate_up.T
            a = swiglu(h).mul_(w_N[start:end, None])
            y_MD.index_add_(0, tok, a @ down.T)
            saved.append((x, h))
        ctx.blocks, ctx.saved_blocks = blocks, saved
        ctx.save_for_backward(w_N, gate_up_EFD, down_EDI)
        ctx.x_shape = x_MD.shape
        return y_MD

    @staticmethod
    def backward(ctx, dy_MD):
        w_N, gate_up_EFD, down_EDI = ctx.saved_tensors
        dy_MD = dy_MD.contiguous()
        dx_MD = dy_MD.new_zeros(ctx.x_shape)
        d_gate_up = torch.empty_like(gate_up_EFD)
        d_down = torch.empty_like(down_EDI)
        dw_N = torch.empty_like(w_N) if ctx.needs_input_grad[3] else None
        I = down_EDI.shape[2]
        # one [rows, 2I] buffer for every expert's pre-activation gradient (no per-expert concatenation)
        dh_buf = dy_MD.new_empty(max((b[1] - b[0] for b in ctx.blocks), default=0), 2 * I)
        for e, ((start, end, tok), block) in enumerate(zip(ctx.blocks, ctx.saved_blocks, strict=True)):
            if block is None:  # an expert that received no token has zero gradient
                d_gate_up[e].zero_()
                d_down[e].zero_()
                continue
            x, h = block
            gate, up = h[:, :I], h[:, I:]
            dy = dy_MD.index_select(0, tok)
            g = dy @ down_EDI[e]  # dL/d(weighted activation)          [n, I]
            silu = F.silu(gate)
            a = silu * up
            w = w_N[start:end, None]
            if dw_N is not None:
                dw_N[start:end] = torch.linalg.vecdot(g, a)
            a.mul_(w)
            g.mul_(w)
            torch.mm(dy.T, a, out=d_down[e])
            # SwiGLU backward: d up = g * silu(gate), d gate = silu'(gate) * g * up.
            dh = dh_buf[: end - start]
            d_gate, d_up = dh[:, :I], dh[:, I:]
            torch.mul(g, up, out=d_gate)
            torch.ops.aten.silu_backward.grad_input(d_gate, gate, grad_input=d_gate)
            torch.mul(g, silu, out=d_up)
            torch.mm(dh.T, x, out=d_gate_up[e])
            dx_MD.index_add_(0, tok, dh @ gate_up_EFD[e])
        ctx.saved_blocks = None
        return dx_MD, None, None, dw_N, d_gate_up, d_down


def _blocks(counts_E: torch.Tensor, token_N: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
    """(start, end, rows of x) of each expert's slots."""
    ends = counts_E.cumsum(0).tolist()
    starts = [0, *ends[:-1]]
    return [(s, e, token_N[s:e]) for s, e in zip(starts, ends, strict=True)]
