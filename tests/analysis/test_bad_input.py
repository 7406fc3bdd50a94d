"""The analytics under careless or hostile input (fault round 5): subjects cut into other windows, a domain field no
document has, meaningless budgets and batch sizes, NaN in metrics.json, and thousands of domains, each one line or a
report that stays linear in the domains."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from moe_lm.analysis import metrics as M
from moe_lm.config import DataConfig
from moe_lm.data.prepare import prepare_data
from moe_lm.errors import DataError
from moe_lm.routing.routed_model import bounded_batch


def refused(proc, *needles: str) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert all(n in proc.stderr for n in needles), proc.stderr[-3000:]
    return proc.stderr


def test_every_subject_of_a_comparison_sees_the_same_windows(tiny_run, cli, tmp_path):
    """A run trained at 2,048 tokens against its own f32 GGUF or HF export at the default 1,024 reported 5.9 % of
    tokens routed elsewhere, all of it the context's cut. --seq-len (or the run's own train.seq_len) now cuts every
    subject alike, and comparisons.md says into what."""
    assert cli("export", "--run", tiny_run, "--out", tmp_path / "hf").returncode == 0
    for flags, windows in (([], 32), (["--seq-len", "16"], 16)):
        out = tmp_path / f"a{windows}"
        proc = cli("analyze", "--run", tiny_run, "--compare", tmp_path / "hf", "--out", out, "--max-tokens", "1500",
                   "--no-init-baseline", *flags)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads((out / "metrics.json").read_text())
        assert result["trace"]["windows"] == windows
        assert json.loads((out / "trace_compare_0" / "meta.json").read_text())["windows"] == windows
        exact = result["comparisons"][str(tmp_path / "hf")]
        assert exact["tokens_differing_in_any_layer"]["mean"] == 0.0, exact["layers"]
        assert f"cut into the same windows of {windows} tokens" in (out / "comparisons.md").read_text()


def test_a_domain_field_no_document_has_is_refused(tiny_run, cli, tmp_path):
    """A misspelt column (`--domain-field subject` on rows that say `domain`) silently gave one domain: the file's."""
    data = tmp_path / "mmlu.jsonl"
    data.write_text("".join(json.dumps({"text": f"question {i} about law " * 20, "domain": f"d{i % 3}"}) + "\n"
                            for i in range(9)))  # fmt: skip
    proc = cli("analyze", "--run", tiny_run, "--data", data, "--domain-field", "subject", "--out", tmp_path / "a")
    refused(proc, "no document of", "'subject' field")
    assert not (tmp_path / "a").exists()
    ok = cli("analyze", "--run", tiny_run, "--data", data, "--domain-field", "domain", "--out", tmp_path / "b",
             "--no-init-baseline")  # fmt: skip
    assert ok.returncode == 0 and json.loads((tmp_path / "b" / "metrics.json").read_text())["trace"]["domains"] == [
        "d0", "d1", "d2"]  # fmt: skip


def test_prepare_refuses_a_domain_field_no_document_has(tiny_data, tmp_path):
    cfg = DataConfig(sources=list(tiny_data.sources), out_dir=str(tmp_path / "p"), domain_field="subject")
    with pytest.raises(DataError, match="'subject' field"):
        prepare_data(cfg, vocab_size=300, log=lambda line: None)


@pytest.mark.parametrize(
    "flags, needle",
    [(["--min-count", "1"], "--min-count must be at least 2"), (["--min-count", "0"], "--min-count must be at least"),
     (["--min-count", "-1"], "--min-count must be at least"), (["--batch-size", "0"], "--batch-size must be at least"),
     (["--max-tokens", "2"], "of the 3 domains without a token"), (["--seq-len", "1"], "--seq-len must be")],
)  # fmt: skip
def test_meaningless_settings_are_one_line(tiny_run, cli, tmp_path, flags, needle):
    """--min-count 0/1/-1 wrote NaN into metrics.json (an id seen once has chance level 1: 0/0), --batch-size 0 put
    every window in one forward pass, --max-tokens below the number of domains ended in a ValueError."""
    refused(cli("analyze", "--run", tiny_run, "--out", tmp_path / "a", *flags), needle)
    assert not (tmp_path / "a").exists()


def test_metrics_json_is_strict_json_when_a_metric_has_no_data(tiny_run, cli, tmp_path):
    """No token id occurs --min-count times in 60 tokens: vocabulary specialisation has no data. metrics.json says
    null, which every JSON reader takes, never NaN."""
    proc = cli("analyze", "--run", tiny_run, "--out", tmp_path / "a", "--max-tokens", "60", "--min-count", "1000")
    assert proc.returncode == 0, proc.stderr[-3000:]

    def no_constants(name):
        raise AssertionError(f"metrics.json holds {name}, which is not JSON")

    result = json.loads((tmp_path / "a" / "metrics.json").read_text(), parse_constant=no_constants)
    assert all(lm["vocabulary_specialisation"]["corrected"] is None for lm in result["layers"].values())


def test_a_batch_is_bounded_by_its_logits():
    assert bounded_batch(16, 1024, 129_280) == 2  # DeepSeek-V3's vocabulary: 2 x 1024 x 129,280 x 4 bytes < 1 GiB
    assert bounded_batch(16, 256, 300) == 16 and bounded_batch(16, 1 << 20, 1 << 20) == 1


def test_mean_domain_jsd_is_every_pair_or_an_unbiased_sample_of_them():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, (30, 8)).astype(float)
    dist = counts / counts.sum(1, keepdims=True)
    pairs = [M.js_divergence(dist[i], dist[j]) for i in range(30) for j in range(i + 1, 30)]
    assert M.mean_domain_jsd(counts) == pytest.approx(np.mean(pairs), rel=1e-12)
    assert M.mean_pairwise(M.domain_jsd_table(counts)) == pytest.approx(np.mean(pairs), rel=1e-12)
    # 435 pairs, 200 drawn: within four standard errors of the mean over all of them
    sampled = M.mean_domain_jsd(counts, max_pairs=200, seed=3)
    assert abs(sampled - np.mean(pairs)) < 4 * np.std(pairs) / math.sqrt(200)
    assert M.mean_domain_jsd(counts[:1]) == 0.0


def test_thousands_of_domains_keep_the_report_linear(tiny_run, cli, tmp_path):
    """2,000 domains (MMLU-style data with many subjects) took 289 s and 4 GB and wrote a 298 MB report: a Python
    loop over the 2 million pairs of domains, their whole table in metrics.json, figures as wide as the domains.
    Now the mean over pairs is over 20,000 pairs drawn at random (said in metrics.json), the pair table is left out
    above 64 domains, and a figure draws the domains with the most tokens."""
    rng = random.Random(0)
    words = "alpha beta gamma delta stars onion galaxy yield bond river stone light".split()
    data = tmp_path / "many.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(12)), "subject": f"s{d}"})
                            + "\n" for d in range(1000)))  # fmt: skip
    proc = cli("analyze", "--run", tiny_run, "--data", data, "--domain-field", "subject", "--out", tmp_path / "a",
               "--max-tokens", "20000", "--no-init-baseline")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "a" / "metrics.json").stat().st_size < 2_000_000
    result = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert result["domain_pairs"] == {"domains": 1000, "pairs": 499500, "averaged_over": 20000, "sampled": True,
                                      "table": False}  # fmt: skip
    layer = result["layers"]["1"]
    assert layer["domain_jsd_bits"] is None
    shares = np.array(layer["domain_token_share"])  # [D, E], rows sum to k: the distribution is shares / k
    dist = shares / shares.sum(1, keepdims=True)

    def entropy(x):
        return -(x * np.log2(np.where(x > 0, x, 1))).sum(-1)

    def jsd(p, q):  # rows of q against p, written here from the definition
        return entropy((p + q) / 2) - (entropy(p) + entropy(q)) / 2

    exact = np.mean(np.concatenate([jsd(dist[i][None], dist[i + 1 :]) for i in range(999)]))
    assert layer["mean_domain_jsd_bits"] == pytest.approx(exact, rel=0.05)
