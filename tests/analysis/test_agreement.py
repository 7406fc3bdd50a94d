"""Comparing two subjects on the same token ids (moe_lm/analysis/agreement.py) against brute-force definitions:
the per-layer agreement, flips and their chance levels (two independent routers with these frequencies), and the
share of tokens that flip in some layer."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from moe_lm.analysis.agreement import agreement
from moe_lm.analysis.recording import record_trace
from moe_lm.model import Transformer
from moe_lm.routing.torch_routing import transformer_routing
from moe_lm.testing import tiny_model_cfg


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """One tiny model and a copy whose selection biases moved: their traces of the same documents."""
    folder = tmp_path_factory.mktemp("agreement")
    model = Transformer(tiny_model_cfg()).eval()
    other = Transformer(tiny_model_cfg()).eval()
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        for r in other.routers():
            r.e_score_correction_bias.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(0)
    docs = [(i % 2, torch.randint(2, 97, (n,), generator=gen).numpy()) for i, n in enumerate([40, 70, 25, 90, 60])]
    made = [record_trace(transformer_routing(m), docs, folder / name, ["a", "b"], seq_len=32, progress=False)
            for m, name in ((model, "ref"), (other, "other"))]  # fmt: skip
    return made


def test_agreement_equals_its_brute_force_definitions(traces):
    ref, other = traces
    result = agreement(ref, other, "moved biases", n_boot=200)
    same_everywhere = np.ones(ref.n, bool)
    for layer in ref.layers:
        a, b = np.asarray(ref.experts(layer), np.int64), np.asarray(other.experts(layer), np.int64)
        m = result["layers"][str(layer)]
        flips = [set(x) != set(y) for x, y in zip(a.tolist(), b.tolist(), strict=True)]
        same_everywhere &= ~np.array(flips)
        assert m["flips"] == sum(flips) and m["flip_rate"]["mean"] == pytest.approx(np.mean(flips))
        lo, hi = m["flip_rate"]["interval"]
        assert lo <= m["flip_rate"]["mean"] <= hi
        assert m["top1_agreement"]["mean"] == pytest.approx(np.mean(a[:, 0] == b[:, 0]))
        overlap = [len(set(x) & set(y)) / ref.k for x, y in zip(a.tolist(), b.tolist(), strict=True)]
        assert m["topk_overlap"]["mean"] == pytest.approx(np.mean(overlap))
        # chance: independent draws, each router from its own frequencies
        sets_a, sets_b = (Counter(tuple(sorted(r)) for r in x.tolist()) for x in (a, b))
        same_set = sum(sets_a[s] * sets_b[s] for s in sets_a) / ref.n**2
        assert m["chance"]["flip_rate"] == pytest.approx(1 - same_set)
        first_a, first_b = Counter(a[:, 0].tolist()), Counter(b[:, 0].tolist())
        assert m["chance"]["top1_agreement"] == pytest.approx(sum(first_a[e] * first_b[e] for e in first_a) / ref.n**2)
    assert 0 < result["tokens_differing_in_any_layer"]["mean"] == pytest.approx(1 - same_everywhere.mean())


def test_a_subject_against_itself_agrees_everywhere(traces):
    ref, _ = traces
    result = agreement(ref, ref, "itself", n_boot=50)
    for m in result["layers"].values():
        assert m["flips"] == 0 and m["top1_agreement"]["mean"] == 1.0 and m["topk_overlap"]["mean"] == 1.0
        assert 0 < m["chance"]["flip_rate"] < 1  # chance stays what two independent routers would do
    assert result["tokens_differing_in_any_layer"]["mean"] == 0.0
