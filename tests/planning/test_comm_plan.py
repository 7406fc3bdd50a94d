"""The communication planner on paper: its expectations against sampled routing, node-limited routing with the real
router, the EPLB-like placement, and `moe-lm estimate` with a routing trace. (Its byte counts against the
dispatcher's measured ones: tests/parallel/test_expert_parallel.py.)"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from moe_lm.config import MoEConfig
from moe_lm.model.router import Router
from moe_lm.planning.comm_plan import (
    KINDS,
    Layout,
    Links,
    contiguous_placement,
    max_nodes_per_token,
    pair_kind,
    place_experts,
    replica_pairs,
    slowest_rank_seconds,
    split_by_rank,
    trace_pairs,
    uniform_nodes_per_token,
    uniform_pairs,
)
from moe_lm.routing.routed_model import Routed
from moe_lm.routing.trace import TraceWriter


def sample_uniform(rng, E: int, K: int, G: int, M: int, n: int) -> np.ndarray:
    """Uniform group-limited routing written plainly: M groups uniformly, then K experts uniformly among theirs."""
    size = E // G
    out = np.empty((n, K), np.int64)
    for t in range(n):
        groups = rng.choice(G, M, replace=False)
        eligible = (groups[:, None] * size + np.arange(size)).ravel()
        out[t] = rng.choice(eligible, K, replace=False)
    return out


def count_pairs(idx_per_rank: list[np.ndarray], n_experts: int, nodes: list[int]) -> dict[str, float]:
    """Pairs per token by kind, one token at a time (the planner's vectorised count written out)."""
    R, total = len(nodes), dict.fromkeys(KINDS, 0)
    for s, idx in enumerate(idx_per_rank):
        for token in idx:
            for r in {int(e) // (n_experts // R) for e in token}:
                total[pair_kind(s, r, nodes)] += 1
    n = sum(len(i) for i in idx_per_rank)
    return {k: v / n for k, v in total.items()}


@pytest.mark.parametrize(
    "E, K, G, M, nodes, gpn, ep",
    [(8, 3, 4, 2, 2, 2, 4), (64, 6, 8, 4, 2, 8, 16), (256, 8, 8, 4, 8, 8, 64), (64, 6, 1, 1, 2, 4, 8)],
)
def test_uniform_expectations_match_sampled_routing(E, K, G, M, nodes, gpn, ep):
    """The exact combinatorics agree with 6000 sampled tokens, counted one by one, within 4 standard errors."""
    layout = Layout(nodes, gpn, ep)
    ep_nodes = layout.ep_nodes()
    rng = np.random.default_rng(0)
    idx = sample_uniform(rng, E, K, G, M, 6000)
    per_rank = [idx[r::ep] for r in range(ep)]
    sampled = count_pairs(per_rank, E, ep_nodes)
    assert trace_pairs(per_rank, E).pairs_per_token(ep_nodes) == pytest.approx(sampled, abs=1e-12)
    expected = uniform_pairs(E, K, G, M, ep_nodes)
    for kind in KINDS:
        assert sampled[kind] == pytest.approx(expected[kind], abs=4 * np.sqrt(K / 6000) + 1e-9), kind
    node_of = np.repeat(ep_nodes, E // ep)
    spread = np.array([len(set(node_of[t])) for t in idx])
    assert spread.mean() == pytest.approx(uniform_nodes_per_token(E, K, G, M, ep_nodes), abs=4 * spread.std() / 77)
    assert spread.max() <= max_nodes_per_token(E, K, G, M, ep_nodes)


def route(moe: MoEConfig, n: int, dim: int = 16) -> np.ndarray:
    torch.manual_seed(0)
    router = Router(dim, moe, init_std=1.0)
    router.e_score_correction_bias.uniform_(-0.5, 0.5)  # the selection bias takes part in the group choice
    with torch.no_grad():
        return router(torch.randn(n, dim)).topk_idx.numpy()


@pytest.mark.parametrize("n_group, topk_group, bound", [(8, 3, 3), (4, 2, 2), (4, 1, 1), (1, 1, 4), (2, 1, 2)])
def test_node_limited_routing_bounds_the_nodes_a_token_reaches(n_group, topk_group, bound):
    """64 experts over EP 16 on 4 nodes of 4 GPUs (16 experts per node). With groups inside nodes (8 or 4 groups), the
    router's group limit bounds every token to topk_group nodes; without a limit tokens reach all 4, and one group
    of 32 experts straddles two nodes. 20,000 tokens through the real router (its CPU kernel)."""
    moe = MoEConfig(n_routed_experts=64, num_experts_per_tok=6, n_group=n_group, topk_group=topk_group)
    nodes = Layout(4, 4, 16).ep_nodes()
    assert max_nodes_per_token(64, 6, n_group, topk_group, nodes) == bound
    idx = route(moe, 20_000)
    reached = np.array([len({int(e) // 16 for e in token}) for token in idx])
    assert reached.max() == bound


def test_placement_evens_a_skewed_load():
    """Zipf-skewed expert loads: the hierarchical placement (groups whole on nodes, replicas inside) and the global
    one both lower the hottest rank's load over the mean, every rank holds as many experts, every expert is
    somewhere, and the hierarchical one keeps each group on one node."""
    E, layout, n_group = 64, Layout(2, 8, 16), 8
    load = 1000.0 / np.arange(1, E + 1) ** 1.1
    np.random.default_rng(1).shuffle(load)
    before = contiguous_placement(load, 16)
    assert before.imbalance > 2.0
    for groups in (n_group, 1):  # 8 groups on 2 nodes: hierarchical; 1 group: global
        placed = place_experts(load, layout, groups, redundant=16)
        assert placed.imbalance < 1.25 < before.imbalance
        assert [len(r) for r in placed.rank_experts] == [5] * 16
        assert sorted(set(sum(placed.rank_experts, []))) == list(range(E))
        assert placed.rank_load.sum() == pytest.approx(load.sum())
    placed = place_experts(load, layout, n_group, redundant=16)
    node_of_rank = layout.ep_nodes()
    for g in range(n_group):
        hosts = {node_of_rank[r] for r, held in enumerate(placed.rank_experts) for e in held if e // 8 == g}
        assert len(hosts) == 1, (g, hosts)
    with pytest.raises(ValueError, match="multiple of ep_size"):
        place_experts(load, layout, n_group, redundant=3)


def test_trace_tokens_are_dealt_to_ranks_by_sequence():
    idx = np.arange(24).reshape(12, 2)
    a, b = split_by_rank(idx, ep_size=2, seq_len=3)
    assert a.tolist() == idx[[0, 1, 2, 6, 7, 8]].tolist() and b.tolist() == idx[[3, 4, 5, 9, 10, 11]].tolist()
    with pytest.raises(ValueError, match="fewer than one"):
        split_by_rank(idx, ep_size=8, seq_len=3)


def write_trace(folder, idx: np.ndarray, n_experts: int):
    writer = TraceWriter(folder, [1, 2], n_experts, idx.shape[1], ["d"], {"kind": "test"})
    zeros, weights = np.zeros(len(idx)), np.zeros(idx.shape)
    nan = np.full(len(idx), np.nan)
    writer.append(zeros, zeros, np.arange(len(idx)), zeros, Routed({1: idx, 2: idx}, {1: weights, 2: weights}, {}, nan))
    return writer.close()


def test_estimate_plans_from_a_routing_trace(tmp_path, cli):
    """`moe-lm estimate --trace`: the trace's pairs per token (what the dispatcher would send for those tokens), the
    expert load per rank, and a placement that evens it; a trace of another model is refused by name."""
    rng = np.random.default_rng(0)
    hot = rng.choice(8, size=(4096, 2), p=[0.4, 0.2, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05])
    hot[:, 1] = np.where(hot[:, 1] == hot[:, 0], (hot[:, 0] + 1) % 8, hot[:, 1])  # two distinct experts
    trace = write_trace(tmp_path / "trace", hot, 8)
    argv = ["--config", "tiny", "--gpus-per-node", "2", "--nodes", "2", "parallel.ep_size=4", "train.seq_len=64"]
    proc = cli("estimate", *argv, "--trace", trace.folder, "--redundant", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    line = next(row for row in out.splitlines() if row.strip().startswith("trace trace"))
    nodes = Layout(2, 2, 4).ep_nodes()
    expected = trace_pairs(split_by_rank(hot, 4, 64), 8).pairs_per_token(nodes)
    assert [f"{expected[k]:.2f}" for k in KINDS] == re.findall(r"\d+\.\d+", line)[:3]
    load = next(row for row in out.splitlines() if "expert load of the trace" in row)
    contiguous, placed = (float(part.split()[-2].rstrip(",")) for part in load.split(";"))
    assert placed < contiguous
    other = write_trace(tmp_path / "other", hot % 4, 4)
    proc = cli("estimate", *argv, "--trace", other.folder)
    assert proc.returncode == 2  # a user error
    assert f"the trace {other.folder} routes to 2 of 4 experts but the config to 2 of 8" in proc.stderr


@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda t: t.joinpath("experts_L1.u8").write_bytes(b"\xff" * (4096 * 2)), "experts_L1.u8 holds expert 255"),
        (lambda t: t.joinpath("experts_L2.u8").write_bytes(b"\x00" * 10), "experts_L2.u8 is 10 bytes"),
        (lambda t: t.joinpath("token.u32").unlink(), "token.u32 is missing"),
        (lambda t: t.joinpath("meta.json").write_text('{"n_tokens": "many"}'), "n_tokens is 'many'"),
        (lambda t: t.joinpath("meta.json").write_text("{"), "meta.json is not JSON"),
    ],
)
def test_a_damaged_trace_is_one_line_naming_the_file(tmp_path, cli, damage, named):
    rng = np.random.default_rng(0)
    trace = write_trace(tmp_path / "trace", np.stack([rng.permutation(8)[:2] for _ in range(4096)]), 8)
    damage(trace.folder)
    argv = ["--config", "tiny", "--gpus-per-node", "2", "parallel.ep_size=2", "train.seq_len=64"]
    proc = cli("estimate", *argv, "--trace", trace.folder)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-2000:]
    assert named in lines[0], lines[0]


def test_a_trace_the_plan_cannot_use_is_refused_not_ignored(tmp_path, cli):
    """At ep_size 1 the trace was ignored without a word (even a path that does not exist gave the usual plan), and a
    trace with no MoE layer ended in a ZeroDivisionError."""
    rng = np.random.default_rng(0)
    trace = write_trace(tmp_path / "trace", np.stack([rng.permutation(8)[:2] for _ in range(256)]), 8)
    one = ["--config", "tiny", "--world", "2", "train.seq_len=64"]
    for folder, said in ((tmp_path / "nowhere", "is not a complete trace"), (trace.folder, "parallel.ep_size 1")):
        proc = cli("estimate", *one, "--trace", folder)
        assert proc.returncode == 2 and said in proc.stderr and not proc.stdout, proc.stderr[-2000:]
    empty = TraceWriter(tmp_path / "dense", [], 8, 2, ["d"], {"kind": "test"}).close()
    proc = cli("estimate", *one, "parallel.ep_size=2", "--trace", empty.folder)
    assert proc.returncode == 2 and "records no MoE layer" in proc.stderr and "Traceback" not in proc.stderr


def test_pairs_under_replicas_are_those_of_a_uniform_choice_among_the_copies():
    """`replica_pairs`: without replicas the exact counts of `trace_pairs`; with them the mean over many draws of
    which copy each token's expert goes to (uniform among its replicas), sampled here."""
    rng = np.random.default_rng(0)
    per_rank = [np.stack([rng.permutation(8)[:2] for _ in range(300)]) for _ in range(4)]
    identity = np.arange(8)
    exact = replica_pairs(per_rank, identity)
    assert np.array_equal(exact.pairs, trace_pairs(per_rank, 8).pairs) and np.array_equal(
        exact.slots, trace_pairs(per_rank, 8).slots
    )
    phy2log = np.array([0, 1, 2, 0, 3, 4, 5, 1, 6, 7, 0, 2])  # 12 slots, 3 a rank: expert 0 thrice, 1 and 2 twice
    rank_of_slot = np.arange(12) // 3
    copies = [np.flatnonzero(phy2log == e) for e in range(8)]
    n_copies = np.array([len(c) for c in copies])
    table = np.array([np.resize(c, n_copies.max()) for c in copies])  # [expert, i]: its i-th copy (i < n_copies)
    draws, sampled = 400, np.zeros((4, 4))
    for s, idx in enumerate(per_rank):
        # each draw picks, for every (token, choice), copy floor(u * n) of that expert's n: uniform among them
        pick = (rng.random((draws, *idx.shape)) * n_copies[idx]).astype(np.int64)
        slot = table[idx, pick]  # [draws, T, K]
        hit = np.zeros((draws, len(idx), 4), bool)
        np.put_along_axis(hit, rank_of_slot[slot], True, axis=2)
        sampled[s] = hit.sum((0, 1)) / draws
    expected = replica_pairs(per_rank, phy2log)
    assert expected.pairs == pytest.approx(sampled, rel=0.02)
    assert expected.slots.sum() == pytest.approx(4 * 300 * 2)


def test_a_layers_all_to_all_lasts_as_long_as_its_slowest_rank():
    """Two ranks on two nodes: rank 0 sends 30 rows to rank 1 and gets 5 back in the dispatch; the combine returns
    them. Each phase is the larger of what a rank sends and receives on the link, at the link's rate."""
    pairs = np.array([[10.0, 30.0], [5.0, 20.0]])
    links = Links(intra_gbs=1.0, inter_gbs=0.5)
    seconds = slowest_rank_seconds(pairs, [0, 1], row_out=100, row_back=50, links=links)
    assert seconds == pytest.approx(30 * 100 / 0.5e9 + 30 * 50 / 0.5e9)
    # on one node the same rows cross NVLink; rows to a rank's own experts cost nothing
    assert slowest_rank_seconds(pairs, [0, 0], 100, 50, links) == pytest.approx(30 * 100 / 1e9 + 30 * 50 / 1e9)
    assert slowest_rank_seconds(np.diag([7.0, 9.0]), [0, 1], 100, 50, links) == 0.0
