"""Drift split into weights, flips and gate values (moe_lm/analysis/attribution.py, routes forced by
moe_lm/routing/forced.py): every part equals a recount from passes recomputed here; analytic cases (a copy with the
reference's weights attributes nothing, a moved router bias is all flips, experts moved after the last router are
all weights); the command's numbers equal a recount from the comparison's own traces; what it refuses."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from moe_lm.analysis.attribution import PARTS, drift_attribution, same_architecture, window_passes
from moe_lm.analysis.subjects import KINDS, NotInArchitecture, RunSubject, Settings, recognise
from moe_lm.checkpoint.format import parse_run
from moe_lm.errors import DataError
from moe_lm.model import Transformer
from moe_lm.routing.forced import decoder_routes, forced_routes
from moe_lm.routing.torch_routing import window_logprobs
from moe_lm.testing import tiny_model_cfg
from tests.helpers.released import qwen3_moe

SIGNED = ("total", "weights", "routing", "flips", "gate_values", "interaction")


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    ref = Transformer(tiny_model_cfg()).eval()

    def copy(change=None):
        other = Transformer(tiny_model_cfg()).eval()
        other.load_state_dict(ref.state_dict())
        if change:
            with torch.no_grad():
                change(other)
        return other

    gen = torch.Generator().manual_seed(1)

    def noise(p, scale):
        p.add_(torch.randn(p.shape, generator=gen) * scale)

    last = f"layers.{ref.moe_layer_ids()[-1]}.mlp.experts."
    return {
        "ref": ref,
        "same": copy(),
        "bias": copy(lambda m: [r.e_score_correction_bias.normal_(0.0, 0.05, generator=gen) for r in m.routers()]),
        "last_experts": copy(lambda m: [noise(p, 0.05) for n, p in m.named_parameters() if n.startswith(last)]),
        # every kind of change at once (routers, experts, attention): 30-40 % of tokens flip; `slight`: about 15 %
        "both": copy(
            lambda m: [noise(p, 0.003 if ".experts." in n or "gate" in n else 0.001) for n, p in m.named_parameters()]
        ),  # fmt: skip
        "slight": copy(
            lambda m: [noise(p, 0.001 if ".experts." in n or "gate" in n else 0.0003) for n, p in m.named_parameters()]
        ),  # fmt: skip
        "docs": [
            (i % 2, torch.randint(2, 97, (n,), generator=gen).numpy()) for i, n in enumerate([40, 70, 25, 90, 60])
        ],
    }


def test_forcing_a_models_own_routes_changes_nothing_and_forcing_others_changes_its_experts(models):
    ref, moved, docs = models["ref"], models["bias"], models["docs"]
    t = torch.as_tensor(docs[1][1][:32])[None]
    with torch.no_grad(), decoder_routes(ref) as recorded:
        plain = ref(t).logits
    own = dict(recorded.last)
    with torch.no_grad(), forced_routes(ref, own):
        assert torch.equal(ref(t).logits, plain)
    with torch.no_grad(), decoder_routes(moved) as recorded:
        moved(t)
    theirs = dict(recorded.last)
    assert any(not torch.equal(own[layer][0], theirs[layer][0]) for layer in own)  # the moved bias moved choices
    with torch.no_grad(), forced_routes(ref, theirs), decoder_routes(ref) as recorded:
        ref(t)
    assert all(torch.equal(recorded.last[layer][0], theirs[layer][0]) for layer in theirs)


# ---- recomputed here: the passes, written out from the routers' outputs, and the parts from them ----------------


def by_hand(ref, other, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """The passes of the module's docstring, recomputed: the experts-only routes built token by token from sets."""
    t = torch.as_tensor(tokens, dtype=torch.long)[None]

    def run(model, routes=None, weights=True):
        with torch.no_grad(), decoder_routes(model) as rec, forced_routes(model, routes or {}, weights=weights):
            return window_logprobs(model(t).logits[0], t[0]), dict(rec.last)

    def experts_of(theirs, own):  # their experts where the token's set differs, the model's own elsewhere
        return {layer: (torch.stack([a if set(a.tolist()) != set(b.tolist()) else b
                                     for a, b in zip(theirs[layer][0], own[layer][0], strict=True)]), own[layer][1])
                for layer in own}  # fmt: skip

    (rr, r0), (oo, r1) = run(ref), run(other)
    flips = [[set(a.tolist()) != set(b.tolist()) for a, b in zip(r0[i][0], r1[i][0], strict=True)] for i in r0]
    return {"RR": rr, "OO": oo, "OR": run(other, r0)[0], "RO": run(ref, r1)[0],
            "RF": run(ref, experts_of(r1, r0), False)[0], "OF": run(other, experts_of(r0, r1), False)[0],
            "flipped": np.array(flips).any(0)}  # fmt: skip


def recounted(ref, other, docs, seq_len: int) -> dict[str, np.ndarray]:
    """Per token (first of each window left out), every signed part, from `by_hand`'s passes."""
    p = {k: [] for k in ("RR", "OO", "OR", "RO", "RF", "OF", "flipped")}
    for _, tokens in docs:
        for start in range(0, len(tokens), seq_len):
            for k, v in by_hand(ref, other, tokens[start : start + seq_len]).items():
                p[k].append(v[1:])
    RR, OO, OR, RO, RF, OF = (np.concatenate(p[k]) for k in ("RR", "OO", "OR", "RO", "RF", "OF"))
    return {"total": OO - RR, "weights": OR - RR, "routing": RO - RR, "flips": RF - RR, "gate_values": RO - RF,
            "interaction": OO - OR - RO + RR, "weights_at_other_routes": OO - RO, "routing_at_other_weights": OO - OR,
            "flips_at_other_weights": OO - OF, "gate_values_at_other_weights": OF - OR,
            "shapley_weights": (OR - RR + OO - RO) / 2, "shapley_routing": (RO - RR + OO - OR) / 2,
            "shapley_flips": (RF - RR + OO - OF) / 2, "shapley_gate_values": (RO - RF + OF - OR) / 2,
            "flipped": np.concatenate(p["flipped"]), "experts_only_residual": np.abs(OF - RR)}  # fmt: skip


def test_every_part_equals_a_recount_from_passes_recomputed_here(models):
    """Routers, experts and attention all moved: each part's mean and mean absolute value, the share routed
    elsewhere, what a flipped token's flips cost and what replay leaves equal the recount; the two orders and the
    Shapley split are different numbers; the parts are not all cancelling (mean |part| > |mean part|)."""
    ref, other, docs = models["ref"], models["both"], models["docs"]
    split = drift_attribution(ref, other, docs, ["a", "b"], seq_len=32, n_boot=20)["all"]
    mine = recounted(ref, other, docs, 32)
    assert set(PARTS) == set(mine) - {"flipped", "experts_only_residual"}
    for part in PARTS:
        assert split[part]["mean"] == pytest.approx(mine[part].mean(), abs=1e-12), part
        assert split[part]["mean_abs"] == pytest.approx(np.abs(mine[part]).mean(), abs=1e-12), part
    flipped = mine["flipped"]
    assert 0 < flipped.mean() < 1 and split["routed_elsewhere"]["mean"] == pytest.approx(flipped.mean())
    assert split["flips_where_routed_elsewhere"]["mean"] == pytest.approx(mine["flips"][flipped].mean(), abs=1e-12)
    assert split["abs_after_experts_only_replay"]["mean"] == pytest.approx(mine["experts_only_residual"].mean())
    assert (
        split["interaction"]["mean_abs"] > 0 and split["routing"]["mean"] != split["routing_at_other_weights"]["mean"]
    )
    assert split["flips"]["mean_abs"] > 0 and split["gate_values"]["mean_abs"] > 0
    assert split["total"]["mean_abs"] > abs(split["total"]["mean"])
    assert split["tokens"] == len(flipped) and split["documents"] == len(docs)


def test_flips_reach_no_token_before_the_first_flip_of_its_window(models):
    """The experts-only passes keep each model's own experts where the sets agree: up to a window's first flipped
    token both flips parts are 0 (to float32 rounding: the later tokens' other experts change the rows each expert's
    product runs over), while the gate values there moved by far more: they are in the gate-value parts."""
    ref, other, docs = models["ref"], models["slight"], models["docs"]
    seen, gate_values_moved = 0, 0.0
    for window in (tokens[start : start + 32] for _, tokens in docs for start in range(0, len(tokens), 32)):
        p = window_passes(ref, other, window)
        first = int(np.argmax(p["elsewhere"])) if p["elsewhere"].any() else len(window)
        before = slice(1, first)  # position 0 has no log-prob
        np.testing.assert_allclose(p["RF"][before], p["RR"][before], rtol=0, atol=2e-6)
        np.testing.assert_allclose(p["OF"][before], p["OO"][before], rtol=0, atol=2e-6)
        gate_values_moved = max(gate_values_moved, float(np.abs(p["RO"] - p["RR"])[before].max(initial=0)))
        seen += max(first - 1, 0)
    assert seen > 5 and gate_values_moved > 10 * 2e-6  # a wrong split would fail the tolerance above


def test_equal_weights_attribute_nothing(models):
    ref, same, docs = models["ref"], models["same"], models["docs"]
    passes = window_passes(ref, same, docs[0][1][:32])
    assert not passes.pop("elsewhere").any()
    for name, values in passes.items():
        np.testing.assert_array_equal(values, passes["RR"], err_msg=name)
    split = drift_attribution(ref, same, docs, ["a", "b"], seq_len=32, n_boot=50)["all"]
    assert all(split[p]["mean"] == 0.0 and split[p]["mean_abs"] == 0.0 for p in PARTS)
    assert split["flips_where_routed_elsewhere"]["mean"] != split["flips_where_routed_elsewhere"]["mean"]  # NaN


def test_a_moved_router_bias_is_all_flips(models):
    """Only the selection bias moved (the scores and gate values are the same function of the hidden state): the
    whole change is flips, in both orders. Weights and interaction are exactly 0; the gate-value parts are 0 up to
    the rounding of a sum over the same experts in another order (a token's set in the other model's order)."""
    ref, moved, docs = models["ref"], models["bias"], models["docs"]
    result = drift_attribution(ref, moved, docs, ["a", "b"], seq_len=32, n_boot=50)
    split = result["all"]
    assert split["total"]["mean_abs"] > 1e-3
    for part in ("weights", "weights_at_other_routes", "shapley_weights", "interaction"):
        assert split[part]["mean_abs"] == 0.0, part
    assert split["routing"]["mean"] == split["routing_at_other_weights"]["mean"] == split["total"]["mean"]
    for part in ("gate_values", "gate_values_at_other_weights", "shapley_gate_values"):
        assert split[part]["mean_abs"] < 1e-6, part
    for part in ("flips", "flips_at_other_weights", "shapley_flips"):
        assert split[part]["mean"] == pytest.approx(split["total"]["mean"], abs=1e-6), part
    assert split["abs_after_replay"]["mean"] == 0.0 and split["abs_after_experts_only_replay"]["mean"] < 1e-6
    assert 0 < split["routed_elsewhere"]["mean"] < 1
    assert set(result["by_domain"]) == {"a", "b"} and result["by_domain"]["a"]["documents"] == 3
    assert set(split["routing_by_layer"]) == {str(i) for i in ref.moe_layer_ids()}
    lo, hi = split["total"]["abs_interval"]
    assert lo <= split["total"]["mean_abs"] <= hi


def test_experts_moved_after_the_last_router_are_all_weights(models):
    """Only the last MoE layer's experts moved: every router sees what it saw, so the routes are the reference's;
    routing, flips, gate values and interaction are exactly 0 and the weights part is the whole change."""
    ref, moved, docs = models["ref"], models["last_experts"], models["docs"]
    split = drift_attribution(ref, moved, docs, ["a", "b"], seq_len=32, n_boot=50)["all"]
    assert split["total"]["mean_abs"] > 0 and split["routed_elsewhere"]["mean"] == 0.0
    for part in PARTS:
        if "routing" in part or "flips" in part or "gate_values" in part or part == "interaction":
            assert split[part]["mean_abs"] == 0.0, part
        else:
            assert split[part]["mean"] == split["total"]["mean"], part


def test_a_gguf_files_weights_come_back_into_the_run_and_nan_weights_are_refused(tiny_run, cli, tmp_path):
    """moe_lm/interop/gguf_weights.py: an f32 GGUF export read back (dequantised by gguf-py, the exporter's tensor
    map inverted) is the run, weight for weight; a q8_0 one differs, and its total is the recount of plain forward
    passes; one with a NaN written into an expert tensor is refused, the tensor named."""
    import gguf

    from moe_lm.checkpoint.format import load_model
    from moe_lm.interop.gguf_weights import model_from_gguf

    cfg, run_model, _ = load_model(tiny_run, None)
    run_model.eval()
    for kind in ("f32", "q8_0"):
        proc = cli("export", "--run", tiny_run, "--gguf", tmp_path / f"{kind}.gguf", "--gguf-type", kind)
        assert proc.returncode == 0, proc.stderr[-2000:]
    ours = run_model.state_dict()
    back = model_from_gguf(tmp_path / "f32.gguf", cfg.model).state_dict()
    assert all(torch.equal(ours[k].float(), back[k].float()) for k in ours)
    q8 = model_from_gguf(tmp_path / "q8_0.gguf", cfg.model)
    gap = max(float((ours[k].float() - v.float()).abs().max()) for k, v in q8.state_dict().items() if v.numel())
    assert 0 < gap < 0.05
    docs = [(0, torch.randint(2, cfg.model.vocab_size, (32,), generator=torch.Generator().manual_seed(i)).numpy())
            for i in range(3)]  # fmt: skip
    split = drift_attribution(run_model, q8, docs, ["d"], seq_len=32, n_boot=20)["all"]
    with torch.no_grad():
        plain = [window_logprobs(m(torch.as_tensor(t)[None]).logits[0], torch.as_tensor(t))[1:]
                 for _, t in docs for m in (q8, run_model)]  # fmt: skip
    assert split["total"]["mean"] == pytest.approx(np.mean(np.concatenate(plain[0::2]) - np.concatenate(plain[1::2])))
    shutil.copy(tmp_path / "f32.gguf", tmp_path / "nan.gguf")
    reader = gguf.GGUFReader(tmp_path / "nan.gguf", "r+")
    tensor = next(t for t in reader.tensors if t.name == "blk.1.ffn_down_exps.weight")
    tensor.data.reshape(-1)[7] = np.nan
    reader.data.flush()
    with pytest.raises(
        DataError, match=r"nan\.gguf: weights that are not numbers .* layers\.1\.mlp\.experts\.down_proj"
    ):
        same_architecture(run_model, model_from_gguf(tmp_path / "nan.gguf", cfg.model), str(tmp_path / "nan.gguf"))


def strict(text: str):
    """JSON as a strict reader reads it: NaN and Infinity are not JSON."""
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in attribution.json"))


def test_analyze_attribute_writes_the_split_for_each_quantised_type(tiny_run, cli, tmp_path):
    out = tmp_path / "drift"
    proc = cli("analyze", "--run", tiny_run, "--quantise", "q8_0", "--attribute", "--max-tokens", "600",
               "--no-init-baseline", "--out", out)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = strict((out / "attribution.json").read_text())["q8_0"]
    assert result["all"]["total"]["mean_abs"] > 0 and result["all"]["documents"] > 1
    table = (out / "attribution.md").read_text()
    for row in ("| q8_0 | total change | OO - RR |", "| - flips: its experts, the run's gate values for them | RF - RR",
                "| weights, Shapley (the two orders' average)", "these do not add up to any routing part",
                "Per domain: indicative"):  # fmt: skip
        assert row in table and row in proc.stdout, row
    assert not (out / "quantised").exists()
    proc = cli("analyze", "--run", tiny_run, "--attribute", "--out", tmp_path / "x")
    assert proc.returncode == 2 and "give --run RUN and --quantise TYPE" in proc.stderr


def fp8_release_of(hf_folder, folder, block=(16, 16)):
    """The run's transformers export as DeepSeek releases its checkpoints: every matrix but the embedding, head and
    router in FP8 blocks with a float32 scale each, config.json saying so, the tokenizer beside it. Blocks of 16 x
    16 give the tiny run's matrices ragged edge blocks (20 rows: 1 1/4 blocks), as 128 x 128 give DeepSeek-V3's."""
    from safetensors.torch import load_file, save_file

    from moe_lm.interop.released_weights import SCALE_SUFFIX, fp8_quantised, quantize_fp8

    folder.mkdir()
    stored = {}
    for name, t in load_file(hf_folder / "model.safetensors").items():
        if fp8_quantised(name, t):
            stored[name], stored[name + SCALE_SUFFIX] = quantize_fp8(t, block)
        else:
            stored[name] = t
    assert any(w.shape[0] % block[0] for w in stored.values() if w.dtype == torch.float8_e4m3fn)  # ragged
    save_file(stored, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf_folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    (folder / "config.json").write_text(json.dumps(config))
    for f in hf_folder.iterdir():
        if not (folder / f.name).exists():
            shutil.copy(f, folder / f.name)
    return folder


def recount_from_traces(report, i: int) -> tuple[float, float]:
    """(mean log-prob change, share of tokens whose set of experts differs in some layer) of compared subject i
    against the subject, from the two traces the analysis recorded."""
    from moe_lm.routing.trace import Trace

    ours, theirs = Trace(report / "trace"), Trace(report / f"trace_compare_{i}")
    change = np.asarray(theirs.logprob, np.float64) - np.asarray(ours.logprob, np.float64)
    differs = np.zeros(ours.n, bool)
    for layer in ours.layers:
        differs |= (np.sort(ours.experts(layer), 1) != np.sort(theirs.experts(layer), 1)).any(1)
    has = np.isfinite(change)  # the first token of a window has no log-prob
    return float(change[has].mean()), float(differs[has].mean())


def test_analyze_attribute_equals_a_recount_from_the_comparisons_own_traces(tiny_run, cli, tmp_path):
    """--attribute with --compare: an earlier checkpoint of the run and the run as a DeepSeek FP8 release: each
    total change and share routed elsewhere equals the recount from the traces the comparison recorded (its own
    forward passes: ours for the checkpoint, transformers' modules for the FP8 folder); the run's own transformers
    export, imported back, attributes exactly 0; the run in bfloat16 (--attribute-dtype, which implies
    --attribute) has a weights part; another architecture is not split."""
    assert cli("export", "--run", tiny_run, "--out", tmp_path / "hf").returncode == 0
    fp8 = fp8_release_of(tmp_path / "hf", tmp_path / "fp8")
    earlier, out = f"{tiny_run}:step_00000002", tmp_path / "drift"
    proc = cli("analyze", "--run", tiny_run, "--compare", earlier, fp8, tmp_path / "hf", "--attribute-dtype",
               "bfloat16", "--max-tokens", "600", "--no-init-baseline", "--out", out)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = strict((out / "attribution.json").read_text())
    for i, (label, tol) in enumerate(((earlier, 1e-6), (str(fp8), 1e-5))):
        split = result[label]["all"]
        change, elsewhere = recount_from_traces(out, i)
        assert split["total"]["mean_abs"] > 0, label
        assert split["total"]["mean"] == pytest.approx(change, abs=tol), label
        assert split["routed_elsewhere"]["mean"] == pytest.approx(elsewhere, abs=1e-12), label
    assert result[earlier]["all"]["routed_elsewhere"]["mean"] > 0
    same = result[str(tmp_path / "hf")]["all"]
    assert all(same[p]["mean_abs"] == 0.0 for p in PARTS) and same["routed_elsewhere"]["mean"] == 0.0
    bf16 = result[f"{tiny_run} in bfloat16"]["all"]  # the run itself in bfloat16: weights and arithmetic rounded
    assert bf16["weights"]["mean_abs"] > 0 and bf16["abs_after_replay"]["mean"] > 0
    qwen3_moe().save_pretrained(tmp_path / "qwen")  # another architecture: its routes cannot be forced into it
    with pytest.raises(NotInArchitecture, match="do not run in the run's architecture"):
        in_architecture(str(tmp_path / "qwen"), tiny_run)
    assert in_architecture(earlier, tiny_run) is not None


def in_architecture(spec: str, run) -> object:
    """`SubjectKind.in_architecture` of the subject `spec` names, against the run `run`."""
    kind = recognise(spec, list(KINDS.values()))
    request = kind.from_flags(spec, Settings.defaults(kind.flags()))
    return kind.in_architecture(request, RunSubject(run=parse_run(str(run))))


def test_a_gqa_runs_quantised_files_are_refused_before_the_export(copied_run, cli, tmp_path):
    """GGUF weights are read back into MLA runs only: a GQA run (its checkpoints' config says so; the refusal reads
    nothing else) with --quantise --attribute and nothing else to split is refused in one line before anything is
    exported or analysed, naming the file left out."""
    copied_run(max_steps=4, ckpt_interval=2, eval_interval=2)
    for config in (tmp_path / "run").rglob("config.yaml"):
        config.write_text(config.read_text().replace("attention: mla", "attention: gqa"))
    proc = cli("analyze", "--run", tmp_path / "run", "--quantise", "q8_0", "--attribute", "--out", tmp_path / "out")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "--attribute: q8_0 is not split" in proc.stdout and "is gqa" in proc.stdout
    assert "no compared model runs in the architecture of" in proc.stderr and "analysing" not in proc.stdout
    assert not (tmp_path / "out").exists()
