"""Checkpoints written the way their makers release them (moe_lm.interop.released_weights.write_fp8_release:
transformers' per-expert names, several shards with an index, FP8 blocks with a float32 `weight_scale_inv` each), of
small random models whose matrices are not multiples of 128, so that every kind of edge block is read; and an
independent dequantisation to check the reader against."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from moe_lm.interop.released_weights import write_fp8_release
from tests.analysis.test_hf_routing import tiny_tokenizer

BLOCK = 128


def deepseek_v3(**overrides) -> transformers.PretrainedConfig:
    """A DeepseekV3 of 4 layers (1 dense), 8 experts in 4 groups, top-2, with ragged matrices: hidden 144 (1 1/8
    blocks), kv_a_proj_with_mqa 72 rows, the dense MLP 200 rows (1 9/16 blocks)."""
    return transformers.DeepseekV3Config(**{
        "vocab_size": 300, "hidden_size": 144, "intermediate_size": 200, "moe_intermediate_size": 48,
        "num_hidden_layers": 4, "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
        "kv_lora_rank": 64, "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "max_position_embeddings": 256, "routed_scaling_factor": 2.5, **overrides})  # fmt: skip


def qwen3_moe(**overrides) -> transformers.PretrainedConfig:
    """A Qwen3Moe of 3 layers, 8 experts top-2 (softmax gate, q/k norms), hidden 144."""
    return transformers.Qwen3MoeConfig(**{
        "vocab_size": 300, "hidden_size": 144, "intermediate_size": 200, "moe_intermediate_size": 48,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 36,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": 256,
        "tie_word_embeddings": False, **overrides})  # fmt: skip


CONFIGS = {"deepseek_v3": deepseek_v3, "qwen3_moe": qwen3_moe}


def random_model(config, seed: int = 0, scale: float = 5.0):
    """The model of `config` at random, its matrices scaled up so that routing is far from uniform, its selection
    biases (where it has them) non-zero."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(scale)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    return model


def release(kind: str, folder: Path, fp8: bool = True, shards: int = 3) -> Path:
    """A random `kind` model released into `folder` with a tokenizer: in FP8 blocks (`fp8`), or in bf16 shards."""
    model = random_model(CONFIGS[kind]())
    if fp8:
        write_fp8_release(model, folder, shards=shards)
    else:
        model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="200KB")
    tiny_tokenizer(folder)
    return folder


def dequantized_by_blocks(w8: torch.Tensor, scale_inv: torch.Tensor, block: int | tuple = BLOCK) -> torch.Tensor:
    """An independent dequantisation: each block (128 x 128, or rows x columns) in turn (the last ones cut short),
    its values times its scale, DeepSeek's rule written out."""
    r, c = (block, block) if isinstance(block, int) else block
    w = torch.empty(w8.shape)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows, cols = slice(i * r, (i + 1) * r), slice(j * c, (j + 1) * c)
            w[rows, cols] = w8[rows, cols].float() * scale_inv[i, j].item()
    return w
