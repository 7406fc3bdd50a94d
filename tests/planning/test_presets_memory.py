"""The GPU presets: they load, their modules have the parameters count_params says (built on the meta device), and
DeepSeek-V3's published dimensions give the paper's 671 B / 37 B; the memory estimator's accounting."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_lm.config import load_config
from moe_lm.model import build_model, count_params
from moe_lm.planning.memory import BF16, FP32, estimate

ROOT = Path(__file__).resolve().parents[2]


def test_deepseek_v3_preset_has_the_papers_parameter_counts():
    cfg = load_config(ROOT / "configs" / "deepseek_v3_671b.yaml")
    n = count_params(cfg.model)
    assert round(n.total / 1e9) == 671 and round(n.active / 1e9) in (37, 38)  # "671B total, 37B activated"
    # the MTP module: 11.6 B of its own; with its copies of the embedding and head, the paper's "14 B" (13.5)
    copies = 2 * cfg.model.vocab_size * cfg.model.dim
    assert round(n.mtp_total / 1e9, 1) == 11.6 and 13 < (n.mtp_total + copies) / 1e9 < 14.5


@pytest.mark.parametrize("preset, total_b", [("gpu_1b", 0.978), ("deepseek_v3_16b", 15.96)])
def test_presets_build_with_the_counted_parameters(preset, total_b):
    cfg = load_config(ROOT / "configs" / f"{preset}.yaml")
    n = count_params(cfg.model)
    assert n.total / 1e9 == pytest.approx(total_b, abs=0.005)
    with torch.device("meta"):
        model = build_model(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == n.total


def test_memory_estimate_follows_the_zero_accounting():
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    n = count_params(cfg.model)
    one = estimate(cfg, world=1)
    assert one.weights + one.gradients + one.optimizer == pytest.approx((2 * BF16 + 3 * FP32) * n.total)
    four = estimate(load_config(ROOT / "configs" / "tiny.yaml", ["parallel.zero_stage=2"]), world=4)
    assert four.weights == one.weights and four.optimizer == pytest.approx(one.optimizer / 4)
    assert four.gradients == pytest.approx(one.gradients / 4)
    zero1 = estimate(load_config(ROOT / "configs" / "tiny.yaml", ["parallel.zero_stage=1"]), world=4)
    assert zero1.gradients == one.gradients
    # one rank runs ZeRO-1 without contiguous gradients (its engine: tests/train/test_train.py): no buckets
    assert one.buckets == 0 and four.buckets > 0
    # experts split over 8 ranks: the routed experts' weights are an eighth per GPU, the rest replicated
    ep = estimate(load_config(ROOT / "configs" / "tiny.yaml", ["parallel.ep_size=8"]), world=8)
    experts = 3 * n.routed_expert * cfg.model.moe.n_routed_experts
    assert ep.weights == pytest.approx(BF16 * (n.total - experts + experts / 8))
    tiny = ROOT / "configs" / "tiny.yaml"
    acts = [
        estimate(load_config(tiny, [f"performance.activation_checkpointing={m}"]), 1).activations
        for m in ("none", "selective", "full")
    ]
    assert acts[0] > acts[1] > acts[2] > 0


def test_chunked_loss_estimate_holds_one_chunk_of_logits():
    """With performance.loss_chunk the logits term stops growing with the micro-batch's tokens x vocab (only dL/dh
    does)."""
    gpu = ROOT / "configs" / "gpu_1b.yaml"
    plain = [estimate(load_config(gpu, [f"train.micro_batch_size={b}", "performance.loss_chunk=0"]), 1).logits
             for b in (4, 8)]  # fmt: skip
    chunked = [estimate(load_config(gpu, [f"train.micro_batch_size={b}", "performance.loss_chunk=4096"]), 1).logits
               for b in (4, 8)]  # fmt: skip
    assert plain[1] == pytest.approx(2 * plain[0])
    cfg = load_config(gpu)
    dh_per_token = BF16 * cfg.model.dim
    assert chunked[1] - chunked[0] == pytest.approx(dh_per_token * 4 * cfg.train.seq_len)
    assert chunked[1] < plain[1] / 4


def test_pipeline_layers_have_the_modules_parameters():
    """The planner's per-layer parameter counts are those of the modules the pipeline stages hold (the embedding,
    each block, the head with the MTP module, the tied embedding), counted on the model built on the meta device."""
    from moe_lm.deepspeed_layout import layer_params

    cfg = load_config(ROOT / "configs" / "gpu_1b.yaml", ["model.mtp.depth=1"])
    with torch.device("meta"):
        model = build_model(cfg.model)

    def count(*modules):
        return sum(p.numel() for m in modules for p in m.parameters())

    want = [count(model.embed_tokens), *(count(b) for b in model.layers), count(model.norm, model.lm_head, model.mtp)]
    want.append(count(model.embed_tokens))
    got = layer_params(cfg)
    assert [other + experts for other, experts, _, _ in got] == want
    experts = [sum(p.numel() for n, p in b.named_parameters() if ".experts." in n) for b in [*model.layers, model.mtp]]
    assert [e for _, e, _, _ in got[1:-1]] == experts


@pytest.mark.parametrize("pp, micro_batches", [(4, 16), (4, 2), (16, 32)])
def test_pipeline_stages_split_the_model_and_count_1f1b_in_flight(pp, micro_batches):
    """The 671 B preset in stages: every parameter on exactly one stage (the tied embedding twice, when the head's
    stage is not the first), stage s keeps min(pp - s, m) micro-batches in flight, the bubble is (pp-1)/(m+pp-1), and
    each stage's memory is ZeRO-1's accounting over its own data-parallel ranks."""
    from moe_lm.planning.memory import stage_estimates
    from moe_lm.planning.stages import bubble, stages

    overrides = [f"parallel.pp_size={pp}", f"train.grad_accum_steps={micro_batches}"]
    cfg = load_config(ROOT / "configs" / "deepseek_v3_671b.yaml", overrides)
    n, m = count_params(cfg.model), cfg.model
    held = stages(cfg)
    assert held[0].start == 0 and [s.stop for s in held[:-1]] == [s.start for s in held[1:]]
    total = sum(s.other_params + s.expert_params for s in held)
    assert total == n.total + n.mtp_total + m.vocab_size * m.dim  # the tied copy on the last stage
    assert sum(len(s.blocks) for s in held) == m.n_layers + m.mtp.depth and held[-1].head
    assert [s.in_flight for s in held] == [min(pp - s, micro_batches) for s in range(pp)]
    assert bubble(pp, micro_batches) == pytest.approx((pp - 1) / (micro_batches + pp - 1))
    world = 64 * pp  # 64 data-parallel ranks per stage, EP 64 among them
    for stage, e in zip(held, stage_estimates(cfg, world), strict=True):
        experts = stage.expert_params / 64
        assert e.weights == pytest.approx(BF16 * (stage.other_params + experts))
        assert e.optimizer == pytest.approx(3 * FP32 * (stage.other_params / 64 + experts / 1))
    # the planner's largest stage is what `estimate` reports per GPU
    assert estimate(cfg, world).total == max(e.total for e in stage_estimates(cfg, world))


def test_pipeline_planner_tables_in_the_readme_and_the_docs():
    """The planner rows for the 671 B preset with pipeline stages (docs/parallelism.md, and the README's PP 4 row)
    are the planner's numbers, and they fit an 80 GiB H100 and a 141 GiB H200."""
    import re

    from moe_lm.planning.memory import GB

    readme, docs = (ROOT / "README.md").read_text(), (ROOT / "docs" / "parallelism.md").read_text()
    for pp, world, gpu in ((4, 256, 80), (16, 1024, 80), (2, 128, 141)):
        overrides = [f"parallel.pp_size={pp}", "performance.activation_checkpointing=full",
                     f"train.grad_accum_steps={8 * pp}"]  # fmt: skip
        gib = estimate(load_config(ROOT / "configs" / "deepseek_v3_671b.yaml", overrides), world).total / GB
        assert gib < gpu
        assert re.search(rf"\| PP {pp} × DP 64[^|]*\| {world:,} \| {gib:.1f} GiB \|", docs), (pp, gib)
        row = f"| deepseek_v3_671b, {world // 8} nodes × 8, PP {pp} × EP 64, full recompute | {gib:.1f} GiB |"
        assert row in readme or pp != 4


def test_stage_cut_is_deepspeeds():
    """The planner's cut of the layers into stages is DeepSpeed's partition_balanced (what the pipeline engine
    uses), on random weights with ties and zeros, and on the 671 B preset's layers."""
    import random

    from deepspeed.runtime.utils import partition_balanced

    from moe_lm.deepspeed_layout import balanced_bounds, layer_params

    rng = random.Random(0)
    for _ in range(200):
        weights = [rng.choice([0, 1, 5, 100, rng.randint(0, 10**6)]) for _ in range(rng.randint(1, 30))]
        parts = rng.randint(1, 8)
        assert balanced_bounds(weights, parts) == list(partition_balanced(weights, parts)), (weights, parts)
    cfg = load_config(ROOT / "configs" / "deepseek_v3_671b.yaml")
    weights = [int(other + experts / 64) for other, experts, _, _ in layer_params(cfg)]
    for pp in (2, 4, 16):
        assert balanced_bounds(weights, pp) == list(partition_balanced(weights, pp))
