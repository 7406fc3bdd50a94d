"""A transformers MoE checkpoint larger than memory, run one layer over every window (docs/analytics.md, "Models
larger than memory"): a RoutedModel (moe_lm/routing/routed_model.py) that records itself layer by layer.

    embed every window --> for each layer: read it (its routed experts a chunk at a time when the layer does not
    fit), run it over every window, record what its router chose --> final norm and head (log-probs)

Every window's hidden states live in files beside the report (memory-mapped: in memory where it has room), two of
them taking turns, so that a layer's input is intact until its output is complete. Each finished layer is noted
with what it chose and its chosen experts' output norms, REAP's ‖f_j(t)‖ (`progress.json`, `experts_L*.npy`,
`norms_L*.npy`; the work folder: stream_work.py): the same command resumes
from the first unfinished layer. The next unit of weights is read while this one computes. The plan and the rates it
is timed by: stream_plan.py; the layer and expert passes: stream_passes.py.

The same windows, batches and padding as the in-memory recorder (recording.py), the same transformers modules
(hf_layers.py) and the same expert loop, in the same order: a model that fits both ways gives the same bits.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from moe_lm.analysis.stream_passes import padded_batch, run_experts, run_layer
from moe_lm.analysis.stream_plan import Plan, Timing, Unit, layer_flops, plan_units, unit_bytes
from moe_lm.analysis.stream_work import WorkFolder
from moe_lm.errors import UserError, shown
from moe_lm.interop.hf_layers import HFCheckpoint
from moe_lm.routing.routed_model import OpenBar, TraceSink, Window, window_columns

LOGITS_BYTES = 64 * 2**20  # the head's logits made at once
WORK_FORMAT = 2  # what a finished layer keeps: 2, its choices and its chosen experts' output norms


class StreamedModel:
    """`checkpoint` run a layer at a time within `budget` bytes of weights, up to layer `last` (None: all of them,
    with the log-probs), its work files in `work`; `seed`: an untrained twin's (its weights are made from it, so its
    work is another analysis's)."""

    ranked = True

    def __init__(self, checkpoint: HFCheckpoint, budget: int, work: Path, last: int | None = None,
                 seed: int | None = None) -> None:  # fmt: skip
        self.ck, self.budget, self.work, self.seed = checkpoint, budget, Path(work), seed
        if last is not None and last not in checkpoint.moe_layers:  # why now: else refused after every layer ran
            raise UserError(f"--layers {last}: {checkpoint.folder} has no MoE layer {last} (its MoE layers: "
                            f"{shown(checkpoint.moe_layers)})")  # fmt: skip
        self.last = checkpoint.n_layers - 1 if last is None else last
        self.layers = [i for i in checkpoint.moe_layers if i <= self.last]
        cfg = checkpoint.config
        self.n_experts, self.k = checkpoint.n_experts, cfg.num_experts_per_tok
        self.gives = frozenset({"weights", "norms", *(["logprob"] if self.last == checkpoint.n_layers - 1 else [])})
        self.units = plan_units(checkpoint, self.last, budget)

    # ---- the RoutedModel contract ---------------------------------------------------------------------------------

    def record_into(self, batches: Iterable[list[Window]], sink: TraceSink, progress: OpenBar) -> dict:
        """Every window through each layer in turn (its own progress bar, by layer), each MoE layer's rows written as
        the layers end, then the token columns with the log-probs."""
        batches = list(batches)
        logprob, timing = self._route_layers(batches, sink)
        sink.append_tokens(*window_columns([w for batch in batches for w in batch]), logprob)
        return {"streamed": timing}

    def windows_per_pass(self, batch_size: int, window_length: int, vocab_size: int) -> int:
        # why whole: its log-probs are made a few windows at a time, and a routed expert's product has the batch's
        # rows that chose it (DeepSeek-V3: 512 of 16 windows, 64 of the 2 the logits would allow)
        return batch_size

    def reroutable(self) -> None:
        return None  # its routers are never in memory together: nothing to route around

    # ---- the run ------------------------------------------------------------------------------------------------

    def _route_layers(self, batches: list[list[Window]], sink: TraceSink) -> tuple[np.ndarray | None, dict]:
        """Each MoE layer's choices into `sink`; (the windows' log-probs, or None when the last layers were not run;
        the timing the trace keeps)."""
        padded = [padded_batch(b) for b in batches]
        state = WorkFolder(self.work, self._key(padded), padded, self.ck.config.hidden_size, self.ck.dtype)
        done = state.done()
        todo = [u for u in self.units if u.layer not in done]
        plan = Plan.of(self.ck, padded, todo)
        print(plan.said(state, self.ck, self.last, self.units, self.budget))
        if done:
            print(f"resuming the streamed analysis: layers 0..{done[-1]} finished before, kept in {state.folder}")
        else:
            self._embed(state, padded)
        timing = self._run_units(todo, state, padded, initial=len(done))
        for layer in self.layers:
            experts, weights, norms = state.routing(layer)
            sink.write_layer(layer, experts, weights, norms=norms)
        logprob = self._logprobs(state, padded, batches) if "logprob" in self.gives else None
        if logprob is None:
            print(f"log-probs not recorded: --layers stops at layer {self.last} of {self.ck.n_layers - 1}")
        if todo:
            print(timing.summary(plan))
        return logprob, {**timing.totals(), "planned_s": plan.seconds, "layers_resumed": len(done)}

    def _run_units(self, todo: list[Unit], state: WorkFolder, padded, initial: int) -> Timing:
        """Each unit read in a background thread while the one before computes; a line per finished layer."""
        timing = Timing()
        reader = ThreadPoolExecutor(max_workers=1)
        bar = tqdm(total=self.last + 1, initial=initial, unit="layer", desc=f"layers over {state.tokens:,} tokens")
        try:
            loading = reader.submit(self._read, todo[0]) if todo else None
            for n, unit in enumerate(todo):
                t0 = time.perf_counter()
                weights, read_s = loading.result()
                waited = time.perf_counter() - t0
                loading = reader.submit(self._read, todo[n + 1]) if n + 1 < len(todo) else None  # the next, meanwhile
                finished, compute_s, flops = self._run(unit, weights, state, padded)
                del weights
                timing.add(unit.layer, unit_bytes(self.ck, unit), read_s, compute_s, flops, waited + compute_s)
                if finished:
                    tqdm.write(timing.said(unit.layer))
                    bar.update(1)
        finally:
            bar.close()
            reader.shutdown(wait=True, cancel_futures=True)
        return timing

    def _key(self, padded) -> str:
        """What the analysis computes from, hashed: the checkpoint's files (where they are, and which: a release
        downloaded again or another model copied over it is other weights), dtype, last layer, seed, and every batch's
        shape, window lengths and tokens (the same tokens in windows of another length are another analysis)."""
        h = hashlib.sha256()
        # why WORK_FORMAT: a folder an earlier version left (finished layers without their norms) is started over
        h.update(json.dumps([str(self.ck.folder.resolve()), _files_identity(self.ck), str(self.ck.dtype), self.last,
                             self.seed, WORK_FORMAT]).encode())  # fmt: skip
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
                run_layer(weights, unit, state, padded, self.ck, self._rotary)
                flops = layer_flops(self.ck, unit.layer, padded, experts=unit.whole)
                finished = unit.whole
        if finished:
            state.finish(unit.layer)
        return finished, time.perf_counter() - t0, flops

    @functools.cached_property
    def _rotary(self):
        return self.ck.rotary()

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
