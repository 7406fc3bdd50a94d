"""MTP modules in the layout DeepSeek publishes them: written beside a `transformers` export, read back on import.

DeepSeek-V3's checkpoint stores its MTP module as one more decoder layer, `model.layers.61` (= num_hidden_layers),
with `config.json` saying `num_nextn_predict_layers: 1`. Module k (1-based) is `model.layers.{L + k - 1}`:

    enorm.weight  hnorm.weight  eh_proj.weight  shared_head.norm.weight      the module's own tensors
    embed_tokens.weight  shared_head.head.weight                            copies of the main model's
    input_layernorm  self_attn.*  post_attention_layernorm  mlp.*           the block, as in any MoE layer,
                                                                            experts one by one (experts.<e>.*_proj)

`transformers` builds no module for these layers (DeepseekV3 lists `model.layers.61.*` as keys to ignore), so it
loads such a checkpoint as the main model alone; we write and read them with safetensors directly.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moe_lm.errors import DataError
from moe_lm.interop.safetensors_folder import INDEX, SINGLE, SafetensorsFolder

MTP_FILE = "model-mtp.safetensors"
HF_EXPERT_WEIGHT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
SHARED_COPIES = {"embed_tokens.weight": "embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


def mtp_tensors_for_hf(state: dict[str, torch.Tensor], n_layers: int, depth: int) -> dict[str, torch.Tensor]:
    """Our state dict's MTP modules (`mtp.<j>.*`) as DeepSeek's `model.layers.<n_layers + j>.*` tensors."""
    out = {}
    for j in range(depth):
        layer = f"model.layers.{n_layers + j}."
        own = {k[len(f"mtp.{j}.") :]: v for k, v in state.items() if k.startswith(f"mtp.{j}.")}
        gate_up, down = own.pop("mlp.experts.gate_up_proj"), own.pop("mlp.experts.down_proj")
        inter = down.shape[2]
        for e in range(gate_up.shape[0]):
            out[f"{layer}mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :inter]
            out[f"{layer}mlp.experts.{e}.up_proj.weight"] = gate_up[e, inter:]
            out[f"{layer}mlp.experts.{e}.down_proj.weight"] = down[e]
        out.update({layer + k: v for k, v in own.items()})
        for hf_name, ours in SHARED_COPIES.items():
            out[layer + hf_name] = state[ours]
    # why clone: the copies of the embedding and head would otherwise share memory, which safetensors refuses
    return {k: v.detach().float().cpu().clone() for k, v in out.items()}


def add_to_export(out_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Add tensors to a `save_pretrained` folder: one more shard in its index, or into its single file."""
    if not tensors:
        return
    index_file = out_dir / INDEX
    if index_file.is_file():
        index = json.loads(index_file.read_text())
        save_file(tensors, out_dir / MTP_FILE, metadata={"format": "pt"})
        index["weight_map"].update(dict.fromkeys(tensors, MTP_FILE))
        index_file.write_text(json.dumps(index, indent=2))
    else:
        save_file({**load_file(out_dir / SINGLE), **tensors}, out_dir / SINGLE, metadata={"format": "pt"})


def read_mtp_layers(path: Path, n_layers: int, declared: int) -> dict[int, dict[str, torch.Tensor]]:
    """The MTP layers a checkpoint folder holds, up to the `declared` num_nextn_predict_layers: {j: {name within the
    layer: tensor}} for consecutive j = 0, 1, ... (a config may declare MTP layers its weights do not have)."""
    if not ((path / INDEX).is_file() or (path / SINGLE).is_file()):
        return {}
    files = SafetensorsFolder(path, "download or convert the checkpoint again")
    layers = {}
    for j in range(declared):
        prefix = f"model.layers.{n_layers + j}."
        keys = [k for k in files.names() if k.startswith(prefix)]
        if prefix + "eh_proj.weight" not in files:
            break
        quantized = [k for k in keys if k.endswith("_scale_inv")]
        if quantized:
            raise DataError(
                f"{path}: MTP layer {n_layers + j} is stored in FP8 ({quantized[0]}); convert the checkpoint to "
                "bf16 first (DeepSeek's fp8_cast_bf16.py)"
            )
        layers[j] = {name[len(prefix) :]: tensor for name, tensor in files.tensors(keys)}
    return layers


def mtp_state_from_hf(layer: dict[str, torch.Tensor], j: int, main: dict[str, torch.Tensor], where: str) -> dict:
    """Our `mtp.<j>.*` state from one MTP layer's tensors: experts stacked, the copies of the shared embedding and
    head checked against the main model's (ours shares them; a differing copy is named in a warning)."""
    own, experts = {}, {}
    for name, tensor in layer.items():
        if name in SHARED_COPIES:
            if not torch.equal(tensor.float(), main[SHARED_COPIES[name]].float()):
                warnings.warn(
                    f"{where}: {name} differs from the main model's {SHARED_COPIES[name]}; moe-lm shares the main "
                    "model's (as DeepSeek-V3 does in training), so the copy is not used",
                    stacklevel=2,
                )
        elif m := HF_EXPERT_WEIGHT.match(name):
            experts.setdefault(int(m[1]), {})[m[2]] = tensor.float()
        else:
            own[f"mtp.{j}.{name}"] = tensor.float()
    if experts:
        order = sorted(experts)
        own[f"mtp.{j}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat((experts[e]["gate"], experts[e]["up"])) for e in order]
        )
        own[f"mtp.{j}.mlp.experts.down_proj"] = torch.stack([experts[e]["down"] for e in order])
    return own
