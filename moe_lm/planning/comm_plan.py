"""What expert parallelism sends, on paper: all-to-all bytes within and across nodes, and expert load per rank.

Layout. The launcher numbers ranks node by node (global rank = node x GPUs per node + local rank), DeepSpeed's
expert-parallel groups are runs of ep_size consecutive ranks, and EP rank r holds the contiguous experts
[r E/ep_size, (r+1) E/ep_size). So an EP group of at most one node's GPUs stays inside the node; a larger one spans
ep_size / GPUs-per-node nodes, each holding a contiguous block of experts. With `n_group` a multiple of those
nodes, every group lies on one node and group-limited routing is node-limited routing: a token's experts lie on at
most `topk_group` nodes (DeepSeek-V3 §3.2.2: 8 groups on 8 nodes, at most 4 per token).

Bytes are those of moe_lm.parallel.dispatch, which counts with the same two functions (moe_lm/parallel/traffic.py):
a token travels once to every rank holding at least one of its K experts (a "pair"), with its K gate weights and
local expert ids, and one row per pair comes back. A pair to the token's own rank is a memory copy ("self"), to
another rank of the same node "intra", to another node "inter".

Two ways to get the pairs:
- `uniform_pairs`: expected values when every token picks `topk_group` groups uniformly at random and its K experts
  uniformly among theirs (without the limit: K among all E). Exact combinatorics, no sampling.
- `trace_pairs`: exact counts for recorded routing (per source rank, the chosen experts of its tokens), which is
  what the dispatcher counts when it routes the same tokens.

`place_experts` evens measured expert load over ranks with DeepSeek's EPLB (placement.py; hierarchical: whole groups
packed onto nodes, then hot experts replicated inside each node and packed onto its GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb
from pathlib import Path

import numpy as np

from moe_lm.errors import ConfigError, DataError
from moe_lm.parallel.traffic import KINDS, combine_row_bytes, dispatch_row_bytes, pair_kind
from moe_lm.planning.placement import identity_placement, rank_loads, rebalance_experts
from moe_lm.routing.trace import Trace


@dataclass(frozen=True)
class Layout:
    nodes: int
    gpus_per_node: int
    ep_size: int
    pp_size: int = 1  # pipeline stages: each holds world / pp_size consecutive ranks, its EP groups among them

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def check(self, n_experts: int) -> None:
        from moe_lm.config import require_ep_divides

        require_ep_divides(self.ep_size, n_experts, self.world, self.pp_size)
        g, ep = self.gpus_per_node, self.ep_size
        if ep > g and ep % g or ep < g and g % ep:
            raise ConfigError(
                f"ep_size {ep} and {g} GPUs per node: one must divide the other, or expert-parallel groups "
                "straddle nodes unevenly"
            )

    def ep_nodes(self) -> list[int]:
        """The node of each rank of an expert-parallel group (node-relative: the first node is 0)."""
        return [r // self.gpus_per_node for r in range(self.ep_size)]


def p_hit(experts: np.ndarray, n_experts: int, k: int, n_group: int = 1, topk_group: int = 1) -> float:
    """Probability that a token's K experts include at least one of `experts`, under uniform group-limited routing.

    The token keeps M = topk_group of the G = n_group groups, uniformly; its K experts are uniform among the
    N = M E / G experts of those groups. If the set has c_g experts in each of the t groups it touches:
        P(miss) = sum over subsets A of the touched groups  P(kept ∩ touched = A) C(N - sum_A c_g, K) / C(N, K)
    where P(kept ∩ touched = A) = C(G - t, M - |A|) / C(G, M) depends on |A| only; a small dynamic programme over
    the touched groups counts the subsets by (|A|, sum_A c_g).
    """
    G, M = n_group, topk_group
    size = n_experts // G
    counts = np.bincount(np.asarray(experts) // size, minlength=G)
    touched = [int(c) for c in counts if c]
    t, N = len(touched), M * size
    ways = {(0, 0): 1}  # (groups kept among the touched, experts of the set in them) -> number of subsets
    for c in touched:
        nxt = dict(ways)
        for (j, s), w in ways.items():
            nxt[(j + 1, s + c)] = nxt.get((j + 1, s + c), 0) + w
        ways = nxt
    miss = sum(w * comb(G - t, M - j) * comb(N - s, k) for (j, s), w in ways.items() if M - j >= 0)
    return 1.0 - miss / (comb(G, M) * comb(N, k))


def _rank_experts(n_experts: int, ep_size: int) -> list[np.ndarray]:
    n_local = n_experts // ep_size
    return [np.arange(r * n_local, (r + 1) * n_local) for r in range(ep_size)]


def uniform_pairs(n_experts: int, k: int, n_group: int, topk_group: int, nodes: list[int]) -> dict[str, float]:
    """Expected pairs per token by kind (self / intra / inter) under uniform routing, for an EP group whose ranks
    sit on `nodes`; the same for the rows each rank combines back (the layout is symmetric)."""
    R = len(nodes)
    hit = [p_hit(e, n_experts, k, n_group, topk_group) for e in _rank_experts(n_experts, R)]
    pairs = dict.fromkeys(KINDS, 0.0)
    for src in range(R):
        for dst in range(R):
            pairs[pair_kind(src, dst, nodes)] += hit[dst] / R
    return pairs


def uniform_nodes_per_token(n_experts: int, k: int, n_group: int, topk_group: int, nodes: list[int]) -> float:
    """Expected number of nodes a token's experts lie on, under uniform routing."""
    per_rank = _rank_experts(n_experts, len(nodes))
    sets = [np.concatenate([e for e, n in zip(per_rank, nodes, strict=True) if n == node]) for node in set(nodes)]
    return sum(p_hit(s, n_experts, k, n_group, topk_group) for s in sets)


def max_nodes_per_token(n_experts: int, k: int, n_group: int, topk_group: int, nodes: list[int]) -> int:
    """The most nodes a token can reach: its K experts lie in its topk_group groups, so at most the nodes those
    groups cover (topk_group when every group lies on one node) and at most K."""
    node_of_expert = np.repeat(nodes, n_experts // len(nodes))
    per_group = sorted((len(set(g)) for g in node_of_expert.reshape(n_group, -1).tolist()), reverse=True)
    return min(sum(per_group[:topk_group]), len(set(nodes)), k)


@dataclass
class TracePairs:
    """Exact counts for recorded routing over one EP group: pairs[s, r] tokens of rank s sent to rank r, and the
    token-slots each rank computes."""

    pairs: np.ndarray  # [R, R] int
    slots: np.ndarray  # [R] int
    tokens: np.ndarray  # [R] int

    def bytes_by_kind(self, dim: int, k: int, elem: int, nodes: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """[R, 3] dispatch bytes each rank sends and [R, 3] combine bytes each rank sends back, by KINDS."""
        R = len(nodes)
        dispatch, combine = np.zeros((R, 3), np.int64), np.zeros((R, 3), np.int64)
        for s in range(R):
            for r in range(R):
                i = KINDS.index(pair_kind(s, r, nodes))
                dispatch[s, i] += self.pairs[s, r] * dispatch_row_bytes(dim, k, elem)
                combine[r, i] += self.pairs[s, r] * combine_row_bytes(dim, elem)
        return dispatch, combine

    def pairs_per_token(self, nodes: list[int]) -> dict[str, float]:
        """Pairs per token by kind, averaged over all tokens (comparable with `uniform_pairs`)."""
        out = dict.fromkeys(KINDS, 0.0)
        R = len(nodes)
        for s in range(R):
            for r in range(R):
                out[pair_kind(s, r, nodes)] += self.pairs[s, r] / max(self.tokens.sum(), 1)
        return out


def trace_pairs(idx_per_rank: list[np.ndarray], n_experts: int, expert_rank: np.ndarray | None = None) -> TracePairs:
    """Pairs and slots for the chosen experts [T_s, K] of each source rank s's tokens; expert e lives on
    `expert_rank[e]` (default: the contiguous layout, E / R experts per rank)."""
    R = len(idx_per_rank)
    if expert_rank is None:
        expert_rank = np.arange(n_experts) // (n_experts // R)
    pairs = np.zeros((R, R), np.int64)
    slots = np.zeros(R, np.int64)
    for s, idx in enumerate(idx_per_rank):
        dest = expert_rank[np.asarray(idx, dtype=np.int64)]
        hits = np.zeros((len(dest), R), bool)
        np.put_along_axis(hits, dest, True, axis=1)
        pairs[s] = hits.sum(0)
        slots += np.bincount(dest.ravel(), minlength=R)
    return TracePairs(pairs, slots, np.array([len(i) for i in idx_per_rank]))


def replica_pairs(idx_per_rank: list[np.ndarray], phy2log: np.ndarray) -> TracePairs:
    """`trace_pairs` under a placement with replicas (`phy2log` [slots]: the expert of each slot, slot s on rank
    s // (slots / R)): each token's copy of an expert drawn uniformly among its replicas, the even split the load
    statistics assume, so pairs and slots are expectations; without replicas they are `trace_pairs`' counts."""
    R = len(idx_per_rank)
    on_rank = np.zeros((int(phy2log.max()) + 1, R))
    np.add.at(on_rank, (phy2log, np.arange(len(phy2log)) // (len(phy2log) // R)), 1.0)
    share = on_rank / on_rank.sum(1, keepdims=True)  # P(a token's copy of expert e is on rank r)
    pairs, slots = np.zeros((R, R)), np.zeros(R)
    for s, idx in enumerate(idx_per_rank):
        p = share[np.asarray(idx, dtype=np.int64)]  # [T, K, R]
        pairs[s] = (1 - np.prod(1 - p, axis=1)).sum(0)  # P(the token reaches rank r), its K copies drawn apart
        slots += p.sum((0, 1))
    return TracePairs(pairs, slots, np.array([len(i) for i in idx_per_rank]))


def slowest_rank_seconds(pairs: np.ndarray, nodes: list[int], row_out: int, row_back: int, links: Links) -> float:
    """One MoE layer's dispatch and combine, each as long as its slowest rank (an all-to-all ends when the last rank
    has its rows): a rank's link is busy with the larger of what it sends and what it receives on it; NVLink and
    the NIC at the same time. `pairs` [R, R]: rows rank s sends rank r in the dispatch (the combine sends them
    back)."""
    R = len(nodes)
    kind = np.array([[KINDS.index(pair_kind(s, r, nodes)) for r in range(R)] for s in range(R)])
    total = 0.0
    for rows, row_bytes in ((pairs, row_out), (pairs.T, row_back)):
        slowest = 0.0
        for r in range(R):
            seconds = []
            for name, gbs in (("intra", links.intra_gbs), ("inter", links.inter_gbs)):
                k = KINDS.index(name)
                sent, got = rows[r][kind[r] == k].sum(), rows[:, r][kind[:, r] == k].sum()
                seconds.append(max(sent, got) * row_bytes / (gbs * 1e9))
            slowest = max(slowest, max(seconds))
        total += slowest
    return total


def split_by_rank(idx_NK: np.ndarray, ep_size: int, seq_len: int) -> list[np.ndarray]:
    """A trace's tokens as a run would spread them: sequences of seq_len tokens dealt to the ranks in turn."""
    n_seq = len(idx_NK) // seq_len
    if n_seq < ep_size:
        raise DataError(f"the trace holds {len(idx_NK)} tokens: fewer than one {seq_len}-token sequence per rank")
    seqs = idx_NK[: n_seq * seq_len].reshape(n_seq, seq_len, -1)
    return [seqs[r::ep_size].reshape(-1, idx_NK.shape[1]) for r in range(ep_size)]


# ---- placement (DeepSeek's EPLB: moe_lm/planning/placement.py) ----


@dataclass
class Placement:
    rank_load: np.ndarray  # [R] token-slots each rank computes (a replicated expert's load split evenly)
    rank_experts: list[list[int]]  # the experts (with repeats for replicas) each rank holds

    @property
    def imbalance(self) -> float:
        return float(self.rank_load.max() / self.rank_load.mean())


def contiguous_placement(load: np.ndarray, ep_size: int) -> Placement:
    identity = identity_placement(1, len(load))
    rank_experts = identity[0].reshape(ep_size, -1)
    return Placement(rank_loads(load[None], identity, ep_size)[0], [e.tolist() for e in rank_experts])


def place_experts(load: np.ndarray, layout: Layout, n_group: int, redundant: int) -> Placement:
    """Even the per-rank load of one layer's expert loads [E] with `redundant` extra expert slots (a multiple of
    ep_size), by DeepSeek's EPLB over the layout's nodes: hierarchical when the groups can be packed whole onto the
    nodes (which keeps node-limited routing intact), global otherwise."""
    E, R = len(load), layout.ep_size
    if redundant % R:
        raise ConfigError(f"redundant slots ({redundant}) must be a multiple of ep_size ({R}): every GPU holds as many")
    n_nodes = len(set(layout.ep_nodes()))
    try:
        phy2log, _, _ = rebalance_experts(load[None], E + redundant, n_group, n_nodes, R)
    except ValueError as e:  # more slots than one copy of each expert per rank (placement.most_slots), or fewer
        raise ConfigError(f"redundant slots ({redundant}): {e}") from None
    per_rank = phy2log[0].reshape(R, -1)
    return Placement(rank_loads(load[None], phy2log, R)[0], [sorted(r.tolist()) for r in per_rank])


# ---- a training step's all-to-all, per GPU ----


@dataclass(frozen=True)
class Links:
    """A GPU's bandwidths (GB/s, one direction) and compute rate."""

    intra_gbs: float = 450.0  # NVLink 4 on an H100 SXM
    inter_gbs: float = 50.0  # one 400 Gb/s NIC per GPU
    peak_tflops: float = 989.0  # H100 dense bf16
    mfu: float = 0.4


@dataclass
class StepTraffic:
    """All-to-all bytes one GPU sends in one training step (every MoE layer, forward and backward, recomputation
    included), by direction and link, for one routing assumption."""

    label: str
    pairs: dict[str, float]  # per token and MoE layer, by KINDS
    nodes_per_token: float
    max_nodes: int
    # nodes other than its own a token reaches: the rows a dispatcher that crosses once per node and forwards inside
    # the node (DeepEP) would send across nodes, where ours sends pairs["inter"]
    remote_nodes: float
    dispatch: dict[str, float]  # bytes sent within the node ("intra") and to other nodes ("inter")
    combine: dict[str, float]

    def seconds(self, links: Links) -> float:
        """NVLink and the NIC move their bytes at the same time: the slower of the two."""
        intra = self.dispatch["intra"] + self.combine["intra"]
        inter = self.dispatch["inter"] + self.combine["inter"]
        return max(intra / (links.intra_gbs * 1e9), inter / (links.inter_gbs * 1e9))


def step_traffic(label: str, pairs: dict, nodes: tuple, cfg, dispatch_elem: int, combine_elem: int) -> StepTraffic:
    """Scale pairs per token and layer to a step of one GPU: its tokens (micro-batch x seq_len x accumulation) x
    MoE layers (MTP's included) x passes (forward, backward, and a recomputed forward under activation
    checkpointing; backward sends as much as forward). `nodes`: (nodes per token, the most, remote nodes). With
    pipeline stages a GPU runs its stage's layers only: a stage's share, the MoE layers / pp_size."""
    m, t = cfg.model, cfg.train
    scale = t.micro_batch_size * t.seq_len * t.grad_accum_steps * layer_passes(cfg)
    row_out = dispatch_row_bytes(m.dim, m.moe.num_experts_per_tok, dispatch_elem)
    row_back = combine_row_bytes(m.dim, combine_elem)
    return StepTraffic(
        label,
        pairs,
        *nodes,
        {kind: pairs[kind] * row_out * scale for kind in ("intra", "inter")},
        {kind: pairs[kind] * row_back * scale for kind in ("intra", "inter")},
    )


def layer_passes(cfg) -> float:
    """MoE layers' all-to-all rounds of one GPU in a step: its stage's MoE layers (MTP's included) x passes (forward,
    backward, and a recomputed forward under activation checkpointing)."""
    m = cfg.model
    moe_layers = (m.n_layers - min(m.first_k_dense_replace, m.n_layers) + m.mtp.depth) / cfg.parallel.pp_size
    return moe_layers * (2 + (cfg.performance.activation_checkpointing != "none"))


def slowest_rank_step(trace: Trace, rows: np.ndarray, phy2log: np.ndarray, cfg, layout: Layout, links: Links,
                      dispatch_elem: int, combine_elem: int) -> float:  # fmt: skip
    """Seconds of a training step's all-to-all for the trace's tokens `rows` (a mask), dealt to the EP ranks by
    sequence and scaled to a step's tokens per GPU, experts placed by `phy2log` [MoE layers, slots] (the identity:
    contiguous): every layer as long as its slowest rank (`slowest_rank_seconds`), averaged over the trace's layers,
    times `layer_passes`."""
    m, t = cfg.model, cfg.train
    row_out = dispatch_row_bytes(m.dim, m.moe.num_experts_per_tok, dispatch_elem)
    row_back = combine_row_bytes(m.dim, combine_elem)
    per_layer = []
    for i, layer in enumerate(trace.layers):
        per_rank = split_by_rank(np.asarray(trace.experts(layer), dtype=np.int64)[rows], layout.ep_size, t.seq_len)
        p = replica_pairs(per_rank, np.asarray(phy2log[i]))
        step_tokens = t.micro_batch_size * t.seq_len * t.grad_accum_steps / p.tokens.mean()
        per_layer.append(slowest_rank_seconds(p.pairs * step_tokens, layout.ep_nodes(), row_out, row_back, links))
    return float(np.mean(per_layer)) * layer_passes(cfg)


def uniform_step(cfg, layout: Layout, limited: bool, dispatch_elem: int, combine_elem: int) -> StepTraffic:
    """The step under uniform routing, with the config's group limit or without any."""
    moe, nodes = cfg.model.moe, layout.ep_nodes()
    E, K = moe.n_routed_experts, moe.num_experts_per_tok
    G, M = (moe.n_group, moe.topk_group) if limited else (1, 1)
    label = f"uniform, best {M} of {G} groups" if G > 1 else "uniform, no group limit"
    pairs = uniform_pairs(E, K, G, M, nodes)
    spread = uniform_nodes_per_token(E, K, G, M, nodes)
    # why (n - 1) / n: every node is reached with the same probability, its own included
    remote = spread * (1 - 1 / len(set(nodes)))
    spread = (spread, max_nodes_per_token(E, K, G, M, nodes), remote)
    return step_traffic(label, pairs, spread, cfg, dispatch_elem, combine_elem)


@dataclass
class TraceLoad:
    """Expert load per rank for a recorded routing, per MoE layer, before and after an EPLB-like placement."""

    contiguous: list[float]  # max / mean rank load per layer, experts laid out contiguously
    placed: list[float]  # the same after place_experts
    redundant: int


def trace_plan(trace: Trace, cfg, layout: Layout, redundant: int, dispatch_elem: int, combine_elem: int):
    """(StepTraffic, TraceLoad) for the tokens of a recorded routing trace."""
    moe, nodes = cfg.model.moe, layout.ep_nodes()
    E, R = moe.n_routed_experts, layout.ep_size
    if (trace.n_experts, trace.k) != (E, moe.num_experts_per_tok):
        raise DataError(
            f"the trace {trace.folder} routes to {trace.k} of {trace.n_experts} experts but the config to "
            f"{moe.num_experts_per_tok} of {E}: plan with the config of the model that recorded it"
        )
    node_of_expert = np.repeat(nodes, E // R)
    pairs = dict.fromkeys(KINDS, 0.0)
    spread, widest, remote = 0.0, 0, 0.0
    load = TraceLoad([], [], redundant)
    n_layers = len(trace.layers)
    for layer in trace.layers:
        idx = np.asarray(trace.experts(layer), dtype=np.int64)
        per_rank = split_by_rank(idx, R, cfg.train.seq_len)
        for kind, v in trace_pairs(per_rank, E).pairs_per_token(nodes).items():
            pairs[kind] += v / n_layers
        n_tokens = sum(len(i) for i in per_rank)
        for r, mine in enumerate(per_rank):
            reached = np.zeros((len(mine), len(set(nodes))), bool)
            np.put_along_axis(reached, node_of_expert[mine], True, axis=1)
            spread += reached.sum() / n_tokens / n_layers
            remote += (reached.sum() - reached[:, nodes[r]].sum()) / n_tokens / n_layers
            widest = max(widest, int(reached.sum(1).max()))
        counts = np.bincount(idx.ravel(), minlength=E).astype(np.float64)
        load.contiguous.append(contiguous_placement(counts, R).imbalance)
        load.placed.append(place_experts(counts, layout, moe.n_group, redundant).imbalance)
    label = f"trace {Path(trace.folder).name} ({trace.n} tokens)"
    return step_traffic(label, pairs, (spread, widest, remote), cfg, dispatch_elem, combine_elem), load
