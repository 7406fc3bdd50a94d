"""An experiment's report: what was held equal, the results, every comparison with its intervals and verdict.

Writes report.md, results.json and figures/*.png into the experiment's output folder. Every number comes from the
runs' final evaluations (the whole validation split, per document) and their metrics.jsonl.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moe_lm.errors import RunError
from moe_lm.experiments import power, stats
from moe_lm.experiments.arm_data import ArmData
from moe_lm.experiments.curves import train_seconds, train_validation_gap
from moe_lm.experiments.figures import draw
from moe_lm.experiments.measures import MEASURES, METRICS
from moe_lm.experiments.runner import Run
from moe_lm.experiments.spec import Comparison, Experiment
from moe_lm.model import count_params, decode_flops_per_token, train_flops_per_token

RULES = {
    "lower": "supported if the 95 % t-interval of the seed-paired delta (a - b) lies below 0 and every seed agrees; "
    "contradicted if it lies above 0",
    "higher": "supported if the interval lies above 0 and every seed agrees; contradicted if it lies below 0",
    "not_lower": "supported if the interval lies above -margin (no gain for a larger than the margin); contradicted "
    "if it lies below -margin",
    "not_higher": "supported if the interval lies below +margin; contradicted if it lies above +margin",
    "equivalent": "supported if the 90 % t-interval lies inside +/- margin (two one-sided tests at 5 %); "
    "contradicted if the 95 % interval lies wholly outside it",
}


def compare(c: Comparison, a: ArmData, b: ArmData, n_boot: int) -> dict:
    """Seed-paired deltas, their t-interval, a hierarchical bootstrap (seeds, then documents within domains) and the
    verdict; per domain too for the loss."""
    seeds, deltas = stats.paired_deltas(
        {r.seed: a.metric(c.metric, i) for i, r in enumerate(a.runs)},
        {r.seed: b.metric(c.metric, i) for i, r in enumerate(b.runs)},
        c.name,
    )
    n = len(seeds)
    mean, lo, hi = stats.t_interval(deltas)
    verdict, why = stats.verdict(deltas, lo, hi, c.expect, c.margin)
    base = float(np.mean([b.metric(c.metric, i) for i in range(n)]))
    out = {"name": c.name, "a": c.a, "b": c.b, "metric": c.metric, "expect": c.expect, "margin": c.margin,
           "role": c.role, "seeds": seeds, "deltas": deltas, "mean": mean, "t_interval": [lo, hi],
           "relative_percent": 100 * mean / base if base else None, "verdict": verdict, "why": why,
           "underpowered": "underpowered" in why}  # fmt: skip
    if c.role != "context" and n > 1:  # what a design needs to decide it, taking these seeds as a pilot
        out["power"] = power.seeds_needed(deltas, c.expect, c.margin).as_dict()
    domain = a.arrays[0]["domain"]
    if METRICS[c.metric].per_document and n > 0:

        def metric(arm, s, docs, which=c.metric):
            return (a, b)[arm].metric(which, s, docs)

        # labelled: never beside a verdict (3-5 seeds resampled give about their min-max)
        out["seed_document_bootstrap"] = list(stats.hierarchical_bootstrap(metric, n, domain, n_boot))
    if c.metric == "loss":
        out["by_domain"] = {}
        for d in np.unique(domain):
            docs = np.flatnonzero(domain == d)
            per_seed = [a.metric("loss", s, docs) - b.metric("loss", s, docs) for s in range(n)]
            m, dlo, dhi = stats.t_interval(per_seed)
            out["by_domain"][int(d)] = {"mean": m, "t_interval": [dlo, dhi]}
    return out


def overall(comparisons: list[dict], exploratory: str = "") -> str:
    """The experiment's verdict: none for an exploratory run; "premise not met" when a premise is not supported
    (the claim is then not judged); otherwise supported if every claim is, contradicted if any is."""
    if exploratory:
        return "exploratory (no verdict)"
    if any(c["verdict"] != "supported" for c in comparisons if c["role"] == "premise"):
        return "premise not met"
    verdicts = [c["verdict"] for c in comparisons if c["role"] == "claim"]
    if verdicts and all(v == "supported" for v in verdicts):
        return "supported"
    return "contradicted" if "contradicted" in verdicts else "inconclusive"


def arm_table(exp: Experiment, by_arm: dict[str, ArmData]) -> list[dict]:
    rows = []
    for arm, data in by_arm.items():
        cfg = data.runs[0].cfg
        n = count_params(cfg.model)
        t, prefix = cfg.train, cfg.objective.prefix_len
        # decoding after the same prompt in every arm: the scored prefix (an encoder-decoder's is its encoder input)
        prompt = prefix or (exp.score_from if exp.score_from > 1 else 0)
        times = [t for t in map(train_seconds, data.runs) if t is not None]
        rows.append({
            "arm": arm, "overrides": exp.arms[arm], "total_params": n.total + n.mtp_total, "active_params":
            n.active + n.mtp_active, "train_flops_per_token": train_flops_per_token(cfg.model, t.seq_len, prefix),
            "decode_flops_per_token": decode_flops_per_token(cfg.model, t.seq_len, prompt),
            "tokens_seen": t.max_steps * cfg.global_batch() * t.seq_len,  # one process
            "train_seconds": float(np.mean(times)) if times else None,
            "loss": [r.result["loss"] for r in data.runs],
            "training": [{"seed": r.seed, **train_validation_gap(r)} for r in data.runs],
        })  # fmt: skip
    return rows


def common_inputs(runs: list[Run]) -> dict:
    """The data fingerprint and code versions every run was trained and evaluated with; runs that differ are
    refused."""
    seen = {}
    for r in runs:
        inputs = r.result.get("inputs", {})
        key = tuple(inputs.get(k) for k in ("data_fingerprint", "training_code", "evaluation_code"))
        seen.setdefault(key, []).append(r)
    if len(seen) > 1 or None in next(iter(seen)):
        groups = "; ".join(
            f"data {data}, training code {train}, evaluation code {evaluation}: "
            + ", ".join(f"{r.arm}/{r.seed} ({r.folder})" for r in rs)
            for (data, train, evaluation), rs in seen.items()
        )
        raise RunError(
            f"these runs were trained or evaluated on different data or code, and cannot be compared: {groups}. "
            "Run the experiment again (it trains what is missing for the current inputs)"
        )
    return runs[0].result["inputs"]


def write_report(exp: Experiment, runs: list[Run], out: Path, n_boot: int = 2000) -> dict:
    inputs = common_inputs(runs)
    out.mkdir(parents=True, exist_ok=True)
    by_arm = {arm: ArmData([r for r in runs if r.arm == arm]) for arm in exp.arms}
    by_arm = {arm: data for arm, data in by_arm.items() if data.runs}
    comparisons = [
        compare(c, by_arm[c.a], by_arm[c.b], n_boot) for c in exp.comparisons if c.a in by_arm and c.b in by_arm
    ]
    domains = sorted({k[5:] for r in runs for k in r.result if k.startswith("loss/")})
    results = {
        "experiment": exp.name, "claim": exp.claim, "source": exp.source, "steps": exp.steps, "seeds": exp.seeds,
        "first_seed": exp.first_seed, "confirmatory": exp.confirmatory, "declaration": exp.declaration,
        "score_from": exp.score_from, "verdict": overall(comparisons, exp.exploratory), "command": command(exp),
        "exploratory": exp.exploratory, "arms": arm_table(exp, by_arm),
        "comparisons": comparisons, "domains": domains, "inputs": inputs,
        "runs": [{"arm": r.arm, "seed": r.seed, "folder": str(r.folder), **r.result} for r in runs],
    }  # fmt: skip
    figures = draw(exp, by_arm, comparisons, domains, out / "figures")
    (out / "results.json").write_text(json.dumps(results, indent=1, default=float))
    (out / "report.md").write_text(markdown(exp, results, by_arm, figures))
    return results


def command(exp: Experiment) -> str:
    """The command that gives these runs again (an exploratory deviation is named by its flags)."""
    words = ["moe-lm experiment", exp.name] + ([f"--preset {exp.preset}"] if exp.preset else [])
    words += ["--confirm"] if exp.confirmatory else []
    return " ".join(words + ([f"({exp.exploratory})"] if exp.exploratory else []))


def markdown(exp: Experiment, results: dict, by_arm: dict[str, ArmData], figures: list[str]) -> str:
    lines = _summary_lines(exp, results, by_arm) + _arm_lines(results)
    lines += _result_lines(exp, results, by_arm) + _training_lines(results) + _comparison_lines(results)
    lines += ["", "Rules, fixed before the runs: " + "; ".join(f"*{k}*: {v}" for k, v in RULES.items()) + "."]
    lines += closing_sections(exp, figures)
    runs = ", ".join(f"{r['arm']}/{r['seed']} `{r['folder']}`" for r in results["runs"])
    inputs = results["inputs"]
    lines += ["", "## Reproduce", "", f"`{results['command']}` (data {inputs['data_fingerprint']}, training code "
              f"{inputs['training_code']}, evaluation code {inputs['evaluation_code']}, commit {inputs.get('commit')})",
              "", f"Runs: {runs}"]  # fmt: skip
    return "\n".join(lines) + "\n"


def _summary_lines(exp: Experiment, results: dict, by_arm: dict[str, ArmData]) -> list[str]:
    """The claim, its source, the verdict and what every arm was trained and scored on."""
    first = next(iter(by_arm.values())).runs[0].result
    lines = [
        f"# {exp.name}: {exp.claim}",
        "",
        f"**Source.** {exp.source}",
        "",
        f"**Verdict: {results['verdict']}** (supported if every judged comparison below is supported; contradicted if "
        "any is contradicted; premise not met if a premise is not supported; otherwise inconclusive).",
    ]
    if results.get("exploratory"):
        lines += ["", f"**Exploratory**: {results['exploratory']}. The rules were fixed for the definition's design; "
                  "this run deviates from it, so no comparison is judged."]  # fmt: skip
    if exp.confirmatory:
        d = exp.declaration or {}
        fixed = (f"first committed in {d['committed_in'][:10]} and unchanged since" if d.get("committed_in")
                 else f"not under version control, checked against {d.get('checked_against', 'nothing')}")  # fmt: skip
        seeds = f"{exp.first_seed}..{exp.first_seed + exp.seeds - 1}"
        lines += ["", f"**Confirmatory round**, declared in `{exp.confirmatory}` (sha256 {d.get('sha256', '?')[:16]}"
                  f"..., {fixed}): fresh seeds {seeds}, the pilot's runs not pooled, the definition's comparisons, "
                  "margins and rule unchanged."]  # fmt: skip
    if exp.verdict:
        lines += ["", exp.verdict.strip()]
    return lines + [
        "",
        f"Each arm trained for {exp.steps} steps with seeds {exp.first_seed}..{exp.first_seed + exp.seeds - 1} (the "
        "seed fixes initialisation and "
        f"data order, so arms are paired by seed), then evaluated on the whole validation split: "
        f"{first['documents']} documents, {first['labels']:,} scored tokens"
        + (f" (window positions >= {exp.score_from})" if exp.score_from > 1 else "")
        + ".",
    ]


def _arm_lines(results: dict) -> list[str]:
    lines = [
        "",
        "## Arms and what is held equal",
        "",
        "| arm | overrides | parameters (total / active) | train FLOPs/token | decode FLOPs/token | tokens seen | "
        "training time |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["arms"]:
        secs = f"{row['train_seconds']:.0f} s" if row["train_seconds"] else "-"
        over = " ".join(f"`{o}`" for o in row["overrides"]) or "(none)"
        lines.append(
            f"| {row['arm']} | {over} | {row['total_params'] / 1e6:.2f} M / {row['active_params'] / 1e6:.2f} M | "
            f"{row['train_flops_per_token'] / 1e6:.2f} M | {row['decode_flops_per_token'] / 1e6:.2f} M | "
            f"{row['tokens_seen'] / 1e6:.2f} M | {secs} |"
        )
    return lines


def _result_lines(exp: Experiment, results: dict, by_arm: dict[str, ArmData]) -> list[str]:
    """Validation loss per arm and domain, and the measures the experiment asks for."""
    doms = results["domains"]
    lines = ["", "## Results (validation loss, nats/token; mean ± sd over seeds)", ""]
    lines += ["| arm | loss | " + " | ".join(doms) + " |", "|---|---|" + "---|" * len(doms)]
    for arm, data in by_arm.items():
        cells = [stats.mean_sd([r.result["loss"] for r in data.runs])]
        cells += [stats.mean_sd([r.result.get(f"loss/{d}", np.nan) for r in data.runs]) for d in doms]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    for name in exp.measures:
        lines += MEASURES[name].report(by_arm)
    return lines


def _training_lines(results: dict) -> list[str]:
    """Training time and the train-validation gap, from the runs' step rows (curves.py)."""
    lines = ["", "## Training (step rows; mean ± sd over seeds)", "",
             "Training time is the optimizer steps' own (start-up, evaluations and checkpoints excluded). The gap is "
             "the last evaluation during training (its per-domain losses weighted by the training split's domain "
             "shares) minus the training loss over the last 10 % of the steps, both on the arm's own training "
             "labels; under one epoch each training batch is new, so memorisation cannot show.",
             "", "| arm | training time, s | tokens/s (median step) | train loss | validation loss | gap |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for row in results["arms"]:
        t = row["training"]
        secs = f"{row['train_seconds']:.0f}" if row["train_seconds"] else "-"
        cells = [stats.mean_sd([r[k] for r in t]) for k in ("train_loss", "validation_loss", "gap")]
        lines.append(
            f"| {row['arm']} | {secs} | {np.mean([r['tokens_per_s'] for r in t]):,.0f} | " + " | ".join(cells) + " |"
        )
    return lines


def _comparison_lines(results: dict) -> list[str]:
    """Every comparison's prediction, per-seed deltas, intervals and verdict, and the loss deltas per domain."""
    lines = ["", "## Comparisons (delta = a - b, paired by seed; 95 % t-intervals)", ""]
    lines += ["| comparison | metric | prediction | delta per seed | mean (t-interval) | relative | verdict | "
              "seeds for a verdict (80 %) |"]  # fmt: skip
    lines.append("|---|---|---|---|---|---|---|---|")
    exploratory = results.get("exploratory")
    for c in results["comparisons"]:
        pred = c["expect"].replace("_", " ") + (f" (margin {c['margin']})" if c["margin"] else "")
        seeds = ", ".join(f"{d:+.4f} ({s})" for s, d in zip(c["seeds"], c["deltas"], strict=True))
        lo, hi = c["t_interval"]
        rel = f"{c['relative_percent']:+.2f} %" if c.get("relative_percent") is not None else "-"
        if c["role"] == "context":
            judged, pred = "context (not judged)", "-"
        elif exploratory:
            judged, pred = f"exploratory, not judged ({c['why']})", f"a {pred}"
        else:
            judged, pred = f"{'premise: ' if c['role'] == 'premise' else ''}**{c['verdict']}**: {c['why']}", f"a {pred}"
        unit = METRICS[c["metric"]].unit if c["metric"] in METRICS else ""
        metric = f"{c['metric']} ({unit})" if unit else c["metric"]
        lines.append(
            f"| {c['name']} | {metric} | {pred} | {seeds} | {c['mean']:+.4f} ({lo:+.4f}, {hi:+.4f}) | "
            f"{rel} | {judged} | {_power_cell(c)} |"
        )
    if any("power" in c for c in results["comparisons"]):
        lines += ["", "Seeds for a verdict: the smallest design whose verdict (supported or contradicted) this rule "
                  f"reaches with {100 * power.TARGET:.0f} % probability, taking these seeds' mean and sd as true "
                  "(moe_lm/experiments/power.py; the sd of a few seeds is itself uncertain)."]  # fmt: skip
    doms = results["domains"]
    for c in (c for c in results["comparisons"] if "by_domain" in c):
        lines += ["", f"Per domain, {c['name']} (loss): " + ", ".join(
            f"{doms[d]} {v['mean']:+.4f} ({v['t_interval'][0]:+.4f}, {v['t_interval'][1]:+.4f})"
            for d, v in c["by_domain"].items() if d < len(doms)
        )]  # fmt: skip
    return lines


def _power_cell(c: dict) -> str:
    p = c.get("power")
    if not p:
        return "-"
    likely = "supported" if p["p_supported"] >= p["p_contradicted"] else "contradicted"
    if p["seeds_needed"] is None:
        best = 100 * (p["p_supported"] + p["p_contradicted"])
        return f"none up to {power.MOST_SEEDS} (best {p['best_seeds']}: {best:.0f} %)"
    return f"{p['seeds_needed']} (most likely {likely})"


def closing_sections(exp: Experiment, figures: list[str]) -> list[str]:
    """The figures, what is not tested, and the notes: the end of every report."""
    lines = []
    if figures:
        lines += ["", "## Figures", ""] + [f"![{Path(f).stem}](figures/{Path(f).name})" for f in figures]
    if exp.untested:
        lines += ["", "## Not tested here", ""] + [f"- {u}" for u in exp.untested]
    if exp.notes:
        lines += ["", "## Notes", "", exp.notes.strip()]
    return lines
