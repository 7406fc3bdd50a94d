"""The check of pruned models (`moe-lm prune --check`): for each criterion and sparsity, the pruned model (a run's
built in memory, a transformers folder's written and loaded back: checked.py) scored on the same held-out windows as
the unpruned model.

    calibration documents (the run's training split, --data, or --trace) --> trace --> each criterion's scores
        --> per sparsity a KeepPlan --> the pruned model --> the held-out windows (the run's validation split, or
        --held-out-data) --> per domain the log-prob change per token (document bootstrap), and its routing

What each number is:

- **Δ log-prob per token** of a domain: Σ_docs (log p_pruned − log p_unpruned) / Σ_docs tokens over the domain's
  held-out documents, every next-token prediction of every window counted once (nats; below 0: the pruned model is
  worse). Its 95 % interval is a bootstrap over documents (moe_lm/analysis/ablation.py `delta_by_domain`): tokens of a
  document are correlated, documents are the unit. The same resampled documents for every arm (one seed).
- **random** is the control, over several seeds: its Δ is the mean over seeds (the Δ of the per-document mean, so its
  interval is a bootstrap over documents too), its spread the standard deviation and range of the seeds' Δ.
- **routing after pruning**, per MoE layer over the held-out predicting positions: MaxVio over the pruned model's
  experts ((max load − mean load) / mean load, with its finite-sample floor for a uniform random router of the same
  count of tokens, experts and k), the new load's max / mean (MaxVio + 1), and the fraction of tokens whose first
  choice is not the unpruned model's (which includes every token whose first choice was removed).
- **Spearman's ρ** per MoE layer between each criterion's expert scores and ablation's, both on the same calibration
  trace: which cheap criterion orders the experts as the causal reference does (ties take their mean rank).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from moe_lm.analysis.ablation import delta_by_domain, window_batches
from moe_lm.analysis.documents import Documents
from moe_lm.analysis.metrics import max_vio_floor
from moe_lm.analysis.recording import record_trace
from moe_lm.analysis.requests import RoutingRequest
from moe_lm.analysis.routing_workflow import budgeted_documents
from moe_lm.analysis.subjects import SubjectRequest
from moe_lm.analysis.subjects.loaded import Subject
from moe_lm.errors import UserError
from moe_lm.flags import default_of
from moe_lm.pruning.checked import CheckedModel, checked_model
from moe_lm.pruning.criteria import CRITERIA, FROM_TRACE, ablation_scores, trace_documents, trace_scores
from moe_lm.pruning.plan import KeepPlan, keep_count
from moe_lm.pruning.run import TRACE_FOLDER, plan_shape, ungrouped
from moe_lm.routing.recorder import RoutingRecorder
from moe_lm.routing.stats import expert_counts, max_vio
from moe_lm.routing.torch_routing import TorchRouting
from moe_lm.routing.trace import Trace

CHECK_FILES = ("check.json", "check.md", "check.png")
CHECK_CRITERIA = ("reap", "frequency", "gate-mass", "random", "ablation")


@dataclasses.dataclass(frozen=True)
class CheckRequest:
    """`moe-lm prune --check`: each of `criteria` at each of `sparsities` (or `keeps`), scored on the calibration
    documents (`trace`, else `documents`, else the run's training split, under `max_tokens`; of `domains` only) and
    checked on the held-out documents (`held_out`, else the run's validation split, under `held_out_tokens`), into
    `out`."""

    subject: SubjectRequest  # a run, or a transformers folder held in memory (checked.py)
    out: Path
    criteria: tuple[str, ...] = CHECK_CRITERIA
    sparsities: tuple[float, ...] | None = None
    keeps: tuple[int, ...] | None = None
    domains: tuple[str, ...] | None = None
    trace: Path | None = None
    documents: Documents = Documents()
    held_out: Documents = Documents()  # --held-out-data; empty: the run's validation split
    max_tokens: int = default_of(RoutingRequest, "max_tokens")
    held_out_tokens: int = default_of(RoutingRequest, "max_tokens")
    batch_size: int = default_of(RoutingRequest, "batch_size")
    seed: int = 0
    random_seeds: int = 3
    n_boot: int = 1000
    ungroup: bool = False  # the pruned models route without expert groups; that alone is checked as an arm too


def check_criteria(criteria) -> tuple[str, ...]:
    """The criteria asked for, each once and known; a UserError naming the known ones otherwise."""
    if unknown := [c for c in criteria if c not in CRITERIA]:
        raise UserError(f"--criteria {' '.join(unknown)}: not a criterion (one of {', '.join(CRITERIA)})")
    return tuple(dict.fromkeys(criteria))


def check_sparsities(sparsities) -> None:
    if bad := [s for s in sparsities if not 0 < s < 1]:
        raise UserError(f"--sparsities {' '.join(f'{s:g}' for s in bad)}: each must be a fraction between 0 and 1 "
                        "(exclusive) of each layer's routed experts")  # fmt: skip


# ------------------------------------------------------------------------------------------ one pass


@dataclasses.dataclass
class Pass:
    """One model over the held-out windows: per document the summed next-token loss and the predictions counted (as
    ablation.py's `document_losses`), and per MoE layer the experts chosen [N, K] (rank order, the model's own ids) at
    every predicting position, in window order."""

    loss: np.ndarray
    count: np.ndarray
    experts: dict[int, np.ndarray]


@torch.no_grad()
def held_out_pass(routing: TorchRouting, docs: list[tuple[int, np.ndarray]], seq_len: int, batch_size: int = 16
                  ) -> Pass:  # fmt: skip
    """`routing`'s model over `docs` cut into windows of `seq_len` (right-padded batches; causal, so padding reaches
    no real token), its routers' choices read from their outputs."""
    recorder = RoutingRecorder(routing.routers, parts=True)  # why parts: a transformers layer routes a part at a time
    loss, count = np.zeros(len(docs)), np.zeros(len(docs))
    experts: dict[int, list[np.ndarray]] = {layer: [] for layer in routing.layers}
    with recorder:
        for part, tokens, mask in window_batches(docs, seq_len, batch_size):
            recorder.last.clear()
            S = tokens.shape[1]
            logits = routing.forward(tokens[:, :-1]).float().cpu()
            ce = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none") * mask
            for b, w in enumerate(part):
                loss[w.doc] += ce[b].sum().item()
                count[w.doc] += mask[b].sum().item()
            for layer in routing.layers:
                chosen = recorder.last[layer][0].reshape(len(part), S - 1, -1)
                experts[layer].append(chosen[mask].numpy())
    return Pass(loss, count, {layer: np.concatenate(v) for layer, v in experts.items()})


# ------------------------------------------------------------------------------------------ one arm


def arm_result(base: Pass, arm: Pass, plan: KeepPlan, domain: np.ndarray, domains: list[str], n_boot: int = 1000,
               seed: int = 0, floors: dict | None = None) -> dict:  # fmt: skip
    """The pruned model's pass `arm` against the unpruned `base` on the same windows: per domain the log-prob change
    per token with its document-bootstrap interval, per MoE layer its routing (`floors`: MaxVio floor by n_keep)."""
    by_domain = delta_by_domain((arm.loss, arm.count), (base.loss, base.count), domain, len(domains), n_boot, seed)
    routing = {}
    for layer in plan.layers:
        local = arm.experts[layer]
        counts = expert_counts(local, plan.n_keep)
        original = np.asarray(plan.kept[layer])[local[:, 0]]
        vio = max_vio(counts)
        routing[str(layer)] = {"maxvio": vio, "max_over_mean": vio + 1 if counts.sum() else float("nan"),
                               "top1_changed": float(np.mean(original != base.experts[layer][:, 0])),
                               "maxvio_floor": (floors or {}).get(plan.n_keep)}  # fmt: skip
    return {"by_domain": dict(zip(domains, by_domain, strict=True)), "routing": routing}


def averaged_pass(passes: list[Pass]) -> Pass:
    """The per-document mean loss over passes of the same windows (random's seeds); no routing."""
    return Pass(np.mean([p.loss for p in passes], axis=0), passes[0].count, {})


# ------------------------------------------------------------------------------------------ rank agreement


def ranks(x) -> np.ndarray:
    """Ranks from 0, ties given their mean rank."""
    x = np.asarray(x, np.float64)
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(len(x))
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    return (np.bincount(inverse, weights=r) / counts)[inverse]


def spearman(a, b) -> float:
    """Spearman's ρ (Pearson's correlation of the ranks); NaN when either side is constant."""
    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def spearman_by_layer(scores: dict[int, np.ndarray], reference: dict[int, np.ndarray]) -> dict[str, float]:
    """Per MoE layer the ρ of `scores` with `reference` (ablation's), and their mean over layers ("mean")."""
    rho = {str(layer): spearman(scores[layer], reference[layer]) for layer in sorted(reference)}
    values = [v for v in rho.values() if np.isfinite(v)]
    return {**rho, "mean": float(np.mean(values)) if values else float("nan")}


# ------------------------------------------------------------------------------------------ documents


def check_disjoint(calibration: list[tuple[int, np.ndarray]], held_out: list[tuple[int, np.ndarray]], what: str):
    """A UserError when a calibration document is a held-out one (equal, or one the start of the other)."""
    starts = {tuple(tokens[:16].tolist()): tokens for _, tokens in held_out}
    for _, tokens in calibration:
        other = starts.get(tuple(tokens[:16].tolist()))
        n = min(len(tokens), len(other)) if other is not None else 0
        if n and np.array_equal(tokens[:n], other[:n]):
            raise UserError(f"the calibration documents ({what}) hold held-out documents of the validation split: "
                            "score on other documents (--data, or the training split without --trace)")  # fmt: skip


# ------------------------------------------------------------------------------------------ the check


def check_prune(req: CheckRequest) -> dict:
    """The check `req` asks for, written into `req.out` (check.json, check.md, check.png; calibration_trace/ when
    recorded here); returns check.json's record."""
    out = Path(req.out)
    checked = checked_model(req.subject, out)
    source_shape = checked.shape
    shape = plan_shape(source_shape, req.ungroup, req.subject.label)
    criteria, n_keeps = check_criteria(req.criteria), checked_keeps(req, shape)
    trace = Trace(req.trace) if req.trace else None
    if trace is not None:
        check_given_trace(trace, shape, req)

    subject = checked.load()
    routing, seq_len = subject.routing, subject.seq_len
    held, domains, held_what = checked.held_out(req.held_out, req.held_out_tokens)
    if trace is not None and trace.provenance.get("data") == held_what:
        raise UserError(f"--trace {req.trace}: recorded on the held-out documents of the check: give a trace of other "
                        "documents, or leave out --trace")  # fmt: skip
    if trace is None:
        trace = record_calibration(req, subject, out / TRACE_FOLDER)
    if trace.layers != routing.layers:
        raise UserError(f"--trace {req.trace}: its MoE layers {trace.layers} are not {req.subject.label}'s "
                        f"{routing.layers}: give a trace recorded from it")  # fmt: skip
    wanted = list(req.domains) if req.domains else None
    calibration = trace_documents(trace, wanted)
    check_disjoint(calibration, held, str(trace.provenance.get("data")))
    seeds = [req.seed + i for i in range(req.random_seeds)]
    scores = criteria_scores(criteria, trace, routing, calibration, wanted, seeds, trace.meta.get("windows") or seq_len)

    domain = np.array([d for d, _ in held])
    base = held_out_pass(routing, held, seq_len, req.batch_size)
    n_predicted = int(base.count.sum())
    floors = {n: max_vio_floor(n_predicted, n, shape.k, trials=50) for n in [shape.n_experts, *n_keeps]}
    base_routing = {str(layer): {"maxvio": max_vio(expert_counts(base.experts[layer], shape.n_experts)),
                                 "maxvio_floor": floors[shape.n_experts]} for layer in base.experts}  # fmt: skip
    arm = ArmContext(checked, base, held, domain, domains, seq_len, floors, req)
    arms = [groups_dropped_arm(arm, source_shape.n_experts)] if req.ungroup else []
    for criterion in criteria:
        for n_keep in n_keeps:
            plans = [KeepPlan.from_scores(s, n_keep, shape.n_group) for (c, _), s in scores.items() if c == criterion]
            arms.append(check_arm(criterion, plans, arm))
            arms[-1]["seeds"] = seeds if criterion == "random" else None
    agreement, best = agreement_with_ablation(scores)
    record = {
        "subject": checked.about(),
        "n_experts": shape.n_experts, "k": shape.k, "n_group": source_shape.n_group,
        **ungrouped(source_shape, req.ungroup),
        "held_out": {"documents": held_what, "n_documents": len(held), "tokens_predicted": n_predicted,
                     "domains": domains, "seq_len": seq_len, "max_tokens": req.held_out_tokens},
        "calibration": {"trace": str(req.trace) if req.trace else TRACE_FOLDER,
                        "documents": trace.provenance.get("data"), "tokens": trace.n,
                        "n_documents": trace.meta["n_docs"], "domains": wanted or trace.domains},
        "base": {"loss_by_domain": {name: float(base.loss[domain == d].sum() / max(base.count[domain == d].sum(), 1))
                                    for d, name in enumerate(domains)}, "routing": base_routing},
        "arms": arms,
        "scores": {score_name(c, s): {str(layer): v.tolist() for layer, v in sc.items()}
                   for (c, s), sc in scores.items()},
        "spearman_with_ablation": agreement,
        "tracks_ablation_best": best,
        "n_boot": req.n_boot, "seed": req.seed, "random_seeds": seeds,
    }  # fmt: skip
    (out / "check.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "check.md").write_text(check_markdown(record))
    from moe_lm.analysis.plots import save  # why here: matplotlib only when a figure is drawn

    save(check_figure(record), out / "check.png")
    return record


def checked_keeps(req: CheckRequest, shape) -> list[int]:
    """The kept counts of `req`'s sparsities (or keeps), largest first; a UserError for one the routing cannot keep."""
    if req.sparsities:
        check_sparsities(req.sparsities)
        asked = [keep_count(shape, s, None) for s in req.sparsities]
    else:
        asked = [keep_count(shape, None, k) for k in req.keeps]
    return sorted(set(asked), reverse=True)


def score_name(criterion: str, seed: int | None) -> str:
    return criterion if seed is None else f"random (seed {seed})"


def check_given_trace(trace: Trace, shape, req: CheckRequest) -> None:
    """A UserError for a --trace of another model's routing."""
    if (trace.n_experts, trace.k) != (shape.n_experts, shape.k):
        raise UserError(f"--trace {req.trace}: routed {trace.n_experts} experts, top-{trace.k}; {req.subject.label} "
                        f"has {shape.n_experts}, top-{shape.k}: give a trace recorded from it")  # fmt: skip


def record_calibration(req: CheckRequest, subject: Subject, folder: Path) -> Trace:
    """The calibration documents' routing (--data, else the run's training split, under --max-tokens spread equally
    over the domains) recorded into `folder` as `moe-lm analyze` records a trace, with the experts' output norms."""
    docs, domains, provenance = budgeted_documents(subject, req)
    provenance = {**provenance, **subject.provenance}
    trace = record_trace(subject.routing, docs, folder, domains, subject.seq_len, req.batch_size,
                         provenance=provenance, progress="calibration routing")  # fmt: skip
    print(f"recorded {trace.n:,} calibration tokens in {trace.meta['n_docs']} documents")
    return trace


def criteria_scores(criteria, trace: Trace, routing: TorchRouting, calibration, wanted, seeds: list[int],
                    seq_len: int):  # fmt: skip
    """(criterion, seed or None) -> per MoE layer the [E] scores on the calibration trace (random: one per seed)."""
    scores: dict[tuple[str, int | None], dict[int, np.ndarray]] = {}
    for criterion in criteria:
        if criterion == "random":
            scores.update({("random", s): trace_scores(trace, "random", wanted, s) for s in seeds})
        elif criterion in FROM_TRACE:
            scores[(criterion, None)] = trace_scores(trace, criterion, wanted)
        else:
            print(f"ablation: {len(routing.layers)} layers x {trace.n_experts} experts, each over {len(calibration)} "
                  "calibration documents")  # fmt: skip
            scores[(criterion, None)] = ablation_scores(routing.forward, routing.routers, trace.n_experts, calibration,
                                                        seq_len, reroute=routing.reroute)  # fmt: skip
    return scores


@dataclasses.dataclass(frozen=True)
class ArmContext:
    """What every arm is scored against: the model pruned, the unpruned model's pass over the held-out documents,
    their domains, the window length, the MaxVio floors by kept count, the request."""

    checked: CheckedModel
    base: Pass
    held: list[tuple[int, np.ndarray]]
    domain: np.ndarray
    domains: list[str]
    seq_len: int
    floors: dict
    req: CheckRequest


def check_arm(criterion: str, plans: list[KeepPlan], at: ArmContext) -> dict:
    """One criterion at one kept count (random: a plan per seed), each pruned model scored on the held-out windows
    against the unpruned model's pass."""
    results, passes = [], []
    req = at.req
    for plan in plans:
        with at.checked.pruned(plan) as pruned:
            arm = held_out_pass(pruned, at.held, at.seq_len, req.batch_size)
        passes.append(arm)
        results.append(arm_result(at.base, arm, plan, at.domain, at.domains, req.n_boot, req.seed, at.floors))
    n_keep = plans[0].n_keep
    row = {"criterion": criterion, "n_keep": n_keep, "sparsity": 1 - n_keep / plans[0].n_experts, **results[0]}
    if criterion == "random":
        row.update(random_summary(at.base, passes, results, at.domain, at.domains, req))
    worst = min(v["delta"] for v in row["by_domain"].values())
    print(f"{criterion} keeping {n_keep} of {plans[0].n_experts}: Δ log-prob per token, worst domain {worst:+.4f}")
    return row


GROUPS_DROPPED = "none, groups dropped"  # the arm of --ungroup that removes no expert


def groups_dropped_arm(at: ArmContext, n_experts: int) -> dict:
    """What dropping the expert groups alone changes (--ungroup): every expert kept, routed without groups."""
    every = {layer: np.zeros(n_experts) for layer in at.base.experts}
    return check_arm(GROUPS_DROPPED, [KeepPlan.from_scores(every, n_experts, 1)], at)


def agreement_with_ablation(scores: dict) -> tuple[dict | None, str | None]:
    """Per criterion (each random seed apart) the Spearman ρ per layer with ablation's scores, and the criterion
    other than ablation whose mean ρ is highest (random: the mean over its seeds); (None, None) without ablation."""
    reference = scores.get(("ablation", None))
    if reference is None:
        return None, None
    agreement = {score_name(c, s): spearman_by_layer(v, reference) for (c, s), v in scores.items()}
    cheap = {c: v["mean"] for c, v in agreement.items() if c != "ablation" and not c.startswith("random")}
    if randoms := [v["mean"] for c, v in agreement.items() if c.startswith("random")]:
        cheap["random"] = float(np.nanmean(randoms))
    finite = {c: v for c, v in cheap.items() if np.isfinite(v)}
    return agreement, (max(finite, key=finite.get) if finite else None)


def random_summary(base: Pass, passes: list[Pass], results: list[dict], domain: np.ndarray,
                   domains: list[str], req: CheckRequest) -> dict:  # fmt: skip
    """Random's arm over its seeds: Δ of the per-document mean loss (with its document-bootstrap interval), the
    seeds' spread, and its routing averaged over the seeds."""
    mean = averaged_pass(passes)
    by_domain = delta_by_domain((mean.loss, mean.count), (base.loss, base.count), domain, len(domains), req.n_boot,
                                req.seed)  # fmt: skip
    summary = {}
    for name, row in zip(domains, by_domain, strict=True):
        each = [r["by_domain"][name]["delta"] for r in results]
        summary[name] = {**row, "seeds_sd": float(np.std(each, ddof=1)) if len(each) > 1 else 0.0,
                         "seeds_range": [float(min(each)), float(max(each))]}  # fmt: skip
    routing = {layer: {key: float(np.mean([r["routing"][layer][key] for r in results]))
                       for key in ("maxvio", "max_over_mean", "top1_changed")} | {
                           "maxvio_floor": results[0]["routing"][layer]["maxvio_floor"]}
               for layer in results[0]["routing"]}  # fmt: skip
    return {"by_domain": summary, "routing": routing, "per_seed": results}


# ------------------------------------------------------------------------------------------ report


def _f(v, fmt: str = "+.4f") -> str:
    return "n/a" if v is None or not np.isfinite(v) else format(v, fmt)


def check_markdown(record: dict) -> str:
    held, cal = record["held_out"], record["calibration"]
    lines = [
        f"# Pruning check: {subject_name(record['subject'])}",
        "",
        f"Held out: {held['documents']}, {held['n_documents']} documents, {held['tokens_predicted']:,} predicted "
        f"tokens, windows of {held['seq_len']}. Calibration (the scores): {cal['documents']}, {cal['tokens']:,} "
        f"tokens in {cal['n_documents']} documents; never the held-out documents.",
        "",
        "Δ: the pruned model's mean log-prob per token minus the unpruned model's on the same windows (nats; below 0:"
        " worse), its 95 % interval a bootstrap over documents. random: the mean over seeds "
        f"{', '.join(map(str, record['random_seeds']))}, with the seeds' standard deviation.{_ungrouped(record)}",
        "",
        "| criterion | sparsity | kept | domain | Δ log-prob / token | 95 % interval | documents | seeds' sd |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm in record["arms"]:
        for name, v in arm["by_domain"].items():
            lines.append(f"| {arm['criterion']} | {arm['sparsity']:.4g} | {arm['n_keep']}/{record['n_experts']} | "
                         f"{name} | {_f(v['delta'])} | [{_f(v['ci95'][0])}, {_f(v['ci95'][1])}] | {v['documents']} | "
                         f"{_f(v.get('seeds_sd'), '.4f') if 'seeds_sd' in v else ''} |")  # fmt: skip
    lines += [
        "",
        "## Routing after pruning",
        "",
        "Per MoE layer over the held-out predicting positions: MaxVio over the kept experts (floor: a uniform random "
        "router of the same tokens, experts and k), the new load's max / mean, the share of tokens whose first choice "
        "changed. Unpruned: "
        + ", ".join(f"layer {layer} MaxVio {_f(v['maxvio'], '.3f')} (floor {_f(v['maxvio_floor'], '.3f')})"
                    for layer, v in record["base"]["routing"].items()) + ".",
        "",
        "| criterion | sparsity | layer | MaxVio (floor) | max / mean load | top-1 changed |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    for arm in record["arms"]:
        for layer, v in arm["routing"].items():
            lines.append(f"| {arm['criterion']} | {arm['sparsity']:.4g} | {layer} | {_f(v['maxvio'], '.3f')} "
                         f"({_f(v['maxvio_floor'], '.3f')}) | {_f(v['max_over_mean'], '.3f')} | "
                         f"{_f(v['top1_changed'], '.1%')} |")  # fmt: skip
    lines += ["", "## Agreement with the ablation reference", ""]
    agreement = record["spearman_with_ablation"]
    if agreement is None:
        lines.append("Not measured: `ablation` was not among --criteria (its scores are the reference).")
    else:
        layers = [k for k in next(iter(agreement.values())) if k != "mean"]
        lines += ["Spearman's ρ per MoE layer of each criterion's expert scores with ablation's, on the same "
                  f"calibration trace. Tracks ablation best: **{record['tracks_ablation_best']}**.", "",
                  "| criterion | " + " | ".join(f"layer {x}" for x in layers) + " | mean |",
                  "|---" * (len(layers) + 2) + "|"]  # fmt: skip
        for name, rho in agreement.items():
            lines.append(
                f"| {name} | " + " | ".join(_f(rho[x], "+.3f") for x in layers) + f" | {_f(rho['mean'], '+.3f')} |"
            )
    return "\n".join(lines) + "\n"


def subject_name(subject: dict) -> str:
    """check.json's subject in words: a run with its checkpoint's tag, or a transformers folder."""
    return f"{subject['run']} ({subject['tag']})" if "run" in subject else f"{subject['hf']} (transformers)"


def _ungrouped(record: dict) -> str:
    if not (groups := record.get("ungrouped")):
        return ""
    return (f" Pruned with --ungroup: every pruned model routes without the source's {groups['n_group']} expert "
            f"groups (the best {groups['topk_group']} used); `{GROUPS_DROPPED}` keeps every expert, so its Δ is what "
            "dropping the groups alone costs.")  # fmt: skip


def check_figure(record: dict):
    """Δ log-prob per token against sparsity, one line per criterion, one panel per domain, intervals as bands."""
    from moe_lm.analysis.plots import plt

    domains = record["held_out"]["domains"]
    fig, axes = plt.subplots(1, len(domains), figsize=(3.6 * len(domains) + 1.2, 3.4), sharey=True, squeeze=False)
    criteria = list(dict.fromkeys(a["criterion"] for a in record["arms"]))
    for ax, name in zip(axes[0], domains, strict=True):
        for i, criterion in enumerate(criteria):
            arms = sorted((a for a in record["arms"] if a["criterion"] == criterion), key=lambda a: a["sparsity"])
            x = [a["sparsity"] for a in arms]
            y = np.array([a["by_domain"][name]["delta"] for a in arms])
            lo, hi = (np.array([a["by_domain"][name]["ci95"][j] for a in arms]) for j in (0, 1))
            color = plt.cm.tab10(i % 10)
            label = criterion + (f" (mean of {len(record['random_seeds'])} seeds)" if criterion == "random" else "")
            ax.plot(x, y, marker="o", ms=3, lw=1.2, color=color, ls="--" if criterion == "random" else "-", label=label)
            ax.fill_between(x, lo, hi, color=color, alpha=0.18, lw=0)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("sparsity (share of routed experts removed)")
    axes[0][0].set_ylabel("Δ log-prob per token (nats)")
    axes[0][-1].legend(fontsize=7, loc="lower left")
    fig.suptitle("Held-out log-prob change of each pruned model (bands: 95 % document bootstrap)", fontsize=10)
    fig.tight_layout()
    return fig
