"""Released checkpoints as their makers ship them (tests/helpers/released.py: FP8 blocks with ragged edges, several
shards, or bf16), read right and analysed a layer at a time within a memory budget: the same experts, weights and
log-probs as the whole model in memory, bit for bit; resumed after an interruption; bad input refused before any
work, in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from moe_lm.analysis import stream_passes, stream_work, streamed
from moe_lm.analysis.hf_routing import hf_routing
from moe_lm.analysis.recording import record_trace
from moe_lm.analysis.routing_workflow import batch_within_memory
from moe_lm.analysis.streamed import StreamedModel
from moe_lm.analysis.subjects import Subject
from moe_lm.errors import UserError
from moe_lm.interop import hf_layers
from moe_lm.interop.hf_layers import HFCheckpoint, UntrainedCheckpoint
from moe_lm.interop.released_weights import SCALE_SUFFIX, ReleasedWeights, dequantize_fp8, quantize_fp8
from moe_lm.routing.trace import Trace
from tests.analysis.test_bad_input import refused
from tests.helpers.released import dequantized_by_blocks, release

RELEASES = [("deepseek_v3", True), ("deepseek_v3", False), ("qwen3_moe", True), ("qwen3_moe", False)]
SMALL = "1200KB"  # below every layer's whole weights, above one routed expert: experts are read in chunks


@pytest.fixture(scope="module", params=RELEASES, ids=[f"{k}-{'fp8' if f else 'bf16'}" for k, f in RELEASES])
def released(request, tmp_path_factory):
    kind, fp8 = request.param
    return release(kind, tmp_path_factory.mktemp(kind) / "release", fp8=fp8)


@pytest.fixture(scope="module")
def deepseek_fp8(tmp_path_factory):
    return release("deepseek_v3", tmp_path_factory.mktemp("ds") / "release")


def write_corpus(path: Path) -> Path:
    """Three domains of documents of 10..90 words (windows of 64 cut some)."""
    words = ["alpha beta gamma delta", "the cat sat on the mat .", "what is the answer to this", "def f ( x ) :"]
    rng = np.random.default_rng(0)
    with path.open("w") as f:
        for i in range(36):
            text = " ".join(rng.choice(" ".join(words).split(), int(rng.integers(10, 90))))
            f.write(json.dumps({"text": text, "domain": f"d{i % 3}"}) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "docs.jsonl")


def documents(n: int = 14) -> list[tuple[int, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [(i % 2, rng.integers(0, 290, int(rng.integers(8, 100)))) for i in range(n)]


# ---- the FP8 format ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(576, 200), (144, 7), (128, 128), (1, 300), (300, 1)])
def test_fp8_blocks_dequantise_by_deepseeks_rule_ragged_edges_included(shape):
    """576 rows are 4.5 blocks (DeepSeek-V3's kv_a_proj_with_mqa); each shape has its own ragged edge."""
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[0])[:, None]  # blocks of very different scales
    w8, scale = quantize_fp8(w)
    assert scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    ours = dequantize_fp8(w8, scale)
    assert torch.equal(ours, dequantized_by_blocks(w8, scale))
    # and it is the weight, to float8's precision (3 mantissa bits) relative to each block's largest value
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = (slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128))
            assert (ours[block] - w[block]).abs().max() <= w[block].abs().max() / 16


def test_every_fp8_code_reads_as_torch_casts_it():
    """The reader looks each byte up in a table (faster than torch's cast): all 256 codes, NaNs and -0 included."""
    w8 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).view(16, 16)
    ours = dequantize_fp8(w8, torch.ones(1, 1))
    cast = w8.float()
    assert torch.equal(ours.isnan(), cast.isnan()) and torch.equal(ours.nan_to_num(), cast.nan_to_num())
    assert torch.equal(ours.signbit(), cast.signbit())


def test_released_fp8_weights_read_as_the_release_means_them(deepseek_fp8):
    """Every FP8 matrix of the release, read through the index and its three shards, equals the independent
    dequantisation of the stored bytes; the rest equals what is stored."""
    stored = {}
    for shard in deepseek_fp8.glob("*.safetensors"):
        stored.update(load_file(shard))
    weights = ReleasedWeights(deepseek_fp8)
    assert len({str(f) for f in weights.files.files.values()}) == 3
    fp8 = [n for n in weights.names() if stored[n].dtype == torch.float8_e4m3fn]
    ragged = [n for n in fp8 if any(d % 128 for d in stored[n].shape)]
    assert len(fp8) > 30 and len(ragged) == len(fp8)  # every matrix of this model has ragged edge blocks
    for name, tensor in weights.weights(weights.names(), torch.float32):
        expected = (
            dequantized_by_blocks(stored[name], stored[name + SCALE_SUFFIX]) if name in fp8 else stored[name].float()
        )
        assert torch.equal(tensor, expected), name


def test_the_model_read_whole_is_transformers_own_on_a_bf16_release(tmp_path):
    """Where transformers reads a release right (bf16), the model moe-lm builds from it gives the same logits and
    the same experts as transformers' from_pretrained."""
    folder = release("deepseek_v3", tmp_path / "bf16", fp8=False)
    config = transformers.AutoConfig.from_pretrained(folder)
    ours = hf_routing(HFCheckpoint(folder, config).model())
    theirs = hf_routing(transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
    tokens = torch.from_numpy(np.stack([d[:60] for _, d in documents(40) if len(d) >= 60][:4])).long()
    with torch.no_grad():
        a, b = ours.forward(tokens), theirs.forward(tokens)
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    assert torch.allclose(
        theirs.forward(tokens),
        transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(tokens).logits,
        atol=1e-5,
        rtol=0,
    )  # the causal forward without a mask is transformers' own forward


# ---- streamed against whole ----------------------------------------------------------------------------------------


def _whole_and_streamed(folder: Path, tmp_path: Path, budget: int, untrained: bool = False):
    config = transformers.AutoConfig.from_pretrained(folder)
    checkpoint = HFCheckpoint(folder, config)
    if untrained:
        checkpoint = UntrainedCheckpoint(checkpoint, seed=0)
    docs = documents()
    whole = record_trace(hf_routing(checkpoint.model()), docs, tmp_path / "whole", ["a", "b"], 48, 4, progress=False)
    model = StreamedModel(checkpoint, budget, tmp_path / "work")
    assert any(u.experts is not None for u in model.units)  # experts read in chunks
    part = record_trace(model, docs, tmp_path / "streamed", ["a", "b"], 48, 4, progress=False)
    return whole, part


def _same(a: Trace, b: Trace) -> None:
    assert a.layers == b.layers and a.layers
    for layer in a.layers:
        assert np.array_equal(a.experts(layer), b.experts(layer)), layer
        assert np.array_equal(a.weights(layer), b.weights(layer)), layer
        # the norms: the whole model's by its hooks (the experts module again, a slot a row), the streamed one's from
        # its expert passes; float16 in the trace
        np.testing.assert_allclose(np.asarray(b.norms(layer), np.float64), np.asarray(a.norms(layer), np.float64),
                                   rtol=2e-3, atol=1e-6)  # fmt: skip
    # the head's product is made a window at a time when streamed (bounded logits): float32 rounding apart
    assert np.allclose(a.logprob, b.logprob, atol=1e-5, rtol=0, equal_nan=True)


def test_streamed_analysis_records_what_the_whole_model_records(released, tmp_path, monkeypatch):
    """DeepseekV3 and Qwen3Moe, FP8 and bf16 releases, in float32: every (token, layer)'s experts and weights bit for
    bit, with the experts read a chunk at a time and the layers run a window at a time, and every log-prob."""
    for module in (stream_passes, hf_layers):  # 3 windows at a time, as a large model's layers run: groups of 3 and 1
        monkeypatch.setattr(module, "windows_at_once", lambda config, seq_len: 3)
    whole, part = _whole_and_streamed(released, tmp_path, 1_200_000)
    _same(whole, part)
    assert part.meta["streamed"]["read_bytes"] > 0 and part.meta["streamed"]["flops"] > 0


def test_a_streamed_subjects_batches_are_not_cut_for_its_logits(deepseek_fp8, tmp_path):
    """Its log-probs are made a few windows at a time, so its batches keep --batch-size windows and an expert's
    product keeps their rows; a model run whole cuts them so that its logits fit (a 129 k vocabulary: 2 windows)."""
    checkpoint = HFCheckpoint(deepseek_fp8, transformers.AutoConfig.from_pretrained(deepseek_fp8))
    like_deepseek = dict(tok=None, seq_len=1024, vocab_size=129_280, provenance={})
    streamed_subject = Subject(StreamedModel(checkpoint, 1_200_000, tmp_path / "work"), **like_deepseek)
    assert batch_within_memory(16, streamed_subject) == 16
    assert batch_within_memory(16, Subject(hf_routing(checkpoint.model()), **like_deepseek)) == 2


def test_the_untrained_baseline_streams_from_its_seed(deepseek_fp8, tmp_path):
    whole, part = _whole_and_streamed(deepseek_fp8, tmp_path, 1_200_000, untrained=True)
    _same(whole, part)


def test_the_untrained_twin_built_a_layer_at_a_time_is_the_same_model(deepseek_fp8):
    config = transformers.AutoConfig.from_pretrained(deepseek_fp8)
    twin = UntrainedCheckpoint(HFCheckpoint(deepseek_fp8, config), seed=0)
    whole = twin.model().model.layers[2].mlp.experts
    gate_up, down = twin.experts(2, [5, 6])
    assert torch.equal(whole.gate_up_proj[5:7], gate_up) and torch.equal(whole.down_proj[5:7], down)
    assert whole.gate_up_proj.std() > 0


def test_a_budget_below_the_largest_part_is_refused_with_a_minimum_that_works(deepseek_fp8, tmp_path):
    checkpoint = HFCheckpoint(deepseek_fp8, transformers.AutoConfig.from_pretrained(deepseek_fp8))
    with pytest.raises(UserError, match=r"give at least --max-memory (\d+)MiB") as refusal:
        StreamedModel(checkpoint, 50_000, tmp_path / "work")
    least = int(re.search(r"(\d+)MiB$", str(refusal.value))[1]) * 2**20
    units = streamed.plan_units(checkpoint, checkpoint.n_layers - 1, least)
    assert any(u.experts for u in units)  # it works, reading experts a chunk at a time
    with pytest.raises(UserError):
        streamed.plan_units(checkpoint, checkpoint.n_layers - 1, least - 2**20)


# ---- the command ---------------------------------------------------------------------------------------------------


def test_analyze_streams_a_release_resumes_after_an_interruption_and_ends_with_the_same_trace(
    deepseek_fp8, corpus, cli, tmp_path, monkeypatch
):
    """An analysis interrupted after its second layer keeps the finished layers beside --out; the same command
    says it resumes from them and ends with the trace of an analysis that fits in memory."""
    common = ("analyze", "--hf", deepseek_fp8, "--data", corpus, "--seq-len", "64")
    whole = cli(*common, "--out", tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "streamed" not in whole.stdout

    out = tmp_path / "streamed"
    finish = streamed.WorkFolder.finish

    def interrupted(self, layer):
        finish(self, layer)
        if layer == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(streamed.WorkFolder, "finish", interrupted)
    stopped = cli(*common, "--out", out, "--max-memory", SMALL)
    assert stopped.returncode == 130 and not out.exists()
    assert "finished layers of the streamed analysis are kept" in stopped.stderr
    monkeypatch.setattr(streamed.WorkFolder, "finish", finish)

    resumed = cli(*common, "--out", out, "--max-memory", SMALL)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming the streamed analysis: layers 0..1 finished before" in resumed.stdout
    assert "streamed plan: layers 0..3" in resumed.stdout and "x max(read, compute)" in resumed.stdout
    for trace in ("trace", "trace_init"):
        _same(Trace(tmp_path / "whole" / trace), Trace(out / trace))
    assert not (tmp_path / ".streamed.stream").exists()  # the work files go when the analysis ends
    a, b = (json.loads((p / "metrics.json").read_text())["layers"] for p in (tmp_path / "whole", out))
    # every number, REAP's saliency (float16 norms summed in another order) within rounding
    assert {layer: {k: v for k, v in m.items() if "saliency" not in k} for layer, m in a.items()} == {
        layer: {k: v for k, v in m.items() if "saliency" not in k} for layer, m in b.items()}  # fmt: skip
    for layer in a:
        np.testing.assert_allclose(b[layer]["saliency"], a[layer]["saliency"], rtol=2e-3)


def test_layers_up_to_l_read_only_those_and_say_the_log_probs_are_not_recorded(deepseek_fp8, corpus, cli, tmp_path):
    proc = cli("analyze", "--hf", deepseek_fp8, "--data", corpus, "--seq-len", "64", "--out", tmp_path / "a",
               "--max-memory", SMALL, "--layers", "2", "--no-init-baseline")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "log-probs not recorded: --layers stops at layer 2 of 3" in proc.stdout
    trace = Trace(tmp_path / "a" / "trace")
    assert trace.layers == [1, 2] and trace.logprob is None
    layer_3 = HFCheckpoint(deepseek_fp8, transformers.AutoConfig.from_pretrained(deepseek_fp8)).layer_bytes(3)
    read = trace.meta["streamed"]["read_bytes"]
    total = sum(p.stat().st_size for p in deepseek_fp8.glob("*.safetensors"))
    assert read < total - layer_3


# ---- bad input -----------------------------------------------------------------------------------------------------


def _damaged(tmp_path: Path, damage) -> Path:
    folder = release("deepseek_v3", tmp_path / "release")
    damage(folder)
    return folder


def _rewrite(folder: Path, change) -> None:
    """Apply `change(tensors)` to the shard holding layer 1's kv_a_proj_with_mqa (and its scale)."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    for shard in {index[name], index[name + SCALE_SUFFIX]}:
        tensors = load_file(folder / shard)
        change(tensors, name)
        save_file(tensors, folder / shard, metadata={"format": "pt"})


def _missing_shard(folder):
    (folder / "model-00002-of-00003.safetensors").unlink()


def _truncated_shard(folder):
    shard = folder / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])


def _bad_scale_grid(folder):
    def change(tensors, name):
        if name + SCALE_SUFFIX in tensors:
            tensors[name + SCALE_SUFFIX] = tensors[name + SCALE_SUFFIX][:, :1].contiguous()

    _rewrite(folder, change)


def _unknown_dtype(folder):
    def change(tensors, name):
        if name in tensors:
            tensors[name] = tensors[name].to(torch.float8_e5m2)

    _rewrite(folder, change)


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (_missing_shard, "model-00002-of-00003.safetensors is missing"),
        (_truncated_shard, "model-00002-of-00003.safetensors is truncated"),
        (_bad_scale_grid, "kv_a_proj_with_mqa.weight_scale_inv is a grid of [1, 1] scales for a 72 x 144 weight"),
        (_unknown_dtype, "kv_a_proj_with_mqa.weight is stored as F8_E5M2"),
    ],
    ids=["missing-shard", "truncated-shard", "bad-scale-grid", "unknown-dtype"],
)
def test_a_damaged_release_is_one_line_before_any_work(damage, said, corpus, cli, tmp_path):
    folder = _damaged(tmp_path, damage)
    out = tmp_path / "a"
    err = refused(cli("analyze", "--hf", folder, "--data", corpus, "--out", out, "--max-memory", SMALL), said)
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists() and not (tmp_path / ".a.stream").exists()


@pytest.mark.parametrize("method", ["compressed-tensors", "mxfp4", "awq", "gptq", "bitsandbytes"])
def test_another_quantisation_is_named_in_one_line(method, deepseek_fp8, corpus, cli, tmp_path):
    folder = tmp_path / "release"
    folder.mkdir()
    for f in deepseek_fp8.iterdir():
        (folder / f.name).symlink_to(f)
    config = json.loads((deepseek_fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config))
    err = refused(cli("analyze", "--hf", folder, "--data", corpus, "--out", tmp_path / "a"), f"quantised with {method}")
    assert len(err.strip().splitlines()) == 1, err


def test_too_little_disk_for_the_hidden_states_is_one_line(deepseek_fp8, corpus, cli, tmp_path, monkeypatch):
    monkeypatch.setattr(stream_work.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 1000})())
    out = tmp_path / "a"
    err = refused(cli("analyze", "--hf", deepseek_fp8, "--data", corpus, "--out", out, "--max-memory", SMALL),
                  "of disk for its hidden states and 0.0 MiB is free there", "--max-tokens")  # fmt: skip
    assert not out.exists()
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1, err


def test_max_memory_below_one_expert_is_one_line_with_the_minimum(deepseek_fp8, corpus, cli, tmp_path):
    err = refused(cli("analyze", "--hf", deepseek_fp8, "--data", corpus, "--out", tmp_path / "a", "--max-memory",
                      "100KB"), "give at least --max-memory")  # fmt: skip
    assert len(err.strip().splitlines()) == 1, err
