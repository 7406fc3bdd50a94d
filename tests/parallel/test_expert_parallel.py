"""Expert parallelism on CPU with gloo under the real `deepspeed` launcher (2 and 4 processes)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from moe_lm.checkpoint.format import load_model
from moe_lm.config import dump_config
from moe_lm.interop.hf import export_hf
from moe_lm.train import loop
from tests.helpers.distributed import launch
from tests.helpers.runs import tiny_train_cfg
from tests.workers.dist_reshard import fixed_tokens

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def ep_check(tmp_path, n: int, ep: int, zero: int, mtp: int) -> dict:
    out = tmp_path / "ep.json"
    launch("tests/workers/dist_ep.py", "--ep", str(ep), "--zero", str(zero), "--mtp", str(mtp), "--out", str(out), n=n)
    return json.loads(out.read_text())


@pytest.mark.parametrize("n, ep, zero, mtp", [(2, 2, 1, 0), (2, 2, 2, 0), (4, 2, 2, 0), (2, 2, 2, 2)])
def test_expert_parallel_step_matches_single_process(tmp_path, n, ep, zero, mtp):
    """One step at EP 2 equals a single process on the global batch (with MTP depth 2: the MTP blocks' experts are
    sharded too, and the MTP loss is in the reference)."""
    r = ep_check(tmp_path, n, ep, zero, mtp)
    assert r["world"] == n
    assert r["logits"] < 1e-5, r
    assert r["grad_norm_rel"] < 1e-5, r  # clipping is exact: the global norm, experts counted once
    assert r["params"] < 1e-5, r
    for slots_sent, slots_computed, pairs_sent in r["stats"]:
        assert slots_computed == slots_sent  # every token-slot was computed once, none dropped
        assert pairs_sent < slots_sent  # tokens with several experts on one rank were sent there once


def train_rows(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


@pytest.mark.parametrize("zero", [1, 2])
def test_loss_trajectory_does_not_depend_on_ep_size(tiny_data, tmp_path, zero):
    base = tiny_train_cfg(
        tiny_data, tmp_path / "ep1", max_steps=10, grad_accum_steps=2, ckpt_interval=100, eval_interval=100
    )
    base = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, zero_stage=zero))
    loop.train(base)  # one process, ep_size 1, 2 micro-batches per step
    ep2 = dataclasses.replace(
        base, train=dataclasses.replace(base.train, grad_accum_steps=1, out_dir=str(tmp_path / "ep2"))
    )
    dump_config(ep2, tmp_path / "ep2.yaml")
    launch("launch/train.py", "--config", str(tmp_path / "ep2.yaml"), "parallel.ep_size=2")  # same global batch
    a, b = train_rows(tmp_path / "ep1"), train_rows(tmp_path / "ep2")
    assert [r["step"] for r in b] == list(range(1, 11))
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5), (ra["step"], ra["loss"], rb["loss"])
    assert all(r["a2a_bytes_per_rank"] > 0 for r in b)


def reshard_logits(tmp_path, run, n: int, ep: int) -> torch.Tensor:
    out = tmp_path / f"logits_ep{ep}.pt"
    launch("tests/workers/dist_reshard.py", "--run", str(run), "--ep", str(ep), "--out", str(out), n=n)
    return torch.load(out)


def offline_logits(run) -> tuple[torch.Tensor, object]:
    cfg, model, _ = load_model(run)
    with torch.no_grad():
        return model(fixed_tokens(cfg.model.vocab_size)).logits, model


@pytest.mark.parametrize("saved_ep, load_ep", [(2, 1), (1, 2)])
def test_checkpoint_reshards_between_ep_sizes(tiny_data, tmp_path, saved_ep, load_ep):
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=3, grad_accum_steps=1, ckpt_interval=3)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep_size=saved_ep))
    dump_config(cfg, tmp_path / "cfg.yaml")
    launch("launch/train.py", "--config", str(tmp_path / "cfg.yaml"), n=2)
    expected, model = offline_logits(tmp_path / "run")  # the plain model assembled from per-expert files
    got = reshard_logits(tmp_path, tmp_path / "run", n=load_ep if load_ep > 1 else 1, ep=load_ep)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # and the HF export of that checkpoint gives the same logits
    import transformers

    export_hf(model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(fixed_tokens(cfg.model.vocab_size)).logits, expected, atol=1e-4, rtol=1e-4)


def test_ep_size_must_divide_experts_and_world(tiny_data, tmp_path):
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=1)
    bad = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep_size=2))
    with pytest.raises(ValueError, match="must divide both the world size"):
        loop.train(bad)  # world size 1 here
