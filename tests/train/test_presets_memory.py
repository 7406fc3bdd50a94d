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
