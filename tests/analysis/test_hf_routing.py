"""Routing analytics of transformers MoE checkpoints: the trace holds what each architecture's gate chose.

Per architecture, a tiny random model made by transformers itself (config -> model -> save_pretrained, with a
tiny tokenizer), with non-trivial selection biases where the architecture has them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moe_lm.analysis.hf_routing import SUPPORTED, hf_routing
from moe_lm.routing.recorder import RoutingRecorder
from tests.helpers.hf import answer_yes_if_asked, remote_code_folder
from tests.helpers.runs import WORDS, make_text

COMMON = dict(
    vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, num_experts_per_tok=2,
)  # fmt: skip
# MLA has no grouped keys: as many key/value heads as query heads
MLA = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
CONFIGS = {
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, **MLA, n_routed_experts=8, n_shared_experts=1,
        moe_intermediate_size=16, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
    ),
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        **{**COMMON, "num_key_value_heads": 4}, **MLA, n_routed_experts=8, n_shared_experts=1,
        moe_intermediate_size=16, n_group=4, topk_group=2, topk_method="group_limited_greedy", first_k_dense_replace=1,
    ),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        **COMMON, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=16, n_group=4, topk_group=2,
        first_k_dense_replace=1, head_dim=8,
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON, num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=16,
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, num_experts=8, moe_intermediate_size=16, head_dim=8),
    "olmoe": lambda: transformers.OlmoeConfig(**COMMON, num_experts=8),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=8),
}  # fmt: skip
TEXT = [" ".join(words) for words in WORDS.values()] * 20


def tiny_tokenizer(folder: Path) -> None:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=290, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXT, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


def tiny_checkpoint(kind: str, folder: Path) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind](), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else None
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a strong, uneven selection bias
                buf.copy_(torch.linspace(-0.3, 0.3, buf.numel())[torch.randperm(buf.numel())])
    model.save_pretrained(folder)
    tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="module", params=SUPPORTED)
def checkpoint(request, tmp_path_factory):
    return request.param, tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def test_every_supported_architecture_is_covered():
    assert set(CONFIGS) == set(SUPPORTED)


@torch.no_grad()
def test_recorded_choices_are_what_the_gate_chose_and_all_the_model_used(checkpoint):
    kind, path = checkpoint
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = hf_routing(hf)
    tokens = torch.randint(0, 290, (3, 40), generator=torch.Generator().manual_seed(1))
    gate_inputs = {}
    hooks = [
        g.register_forward_pre_hook(lambda m, a, l=l: gate_inputs.__setitem__(l, a[0]))
        for l, g in model.routers.items()
    ]
    with RoutingRecorder(model.routers) as rec:
        logits = model.forward(tokens)
    for h in hooks:
        h.remove()
    assert sorted(rec.last) == model.layers and len(rec.last) >= 2
    biased = False
    for layer, gate in model.routers.items():
        idx, w = rec.last[layer]
        assert idx.shape == (3 * 40, gate.top_k)
        _, own_w, own_idx = gate(gate_inputs[layer])  # the gate's own output, called again on the same input
        assert torch.equal(idx.sort(-1).values, own_idx.sort(-1).values)
        assert (w[:, :-1] >= w[:, 1:]).all()  # largest weight first
        order = own_idx.argsort(-1)
        torch.testing.assert_close(
            w.gather(1, idx.argsort(-1)), own_w.float().gather(1, order), rtol=0, atol=0
        )  # each expert keeps its own weight
        if hasattr(gate, "e_score_correction_bias"):
            plain = (gate_inputs[layer].reshape(-1, gate.hidden_dim) @ gate.weight.T).sigmoid().topk(gate.top_k).indices
            biased |= not torch.equal(plain.sort(-1).values, idx.sort(-1).values)
    if kind in ("deepseek_v3", "glm4_moe"):
        assert biased, "the selection bias changed no choice: the test would not see it"

    # a forward pass whose gates return exactly the recorded experts and weights gives the same logits
    def replay(layer):
        return lambda m, args, out: (out[0], rec.last[layer][1].to(out[1].dtype), rec.last[layer][0])

    hooks = [g.register_forward_hook(replay(layer)) for layer, g in model.routers.items()]
    try:
        replayed = model.forward(tokens)
    finally:
        for h in hooks:
            h.remove()
    torch.testing.assert_close(replayed, logits, rtol=0, atol=1e-6)


def test_analyze_routing_cli_on_the_checkpoint(checkpoint, cli, tmp_path):
    """The talk's set-up: a parquet file whose `subject` column names the domain (as MMLU's subjects)."""
    kind, path = checkpoint
    subjects = dict(zip(("abstract_algebra", "professional_law", "world_religions"), WORDS, strict=True))
    rows = [{"question": make_text(d, i), "subject": s} for s, d in subjects.items() for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "mmlu_like.parquet")
    out = tmp_path / "report"
    data = ["--data", tmp_path / "mmlu_like.parquet", "--text-field", "question", "--domain-field", "subject"]
    chart = ["--chart-tokens", "the", "--min-count", "3"]
    proc = cli("analyze", "--hf", path, *data, "--out", out, *chart, "--max-tokens", "20000", "--seq-len", "64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((out / "trace" / "meta.json").read_text())
    assert meta["provenance"]["model_type"] == kind and meta["domains"] == list(subjects)
    assert meta["n_experts"] == 8 and meta["k"] == 2 and meta["n_tokens"] > 500
    assert (out / "trace_init" / "meta.json").is_file() and (out / "routing.html").is_file()
    result = json.loads((out / "metrics.json").read_text())
    assert set(map(int, result["layers"])) == set(meta["layers"])
    shares = np.array(result["layers"][str(meta["layers"][0])]["domain_token_share"])
    np.testing.assert_allclose(shares.sum(1), 2.0)  # each domain's top-2 shares sum to k
    assert list((out / "figures").glob("domain_experts_L*.png"))


def test_an_unsupported_architecture_is_a_clear_error():
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    with pytest.raises(ValueError, match="'llama' is not supported.*deepseek_v3"):
        hf_routing(transformers.AutoModelForCausalLM.from_config(cfg))


@torch.no_grad()
def test_the_ablation_replica_of_each_gate_reproduces_it_and_routes_around(checkpoint):
    """Each gate's rule (`GATE_RULES`) with nothing dropped gives the gate's own experts and weights; with experts
    dropped, no token is routed to them and each keeps its other choices where its groups allow."""
    from moe_lm.analysis.ablation import route_around
    from moe_lm.analysis.hf_routing import GATE_RULES

    kind, path = checkpoint
    model = hf_routing(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    tokens = torch.randint(0, 290, (2, 48), generator=torch.Generator().manual_seed(2))
    seen = {}
    hooks = [g.register_forward_hook(lambda m, a, o, l=l: seen.__setitem__(l, o)) for l, g in model.routers.items()]
    model.forward(tokens)
    for h in hooks:
        h.remove()
    for layer, gate in model.routers.items():
        logits, own_w, own_idx = seen[layer]
        w, idx = GATE_RULES[kind](gate, logits, [])
        assert torch.equal(idx.sort(-1).values, own_idx.sort(-1).values)
        torch.testing.assert_close(w.float().gather(1, idx.argsort(-1)), own_w.float().gather(1, own_idx.argsort(-1)))
    layer = model.layers[0]
    with RoutingRecorder(model.routers) as rec:
        model.forward(tokens)
        before = rec.last[layer][0].clone()
        with route_around(model, layer, [0, 3]):
            model.forward(tokens)
            after = rec.last[layer][0]
    assert ((before == 0) | (before == 3)).any() and not ((after == 0) | (after == 3)).any()


def test_ablate_experts_cli_on_the_checkpoint(checkpoint, cli, tmp_path):
    kind, path = checkpoint
    subjects = dict(zip(("abstract_algebra", "professional_law", "world_religions"), WORDS, strict=True))
    rows = [{"text": make_text(d, i), "subject": s} for s, d in subjects.items() for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    layer = hf_routing(transformers.AutoModelForCausalLM.from_pretrained(path)).layers[0]
    data = ["--data", tmp_path / "rows.parquet", "--domain-field", "subject"]
    flags = ["--targets", f"{layer}:1,2", "--controls", "1", "--n-boot", "50", "--seq-len", "64"]
    proc = cli("ablate", "--hf", path, "--out", tmp_path / "a", *data, *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "a" / "ablation.json").read_text())
    [row] = result["ablations"]
    assert row["layer"] == layer and row["experts"] == [1, 2] and set(row["by_domain"]) == set(subjects)
    assert result["subject"]["model_type"] == kind and (tmp_path / "a" / "ablation.png").is_file()


@pytest.mark.parametrize("command", ["analyze", "ablate"])
def test_a_model_folder_with_code_of_its_own_is_refused_and_its_code_never_runs(tmp_path, cli, monkeypatch, command):
    folder = remote_code_folder(tmp_path / "custom")
    asked = answer_yes_if_asked(monkeypatch)
    (tmp_path / "doc.txt").write_text(make_text("cooking", 0))
    proc = cli(command, "--hf", folder, "--data", tmp_path / "doc.txt", "--out", tmp_path / "out")
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: {folder}: its config.json asks to run the folder's own Python code")
    assert "trust_remote_code is off" in line and ", ".join(SUPPORTED) in line
    assert not asked and not (folder / "RAN").exists()


def test_a_served_folder_with_code_of_its_own_is_refused_and_its_code_never_runs(tmp_path, cli, monkeypatch):
    """`--served` (the checkpoint an engine served) reads a folder's config and tokenizer as `--hf` does."""
    from moe_lm.interop.routes.vllm import vllm_response

    folder = remote_code_folder(tmp_path / "custom")
    asked = answer_yes_if_asked(monkeypatch)
    routes = np.tile(np.array([0, 1]), (5, 3, 1))  # 6 tokens: the last sampled one never routed
    (tmp_path / "routes.jsonl").write_text(json.dumps(vllm_response(np.arange(6), 3, routes, 8)) + "\n")
    proc = cli("analyze", "--routes", tmp_path / "routes.jsonl", "--served", folder, "--out", tmp_path / "out")
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "asks to run the folder's own Python code" in lines[0]
    assert not asked and not (folder / "RAN").exists()


class PickledCall:
    """What an attacker pickles into a pytorch_model.bin: unpickling it calls os.system."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_device_auto_over_a_pickled_checkpoint_runs_none_of_it(tmp_path, cli):
    """`--device auto` hands the folder to transformers' own loader, which took a pytorch_model.bin (a pickle) to
    torch.load: weights-only refused the pickled call, but as a traceback. Safetensors only, checked first, as the
    CPU path reads them: one line, and nothing of the pickle runs."""
    from safetensors.torch import load_file

    folder = tiny_checkpoint("qwen3_moe", tmp_path / "bin")
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save({**state, "payload": PickledCall(tmp_path / "RAN")}, folder / "pytorch_model.bin")
    (tmp_path / "doc.txt").write_text(make_text("cooking", 0))
    proc = cli("analyze", "--hf", folder, "--device", "auto", "--data", tmp_path / "doc.txt", "--out", tmp_path / "o")
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"{folder} holds no .safetensors file" in lines[0]
    assert not (tmp_path / "RAN").exists() and not (tmp_path / "o").exists()
