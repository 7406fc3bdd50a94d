"""`moe-lm eval` (launch/evaluate.py): lm-evaluation-harness on a run or an export scores [document start] + context +
continuation, the ids training fed the model; its accuracies equal those computed here from transformers'
loglikelihoods."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

pytest.importorskip("lm_eval", reason="needs lm-evaluation-harness: pip install 'moe-lm[eval]'")
transformers = pytest.importorskip("transformers")

from moe_lm.config import load_config  # noqa: E402
from moe_lm.data.tokenizer import load_data_tokenizer  # noqa: E402
from tests.helpers.runs import WORDS  # noqa: E402

TASK = "tiny_next_word"


def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1, as a user's shell would set them: the commands must not reach for
    the hub. huggingface_hub and datasets read these variables once, when imported (already, in this process), so
    their flags are set too."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)


def next_word_items(encode, max_tokens: int, n_per_domain: int = 10, seed: int = 0) -> list[dict]:
    """Multiple choice: continue a run of a domain's words with its next word, against words of the other domains.
    A few items have an empty context (lm-eval then scores the choice after its prefix token alone). Contexts are
    cut from the left until every choice fits `max_tokens` (lm-eval would cut them, and the start token with them)."""
    rng = np.random.default_rng(seed)
    items = []
    for domain, words in WORDS.items():
        others = sorted({w for d, ws in WORDS.items() if d != domain for w in ws} - set(words))
        for i in range(n_per_domain):
            end = int(rng.integers(1, len(words)))
            context = [] if i < 1 else words[int(rng.integers(0, end)) : end]
            choices = [words[end], *rng.choice(others, 3, replace=False).tolist()]
            while 1 + max(len(encode(" ".join([*context, c]))) for c in choices) > max_tokens:
                context = context[1:]
            rng.shuffle(choices)
            items.append({"context": " ".join(context), "choices": choices, "label": choices.index(words[end])})
    return items


def write_task(folder: Path, items: list[dict]) -> Path:
    """A local lm-eval task: JSONL documents and a YAML reading them with the `json` dataset builder."""
    folder.mkdir(parents=True)
    data = folder / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in items))
    config = {
        "task": TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{context}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}",
        "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
    }
    (folder / f"{TASK}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return folder / f"{TASK}.yaml"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_data, trained_run, cli):
    """A short run (shared: read only), its export (`moe-lm export`), and the local task."""
    root = tmp_path_factory.mktemp("evaluate")
    run = trained_run(max_steps=6)
    with pytest.MonkeyPatch.context() as monkeypatch:
        offline(monkeypatch)
        proc = cli("export", "--run", run, "--out", root / "export")
    assert proc.returncode == 0, proc.stderr[-3000:]
    max_seq_len = load_config(run / "config.yaml").model.max_seq_len
    items = next_word_items(load_data_tokenizer(tiny_data.out_dir).encode, max_seq_len)
    return run, root / "export", write_task(root / "task", items), items


def reference_loglikelihoods(export: Path, data_dir: str, items: list[dict], start: bool = True) -> list[list[float]]:
    """Each choice's loglikelihood by transformers on [document start] + encode(context) + continuation, the
    continuation being what encoding the whole text adds after the context (as one training document has it)."""
    tok = load_data_tokenizer(data_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    prefix = [tok.doc_start_id] if start else []
    out = []
    for item in items:
        assert item["context"] == item["context"].rstrip()  # lm-eval would move a trailing space, see check below
        context = prefix + tok.encode(item["context"])
        scores = []
        for choice in item["choices"]:
            text = f"{item['context']} {choice}" if item["context"] else f" {choice}"
            whole = prefix + tok.encode(text)
            assert whole[: len(context)] == context  # the context's ids are a prefix of the whole text's
            with torch.no_grad():
                logp = model(torch.tensor([whole[:-1]])).logits[0].double().log_softmax(-1)
            scores.append(sum(logp[i - 1, whole[i]].item() for i in range(max(len(context), 1), len(whole))))
        out.append(scores)
    return out


def accuracies(items: list[dict], lls: list[list[float]]) -> tuple[float, float]:
    """acc (argmax loglikelihood) and acc_norm (argmax loglikelihood per character of the choice), as lm-eval."""
    acc = [int(np.argmax(ll)) == it["label"] for it, ll in zip(items, lls, strict=True)]
    lengths = [np.array([len(c) for c in it["choices"]], dtype=float) for it in items]
    norm = [int(np.argmax(np.array(ll) / n)) == it["label"] for it, ll, n in zip(items, lls, lengths, strict=True)]
    return float(np.mean(acc)), float(np.mean(norm))


def sample_loglikelihoods(out: Path) -> dict[int, list[float]]:
    """Per document id, the loglikelihood lm-eval scored for each choice (from samples_<task>.jsonl)."""
    docs = [json.loads(line) for line in (out / f"samples_{TASK}.jsonl").read_text().splitlines()]
    return {d["doc_id"]: [float(r[0][0]) for r in d["resps"]] for d in docs}


def test_evaluate_an_export_scores_what_training_fed_the_model(trained, tiny_data, cli, monkeypatch, tmp_path):
    run, export, task_yaml, items = trained
    offline(monkeypatch)
    proc = cli("eval", "--model", export, "--include-path", task_yaml.parent, "--tasks", TASK,
               "--out", tmp_path / "eval", "--batch-size", "4", "--log-samples")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    start = load_data_tokenizer(tiny_data.out_dir).doc_start_id
    assert results["moe_lm"]["start_token_id"] == start

    reference = reference_loglikelihoods(export, tiny_data.out_dir, items)
    scored = sample_loglikelihoods(tmp_path / "eval")
    assert sorted(scored) == list(range(len(items)))
    for doc_id, ll in scored.items():
        np.testing.assert_allclose(ll, reference[doc_id], atol=1e-4, rtol=0)
    acc, acc_norm = accuracies(items, reference)
    metrics = results["results"][TASK]
    print(f"{TASK}: acc {metrics['acc,none']} (reference {acc}), acc_norm {metrics['acc_norm,none']} ({acc_norm})")
    assert metrics["acc,none"] == pytest.approx(acc, abs=1e-12)
    assert metrics["acc_norm,none"] == pytest.approx(acc_norm, abs=1e-12)

    # the start token matters to this model: without it, the contexts' loglikelihoods are other numbers
    some = [i for i, item in enumerate(items) if item["context"]]
    unstarted = reference_loglikelihoods(export, tiny_data.out_dir, [items[i] for i in some], start=False)
    assert np.abs(np.array(unstarted) - np.array([reference[i] for i in some])).max() > 1e-3  # 10x the tolerance


def test_evaluate_a_run_exports_it_on_the_fly(trained, tiny_data, cli, monkeypatch, tmp_path):
    """--run RUN with a task YAML path gives the scores of the run's export; --limit takes the first documents."""
    run, export, task_yaml, items = trained
    offline(monkeypatch)
    proc = cli("eval", "--run", run, "--tasks", task_yaml, "--out", tmp_path / "eval", "--limit", "12",
               "--log-samples")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    scored = sample_loglikelihoods(tmp_path / "eval")
    assert sorted(scored) == list(range(12))
    reference = reference_loglikelihoods(export, tiny_data.out_dir, items[:12])
    for doc_id, ll in scored.items():
        np.testing.assert_allclose(ll, reference[doc_id], atol=1e-4, rtol=0)
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert results["results"][TASK]["acc,none"] == pytest.approx(accuracies(items[:12], reference)[0], abs=1e-12)
    assert [p.name for p in (tmp_path / "eval").iterdir() if p.name.startswith(".export-")] == []  # cleaned up


def test_evaluate_refuses_bad_output_and_exports_without_a_start_token(trained, cli, monkeypatch, tmp_path):
    run, export, task_yaml, _ = trained
    offline(monkeypatch)
    (tmp_path / "file").write_text("")
    proc = cli("eval", "--run", run, "--tasks", task_yaml, "--out", tmp_path / "file")
    assert proc.returncode == 2 and "--out" in proc.stderr and "not a folder" in proc.stderr, proc.stderr[-2000:]
    proc = cli("eval", "--model", tmp_path, "--tasks", task_yaml, "--out", tmp_path / "o")
    assert proc.returncode == 2 and "config.json not found" in proc.stderr, proc.stderr[-2000:]
    proc = cli("eval", "--model", export, "--tasks", "no_such_task_xyz", "--out", tmp_path / "o")
    assert proc.returncode == 2 and "no such lm-eval task" in proc.stderr, proc.stderr[-2000:]


def test_lm_evals_own_tasks_are_indexed_only_when_the_users_tasks_name_one(tmp_path):
    """Indexing lm-eval's 14,683 task files costs ~15 s per call: tasks given as YAML files or in --include-path
    skip it unless a name they reach (a group's members, nested groups, through `include`) is not among them."""
    from lm_eval.tasks import TaskManager

    from moe_lm.interop.lm_eval import needs_lm_evals_tasks

    files = {
        "a.yaml": "task: mine_a\ntag: [mine_tag]\ndataset_path: json\ndoc_to_text: !function utils.text\n",
        "b.yaml": "include: a.yaml\ntask: mine_b\n",
        "g.yaml": "group: mine_g\ntask: [mine_a, {task: mine_b, num_fewshot: 2}]\n",
        "nested.yaml": "group: mine_nested\ntask:\n  - group: mine_g\n    aggregate_metric_list: []\n",
        "builtin.yaml": "group: mine_builtin\ntask: [mine_a, arc_easy]\n",
        "deep.yaml": "group: mine_deep\ntask: [mine_builtin]\n",
        "inline.yaml": "group: mine_inline\ntask:\n  - group: not_indexed\n    task: [mine_a]\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    own = TaskManager(include_path=str(tmp_path), include_defaults=False).task_index
    for specs in (["mine_a"], ["mine_b", "mine_g"], ["mine_nested"], ["mine_tag"], [str(tmp_path / "g.yaml")]):
        assert not needs_lm_evals_tasks(specs, own), specs
    for specs in (["mine_builtin"], ["mine_deep"], ["mine_inline"], ["mine_a", "arc_easy"], ["mine_*"],
                  [str(tmp_path / "builtin.yaml")], [str(tmp_path / "deep.yaml")]):  # fmt: skip
        assert needs_lm_evals_tasks(specs, own), specs
    (tmp_path / "broken.yaml").write_text("include: missing.yaml\ntask: x\n")  # lm-eval names the problem
    assert needs_lm_evals_tasks([str(tmp_path / "broken.yaml")], {})


def test_lm_eval_ids_without_the_start_token_are_refused(trained):
    """The check every evaluation runs first: a model that lm-eval would feed no start token is an error."""
    from lm_eval.models.huggingface import HFLM

    from moe_lm.interop.lm_eval import check_start_token, document_start_id

    _, export, _, _ = trained
    start = document_start_id(export)
    check_start_token(HFLM(pretrained=str(export), device="cpu", add_bos_token=True), start)
    with pytest.raises(ValueError, match=f"every training document began with token {start}"):
        check_start_token(HFLM(pretrained=str(export), device="cpu", add_bos_token=False), start)


def test_a_gpt2_style_export_is_scored_after_eos(tmp_path):
    """A tokenizer without BOS began every document with EOS: lm-eval scores contexts, and empty ones, after it."""
    from lm_eval.api.instance import Instance

    from moe_lm.interop.hf import export_hf
    from moe_lm.interop.hf_tokenizer import export_tokenizer
    from moe_lm.interop.lm_eval import harness_lm
    from moe_lm.model import Transformer
    from moe_lm.testing import tiny_model_cfg
    from tests.helpers.tokenizers import bpe_json, prepare_with

    raw = bpe_json(tmp_path / "raw", ["<|endoftext|>"])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(raw), eos_token="<|endoftext|>")
    fast.save_pretrained(tmp_path / "gpt2ish")
    data = prepare_with(tmp_path, str(tmp_path / "gpt2ish"))
    tok = load_data_tokenizer(data)
    assert tok.bos_id is None and tok.doc_start_id == tok.eos_id
    export = tmp_path / "export"
    export.mkdir()
    export_hf(Transformer(tiny_model_cfg(vocab_size=300)).eval(), export, tok.doc_start_id, tok.eos_id)
    export_tokenizer(data, export, max_len=64)

    lm = harness_lm(export)
    assert lm.prefix_token_id == tok.eos_id
    items = [{"context": "the bond yield", "choices": ["rose", "galaxy"], "label": 0},
             {"context": "", "choices": ["stir", "the"], "label": 0}]  # fmt: skip
    requests = [
        Instance("loglikelihood", {}, (it["context"], f" {c}"), i) for it in items for i, c in enumerate(it["choices"])
    ]
    scored = [ll for ll, _ in lm.loglikelihood(requests)]
    reference = [ll for lls in reference_loglikelihoods(export, data, items) for ll in lls]
    np.testing.assert_allclose(scored, reference, atol=1e-4, rtol=0)
    # the comparison sees the start token: without it, the first item's context gives other numbers
    unstarted = reference_loglikelihoods(export, data, items[:1], start=False)[0]
    assert np.abs(np.array(unstarted) - reference[:2]).max() > 1e-3
