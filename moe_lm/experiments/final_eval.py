"""The final evaluation of an experiment's run: the whole validation split, every document, per-document sums.

Each document is cut into windows of seq_len + 1 tokens overlapping by one (as training cuts its windows, but the
context restarts with each document), so every token after a document's first is predicted exactly once; windows
are batched by length, without padding. A masked-language-model run (objective.name=mlm) is scored on its masked
tokens, with the masks its objective fixes for each window.
`score_from` = P > 1 scores only the tokens at window positions >= P (the prefix-LM targets, the same labels for
every arm of an experiment); a model with a prefix mask then sees positions < P bidirectionally. Windows shorter than
P + 1 tokens have no label.

Saved per document: the summed NLL of its labels and their number, its domain, and what the measures a definition
names record on the same batches (measures.py: with routing, the token-slots per (MoE layer, expert), with the domain
JSD of the same architecture untrained (N1) and with token-shuffled domains (N2) as baselines); and per window
position (over all windows): summed NLL and labels, for the loss by distance from a prefix boundary. Everything an
experiment compares is a function of these (or of the per-token arrays kept for the token-shuffled JSD baseline), so
intervals can resample documents.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from moe_lm.checkpoint.format import load_model
from moe_lm.data.prepare import load_split
from moe_lm.errors import ConfigError
from moe_lm.experiments.measures import MEASURES
from moe_lm.experiments.provenance import data_fingerprint, evaluation_code, git_commit, training_code
from moe_lm.experiments.recording import Evaluation
from moe_lm.experiments.variants.objectives import MLM, PrefixLM
from moe_lm.model import reads_prefix
from moe_lm.routing.recorder import RoutingRecorder, routers_by_layer
from moe_lm.train.objective import IGNORE, NEXT_TOKEN

RESULT, ARRAYS = "final_eval.json", "final_eval.npz"


def document_windows(doc: np.ndarray, seq_len: int) -> list[np.ndarray]:
    """Windows of at most seq_len + 1 tokens, consecutive windows sharing one token; none for a 1-token document."""
    return [doc[s : s + seq_len + 1] for s in range(0, max(len(doc) - 1, 0), seq_len)]


@torch.no_grad()
def evaluate_run(run_dir: Path, score_from: int = 1, measures: tuple[str, ...] = (), batch_size: int = 16) -> dict:
    """Evaluate the run's final checkpoint on its whole validation split; writes final_eval.json/.npz there. Beyond
    the loss, `measures` (experiments/measures.py: "routing", "attention_rank", ...), each recorded on the same
    batches and windows."""
    cfg, model, tag = load_model(run_dir)
    shard = load_split(cfg.data.out_dir, "val")
    objective = scoring_objective(cfg, score_from, run_dir)
    evaluation = Evaluation(cfg, model, shard, validation_windows(shard, cfg.train.seq_len, score_from), objective,
                            batch_size)  # fmt: skip
    recordings = [MEASURES[name].start(evaluation) for name in measures]
    losses = _LossTally(shard.n_docs, cfg.train.seq_len)
    recorder = RoutingRecorder(routers_by_layer(model))
    with recorder:
        for part in evaluation.batches():
            batch = torch.from_numpy(np.stack([w for _, w in part]).astype(np.int64))
            recorder.last.clear()
            out, labels = objective.run(model, batch)
            docs = [d for d, _ in part]
            losses.add(docs, out.logits, labels)
            for recording in recordings:
                recording.add(docs, batch, recorder)
    domain = np.asarray(shard.doc_domain[: shard.n_docs])
    result = summarise(losses.nll, losses.count, domain, shard.domains)
    result.update(checkpoint=tag, score_from=score_from, windows=len(evaluation.windows))
    # what the numbers depend on beyond the config (the report refuses to mix runs that differ in them)
    result["inputs"] = {"data_fingerprint": data_fingerprint(cfg.data.out_dir), "training_code": training_code(),
                        "evaluation_code": evaluation_code(), "commit": git_commit()}  # fmt: skip
    arrays = {**losses.arrays(), "domain": domain}
    for recording in recordings:
        entries, per_document = recording.finish()
        result.update(entries)
        arrays.update(per_document)
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


def summarise(nll: np.ndarray, count: np.ndarray, domain: np.ndarray, domains: list[str]) -> dict:
    """Token-weighted loss overall and per domain from per-document sums."""
    out = {"loss": float(nll.sum() / max(count.sum(), 1)), "labels": int(count.sum()), "documents": int(len(nll))}
    for i, name in enumerate(domains):
        sel = domain == i
        if count[sel].sum():
            out[f"loss/{name}"] = float(nll[sel].sum() / count[sel].sum())
    return out
