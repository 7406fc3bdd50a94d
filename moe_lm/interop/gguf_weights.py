"""A GGUF file's weights back in our Transformer: every tensor dequantised by gguf-py (`gguf.quants.dequantize`, any
type llama.cpp writes, the k-quants included) and put where our exporter (interop/gguf.py, `gguf_tensors`) took it
from. What the quantised model computes in PyTorch, in our architecture: the drift attribution runs it with the
original's routes forced (moe_lm/analysis/attribution.py). For files `moe-lm export --gguf` wrote (deepseek2, MLA).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from moe_lm.config import ModelConfig
from moe_lm.errors import UserError, require
from moe_lm.interop.hf import deinterleave_rope
from moe_lm.model import Transformer

FFN = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def gguf_arrays(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file, dequantised to float32, in numpy's order (GGUF lists dimensions innermost
    first)."""
    gguf = require("gguf", "gguf", "reading a GGUF file's weights")
    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        out[t.name] = np.asarray(values, dtype=np.float32).reshape(tuple(int(n) for n in reversed(t.shape)))
    return out


def state_from_gguf(g: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict (rotary rows in our order) from the GGUF arrays of `moe-lm export --gguf`'s layout."""
    if cfg.attention != "mla":
        raise UserError("reading a GGUF file's weights back is written for MLA models (deepseek2) only")
    state = {"embed_tokens.weight": g["token_embd.weight"], "norm.weight": g["output_norm.weight"],
             "lm_head.weight": g["output.weight"]}  # fmt: skip
    H, nope, v, kv = cfg.n_heads, cfg.mla.qk_nope_head_dim, cfg.mla.v_head_dim, cfg.mla.kv_lora_rank
    for i in range(cfg.n_layers):
        p, s = f"blk.{i}.", f"layers.{i}."
        state[s + "input_layernorm.weight"] = g[p + "attn_norm.weight"]
        state[s + "post_attention_layernorm.weight"] = g[p + "ffn_norm.weight"]
        a = s + "self_attn."
        if p + "attn_q_a.weight" in g:
            state |= {a + "q_a_proj.weight": g[p + "attn_q_a.weight"], a + "q_a_layernorm.weight":
                      g[p + "attn_q_a_norm.weight"], a + "q_b_proj.weight": g[p + "attn_q_b.weight"]}  # fmt: skip
        else:
            state[a + "q_proj.weight"] = g[p + "attn_q.weight"]
        k_b = g[p + "attn_k_b.weight"].reshape(H, kv, nope).transpose(0, 2, 1)  # [H, nope, kv]
        v_b = g[p + "attn_v_b.weight"].reshape(H, v, kv)
        state |= {a + "kv_a_proj_with_mqa.weight": g[p + "attn_kv_a_mqa.weight"],
                  a + "kv_a_layernorm.weight": g[p + "attn_kv_a_norm.weight"],
                  a + "kv_b_proj.weight": np.concatenate([k_b, v_b], axis=1).reshape(H * (nope + v), kv),
                  a + "o_proj.weight": g[p + "attn_output.weight"]}  # fmt: skip
        m = s + "mlp."
        if p + "ffn_gate_inp.weight" not in g:  # a dense block
            state |= {m + f"{h}.weight": g[p + f"ffn_{x}.weight"] for h, x in FFN.items()}
            continue
        state |= {m + "gate.weight": g[p + "ffn_gate_inp.weight"],
                  m + "gate.e_score_correction_bias": g[p + "exp_probs_b.bias"],
                  m + "experts.gate_up_proj": np.concatenate([g[p + "ffn_gate_exps.weight"],
                                                              g[p + "ffn_up_exps.weight"]], axis=1),
                  m + "experts.down_proj": g[p + "ffn_down_exps.weight"]}  # fmt: skip
        state |= {m + f"shared_experts.{h}.weight": g[p + f"ffn_{x}_shexp.weight"] for h, x in FFN.items()}
    tensors = {k: torch.from_numpy(np.array(a, dtype=np.float32)) for k, a in state.items()}  # owned, writable
    deinterleave_rope(tensors, cfg)  # why: the export wrote DeepSeek's interleaved rotary rows
    return tensors


def model_from_gguf(path: str | Path, cfg: ModelConfig) -> Transformer:
    """Our Transformer of `cfg` (the run the file was exported from) holding the GGUF file's weights, dequantised;
    a file of another shape is one line naming the first tensor that does not fit."""
    model = Transformer(cfg)
    ours = model.state_dict()
    try:
        state = state_from_gguf(gguf_arrays(path), cfg)
    except KeyError as e:
        what = f"{path}: no tensor {e.args[0]!r}"
        raise UserError(f"{what}; give a GGUF file moe-lm export --gguf wrote of this run") from None
    for key, tensor in ours.items():
        if key.startswith("mtp.") or not tensor.numel():
            state.setdefault(key, tensor)
        elif key not in state or state[key].shape != tensor.shape:
            got = tuple(state[key].shape) if key in state else "none"
            raise UserError(f"{path}: {key} is {got}, the run's is {tuple(tensor.shape)}: exported from another model")
    model.load_state_dict({k: state[k] for k in ours}, strict=True)
    return model.eval()
