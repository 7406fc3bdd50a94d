"""A run checkpoint that holds a model's weights only, written without DeepSpeed in the layout training writes
(format.py): what `moe-lm prune` leaves, so that `load_model` and every command that takes `--run` read it.

    <run>/checkpoints/<tag>/mp_rank_00_model_states.pt              {"module": the weights outside routed experts}
    <run>/checkpoints/<tag>/layer_<n>_expert_<e>_mp_rank_00_model_states.pt
                                                                    {"<moe>.deepspeed_moe.experts.deepspeed_experts.
                                                                      <e>.<param>": expert e's tensor}, n the n-th
                                                                      MoE layer, as DeepSpeed numbers them
    <run>/checkpoints/<tag>/config.yaml, data_ref.json, COMPLETE   as a save writes them (save_resume.py)
    <run>/checkpoints/latest                                        the tag

No optimizer state and no RNG state: such a checkpoint is read, not resumed (training on it would start its
optimizer afresh, which `moe-lm train` does not do from a checkpoint).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moe_lm.checkpoint.format import COMPLETE, MODEL_FILE, ckpt_root, complete_record, safe_load
from moe_lm.config import Config, dump_config
from moe_lm.deepspeed_layout import STACKED
from moe_lm.model import Transformer


def saved_dtype(folder: Path) -> torch.dtype:
    """The dtype a checkpoint's non-expert weights were saved in (a bf16 run saves bf16), read memory-mapped."""
    module = safe_load(Path(folder) / MODEL_FILE, mmap=True)["module"]
    return next((t.dtype for t in module.values() if t.is_floating_point()), torch.float32)


def write_weights(model: Transformer, cfg: Config, run_dir: Path, tag: str, data_ref: dict,
                  dtype: torch.dtype = torch.float32) -> Path:  # fmt: skip
    """`model`'s weights (floating ones in `dtype`, fp32 buffers kept fp32) as checkpoint `tag` of `run_dir`, with
    `cfg` and `data_ref` beside them and `latest` naming it; returns the checkpoint folder."""
    folder = ckpt_root(run_dir) / tag
    folder.mkdir(parents=True)
    names = {id(module): name for name, module in model.named_modules()}
    experts = {f"{names[id(moe)]}.experts.": n for n, moe in enumerate(model.moe_layers())}  # MTP modules' too
    module, per_expert = {}, {}
    for key, value in _cast(model, dtype).items():
        prefix, _, name = key.rpartition(".")
        n = experts.get(prefix + ".")
        if n is None or name not in STACKED:
            module[key] = value
            continue
        for e, tensor in enumerate(value.unbind(0)):
            # why clone: a view would save the whole stacked tensor's storage into every expert's file
            per_expert.setdefault((n, e), {})[f"{prefix}.deepspeed_moe.experts.deepspeed_experts.{e}.{name}"] = (
                tensor.clone()
            )
    torch.save({"module": module}, folder / MODEL_FILE)
    for (n, e), tensors in per_expert.items():
        torch.save(tensors, folder / f"layer_{n}_expert_{e}_mp_rank_00_model_states.pt")
    dump_config(cfg, folder / "config.yaml")
    (folder / "data_ref.json").write_text(json.dumps(data_ref))
    (folder / COMPLETE).write_text(json.dumps(complete_record(folder)))
    (ckpt_root(run_dir) / "latest").write_text(tag)
    return folder


def _cast(model: Transformer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's state dict with floating tensors in `dtype`, but the buffers a module keeps in fp32 (the routers'
    selection bias: updates of 1e-3 vanish in bf16)."""
    fp32 = {f"{name}.{b}" for name, m in model.named_modules() for b in getattr(m, "fp32_buffers", ())}
    return {key: v.to(dtype) if v.is_floating_point() and key not in fp32 else v
            for key, v in model.state_dict().items()}  # fmt: skip
