"""A transformers MoE checkpoint larger than memory, run one layer over every window (docs/analytics.md, "Models
larger than memory"): a LayerwiseModel (moe_lm/routing/routed_model.py).

    embed every window --> for each layer: read it (its routed experts a chunk at a time when the layer does not
    fit), run it over every window, record what its router chose --> final norm and head (log-probs)

Every window's hidden states live in files beside the report (memory-mapped: in memory where it has room), two of
them taking turns, so that a layer's input is intact until its output is complete. Each finished layer is noted
with what it chose (`progress.json`, `experts_L*.npy`; the work folder: stream_work.py): the same command resumes
from the first unfinished layer.
The next unit of weights is read while this one computes.

The same windows, batches and padding as the in-memory recorder (recording.py), the same transformers modules
(hf_layers.py) and the same expert loop, in the same order: a model that fits both ways gives the same bits.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from moe_lm.analysis.stream_work import WorkFolder
from moe_lm.errors import UserError, shown
from moe_lm.files import gib
from moe_lm.interop.hf_layers import HFCheckpoint, experts_deferred, windows_at_once
from moe_lm.routing.recorder import gate_choices
from moe_lm.routing.routed_model import LayerSink, Window

LOGITS_BYTES = 64 * 2**20  # the head's logits made at once


@dataclass
class Unit:
    """What is read at once: a layer's own weights (with all its experts when they fit), or a chunk of its experts."""

    layer: int
    experts: list[int] | None  # None: the layer's own weights (`whole`: its experts too)
    whole: bool = False


class StreamedModel:
    """`checkpoint` run a layer at a time within `budget` bytes of weights, up to layer `last` (None: all of them,
    with the log-probs), its work files in `work`."""

    def __init__(self, checkpoint: HFCheckpoint, budget: int, work: Path, last: int | None = None) -> None:
        self.ck, self.budget, self.work = checkpoint, budget, Path(work)
        if last is not None and last not in checkpoint.moe_layers:  # why now: else refused after every layer ran
            raise UserError(f"--layers {last}: {checkpoint.folder} has no MoE layer {last} (its MoE layers: "
                            f"{shown(checkpoint.moe_layers)})")  # fmt: skip
        self.last = checkpoint.n_layers - 1 if last is None else last
        self.layers = [i for i in checkpoint.moe_layers if i <= self.last]
        cfg = checkpoint.config
        self.n_experts, self.k = checkpoint.n_experts, cfg.num_experts_per_tok
        self.gives = frozenset({"weights", "logprob"} if self.last == checkpoint.n_layers - 1 else {"weights"})
        self.units = plan_units(checkpoint, self.last, budget)

    # ---- the run ------------------------------------------------------------------------------------------------

    def route_layers(self, batches: list[list[Window]], sink: LayerSink) -> np.ndarray | None:
        padded = [_padded(b) for b in batches]
        state = WorkFolder(self.work, self._key(padded), padded, self.ck.config.hidden_size, self.ck.dtype)
        done = state.done()
        todo = [u for u in self.units if u.layer not in done]
        plan = Plan.of(self, padded, todo)
        print(plan.said(state, self))
        if done:
            print(f"resuming the streamed analysis: layers 0..{done[-1]} finished before, kept in {state.folder}")
        else:
            self._embed(state, padded)
        timing = Timing()
        reader = ThreadPoolExecutor(max_workers=1)
        bar = tqdm(total=self.last + 1, initial=len(done), unit="layer", desc=f"layers over {state.tokens:,} tokens")
        try:
            loading = reader.submit(self._read, todo[0]) if todo else None
            for n, unit in enumerate(todo):
                t0 = time.perf_counter()
                weights, read_s = loading.result()
                waited = time.perf_counter() - t0
                loading = reader.submit(self._read, todo[n + 1]) if n + 1 < len(todo) else None  # the next, meanwhile
                finished, compute_s, flops = self._run(unit, weights, state, padded)
                del weights
                timing.add(unit.layer, self._bytes(unit), read_s, compute_s, flops, waited + compute_s)
                if finished:
                    tqdm.write(timing.said(unit.layer))
                    bar.update(1)
        finally:
            bar.close()
            reader.shutdown(wait=True, cancel_futures=True)
        for layer in self.layers:
            experts, weights = state.routing(layer)
            sink.write_layer(layer, experts, weights)
        logprob = self._logprobs(state, padded, batches) if "logprob" in self.gives else None
        if logprob is None:
            print(f"log-probs not recorded: --layers stops at layer {self.last} of {self.ck.n_layers - 1}")
        if todo:
            print(timing.summary(plan))
        self.timing = {**timing.totals(), "planned_s": plan.seconds, "layers_resumed": len(done)}
        return logprob

    def _key(self, padded) -> str:
        """What the analysis computes from, hashed: the checkpoint's files (where they are, and which: a release
        downloaded again or another model copied over it is other weights), dtype, last layer, seed, and every batch's
        shape, window lengths and tokens (the same tokens in windows of another length are another analysis)."""
        h = hashlib.sha256()
        h.update(json.dumps([str(self.ck.folder.resolve()), _files_identity(self.ck), str(self.ck.dtype), self.last,
                             getattr(self.ck, "seed", None)]).encode())  # fmt: skip
        for tokens, lengths in padded:
            h.update(json.dumps([list(tokens.shape), lengths]).encode())
            h.update(tokens.numpy().tobytes())
        return h.hexdigest()[:16]

    def _read(self, unit: Unit):
        t0 = time.perf_counter()
        if unit.experts is not None:
            weights = self.ck.experts(unit.layer, unit.experts)
        else:
            weights = self.ck.layer(unit.layer, experts=unit.whole)
        return weights, time.perf_counter() - t0

    def _bytes(self, unit: Unit) -> int:
        """Bytes a unit reads from the checkpoint."""
        if unit.experts is not None:
            return len(unit.experts) * self.ck.expert_bytes(unit.layer)
        return self.ck.layer_bytes(unit.layer, experts=unit.whole)

    def _embed(self, state: WorkFolder, padded) -> None:
        embed = self.ck.embed()
        with torch.no_grad():
            for b, (tokens, _) in enumerate(padded):
                state.hidden(b, "in")[:] = embed(tokens)
        del embed

    def _run(self, unit: Unit, weights, state: WorkFolder, padded) -> tuple[bool, float, float]:
        """Run one unit: (whether its layer is finished, seconds, its matrix products' FLOPs)."""
        t0 = time.perf_counter()
        finished = False
        with torch.no_grad():
            if unit.experts is not None:
                rows = run_experts(weights, unit, state, padded, self.ck)
                flops = 2.0 * rows * self.ck.expert_numel(unit.layer)
                finished = unit.experts[-1] == self.n_experts - 1  # the layer's last chunk: its output is complete
                if finished:
                    for b in range(len(padded)):
                        state.finish_batch(b)
            else:
                run_layer(weights, unit, state, padded, self.ck, self._rotary())
                flops = layer_flops(self.ck, unit.layer, padded, experts=unit.whole)
                finished = unit.whole
        if finished:
            state.finish(unit.layer)
        return finished, time.perf_counter() - t0, flops

    def _rotary(self):
        if not hasattr(self, "_rot"):
            self._rot = self.ck.rotary()
        return self._rot

    def _logprobs(self, state: WorkFolder, padded, batches) -> np.ndarray:
        """Every window's log-probs from the last layer's output, the head's logits made a stretch of positions at a
        time (DeepSeek-V3's vocabulary of 129,280 makes a 1,024-token window's logits half a GB)."""
        norm, head = self.ck.head()
        rows = max(1, LOGITS_BYTES // (4 * self.ck.config.vocab_size))
        out = []
        with torch.no_grad():
            for b, (tokens, lengths) in enumerate(padded):
                hidden = state.hidden(b, "in")
                for i, n in enumerate(lengths):
                    picked = [np.array([np.nan])]
                    for a in range(0, n - 1, rows):
                        logits = head(norm(hidden[i, a : min(a + rows, n - 1)])).float()
                        target = tokens[i, a + 1 : a + 1 + len(logits), None]
                        picked.append((logits.gather(-1, target)[:, 0] - torch.logsumexp(logits, -1)).double().numpy())
                    out.append(np.concatenate(picked))
        return np.concatenate(out)


def _files_identity(ck: HFCheckpoint) -> list:
    """Each file of the checkpoint (through its symlinks, as the hub cache lays them out) by size, modification and
    change times and inode: what changes when another file is put in its place."""
    files = sorted({*ck.weights.files.files.values(), ck.folder / "config.json"})
    return [[f.name, s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino] for f in files for s in [f.stat()]]


def layer_flops(ck: HFCheckpoint, i: int, padded, experts: bool = True) -> float:
    """The FLOPs of layer i's matrix products over the padded windows: every weight once per token (2 FLOPs a value),
    the routed experts k times per token, attention's scores and mix over the causal half."""
    cfg = ck.config
    tokens = sum(int(t.numel()) for t, _ in padded)
    heads = cfg.num_attention_heads
    qk = getattr(cfg, "qk_head_dim", None) or getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    v = getattr(cfg, "v_head_dim", None) or qk
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
    def of(cls, model: StreamedModel, padded, todo: list[Unit]) -> Plan:
        ck = model.ck
        layers = sorted({u.layer for u in todo})
        read = sum(ck.layer_bytes(i) for i in layers)
        flops = sum(layer_flops(ck, i, padded) for i in layers)
        # An expert's rows in one product: a batch's tokens times k, shared among the experts.
        batch = max(int(t.numel()) for t, _ in padded)
        rows = max(8, batch * ck.config.num_experts_per_tok // max(ck.n_experts, 1))
        return cls(read, flops, read_rate(ck), flop_rate(ck, rows))

    def said(self, state: WorkFolder, model: StreamedModel) -> str:
        chunked = sorted({u.layer for u in model.units if u.experts is not None})
        return (
            f"streamed plan: layers 0..{model.last} (of {model.ck.n_layers}), {state.tokens:,} tokens (padded); "
            f"{gib(self.read_bytes)} to read (~{self.read_rate / 1e6:,.0f} MB/s here), {self.flops / 1e9:,.0f} GFLOP "
            f"of matrix products (~{self.flop_rate / 1e9:,.0f} GFLOP/s in {str(model.ck.dtype).removeprefix('torch.')}"
            f"); about {_duration(self.seconds)}; work files up to {gib(state.bytes)} in {state.folder} (the hidden "
            f"states, {gib(state.bytes // 6)}, twice, and a layer's parts); weights held within {gib(model.budget)}"
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
    hidden, inter = cfg.hidden_size, getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
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


def _padded(batch: list[Window]) -> tuple[torch.Tensor, list[int]]:
    """A batch's token ids, right-padded with 0 as the in-memory recorder pads them, and each window's length."""
    S = max(len(w.tokens) for w in batch)
    tokens = torch.zeros(len(batch), S, dtype=torch.long)
    for b, w in enumerate(batch):
        tokens[b, : len(w.tokens)] = torch.from_numpy(np.asarray(w.tokens, np.int64))
    return tokens, [len(w.tokens) for w in batch]


def run_layer(layer, unit: Unit, state: WorkFolder, padded, ck: HFCheckpoint, rotary) -> None:
    """Layer `unit.layer` over every batch: attention and router `windows_at_once` windows at a time, a MoE layer's
    routed experts deferred (what they need kept: the residual `h`, the MoE's output without them `y`, their input
    `t`, the choices); in a whole unit, then the experts over each batch at once (transformers' own module, as the
    model run whole calls it) and the layer's output written; else they come in chunks (`run_experts`)."""
    moe = unit.layer in ck.moe_layers
    experts = layer.mlp.experts if moe else None
    gate: dict = {}
    with contextlib.ExitStack() as stack:
        if moe:
            stack.callback(layer.mlp.gate.register_forward_hook(lambda m, a, out: gate.__setitem__("out", out)).remove)
            kept = stack.enter_context(experts_deferred(layer))
        for b, (_, lengths) in enumerate(padded):
            B, S = state.shapes[b][:2]
            position_ids = torch.arange(S)[None]
            cos_sin = rotary(state.hidden(b, "in"), position_ids)
            step = windows_at_once(ck.config, S)
            for j in range(0, B, step):
                rows = slice(j, min(j + step, B))
                out = layer(state.hidden(b, "in")[rows], attention_mask=None, position_ids=position_ids,
                            position_embeddings=cos_sin)  # fmt: skip
                if not moe:
                    state.hidden(b, "out")[rows] = out[0] if isinstance(out, tuple) else out
                    continue
                state.keep_choices(unit.layer, (b, j), *gate_choices(gate["out"]), lengths[rows])
                state.part(b, "h")[rows] = kept["h"]
                state.part(b, "y")[rows] = kept["y"]
                state.keep_expert_input(b, rows, kept["t"], kept["idx"], kept["w"])
            if moe and unit.whole:
                state.finish_batch(b, experts(*state.expert_input(b)).view(state.shapes[b]))
            elif moe:
                state.part(b, "e")[:] = 0  # the experts' sum, added to chunk by chunk


def run_experts(weights, unit: Unit, state: WorkFolder, padded, ck: HFCheckpoint) -> int:
    """A chunk of layer `unit.layer`'s routed experts, each over every token of a batch that chose it, added into
    their sum in increasing expert order, as transformers' experts module does over the batch in a whole layer;
    the (token, expert) rows run."""
    gate_up, down = weights
    act = ck.activation()
    rows = 0
    for b in range(len(padded)):
        t, idx, w = state.expert_input(b)
        final = state.part(b, "e").view(-1, t.shape[-1])
        mask = torch.nn.functional.one_hot(idx, num_classes=ck.n_experts + 1).permute(2, 1, 0)
        for j, e in enumerate(unit.experts):
            if not mask[e].any():
                continue
            top_k_pos, token_idx = torch.where(mask[e])
            rows += len(token_idx)
            g, u = torch.nn.functional.linear(t[token_idx], gate_up[j]).chunk(2, dim=-1)
            h = torch.nn.functional.linear(act(g) * u, down[j])
            h = h * w[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, h.to(final.dtype))
    return rows
