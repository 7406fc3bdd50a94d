"""`moe-lm prune --check` of a transformers folder (a Qwen3-MoE: a softmax router without a selection bias): each
pruned model is the folder prune writes, loaded by transformers, scored on --held-out-data against the source."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from moe_lm.analysis.documents import user_documents
from moe_lm.data.tokenizer import HFTokenizer
from moe_lm.pruning.criteria import trace_documents
from moe_lm.pruning.hf_folder import prune_hf_folder
from moe_lm.pruning.plan import KeepPlan
from moe_lm.routing.trace import Trace
from tests.analysis.test_hf_routing import tiny_tokenizer
from tests.helpers.released import qwen3_moe, random_model
from tests.helpers.runs import WORDS
from tests.pruning.test_check import direct_logprobs
from tests.pruning.test_formats import softmax_masked

SEQ_LEN = 32


def documents(path, seed: int, n: int = 6) -> None:
    """`n` documents of 20-60 words per domain of WORDS, as JSON lines {"text", "domain"}."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for domain, words in WORDS.items():
            for _ in range(n):
                text = " ".join(rng.choice(words, rng.integers(20, 60)))
                f.write(json.dumps({"text": text, "domain": domain}) + "\n")


@pytest.fixture(scope="module")
def hf_check(tmp_path_factory, cli):
    """A random Qwen3-MoE (8 experts, top-2, norm_topk_prob) checked at 2 of 8 kept by frequency, random (1 seed)
    and ablation, calibrated on one set of documents and held out on another."""
    root = tmp_path_factory.mktemp("hf_check")
    source = root / "qwen3"
    random_model(qwen3_moe()).save_pretrained(source)
    tiny_tokenizer(source)
    documents(root / "calibration.jsonl", seed=0)
    documents(root / "held_out.jsonl", seed=1)
    proc = cli("prune", "--hf", source, "--check", "--data", root / "calibration.jsonl", "--held-out-data",
               root / "held_out.jsonl", "--criteria", "frequency", "random", "ablation", "--keeps", "2",
               "--random-seeds", "1", "--seq-len", str(SEQ_LEN), "--out", root / "check")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return source, root, json.loads((root / "check" / "check.json").read_text())


def load(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def held_out_docs(source, path) -> tuple[list[tuple[int, np.ndarray]], list[str]]:
    domains: list[str] = []
    return list(user_documents([str(path)], HFTokenizer(source), domains, "text", "domain")), domains


def test_the_delta_is_the_written_pruned_folder_against_the_source_in_transformers(hf_check):
    source, root, record = hf_check
    docs, domains = held_out_docs(source, root / "held_out.jsonl")
    assert record["subject"] == {"hf": str(source)} and record["held_out"]["n_documents"] == len(docs)
    assert record["held_out"]["domains"] == domains and record["held_out"]["seq_len"] == SEQ_LEN
    scores = {int(layer): np.array(v) for layer, v in record["scores"]["frequency"].items()}
    plan = KeepPlan.from_scores(scores, 2, 1)
    base, n = direct_logprobs(load(source), docs, SEQ_LEN)
    pruned, _ = direct_logprobs(load(prune_hf_folder(source, root / "pruned", plan.kept)), docs, SEQ_LEN)
    arm = next(a for a in record["arms"] if a["criterion"] == "frequency")
    domain = np.array([d for d, _ in docs])
    for d, name in enumerate(domains):
        expected = (pruned[domain == d] - base[domain == d]).sum() / n[domain == d].sum()
        assert arm["by_domain"][name]["delta"] == pytest.approx(expected, abs=2e-5), name
        assert record["base"]["loss_by_domain"][name] == pytest.approx(-base[domain == d].sum() / n[domain == d].sum(),
                                                                       abs=2e-5)  # fmt: skip
    assert all(abs(v["delta"]) > 1e-3 for v in arm["by_domain"].values())  # 6 of 8 experts gone: not vacuous
    assert not list((root / "check").glob(".pruned-*"))  # the pruned folders were scratch


def test_ablation_of_a_router_without_a_bias_is_the_loss_with_that_experts_logit_masked(hf_check):
    """A softmax gate has no selection bias to set to -inf: ablation routes around the expert by the gate's own rule,
    which without groups is masking its logit (what a pruned copy computes: test_formats.py); its score is the
    calibration loss increase of the source with that one logit masked (the gate written out in the test)."""
    source, root, record = hf_check
    docs = trace_documents(Trace(root / "check" / "calibration_trace"))
    layer, expert = 1, int(np.argmax(record["scores"]["frequency"]["1"]))
    base, n = direct_logprobs(load(source), docs, SEQ_LEN)
    masked = softmax_masked(load(source), {layer: [e for e in range(8) if e != expert]}, 8)
    without, _ = direct_logprobs(masked, docs, SEQ_LEN)
    assert record["scores"]["ablation"][str(layer)][expert] == pytest.approx((base - without).sum() / n.sum(),
                                                                              abs=2e-5)  # fmt: skip
    assert abs(record["scores"]["ablation"][str(layer)][expert]) > 1e-3  # the expert mattered: not vacuous
