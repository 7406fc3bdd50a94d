"""`moe-lm prune` on every subject kind it can write (--hf, an FP8 release through --hf, --gguf), end to end in
process: each pruned model read in its own reader gives the source's logits with the pruned experts' selection bias
at -inf (test_formats.py's references), prune.json with it; a NextN layer the trace does not reach keeps the last
traced layer's ids; criteria a kind cannot give are one line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from moe_lm.interop.hf_layers import HFCheckpoint
from moe_lm.output_folder import made_by
from moe_lm.pruning.plan import KeepPlan
from moe_lm.routing.trace import Trace
from tests.helpers.pruned_sources import VOCAB
from tests.pruning.test_formats import load, masked, masked_gguf, run_llama_cpp


def plan_of(path) -> KeepPlan:
    return KeepPlan.from_json(json.loads(path.read_text()))


@pytest.fixture(scope="module")
def pruned_hf(ggufs, tiny_data, tmp_path_factory, cli):
    out = tmp_path_factory.mktemp("pruned_hf") / "f8"
    proc = cli("prune", "--hf", ggufs / "hf", "--data", tiny_data.sources[0], "--criterion", "frequency",
               "--keep", "8", "--max-tokens", "300", "--out", out)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kept 8 of 16 routed experts in each of 2 MoE layers (frequency)" in proc.stdout
    return out


def test_a_transformers_folder_pruned_loads_as_the_source_with_the_pruned_experts_masked(ggufs, pruned_hf):
    plan = plan_of(pruned_hf / "prune.json")
    assert plan.about["source"] == {"format": "transformers", "path": str(ggufs / "hf")}
    assert plan.layers == [1, 2] and made_by(pruned_hf) == "prune-copy"
    # the frequencies of the calibration trace recorded from the folder, kept in the copy
    trace = Trace(pruned_hf / "calibration_trace")
    assert trace.n == 300 and plan.about["calibration"]["trace"] == "calibration_trace"
    for layer in plan.layers:
        counts = np.bincount(np.asarray(trace.experts(layer)).ravel(), minlength=16)
        assert plan.scores[layer] == tuple(float(c) for c in counts)
    pruned = load(pruned_hf)  # prune.json and calibration_trace/ in the folder do not disturb transformers
    assert pruned.config.n_routed_experts == 8
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = masked(load(ggufs / "hf"), plan.kept, 16)(tokens).logits
        torch.testing.assert_close(pruned(tokens).logits, reference, atol=1e-5, rtol=0)
        assert (load(ggufs / "hf")(tokens).logits - reference).abs().max() > 1e-2  # not vacuous


def test_a_transformers_models_norms_are_its_own_experts_outputs(ggufs, pruned_hf):
    """The norms column of a trace recorded from a transformers folder: for chosen (token, slot) pairs of the first
    window, ||down_e (silu(gate_e x) * up_e x)|| of the expert the trace names, from transformers' stacked weights and
    the input its experts module received, in the trace's order (largest gate weight first)."""
    trace = Trace(pruned_hf / "calibration_trace")
    assert "norms" in trace.columns
    model = load(ggufs / "hf")
    first = int(np.argmax(np.asarray(trace.doc) != trace.doc[0])) or trace.n  # the first document's rows
    window = torch.from_numpy(np.asarray(trace.token[: min(first, trace.meta["windows"])], np.int64))[None]
    inputs = {}
    hooks = [model.model.layers[i].mlp.experts.register_forward_pre_hook(
        lambda m, a, i=i: inputs.__setitem__(i, a[0])) for i in trace.layers]  # fmt: skip
    with torch.no_grad():
        model(window)
    for h in hooks:
        h.remove()
    for layer in trace.layers:
        experts = model.model.layers[layer].mlp.experts
        I = experts.down_proj.shape[2]
        for t in (0, 7, window.shape[1] - 1):
            for k in range(trace.k):
                e = int(trace.experts(layer)[t, k])
                gate, up = experts.gate_up_proj[e, :I], experts.gate_up_proj[e, I:]
                x = inputs[layer][t]
                with torch.no_grad():
                    f = experts.down_proj[e] @ (torch.nn.functional.silu(gate @ x) * (up @ x))
                assert float(trace.norms(layer)[t, k]) == pytest.approx(float(f.norm()), rel=2e-3), (layer, t, k)
        w = np.asarray(trace.weights(layer))
        assert (np.diff(w, axis=1) <= 0).all()  # the weights the norms were ordered by: largest first


def test_reap_of_a_folder_streamed_from_disk_is_reap_of_the_folder_held_in_memory(ggufs, pruned_hf, tiny_data,
                                                                                   tmp_path, cli):  # fmt: skip
    """A folder streamed a layer at a time records its experts' output norms from its own expert passes: the same
    saliency as the model held in memory records by its hooks (float16 norms), and the same plan."""
    trace = pruned_hf / "calibration_trace"
    whole = cli("prune", "--hf", ggufs / "hf", "--trace", trace, "--criterion", "reap", "--keep", "8", "--out",
                tmp_path / "whole")  # fmt: skip
    streamed = cli("prune", "--hf", ggufs / "hf", "--data", tiny_data.sources[0], "--criterion", "reap", "--keep", "8",
                   "--max-tokens", "300", "--max-memory", "1MiB", "--out", tmp_path / "streamed")  # fmt: skip
    assert whole.returncode == 0 and streamed.returncode == 0, whole.stderr[-2000:] + streamed.stderr[-2000:]
    assert "streamed" in streamed.stdout
    a, b = plan_of(tmp_path / "whole" / "prune.json"), plan_of(tmp_path / "streamed" / "prune.json")
    for layer in a.layers:
        np.testing.assert_allclose(b.scores[layer], a.scores[layer], rtol=2e-3)
    assert a.kept == b.kept


def test_a_nextn_layer_the_trace_does_not_reach_keeps_the_last_traced_layers_ids(ggufs, pruned_hf, tmp_path, cli):
    """A folder with an MTP layer after the decoder (transformers does not run it, so no trace reaches it), pruned
    from a trace (no --data needed): it keeps layer 2's ids; the next-token logits are as before."""
    source = tmp_path / "with_mtp"
    shutil.copytree(ggufs / "hf", source)
    state = load_file(source / "model.safetensors")
    state |= {n.replace("layers.2.", "layers.3."): t.clone() for n, t in state.items() if ".layers.2." in n}
    save_file(state, source / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    proc = cli("prune", "--hf", source, "--trace", pruned_hf / "calibration_trace", "--criterion", "gate-mass",
               "--keep", "8", "--out", out)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layers 3 (MTP / NextN" in proc.stdout and not (out / "calibration_trace").exists()
    plan = plan_of(out / "prune.json")
    assert plan.layers == [1, 2, 3] and plan.kept[3] == plan.kept[2] and plan.about["untraced"] == {"3": 2}
    after, kept = load_file(out / "model.safetensors"), plan.kept[2]
    e = "model.layers.3.mlp."
    assert torch.equal(after[e + "gate.weight"], state[e + "gate.weight"][list(kept)])
    assert torch.equal(after[e + "experts.7.down_proj.weight"], state[f"{e}experts.{kept[7]}.down_proj.weight"])


def test_an_fp8_release_is_pruned_through_hf_and_reads_as_the_masked_source(release16, tiny_data, tmp_path, cli):
    source, out = release16, tmp_path / "pruned"
    proc = cli("prune", "--hf", source, "--data", tiny_data.sources[0], "--criterion", "gate-mass",
               "--sparsity", "0.5", "--max-tokens", "300", "--out", out)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = plan_of(out / "prune.json")
    assert plan.layers == [1, 2, 3] and plan.about["source"]["format"] == "fp8-release"
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        pruned = HFCheckpoint(out, transformers.AutoConfig.from_pretrained(out)).model()(tokens).logits
        whole = HFCheckpoint(source, transformers.AutoConfig.from_pretrained(source)).model()
        torch.testing.assert_close(pruned, masked(whole, plan.kept, 16)(tokens).logits, atol=1e-5, rtol=0)


def test_a_gguf_file_pruned_runs_in_llama_cpp_as_the_masked_source(ggufs, tiny_data, tmp_path, cli):
    pytest.importorskip("llama_cpp")
    out = tmp_path / "pruned.gguf"
    proc = cli("prune", "--gguf", ggufs / "f32.gguf", "--data", tiny_data.sources[0], "--criterion", "frequency",
               "--keep", "8", "--max-tokens", "300", "--out", out)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = plan_of(tmp_path / "pruned.gguf.prune.json")  # beside the file, with the trace
    assert plan.about["calibration"]["trace"] == "pruned.gguf.calibration_trace"
    assert Trace(tmp_path / "pruned.gguf.calibration_trace").n == 300
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pruned.gguf", *(f"pruned.gguf.{n}" for n in (
        "calibration_trace", "prune.json"))]  # fmt: skip
    reference = masked_gguf(ggufs / "f32.gguf", tmp_path / "masked.gguf", {k: list(v) for k, v in plan.kept.items()})
    tokens = np.random.default_rng(0).integers(0, VOCAB, 64)
    (ours, logits), (theirs, expected) = run_llama_cpp(out, tokens), run_llama_cpp(reference, tokens)
    for layer, kept in plan.kept.items():
        assert np.array_equal(np.asarray(kept)[ours.experts[layer]], theirs.experts[layer]), layer
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5)
    again = cli("prune", "--gguf", ggufs / "f32.gguf", "--trace", tmp_path / "pruned.gguf.calibration_trace",
                "--criterion", "frequency", "--keep", "8", "--out", tmp_path / "masked.gguf.x")  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert plan_of(tmp_path / "masked.gguf.x.prune.json").kept == plan.kept  # the same trace, the same plan
    reap = cli("prune", "--gguf", ggufs / "f32.gguf", "--trace", tmp_path / "pruned.gguf.calibration_trace",
               "--criterion", "reap", "--keep", "8", "--out", tmp_path / "reap.gguf")  # fmt: skip
    assert reap.returncode == 0, reap.stderr[-2000:]  # llama.cpp's expert outputs give the trace its norms
    trace = Trace(tmp_path / "pruned.gguf.calibration_trace")
    w, n, e = (np.asarray(c, np.float64) for c in (trace.weights(1), trace.norms(1), trace.experts(1)))
    saliency = [(w * n)[e == j].mean() if (e == j).any() else 0.0 for j in range(16)]
    np.testing.assert_allclose(plan_of(tmp_path / "reap.gguf.prune.json").scores[1], saliency, rtol=1e-9)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--hf", "{hf}", "--criterion", "ablation", "--max-memory", "1MiB"], "--criterion ablation: .* is run a "
         "layer at a time \\(streamed from disk\\), and ablation masks experts in a model held whole: give a "
         "--max-memory it fits in, or use reap, frequency, gate-mass, random"),
        (["--gguf", "{gguf}", "--criterion", "ablation"], "--criterion ablation masks experts in a model moe-lm runs "
         "in memory, and a GGUF file is not one: use reap, frequency, gate-mass, random"),
        (["--hf", "{hf}", "--keep", "6", "--criterion", "frequency"], "cannot share equally"),
        (["--hf", "{hf}", "--criterion", "frequency", "--force"], "--force: a pruned transformers folder is always "
         "written new"),
        (["--hf", "{hf}", "--check"], "--check of a transformers folder needs --held-out-data"),
        (["--gguf", "{gguf}", "--check"], "--check runs each pruned model: give a moe-lm run \\(--run\\) or a "
         "transformers folder"),
        (["--hf", "{olmoe}", "--criterion", "frequency"], "model_type 'olmoe'; moe-lm prune writes deepseek_v3, "
         "glm4_moe, qwen3_moe folders"),
        (["--hf", "{qwen}", "--criterion", "frequency"], "norm_topk_prob is false, so each chosen expert's weight is "
         "its softmax share of every expert"),
    ],
)  # fmt: skip
def test_what_a_kind_cannot_give_is_one_line_exit_2_and_leaves_nothing(ggufs, tiny_data, tmp_path, cli, flags,
                                                                       message):  # fmt: skip
    configs = {"olmoe": {"model_type": "olmoe", "num_experts": 8},
               "qwen": {"model_type": "qwen3_moe", "num_experts": 8, "norm_topk_prob": False}}  # fmt: skip
    for name, config in configs.items():  # folders prune does not write: their config.json is all that is read
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    flags = [f.format(hf=ggufs / "hf", gguf=ggufs / "f32.gguf", olmoe=tmp_path / "olmoe", qwen=tmp_path / "qwen")
             for f in flags]  # fmt: skip
    keep = [] if "--keep" in flags else ["--keep", "8"]
    proc = cli("prune", *flags, *keep, "--data", tiny_data.sources[0], "--out", tmp_path / "out")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and __import__("re").search(message, lines[0]), proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["olmoe", "qwen"]


def test_the_source_is_never_the_output(ggufs, tiny_data, tmp_path, cli):
    data = ["--data", tiny_data.sources[0]]
    for flags, out, said in [
        (["--hf", ggufs / "hf"], ggufs / "hf", "is the source itself"),
        (["--hf", ggufs / "hf"], ggufs / "hf" / "p", "lies inside the source"),
        (["--gguf", ggufs / "f32.gguf"], ggufs / "f32.gguf", "is the source itself"),
    ]:
        proc = cli("prune", *flags, *data, "--keep", "8", "--criterion", "frequency", "--out", out)
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    (tmp_path / "taken.gguf.prune.json").write_text("mine")
    proc = cli("prune", "--gguf", ggufs / "f32.gguf", *data, "--keep", "8", "--criterion", "frequency", "--out",
               tmp_path / "taken.gguf")  # fmt: skip
    assert proc.returncode == 2 and "taken.gguf.prune.json exists" in proc.stderr
    assert (tmp_path / "taken.gguf.prune.json").read_text() == "mine" and not (tmp_path / "taken.gguf").exists()


def test_ablation_masks_the_experts_in_transformers_own_routers(ggufs, pruned_hf, tmp_path, cli):
    """Ablation on a transformers folder (from the trace of the first test, its cooking documents): every expert its
    cost; REAP on that trace ranks by its norms; ablation on the folder streamed is one line."""
    trace = ["--trace", pruned_hf / "calibration_trace", "--domains", "cooking"]
    out = tmp_path / "abl"
    proc = cli("prune", "--hf", ggufs / "hf", *trace, "--criterion", "ablation", "--keep", "12", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = plan_of(out / "prune.json")
    assert plan.about["criterion"] == "ablation" and plan.about["domains"] == ["cooking"]
    for layer in (1, 2):
        assert np.isfinite(plan.scores[layer]).all() and len(set(plan.scores[layer])) > 8
    reap = cli("prune", "--hf", ggufs / "hf", *trace, "--keep", "12", "--out", tmp_path / "reap")
    assert reap.returncode == 0, reap.stderr[-3000:]
    assert plan_of(tmp_path / "reap" / "prune.json").about["criterion"] == "reap"
    streamed = cli("prune", "--hf", ggufs / "hf", *trace, "--criterion", "ablation", "--keep", "12", "--max-memory",
                   "1MiB", "--out", tmp_path / "streamed")  # fmt: skip
    assert streamed.returncode == 2 and "is run a layer at a time (streamed from disk)" in streamed.stderr
    assert "or use reap, frequency, gate-mass, random" in streamed.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["abl", "reap"]
