"""HF interop: exports load with transformers' from_pretrained and reproduce our logits; imports do the reverse."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers

import moe_lm.experiments.variants  # noqa: F401  (registers the research variants used below)
from moe_lm.config import RopeScalingConfig
from moe_lm.interop.hf import export_hf, from_hf_config, import_hf, to_hf_model
from moe_lm.model import Transformer, build_model
from moe_lm.testing import tiny_model_cfg
from tests.helpers.hf import answer_yes_if_asked, native_deepseek_config, random_model, remote_code_folder


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("attention, hf_cls", [("mla", "DeepseekV3ForCausalLM"), ("gqa", "Glm4MoeForCausalLM")])
@pytest.mark.parametrize("grouping", [dict(n_group=1, topk_group=1), dict(n_group=4, topk_group=2)])
def test_export_loads_in_transformers_with_same_logits(tmp_path, attention, hf_cls, grouping):
    model = random_model(attention, **grouping)
    export_hf(model, tmp_path)
    assert (tmp_path / "config.json").is_file() and list(tmp_path.glob("*.safetensors"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == hf_cls
    tokens = torch.randint(0, 97, (2, 24))
    ours = logits(model, tokens)
    diff = (hf(tokens).logits - ours).abs().max().item()
    assert diff <= 1e-4, diff
    assert ours.std() > 1e-2  # logits are not trivially equal
    # the biases made it across and matter
    hf_bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
    torch.testing.assert_close(hf_bias, model.layers[1].mlp.gate.e_score_correction_bias)
    # the benchmarks' HF arms skip the disk (to_hf_model): the very model from_pretrained gives, buffers included
    in_memory = to_hf_model(model, hf.config._experts_implementation).eval()
    assert torch.equal(in_memory(tokens).logits, hf(tokens).logits)
    held = {**dict(hf.named_parameters()), **dict(hf.named_buffers())}
    assert all(torch.equal(t, held[name]) for name, t in [*in_memory.named_parameters(), *in_memory.named_buffers()])


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_export_import_round_trip(tmp_path, attention):
    model = random_model(attention, n_group=4, topk_group=2)
    export_hf(model, tmp_path)
    back = import_hf(tmp_path).eval()
    unused = "gqa" if attention == "mla" else "mla"  # the other attention's section is not exported
    assert dataclasses.replace(back.cfg, **{unused: getattr(model.cfg, unused)}) == model.cfg
    tokens = torch.randint(0, 97, (2, 24))
    torch.testing.assert_close(logits(back, tokens), logits(model, tokens), atol=1e-6, rtol=0)


@pytest.mark.parametrize("q_lora_rank", [0, 16])
def test_mla_export_is_in_deepseeks_published_layout(tmp_path, q_lora_rank):
    """vLLM and SGLang rotate DeepSeek-V3's rotary dims as interleaved pairs whatever the config says, and route
    with sigmoid + bias only when told: the export must hold for a reader that forces the published layout."""
    model = random_model("mla", n_group=4, topk_group=2)
    cfg = dataclasses.replace(model.cfg, mla=dataclasses.replace(model.cfg.mla, q_lora_rank=q_lora_rank))
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(5.0) if p.dim() > 1 else None  # attention far from uniform, so the rotary layout shows
    export_hf(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_interleave"] is True
    assert (config["scoring_func"], config["topk_method"]) == ("sigmoid", "noaux_tc")
    assert (config["n_group"], config["topk_group"]) == (4, 2)
    assert config["num_experts_per_tok"] == cfg.moe.num_experts_per_tok
    tokens = torch.randint(0, 97, (2, 24))
    ours = logits(model, tokens)
    published = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, rope_interleave=True)
    assert (published.eval()(tokens).logits - ours).abs().max().item() <= 1e-4
    # the layout matters at this scale: read as rotate-half rows, the same file gives another model
    half = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, rope_interleave=False)
    assert (half.eval()(tokens).logits - ours).abs().max().item() > 1e-2


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_import_of_an_export_is_the_identity(tmp_path, attention):
    model = random_model(attention, n_group=4, topk_group=2)
    export_hf(model, tmp_path)
    back = import_hf(tmp_path).state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(back[key], value), key


@pytest.mark.parametrize("q_lora_rank", [None, 16])
def test_import_native_deepseek_v3_checkpoint(tmp_path, q_lora_rank):
    """A checkpoint made by transformers itself (interleaved RoPE, as DeepSeek publishes) imports exactly."""
    hf_cfg = native_deepseek_config(q_lora_rank=q_lora_rank)
    hf = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
        for p in hf.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else None
    hf.save_pretrained(tmp_path)
    ours = import_hf(tmp_path).eval()
    tokens = torch.randint(0, 101, (2, 20))
    with torch.no_grad():
        expected = hf(tokens).logits
    diff = (logits(ours, tokens) - expected).abs().max().item()
    assert diff <= 1e-4, diff


YARN = RopeScalingConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0)


@pytest.mark.parametrize("attention, mscale_all_dim", [("mla", 1.0), ("mla", 0.0), ("gqa", 0.0)])
def test_yarn_rope_export_matches_transformers(tmp_path, attention, mscale_all_dim):
    """YaRN as DeepSeek-V3 ships it (mscale_all_dim=1 also sharpens MLA's softmax), past the original context."""
    model = random_model(attention)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(5.0) if p.dim() > 1 else None  # std 0.1: attention far from uniform, so positions matter
    cfg = dataclasses.replace(model.cfg, rope_scaling=dataclasses.replace(YARN, mscale_all_dim=mscale_all_dim))
    yarn = Transformer(cfg).eval()
    yarn.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 97, (2, 40))
    assert (logits(yarn, tokens) - logits(model, tokens)).abs().max() > 1e-2  # the scaling changes the model
    export_hf(yarn, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    diff = (hf(tokens).logits - logits(yarn, tokens)).abs().max().item()
    assert diff <= 1e-4, diff
    assert import_hf(tmp_path).cfg.rope_scaling == cfg.rope_scaling


def test_import_native_yarn_checkpoint(tmp_path):
    """A transformers-made DeepseekV3 checkpoint with DeepSeek-V3's rope settings (yarn, interleaved) imports."""
    hf_cfg = native_deepseek_config(
        q_lora_rank=16,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    )
    hf = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else None
    hf.save_pretrained(tmp_path)
    ours = import_hf(tmp_path).eval()
    assert ours.cfg.rope_scaling.rope_type == "yarn"
    tokens = torch.randint(0, 101, (2, 48))
    with torch.no_grad():
        expected = hf(tokens).logits
    diff = (logits(ours, tokens) - expected).abs().max().item()
    assert diff <= 1e-4, diff


def test_unsupported_features_are_clear_errors():
    for rope in (
        {"rope_type": "dynamic", "factor": 4.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "attention_factor": 0.5},
    ):
        hf_cfg = transformers.DeepseekV3Config(rope_parameters={"rope_theta": 10000.0, **rope})
        with pytest.raises(ValueError, match="does not implement: .*(dynamic|attention_factor)"):
            from_hf_config(hf_cfg)
    prefix = Transformer(dataclasses.replace(tiny_model_cfg(), attn_mask="prefix"))
    with pytest.raises(ValueError, match="attn_mask=prefix: .*causal only"):
        export_hf(prefix, "/nonexistent")
    encdec = build_model(dataclasses.replace(tiny_model_cfg("gqa"), arch="encdec", n_enc_layers=2))
    with pytest.raises(ValueError, match="arch=encdec: .*decoder-only"):
        export_hf(encdec, "/nonexistent")


def test_export_cli_from_a_training_run(tiny_data, trained_run, cli, tmp_path):
    from moe_lm.checkpoint.format import load_model
    from moe_lm.data.tokenizer import load_data_tokenizer

    run = trained_run(max_steps=2)
    proc = cli("export", "--run", run, "--out", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "hf" / "tokenizer.model").is_file()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")  # the export is usable by HF tools as is
    text = "stir the onions slowly\n\tline 7\n"
    ours = load_data_tokenizer(tiny_data.out_dir)
    assert tok(text).input_ids == [ours.bos_id, *ours.encode(text)]  # what training and generate.py feed the model
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert config["bos_token_id"] == generation["bos_token_id"] == ours.bos_id
    assert config["eos_token_id"] == generation["eos_token_id"] == ours.eos_id
    _, model, _ = load_model(run)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, 300, (2, 16))
    assert (hf(tokens).logits - logits(model, tokens)).abs().max().item() <= 1e-4


def test_importing_a_folder_with_code_of_its_own_is_refused_and_its_code_never_runs(tmp_path, monkeypatch):
    """import_hf, which train.init_from=hf:PATH uses (through the same config reader)."""
    folder = remote_code_folder(tmp_path / "custom")
    asked = answer_yes_if_asked(monkeypatch)
    with pytest.raises(ValueError, match=r"its config.json asks to run the folder's own Python code") as err:
        import_hf(folder)
    assert "\n" not in str(err.value) and "deepseek_v3, glm4_moe" in str(err.value)
    assert not asked and not (folder / "RAN").exists()
