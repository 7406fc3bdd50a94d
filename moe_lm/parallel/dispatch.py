"""The dropless expert-parallel dispatcher: tokens travel to the ranks that hold their experts and come back.

Shape legend: T = local tokens, D = model dim, K = experts per token, R = expert-parallel ranks,
P = (token, destination rank) pairs sent, Q = rows received, N = token-slots computed here.

Per MoE layer call:
1. Each token goes ONCE to each rank that holds at least one of its K experts (as DeepSeek-V3 does per node),
   carrying, for its K slots, the local expert id on that rank (or -1) and the gate weight.
2. Counts are exchanged, then rows, expert ids and weights with `all_to_all_single` with variable split sizes
   (autograd-aware for rows and weights). No capacity, no padding, nothing dropped.
3. The receiving rank runs its local experts over all received slots and sums each row's weighted outputs.
4. The reverse exchange returns one row per pair, summed back per token.

Rows move between tokens and pairs by gathers only, both ways (moe_lm/ops/slot_rows.py: a token's pairs are its
"slots", one per rank): a token's returning rows are summed in float32 in rank order, never with atomics, so the
result and its gradients do not depend on the order a GPU's threads land in.

Bytes are counted per destination as the planner counts them (moe_lm/parallel/traffic.py): to this rank itself
(a copy), to another rank of the same node, or to another node, so node-limited routing's saving can be read off.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

from moe_lm.ops.slot_rows import combine_slots, gather_slots, slot_map
from moe_lm.parallel.traffic import KINDS, combine_row_bytes, dispatch_row_bytes, pair_kind


class AllToAllDispatcher:
    def __init__(self, group, ep_size: int, num_local_experts: int, nodes: list[int] | None = None) -> None:
        """`nodes`: the node of each rank of the expert-parallel group (default: all on one node)."""
        self.group = group
        self.ep_size = ep_size
        self.num_local = num_local_experts
        me = dist.get_rank(group=group)
        nodes = nodes or [0] * ep_size
        self.kind_of_rank = [pair_kind(me, r, nodes) for r in range(ep_size)]
        self.reset_stats()

    def reset_stats(self) -> None:
        """Counters since the last reset (forward passes): bytes this rank sent (in all, and by destination:
        bytes_self / bytes_intra / bytes_inter), and the pairs and slots it sent and computed."""
        self.stats = {"bytes_sent": 0, "pairs_sent": 0, "slots_sent": 0, "slots_computed": 0, "rows_received": 0}
        self.stats.update({f"bytes_{kind}": 0 for kind in KINDS})

    def __call__(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weight_TK: torch.Tensor, shell) -> torch.Tensor:
        T, K = idx_TK.shape
        R = self.ep_size
        dest_TK = idx_TK // self.num_local
        sends_TR = torch.zeros(T, R, dtype=torch.bool, device=x_TD.device).scatter_(1, dest_TK, True)
        rank_P, token_P = sends_TR.T.nonzero(as_tuple=True)  # grouped by destination rank
        send_counts = sends_TR.sum(0)
        P = len(token_P)
        pairs = slot_map(token_P * R + rank_P, torch.arange(P, device=x_TD.device), T, R, P, complete=P == T * R)
        on_rank_PK = dest_TK.index_select(0, token_P) == rank_P[:, None]
        local_PK = torch.where(on_rank_PK, idx_TK.index_select(0, token_P) % self.num_local, -1)
        w_PK = torch.where(on_rank_PK, gather_slots(weight_TK, pairs), 0.0).to(x_TD.dtype)

        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        Q = sum(recv)
        x_QD = dist_fn.all_to_all_single(
            x_TD.new_empty(Q, x_TD.shape[1]), gather_slots(x_TD, pairs), recv, send, group=self.group
        )
        w_QK = dist_fn.all_to_all_single(w_PK.new_empty(Q, K), w_PK, recv, send, group=self.group)
        local_QK = local_PK.new_empty(Q, K)
        dist.all_to_all_single(local_QK, local_PK, recv, send, group=self.group)

        slot_N = (local_QK.flatten() >= 0).nonzero().squeeze(1)  # the received slots on this rank's experts
        y_QD = shell.local.forward_slots(x_QD, local_QK, w_QK, slot_N)
        y_PD = dist_fn.all_to_all_single(y_QD.new_empty(P, x_TD.shape[1]), y_QD, send, recv, group=self.group)

        slots_sent = int(on_rank_PK.sum())
        if slots_sent != T * K:  # every token-slot is in exactly one pair
            raise RuntimeError(f"expert-parallel dispatch lost token-slots: {slots_sent} sent of {T * K}")
        s = self.stats
        s["pairs_sent"] += len(token_P)
        s["slots_sent"] += slots_sent
        s["slots_computed"] += len(slot_N)
        s["rows_received"] += Q
        # rows + weights + expert ids out, and the combined rows back (the backward pass sends as much again)
        D, elem = x_TD.shape[1], x_TD.element_size()
        for r, kind in enumerate(self.kind_of_rank):
            sent = send[r] * dispatch_row_bytes(D, K, elem) + recv[r] * combine_row_bytes(D, elem)
            s[f"bytes_{kind}"] += sent
            s["bytes_sent"] += sent
        return combine_slots(y_PD, pairs)
