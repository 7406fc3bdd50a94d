"""Evaluation during training: loss per domain on fixed validation windows, and the headline routing metrics.

`loss` is always the main head's next-token loss on the objective's labels (all tokens, or those after the prefix),
so runs with and without MTP compare on the same number; the MTP depths' losses are reported beside it
(`mtp_loss/depth_k`). With `score_from` = P > 1, `loss_scored` is the loss on those of the objective's labels at
window positions >= P: an experiment's arms that train on different labels (every token, or the targets after a
prefix) are compared on the same ones along training.

The routing numbers come from what the routers chose on those windows, through the same functions the routing
report uses (moe_lm/routing/stats.py): MaxVio_global, mean pairwise domain JSD (bits), and the shares of
adjacent same-document tokens with the same first choice / overlapping top-k. Counts are summed over ranks.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from moe_lm.model import Transformer
from moe_lm.parallel.engine import Engine
from moe_lm.routing import stats
from moe_lm.routing.recorder import RoutingRecorder, routers_by_layer
from moe_lm.train.objective import IGNORE, NEXT_TOKEN, Objective, loss_sums


@torch.no_grad()
def evaluate(
    engine: Engine,
    model: Transformer,
    evalsets: dict[str, torch.Tensor],
    micro: int,
    dev,
    doc_start_id: int,
    objective: Objective = NEXT_TOKEN,
    score_from: int = 1,
    data_parallel: tuple[int, int] | None = None,
) -> dict[str, float]:
    """{loss, ppl, loss/<domain>, ppl/<domain>, <routing metric>/layer_<l>} over every rank's share of the windows;
    `doc_start_id` (the tokenizer's BOS, or EOS) marks where a document begins inside a window. `data_parallel`:
    (rank, size) among the ranks of one pipeline stage, with stages (default: the world's). A stage's output is
    None on every stage but the last (which alone counts the losses); each stage counts its own layers' routing."""
    rank, world = data_parallel or (dist.get_rank(), dist.get_world_size())
    engine.eval()
    losses = LossTally(len(evalsets), len(model.mtp), score_from)
    routing = RoutingTally(model, len(evalsets), doc_start_id)
    with RoutingRecorder(routers_by_layer(model)) as recorder:
        for d, windows in enumerate(evalsets.values()):
            # every rank runs the same number of forward passes (expert parallelism needs all ranks in each one).
            # Fewer windows than ranks: every rank runs them all and rank 0 alone counts them.
            few = len(windows) < world
            mine = windows if few else windows[rank::world][: len(windows) // world]
            for chunk in mine.split(micro):
                recorder.last.clear()
                out, labels = objective.run(engine, chunk.to(dev), mtp=len(model.mtp) > 0)
                if few and rank > 0:
                    continue
                if out is not None:
                    losses.add(d, out, labels)
                routing.add(d, recorder.last, chunk[:, :-1].numpy())
    engine.train()
    return {k: float(v) for k, v in {**losses.metrics(list(evalsets), dev), **routing.metrics(dev)}.items()}


class LossTally:
    """Loss sums (and token counts) per domain, per MTP depth, and on the labels at window positions >= score_from,
    over this rank's windows; `metrics` sums them over the ranks."""

    def __init__(self, n_domains: int, depth: int, score_from: int) -> None:
        self.loss = np.zeros((n_domains, 2))  # [domain, (loss sum, tokens)]
        self.mtp = np.zeros((depth, 2))  # [MTP depth, (loss sum, tokens)]
        self.scored = np.zeros(2)  # (loss sum, tokens) on the labels at window positions >= score_from
        self.score_from = score_from

    def add(self, d: int, out, labels: torch.Tensor) -> None:
        nll, n, per_depth = loss_sums(out, labels)
        self.loss[d] += nll, n
        if self.score_from > 1:
            labels = labels.clone()
            labels[:, : self.score_from - 1] = IGNORE  # label j is the token at window position j + 1
            self.scored += loss_sums(out, labels)[:2]
        self.mtp += np.array(per_depth).reshape(len(self.mtp), 2)

    def metrics(self, domains: list[str], dev) -> dict[str, float]:
        loss, mtp, scored = (_sum_over_ranks(a, dev) for a in (self.loss, self.mtp, self.scored))
        result = {}
        for domain, (loss_sum, n) in zip(domains, loss, strict=True):
            if n > 0:
                result[f"loss/{domain}"] = loss_sum / n
                result[f"ppl/{domain}"] = math.exp(loss_sum / n)
        result["loss"] = loss[:, 0].sum() / max(loss[:, 1].sum(), 1)
        result["ppl"] = math.exp(result["loss"])
        if self.score_from > 1:
            result["loss_scored"] = scored[0] / max(scored[1], 1)
        for k, (loss_sum, n) in enumerate(mtp, start=1):
            result[f"mtp_loss/depth_{k}"] = loss_sum / max(n, 1)
        return result


class RoutingTally:
    """What the routers chose on this rank's windows: token-slots per (MoE layer, domain, expert), and adjacent
    same-document pairs with the same first choice / overlapping top-k; `metrics` sums them over the ranks."""

    def __init__(self, model: Transformer, n_domains: int, doc_start_id: int) -> None:
        self.layers, self.E = model.moe_layer_ids(), model.cfg.moe.n_routed_experts
        self.aligned, self.doc_start_id = model.window_aligned_routing, doc_start_id
        self.counts = np.zeros((len(self.layers), n_domains, self.E))  # [layer, domain, expert] token-slots
        self.pairs = np.zeros((len(self.layers), 3))  # [layer, (adjacent pairs, same first choice, overlap)]

    def add(self, d: int, last: dict, tokens: np.ndarray) -> None:
        for i, layer in enumerate(self.layers):
            if layer not in last:  # an MTP depth with no position to predict in a short window
                continue
            experts = last[layer][0].cpu().numpy()
            self.counts[i, d] += stats.expert_counts(experts, self.E)
            if not self.aligned:  # e.g. an encoder-decoder's stacks: counts only
                continue
            # an MTP block routes the first S - k positions of each window; a decoder block all S
            doc = _documents(tokens[:, : len(experts) // len(tokens)], self.doc_start_id)
            t, same_first, overlap = stats.repetition_hits(experts, doc)
            self.pairs[i] += len(t), same_first.sum(), overlap.sum()

    def metrics(self, dev) -> dict[str, float]:
        counts, pairs = _sum_over_ranks(self.counts, dev), _sum_over_ranks(self.pairs, dev)
        result = {}
        for i, layer in enumerate(self.layers):
            n_pairs = max(pairs[i, 0], 1)
            result[f"maxvio_global/layer_{layer}"] = stats.max_vio(counts[i].sum(0))
            result[f"domain_jsd/layer_{layer}"] = stats.mean_domain_jsd(counts[i])
            result[f"same_first/layer_{layer}"] = pairs[i, 1] / n_pairs
            result[f"topk_overlap/layer_{layer}"] = pairs[i, 2] / n_pairs
        return result


def _documents(tokens_BS: np.ndarray, doc_start_id: int) -> np.ndarray:
    """A document id for every token of the flattened windows [B*S]: a new one at each row and at each start."""
    starts = tokens_BS == doc_start_id
    starts[:, 0] = True
    return np.cumsum(starts.ravel())


def _sum_over_ranks(a: np.ndarray, dev) -> np.ndarray:
    t = torch.from_numpy(a).to(dev)  # why on the device: NCCL reduces device tensors only
    dist.all_reduce(t)
    return t.cpu().numpy()
