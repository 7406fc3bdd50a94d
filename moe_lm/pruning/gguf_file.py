"""A GGUF file with routed experts removed: what `moe-lm export --gguf` writes for llama.cpp's `deepseek2` (and
`glm4moe`), or llama.cpp's own converter writes, as a new GGUF file llama.cpp runs, written with gguf-py.

Per MoE block N (a block with a router, `blk.N.ffn_gate_inp.weight`):
    blk.N.ffn_{gate,up,down}_exps.*  (any `*_exps` tensor)  the kept experts' slices, as raw bytes
    blk.N.ffn_gate_inp.*, blk.N.exp_probs_b.*               the kept experts' rows / entries, as raw bytes
    `{arch}.expert_count`                                    the kept number; the group keys unchanged (1 when
                                                             pruned with --ungroup: no group limitation)
Everything else (tokenizer, metadata, attention, shared experts) is copied as it is.

Why raw bytes, whatever the type: ggml lists a tensor's dimensions innermost first, and the stacked experts are
[n_in, n_out, n_expert], the expert axis outermost. Quantised blocks run along the innermost dimension only, so each
expert (and each router row) is one contiguous byte range, whole blocks of its type: slicing it needs no
dequantising, and a quantised file pruned keeps its experts' bits (tested on Q8_0).

What llama.cpp computes (src/llama-graph.cpp, build_moe_ffn, of the version llama-cpp-python 0.3.36 vendors): the
selection scores are the sigmoid probabilities plus exp_probs_b; with `expert_group_count` > 1 a group scores the sum
of its top 2 selection scores, the best `expert_group_used_count` groups are kept and the rest set to -inf; the top
`expert_used_count` of those are chosen and weighted by the unbiased probabilities. So the pruned file computes what
the source computes with exp_probs_b at -inf for the pruned experts (kept_experts.py), which the tests check in
llama.cpp itself.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from moe_lm.errors import UserError, require
from moe_lm.interop.gguf_header import GGUFHeader, read_gguf_header
from moe_lm.pruning.kept_experts import KeptExperts, checked_keep
from moe_lm.pruning.output import pruned_output

ROUTER = re.compile(r"^blk\.(\d+)\.(?:ffn_gate_inp|exp_probs_b)\.\w+$")  # [E] or [n_embd, E]: rows outermost
EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_\w+_exps\.\w+$")  # [..., E]: the stacked experts
FIX = "give a file `moe-lm export --gguf` or llama.cpp's converter wrote, or convert the model again"


def prune_gguf(source: Path, out: Path, keep: Mapping[int, Sequence[int]], ungroup: bool = False) -> Path:
    """`source` (a GGUF MoE file) written to the new file `out` with only the routed experts `keep` names ({MoE
    block: ascending expert ids}, the same number in every block), renumbered 0..E'-1; `ungroup`: without expert
    groups (expert_group_count and expert_group_used_count 1); returns `out`."""
    gguf = require("gguf", "gguf", "pruning a GGUF file")
    source, out = Path(source), Path(out)
    header = read_gguf_header(source)  # why first: every length checked before gguf-py's reader trusts them
    kept = _checked(header, keep, ungroup)
    place = pruned_output(source, out, file=True)
    with place.staged(_pruned_bytes(header, kept)) as target:
        _write(gguf, gguf.GGUFReader(str(source)), target, header.arch, kept, ungroup)
    return out


def gguf_routing(header: GGUFHeader) -> tuple[int, int, int, int, list[int]]:
    """(routed experts, experts per token, expert groups, groups used, the MoE blocks: NextN ones included) of a
    checked header; a one-line UserError naming the file for one that is not a MoE model pruned here."""
    path, arch = header.path, header.arch
    if int(header.fields.get("split.count", 1) or 1) > 1:
        raise UserError(f"{path} is one part of a split GGUF (split.count {header.fields['split.count']}); merge it "
                        "first (llama-gguf-split --merge)")  # fmt: skip
    E, k = header.fields.get(f"{arch}.expert_count"), header.fields.get(f"{arch}.expert_used_count")
    if type(E) is not int or type(k) is not int or E < 2:
        raise UserError(f"{path} is not a mixture-of-experts model ({arch}, no {arch}.expert_count and "
                        "expert_used_count)")  # fmt: skip
    groups = int(header.fields.get(f"{arch}.expert_group_count", 1) or 1)
    used = int(header.fields.get(f"{arch}.expert_group_used_count", groups) or groups)
    layers = sorted({int(m[1]) for t in header.tensors if t.name.endswith(".ffn_gate_inp.weight")
                     and (m := ROUTER.match(t.name))})  # fmt: skip
    if not layers:
        raise UserError(f"{path} has no routed experts (no blk.N.ffn_gate_inp.weight); {FIX}")
    return E, k, groups, used, layers


def _checked(header: GGUFHeader, keep: Mapping[int, Sequence[int]], ungroup: bool) -> KeptExperts:
    """`keep` checked against the file's MoE keys and blocks, and every tensor pruned here holding one slice per
    expert on its outermost axis; a one-line UserError naming the file otherwise."""
    path, arch = header.path, header.arch
    E, k, groups, used, layers = gguf_routing(header)
    kept = checked_keep(keep, layers, E, k, *((1, 1) if ungroup else (groups, used)), path)
    for t in header.tensors:
        m = ROUTER.match(t.name) or EXPERTS.match(t.name)
        if m and int(m[1]) in kept.ids and t.shape[-1] != E:
            raise UserError(f"{path}: {t.name} has shape {list(t.shape)} (ggml's order), not one slice per routed "
                            f"expert ({E}, {arch}.expert_count) outermost; {FIX}")  # fmt: skip
    return kept


def _pruned_bytes(header: GGUFHeader, kept: KeptExperts) -> int:
    """The bytes of the pruned file, about (its tensors' data and the source's header)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    total = header.data_offset
    for t in header.tensors:
        block, per_block = GGML_QUANT_SIZES[GGMLQuantizationType(t.type)]
        nbytes = t.shape[0] // block * per_block * math.prod(t.shape[1:])
        m = ROUTER.match(t.name) or EXPERTS.match(t.name)
        total += nbytes * kept.count // kept.n_experts if m and int(m[1]) in kept.ids else nbytes
    return total


def _write(gguf, reader, target: Path, arch: str, kept: KeptExperts, ungroup: bool) -> None:
    """`reader`'s file written to `target` with only the kept experts: its keys (expert_count changed, the group keys
    1 with `ungroup`), then each tensor's bytes, a tensor in memory at a time (the unchanged ones straight from the
    source's memory map)."""
    w = gguf.GGUFWriter(str(target), arch=arch)
    changed = {f"{arch}.expert_count": kept.count}
    if ungroup:
        changed |= {f"{arch}.expert_group_count": 1, f"{arch}.expert_group_used_count": 1}
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by the writer itself
        kind = f.types[0]
        value = changed.get(name, f.contents())
        if name == "general.alignment":
            w.data_alignment = int(value)  # why: the writer pads the data by it, not by the key it copies
        w.add_key_value(name, value, kind, sub_type=f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    rows = {}
    for t in reader.tensors:
        m = ROUTER.match(t.name) or EXPERTS.match(t.name)
        rows[t.name] = np.asarray(kept.ids[int(m[1])]) if m and int(m[1]) in kept.ids else None
        shape = t.data.shape if rows[t.name] is None else (kept.count, *t.data.shape[1:])
        nbytes = t.data.nbytes if rows[t.name] is None else t.data.nbytes // kept.n_experts * kept.count
        w.add_tensor_info(t.name, shape, t.data.dtype, nbytes, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in reader.tensors:
        w.write_tensor_data(t.data if rows[t.name] is None else t.data[rows[t.name]])
    w.close()
