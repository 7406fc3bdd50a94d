"""How two subjects route the same token ids: a run and its GGUF export, an HF original and its quantised GGUF, two
checkpoints of one run (OLMoE's router saturation). Definitions: docs/analytics.md ("Comparing subjects").

Per MoE layer, overall and per domain, each beside its chance level (two routers that choose independently, each
with its own expert frequencies) and with a 95 % bootstrap interval over documents:
- top-1 agreement: the same first choice;
- top-k overlap: mean |A ∩ B| / k (router saturation when the two are checkpoints of one run);
- flips: tokens whose expert set differs, and how many of them were near ties (their decision margin, the k-th
  minus the (k+1)-th selection score or the group margin, below `TIE` in either subject);
across layers, the share of tokens whose experts differ in at least one layer; and each token's log-prob under both
(mean and tail of |delta|, on tokens with and without a flip anywhere): what the flips cost.
"""

from __future__ import annotations

import numpy as np

from moe_lm.errors import DataError
from moe_lm.routing.trace import Trace

TIE = 1e-4  # a decision whose margin is below this is a near tie: any rounding can flip it
N_BOOT = 500


def same_tokens(ref: Trace, other: Trace, label: str) -> None:
    """A DataError unless `other` recorded the very rows of `ref` (token ids, documents, positions) and layers."""
    if other.n != ref.n or not np.array_equal(np.asarray(ref.token), np.asarray(other.token)):
        raise DataError(f"{label} did not route the same token ids as the subject ({other.n:,} against {ref.n:,})")
    if other.meta.get("windows") != ref.meta.get("windows"):
        raise DataError(
            f"{label} was cut into windows of {other.meta.get('windows')} tokens, the subject into "
            f"{ref.meta.get('windows')}: with other context the routing differs; record both alike"
        )
    if other.layers != ref.layers or (other.n_experts, other.k) != (ref.n_experts, ref.k):
        raise DataError(
            f"{label} has MoE layers {other.layers} of {other.n_experts} experts (top-{other.k}); the subject has "
            f"{ref.layers} of {ref.n_experts} (top-{ref.k}): not the same architecture"
        )


def agreement(ref: Trace, other: Trace, label: str, n_boot: int = N_BOOT, seed: int = 0) -> dict:
    """Everything the report says about `other` against `ref` (see the module's docstring); str layer keys."""
    same_tokens(ref, other, label)
    doc = np.asarray(ref.doc, np.int64)
    draws = document_draws(doc, n_boot, seed)
    differs_any = np.zeros(ref.n, bool)
    layers, set_chance = {}, []
    for layer in ref.layers:
        a, b = np.asarray(ref.experts(layer), np.int64), np.asarray(other.experts(layer), np.int64)
        layers[str(layer)], flip = _layer_agreement(ref, other, layer, a, b, draws)
        differs_any |= flip
        set_chance.append(1 - layers[str(layer)]["chance"]["flip_rate"])
    return {
        "label": label,
        "layers": layers,
        "tokens_differing_in_any_layer": {
            **mean_with_interval(differs_any, doc, draws),
            "chance": 1 - float(np.prod(set_chance)),
        },  # fmt: skip
        "logprob": _logprob_gap(ref, other, differs_any),
    }


def _layer_agreement(ref: Trace, other: Trace, layer: int, a: np.ndarray, b: np.ndarray, draws) -> tuple[dict, ...]:
    """One layer's numbers (its experts `a` under ref, `b` under other), and which tokens' expert sets differ."""
    doc, domain = np.asarray(ref.doc, np.int64), np.asarray(ref.domain, np.int64)
    top1, overlap = a[:, 0] == b[:, 0], (a[:, :, None] == b[:, None, :]).any(2).sum(1) / ref.k
    ranked = ref.ranked and other.ranked  # a side recorded as sets (Megatron's trace) has no first choice
    flip = overlap < 1
    known = ref.margins(layer) is not None or other.margins(layer) is not None  # one side's margin decides a tie
    margin = np.fmin(_margins(ref, layer, ref.n), _margins(other, layer, ref.n))
    by_domain = {}
    for d, name in enumerate(ref.domains):
        rows = domain == d
        if rows.any():
            by_domain[name] = {"top1_agreement": float(top1[rows].mean()) if ranked else None,
                               "topk_overlap": float(overlap[rows].mean()),
                               "flip_rate": float(flip[rows].mean())}  # fmt: skip
    numbers = {
        "top1_agreement": mean_with_interval(top1, doc, draws) if ranked else None,
        "topk_overlap": mean_with_interval(overlap, doc, draws),
        "flips": int(flip.sum()),
        "flip_rate": mean_with_interval(flip, doc, draws),
        # they need a decision margin (the selection scores) from at least one of the two subjects
        "flips_near_ties": int((flip & (margin < TIE)).sum()) if known else None,
        "near_ties": int((margin < TIE).sum()) if known else None,
        "flipped_margin_median": float(np.nanmedian(margin[flip])) if flip.any() and np.isfinite(margin[flip]).any()
        else None,
        "order_differs": int((a != b).any(1).sum()) if ranked else None,
        "chance": {"top1_agreement": _chance_top1(a, b, ref.n_experts) if ranked else None,
                   "topk_overlap": _chance_overlap(a, b, ref.n_experts, ref.k),
                   "flip_rate": 1 - _chance_same_set(a, b)},  # fmt: skip
        "by_domain": by_domain,
        "weights": _weight_gap(ref, other, layer, a, b),
    }  # fmt: skip
    return numbers, flip


def _margins(trace: Trace, layer: int, n: int) -> np.ndarray:
    m = trace.margins(layer)
    return np.full(n, np.nan) if m is None else np.asarray(m, np.float64)


def document_draws(doc: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """[n_boot, D] how often each document is drawn in each bootstrap resample of the documents."""
    n_docs = int(doc.max()) + 1 if len(doc) else 0
    picks = np.random.default_rng(seed).integers(0, n_docs, (n_boot, n_docs)) if n_docs else np.zeros((n_boot, 0))
    return np.stack([np.bincount(row.astype(np.int64), minlength=n_docs) for row in picks]) if n_docs else picks


def mean_with_interval(per_token: np.ndarray, doc: np.ndarray, draws: np.ndarray) -> dict:
    """The mean over tokens, and its 95 % interval from resampling whole documents (tokens of one document move
    together: their routing is not independent)."""
    values = np.asarray(per_token, np.float64)
    sums = np.bincount(doc, weights=values, minlength=draws.shape[1])
    counts = np.bincount(doc, minlength=draws.shape[1]).astype(np.float64)
    boot = (draws @ sums) / np.maximum(draws @ counts, 1)
    lo, hi = np.percentile(boot, [2.5, 97.5]) if len(boot) else (np.nan, np.nan)
    return {"mean": float(values.mean()) if len(values) else float("nan"), "interval": [float(lo), float(hi)]}


def _chance_top1(a: np.ndarray, b: np.ndarray, n_experts: int) -> float:
    """P(same first choice) for two independent routers with these first-choice frequencies."""
    pa, pb = (np.bincount(x[:, 0], minlength=n_experts) / max(len(x), 1) for x in (a, b))
    return float(pa @ pb)


def _chance_overlap(a: np.ndarray, b: np.ndarray, n_experts: int, k: int) -> float:
    """E|A ∩ B| / k for two independent routers with these per-expert selection frequencies."""
    qa, qb = (np.bincount(x.ravel(), minlength=n_experts) / max(len(x), 1) for x in (a, b))
    return float(qa @ qb / k)


def _chance_same_set(a: np.ndarray, b: np.ndarray) -> float:
    """P(the same expert set) for two independent routers with these set frequencies."""
    keys_a, keys_b = (np.sort(x, axis=1) for x in (a, b))
    sets, inverse = np.unique(np.concatenate([keys_a, keys_b]), axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    fa = np.bincount(inverse[: len(a)], minlength=len(sets)) / max(len(a), 1)
    fb = np.bincount(inverse[len(a) :], minlength=len(sets)) / max(len(b), 1)
    return float(fa @ fb)


def _weight_gap(ref: Trace, other: Trace, layer: int, a: np.ndarray, b: np.ndarray) -> dict:
    """|delta| of the gate weights on rows whose experts agree in order (stored as float16: ~1e-3 relative); it
    needs both subjects' gate weights."""
    same = (a == b).all(1)
    wa, wb = ref.weights(layer), other.weights(layer)
    if wa is None or wb is None:
        return {"rows": 0, "needs": "the gate weights of both subjects; one of them does not record them"}
    if not same.any():
        return {"rows": 0}
    gap = np.abs(np.asarray(wa, np.float64)[same] - np.asarray(wb, np.float64)[same])
    return {"rows": int(same.sum()), "max": float(gap.max()), "p99": float(np.percentile(gap, 99))}


def _logprob_gap(ref: Trace, other: Trace, differs_any: np.ndarray) -> dict | None:
    """Each token's log-prob under `other` minus under `ref`, where both recorded one."""
    if ref.logprob is None or other.logprob is None:
        return None
    delta = np.asarray(other.logprob, np.float64) - np.asarray(ref.logprob, np.float64)
    known = np.isfinite(delta)

    def summary(rows: np.ndarray) -> dict:
        d = delta[rows & known]
        if not len(d):
            return {"tokens": 0}
        magnitude = np.abs(d)
        return {"tokens": int(len(d)), "mean": float(d.mean()), "mean_abs": float(magnitude.mean()),
                "p99_abs": float(np.percentile(magnitude, 99)), "max_abs": float(magnitude.max())}  # fmt: skip

    return {"all": summary(np.ones_like(known)), "with_a_flip": summary(differs_any),
            "without_a_flip": summary(~differs_any)}  # fmt: skip
