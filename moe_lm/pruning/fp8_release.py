"""A DeepSeek FP8 release with routed experts removed, streamed: the folder as DeepSeek publishes it (and as
moe_lm/interop/released_weights.py reads it: per-expert `model.layers.N.mlp.experts.J.{gate,up,down}_proj.weight` in
float8_e4m3fn, each with its `weight_scale_inv` block scales; the router in bf16 and its bias in float32; shards named
by `model.safetensors.index.json`; config.json's `quantization_config`) written as a new release of the same format.

Nothing is dequantised: a kept expert's FP8 weight and its scales are the source's bytes under the new id, copied in
pieces (safetensors_shards.py), so a 671 B release (680 GB) is pruned in the memory of a copy buffer. Before any byte
is written, every FP8 weight is checked to have its scale grid (from the headers alone), so that a damaged release is
one line, not a pruned folder that fails later.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from moe_lm.errors import UserError
from moe_lm.interop.released_weights import ReleasedWeights, block_size
from moe_lm.pruning.hf_folder import read_config
from moe_lm.pruning.safetensors_shards import prune_folder

FIX = "download or convert the release again"


def prune_fp8_release(
    source: Path,
    out: Path,
    keep: Mapping[int, Sequence[int]],
    extras: Callable[[Path], None] | None = None,
    ungroup: bool = False,
) -> Path:
    """`source` (a DeepSeek FP8 release folder) written to the new folder `out` with only the routed experts `keep`
    names ({MoE layer: ascending expert ids}, the same number in every layer), renumbered 0..E'-1; `extras(folder)`
    writes more files into it before it is put in place (prune.json); `ungroup`: without expert groups (n_group and
    topk_group 1 in config.json); returns `out`."""
    source, out = Path(source), Path(out)
    config = read_config(source)
    if block_size(config, source) is None:  # why first: another quantisation is refused here, by name
        raise UserError(f"{source / 'config.json'} declares no quantization_config: not an FP8 release; a bf16 or "
                        "float32 folder is pruned by moe_lm.pruning.hf_folder.prune_hf_folder")  # fmt: skip
    weights = ReleasedWeights(source, config)
    weights.check(weights.names())  # each FP8 weight's scale present, its grid fitting (headers only)
    return prune_folder(source, out, keep, config, FIX, extras, ungroup)
