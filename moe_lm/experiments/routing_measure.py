"""The routing measure (`measures: [routing]`): what the routers chose on the whole validation split, token-slots per
(document, MoE layer, expert), with MaxVio_global and its finite-sample floor, the mean pairwise domain JSD, the JSD
of the same architecture untrained (N1) and with domain labels shuffled among occurrences of the same token (N2:
what token identity alone explains); its lines in the report, and its figures: MaxVio_batch over training and each
domain's relative load per expert (DeepSeek-V3's Fig. 9). Registered in measures.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from moe_lm.analysis import metrics
from moe_lm.experiments.recording import Evaluation, Recording
from moe_lm.experiments.stats import mean_sd
from moe_lm.model import initial_model
from moe_lm.routing import stats
from moe_lm.routing.recorder import RoutingRecorder, routers_by_layer


def domain_jsd_of_documents(counts_NE: np.ndarray, doc_domain: np.ndarray, n_domains: int) -> float:
    """The mean pairwise domain JSD (bits) from per-document expert counts [N docs, E] and each document's domain."""
    per_domain = np.zeros((n_domains, counts_NE.shape[1]))
    np.add.at(per_domain, doc_domain, counts_NE)
    return stats.mean_domain_jsd(per_domain)


class RoutingRecording(Recording):
    """What the routers chose: token-slots per (document, MoE layer, expert), and per token its id, domain and
    experts (for the token-shuffled baseline)."""

    def __init__(self, evaluation: Evaluation) -> None:
        self.evaluation, self.shard = evaluation, evaluation.shard
        self.n_experts = evaluation.cfg.model.moe.n_routed_experts
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

    def finish(self) -> tuple[dict, dict[str, np.ndarray]]:
        """result["routing"] (per MoE layer: the summary and N1) and the arrays' expert_counts; nothing for a model
        without MoE layers."""
        if self.counts is None:
            return {}, {}
        domain = np.asarray(self.shard.doc_domain[: self.shard.n_docs])
        token, token_domain = np.concatenate(self.tokens), np.concatenate(self.token_domain)
        summary = routing_summary(self.counts, domain, len(self.shard.domains), self.layers, token, token_domain,
                                  np.concatenate(self.token_experts))  # fmt: skip
        init = init_domain_jsd(self.evaluation, self.layers)  # N1: the same model untrained
        for layer in self.layers:
            summary[f"layer_{layer}"]["domain_jsd_init"] = init[layer]
        return {"routing": summary}, {"expert_counts": self.counts}


@torch.no_grad()
def init_domain_jsd(evaluation: Evaluation, layers: list[int]) -> dict[int, float]:
    """Per MoE layer, the mean pairwise domain JSD of the run's architecture at its initialisation (same seed,
    same windows): the N1 baseline of docs/analytics.md, what an untrained router already separates."""
    cfg, shard = evaluation.cfg, evaluation.shard
    model = initial_model(cfg).eval()
    E = cfg.model.moe.n_routed_experts
    counts = {layer: np.zeros((len(shard.domains), E)) for layer in layers}
    recorder = RoutingRecorder(routers_by_layer(model))
    with recorder:
        for part in evaluation.batches():
            batch = torch.from_numpy(np.stack([w for _, w in part]).astype(np.int64))
            model(batch[:, :-1])
            domain_of = np.repeat(shard.doc_domain[[d for d, _ in part]], len(part[0][1]) - 1)
            for layer in layers:
                counts[layer] += metrics.domain_expert_counts(
                    recorder.last[layer][0].numpy(), domain_of, len(counts[layer]), E
                )
    return {layer: metrics.mean_domain_jsd(c) for layer, c in counts.items()}


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


def recorded(result: dict) -> bool:
    """Whether a final_eval.json holds the measure, its N1 baseline included."""
    return bool(result.get("routing")) and all("domain_jsd_init" in v for v in result["routing"].values())


def routing_lines(by_arm: dict) -> list[str]:
    """The report's table: per arm (arm -> ArmData), MaxVio_global with its floor, domain JSD, N1, N2 and JSD - N2,
    mean ± sd over seeds."""
    lines = ["", "| arm | MaxVio_global (floor) | domain JSD, bits | at init (N1) | token-shuffled (N2) | JSD - N2 |"]
    lines.append("|---|---|---|---|---|---|")
    for arm, data in by_arm.items():
        per = [list(r.result["routing"].values()) for r in data.runs]
        mv = [np.mean([v["maxvio_global"] for v in p]) for p in per]
        floor = np.mean([v["maxvio_floor"] for v in per[0]])
        jsd = [np.mean([v["domain_jsd"] for v in p]) for p in per]
        sh = [np.mean([v["domain_jsd_shuffled"] for v in p]) for p in per]
        n1 = [np.mean([v["domain_jsd_init"] for v in p]) for p in per]
        lines.append(
            f"| {arm} | {mean_sd(mv)} ({floor:.3f}) | {mean_sd(jsd)} | {mean_sd(n1)} | {mean_sd(sh)} | "
            f"{mean_sd(np.subtract(jsd, sh))} |"
        )
    return lines


def routing_figures(by_arm: dict, domains: list[str], folder: Path) -> list[Path]:
    """maxvio_batch.png and relative_load.png into `folder` (arm -> ArmData)."""
    return [_draw_maxvio(by_arm, folder / "maxvio_batch.png"),
            _draw_relative_load(by_arm, domains, folder / "relative_load.png")]  # fmt: skip


def _draw_maxvio(by_arm: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt

    from moe_lm.analysis.plots import save

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, data in by_arm.items():
        train = [data.step_rows(s, "train") for s in range(len(data.runs))]
        curves = [[np.mean([v for k, v in row.items() if k.startswith("maxvio/")]) for row in rows] for rows in train]
        n = min(len(c) for c in curves)
        steps = [row["step"] for row in train[0]][:n]
        ax.plot(steps, np.mean([c[:n] for c in curves], 0), label=arm)
    ax.set_xlabel("step")
    ax.set_ylabel("MaxVio_batch (mean over MoE layers and seeds)")
    ax.set_yscale("log")
    ax.legend()
    save(fig, path)
    return path


def _draw_relative_load(by_arm: dict, domains: list[str], path: Path) -> Path:
    """Per arm (rows) and MoE layer (columns): each domain's load on each expert relative to a uniform share
    (token-slots / (the domain's token-slots / experts)), summed over seeds, on the whole validation split."""
    import matplotlib.pyplot as plt

    from moe_lm.analysis.plots import save

    loads = {arm: relative_load(data) for arm, data in by_arm.items()}
    n_layers = max(v.shape[0] for v in loads.values())
    fig, axes = plt.subplots(len(loads), n_layers, figsize=(3.2 * n_layers + 1, 1.6 * len(loads) + 1), squeeze=False)
    top = max(float(v.max()) for v in loads.values())
    for row, (arm, load) in enumerate(loads.items()):
        for j in range(n_layers):
            image = axes[row, j].imshow(load[j], vmin=0, vmax=top, cmap="viridis", aspect="auto")
            axes[row, j].set_yticks(range(len(domains)), domains if j == 0 else [""] * len(domains), fontsize=7)
            axes[row, j].set_title(f"{arm}, MoE layer {j + 1}", fontsize=8)
            axes[row, j].set_xlabel("expert", fontsize=7)
    fig.colorbar(image, ax=axes, label="load / uniform share")
    save(fig, path)
    return path


def relative_load(data) -> np.ndarray:
    """[MoE layer, domain, expert] of an arm (ArmData): the domain's token-slots on the expert over its uniform
    share (1 = balanced)."""
    counts = sum(_by_domain(a["expert_counts"], a["domain"]) for a in data.arrays)
    return counts / (counts.sum(-1, keepdims=True) / counts.shape[-1])


def _by_domain(expert_counts: np.ndarray, domain: np.ndarray) -> np.ndarray:
    """[documents, layers, experts] -> [layers, domains, experts]."""
    out = np.zeros((expert_counts.shape[1], int(domain.max()) + 1, expert_counts.shape[2]))
    np.add.at(out, (slice(None), domain), expert_counts.transpose(1, 0, 2))
    return out
