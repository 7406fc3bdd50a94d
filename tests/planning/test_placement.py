"""DeepSeek's EPLB (moe_lm/planning/placement.py) against its published example and on its properties; the load
statistics against their definitions; the placement files as SGLang and vllm-ascend read them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_lm.planning import placement
from moe_lm.planning.placement import (
    balanced_packing,
    identity_placement,
    load_statistics,
    most_slots,
    rank_loads,
    rebalance_experts,
    sglang_expert_location,
    vllm_expert_map,
)
from moe_lm.routing.routed_model import Routed
from moe_lm.routing.trace import TraceWriter

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
    assert no_rank_holds_an_expert_twice(phy2log, gpus)
    if groups % nodes == 0:  # hierarchical: an expert group's experts, replicas included, live on one node
        per_node = slots // nodes
        node_of_group = {}
        for s, e in enumerate(phy2log[0]):
            assert node_of_group.setdefault(e // (64 // groups), s // per_node) == s // per_node
    before = load_statistics(rank_loads(weight, identity_placement(3, 64), gpus))
    after = load_statistics(rank_loads(weight, phy2log, gpus))
    assert after["balancedness"] > before["balancedness"]
    assert after["overload_factor_max"] < before["overload_factor_max"]


def no_rank_holds_an_expert_twice(phy2log: np.ndarray, ranks: int) -> bool:
    per_rank = phy2log.reshape(len(phy2log), ranks, -1)
    return all(len(set(r)) == per_rank.shape[2] for layer in per_rank.tolist() for r in layer)


def deepseek_unconstrained(weight, slots, groups, nodes, gpus):
    """DeepSeek's EPLB as published: our functions without the constraint (the README's example is theirs)."""
    pack, replicate = placement.balanced_packing, placement.replicate_experts
    with pytest.MonkeyPatch.context() as m:
        m.setattr(placement, "balanced_packing", lambda w, n, labels=None: pack(w, n))
        m.setattr(placement, "replicate_experts", lambda w, p, most=None: replicate(w, p))
        return rebalance_experts(weight, slots, groups, nodes, gpus)[0]


def test_no_rank_holds_two_copies_of_an_expert_and_otherwise_the_placement_is_deepseeks():
    """vllm-ascend's loader misreads a rank holding two copies of one expert (placement.py's docstring), which
    DeepSeek's packing makes. On random, skewed, tied and zero loads at every slot count up to the cap: no rank holds
    two, every expert has a slot, and where DeepSeek's placement had no such rank, it is DeepSeek's, slot for slot."""
    rng = np.random.default_rng(7)
    shapes = [(8, 1, 1, 4), (8, 4, 1, 4), (8, 4, 2, 8), (16, 1, 2, 8), (16, 4, 2, 4), (32, 8, 4, 16), (64, 8, 2, 8)]
    kept = 0
    for trial in range(240):
        experts, groups, nodes, gpus = shapes[trial % len(shapes)]
        slots = experts + gpus * int(rng.integers(0, (most_slots(experts, groups, nodes, gpus) - experts) // gpus + 1))
        load = [rng.gamma(0.3, 100, (2, experts)), rng.zipf(1.3, (2, experts)).astype(float),
                rng.integers(0, 3, (2, experts)).astype(float)][trial % 3]  # fmt: skip
        phy2log, _, logcnt = rebalance_experts(load, slots, groups, nodes, gpus)
        assert no_rank_holds_an_expert_twice(phy2log, gpus), (trial, phy2log)
        assert (logcnt >= 1).all() and (logcnt.sum(1) == slots).all()
        theirs = deepseek_unconstrained(load, slots, groups, nodes, gpus)
        if no_rank_holds_an_expert_twice(theirs, gpus):
            assert np.array_equal(phy2log, theirs), trial
            kept += 1
    assert 20 < kept < 220  # both kinds were met (39 kept)


def test_a_copy_that_fits_nowhere_swaps_with_a_lighter_item():
    """3 packs of 3: the heavy item fills pack 0 alone while packs 1 and 2 fill up, so both copies of label 7 would
    land in pack 0; the second takes an item's place in a full pack instead, and that item moves to pack 0."""
    weight = np.array([[100.0, 10, 10, 10, 10, 10, 10, 1, 1]])
    labels = np.array([[0, 1, 2, 3, 4, 5, 6, 7, 7]])
    assert sorted(balanced_packing(weight, 3)[0][0, 7:].tolist()) == [0, 0]  # DeepSeek's packing
    pack, rank = balanced_packing(weight, 3, labels=labels)
    members = [sorted(labels[0, pack[0] == p].tolist()) for p in range(3)]
    assert all(len(set(m)) == 3 for m in members) and sorted(pack[0, 7:].tolist()) in ([0, 1], [0, 2])
    assert sorted(zip(pack[0].tolist(), rank[0].tolist(), strict=True)) == [(p, r) for p in range(3) for r in range(3)]


def test_the_slots_are_capped_at_one_copy_of_each_expert_per_rank():
    """At the cap every rank of a node holds every expert of the node; one slot a rank more cannot be placed."""
    weight = np.random.default_rng(3).zipf(1.5, (2, 8)).astype(float)
    assert most_slots(8, 4, 2, 8) == 32 and most_slots(8, 3, 2, 8) == 64  # 3 groups on 2 nodes: one pool
    phy2log, _, logcnt = rebalance_experts(weight, 32, 4, 2, 8)
    assert (logcnt == 4).all() and no_rank_holds_an_expert_twice(phy2log, 8)
    with pytest.raises(ValueError, match="at most 4 copies"):
        rebalance_experts(weight, 40, 4, 2, 8)
    with pytest.raises(ValueError, match="every expert needs a slot"):
        rebalance_experts(weight, 4, 4, 2, 4)


def ascend_slots(device_expert: list[list[int]], n_experts: int, ep_rank: int) -> np.ndarray:
    """[experts]: the global slot rank `ep_rank` dispatches each expert to, as vllm-ascend builds it from an expert
    map (vllm_ascend/eplb/core/eplb_utils.py at v0.23.0: `init_eplb_config`, `generate_log2phy_map`)."""
    maps = np.full((len(device_expert), n_experts), -1)
    for r, experts in enumerate(device_expert):
        maps[r, experts] = np.arange(len(experts))  # one entry per expert: a second copy's slot is lost
    valid_count = (maps[0] != -1).sum()  # rank 0's distinct experts, taken as every rank's slot count
    slots = [[maps[r, e] + r * valid_count for r in range(len(maps)) if maps[r, e] != -1] for e in range(n_experts)]
    return np.array([s[ep_rank % len(s)] for s in slots])  # the replica a rank dispatches to


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
    for i, layer in enumerate(vllm["layer_list"]):
        placed = {e for d in layer["device_list"] for e in d["device_expert"]}
        assert placed == set(range(12)) and all(len(d["device_expert"]) == 2 for d in layer["device_list"])
        lists = [d["device_expert"] for d in layer["device_list"]]
        for rank in range(8):  # where each rank dispatches each expert: a slot holding that expert
            assert (phy2log[i][ascend_slots(lists, 12, rank)] == np.arange(12)).all()
    # the committed d256-ep4 placement's MoE layer 2 (rank 0 [7, 0, 0]): refused, and what vllm-ascend made of it
    doubled = np.array([[7, 0, 0, 6, 2, 1, 6, 3, 4, 5, 5, 4]])
    assert not (doubled[0][ascend_slots(doubled[0].reshape(4, 3).tolist(), 8, 0)] == np.arange(8)).all()
    with pytest.raises(ValueError, match=r"two copies of an expert on rank 0 \(\[7, 0, 0\]\)"):
        vllm_expert_map(doubled, num_ranks=4)


def skewed_trace(folder, n_docs: int = 40, per_doc: int = 100, layers=(1, 2, 3)):
    """Two domains whose tokens favour other experts (each its own hot four of eight), documents alternating; the
    tiny preset's MoE layers (1, 2, 3), each routed alike."""
    rng = np.random.default_rng(0)
    writer = TraceWriter(folder, list(layers), 8, 2, ["code", "prose"], {"kind": "test"}, columns=())  # experts only
    for d in range(n_docs):
        domain = d % 2
        p = np.array([0.3, 0.3, 0.2, 0.1, 0.025, 0.025, 0.025, 0.025])
        p = p if domain == 0 else p[::-1]
        first = rng.choice(8, size=per_doc, p=p)
        idx = np.stack([first, (first + 1 + rng.integers(0, 7, per_doc)) % 8], axis=1)
        writer.append(np.zeros(per_doc), np.full(per_doc, d), np.arange(per_doc), np.full(per_doc, domain),
                      Routed(dict.fromkeys(layers, idx)))  # fmt: skip
    return writer.close()


ESTIMATE = ["--config", "tiny", "--gpus-per-node", "4", "parallel.ep_size=4", "train.seq_len=64"]


def by_definition(per_rank: np.ndarray) -> dict:
    """The four statistics of per-rank loads [layers, ranks], as their sources define them."""
    mean, most = per_rank.mean(1), per_rank.max(1)
    return {"balancedness": mean.sum() / most.sum(), "overload_factor_mean": (most / mean).mean(),
            "overload_factor_max": (most / mean).max(), "rank_cv": (per_rank.std(1) / mean).mean()}  # fmt: skip


def assert_engine_files_hold_the_placement(folder, layers: int, ranks: int, decoder_layers: int = 4):
    """SGLang's and vllm-ascend's maps are placement.json's: every expert placed in every layer, every rank as many
    slots, none holding an expert twice; SGLang's dense rows the trivial map."""
    placement = json.loads((folder / "placement.json").read_text())
    phy2log = np.array(placement["phy2log"])
    slots = phy2log.shape[1]
    assert phy2log.shape[0] == layers and slots % ranks == 0
    assert all(set(row) == set(range(8)) for row in phy2log.tolist()) and no_rank_holds_an_expert_twice(phy2log, ranks)
    sglang = json.loads((folder / "sglang_expert_location.json").read_text())["physical_to_logical_map"]
    assert len(sglang) == decoder_layers and sglang[decoder_layers - layers :] == phy2log.tolist()
    assert all(row == [s % 8 for s in range(slots)] for row in sglang[: decoder_layers - layers])
    vllm = json.loads((folder / "vllm_expert_map.json").read_text())
    lists = [[d["device_expert"] for d in layer["device_list"]] for layer in vllm["layer_list"]]
    assert vllm["moe_layer_count"] == layers and lists == phy2log.reshape(layers, ranks, -1).tolist()
    return placement, phy2log


def test_estimate_writes_a_placement_planned_on_half_the_documents_and_measured_on_the_other(tmp_path, cli):
    trace = skewed_trace(tmp_path / "trace")
    proc = cli("estimate", *ESTIMATE, "--trace", trace.folder, "--redundant", "4", "--placement", tmp_path / "place")
    assert proc.returncode == 0, proc.stderr[-3000:]
    placement, phy2log = assert_engine_files_hold_the_placement(tmp_path / "place", layers=3, ranks=4)
    # held out: every second document of each domain (documents alternate domains: 2, 3, 6, 7, ...); every statistic
    # recomputed from the trace, slot by slot, overall and per domain
    docs, domain = np.asarray(trace.doc), np.asarray(trace.domain)
    odd = np.isin(docs, [d for d in range(40) if (d // 2) % 2 == 1])
    for name, rows in (("held out", odd), ("code", odd & (domain == 0)), ("prose", odd & (domain == 1))):
        counts = np.stack([np.bincount(np.asarray(trace.experts(i))[rows].ravel(), minlength=8) for i in (1, 2, 3)])
        per_rank = []
        for layer in range(3):
            copies = np.bincount(phy2log[layer], minlength=8)
            slots = phy2log[layer].reshape(4, 3)  # 12 slots, 3 a rank
            per_rank.append([sum(counts[layer, e] / copies[e] for e in slots[r]) for r in range(4)])
        stats = placement["held_out"] if name == "held out" else placement["held_out_by_domain"][name]
        assert stats["tokens"] == rows.sum()
        assert stats["placed"] == pytest.approx(by_definition(np.array(per_rank)))
        assert stats["contiguous"] == pytest.approx(by_definition(counts.reshape(3, 4, 2).sum(-1).astype(float)))
    held = placement["held_out"]
    assert held["placed"]["balancedness"] > held["contiguous"]["balancedness"]
    assert f"{held['placed']['balancedness']:.3f}" in proc.stdout
    # the all-to-all on the held-out tokens, each layer waiting for its slowest rank: the evened load sends less to it
    a2a = placement["all_to_all_ms_per_step"]
    assert 0 < a2a["placed"] < a2a["contiguous"]
    assert f"contiguous {a2a['contiguous']:.3g} ms -> placed {a2a['placed']:.3g} ms" in proc.stdout


def test_estimate_gives_every_expert_a_slot_with_no_redundant_slot_and_with_400000(tmp_path, cli):
    """--redundant 0: one slot an expert; 400,000: capped, said, at every rank holding all 8 experts (the tiny
    preset's 4 groups on one node), in the time of any other plan (the replication loop runs once a slot)."""
    trace = skewed_trace(tmp_path / "trace", n_docs=8)
    for redundant, slots in ((0, 8), (400_000, 32)):
        out = tmp_path / f"place-{redundant}"
        proc = cli("estimate", *ESTIMATE, "--trace", trace.folder, "--redundant", str(redundant), "--placement", out)
        assert proc.returncode == 0, proc.stderr[-3000:]
        placement, phy2log = assert_engine_files_hold_the_placement(out, layers=3, ranks=4)
        assert phy2log.shape == (3, slots) and placement["redundant"] == slots - 8
    assert "--redundant 400000: at most 24 redundant slots keep every copy of an expert on a rank" in proc.stdout
    assert (np.sort(phy2log.reshape(3, 4, 8), -1) == np.arange(8)).all()


def test_an_mtp_layer_is_placed_and_left_out_of_the_engines_files(tmp_path, cli):
    """A run with an MTP module records its MoE layer as layer n_layers (4 here): it was written past the end of
    SGLang's rows (an IndexError); SGLang's map holds decoder layers and vllm-ascend places an MTP layer itself."""
    trace = skewed_trace(tmp_path / "trace", n_docs=8, layers=(1, 2, 3, 4))
    proc = cli("estimate", *ESTIMATE, "model.mtp.depth=1", "--trace", trace.folder, "--placement", tmp_path / "p")
    assert proc.returncode == 0, proc.stderr[-3000:]
    phy2log = json.loads((tmp_path / "p" / "placement.json").read_text())["phy2log"]
    sglang = json.loads((tmp_path / "p" / "sglang_expert_location.json").read_text())["physical_to_logical_map"]
    vllm = json.loads((tmp_path / "p" / "vllm_expert_map.json").read_text())
    assert len(phy2log) == 4 and len(sglang) == 4 and sglang[1:] == phy2log[:3] and vllm["moe_layer_count"] == 3


def test_estimate_refuses_a_placement_it_cannot_write_and_touches_nothing(tmp_path, cli):
    """A user's folder holding files of the names it writes, a symlink, a file; a trace of other MoE layers;
    --redundant below 0 or not a multiple of the ranks; --placement without --trace: one line, exit 2, nothing
    written or changed. The user's folder only with --force, moved aside whole."""
    trace = skewed_trace(tmp_path / "trace", n_docs=8)
    other = skewed_trace(tmp_path / "other", n_docs=8, layers=(1, 2))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "placement.json").write_text("my own\n")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "file").write_text("a file\n")

    def snapshot():
        return {str(p): p.read_bytes() if p.is_file() and not p.is_symlink() else None for p in tmp_path.rglob("*")}

    before = snapshot()
    cases = [
        (["--trace", trace.folder, "--placement", tmp_path / "mine"], "holds files that moe-lm estimate did not write"),
        (["--trace", trace.folder, "--placement", tmp_path / "link"], "is a symlink"),
        (["--trace", trace.folder, "--placement", tmp_path / "file"], "exists and is not a folder"),
        (["--trace", other.folder, "--placement", tmp_path / "new"],
         f"the trace {other.folder} records MoE layers [1, 2] but the config's MoE layers are [1, 2, 3]"),
        (["--trace", trace.folder, "--redundant", "-4", "--placement", tmp_path / "new"], "--redundant -4: must be"),
        (["--trace", trace.folder, "--redundant", "3", "--placement", tmp_path / "new"], "must be a multiple"),
        (["--placement", tmp_path / "new"], "give --trace TRACE"),
    ]  # fmt: skip
    for flags, said in cases:
        proc = cli("estimate", *ESTIMATE, *flags)
        assert proc.returncode == 2 and said in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert snapshot() == before, flags
    # --force (what the refusal offers) moves the user's folder aside whole and writes in its place
    proc = cli("estimate", *ESTIMATE, "--trace", trace.folder, "--placement", tmp_path / "mine", "--force")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (aside,) = tmp_path.glob("mine.prev-*")
    assert (aside / "placement.json").read_text() == "my own\n"
    assert (tmp_path / "mine" / "vllm_expert_map.json").is_file()
