"""MTP modules across the HF boundary: exported in DeepSeek's published layout (layers past num_hidden_layers),
ignored by transformers (which still reproduces the main logits), read back exactly; and a checkpoint laid out as
DeepSeek publishes it, imported and checked against transformers' own decoder layer as the MTP block."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.masking_utils import create_causal_mask

from moe_lm.config import MTPConfig
from moe_lm.interop.hf import export_hf, import_hf
from moe_lm.model import Transformer
from tests.helpers.hf import native_deepseek_config, random_model


def mtp_model(attention: str, depth: int) -> Transformer:
    """A random model (uneven biases and norms, as test_hf's) with `depth` MTP modules of random weights."""
    base = random_model(attention, n_group=4, topk_group=2)
    model = Transformer(dataclasses.replace(base.cfg, mtp=MTPConfig(depth=depth))).eval()
    model.load_state_dict(base.state_dict(), strict=False)
    with torch.no_grad():
        for p in model.mtp.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        for router in model.routers()[len(base.routers()) :]:
            router.e_score_correction_bias.normal_(0.0, 0.05)
    return model


def keys_in(folder) -> set[str]:
    names = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(f, framework="pt") as st:
            names.update(st.keys())
    return names


@pytest.mark.parametrize("attention", ["mla", "gqa"])
@pytest.mark.parametrize("depth", [1, 2])
def test_export_writes_deepseeks_mtp_layout_and_imports_back_exactly(tmp_path, attention, depth):
    model = mtp_model(attention, depth)
    export_hf(model, tmp_path)
    L = model.cfg.n_layers
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == depth
    names = keys_in(tmp_path)
    for j in range(depth):
        layer = f"model.layers.{L + j}."
        for own in (
            "enorm.weight",
            "hnorm.weight",
            "eh_proj.weight",
            "shared_head.norm.weight",
            "shared_head.head.weight",
            "embed_tokens.weight",
            "input_layernorm.weight",
            "mlp.gate.e_score_correction_bias",
            "mlp.experts.7.down_proj.weight",
            "mlp.shared_experts.up_proj.weight",
        ):
            assert layer + own in names
    # transformers loads the export as the main model alone and reproduces its logits
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        assert (hf(tokens).logits - model(tokens).logits).abs().max() <= 1e-4
        back = import_hf(tmp_path).eval()
        assert back.cfg.mtp.depth == depth
        a, b = model(tokens, mtp=True), back(tokens, mtp=True)
    for x, y in zip(a.mtp_logits, b.mtp_logits, strict=True):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in model.state_dict().items() if k.startswith("mtp."))


@pytest.mark.filterwarnings("error")  # the embedding and head copies match the main model's: no warning
def test_mtp_tensors_go_into_a_sharded_export_through_its_index(tmp_path):
    model = mtp_model("mla", 1)
    out = tmp_path / "sharded"
    export_hf(model, out, max_shard_size="20KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # several shards of the main model, and the MTP one
    assert index["weight_map"]["model.layers.3.eh_proj.weight"] == "model-mtp.safetensors"
    back = import_hf(out)
    assert back.cfg.mtp.depth == 1
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in model.state_dict().items())


def published_mtp_layer(hf_cfg, gen: torch.Generator, main_state: dict) -> dict[str, torch.Tensor]:
    """An MTP layer as DeepSeek publishes one: its own tensors, copies of the embedding and head, the block with
    experts one by one and interleaved RoPE rows, under model.layers.<num_hidden_layers>."""
    layer = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer(hf_cfg, 3)
    D = hf_cfg.hidden_size
    tensors = {}
    for name, p in layer.state_dict().items():
        value = torch.randn(p.shape, generator=gen) * 0.1 if p.dim() > 1 else torch.rand(p.shape, generator=gen) + 0.5
        if name.endswith("e_score_correction_bias"):
            value = torch.randn(p.shape, generator=gen) * 0.05
        if name == "mlp.experts.gate_up_proj":
            inter = value.shape[1] // 2
            for e in range(value.shape[0]):
                tensors[f"mlp.experts.{e}.gate_proj.weight"] = value[e, :inter]
                tensors[f"mlp.experts.{e}.up_proj.weight"] = value[e, inter:]
        elif name == "mlp.experts.down_proj":
            for e in range(value.shape[0]):
                tensors[f"mlp.experts.{e}.down_proj.weight"] = value[e]
        else:
            tensors[name] = value
    tensors["enorm.weight"] = torch.rand(D, generator=gen) + 0.5
    tensors["hnorm.weight"] = torch.rand(D, generator=gen) + 0.5
    tensors["shared_head.norm.weight"] = torch.rand(D, generator=gen) + 0.5
    tensors["eh_proj.weight"] = torch.randn(D, 2 * D, generator=gen) * 0.1
    tensors["embed_tokens.weight"] = main_state["model.embed_tokens.weight"].clone()
    tensors["shared_head.head.weight"] = main_state["lm_head.weight"].clone()
    return {f"model.layers.{hf_cfg.num_hidden_layers}.{k}": v.contiguous() for k, v in tensors.items()}


def reference_mtp_logits(hf, layer_tensors: dict, tokens: torch.Tensor) -> torch.Tensor:
    """Depth 1 as vLLM/SGLang serve DeepSeek's MTP layer, with transformers' own decoder layer as the block:
    x_i = eh_proj [enorm(Emb(t_{i+1})); hnorm(h_i)] (h: the main model's final-normed hidden state), the block,
    then shared_head.norm and the head."""
    cfg = hf.config
    L = cfg.num_hidden_layers
    own = {k.removeprefix(f"model.layers.{L}."): v for k, v in layer_tensors.items()}
    block = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer(cfg, L).eval()
    E = cfg.n_routed_experts
    state = {k: v for k, v in own.items() if k in block.state_dict()}
    state["mlp.experts.gate_up_proj"] = torch.stack(
        [
            torch.cat((own[f"mlp.experts.{e}.gate_proj.weight"], own[f"mlp.experts.{e}.up_proj.weight"]))
            for e in range(E)
        ]
    )
    state["mlp.experts.down_proj"] = torch.stack([own[f"mlp.experts.{e}.down_proj.weight"] for e in range(E)])
    block.load_state_dict(state, strict=True)

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    with torch.no_grad():
        h = hf.model(tokens).last_hidden_state[:, :-1]
        emb = hf.model.embed_tokens(tokens[:, 1:])
        x = torch.cat((rms(emb, own["enorm.weight"]), rms(h, own["hnorm.weight"])), -1) @ own["eh_proj.weight"].T
        positions = torch.arange(x.shape[1])[None]
        mask = create_causal_mask(
            config=cfg, inputs_embeds=x, attention_mask=None, past_key_values=None, position_ids=positions
        )
        y = block(x, attention_mask=mask, position_ids=positions, position_embeddings=hf.model.rotary_emb(x, positions))
        return rms(y, own["shared_head.norm.weight"]) @ hf.lm_head.weight.T


def test_import_of_a_checkpoint_laid_out_as_deepseek_publishes_it(tmp_path):
    hf_cfg = native_deepseek_config(q_lora_rank=16, num_nextn_predict_layers=1)
    hf = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05, generator=gen)
        for p in hf.parameters():
            p.normal_(0.0, 0.1, generator=gen) if p.dim() > 1 else None
    hf.save_pretrained(tmp_path)
    mtp = published_mtp_layer(hf_cfg, gen, hf.state_dict())
    save_file(mtp, tmp_path / "mtp.safetensors", metadata={"format": "pt"})  # then index it, as DeepSeek's repo does
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    weight_map.update(dict.fromkeys(mtp, "mtp.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "model.safetensors").rename(tmp_path / "main.safetensors")
    weight_map = {k: ("main.safetensors" if v == "model.safetensors" else v) for k, v in weight_map.items()}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    ours = import_hf(tmp_path).eval()
    assert ours.cfg.mtp.depth == 1
    tokens = torch.randint(0, 101, (2, 20))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = ours(tokens, mtp=True)
        assert (out.logits - reloaded(tokens).logits).abs().max() <= 1e-4
    expected = reference_mtp_logits(reloaded, mtp, tokens)
    diff = (out.mtp_logits[0] - expected).abs().max().item()
    assert diff <= 1e-4 and expected.std() > 1e-2, diff


def test_a_config_that_declares_mtp_without_its_weights_imports_without_mtp(tmp_path):
    """transformers' DeepseekV3Config says num_nextn_predict_layers=1 by default; the weights decide."""
    hf = transformers.DeepseekV3ForCausalLM(native_deepseek_config()).eval()
    assert hf.config.num_nextn_predict_layers == 1
    hf.save_pretrained(tmp_path)
    assert import_hf(tmp_path).cfg.mtp.depth == 0


def test_a_differing_embedding_copy_is_named_in_a_warning(tmp_path):
    model = mtp_model("mla", 1)
    export_hf(model, tmp_path)
    from safetensors.torch import load_file

    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.3.embed_tokens.weight"] = state["model.layers.3.embed_tokens.weight"] + 1.0
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match="layer 3: embed_tokens.weight differs"):
        import_hf(tmp_path)
