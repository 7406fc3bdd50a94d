"""What an experiment's runs are keyed on beyond the config: the data's content and the code's version."""

from __future__ import annotations

import json
import shutil

from moe_lm.data.prepare import prepare_data
from moe_lm.experiments import provenance
from moe_lm.experiments.provenance import data_fingerprint


def test_the_data_fingerprint_follows_content_and_tokenizer(tiny_data, tmp_path):
    """The same documents prepared again give the same fingerprint (although the tokenizer file differs in the path
    it records); one document's content, its split, or one token of a shard give another."""
    folder = tmp_path / "copy"
    shutil.copytree(tiny_data.out_dir, folder)
    same = data_fingerprint(tiny_data.out_dir)
    assert data_fingerprint(folder) == same
    again = tmp_path / "again"
    prepare_data(type(tiny_data)(**{**vars(tiny_data), "out_dir": str(again)}), vocab_size=_vocab(tiny_data),
                 log=lambda s: None)  # fmt: skip
    assert data_fingerprint(again) == same  # deterministic preparation, same inputs

    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["documents"][0]["sha256"] = "0" * 16  # another text under the same name
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert data_fingerprint(folder) != same
    manifest["documents"][0]["sha256"] = json.loads((again / "manifest.json").read_text())["documents"][0]["sha256"]
    manifest["documents"][0]["split"] = "val" if manifest["documents"][0]["split"] == "train" else "train"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert data_fingerprint(folder) != same

    shutil.rmtree(folder)
    shutil.copytree(tiny_data.out_dir, folder)
    tokens = folder / "val" / "tokens.bin"
    raw = bytearray(tokens.read_bytes())
    raw[0] ^= 1  # one token of the validation split
    tokens.write_bytes(bytes(raw))
    assert data_fingerprint(folder) != same


def test_the_code_versions_cover_what_trains_and_evaluates_and_nothing_else(monkeypatch, process):
    """The training version changes with the model, the training loop, a research variant or a kernel, not with a
    report or the CLI of another command; the evaluation version also with the final evaluation. A verbose console
    (DeepSpeed's notice printed as the modules import) changes neither."""
    # `process`, not called here: each version lists its modules in a fresh interpreter (provenance._IMPORTED)
    package = provenance.PACKAGE
    base = {k: _version(k) for k in ("training", "evaluation")}
    _each_listing_once(monkeypatch)
    with monkeypatch.context() as loud:
        loud.setenv("MOE_LM_VERBOSE", "1")
        again = {k: _version(k) for k in ("training", "evaluation")}
    assert base == again and len(base["training"]) == 16
    for path, changes in [("model/router.py", {"training", "evaluation"}),
                          ("train/loop.py", {"training", "evaluation"}),
                          ("experiments/variants/objectives.py", {"training", "evaluation"}),
                          ("ops/csrc/" + next((package / "ops/csrc").glob("*.cpp")).name, {"training", "evaluation"}),
                          ("experiments/final_eval.py", {"evaluation"}),
                          ("experiments/report.py", set()), ("cli/bench.py", set()),
                          ("configs/experiments/mask.yaml", set())]:  # fmt: skip
        real = (package / path).read_bytes()
        with monkeypatch.context() as edit:
            edit.setattr(provenance.Path, "read_bytes", _edited(package / path, real + b"\n# edited\n"))
            changed = {k for k in base if _version(k) != base[k]}
        assert changed == changes, (path, changed)


def _each_listing_once(monkeypatch) -> None:
    """From here on, the fresh interpreter that lists the modules of a version's entry points runs once per entry
    list, its answer kept (two fresh listings agreeing is checked before this). why: each takes seconds (it imports
    torch and DeepSpeed), and the edits above append a comment to a file: its bytes change, not what is imported."""

    class ListedOnce:
        def __init__(self, real):
            self.real, self.answers = real, {}

        def __getattr__(self, name):
            return getattr(self.real, name)

        def run(self, cmd, **kwargs):
            if tuple(cmd) not in self.answers:
                self.answers[tuple(cmd)] = self.real.run(cmd, **kwargs)
            return self.answers[tuple(cmd)]

    monkeypatch.setattr(provenance, "subprocess", ListedOnce(provenance.subprocess))


def _version(kind: str) -> str:
    return provenance._source_hash(provenance.TRAINING_ENTRIES if kind == "training" else provenance.EVALUATION_ENTRIES)


def _edited(target, content: bytes):
    original = provenance.Path.read_bytes

    def read_bytes(self):
        return content if self == target else original(self)

    return read_bytes


def _vocab(cfg) -> int:
    from moe_lm.data.prepare import read_meta

    return read_meta(cfg.out_dir)["vocab_size"]
