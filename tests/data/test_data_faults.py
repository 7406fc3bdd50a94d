"""Data preparation under faults: it never deletes what it did not create, and damaged inputs are named errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moe_lm.config import DataConfig
from moe_lm.data.batches import eval_windows
from moe_lm.data.documents import DataError, ReadReport
from moe_lm.data.prepare import load_split, prepare_data
from moe_lm.data.sources import iter_source
from tests.helpers.runs import write_folder_corpus


def prepare_cli(cli, tmp_path, *overrides):
    """launch/prepare_data.py with the tiny preset and these overrides (vocab 300, as the test corpus needs)."""
    return cli.script("prepare_data.py", "--config", "tiny", "model.vocab_size=300", *overrides, cwd=tmp_path)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["equal", "inside", "around"])
def test_out_dir_overlapping_a_source_is_refused_and_nothing_is_deleted(cli, tmp_path, where):
    corpus = write_folder_corpus(tmp_path / "corpus", n_docs=4)
    (corpus / "notes.md").write_text("the user's own file")
    before = snapshot(tmp_path)
    out = {"equal": corpus, "inside": corpus / "prepared", "around": tmp_path}[where]
    proc = prepare_cli(cli, tmp_path, f"data.sources=[{corpus}]", f"data.out_dir={out}")
    assert proc.returncode != 0
    assert "overlaps the source" in proc.stderr
    assert snapshot(tmp_path) == before


def test_out_dir_with_foreign_files_is_refused_even_with_force(cli, tmp_path):
    corpus = write_folder_corpus(tmp_path / "corpus", n_docs=4)
    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.tex").write_text("not ours")
    for extra in ([], ["--force"]):
        proc = prepare_cli(cli, tmp_path, f"data.sources=[{corpus}]", f"data.out_dir={out}", *extra)
        assert proc.returncode != 0 and "not prepared data (thesis.tex)" in proc.stderr
    assert (out / "thesis.tex").read_text() == "not ours"


def test_a_failed_build_leaves_no_partial_copy_and_keeps_a_foreign_partial(cli, tmp_path):
    corpus = write_folder_corpus(tmp_path / "corpus", n_docs=4)
    out = tmp_path / "out"
    proc = prepare_cli(cli, tmp_path, f"data.sources=[{corpus}]", f"data.out_dir={out}", "model.vocab_size=60000")
    assert proc.returncode != 0 and "vocab" in proc.stderr.lower()
    assert not (tmp_path / "out.partial").exists() and not out.exists()
    (tmp_path / "out.partial").mkdir()
    (tmp_path / "out.partial" / "mine.txt").write_text("a user's folder that happens to have this name")
    proc = prepare_cli(cli, tmp_path, f"data.sources=[{corpus}]", f"data.out_dir={out}")
    assert proc.returncode != 0 and "was not made by prepare_data" in proc.stderr
    assert (tmp_path / "out.partial" / "mine.txt").is_file()


def test_force_replaces_only_our_own_outputs(tmp_path):
    corpus = write_folder_corpus(tmp_path / "corpus", n_docs=4)
    cfg = DataConfig(sources=[str(corpus)], out_dir=str(tmp_path / "out"), val_fraction=0.25)
    prepare_data(cfg, vocab_size=300, log=lambda s: None)
    prepare_data(cfg, vocab_size=300, force=True, log=lambda s: None)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "manifest.json",
        "meta.json",
        "tokenizer.model",
        "train",
        "val",
    ]


def test_an_edited_source_is_not_up_to_date(tmp_path):
    corpus = write_folder_corpus(tmp_path / "corpus", n_docs=4)
    cfg = DataConfig(sources=[str(corpus)], out_dir=str(tmp_path / "out"), val_fraction=0.25)
    prepare_data(cfg, vocab_size=300, log=lambda s: None)
    doc = corpus / "cooking" / "doc0.txt"
    doc.write_text(doc.read_text() + "one more sentence about onions\n")
    with pytest.raises(DataError, match="the source files' contents"):
        prepare_data(cfg, vocab_size=300, log=lambda s: None)


def test_files_beside_domain_folders_are_a_counted_skip(tmp_path):
    corpus = write_folder_corpus(tmp_path / "corpus", n_docs=2)
    (corpus / "stray.txt").write_text("in no domain")
    report = ReadReport()
    docs = list(iter_source(corpus, report))
    assert all("stray" not in d.name for d in docs)
    [(reason, n)] = report.skipped.items()
    assert n == 1 and "beside the domain folders" in reason and "stray.txt" in report.summary()


@pytest.fixture
def prepared_copy(tmp_path):
    corpus = write_folder_corpus(tmp_path / "corpus", n_docs=4)
    cfg = DataConfig(sources=[str(corpus)], out_dir=str(tmp_path / "out"), val_fraction=0.25)
    return prepare_data(cfg, vocab_size=300, log=lambda s: None)


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda d: (d / "train" / "tokens.bin").write_bytes((d / "train" / "tokens.bin").read_bytes()[:-7]), "bytes"),
        (lambda d: (d / "train" / "doc_offsets.npy").write_bytes(b"garbage"), "doc_offsets|ValueError"),
        (lambda d: (d / "train" / "shard.json").unlink(), "shard.json|FileNotFoundError"),
        (lambda d: np.save(d / "train" / "doc_offsets.npy", np.array([0, 5, 3])), "does not index"),
        (lambda d: (d / "meta.json").write_text('{"signature": '), "meta.json is corrupt"),
    ],
)
def test_damaged_shards_and_meta_are_named_errors(prepared_copy, damage, match):
    damage(prepared_copy)
    with pytest.raises(DataError, match=match) as err:
        load_split(prepared_copy, "train")
    assert str(prepared_copy) in str(err.value) and "--force" in str(err.value)


def test_validation_text_shorter_than_a_window_still_counts(prepared_copy):
    shard = load_split(prepared_copy, "val")
    longest = max(len(shard.document(d)) for d in range(shard.n_docs))
    windows = eval_windows(shard, seq_len=10 * longest * shard.n_docs, per_domain=4)
    assert set(windows) == set(shard.domains)  # no domain silently dropped, no empty window
    for domain, w in windows.items():
        stream = np.concatenate([shard.document(d) for d in shard.domain_docs(domain)])
        assert w.shape == (1, len(stream)) and (w[0].numpy() == stream).all()


def test_prepare_cli_meta_names_its_signature(cli, tmp_path):
    corpus = write_folder_corpus(tmp_path / "corpus", n_docs=4)
    proc = prepare_cli(cli, tmp_path, f"data.sources=[{corpus}]", f"data.out_dir={tmp_path / 'out'}")
    assert proc.returncode == 0, proc.stderr
    signature = json.loads((tmp_path / "out" / "meta.json").read_text())["signature"]
    assert signature["source_files"] and signature["sources"] == [str(corpus)]
