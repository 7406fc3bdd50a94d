"""The sources the pruning tests prune in their own formats (shared in tests/pruning/conftest.py): a check-sized MLA
model with 16 routed experts in 4 groups (top-3 from 2 groups, non-zero biases) as a transformers folder with the tiny
corpus' tokenizer and as GGUF files of it, and a DeepSeek-V3 FP8 release of the same routing."""

from __future__ import annotations

from pathlib import Path

from moe_lm.config import DataConfig
from moe_lm.data.tokenizer import load_data_tokenizer
from moe_lm.interop.gguf import export_gguf
from moe_lm.interop.hf import export_hf
from moe_lm.interop.hf_tokenizer import export_tokenizer
from moe_lm.interop.released_weights import write_fp8_release
from moe_lm.testing import check_model, check_weights, replace_moe
from tests.analysis.test_hf_routing import tiny_tokenizer
from tests.helpers.released import deepseek_v3
from tests.helpers.released import random_model as random_release_model

SIXTEEN = dict(n_routed_experts=16, n_group=4, topk_group=2)
VOCAB = 320


def gguf_sources(folder: Path, data: DataConfig) -> Path:
    """`folder` holding hf/ (the model exported with `data`'s tokenizer), f32.gguf and q8_0.gguf (deepseek2)."""
    tok = load_data_tokenizer(data.out_dir)
    cfg = replace_moe(check_model("mla", vocab_size=VOCAB, q_lora_rank=0).cfg, **SIXTEEN)
    model = check_weights(cfg)
    export_hf(model, folder / "hf", tok.doc_start_id, tok.eos_id)
    export_tokenizer(data.out_dir, folder / "hf", max_len=cfg.max_seq_len)
    for kind in ("f32", "q8_0"):
        export_gguf(folder / "hf", folder / f"{kind}.gguf", kind)
    return folder


def fp8_release(folder: Path) -> Path:
    """A random DeepseekV3 (MoE layers 1..3, 16 experts in 4 groups) released in FP8 blocks in 3 shards, with a
    tokenizer, into `folder`."""
    write_fp8_release(random_release_model(deepseek_v3(**SIXTEEN)), folder, shards=3)
    tiny_tokenizer(folder)
    return folder
