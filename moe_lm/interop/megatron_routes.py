"""Megatron-Core's router trace (`--moe-routing-trace-path DIR`), read with the token ids the trainer fed it.

What Megatron writes (megatron/core/transformer/moe/router_trace.py, read at 059f0f5c; docs/analytics.md, "Routes
from serving engines"): `router_trace_rank{r}.jsonl`, one line per router call, {"step", "stage": "pre_dispatch",
"block": "decoder" | "mtp", "layer", "rank", "num_tokens", "topk", "top_indices" [num_tokens][topk]}. What it does
not say, and how it is read here:

- **No token ids.** The rows are the router's input in Megatron's [sequence, batch] order (row = position x batch +
  sample). The token ids come from the trainer: `tokens_rank{r}.npy` beside each rank's file, the micro-batches'
  `tokens` [micro-batches, batch, sequence] in the order they ran (docs/analytics.md shows the two lines that save
  them from a training loop).
- **Layer numbering.** `layer` is the index in the model chunk's `decoder.layers` (dense layers count): with
  pipeline stages it restarts at 0 on each stage, so a file's layers must be the served model's MoE layers (one
  stage holding them all), or it is refused.
- **Order.** The hook turns the router's boolean routing map into ids with `nonzero()`: each token's experts in
  ascending id order, not in rank order. A Megatron record is unranked; metrics of the first choice say so.
- **Repeats.** Every micro-batch appends its records to the step, and activation recompute appends the same
  records again: within a step and layer, a record equal to an earlier one is its recompute and read once; the
  records left, in order, are the step's micro-batches.
- **Ranks.** Data-parallel ranks route their own tokens (each with its tokens file); tensor-parallel ranks
  without sequence parallelism record the same rows (read once). A file whose rows are a slice of the batch
  (sequence or context parallelism) is refused: its tokens would lack their context.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from moe_lm.errors import DataError
from moe_lm.interop.route_records import Record, Sequence

TRACE_GLOB = "router_trace_rank*.jsonl"
MTP = "multi-token-prediction layers' routes"
RECOMPUTED = "routes repeated by activation recompute"
UNUSED = "micro-batches of the tokens files after the traced steps"


def is_megatron_trace(path: Path) -> bool:
    """A folder of router_trace_rank*.jsonl, or one such file: a regular file (never a FIFO, which would wait for
    a writer) whose first bytes are a record as the tracer's json.dumps orders its keys (step first)."""
    if path.is_dir():
        return any(path.glob(TRACE_GLOB))
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return False
    return head.startswith(b'{"step": ') and b'"layer": ' in head


def read_megatron_trace(path: Path) -> Record:
    files = sorted(path.glob(TRACE_GLOB)) if path.is_dir() else [path]
    sequences: list[Sequence] = []
    skipped: dict[str, int] = {}
    layers: list[int] | None = None
    seen: set[bytes] = set()
    for file in files:
        tokens = _tokens(file)
        steps = _steps(file, skipped)
        mine = sorted({layer for step in steps.values() for layer in step})
        if layers is not None and mine != layers:
            raise DataError(f"{file}: traces layers {mine}, {files[0].name} traces {layers}: ranks of other pipeline "
                            "stages (give one stage's ranks, the one holding every MoE layer)")  # fmt: skip
        layers = mine
        used = 0
        for step, by_layer in steps.items():
            counts = {layer: len(records) for layer, records in by_layer.items()}
            if len(set(counts.values())) > 1 or set(by_layer) != set(layers):
                raise DataError(f"{file}, step {step}: layers recorded unequal numbers of micro-batches {counts}: the "
                                "file was cut short, or ranks of several stages wrote into it")  # fmt: skip
            for m in range(next(iter(counts.values()))):
                if used == len(tokens):
                    raise DataError(f"{_tokens_file(file)}: {len(tokens)} micro-batches, but {file.name} traces "
                                    f"more (step {step} needs one more): save every micro-batch the traced steps "
                                    "ran")  # fmt: skip
                batch = tokens[used]
                routes = [by_layer[layer][m] for layer in layers]
                for s in _micro_batch(batch, routes, f"{file}, step {step}, micro-batch {m}"):
                    key = s.tokens.tobytes() + s.routes.tobytes()
                    if key not in seen:  # tensor-parallel ranks route the same rows
                        seen.add(key)
                        sequences.append(s)
                used += 1
        if used < len(tokens):
            skipped[UNUSED] = skipped.get(UNUSED, 0) + (len(tokens) - used) * tokens[0].size
    if not sequences:
        raise DataError(f"{path}: no decoder layer's routes in it (Megatron writes them with --moe-routing-trace-path)")
    return Record("megatron router trace", sequences, skipped, layers=layers, ranked=False)


def _tokens_file(trace: Path) -> Path:
    return trace.with_name(trace.name.replace("router_trace_", "tokens_").replace(".jsonl", ".npy"))


def _tokens(trace: Path) -> np.ndarray:
    """[micro-batches, batch, sequence]: the token ids the trainer fed the rank, from its tokens file."""
    path = _tokens_file(trace)
    if not path.is_file():
        raise DataError(f"{trace}: Megatron's trace holds no token ids; save the rank's micro-batches' tokens "
                        f"[micro-batches, batch, sequence] as {path.name} beside it (docs/analytics.md)")  # fmt: skip
    try:
        tokens = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"{path}: not a .npy file ({e})") from None
    if tokens.ndim != 3 or not np.issubdtype(tokens.dtype, np.integer) or tokens.size == 0 or tokens.min() < 0:
        raise DataError(f"{path}: {tokens.dtype} {tokens.shape}, not token ids [micro-batches, batch, sequence]")
    return tokens.astype(np.int64)


def _steps(file: Path, skipped: dict) -> dict[int, dict[int, list[np.ndarray]]]:
    """step -> decoder layer -> its records' [num_tokens, topk] in file order, recompute's repeats dropped."""
    steps: dict[int, dict[int, list[np.ndarray]]] = {}
    seen: set[tuple[int, int, bytes]] = set()  # (step, layer, digest of the rows): a set, not a scan of the records
    with open(file, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{file}, line {n}"
            try:
                rec = json.loads(line)
                step, layer, rows = int(rec["step"]), int(rec["layer"]), rec["top_indices"]
            except (ValueError, KeyError, TypeError) as e:
                raise DataError(f"{where}: not a router trace record (step, layer, top_indices): {e}") from None
            if rec.get("block", "decoder") != "decoder":
                skipped[MTP] = skipped.get(MTP, 0) + int(rec.get("num_tokens", 0))
                continue
            try:
                ids = np.asarray(rows, dtype=np.int64)
            except (ValueError, TypeError):
                ids = np.empty(0)
            if ids.ndim != 2 or len(ids) != rec.get("num_tokens", len(ids)):
                raise DataError(f"{where}: top_indices is not {rec.get('num_tokens')} rows of top-k expert ids: cut "
                                "short")  # fmt: skip
            key = (step, layer, hashlib.blake2b(ids.tobytes() + str(ids.shape).encode(), digest_size=16).digest())
            if key in seen:
                skipped[RECOMPUTED] = skipped.get(RECOMPUTED, 0) + len(ids)
                continue
            seen.add(key)
            steps.setdefault(step, {}).setdefault(layer, []).append(ids)
    return steps


def _micro_batch(batch: np.ndarray, routes: list[np.ndarray], where: str) -> list[Sequence]:
    """The micro-batch's samples, each [sequence] with its routes [sequence, traced layers, k]: the router's rows are
    [sequence, batch] (row = position x batch + sample)."""
    b, s = batch.shape
    for ids in routes:
        if len(ids) != b * s:
            raise DataError(f"{where}: {len(ids)} routed rows, the micro-batch of its tokens file holds {b} x {s} "
                            "tokens: another micro-batch's, or a slice (sequence or context parallelism: record "
                            "without it)")  # fmt: skip
    stacked = np.stack([ids.reshape(s, b, -1) for ids in routes], axis=2)  # [s, b, layers, k]
    return [Sequence(batch[i], stacked[:, i]) for i in range(b)]


# ---- writer: a moe-lm trace's windows as Megatron traces them (tests, conversions) --------------------------------


def megatron_trace(folder: Path, batches: list[tuple[np.ndarray, dict[int, np.ndarray]]], rank: int = 0,
                   recompute: bool = False, per_step: int = 2) -> None:  # fmt: skip
    """Write `batches` (each the micro-batch's tokens [b, s] and per decoder layer its experts [b, s, k]) as rank
    `rank`'s router trace and tokens file: `per_step` micro-batches a step, each layer's ids ascending, rows in
    [sequence, batch] order, a recompute record after each when `recompute`."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"router_trace_rank{rank}.jsonl", "w") as f:
        for i, (_, experts) in enumerate(batches):
            for layer, ids in experts.items():
                rows = np.sort(ids, axis=-1).transpose(1, 0, 2).reshape(-1, ids.shape[-1])
                rec = {"step": i // per_step, "stage": "pre_dispatch", "block": "decoder", "layer": layer,
                       "rank": rank, "num_tokens": len(rows), "topk": rows.shape[1],
                       "top_indices": rows.tolist()}  # fmt: skip
                f.write(json.dumps(rec) + "\n")
                if recompute:
                    f.write(json.dumps(rec) + "\n")
    np.save(folder / f"tokens_rank{rank}.npy", np.stack([t for t, _ in batches]))
