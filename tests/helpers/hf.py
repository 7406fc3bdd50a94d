"""Tiny models with non-trivial routing and tiny transformers configs, for the interop tests; a folder with code of its
own, for the loaders that must not run it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from moe_lm.model import Transformer
from moe_lm.testing import replace_moe, tiny_model_cfg


def random_model(attention: str, **moe) -> Transformer:
    model = Transformer(replace_moe(tiny_model_cfg(attention), **moe)).eval()
    with torch.no_grad():
        for router in model.routers():  # non-zero, partly negative biases that change routing
            router.e_score_correction_bias.normal_(0.0, 0.05)
        for norm in (m for n, m in model.named_modules() if n.endswith("norm")):
            norm.weight.uniform_(0.5, 1.5)  # non-trivial norm weights, so a mis-mapped norm shows
    return model


def native_deepseek_config(**overrides):
    """A tiny transformers DeepseekV3Config with DeepSeek's interleaved RoPE and group-limited routing."""
    base = dict(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        first_k_dense_replace=1,
        rope_interleave=True,
        max_position_embeddings=64,
    )
    return transformers.DeepseekV3Config(**{**base, **overrides})


def remote_code_folder(folder: Path) -> Path:
    """A model and tokenizer folder of a type transformers does not know, whose config.json and
    tokenizer_config.json point (auto_map) at a .py file that writes `folder / "RAN"` when it is imported."""
    folder.mkdir(parents=True)
    auto = {"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomModel"}
    (folder / "config.json").write_text(json.dumps({"model_type": "custom_moe", "auto_map": auto}))
    tokenizer = {"tokenizer_class": "CustomTokenizer", "auto_map": {"AutoTokenizer": ["custom.CustomTokenizer", None]}}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    (folder / "custom.py").write_text('import pathlib\npathlib.Path(__file__).with_name("RAN").write_text("ran")\n')
    return folder


def answer_yes_if_asked(monkeypatch) -> list:
    """A user at a terminal who answers transformers' "Do you wish to run the custom code?" with y (transformers
    calls input() for it whether or not stdin is a terminal); returns the questions asked."""
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "y")
    return asked
