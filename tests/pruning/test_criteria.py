"""The criteria against references computed here from the trace's columns, the expert output norms against the
experts' weights, and the ablation criterion against the model with the expert's bias at -inf."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moe_lm.analysis.recording import record_trace
from moe_lm.errors import UserError
from moe_lm.model import Transformer
from moe_lm.pruning.criteria import ablation_scores, trace_documents, trace_scores
from moe_lm.routing.torch_routing import transformer_routing
from moe_lm.routing.trace import Trace
from moe_lm.testing import tiny_model_cfg

DOMAINS = ["a", "b", "c"]


def docs(n=9, seed=0):
    rng = np.random.default_rng(seed)
    return [(i % 3, rng.integers(0, 97, int(rng.integers(20, 50)))) for i in range(n)]


@pytest.fixture(scope="module")
def model_and_trace(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(tiny_model_cfg(moe=dict(n_routed_experts=16, n_group=4, topk_group=2))).eval()
    trace = record_trace(transformer_routing(model), docs(), tmp_path_factory.mktemp("t") / "trace", DOMAINS, 32,
                         batch_size=4, progress=False)  # fmt: skip
    return model, trace


def reference(trace: Trace, layer: int, criterion: str, domains=None) -> np.ndarray:
    """The definitions, one routed (token, slot) at a time."""
    count, mass, saliency = np.zeros(16), np.zeros(16), np.zeros(16)
    experts, weights, norms = trace.experts(layer), trace.weights(layer), trace.norms(layer)
    for t in range(trace.n):
        if domains and trace.domains[trace.domain[t]] not in domains:
            continue
        for k in range(trace.k):
            e = experts[t, k]
            count[e] += 1
            mass[e] += float(weights[t, k])
            saliency[e] += float(weights[t, k]) * float(norms[t, k])
    if criterion == "frequency":
        return count
    if criterion == "gate-mass":
        return mass
    return np.array([saliency[e] / count[e] if count[e] else 0.0 for e in range(16)])


@pytest.mark.parametrize("criterion", ["frequency", "gate-mass", "reap"])
@pytest.mark.parametrize("domains", [None, ["b"], ["a", "c"]])
def test_trace_criteria_are_their_definitions(model_and_trace, criterion, domains):
    _, trace = model_and_trace
    scores = trace_scores(trace, criterion, domains)
    assert sorted(scores) == trace.layers == [1, 2]
    for layer in trace.layers:
        np.testing.assert_allclose(scores[layer], reference(trace, layer, criterion, domains), rtol=1e-9, atol=1e-9)


def test_random_is_seeded(model_and_trace):
    _, trace = model_and_trace
    one, again, other = (trace_scores(trace, "random", seed=s) for s in (1, 1, 2))
    assert all(np.array_equal(one[layer], again[layer]) for layer in trace.layers)
    assert not np.array_equal(one[1], other[1])


def test_a_domain_the_documents_lack_is_named(model_and_trace):
    _, trace = model_and_trace
    with pytest.raises(UserError, match=r"--domains zzz: not a domain of the calibration documents \(a, b, c\)"):
        trace_scores(trace, "frequency", ["zzz"])


def test_the_norms_column_is_each_chosen_experts_output_norm(model_and_trace):
    model, trace = model_and_trace
    doc_tokens = torch.from_numpy(docs()[0][1][:32].astype(np.int64))[None]  # the first window of the first document
    inputs = {}
    hooks = [model.layers[i].mlp.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0][0]))
             for i in trace.layers]  # fmt: skip
    with torch.no_grad():
        model(doc_tokens)
    for h in hooks:
        h.remove()
    for layer in trace.layers:
        experts = model.layers[layer].mlp.experts
        I = experts.down_proj.shape[2]
        for t in (0, 5, 31):
            for k in range(trace.k):
                e = int(trace.experts(layer)[t, k])
                gate, up = experts.gate_up_proj[e, :I], experts.gate_up_proj[e, I:]  # HF's layout: gate rows first
                x = inputs[layer][t]
                with torch.no_grad():
                    f = experts.down_proj[e] @ (F.silu(gate @ x) * (up @ x))
                assert float(trace.norms(layer)[t, k]) == pytest.approx(float(f.norm()), rel=2e-3)


def test_reap_on_a_trace_without_norms_says_to_record_again(model_and_trace, tmp_path):
    import json
    import shutil

    _, trace = model_and_trace
    old = shutil.copytree(trace.folder, tmp_path / "old")
    meta = json.loads((old / "meta.json").read_text())
    meta["columns"] = ["weights", "margins", "logprob"]  # as recorded before the norms
    (old / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="needs the expert output norms.*record it again with this version"):
        trace_scores(Trace(old), "reap")
    assert Trace(old).norms(1) is None and trace_scores(Trace(old), "frequency")[1].sum() == trace.n * trace.k


def test_the_trace_gives_back_its_documents(model_and_trace):
    _, trace = model_and_trace
    again = trace_documents(trace)
    assert [(d, t.tolist()) for d, t in again] == [(d, t.tolist()) for d, t in docs()]
    assert [d for d, _ in trace_documents(trace, ["b"])] == [1, 1, 1]


def test_ablation_is_the_loss_increase_with_the_expert_alone_masked_before_selection():
    torch.manual_seed(1)
    cfg = tiny_model_cfg(moe=dict(n_routed_experts=16, n_group=4, topk_group=2), n_layers=2)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.layers[1].mlp.gate.e_score_correction_bias[7] = -1e4  # expert 7 is never chosen: removing it is free
    d = docs(6)
    routers = {1: model.layers[1].mlp.gate}
    scores = ablation_scores(lambda t: model(t).logits, routers, 16, d, 64)  # each document one window

    def mean_loss(m):  # the reference: each document whole in one window, no batching
        total = count = 0.0
        with torch.no_grad():
            for _, tokens in d:
                ids = torch.from_numpy(tokens.astype(np.int64))[None]
                total += F.cross_entropy(m(ids[:, :-1]).logits[0], ids[0, 1:], reduction="sum").item()
                count += len(tokens) - 1
        return total / count

    base = mean_loss(model)
    for e in (0, 7, 13):
        other = Transformer(cfg).eval()
        other.load_state_dict(model.state_dict())
        with torch.no_grad():
            other.layers[1].mlp.gate.e_score_correction_bias[e] = float("-inf")
        assert scores[1][e] == pytest.approx(mean_loss(other) - base, abs=1e-5)
    assert scores[1][7] == 0.0 and (scores[1] != 0).sum() >= 10
