"""A transformers checkpoint folder with routed experts removed: what `moe_lm.interop.hf.export_hf` writes
(DeepseekV3ForCausalLM for MLA models, Glm4MoeForCausalLM for GQA ones, the routed experts one tensor per expert as
save_pretrained lays them out), any folder of that layout (the stacked [E, ...] layout too) and a Qwen3-MoE's,
written as a new folder that transformers loads as it is (safetensors_shards.py says what changes).

The pruned model computes what the source computes with the pruned experts' `e_score_correction_bias` at -inf
(kept_experts.py says why; the tests check it in transformers, groups included: its DeepseekV3TopkRouter and
Glm4MoeTopkRouter score groups from the biased scores, `scores + e_score_correction_bias`), or, for Qwen3-MoE's
softmax router with its top-k renormalised, with their logits at -inf (formats.py checks the type).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from moe_lm.errors import UserError
from moe_lm.pruning.safetensors_shards import prune_folder

FIX = "give a folder written by `moe-lm export` or save_pretrained, or download it again"


def read_config(folder: Path) -> dict:
    """A checkpoint folder's config.json as a mapping; a one-line UserError naming it otherwise."""
    where = folder / "config.json"
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder; give a transformers checkpoint folder")
    try:
        config = json.loads(where.read_text())
    except FileNotFoundError:
        raise UserError(f"{where} is missing: {folder} is not a transformers checkpoint folder") from None
    except (ValueError, OSError) as e:
        raise UserError(f"{where} is not readable JSON ({e}); {FIX}") from None
    if not isinstance(config, dict):
        raise UserError(f"{where} is not a JSON mapping; {FIX}")
    return config


def prune_hf_folder(
    source: Path,
    out: Path,
    keep: Mapping[int, Sequence[int]],
    extras: Callable[[Path], None] | None = None,
    ungroup: bool = False,
) -> Path:
    """`source` (a transformers folder) written to the new folder `out` with only the routed experts `keep` names
    ({MoE layer: ascending expert ids}, the same number in every layer), renumbered 0..E'-1; `extras(folder)`
    writes more files into it before it is put in place (prune.json); `ungroup`: without expert groups (n_group and
    topk_group 1 in config.json); returns `out`."""
    source, out = Path(source), Path(out)
    config = read_config(source)
    if config.get("quantization_config"):
        raise UserError(f"{source / 'config.json'} declares quantised weights (quantization_config); an FP8 release is "
                        "pruned by moe_lm.pruning.fp8_release.prune_fp8_release")  # fmt: skip
    return prune_folder(source, out, keep, config, FIX, extras, ungroup)
