"""The pruned model in each subject's own format (moe_lm/pruning/hf_folder.py, gguf_file.py, fp8_release.py), each
checked in the tool that reads it against the reference of what pruning means: the source with the pruned experts'
selection bias at -inf (transformers for the folder, llama.cpp for the GGUF, moe-lm's release reader for FP8), and
the kept experts' bytes the source's."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from moe_lm.errors import UserError
from moe_lm.interop.hf import export_hf
from moe_lm.interop.hf_layers import HFCheckpoint
from moe_lm.interop.released_weights import SCALE_SUFFIX
from moe_lm.output_folder import FOLDER_KINDS, made_by
from moe_lm.pruning import safetensors_shards
from moe_lm.pruning.fp8_release import prune_fp8_release
from moe_lm.pruning.gguf_file import prune_gguf
from moe_lm.pruning.hf_folder import prune_hf_folder
from tests.helpers.hf import random_model
from tests.helpers.pruned_sources import SIXTEEN, VOCAB

# 16 experts in 4 groups of 4, top-3 from 2 groups: each layer keeps 2 of every group, other ones in each layer
KEEP = {1: [0, 2, 5, 7, 8, 9, 13, 14], 2: [1, 3, 4, 6, 10, 11, 12, 15]}


def masked(hf_model, keep: dict[int, list[int]], n_experts: int):
    """A transformers model with the experts `keep` leaves out unselectable: their selection bias at -inf."""
    with torch.no_grad():
        for layer, kept in keep.items():
            gone = [e for e in range(n_experts) if e not in kept]
            hf_model.model.layers[layer].mlp.gate.e_score_correction_bias[gone] = float("-inf")
    return hf_model


def load(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text and len(text) < 600, text
    return text


# ---- a transformers folder --------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["mla", "gqa"])
def exported(request, tmp_path_factory):
    """An export of a tiny model with 16 routed experts, group-limited routing and non-zero biases: MLA in one file,
    GQA in shards with an index."""
    folder = tmp_path_factory.mktemp(f"hf_{request.param}") / "source"
    export_hf(random_model(request.param, **SIXTEEN), folder, max_shard_size="20KB" if request.param == "gqa" else None)
    return folder


def test_a_pruned_folder_loads_in_transformers_as_the_source_with_the_pruned_experts_masked(exported, tmp_path):
    out = prune_hf_folder(exported, tmp_path / "pruned", KEEP)
    if (exported / "model.safetensors.index.json").is_file():  # every shard still holding a tensor, in the index
        shards = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())
        assert len(shards) > 5 and shards == {p.name for p in out.glob("*.safetensors")}
    pruned = load(out)
    assert pruned.config.n_routed_experts == 8 and pruned.config.n_group == 4 and pruned.config.topk_group == 2
    tokens = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = masked(load(exported), KEEP, 16)(tokens).logits
        source = load(exported)(tokens).logits
        torch.testing.assert_close(pruned(tokens).logits, reference, atol=1e-5, rtol=0)
    assert (source - reference).abs().max() > 1e-2  # the pruned experts mattered: the check is not vacuous
    original = load(exported)
    for layer, kept in KEEP.items():  # the router's rows and biases are the kept experts', in order
        gate, source_gate = pruned.model.layers[layer].mlp.gate, original.model.layers[layer].mlp.gate
        assert torch.equal(gate.weight, source_gate.weight[kept])
        assert torch.equal(gate.e_score_correction_bias, source_gate.e_score_correction_bias[kept])


KEEP7 = {1: [0, 2, 5, 7, 8, 9, 13], 2: [1, 3, 4, 6, 10, 11, 15]}  # 7 of 16: no equal share of the 4 groups


def test_an_ungrouped_folder_loads_in_transformers_as_the_source_ungrouped_and_masked(exported, tmp_path):
    """--ungroup: transformers' own routers of the copy (n_group and topk_group 1) give the source routed without
    groups, the pruned experts masked; with its groups the masked source differs (the groups are dropped, seen)."""
    with pytest.raises(UserError, match="same number"):
        prune_hf_folder(exported, tmp_path / "grouped", KEEP7)
    out = prune_hf_folder(exported, tmp_path / "pruned", KEEP7, ungroup=True)
    pruned = load(out)
    assert (pruned.config.n_routed_experts, pruned.config.n_group, pruned.config.topk_group) == (7, 1, 1)
    tokens = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    ungrouped = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32, n_group=1,
                                                                  topk_group=1).eval()  # fmt: skip
    with torch.no_grad():
        reference = masked(ungrouped, KEEP7, 16)(tokens).logits
        torch.testing.assert_close(pruned(tokens).logits, reference, atol=1e-5, rtol=0)
        grouped = masked(load(exported), KEEP7, 16)(tokens).logits
    assert (grouped - reference).abs().max() > 1e-3


def test_keeping_every_expert_gives_the_source(exported, tmp_path):
    out = prune_hf_folder(exported, tmp_path / "all", {1: list(range(16)), 2: list(range(16))})
    tokens = torch.randint(0, 97, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(load(out)(tokens).logits, load(exported)(tokens).logits)
    assert {n for f in out.glob("*.safetensors") for n in load_file(f)} == {
        n for f in exported.glob("*.safetensors") for n in load_file(f)
    }
    assert (out / "generation_config.json").read_bytes() == (exported / "generation_config.json").read_bytes()
    assert made_by(out) not in FOLDER_KINDS  # a transformers folder, never taken for a (pruned) run folder


def test_the_stacked_expert_layout_is_pruned_along_the_expert_axis(exported, tmp_path):
    """A folder with transformers' stacked experts ([E, 2I, D] gate_up_proj, [E, D, I] down_proj) pruned gives the
    stacks of the per-expert folder pruned: the kept experts' slices in order."""
    state = {n: t for f in exported.glob("*.safetensors") for n, t in load_file(f).items()}
    stacked = {n: t for n, t in state.items() if ".mlp.experts." not in n}
    for layer in KEEP:
        e = f"model.layers.{layer}.mlp.experts."
        gate_up = [torch.cat([state[f"{e}{j}.gate_proj.weight"], state[f"{e}{j}.up_proj.weight"]]) for j in range(16)]
        stacked[e + "gate_up_proj"] = torch.stack(gate_up)
        stacked[e + "down_proj"] = torch.stack([state[f"{e}{j}.down_proj.weight"] for j in range(16)])
    source = tmp_path / "stacked"
    source.mkdir()
    save_file(stacked, source / "model.safetensors")
    shutil.copy(exported / "config.json", source / "config.json")
    got = load_file(prune_hf_folder(source, tmp_path / "out", KEEP) / "model.safetensors")
    for layer, kept in KEEP.items():
        e = f"model.layers.{layer}.mlp.experts."
        assert torch.equal(got[e + "gate_up_proj"], stacked[e + "gate_up_proj"][kept])
        assert torch.equal(got[e + "down_proj"], stacked[e + "down_proj"][kept])
    assert got.keys() == stacked.keys()


@pytest.mark.parametrize(
    "keep, said",
    [({1: KEEP[1]}, "names no experts for MoE layer(s) [2]"),
     ({**KEEP, 0: KEEP[1]}, "names layer(s) [0], which are not MoE layers"),
     ({1: KEEP[1], 2: KEEP[2][:-2] + [15]}, "every MoE layer must keep the same number"),
     ({1: KEEP[1], 2: KEEP[2][::-1]}, "must be ascending, each once"),
     ({1: KEEP[1], 2: [*KEEP[2][:-1], 16]}, "is not an expert id (0 to 15)"),
     ({1: [0, 1, 2, 4, 5, 6, 8, 9], 2: KEEP[2]}, "keeps [3, 3, 2, 0] experts in its 4 groups"),
     ({1: [0, 4, 8, 12], 2: [1, 5, 9, 13]}, "at least 2"),
     ({1: [0, 1], 2: [2, 3]}, "fewer than the 3 each token chooses")],
)  # fmt: skip
def test_a_keep_that_does_not_fit_the_model_is_one_line_naming_the_config(exported, tmp_path, keep, said):
    with pytest.raises(UserError) as e:
        prune_hf_folder(exported, tmp_path / "out", keep)
    assert said in one_line(e) and str(exported / "config.json") in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_outputs_that_are_not_new_are_refused_and_a_full_disk_is_one_line(exported, tmp_path, monkeypatch):
    for out, said in [(exported, "is the source itself"), (exported / "sub", "lies inside the source")]:
        with pytest.raises(UserError) as e:
            prune_hf_folder(exported, out, KEEP)
        assert said in one_line(e)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep me")
    with pytest.raises(UserError) as e:
        prune_hf_folder(exported, tmp_path / "full", KEEP)
    assert "not empty" in one_line(e) and (tmp_path / "full" / "mine.txt").read_text() == "keep me"

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors_shards, "_write_shard", no_space)
    with pytest.raises(UserError) as e:
        prune_hf_folder(exported, tmp_path / "new", KEEP)
    assert "disk filled up" in one_line(e) and str(tmp_path / "new") in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # nothing half-written left behind


# ---- a Qwen3-MoE folder: a softmax router ---------------------------------------------------------------------------

QWEN_KEEP = {0: [0, 2, 3, 6, 7], 1: [1, 2, 4, 5, 7], 2: [0, 1, 3, 4, 5]}  # 5 of 8 experts, top-2, no groups


def softmax_masked(model, keep: dict[int, list[int]], n_experts: int):
    """Qwen3-MoE with the experts `keep` leaves out unselectable, its gate written out here: the logits of the pruned
    experts at -inf before the softmax, then the top-k renormalised (norm_topk_prob)."""
    for layer, kept in keep.items():
        gate = model.model.layers[layer].mlp.gate
        gone = [e for e in range(n_experts) if e not in kept]

        def forward(hidden, gate=gate, gone=gone):
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            probs = logits.index_fill(-1, torch.tensor(gone), float("-inf")).softmax(-1, dtype=torch.float)
            weights, experts = probs.topk(gate.top_k, dim=-1)
            return logits, (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), experts

        gate.forward = forward
    return model


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from tests.helpers.released import qwen3_moe
    from tests.helpers.released import random_model as random_hf_model

    folder = tmp_path_factory.mktemp("qwen3") / "source"
    random_hf_model(qwen3_moe()).save_pretrained(folder)
    return folder


def test_a_pruned_qwen3_moe_folder_loads_in_transformers_as_the_source_with_the_pruned_experts_masked(qwen3, tmp_path):
    """A softmax router: the pruned copy's softmax over the kept experts, renormalised over its top-k, gives what the
    source gives with the pruned experts' logits at -inf."""
    pruned = load(prune_hf_folder(qwen3, tmp_path / "pruned", QWEN_KEEP))
    assert pruned.config.num_experts == 5
    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = softmax_masked(load(qwen3), QWEN_KEEP, 8)(tokens).logits
        source = load(qwen3)(tokens).logits
        torch.testing.assert_close(pruned(tokens).logits, reference, atol=1e-5, rtol=0)
        every = load(prune_hf_folder(qwen3, tmp_path / "all", {i: list(range(8)) for i in QWEN_KEEP}))
        assert torch.equal(every(tokens).logits, source)  # a 0 % prune is the source
    assert (source - reference).abs().max() > 1e-2  # the pruned experts mattered: the check is not vacuous


def test_a_qwen3_moe_folder_without_renormalised_top_k_is_refused(qwen3, tmp_path):
    """Without norm_topk_prob a chosen expert's weight is its share of every expert's softmax: no pruned copy computes
    the masked source, so prune says so in one line."""
    from moe_lm.pruning.formats import SafetensorsFormat

    source = tmp_path / "plain"
    shutil.copytree(qwen3, source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "norm_topk_prob": False}))
    with pytest.raises(UserError) as e:
        SafetensorsFormat(None, source)
    assert "norm_topk_prob is false" in one_line(e)


# ---- a DeepSeek FP8 release ----------------------------------------------------------------------------------------


def test_a_pruned_fp8_release_reads_as_the_source_with_the_pruned_experts_masked(release16, tmp_path, monkeypatch):
    """Streamed in pieces smaller than one tensor; the kept experts' FP8 bytes and block scales are the source's under
    their new ids, and moe-lm's reader of releases computes the masked source's logits from it."""
    source = release16
    keep = {layer: KEEP[1 + (layer % 2)] for layer in (1, 2, 3)}  # the helper's DeepseekV3 has MoE layers 1..3
    monkeypatch.setattr(safetensors_shards, "COPY_BYTES", 1000)
    out = prune_fp8_release(source, tmp_path / "pruned", keep)

    config = transformers.AutoConfig.from_pretrained(out)
    assert config.n_routed_experts == 8 and json.loads((out / "config.json").read_text())["quantization_config"]
    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        pruned = HFCheckpoint(out, config).model()(tokens).logits
        whole = HFCheckpoint(source, transformers.AutoConfig.from_pretrained(source)).model()
        torch.testing.assert_close(pruned, masked(whole, keep, 16)(tokens).logits, atol=1e-5, rtol=0)

    def stored(folder):
        return {n: t for shard in folder.glob("*.safetensors") for n, t in load_file(shard).items()}

    before, after = stored(source), stored(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(after) and all((out / f).is_file() for f in set(index.values()))
    e = "model.layers.{}.mlp.experts.{}.{}_proj.weight"
    for layer, kept in keep.items():
        for new, old in enumerate(kept):
            for which in ("gate", "up", "down"):
                for suffix in ("", SCALE_SUFFIX):
                    a, b = after[e.format(layer, new, which) + suffix], before[e.format(layer, old, which) + suffix]
                    assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert after[e.format(layer, 0, "gate")].dtype == torch.float8_e4m3fn
        assert not any(k.startswith(f"model.layers.{layer}.mlp.experts.8.") for k in after)
        router = f"model.layers.{layer}.mlp.gate."
        assert torch.equal(after[router + "weight"], before[router + "weight"][kept])
        assert torch.equal(after[router + "e_score_correction_bias"], before[router + "e_score_correction_bias"][kept])
    unrouted = [n for n in before if ".mlp.experts." not in n and ".mlp.gate." not in n]
    assert all(torch.equal(after[n].view(torch.uint8), before[n].view(torch.uint8)) for n in unrouted)


def test_a_folder_without_fp8_is_not_taken_for_a_release(exported, tmp_path):
    with pytest.raises(UserError) as e:
        prune_fp8_release(exported, tmp_path / "out", KEEP)
    assert "not an FP8 release" in one_line(e)


# ---- a GGUF file ---------------------------------------------------------------------------------------------------


def masked_gguf(source: Path, out: Path, keep: dict[int, list[int]]) -> Path:
    """A copy of `source` with exp_probs_b at -inf for the experts `keep` leaves out (patched in place: the file is
    otherwise the source's, byte for byte)."""
    shutil.copy(source, out)
    reader = gguf.GGUFReader(out, "r+")
    for t in reader.tensors:
        if t.name.endswith(".exp_probs_b.bias"):
            kept = keep[int(t.name.split(".")[1])]
            t.data[[e for e in range(t.data.shape[0]) if e not in kept]] = -np.inf
    reader.data.flush()
    return out


def ungrouped_gguf(path: Path) -> Path:
    """`path` patched in place to route without expert groups (expert_group_count and _used_count 1)."""
    reader = gguf.GGUFReader(path, "r+")
    arch = reader.fields["general.architecture"].contents()
    for key in (f"{arch}.expert_group_count", f"{arch}.expert_group_used_count"):
        field = reader.fields[key]
        field.parts[field.data[0]][0] = 1
    reader.data.flush()
    return path


def run_llama_cpp(path: Path, tokens: np.ndarray):
    """(routing, logits [T, vocab]) of one sequence in llama.cpp."""
    import llama_cpp

    from moe_lm.interop.llama_cpp import GGUFModel

    model = GGUFModel(path, n_ctx=128)
    try:
        routed = model.route(tokens)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(model._ctx), shape=(len(tokens), model.n_vocab))
        return routed, logits.copy()
    finally:
        model.close()


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_a_pruned_gguf_runs_in_llama_cpp_as_the_source_with_the_pruned_experts_masked(ggufs, tmp_path, kind):
    """llama.cpp's own routing of the pruned file: the masked source's experts (renumbered), gate weights and
    logits; the source unmasked routes otherwise (the check is not vacuous)."""
    pytest.importorskip("llama_cpp")
    out = prune_gguf(ggufs / f"{kind}.gguf", tmp_path / "pruned.gguf", KEEP)
    reference = masked_gguf(ggufs / f"{kind}.gguf", tmp_path / "masked.gguf", KEEP)
    tokens = np.random.default_rng(0).integers(0, VOCAB, 100)
    (ours, logits), (theirs, expected) = run_llama_cpp(out, tokens), run_llama_cpp(reference, tokens)
    for layer, kept in KEEP.items():
        assert np.array_equal(np.asarray(kept)[ours.experts[layer]], theirs.experts[layer]), layer
        np.testing.assert_allclose(ours.weights[layer], theirs.weights[layer], rtol=0, atol=1e-6)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5)
    source, _ = run_llama_cpp(ggufs / f"{kind}.gguf", tokens)
    assert any(not np.isin(source.experts[layer], kept).all() for layer, kept in KEEP.items())


def test_an_ungrouped_gguf_runs_in_llama_cpp_as_the_source_ungrouped_and_masked(ggufs, tmp_path):
    """--ungroup: llama.cpp's own routing of the copy (group keys 1) is the source's without groups, masked."""
    pytest.importorskip("llama_cpp")
    out = prune_gguf(ggufs / "f32.gguf", tmp_path / "pruned.gguf", KEEP7, ungroup=True)
    fields = gguf.GGUFReader(out).fields
    assert [fields[f"deepseek2.{k}"].contents() for k in ("expert_count", "expert_group_count",
                                                          "expert_group_used_count")] == [7, 1, 1]  # fmt: skip
    reference = ungrouped_gguf(masked_gguf(ggufs / "f32.gguf", tmp_path / "masked.gguf", KEEP7))
    tokens = np.random.default_rng(0).integers(0, VOCAB, 100)
    (ours, logits), (theirs, expected) = run_llama_cpp(out, tokens), run_llama_cpp(reference, tokens)
    for layer, kept in KEEP7.items():
        assert np.array_equal(np.asarray(kept)[ours.experts[layer]], theirs.experts[layer]), layer
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5)
    _, grouped = run_llama_cpp(masked_gguf(ggufs / "f32.gguf", tmp_path / "grouped.gguf", KEEP7), tokens)
    assert np.abs(grouped - expected).max() > 1e-3  # the group keys were read: dropping them is seen


def test_a_quantised_gguf_is_sliced_byte_for_byte(ggufs, tmp_path):
    """Q8_0 experts: each kept expert's bytes in the pruned file are the source's, which are one contiguous range of
    the source file (the expert axis is outermost); the router rows and biases are the kept ones; every other tensor
    and every key but expert_count is the source's."""
    source = gguf.GGUFReader(ggufs / "q8_0.gguf")
    out = gguf.GGUFReader(prune_gguf(ggufs / "q8_0.gguf", tmp_path / "pruned.gguf", KEEP))
    raw = (ggufs / "q8_0.gguf").read_bytes()
    before, after = {t.name: t for t in source.tensors}, {t.name: t for t in out.tensors}
    assert before.keys() == after.keys()
    quantised = [n for n, t in before.items() if "_exps." in n and t.tensor_type == gguf.GGMLQuantizationType.Q8_0]
    assert len(quantised) == 6  # gate, up and down of both MoE blocks
    for name, t in before.items():
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        if layer in KEEP and ("_exps." in name or ".ffn_gate_inp." in name or ".exp_probs_b." in name):
            kept = KEEP[layer]
            per = t.n_bytes // 16
            assert after[name].tensor_type == t.tensor_type and list(after[name].shape) == [*t.shape[:-1], 8]
            for new, old in enumerate(kept):
                piece = bytes(np.asarray(after[name].data[new]).tobytes())
                assert piece == raw[t.data_offset + old * per : t.data_offset + (old + 1) * per], (name, old)
        else:
            assert after[name].tensor_type == t.tensor_type and np.array_equal(after[name].data, t.data), name
    fields = {n: f.contents() for n, f in out.fields.items() if not n.startswith("GGUF.")}
    assert fields.pop("deepseek2.expert_count") == 8
    assert fields == {n: f.contents() for n, f in source.fields.items()
                      if not n.startswith("GGUF.") and n != "deepseek2.expert_count"}  # fmt: skip
    assert fields["deepseek2.expert_group_count"] == 4 and fields["deepseek2.expert_group_used_count"] == 2


def test_a_gguf_that_exists_is_not_replaced_and_a_full_disk_leaves_nothing(ggufs, tmp_path, monkeypatch):
    (tmp_path / "there.gguf").write_bytes(b"mine")
    with pytest.raises(UserError) as e:
        prune_gguf(ggufs / "f32.gguf", tmp_path / "there.gguf", KEEP)
    assert "exists" in one_line(e) and (tmp_path / "there.gguf").read_bytes() == b"mine"
    with pytest.raises(UserError) as e:
        prune_gguf(ggufs / "f32.gguf", tmp_path / "bad.gguf", {1: KEEP[1]})
    assert "f32.gguf: keep names no experts for MoE layer(s) [2]" in one_line(e)

    def short_write(self, *a, **k):
        raise OSError("4194304 requested and 1000 written")  # numpy's tofile on a full disk

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", short_write)
    with pytest.raises(UserError) as e:
        prune_gguf(ggufs / "f32.gguf", tmp_path / "full.gguf", KEEP)
    assert "disk filled up" in one_line(e) and "full.gguf" in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there.gguf"]
