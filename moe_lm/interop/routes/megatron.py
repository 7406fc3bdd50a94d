"""Megatron-Core's router trace (`--moe-routing-trace-path DIR`), recognised, read with the token ids the trainer fed it
and written as Megatron traces.

What Megatron writes (megatron/core/transformer/moe/router_trace.py, read in Megatron-Core 0.19 (tag core_v0.19.0,
5be96267; the file is the same at d98e8a64) and at 059f0f5c; docs/analytics.md, "Routes from serving engines"):
`router_trace_rank{r}.jsonl`, one line per router call, {"step", "stage": "pre_dispatch", "block": "decoder" |
"mtp", "layer", "rank", "num_tokens", "topk", "top_indices" [num_tokens][topk]}. What it does not say, and how it is
read here:

- **No token ids.** The rows are the router's input in Megatron's [sequence, batch] order (row = position x batch +
  sample). The token ids come from the trainer: `tokens_rank{r}.npy` beside each rank's file, the micro-batches'
  `tokens` [micro-batches, batch, sequence] of exactly the traced steps, in the order they ran (docs/analytics.md
  shows the two lines that save them from a training loop).
- **Layer numbering.** `layer` is the index in the model chunk's `decoder.layers` (dense layers count): with
  pipeline stages it restarts at 0 on each stage, so a file's layers must be the served model's MoE layers (one
  stage holding them all), or it is refused.
- **Order.** The hook turns the router's boolean routing map into ids with `nonzero()`: each token's experts in
  ascending id order, not in rank order. A Megatron record is unranked; metrics of the first choice say so.
- **Repeats.** Training steps are the trainer's iterations (`advance_step(iteration)` in training.py's train_step).
  Every micro-batch appends its records to the step, and activation recompute (`--recompute-granularity full`, or
  selective with "moe": moe_layer.py checkpoints the layer, router included) runs the layer's forward again in the
  micro-batch's backward, so the hook records it again. In `forward_backward_no_pipelining`
  (pipeline_parallel/schedules.py) each micro-batch's backward follows its own forward, before the next
  micro-batch's: a layer's records of a step are micro-batch 0, its repeats, micro-batch 1, its repeats, ... The
  number of repeats is told by count, never by content (two micro-batches can route alike: the same batch twice, a
  collapsed router): a layer's records over the trace are the tokens file's micro-batches times its records per
  micro-batch (1, or 2 with recompute; per layer: block recompute covers some layers only).
- **Inference.** Megatron's inference engine traces each forward pass of its dynamic batch (prefill chunks and
  decode tokens of several requests packed, records of every size, layer ids from `layer_number` through
  `record_indices`): no token ids or positions say whose rows they are, so such a trace is refused, named.
- **Ranks.** Data-parallel ranks route their own tokens (each with its tokens file); tensor-parallel ranks
  without sequence parallelism write the same file (read once). A file whose rows are a slice of the batch
  (sequence or context parallelism) is refused: its tokens would lack their context.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from moe_lm.errors import DataError
from moe_lm.files import read_small
from moe_lm.interop.routes.record import (
    Record,
    Sequence,
    capped_lines,
    int_array,
    integer,
    json_value,
    npy_array,
    open_regular,
)
from moe_lm.interop.routes.registry import RouteFormat, register_route_format

TRACE_GLOB = "router_trace_rank*.jsonl"
MTP = "multi-token-prediction layers' routes"
RECOMPUTED = "routes repeated by activation recompute"
FILLER = -1  # the layers a trace does not name, once its routes are put on the decoder-layer axis

Steps = dict[int, dict[int, list[np.ndarray]]]  # step -> decoder layer -> its records' [num_tokens, topk], in order


def is_megatron_trace(path: Path) -> bool:
    """A folder of router_trace_rank*.jsonl, or one such file: a regular file (never a FIFO, which would wait for
    a writer) whose first bytes are a record as the tracer's json.dumps orders its keys (step first)."""
    if path.is_dir():
        return any(path.glob(TRACE_GLOB))
    head = read_small(path, 256, head=True)
    return head is not None and head.startswith('{"step": ') and '"layer": ' in head


def read_megatron_trace(path: Path) -> Record:
    files = sorted(path.glob(TRACE_GLOB)) if path.is_dir() else [path]
    sequences: list[Sequence] = []
    skipped: dict[str, int] = {}
    layers: list[int] | None = None
    seen: set[bytes] = set()
    for file in files:
        steps = _steps(file, skipped)
        _training_trace(file, steps)
        mine = sorted({layer for step in steps.values() for layer in step})
        if layers is not None and mine != layers:
            raise DataError(f"{file}: traces layers {mine}, {files[0].name} traces {layers}: ranks of other pipeline "
                            "stages (give one stage's ranks, the one holding every MoE layer)")  # fmt: skip
        layers = mine
        tokens = _tokens(file)
        mine_sequences = _sequences(file, steps, layers, tokens, skipped)
        digest = _digest(mine_sequences)
        if digest not in seen:  # tensor-parallel ranks write the same file; anything else is read whole
            seen.add(digest)
            sequences += mine_sequences
    if not sequences:
        raise DataError(f"{path}: no decoder layer's routes in it (Megatron writes them with --moe-routing-trace-path)")
    return Record("megatron router trace", sequences, skipped, layers=layers, ranked=False, filler=FILLER)


def _sequences(file: Path, steps: Steps, layers: list[int], tokens: np.ndarray, skipped: dict) -> list[Sequence]:
    """The file's samples in the order they ran: each step's micro-batches, each the first of its records per
    layer (the rest are recompute's repeats), paired with the tokens file's micro-batches in turn."""
    factors = _records_per_micro_batch(file, steps, layers, len(tokens))
    out, used = [], 0
    for step, by_layer in steps.items():
        for m in range(_micro_batches(file, step, by_layer, factors)):
            routes = [by_layer[layer][m * factors[layer]] for layer in layers]
            out += _micro_batch(tokens[used], routes, layers, f"{file}, step {step}, micro-batch {m}")
            used += 1
    repeated = max(factors.values()) - 1
    if repeated:
        skipped[RECOMPUTED] = skipped.get(RECOMPUTED, 0) + repeated * tokens.size
    return out


def _records_per_micro_batch(file: Path, steps: Steps, layers: list[int], micro_batches: int) -> dict[int, int]:
    """Each layer's records per micro-batch: its records over the trace / the tokens file's micro-batches."""
    factors = {}
    for layer in layers:
        records = sum(len(by_layer.get(layer, [])) for by_layer in steps.values())
        if records < micro_batches or records % micro_batches:
            raise DataError(
                f"{file}: layer {layer} has {records} records over its {len(steps)} steps, the tokens file "
                f"{micro_batches} micro-batches: not a whole number of records per micro-batch (1, or 2 with "
                "activation recompute): save the micro-batches of exactly the traced steps, and trace steps without "
                "evaluation"
            )
        factors[layer] = records // micro_batches
    return factors


def _micro_batches(file: Path, step: int, by_layer: dict[int, list], factors: dict[int, int]) -> int:
    """The step's micro-batches: every layer's records / its records per micro-batch, the same for all layers."""
    counts = {layer: len(by_layer.get(layer, [])) for layer in factors}
    n = {layer: c // factors[layer] for layer, c in counts.items()}
    if any(c % factors[layer] for layer, c in counts.items()) or len(set(n.values())) != 1:
        raise DataError(f"{file}, step {step}: layers recorded {counts} records, records per micro-batch "
                        f"{factors}: not the same micro-batches in every layer (the file was cut short, or ranks of "
                        "several stages wrote into it)")  # fmt: skip
    return next(iter(n.values()))


def _training_trace(file: Path, steps: Steps) -> None:
    """A DataError for a trace of Megatron's inference engine: its records are forward passes of every size."""
    sizes = {len(ids) for by_layer in steps.values() for records in by_layer.values() for ids in records}
    if len(sizes) > 1:
        raise DataError(
            f"{file}: records of {len(sizes)} sizes ({min(sizes)} to {max(sizes)} tokens): Megatron's inference trace "
            "(each forward pass of its dynamic engine, several requests' prefill chunks and decode tokens packed, "
            "with neither their ids nor their positions), or micro-batches of other shapes; moe-lm reads training "
            "traces, with the trainer's tokens file"
        )


def _tokens_file(trace: Path) -> Path:
    return trace.with_name(trace.name.replace("router_trace_", "tokens_").replace(".jsonl", ".npy"))


def _tokens(trace: Path) -> np.ndarray:
    """[micro-batches, batch, sequence]: the token ids the trainer fed the rank, from its tokens file."""
    path = _tokens_file(trace)
    if not path.exists():
        raise DataError(f"{trace}: Megatron's trace holds no token ids; save the rank's micro-batches' tokens "
                        f"[micro-batches, batch, sequence] as {path.name} beside it (docs/analytics.md)")  # fmt: skip
    with open_regular(path) as f:
        tokens = npy_array(f, os.fstat(f.fileno()).st_size, "the tokens file", str(path))
    if tokens.ndim != 3 or tokens.size == 0 or tokens.min() < 0:
        raise DataError(f"{path}: {tokens.dtype} {tokens.shape}, not token ids [micro-batches, batch, sequence]")
    return tokens.astype(np.int64)


def _steps(file: Path, skipped: dict) -> Steps:
    """step -> decoder layer -> its records' [num_tokens, topk] in file order (recompute's repeats included)."""
    steps: Steps = {}
    with open_regular(file) as f:
        for n, line in capped_lines(f, file):
            where = f"{file}, line {n}"
            rec = json_value(line, where)
            if not isinstance(rec, dict) or not {"step", "layer", "top_indices"} <= rec.keys():
                raise DataError(f"{where}: not a router trace record (step, layer, top_indices)")
            step, layer = integer(rec["step"], "step", where), integer(rec["layer"], "layer", where)
            if rec.get("block", "decoder") != "decoder":
                skipped[MTP] = skipped.get(MTP, 0) + integer(rec.get("num_tokens", 0), "num_tokens", where)
                continue
            ids = int_array(rec["top_indices"], "top_indices", where, 2)
            if len(ids) != integer(rec.get("num_tokens", len(ids)), "num_tokens", where):
                raise DataError(f"{where}: top_indices holds {len(ids)} rows, num_tokens says {rec['num_tokens']}: "
                                "cut short")  # fmt: skip
            steps.setdefault(step, {}).setdefault(layer, []).append(ids)
    return steps


def _micro_batch(batch: np.ndarray, routes: list[np.ndarray], layers: list[int], where: str) -> list[Sequence]:
    """The micro-batch's samples, each [sequence] with its routes [sequence, traced layers, k]: the router's rows are
    [sequence, batch] (row = position x batch + sample)."""
    b, s = batch.shape
    for layer, ids in zip(layers, routes, strict=True):
        if len(ids) != b * s:
            raise DataError(f"{where}: {len(ids)} routed rows, the micro-batch of its tokens file holds {b} x {s} "
                            "tokens: another micro-batch's, or a slice (sequence or context parallelism: record "
                            "without it)")  # fmt: skip
        if ids.shape[1] != routes[0].shape[1]:
            raise DataError(f"{where}: layer {layer} routes top-{ids.shape[1]}, layer {layers[0]} top-"
                            f"{routes[0].shape[1]}: one model routes every layer to as many experts")  # fmt: skip
    stacked = np.stack([ids.reshape(s, b, -1) for ids in routes], axis=2)  # [s, b, layers, k]
    return [Sequence(batch[i], stacked[:, i]) for i in range(b)]


def _digest(sequences: list[Sequence]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for s in sequences:
        h.update(s.tokens.tobytes())
        h.update(s.routes.tobytes())
    return h.digest()


# ---- writer: a moe-lm trace's windows as Megatron traces them (tests, conversions) --------------------------------


def megatron_trace(folder: Path, batches: list[tuple[np.ndarray, dict[int, np.ndarray]]], rank: int = 0,
                   recompute: bool = False, per_step: int = 2) -> None:  # fmt: skip
    """Write `batches` (each the micro-batch's tokens [b, s] and per decoder layer its experts [b, s, k]) as rank
    `rank`'s router trace and tokens file: `per_step` micro-batches a step, each layer's ids ascending, rows in
    [sequence, batch] order; with `recompute`, each micro-batch's layers traced again after its forward, last layer
    first (full recompute in its backward, as forward_backward_no_pipelining runs it)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"router_trace_rank{rank}.jsonl", "w") as f:
        for i, (_, experts) in enumerate(batches):
            lines = []
            for layer, ids in experts.items():
                rows = np.sort(ids, axis=-1).transpose(1, 0, 2).reshape(-1, ids.shape[-1])
                rec = {"step": i // per_step, "stage": "pre_dispatch", "block": "decoder", "layer": layer,
                       "rank": rank, "num_tokens": len(rows), "topk": rows.shape[1],
                       "top_indices": rows.tolist()}  # fmt: skip
                lines.append(json.dumps(rec) + "\n")
            f.writelines(lines + (lines[::-1] if recompute else []))
    np.save(folder / f"tokens_rank{rank}.npy", np.stack([t for t, _ in batches]))


class MegatronTrace(RouteFormat):
    name = "megatron router trace"
    looks_like = "Megatron-Core's router trace, router_trace_rank*.jsonl with tokens_rank*.npy, or their folder"
    order = 10  # why first: a folder holding a trace and SGLang dumps is read as the trace (the cheaper glance)

    def recognises(self, path: Path) -> bool:
        return is_megatron_trace(path)

    def read(self, path: Path) -> Record:
        return read_megatron_trace(path)

    def write(self, path: Path, record: Record, batch: int = 1, rank: int = 0, recompute: bool = False) -> None:
        """`record`'s sequences (equal lengths, routes of its `layers` [s, layers, k]) in micro-batches of `batch`,
        two a step, into the folder `path` (megatron_trace)."""
        batches = []
        for i in range(0, len(record.sequences), batch):
            group = record.sequences[i : i + batch]
            experts = {layer: np.stack([s.routes[:, j] for s in group]) for j, layer in enumerate(record.layers)}
            batches.append((np.stack([s.tokens for s in group]), experts))
        megatron_trace(Path(path), batches, rank, recompute)


register_route_format(MegatronTrace())
