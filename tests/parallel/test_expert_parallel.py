"""Expert parallelism on CPU with gloo: 2, 4 and 8 ranks (forked, tests/helpers/ranks.py), two "nodes" of ranks,
and a real 2-node job started the way a cluster without ssh starts it (two DeepSpeed launchers on this machine)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_lm.checkpoint.format import latest_tag, load_model
from moe_lm.config import dump_config
from moe_lm.interop.hf import export_hf
from moe_lm.parallel.traffic import KINDS
from moe_lm.planning.comm_plan import trace_pairs
from tests.helpers.runs import tiny_train_cfg
from tests.workers.dist_ep import expert_parallel_cases
from tests.workers.dist_reshard import fixed_tokens, resharded_logits
from tests.workers.train_ranks import train_command

ALL_CASES = "zero1,zero2,zero2-mtp2,zero2-starve"
DIM, K, FP32 = 32, 3, 4  # the worker's model: dim 32, 3 experts per token, fp32 rows


# each world size's expert-parallel sizes and cases, run in one job (world: [(ep, cases), ...])
EP_JOBS = {2: [(2, ALL_CASES)], 4: [(2, "zero2"), (4, ALL_CASES)], 8: [(8, ALL_CASES)]}


@pytest.fixture(scope="module")
def ep_results(ranks):
    """The results of EP_JOBS, one job per world size, run when a test first asks for that world size."""
    done: dict[int, dict] = {}

    def get(world: int, ep: int) -> dict:
        if world not in done:
            done[world] = ranks(expert_parallel_cases, world, EP_JOBS[world])[0]
        return done[world][ep]

    return get


def check_case(r: dict, ep: int, nodes: list[int], starved: bool) -> None:
    """One case of dist_ep: equal to the single process, every slot computed once, and the dispatcher's bytes
    per destination kind equal to the planner's for the same routing."""
    assert r["logits"] < 1e-5, r["logits"]
    assert r["grad_norm_rel"] < 1e-5, r["grad_norm_rel"]  # clipping is exact: the global norm, experts counted once
    assert r["params"] < 1e-5, r["params"]
    ranks = r["ranks"]
    for group in range(len(ranks) // ep):  # each expert-parallel group: ranks [g ep, (g+1) ep)
        members = ranks[group * ep : (group + 1) * ep]
        for layer in range(len(members[0]["stats"])):
            stats = [m["stats"][layer] for m in members]
            # every token-slot sent in the group was computed once, none dropped
            assert sum(s["slots_computed"] for s in stats) == sum(s["slots_sent"] for s in stats)
            for s in stats:
                # a token with several experts on one rank goes there once (one expert per rank: pairs = slots)
                assert s["pairs_sent"] <= s["slots_sent"] and (ep == 8 or s["pairs_sent"] < s["slots_sent"])
            if starved:
                assert stats[-1]["rows_received"] == 0  # the last rank received nothing, and the step still matched
            planned = trace_pairs([np.array(m["routing"][layer]) for m in members], n_experts=8)
            dispatch, combine = planned.bytes_by_kind(DIM, K, FP32, nodes)
            for rank, s in enumerate(stats):
                measured = [s[f"bytes_{kind}"] for kind in KINDS]
                assert measured == (dispatch[rank] + combine[rank]).tolist()
                assert s["slots_computed"] == planned.slots[rank]


@pytest.mark.parametrize("n, ep, cases", [(n, ep, cases) for n, jobs in EP_JOBS.items() for ep, cases in jobs])
def test_expert_parallel_steps_match_single_process(ep_results, n, ep, cases):
    """Two steps at EP 2, 4 and 8 (one expert per rank), with DP 2 x EP 2, equal a single process on the global
    batch: with ZeRO-1 and -2, with MTP depth 2 (the MTP blocks' experts are sharded too, and the MTP loss is in the
    reference), and with a rank that receives no token at all."""
    r = ep_results(n, ep)
    assert r["world"] == n and r["nodes"] == [0] * ep
    for case in cases.split(","):
        check_case(r[case], ep, r["nodes"], starved="starve" in case)


def test_two_nodes_expert_parallel_and_node_limited_routing(ranks):
    """Two nodes of 2 ranks (as two launchers with --node_rank 0|1 number them: CROSS_RANK); EP 4 spans both nodes
    (experts 0-3 on node 0, 4-7 on node 1) and equals the single process. With n_group 2 = nodes and topk_group 1,
    every token's experts lie on one node, and the dispatcher's cross-node bytes fall accordingly."""
    r = ranks(expert_parallel_cases, 4, [(4, "zero2-groups1x1,zero2-groups2x1")], nodes=2)[0][4]
    assert r["world"] == 4 and r["nodes"] == [0, 0, 1, 1]
    inter = {}
    for case in ("zero2-groups1x1", "zero2-groups2x1"):
        check_case(r[case], 4, r["nodes"], starved=False)
        inter[case] = sum(s["bytes_inter"] for rank in r[case]["ranks"] for s in rank["stats"])
        nodes_per_token = [len({e // 4 for e in token}) for rank in r[case]["ranks"] for layer in rank["routing"]
                           for token in layer]  # fmt: skip
        assert max(nodes_per_token) == (1 if case.endswith("2x1") else 2)
    # without the limit a token whose experts are on both nodes crosses for sure; with it, only when its one node is
    # the other one
    assert 0 < inter["zero2-groups2x1"] < 0.8 * inter["zero2-groups1x1"], inter


def train_rows(run_dir, kind: str = "train"):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def eval_rows(run_dir):
    return train_rows(run_dir, kind="eval")


@pytest.mark.parametrize("zero", [1, 2])
def test_loss_trajectory_does_not_depend_on_ep_size(tiny_data, tmp_path, train, ranks, zero):
    base = tiny_train_cfg(
        tiny_data, tmp_path / "ep1", max_steps=10, grad_accum_steps=2, ckpt_interval=100, eval_interval=100
    )
    base = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, zero_stage=zero))
    train(base)  # one process, ep_size 1, 2 micro-batches per step
    ep2 = dataclasses.replace(
        base, train=dataclasses.replace(base.train, grad_accum_steps=1, out_dir=str(tmp_path / "ep2"))
    )
    dump_config(ep2, tmp_path / "ep2.yaml")
    ranks(train_command, 2, "--config", tmp_path / "ep2.yaml", "parallel.ep_size=2")  # same global batch
    a, b = train_rows(tmp_path / "ep1"), train_rows(tmp_path / "ep2")
    assert [r["step"] for r in b] == list(range(1, 11))
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5), (ra["step"], ra["loss"], rb["loss"])
    assert all(r["a2a_bytes_per_rank"] > 0 for r in b)


def test_two_node_training_equals_one_process(tiny_data, tmp_path, train, launcher):
    """`launch/train.py` as a 2-node job (2 launchers x 2 ranks, EP 4 across the nodes) gives the losses of one
    process on the same global batch, logs cross-node bytes, and saves a complete checkpoint. Its evaluation (2
    windows per domain: fewer than the 4 ranks, so every rank runs them all and one counts them) gives the single
    process's too."""
    base = tiny_train_cfg(
        tiny_data, tmp_path / "one", max_steps=4, micro_batch_size=2, grad_accum_steps=4, ckpt_interval=4,
        eval_interval=4,
    )  # fmt: skip
    train(base)
    two_train = dataclasses.replace(base.train, grad_accum_steps=1, out_dir=str(tmp_path / "two"))
    two = dataclasses.replace(base, train=two_train)
    dump_config(two, tmp_path / "two.yaml")
    launcher.launch("launch/train.py", "--config", str(tmp_path / "two.yaml"), "parallel.ep_size=4", n=2, nodes=2)
    a, b = train_rows(tmp_path / "one"), train_rows(tmp_path / "two")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5), (ra["step"], ra["loss"], rb["loss"])
    assert all(0 < r["a2a_inter_node_bytes_per_rank"] < r["a2a_bytes_per_rank"] for r in b)
    (ea,), (eb,) = (eval_rows(tmp_path / run) for run in ("one", "two"))
    assert eb["loss"] == pytest.approx(ea["loss"], rel=1e-5) and eb.keys() == ea.keys()
    assert latest_tag(tmp_path / "two") == "step_00000004"


def offline_logits(run) -> tuple[torch.Tensor, object]:
    cfg, model, _ = load_model(run)
    with torch.no_grad():
        return model(fixed_tokens(cfg.model.vocab_size)).logits, model


@pytest.mark.parametrize("saved_ep, load_eps", [(2, (1,)), (1, (2, 8)), (8, (2, 1))])
def test_checkpoint_reshards_between_ep_sizes(tiny_data, tmp_path, ranks, saved_ep, load_eps):
    """A checkpoint saved at one ep_size loads at another (EP 2 -> 1, 1 -> 2 and 8, 8 -> 2 and 1): the same logits
    as the plain model assembled from its per-expert files."""
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=3, grad_accum_steps=1, ckpt_interval=3)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep_size=saved_ep))
    dump_config(cfg, tmp_path / "cfg.yaml")
    ranks(train_command, max(saved_ep, 2), "--config", tmp_path / "cfg.yaml")
    expected, model = offline_logits(tmp_path / "run")  # the plain model assembled from per-expert files
    for load_ep in load_eps:
        for got in ranks(resharded_logits, load_ep, tmp_path / "run", load_ep):  # every rank's
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # and the HF export of that checkpoint gives the same logits
    import transformers

    export_hf(model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(fixed_tokens(cfg.model.vocab_size)).logits, expected, atol=1e-4, rtol=1e-4)


def test_ep_size_must_divide_experts_and_world(tiny_data, tmp_path, train):
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=1)
    bad = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep_size=2))
    with pytest.raises(ValueError, match="must divide both the world size"):
        train(bad)  # world size 1 here
