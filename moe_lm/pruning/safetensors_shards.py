"""A DeepSeek-V3-layout safetensors folder written again without the pruned routed experts, a shard at a time and
byte for byte: what hf_folder.py (transformers exports) and fp8_release.py (DeepSeek's FP8 releases) both write.

Every tensor is copied as the bytes it is stored as, never decoded: the same code serves float32, bf16 and
float8_e4m3fn with its `weight_scale_inv` block scales, and a 680 GB release is read and written in pieces of
COPY_BYTES (no shard is held in memory). Per MoE layer N (a layer with a router, `model.layers.N.mlp.gate.weight`):
    mlp.experts.J.<anything>        kept J renamed to its new id (weights and FP8 scales alike), pruned J left out
    mlp.experts.<stacked>           transformers' stacked layout ([E, 2I, D] gate_up_proj, [E, D, I] down_proj):
                                    the kept experts' slices (the expert axis is outermost: one byte range each)
    mlp.gate.weight, .e_score_correction_bias   the kept experts' rows / entries (row-major: one byte range each)
Everything else (attention, dense layers, shared experts, norms, embeddings) is copied unchanged. Each source shard
becomes the shard of the same name (one left empty is not written), `model.safetensors.index.json` is rewritten with
the new weight map and total size, config.json gets the new expert count (`n_routed_experts`; Qwen3-MoE's
`num_experts` or `num_local_experts`), and the other files (tokenizer,
generation config, code, READMEs) are copied, except hidden ones and other weight files (.bin, .pt, .pth, .gguf).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from moe_lm.errors import UserError
from moe_lm.files import open_regular
from moe_lm.interop.safetensors_folder import INDEX, SafetensorsFolder
from moe_lm.pruning.kept_experts import KeptExperts, checked_keep
from moe_lm.pruning.output import pruned_output

COPY_BYTES = 64 * 2**20  # read and written at a time
ROUTER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate\.\w+$")
EXPERT = re.compile(r"^(.*(?:^|\.)layers\.(\d+)\.mlp\.experts\.)(\d+)(\..+)$")
STACKED = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.[A-Za-z_]\w*$")
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# config.json's count of routed experts, by model type (formats.py says which types a pruned copy is exact for):
# Qwen3-MoE's releases name it num_experts, transformers 5 writes num_local_experts
EXPERT_COUNT = {"deepseek_v3": ("n_routed_experts",), "glm4_moe": ("n_routed_experts",),
                "qwen3_moe": ("num_experts", "num_local_experts")}  # fmt: skip
Range = tuple[int, int]  # (offset in the source file, bytes)


def moe_layers(names: list[str]) -> list[int]:
    """The layers with a router (`layers.N.mlp.gate.weight`), MTP layers included."""
    return sorted({int(m[1]) for n in names if n.endswith(".mlp.gate.weight") and (m := ROUTER.search(n))})


def folder_routing(source: Path, config: dict, fix: str) -> tuple[int, int, int, int, list[int]]:
    """(routed experts, experts per token, expert groups, groups used, the MoE layers: MTP ones included) of a
    DeepSeek-V3-layout folder, from its config.json (`config`) and its safetensors headers; a one-line UserError."""
    count = expert_count_key(config)
    E, top_k = config.get(count), config.get("num_experts_per_tok")
    if type(E) is not int or E < 1 or type(top_k) is not int:
        raise UserError(f"{source / 'config.json'} has no {count} and num_experts_per_tok: not a MoE checkpoint "
                        f"of the types prune writes ({', '.join(EXPERT_COUNT)})")  # fmt: skip
    n_group = config.get("n_group") or 1
    layers = moe_layers(SafetensorsFolder(source, fix).names())
    if not layers:
        raise UserError(f"{source}: no routed experts (no model.layers.N.mlp.gate.weight in its safetensors); {fix}")
    return E, top_k, n_group, config.get("topk_group") or n_group, layers


def expert_count_key(config: dict) -> str:
    """The key of config.json's routed-expert count: the first of its type's names it holds (DeepSeek-V3's name for a
    type not listed)."""
    names = EXPERT_COUNT.get(config.get("model_type"), ("n_routed_experts",))
    return next((name for name in names if name in config), names[0])


def prune_folder(source: Path, out: Path, keep: Mapping[int, Sequence[int]], config: dict, fix: str,
                 extras: Callable[[Path], None] | None = None, ungroup: bool = False) -> Path:  # fmt: skip
    """`source` (its safetensors beside `config`, its config.json) written to the new folder `out` with only the kept
    experts (module docstring); `fix` ends the errors about the source; `extras(folder)` writes more files into the
    folder before it is put in place (moe-lm prune's prune.json); `ungroup`: the copy routes without expert groups
    (n_group and topk_group 1), so any `keep` of at least top-k experts a layer is valid. Returns `out`."""
    E, top_k, n_group, topk_group, layers = folder_routing(source, config, fix)
    groups = {"n_group": 1, "topk_group": 1} if ungroup else {}
    files = SafetensorsFolder(source, fix)
    kept = checked_keep(keep, layers, E, top_k, *((1, 1) if ungroup else (n_group, topk_group)), source / "config.json")
    plans = {file: _shard_plan(files, names, kept, fix) for file, names in _by_file(files).items()}
    others = _other_files(source, set(plans))
    needed = sum(n for plan in plans.values() for *_, ranges in plan for _, n in ranges)
    place = pruned_output(source, out)
    with place.staged(needed + sum(_size(p) for p in others)) as stage:
        weight_map, total = {}, 0
        for file, plan in plans.items():
            if plan:
                name = str(file.relative_to(source))
                total += _write_shard(file, stage / name, plan)
                weight_map.update(dict.fromkeys((new for new, *_ in plan), name))
        if (source / INDEX).is_file():
            index = json.loads((source / INDEX).read_text())
            index["metadata"] = {**(index.get("metadata") or {}), "total_size": total}
            index["weight_map"] = dict(sorted(weight_map.items()))
            (stage / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        config = {**config, expert_count_key(config): kept.count, **groups}
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for path in others:
            _copy(path, stage / path.name)
        if extras is not None:
            extras(stage)
    return out


def _by_file(files: SafetensorsFolder) -> dict[Path, list[str]]:
    """Tensor names by shard, each shard's in the order of its bytes (read front to back)."""
    by_file: dict[Path, list[str]] = {}
    for name in files.names():
        files.dtype(name)  # why: each header checked by SafetensorsFolder (truncation, offsets) before it is read here
        by_file.setdefault(files.files[name], []).append(name)
    headers = {file: _read_header(file)[1] for file in by_file}
    return {file: sorted(names, key=lambda n: headers[file][n]["data_offsets"][0]) for file, names in by_file.items()}


def _shard_plan(files: SafetensorsFolder, names: list[str], kept: KeptExperts, fix: str) -> list[tuple]:
    """What one shard becomes: (name, dtype, shape, [byte ranges of the source file]) per tensor written."""
    file = files.files[names[0]]
    start, header = _read_header(file)
    plan = []
    for name in names:
        entry = header[name]
        shape, (begin, end) = list(entry["shape"]), entry["data_offsets"]
        begin, end = start + begin, start + end
        if (m := EXPERT.match(name)) and int(m[2]) in kept.ids:
            new = kept.new_id(int(m[2]), int(m[3]))
            if new is not None:
                plan.append((f"{m[1]}{new}{m[4]}", entry["dtype"], shape, [(begin, end - begin)]))
            continue
        m = ROUTER.search(name) or STACKED.search(name)
        if m is None or int(m[1]) not in kept.ids:
            plan.append((name, entry["dtype"], shape, [(begin, end - begin)]))
            continue
        if not shape or shape[0] != kept.n_experts:
            raise UserError(f"{file}: {name} has shape {shape}, not one row per routed expert ({kept.n_experts}, "
                            f"n_routed_experts in config.json): it cannot be pruned by rows; {fix}")  # fmt: skip
        row = (end - begin) // kept.n_experts
        plan.append((name, entry["dtype"], [kept.count, *shape[1:]], _runs(kept.ids[int(m[1])], begin, row)))
    return plan


def _runs(rows: Sequence[int], begin: int, row: int) -> list[Range]:
    """The byte ranges of `rows` (ascending) of a row-major tensor at `begin`, adjacent rows in one range."""
    ranges: list[Range] = []
    for r in rows:
        at = begin + r * row
        if ranges and sum(ranges[-1]) == at:
            ranges[-1] = (ranges[-1][0], ranges[-1][1] + row)
        else:
            ranges.append((at, row))
    return ranges


def _read_header(file: Path) -> tuple[int, dict]:
    """(where the tensors' bytes begin, the parsed header) of a safetensors file SafetensorsFolder has checked."""
    with open_regular(file) as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def _write_shard(source: Path, out: Path, plan: list[tuple]) -> int:
    """A safetensors file of `plan`'s tensors, each copied from `source`'s byte ranges, the source's `__metadata__`
    kept; returns the tensors' bytes."""
    start, header = _read_header(source)
    new: dict[str, dict] = {"__metadata__": header["__metadata__"]} if "__metadata__" in header else {}
    at = 0
    for name, dtype, shape, ranges in plan:
        n = sum(length for _, length in ranges)
        new[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(new, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # why: the data then starts 8-aligned, as safetensors' own writer keeps it
    out.parent.mkdir(parents=True, exist_ok=True)
    with open_regular(source) as src, open(out, "xb") as dst:
        dst.write(struct.pack("<Q", len(raw)) + raw)
        for *_, ranges in plan:
            for offset, length in ranges:
                while length:
                    chunk = os.pread(src.fileno(), min(length, COPY_BYTES), offset)
                    if not chunk:
                        raise UserError(f"{source} ended while it was read (it changed or was truncated meanwhile)")
                    dst.write(chunk)
                    offset, length = offset + len(chunk), length - len(chunk)
    return at


def _other_files(source: Path, shards: set[Path]) -> list[Path]:
    """What is copied beside the weights: every entry but hidden ones, config.json, the index, weight files."""
    skip = {"config.json", INDEX}
    return sorted(
        p for p in source.iterdir()
        if not p.name.startswith(".") and p.name not in skip and p not in shards and not p.name.endswith(WEIGHT_FILES)
    )  # fmt: skip


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.exists() else 0


def _copy(path: Path, to: Path) -> None:
    """A file (its content, through a symlink: the hub cache's snapshots point into blobs/) or a folder, without
    weight files or hidden entries."""
    if path.is_dir():
        shutil.copytree(path, to, ignore=lambda _, names: [n for n in names if n.startswith(".") or
                                                           n.endswith(WEIGHT_FILES)])  # fmt: skip
    elif path.is_file():
        shutil.copyfile(path, to)
