"""The plan of a streamed analysis (moe_lm/analysis/streamed.py) and the rates it is timed by: what is read at once
(`Unit`: a layer, or a chunk of its routed experts, within half the weights' budget), the bytes and matrix products of
each layer, this machine's read and compute rates measured on the model's own shapes, the time they make, and each
layer's measured bytes, FLOPs and seconds against them (`Timing`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from moe_lm.analysis.hf_routing import declared
from moe_lm.analysis.stream_work import WorkFolder
from moe_lm.errors import UserError
from moe_lm.files import gib
from moe_lm.interop.hf_layers import HFCheckpoint


@dataclass
class Unit:
    """What is read at once: a layer's own weights (with all its experts when they fit), or a chunk of its experts."""

    layer: int
    experts: list[int] | None  # None: the layer's own weights (`whole`: its experts too)
    whole: bool = False


def plan_units(ck: HFCheckpoint, last: int, budget: int) -> list[Unit]:
    """The reading plan: per layer its whole weights when they fit half the budget (the other half holds the unit
    read meanwhile), else its own weights and then chunks of its routed experts; a UserError naming the least budget
    that works when the largest unit does not fit."""
    elem = torch.tensor([], dtype=ck.dtype).element_size()
    least = {}  # layer -> (bytes of its largest unit, what that unit is)
    for i in range(last + 1):
        whole = ck.layer_numel(i) * elem
        if i not in ck.moe_layers:
            least[i] = (whole, "its weights")
        else:
            own, one = ck.layer_numel(i, experts=False) * elem, ck.expert_numel(i) * elem
            least[i] = (own, "its attention, router and shared experts") if own >= one else (one, "one routed expert")
    worst = max(least, key=lambda i: least[i][0])
    if 2 * least[worst][0] > budget:
        size, what = least[worst]
        raise UserError(f"--max-memory {gib(budget)} is too little: layer {worst}'s largest part ({what}) takes "
                        f"{gib(size)}, held while the next part is read: give at least --max-memory "
                        f"{-(-2 * size // 2**20)}MiB")  # fmt: skip
    half = budget // 2
    units = []
    for i in range(last + 1):
        if i not in ck.moe_layers or ck.layer_numel(i) * elem <= half:
            units.append(Unit(i, None, whole=True))
            continue
        chunk = max(1, half // (ck.expert_numel(i) * elem))
        units.append(Unit(i, None))
        units += [Unit(i, list(range(s, min(s + chunk, ck.n_experts)))) for s in range(0, ck.n_experts, chunk)]
    return units


def unit_bytes(ck: HFCheckpoint, unit: Unit) -> int:
    """Bytes a unit reads from the checkpoint."""
    if unit.experts is not None:
        return len(unit.experts) * ck.expert_bytes(unit.layer)
    return ck.layer_bytes(unit.layer, experts=unit.whole)


def layer_flops(ck: HFCheckpoint, i: int, padded, experts: bool = True) -> float:
    """The FLOPs of layer i's matrix products over the padded windows: every weight once per token (2 FLOPs a value),
    the routed experts k times per token, attention's scores and mix over the causal half."""
    cfg = ck.config
    tokens = sum(int(t.numel()) for t, _ in padded)
    heads = cfg.num_attention_heads
    qk = declared(cfg, "qk_head_dim", "head_dim") or cfg.hidden_size // heads
    v = declared(cfg, "v_head_dim") or qk
    attention = sum(t.shape[0] * t.shape[1] ** 2 * heads * (qk + v) for t, _ in padded)  # 2 * S^2 / 2 each
    flops = 2.0 * tokens * ck.layer_numel(i, experts=False) + attention
    if experts and i in ck.moe_layers:
        flops += 2.0 * tokens * cfg.num_experts_per_tok * ck.expert_numel(i)
    return flops


@dataclass
class Plan:
    """What a streamed analysis will read and compute, and how long that should take at this machine's rates (a
    routed expert timed over gathered tokens in the analysis dtype; a stretch of the largest shard read)."""

    read_bytes: int
    flops: float
    read_rate: float  # bytes/s
    flop_rate: float  # FLOP/s

    @property
    def seconds(self) -> float:
        return max(self.read_bytes / self.read_rate, self.flops / self.flop_rate)  # the next read while computing

    @classmethod
    def of(cls, ck: HFCheckpoint, padded, todo: list[Unit]) -> Plan:
        layers = sorted({u.layer for u in todo})
        read = sum(ck.layer_bytes(i) for i in layers)
        flops = sum(layer_flops(ck, i, padded) for i in layers)
        # An expert's rows in one product: a batch's tokens times k, shared among the experts.
        batch = max(int(t.numel()) for t, _ in padded)
        rows = max(8, batch * ck.config.num_experts_per_tok // max(ck.n_experts, 1))
        return cls(read, flops, read_rate(ck), flop_rate(ck, rows))

    def said(self, state: WorkFolder, ck: HFCheckpoint, last: int, units: list[Unit], budget: int) -> str:
        """The plan in one line: the layers up to `last`, the bytes, FLOPs and rates, the time, the work files."""
        chunked = sorted({u.layer for u in units if u.experts is not None})
        return (
            f"streamed plan: layers 0..{last} (of {ck.n_layers}), {state.tokens:,} tokens (padded); "
            f"{gib(self.read_bytes)} to read (~{self.read_rate / 1e6:,.0f} MB/s here), {self.flops / 1e9:,.0f} GFLOP "
            f"of matrix products (~{self.flop_rate / 1e9:,.0f} GFLOP/s in {str(ck.dtype).removeprefix('torch.')}"
            f"); about {_duration(self.seconds)}; work files up to {gib(state.bytes)} in {state.folder} (the hidden "
            f"states, {gib(state.bytes // 6)}, twice, and a layer's parts); weights held within {gib(budget)}"
            + (f", experts read in chunks in layers {chunked}" if chunked else "")
        )


@dataclass
class Timing:
    """Per layer: bytes read and the reading's seconds (in the background), FLOPs and the computing's seconds, and
    the wall time (waiting for the read + computing)."""

    rows: dict[int, list[float]] = field(default_factory=dict)

    def add(self, layer: int, nbytes: int, read_s: float, compute_s: float, flops: float, wall_s: float) -> None:
        row = self.rows.setdefault(layer, [0.0] * 5)
        for j, x in enumerate((nbytes, read_s, compute_s, flops, wall_s)):
            row[j] += x

    def total(self) -> list[float]:
        return [sum(r[j] for r in self.rows.values()) for j in range(5)]

    def totals(self) -> dict[str, float]:
        """The whole run's numbers, by name (the trace's meta.json keeps them)."""
        return dict(zip(("read_bytes", "read_s", "compute_s", "flops", "wall_s"), self.total(), strict=True))

    @staticmethod
    def _said(nbytes, read_s, compute_s, flops, wall_s) -> str:
        bound = max(read_s, compute_s, 1e-9)
        return (f"read {gib(nbytes)} in {read_s:.1f} s ({nbytes / 1e6 / max(read_s, 1e-9):,.0f} MB/s), "
                f"{flops / 1e9:,.1f} GFLOP in {compute_s:.1f} s ({flops / 1e9 / max(compute_s, 1e-9):,.1f} GFLOP/s), "
                f"wall {wall_s:.1f} s = {wall_s / bound:.2f} x max(read, compute)")  # fmt: skip

    def said(self, layer: int) -> str:
        return f"layer {layer}: " + self._said(*self.rows[layer])

    def summary(self, plan: Plan) -> str:
        total = self.total()
        return f"streamed in {_duration(total[4])} (planned {_duration(plan.seconds)}): " + self._said(*total)


def read_rate(ck: HFCheckpoint, probe: int = 128 * 2**20) -> float:
    """Bytes/s of reading the checkpoint's largest shard (a stretch of it; faster where the OS caches it)."""
    shard = max(set(ck.weights.files.files.values()), key=lambda f: f.stat().st_size)
    t0, n = time.perf_counter(), 0
    with open(shard, "rb", buffering=0) as f:
        f.seek(max(0, shard.stat().st_size // 2 - probe // 2))
        while n < probe and (chunk := f.read(16 * 2**20)):
            n += len(chunk)
    return n / max(time.perf_counter() - t0, 1e-9)


def flop_rate(ck: HFCheckpoint, rows: int, probes: int = 7, seconds: float = 0.1) -> float:
    """FLOP/s of this machine running one routed expert (SwiGLU) over `rows` tokens gathered from and added back into
    a larger batch, in the analysis dtype: the work the streamed analysis does most, with the gathers and the
    activation that a bare matrix product leaves out (a bare product overstates the rate about 1.4x). The median of
    `probes` short timings: on a shared machine one timing varies by half."""
    cfg = ck.config
    hidden, inter = cfg.hidden_size, declared(cfg, "moe_intermediate_size") or cfg.intermediate_size
    batch = torch.randn(4 * rows, hidden).to(ck.dtype)
    out = torch.zeros_like(batch)
    rows_of = torch.randperm(4 * rows)[:rows]
    gate_up, down = torch.randn(2 * inter, hidden).to(ck.dtype), torch.randn(hidden, inter).to(ck.dtype)

    def expert() -> None:
        gate, up = torch.nn.functional.linear(batch.index_select(0, rows_of), gate_up).chunk(2, -1)
        out.index_add_(0, rows_of, torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down))

    expert()  # warm-up
    rates = []
    for _ in range(probes):
        t0, n = time.perf_counter(), 0
        while (elapsed := time.perf_counter() - t0) < seconds or n < 2:
            expert()
            n += 1
        rates.append(6.0 * rows * hidden * inter * n / elapsed)
    return float(np.median(rates))


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"
