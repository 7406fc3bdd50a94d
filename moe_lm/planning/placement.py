"""Expert placement for expert-parallel serving and training: DeepSeek's EPLB, the load statistics engines and trainers
report, and the placement files SGLang and vLLM load.

EPLB (github.com/deepseek-ai/EPLB, eplb.py, read at d52c72d5; written here from its description, in numpy):
`rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)` with `weight` [layers, logical experts]
(each expert's load) gives `phy2log` [layers, num_replicas] (the logical expert of every physical slot; slot s is on
GPU s // (num_replicas / num_gpus)), `log2phy` [layers, logical, most replicas] (-1 padded, in the order replicas
were made) and `logcnt` [layers, logical]. Hierarchical when `num_groups % num_nodes == 0`: expert groups are
packed onto nodes (group-limited routing then keeps a token's experts on few nodes), experts replicated within each
node, the replicas packed onto the node's GPUs; otherwise the same with one group and one node (the global policy).
Packing puts each item, heaviest first, on the lightest pack that still has room (the lowest-numbered on a tie);
replication gives each new slot to the expert with the most load per replica (the lowest id on a tie).

One change to DeepSeek's packing: two copies of one expert never share a GPU. DeepSeek's packing may put them
there (all four placements under docs/results/placement/ had such a GPU), and vllm-ascend's loader, which reads
our `vllm_expert_map` file, builds each rank's map keyed by logical expert (vllm_ascend/eplb/core/eplb_utils.py,
`init_eplb_config` and `generate_log2phy_map`, tag v0.23.0 = 5cb98caa, unchanged at 182b75ea of 2026-08-22):
`expert_map[local_placement] = arange(slots)` keeps one slot of the two, and `valid_count`, the distinct experts of
rank 0, is taken as every rank's slot count, so every rank's dispatch ids of that layer point at other slots.
(SGLang's `--init-expert-location` is slot-indexed, python/sglang/srt/eplb/expert_location.py at 01fec5c2, and
upstream vLLM loads no placement file: its EPLBConfig at 00193b82 has no path.) So a copy whose lightest GPU
already holds that expert goes to the lightest GPU with room that does not; where every GPU with room holds it,
a lighter item of a full GPU without it moves over to make room (one always can: see `_make_room`). Where DeepSeek's
packing puts no two copies together, the placement is DeepSeek's, slot for slot. It needs at most one copy of an
expert per GPU of its node, so replication caps an expert's copies there: at most `most_slots` slots in all.

Load statistics, per layer over the expert-parallel ranks, each rank's load the token-slots its slots receive (an
expert's tokens split evenly over its replicas, as a balancing dispatcher aims to): balancedness (vLLM's
`eplb_state.py`: the sum over layers of the mean rank load over the sum of the max rank load, 1 = balanced),
Megatron-Core's overload factor (max-rank tokens / balanced tokens per rank, per layer), and the ranks' coefficient
of variation.
"""

from __future__ import annotations

import numpy as np

from moe_lm.routing.trace import Trace


def balanced_packing(weight: np.ndarray, num_packs: int, labels: np.ndarray | None = None):
    """(pack of each item, its rank within the pack), both [X, n]: every pack gets n / num_packs items. `labels`
    [X, n]: items of one label (copies of one expert) go to distinct packs (needs at most num_packs of each)."""
    X, n = weight.shape
    if n % num_packs:
        raise ValueError(f"{n} items do not split into {num_packs} equal packs")
    per_pack = n // num_packs
    if per_pack == 1:
        return np.tile(np.arange(n), (X, 1)), np.zeros((X, n), dtype=np.int64)
    pack_index = np.empty((X, n), dtype=np.int64)
    rank_in_pack = np.empty((X, n), dtype=np.int64)
    for i in range(X):
        members = _pack_row(weight[i], None if labels is None else labels[i], num_packs, per_pack)
        for p, items in enumerate(members):
            pack_index[i, items], rank_in_pack[i, items] = p, np.arange(len(items))
    return pack_index, rank_in_pack


def _pack_row(weight: np.ndarray, labels: np.ndarray | None, num_packs: int, per_pack: int) -> list[list[int]]:
    """Each pack's items in the order they came: heaviest first onto the lightest pack with room (and, with
    `labels`, without that label)."""
    load, members = np.zeros(num_packs), [[] for _ in range(num_packs)]
    count = np.zeros(num_packs, dtype=np.int64)
    held = np.zeros((int(labels.max()) + 1 if labels is not None else 1, num_packs), dtype=bool)
    for g in np.argsort(-weight, kind="stable"):  # heaviest first; ties in id order
        fits = count < per_pack
        if labels is not None:
            fits &= ~held[labels[g]]
        if fits.any():
            pack = int(np.where(fits, load, np.inf).argmin())  # the lowest-numbered of the lightest
            members[pack].append(int(g))
            count[pack] += 1
        else:  # every pack with room holds this label already
            pack = _make_room(int(g), weight, labels, members, load, count, per_pack, held)
        load[pack] += weight[g]
        if labels is not None:
            held[labels[g], pack] = True
    return members


def _make_room(g: int, weight, labels, members, load, count, per_pack: int, held) -> int:
    """Put item g (whose label every pack with room holds) into the lightest full pack p without its label, moving
    p's lightest item whose label the lightest pack s with room lacks into s; returns p (g's load not yet added).
    Such a p and item always exist: fewer copies of g's label than packs are placed, so some pack lacks it (a full
    one), and were all its labels in s too, s would hold them and g's label, more than a pack holds."""
    s = int(np.where(count < per_pack, load, np.inf).argmin())
    for p in np.argsort(load, kind="stable"):
        if held[labels[g], p]:
            continue
        for j in range(len(members[p]) - 1, -1, -1):  # the lightest first: items came heaviest first
            x = members[p][j]
            if not held[labels[x], s]:
                members[p][j] = g  # g takes x's place in p, x goes to s
                members[s].append(x)
                load[p] -= weight[x]
                load[s] += weight[x]
                count[s] += 1
                held[labels[x], p], held[labels[x], s] = False, True
                return int(p)
    raise AssertionError("no pack can take the item")  # unreachable (see the docstring)


def replicate_experts(weight: np.ndarray, num_phy: int, most: int | None = None):
    """(phy2log [X, num_phy], replica rank [X, num_phy], logcnt [X, num_log]): the first num_log slots are the
    experts themselves, each further slot a replica of the expert with the most load per replica among those with
    fewer than `most` copies."""
    X, num_log = weight.shape
    if num_phy < num_log or (most is not None and num_phy > num_log * most):
        raise ValueError(f"{num_phy} slots for {num_log} experts: every expert needs a slot"
                         + (f", and at most {most} copies of each fit" if most is not None else ""))  # fmt: skip
    phy2log = np.tile(np.arange(num_phy), (X, 1))
    rank = np.zeros((X, num_phy), dtype=np.int64)
    logcnt = np.ones((X, num_log), dtype=np.int64)
    rows = np.arange(X)
    for i in range(num_log, num_phy):
        per_copy = weight / logcnt
        if most is not None:  # why -inf: a zero-load expert at its cap must lose to one below it
            per_copy = np.where(logcnt < most, per_copy, -np.inf)
        redundant = np.argmax(per_copy, axis=-1)
        phy2log[:, i] = redundant
        rank[:, i] = logcnt[rows, redundant]
        logcnt[rows, redundant] += 1
    return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.tile(np.arange(perm.shape[1]), (perm.shape[0], 1)), axis=1)
    return inv


def policy(num_groups: int, num_nodes: int) -> tuple[int, int]:
    """(groups, nodes) EPLB works with: the hierarchical policy's when the groups divide over the nodes, else one
    group on one node (the global policy)."""
    return (num_groups, num_nodes) if num_groups % num_nodes == 0 else (1, 1)


def most_slots(n_experts: int, num_groups: int, num_nodes: int, num_gpus: int) -> int:
    """The most slots a placement can have with no two copies of an expert on one GPU: every GPU of a node holding
    every expert of that node (one copy per GPU of the pool the policy replicates within)."""
    return n_experts * (num_gpus // policy(num_groups, num_nodes)[1])


def _hierarchical(weight: np.ndarray, P: int, G: int, nodes: int, gpus: int):
    L, N = weight.shape
    if N % G or G % nodes or gpus % nodes or P % gpus:
        raise ValueError(f"EPLB needs experts ({N}) % groups ({G}), groups % nodes ({nodes}), GPUs ({gpus}) % nodes "
                         f"and slots ({P}) % GPUs all 0")  # fmt: skip
    group_size, groups_per_node, per_gpu = N // G, G // nodes, P // gpus
    # 1. expert groups onto nodes
    group_pack, group_rank = balanced_packing(weight.reshape(L, G, group_size).sum(-1), nodes)
    log2mlog = ((group_pack * groups_per_node + group_rank) * group_size)[..., None] + np.arange(group_size)
    log2mlog = log2mlog.reshape(L, N)
    mlog2log = _inverse(log2mlog)
    # 2. replicas within each node, at most one per GPU of the node
    tokens_per_mlog = np.take_along_axis(weight, mlog2log, -1).reshape(L * nodes, N // nodes)
    phy2mlog, phyrank, mlogcnt = replicate_experts(tokens_per_mlog, P // nodes, most=gpus // nodes)
    # 3. the node's replicas onto its GPUs, no two copies of an expert on one
    tokens_per_phy = np.take_along_axis(tokens_per_mlog / mlogcnt, phy2mlog, -1)
    pack, rank = balanced_packing(tokens_per_phy, gpus // nodes, labels=phy2mlog)
    pphy2phy = _inverse(pack * per_gpu + rank)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, -1)
    pphy2mlog = (pphy2mlog.reshape(L, nodes, -1) + np.arange(0, N, N // nodes)[None, :, None]).reshape(L, -1)
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog, -1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, -1).reshape(L, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(L, -1), log2mlog, -1)
    return pphy2log, pphyrank, logcnt


def rebalance_experts(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int):
    """(phy2log, log2phy, logcnt) for `weight` [layers, logical experts] (see the module's docstring)."""
    weight = np.asarray(weight, dtype=np.float64)
    phy2log, phyrank, logcnt = _hierarchical(weight, num_replicas, *policy(num_groups, num_nodes), num_gpus)
    L, N = weight.shape
    most = int(logcnt.max())
    log2phy = np.full((L, N * most), -1, dtype=np.int64)
    np.put_along_axis(log2phy, phy2log * most + phyrank, np.tile(np.arange(num_replicas), (L, 1)), axis=1)
    return phy2log, log2phy.reshape(L, N, most), logcnt


# ---- load statistics -------------------------------------------------------------------------------------------


def rank_loads(counts: np.ndarray, phy2log: np.ndarray, num_ranks: int) -> np.ndarray:
    """[layers, ranks]: token-slots each rank receives, `counts` [layers, logical] split evenly over each expert's
    replicas, slot s on rank s // (slots / ranks)."""
    L, N = counts.shape
    replicas = np.stack([np.bincount(p, minlength=N) for p in phy2log])  # [L, N]
    per_slot = np.take_along_axis(counts / replicas, phy2log, -1)
    return per_slot.reshape(L, num_ranks, -1).sum(-1)


def identity_placement(n_layers: int, n_experts: int) -> np.ndarray:
    """Expert e on slot e (what an engine does without a placement): phy2log [layers, experts]."""
    return np.tile(np.arange(n_experts), (n_layers, 1))


def load_statistics(loads: np.ndarray) -> dict[str, float]:
    """From per-rank loads [layers, ranks]: vLLM's balancedness (sum of means / sum of maxima over layers),
    Megatron-Core's overload factor per layer (max / balanced) as its mean and max over layers, and the ranks'
    coefficient of variation (mean over layers)."""
    mean, most = loads.mean(1), loads.max(1)
    overload = most / np.where(mean > 0, mean, 1.0)
    cv = loads.std(1) / np.where(mean > 0, mean, 1.0)
    return {
        "balancedness": float(mean.sum() / most.sum()) if most.sum() > 0 else 0.0,
        "overload_factor_mean": float(overload.mean()),
        "overload_factor_max": float(overload.max()),
        "rank_cv": float(cv.mean()),
    }


# ---- what engines load -----------------------------------------------------------------------------------------


def sglang_expert_location(phy2log: np.ndarray, moe_layers: list[int], n_layers: int) -> dict:
    """SGLang's `--init-expert-location FILE.json`: {"physical_to_logical_map": [num_hidden_layers, slots]} (srt/eplb/
    expert_location.py, `init_by_mapping`); the dense layers' rows are its trivial map (slot % experts)."""
    N = int(phy2log.max()) + 1
    rows = np.tile(np.arange(phy2log.shape[1]) % N, (n_layers, 1))
    rows[moe_layers] = phy2log
    return {"physical_to_logical_map": rows.tolist()}


def vllm_expert_map(phy2log: np.ndarray, num_ranks: int) -> dict:
    """The expert map vllm-ascend loads (`--additional-config '{"eplb_config": {"expert_map_path": FILE}}'`,
    vllm_ascend/eplb/core/eplb_utils.py): per MoE layer (0-based among MoE layers) per rank the logical experts of
    its slots in slot order. A ValueError for a rank holding two copies of one expert: that loader misreads it
    (the module's docstring)."""
    per_rank = phy2log.reshape(phy2log.shape[0], num_ranks, -1)
    doubled = [(i, r) for i, layer in enumerate(per_rank.tolist()) for r, held in enumerate(layer)
               if len(set(held)) < len(held)]  # fmt: skip
    if doubled:
        i, r = doubled[0]
        raise ValueError(f"MoE layer {i} (0-based) puts two copies of an expert on rank {r} "
                         f"({per_rank[i, r].tolist()}): vllm-ascend's loader keeps one slot of the two and shifts "
                         "every rank's slot ids")  # fmt: skip
    return {
        "moe_layer_count": int(phy2log.shape[0]),
        "layer_list": [
            {"layer_id": i, "device_count": num_ranks,
             "device_list": [{"device_id": r, "device_expert": per_rank[i, r].tolist()} for r in range(num_ranks)]}
            for i in range(phy2log.shape[0])
        ],
    }  # fmt: skip


# ---- planned on some documents, measured on others -------------------------------------------------------------


def expert_counts(trace: Trace, rows: np.ndarray) -> np.ndarray:
    """[MoE layers, experts]: token-slots per expert among the trace's `rows` (a boolean mask over its tokens)."""
    return np.stack([np.bincount(np.asarray(trace.experts(layer))[rows].ravel(), minlength=trace.n_experts)
                     for layer in trace.layers]).astype(np.float64)  # fmt: skip


def held_out_rows(doc: np.ndarray, domain: np.ndarray) -> np.ndarray:
    """[tokens] bool: the rows of every second document of each domain (its 2nd, 4th, ...), whole documents. why
    within each domain: a trace whose domains alternate document by document would otherwise hold out one domain."""
    starts = np.flatnonzero(np.r_[True, doc[1:] != doc[:-1]])
    doc_domain = domain[starts]
    nth = np.zeros(len(starts), dtype=np.int64)
    for d in np.unique(doc_domain):
        nth[doc_domain == d] = np.arange((doc_domain == d).sum())
    return np.repeat(nth % 2 == 1, np.diff(np.r_[starts, len(doc)]))


def held_out_placement(trace: Trace, ranks: int, nodes: int, groups: int, redundant: int) -> dict:
    """EPLB planned on half the documents of each domain of a routing trace and
    measured on the other half (`held_out_rows`), against experts laid out contiguously (expert e on rank
    e // (experts / ranks), what engines do without a placement); the same per domain of the held-out documents.
    Returns phy2log, logcnt and the statistics."""
    held = held_out_rows(np.asarray(trace.doc), np.asarray(trace.domain))
    plan = ~held
    if not plan.any() or not held.any():
        raise ValueError("planning on half of each domain's documents and measuring on the other half needs a domain "
                         "with at least two documents")  # fmt: skip
    E = trace.n_experts
    phy2log, _, logcnt = rebalance_experts(expert_counts(trace, plan), E + redundant, groups, nodes, ranks)
    contiguous = identity_placement(len(trace.layers), E)

    def both(rows: np.ndarray) -> dict:
        counts = expert_counts(trace, rows)
        return {"contiguous": load_statistics(rank_loads(counts, contiguous, ranks)),
                "placed": load_statistics(rank_loads(counts, phy2log, ranks)), "tokens": int(rows.sum())}  # fmt: skip

    domain = np.asarray(trace.domain)
    result = {"ranks": ranks, "nodes": nodes, "groups": groups, "redundant": redundant, "layers": list(trace.layers),
              "planned_on": both(plan), "held_out": both(held),
              "held_out_by_domain": {name: both(held & (domain == d)) for d, name in enumerate(trace.domains)
                                     if (held & (domain == d)).any()}}  # fmt: skip
    return {**result, "phy2log": phy2log.tolist(), "logcnt": logcnt.tolist()}
