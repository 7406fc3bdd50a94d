"""DeepSeek's EPLB (moe_lm/planning/placement.py) against its published example and on its properties; the load
statistics against their definitions; the placement files as SGLang and vllm-ascend read them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_lm.analysis.trace import TraceWriter
from moe_lm.planning.placement import (
    identity_placement,
    load_statistics,
    rank_loads,
    rebalance_experts,
    sglang_expert_location,
    vllm_expert_map,
)
from moe_lm.routing.routed_model import Routed

# github.com/deepseek-ai/EPLB README (d52c72d5): the hierarchical policy's example, input and printed phy2log
README_WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                 [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]  # fmt: skip
README_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]  # fmt: skip


def test_the_published_example_gives_the_published_placement():
    phy2log, log2phy, logcnt = rebalance_experts(np.array(README_WEIGHT), 16, 4, 2, 8)
    assert phy2log.tolist() == README_PHY2LOG
    assert logcnt.sum(1).tolist() == [16, 16]
    for layer in range(2):  # log2phy lists exactly the slots phy2log gives each expert
        for e in range(12):
            slots = [s for s in log2phy[layer, e] if s >= 0]
            assert sorted(slots) == [s for s in range(16) if phy2log[layer, s] == e] and len(slots) == logcnt[layer, e]


@pytest.mark.parametrize("groups, nodes, gpus, slots", [(8, 2, 8, 72), (8, 4, 16, 80), (6, 4, 8, 64), (1, 1, 4, 64)])
def test_every_expert_is_placed_and_every_gpu_gets_its_slots(groups, nodes, gpus, slots):
    rng = np.random.default_rng(groups + nodes)
    weight = rng.gamma(0.5, 100.0, size=(3, 64)) + 1
    phy2log, log2phy, logcnt = rebalance_experts(weight, slots, groups, nodes, gpus)
    assert phy2log.shape == (3, slots) and (logcnt >= 1).all() and (logcnt.sum(1) == slots).all()
    for layer in range(3):
        assert np.array_equal(np.bincount(phy2log[layer], minlength=64), logcnt[layer])
    if groups % nodes == 0:  # hierarchical: an expert group's experts, replicas included, live on one node
        per_node = slots // nodes
        node_of_group = {}
        for s, e in enumerate(phy2log[0]):
            assert node_of_group.setdefault(e // (64 // groups), s // per_node) == s // per_node
    before = load_statistics(rank_loads(weight, identity_placement(3, 64), gpus))
    after = load_statistics(rank_loads(weight, phy2log, gpus))
    assert after["balancedness"] > before["balancedness"]
    assert after["overload_factor_max"] < before["overload_factor_max"]


def test_load_statistics_follow_their_definitions():
    loads = np.array([[10.0, 30.0], [20.0, 20.0]])  # layer 0: ranks of 10 and 30; layer 1 balanced
    s = load_statistics(loads)
    assert s["balancedness"] == pytest.approx((20 + 20) / (30 + 20))  # vLLM: sum of means / sum of maxima
    assert s["overload_factor_max"] == pytest.approx(1.5) and s["overload_factor_mean"] == pytest.approx(1.25)
    assert s["rank_cv"] == pytest.approx((10 / 20 + 0) / 2)
    # an expert with two replicas sends half its tokens to each
    loads = rank_loads(np.array([[8.0, 2.0]]), np.array([[0, 1, 0, 1]]), 2)
    assert loads.tolist() == [[5.0, 5.0]]


def test_the_placement_files_are_what_the_engines_read():
    phy2log, _, _ = rebalance_experts(np.array(README_WEIGHT), 16, 4, 2, 8)
    sglang = sglang_expert_location(phy2log, moe_layers=[1, 2], n_layers=3)["physical_to_logical_map"]
    assert len(sglang) == 3 and sglang[1:] == README_PHY2LOG and sglang[0] == [s % 12 for s in range(16)]
    vllm = vllm_expert_map(phy2log, num_ranks=8)
    assert vllm["moe_layer_count"] == 2 and len(vllm["layer_list"][0]["device_list"]) == 8
    # vllm-ascend builds each rank's global -> local map from its list; every logical expert is on some rank
    for layer in vllm["layer_list"]:
        placed = {e for d in layer["device_list"] for e in d["device_expert"]}
        assert placed == set(range(12)) and all(len(d["device_expert"]) == 2 for d in layer["device_list"])


def skewed_trace(folder, n_docs: int = 40, per_doc: int = 100):
    """Two domains whose tokens favour other experts (each its own hot four of eight), documents alternating."""
    rng = np.random.default_rng(0)
    writer = TraceWriter(folder, [1, 2], 8, 2, ["code", "prose"], {"kind": "test"}, columns=())  # experts only
    for d in range(n_docs):
        domain = d % 2
        p = np.array([0.3, 0.3, 0.2, 0.1, 0.025, 0.025, 0.025, 0.025])
        p = p if domain == 0 else p[::-1]
        first = rng.choice(8, size=per_doc, p=p)
        idx = np.stack([first, (first + 1 + rng.integers(0, 7, per_doc)) % 8], axis=1)
        writer.append(np.zeros(per_doc), np.full(per_doc, d), np.arange(per_doc), np.full(per_doc, domain),
                      Routed({1: idx, 2: idx}))  # fmt: skip
    return writer.close()


def test_estimate_writes_a_placement_planned_on_half_the_documents_and_measured_on_the_other(tmp_path, cli):
    trace = skewed_trace(tmp_path / "trace")
    argv = ["--config", "tiny", "--gpus-per-node", "4", "parallel.ep_size=4", "train.seq_len=64", "--trace",
            trace.folder, "--redundant", "4"]  # fmt: skip
    proc = cli("estimate", *argv, "--placement", tmp_path / "place")
    assert proc.returncode == 0, proc.stderr[-3000:]
    placement = json.loads((tmp_path / "place" / "placement.json").read_text())
    phy2log = np.array(placement["phy2log"])
    # held out: every second document of each domain (documents alternate domains: 2, 3, 6, 7, ...), brute force
    odd = np.isin(np.asarray(trace.doc), [d for d in range(40) if (d // 2) % 2 == 1])
    counts = np.stack([np.bincount(np.asarray(trace.experts(layer))[odd].ravel(), minlength=8) for layer in (1, 2)])
    per_rank = []
    for layer in range(2):
        copies = np.bincount(phy2log[layer], minlength=8)
        slots = phy2log[layer].reshape(4, 3)  # 12 slots, 3 a rank
        per_rank.append([sum(counts[layer, e] / copies[e] for e in slots[r]) for r in range(4)])
    per_rank = np.array(per_rank)
    held = placement["held_out"]
    assert held["placed"]["balancedness"] == pytest.approx(per_rank.mean(1).sum() / per_rank.max(1).sum())
    assert held["placed"]["balancedness"] > held["contiguous"]["balancedness"]
    assert set(placement["held_out_by_domain"]) == {"code", "prose"}
    assert f"{held['placed']['balancedness']:.3f}" in proc.stdout
    # the all-to-all on the held-out tokens, each layer waiting for its slowest rank: the evened load sends less to it
    a2a = placement["all_to_all_ms_per_step"]
    assert 0 < a2a["placed"] < a2a["contiguous"]
    assert f"contiguous {a2a['contiguous']:.3g} ms -> placed {a2a['placed']:.3g} ms" in proc.stdout
    sglang = json.loads((tmp_path / "place" / "sglang_expert_location.json").read_text())["physical_to_logical_map"]
    assert len(sglang) == 4 and sglang[1] == placement["phy2log"][0] and sglang[2] == placement["phy2log"][1]
    vllm = json.loads((tmp_path / "place" / "vllm_expert_map.json").read_text())
    assert vllm["moe_layer_count"] == 2 and [d["device_expert"] for d in vllm["layer_list"][1]["device_list"]] == [
        placement["phy2log"][1][r * 3 : r * 3 + 3] for r in range(4)
    ]
    wrong = (([], "give --trace TRACE"), (["--trace", trace.folder, "--redundant", "3"], "must be a multiple"))
    for flags, said in wrong:
        proc = cli("estimate", "--config", "tiny", "--gpus-per-node", "4", "parallel.ep_size=4", *flags,
                   "--placement", tmp_path / "again")  # fmt: skip
        assert proc.returncode == 2 and said in proc.stderr and not (tmp_path / "again").exists(), proc.stderr
