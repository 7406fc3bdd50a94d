"""The final evaluation of an experiment's run: the whole validation split, every document, per-document sums.

Each document is cut into windows of seq_len + 1 tokens overlapping by one (as training cuts its windows, but the
context restarts with each document), so every token after a document's first is predicted exactly once; windows
are batched by length, without padding. A masked-language-model run (objective.name=mlm) is scored on its masked
tokens, with the masks its objective fixes for each window.
`score_from` = P > 1 scores only the tokens at window positions >= P (the prefix-LM targets, the same labels for
every arm of an experiment); a model with a prefix mask then sees positions < P bidirectionally. Windows shorter than
P + 1 tokens have no label.

Saved per document: the summed NLL of its labels and their number, its domain, and, with routing, the token-slots
per (MoE layer, expert), with the domain JSD of the same architecture untrained (N1) and with token-shuffled
domains (N2) as baselines; and per window position (over all windows): summed NLL and labels, for the loss by
distance from a prefix boundary. Everything an experiment compares is a function of these (or of the per-token arrays
kept for the token-shuffled JSD baseline), so intervals can resample documents.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from moe_lm.analysis import metrics
from moe_lm.checkpoint.format import load_model
from moe_lm.data.batches import eval_windows
from moe_lm.data.prepare import load_split
from moe_lm.errors import ConfigError
from moe_lm.experiments.attention_probe import erank_by_layer
from moe_lm.experiments.measures import domain_jsd_of_documents
from moe_lm.experiments.provenance import data_fingerprint, evaluation_code, git_commit, training_code
from moe_lm.experiments.variants.objectives import MLM, PrefixLM
from moe_lm.model import initial_model, reads_prefix
from moe_lm.routing.recorder import RoutingRecorder, routers_by_layer
from moe_lm.train.objective import IGNORE, NEXT_TOKEN

RESULT, ARRAYS = "final_eval.json", "final_eval.npz"
RANK_WINDOWS = 32  # validation windows the attention-rank measure reads (as the rank experiment's probe)


def document_windows(doc: np.ndarray, seq_len: int) -> list[np.ndarray]:
    """Windows of at most seq_len + 1 tokens, consecutive windows sharing one token; none for a 1-token document."""
    return [doc[s : s + seq_len + 1] for s in range(0, max(len(doc) - 1, 0), seq_len)]


@torch.no_grad()
def evaluate_run(run_dir: Path, score_from: int = 1, measures: tuple[str, ...] = (), batch_size: int = 16) -> dict:
    """Evaluate the run's final checkpoint on its whole validation split; writes final_eval.json/.npz there. Beyond
    the loss, `measures` (experiments/measures.py): "routing" (token-slots per MoE layer and expert per document),
    "attention_rank" (the effective rank of every layer's attention matrices on RANK_WINDOWS windows, read the way
    the run's objective reads them, an MLM's masked inputs, trained and at initialisation)."""
    routing, attention_rank = "routing" in measures, "attention_rank" in measures
    cfg, model, tag = load_model(run_dir)
    shard = load_split(cfg.data.out_dir, "val")
    objective = scoring_objective(cfg, score_from, run_dir)
    windows = validation_windows(shard, cfg.train.seq_len, score_from)
    losses = _LossTally(shard.n_docs, cfg.train.seq_len)
    routes = _RoutingTally(shard, cfg.model.moe.n_routed_experts) if routing else None
    recorder = RoutingRecorder(routers_by_layer(model))
    with recorder:
        for part in _equal_length_batches(windows, batch_size):
            batch = torch.from_numpy(np.stack([w for _, w in part]).astype(np.int64))
            recorder.last.clear()
            out, labels = objective.run(model, batch)
            docs = [d for d, _ in part]
            losses.add(docs, out.logits, labels)
            if routes is not None:
                routes.add(docs, batch, recorder)
    domain = np.asarray(shard.doc_domain[: shard.n_docs])
    result = summarise(losses.nll, losses.count, domain, shard.domains)
    result.update(checkpoint=tag, score_from=score_from, windows=len(windows))
    # what the numbers depend on beyond the config (the report refuses to mix runs that differ in them)
    result["inputs"] = {"data_fingerprint": data_fingerprint(cfg.data.out_dir), "training_code": training_code(),
                        "evaluation_code": evaluation_code(), "commit": git_commit()}  # fmt: skip
    arrays = {**losses.arrays(), "domain": domain}
    if routes is not None and routes.counts is not None:
        arrays["expert_counts"] = routes.counts
        result["routing"] = routes.summary(domain, len(shard.domains))
        init = init_domain_jsd(cfg, windows, shard, routes.layers, batch_size)  # N1: the same model untrained
        for layer in routes.layers:
            result["routing"][f"layer_{layer}"]["domain_jsd_init"] = init[layer]
    if attention_rank:
        probe, untrained = probe_windows(cfg, RANK_WINDOWS), initial_model(cfg).eval()
        result["attention_rank"] = {
            "windows": len(probe),
            "erank": erank_by_layer(model, probe, forward=lambda chunk: objective.run(model, chunk)),
            "erank_init": erank_by_layer(untrained, probe, forward=lambda chunk: objective.run(untrained, chunk)),
        }
    np.savez(Path(run_dir) / ARRAYS, **arrays)
    # why renamed into place: a run is finished when this file reads, so it must never be seen half-written
    partial = Path(run_dir) / f"{RESULT}.partial"
    partial.write_text(json.dumps(result, indent=1))
    os.replace(partial, Path(run_dir) / RESULT)
    return result


def scoring_objective(cfg, score_from: int, run_dir: Path):
    """How the run is scored: an MLM on its fixed (content-seeded) masks, the prefix-LM labels from window position
    `score_from` (a prefix-reading model sees the prefix its way), or every next token."""
    if cfg.objective.name == "mlm":
        return MLM.of(cfg)
    if score_from > 1:
        return PrefixLM(score_from, reads_prefix(cfg.model))
    if reads_prefix(cfg.model):
        raise ConfigError(f"{run_dir}: a prefix-mask or encoder-decoder model needs score_from > 1 (its prefix)")
    return NEXT_TOKEN


def validation_windows(shard, seq_len: int, score_from: int) -> list[tuple[int, np.ndarray]]:
    """(document, window) for every window of the split that holds a label, sorted by length."""
    windows = [(d, w) for d in range(shard.n_docs) for w in document_windows(np.asarray(shard.document(d)), seq_len)]
    windows = [(d, w) for d, w in windows if len(w) > (score_from if score_from > 1 else 1)]
    # why by length: batches of equal-length windows need no padding, which a bidirectional model would attend to
    windows.sort(key=lambda dw: len(dw[1]))
    return windows


class _LossTally:
    """Summed NLL and label counts per document and per window position."""

    def __init__(self, n_docs: int, seq_len: int) -> None:
        self.nll, self.count = np.zeros(n_docs), np.zeros(n_docs, dtype=np.int64)
        self.position_nll, self.position_count = np.zeros(seq_len), np.zeros(seq_len, dtype=np.int64)

    def add(self, docs: list[int], logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> None:
        nll_BS = F.cross_entropy(logits_BSV.float().transpose(1, 2), labels_BS, ignore_index=IGNORE, reduction="none")
        labelled = labels_BS != IGNORE
        for b, d in enumerate(docs):
            self.nll[d] += nll_BS[b].sum().item()
            self.count[d] += int(labelled[b].sum())
        L = labels_BS.shape[1]
        self.position_nll[:L] += nll_BS.sum(0).double().numpy()
        self.position_count[:L] += labelled.sum(0).numpy()

    def arrays(self) -> dict[str, np.ndarray]:
        return {"nll": self.nll, "count": self.count, "position_nll": self.position_nll,
                "position_count": self.position_count}  # fmt: skip


class _RoutingTally:
    """What the routers chose: token-slots per (document, MoE layer, expert), and per token its id, domain and
    experts (for the token-shuffled baseline)."""

    def __init__(self, shard, n_experts: int) -> None:
        self.shard, self.n_experts = shard, n_experts
        self.layers: list[int] = []
        self.counts: np.ndarray | None = None  # [documents, layers, experts]
        self.tokens, self.token_domain, self.token_experts = [], [], []

    def add(self, docs: list[int], batch_BS1: torch.Tensor, recorder: RoutingRecorder) -> None:
        self.layers = self.layers or [layer for layer in recorder.layers if layer in recorder.last]
        if self.counts is None:
            self.counts = np.zeros((self.shard.n_docs, len(self.layers), self.n_experts), np.int64)
        doc_of = np.repeat(docs, batch_BS1.shape[1] - 1)
        per_layer = [recorder.last[layer][0].numpy() for layer in self.layers]
        for j, experts in enumerate(per_layer):
            np.add.at(self.counts[:, j], (np.repeat(doc_of, experts.shape[1]), experts.ravel()), 1)
        self.tokens.append(batch_BS1[:, :-1].flatten().numpy())
        self.token_domain.append(self.shard.doc_domain[doc_of])
        self.token_experts.append(np.stack(per_layer, 1))

    def summary(self, doc_domain: np.ndarray, n_domains: int) -> dict:
        token, token_domain = np.concatenate(self.tokens), np.concatenate(self.token_domain)
        experts = np.concatenate(self.token_experts)
        return routing_summary(self.counts, doc_domain, n_domains, self.layers, token, token_domain, experts)


@torch.no_grad()
def init_domain_jsd(cfg, windows: list, shard, layers: list[int], batch_size: int) -> dict[int, float]:
    """Per MoE layer, the mean pairwise domain JSD of the run's architecture at its initialisation (same seed,
    same windows): the N1 baseline of docs/analytics.md, what an untrained router already separates."""
    model = initial_model(cfg).eval()
    E = cfg.model.moe.n_routed_experts
    counts = {layer: np.zeros((len(shard.domains), E)) for layer in layers}
    recorder = RoutingRecorder(routers_by_layer(model))
    with recorder:
        for part in _equal_length_batches(windows, batch_size):
            batch = torch.from_numpy(np.stack([w for _, w in part]).astype(np.int64))
            model(batch[:, :-1])
            domain_of = np.repeat(shard.doc_domain[[d for d, _ in part]], len(part[0][1]) - 1)
            for layer in layers:
                counts[layer] += metrics.domain_expert_counts(
                    recorder.last[layer][0].numpy(), domain_of, len(counts[layer]), E
                )
    return {layer: metrics.mean_domain_jsd(c) for layer, c in counts.items()}


def probe_windows(cfg, n: int) -> torch.Tensor:
    """n fixed validation windows [n, seq_len + 1], taken round-robin over the domains."""
    sets = list(eval_windows(load_split(cfg.data.out_dir, "val"), cfg.train.seq_len, n).values())
    full = [w for w in sets if w.shape[1] == cfg.train.seq_len + 1]
    picked = [s[i] for i in range(n) for s in full if i < len(s)][:n]
    return torch.stack(picked)


def _equal_length_batches(windows: list, batch_size: int):
    """Consecutive runs of equal-length windows (the list is sorted by length), at most batch_size each."""
    i = 0
    while i < len(windows):
        j = i
        while j < len(windows) and j - i < batch_size and len(windows[j][1]) == len(windows[i][1]):
            j += 1
        yield windows[i:j]
        i = j


def summarise(nll: np.ndarray, count: np.ndarray, domain: np.ndarray, domains: list[str]) -> dict:
    """Token-weighted loss overall and per domain from per-document sums."""
    out = {"loss": float(nll.sum() / max(count.sum(), 1)), "labels": int(count.sum()), "documents": int(len(nll))}
    for i, name in enumerate(domains):
        sel = domain == i
        if count[sel].sum():
            out[f"loss/{name}"] = float(nll[sel].sum() / count[sel].sum())
    return out


def routing_summary(counts_NLE, doc_domain, n_domains, layers, token, token_domain, token_experts) -> dict:
    """Per MoE layer: MaxVio_global (and its finite-sample floor), mean pairwise domain JSD, and the JSD left once
    domain labels are shuffled among occurrences of the same token id (N2: what token identity alone explains)."""
    shuffled = metrics.shuffle_domains_within_token(token, token_domain)
    E, K = counts_NLE.shape[2], token_experts.shape[2]
    out = {}
    for j, layer in enumerate(layers):
        experts = token_experts[:, j]
        out[f"layer_{layer}"] = {
            "maxvio_global": metrics.max_vio(counts_NLE[:, j].sum(0)),
            "maxvio_floor": metrics.max_vio_floor(len(token), E, K),
            "domain_jsd": domain_jsd_of_documents(counts_NLE[:, j], doc_domain, n_domains),
            "domain_jsd_shuffled": metrics.mean_domain_jsd(
                metrics.domain_expert_counts(experts, shuffled, n_domains, E)
            ),
        }
    return out
