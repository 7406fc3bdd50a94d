"""Data: readers, the default corpus, the split, the tokenizer, shards with document and domain indices."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from moe_lm.config import DataConfig
from moe_lm.data import default_corpus
from moe_lm.data.batches import TrainWindows, eval_windows
from moe_lm.data.default_corpus import DOMAINS, iter_default_corpus
from moe_lm.data.documents import ReadReport
from moe_lm.data.prepare import is_validation, load_split, prepare_data
from moe_lm.data.sources import iter_source
from moe_lm.data.tokenizer import load_data_tokenizer
from moe_lm.errors import DataError
from moe_lm.experiments.provenance import data_fingerprint
from tests.helpers.runs import WORDS, write_folder_corpus


def read_all(source):
    report = ReadReport()
    return list(iter_source(source, report)), report


def test_txt_file_is_one_document(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("hello world\nsecond line\n")
    docs, report = read_all(f)
    assert [(d.domain, d.text) for d in docs] == [("notes", "hello world\nsecond line\n")]
    assert report.documents["notes"] == 1


def test_jsonl_reader_and_bad_lines_are_counted(tmp_path):
    f = tmp_path / "mixed.jsonl"
    lines = [
        json.dumps({"text": "alpha text", "domain": "a"}),
        json.dumps({"text": "beta text"}),  # no domain: the file's stem
        "{not json",
        json.dumps({"domain": "a"}),  # no text
        json.dumps({"text": "   ", "domain": "a"}),  # empty
        "",
    ]
    f.write_text("\n".join(lines) + "\n")
    docs, report = read_all(f)
    assert [(d.name, d.domain, d.text) for d in docs] == [  # named from the source's folder; skips by full path
        ("mixed.jsonl:1", "a", "alpha text"),
        ("mixed.jsonl:2", "mixed", "beta text"),
    ]
    assert report.skipped == {"invalid JSON line": 1, "jsonl line without a string 'text' field": 1, "empty text": 1}
    assert f"{f}:3" in report.examples["invalid JSON line"]
    assert "skipped 1 (invalid JSON line)" in report.summary()


def test_a_flat_folder_given_as_dot_is_named_by_the_folder(tmp_path, monkeypatch):
    """A folder of files read from inside it ('.'): its domain and its documents' names come from the folder's own
    name, as when it is given by path."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("hello")
    monkeypatch.chdir(tmp_path / "notes")
    docs, _ = read_all(".")
    assert (
        [(d.name, d.domain) for d in docs]
        == [("notes/a.txt", "notes")]
        == [(d.name, d.domain) for d in read_all(tmp_path / "notes")[0]]
    )


def test_folder_per_domain(tmp_path):
    root = write_folder_corpus(tmp_path / "corpus", n_docs=3)
    docs, report = read_all(root)
    assert sorted({d.domain for d in docs}) == sorted(WORDS)
    assert dict(report.documents) == {d: 3 for d in WORDS}


def test_undecodable_bytes_are_replaced_and_counted(tmp_path):
    f = tmp_path / "latin.txt"
    f.write_bytes(b"caf\xe9 au lait")
    docs, report = read_all(f)
    assert docs[0].text == "caf\ufffd au lait"
    assert report.repaired == 1


def test_bad_inputs_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="not found"):
        read_all(tmp_path / "missing.jsonl")
    (tmp_path / "empty_domain").mkdir()
    (tmp_path / "empty_domain" / "blank.txt").write_text("  \n")
    with pytest.raises(DataError, match="no usable"):
        read_all(tmp_path)
    bad = tmp_path / "data.csv"
    bad.write_text("a,b")
    with pytest.raises(DataError, match="unsupported file type"):
        read_all(bad)


def test_empty_file_is_a_counted_skip(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "empty.txt").write_text("")
    (tmp_path / "d" / "full.txt").write_text("some words")
    docs, report = read_all(tmp_path / "d")
    assert len(docs) == 1 and report.skipped["empty file"] == 1


def test_default_corpus_has_distinct_domains_and_is_deterministic():
    a = [(d.name, d.domain, len(d.text)) for d in iter_default_corpus(0.05, ReadReport())]
    b = [(d.name, d.domain, len(d.text)) for d in iter_default_corpus(0.05, ReadReport())]
    assert a == b
    assert len({domain for _, domain, _ in a}) >= 4
    assert {domain for _, domain, _ in a} <= set(DOMAINS)


def test_the_default_corpus_is_the_shipped_file_not_this_installation(monkeypatch, tmp_path):
    """Another installation (no packages, another standard library) reads the same documents: the shipped ones."""
    full = [(d.name, d.text) for d in iter_default_corpus(2.0, ReadReport())]
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: iter(()))
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path), "include": str(tmp_path)})
    assert [(d.name, d.text) for d in iter_default_corpus(2.0, ReadReport())] == full
    # each domain is a prefix of the shipped order, cut where the cap is first reached
    capped = list(iter_default_corpus(0.1, ReadReport()))
    for domain in DOMAINS:
        sizes = [len(t.encode()) for n, t in full if n.startswith(domain + ":")]
        kept = sum(d.domain == domain for d in capped)
        assert sum(sizes[: kept - 1]) < 0.1e6 and (kept == len(sizes) or sum(sizes[:kept]) >= 0.1e6)


def test_a_modified_embedded_corpus_or_a_larger_cap_is_refused(monkeypatch, tmp_path):
    with pytest.raises(DataError, match="ships 2.0 MB per domain at most"):
        next(iter_default_corpus(4.0, ReadReport()))
    copy = tmp_path / "default_corpus.jsonl.xz"
    copy.write_bytes(default_corpus.EMBEDDED.read_bytes()[:-10])
    monkeypatch.setattr(default_corpus, "EMBEDDED", copy)
    with pytest.raises(DataError, match="not the pinned embedded corpus"):
        next(iter_default_corpus(0.05, ReadReport()))
    monkeypatch.setattr(default_corpus, "EMBEDDED", tmp_path / "absent.xz")
    with pytest.raises(DataError, match="missing"):
        next(iter_default_corpus(0.05, ReadReport()))


def test_the_corpus_builder_reads_only_moe_lms_dependency_tree():
    from moe_lm.data.build_default_corpus import dependency_tree

    names = {d.metadata["Name"].lower().replace("_", "-") for d in dependency_tree()}
    assert {"torch", "deepspeed", "sentencepiece", "transformers", "matplotlib"} <= names  # core and extras
    assert not names & {"moe-lm", "pytest", "ruff"}  # not itself, not the dev tools


def test_split_is_stable_by_name():
    names = [f"doc-{i}" for i in range(2000)]
    val = [n for n in names if is_validation(n, 0.1)]
    assert 150 < len(val) < 250
    assert val == [n for n in names if is_validation(n, 0.1)]


@pytest.fixture
def prepared(tmp_path):
    corpus = write_folder_corpus(tmp_path / "corpus")
    cfg = DataConfig(sources=[str(corpus)], out_dir=str(tmp_path / "prepared"), val_fraction=0.2)
    return cfg, prepare_data(cfg, vocab_size=300, log=lambda s: None)


def test_prepare_writes_shards_with_document_and_domain_indices(prepared):
    cfg, out = prepared
    meta = json.loads((out / "meta.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    assert meta["domains"] == sorted(WORDS)
    sp = load_data_tokenizer(out)
    assert meta["bos_id"] == sp.bos_id == 1  # sentencepiece's BOS starts every document
    texts = {e["name"]: e for e in manifest["documents"]}
    n_seen = 0
    for split in ("train", "val"):
        shard = load_split(out, split)
        names = shard.doc_names()
        assert shard.doc_offsets[-1] == len(shard.tokens) == meta["tokens"][split]
        for d in range(shard.n_docs):
            doc = shard.document(d)
            assert doc[0] == meta["bos_id"]  # every document starts with BOS
            entry = texts[names[d]]
            assert entry["split"] == split and shard.domains[shard.doc_domain[d]] == entry["domain"]
            # the shard holds exactly the tokens of the source document
            source = (Path(cfg.sources[0]).parent / names[d]).read_text()  # a name is a path from there
            assert sp.decode(doc[1:].tolist()) == source
            n_seen += 1
    assert n_seen == len(manifest["documents"]) == 36
    # every domain has validation documents, and the split is the stable one by name
    val = load_split(out, "val")
    assert {val.domains[i] for i in val.doc_domain} == set(WORDS)


def test_a_moved_corpus_keeps_its_names_split_and_fingerprint(prepared, tmp_path, monkeypatch):
    """The same corpus in another folder (another user's checkout, another node's mount), given by an absolute or
    a relative path, prepares to the same document names, split, shards and data fingerprint: a document's name is
    its path from the folder holding the source, not where that folder lives."""
    cfg, out = prepared
    moved = shutil.copytree(cfg.sources[0], tmp_path / "elsewhere" / "deeper" / "corpus")
    monkeypatch.chdir(tmp_path / "elsewhere")
    again = prepare_data(DataConfig(sources=["deeper/corpus"], out_dir="prepared", val_fraction=0.2), 300, log=print)
    documents = [json.loads((d / "manifest.json").read_text())["documents"] for d in (out, again)]
    assert documents[0] == documents[1]
    assert {d["name"] for d in documents[0]} >= {f"corpus/{domain}/doc0.txt" for domain in WORDS}
    assert data_fingerprint(again) == data_fingerprint(out)
    assert moved.is_dir() and Path(cfg.sources[0]).is_dir()  # both corpora untouched


def test_two_sources_of_one_folder_name_keep_every_document(tmp_path):
    """Sources whose folders share a name give their files one name (as the default corpus has two packages'
    numpy/LICENSE.txt): every document is kept, and the two, being one name, fall on one side of the split."""
    for side, text in (("a", "one text here"), ("b", "another text")):
        for i in range(6):  # enough documents for both splits
            (tmp_path / side / "corpus" / "law").mkdir(parents=True, exist_ok=True)
            (tmp_path / side / "corpus" / "law" / f"x{i}.txt").write_text(f"{text} {i}")
    cfg = DataConfig(sources=[str(tmp_path / s / "corpus") for s in "ab"], out_dir=str(tmp_path / "prepared"))
    out = prepare_data(cfg, vocab_size=300, log=lambda s: None)
    documents = json.loads((out / "manifest.json").read_text())["documents"]
    assert sorted(d["name"] for d in documents) == sorted(2 * [f"corpus/law/x{i}.txt" for i in range(6)])
    split_of = {}
    for d in documents:  # each name on one side, in the manifest as in the shards
        assert split_of.setdefault(d["name"], d["split"]) == d["split"], d["name"]
    shards = {s: load_split(out, s) for s in ("train", "val")}
    assert sorted(n for s, shard in shards.items() for n in shard.doc_names() if split_of[n] == s) == sorted(
        d["name"] for d in documents
    )


def test_prepare_skips_when_done_and_refuses_silent_overwrite(prepared):
    cfg, out = prepared
    stamp = (out / "meta.json").stat().st_mtime_ns
    logs = []
    prepare_data(cfg, vocab_size=300, log=logs.append)
    assert "up to date" in logs[0] and (out / "meta.json").stat().st_mtime_ns == stamp
    with pytest.raises(DataError, match="other settings.*vocab_size"):
        prepare_data(cfg, vocab_size=320, log=lambda s: None)
    prepare_data(cfg, vocab_size=320, force=True, log=lambda s: None)
    assert json.loads((out / "meta.json").read_text())["vocab_size"] == 320


def test_prepare_is_deterministic(tmp_path, prepared):
    cfg, out = prepared
    cfg2 = DataConfig(sources=cfg.sources, out_dir=str(tmp_path / "again"), val_fraction=0.2)
    out2 = prepare_data(cfg2, vocab_size=300, log=lambda s: None)
    for split in ("train", "val"):
        assert np.array_equal(load_split(out, split).tokens, load_split(out2, split).tokens)
    sp1, sp2 = load_data_tokenizer(out), load_data_tokenizer(out2)
    assert [sp1.id_to_piece(i) for i in range(300)] == [sp2.id_to_piece(i) for i in range(300)]


def test_vocab_too_large_for_the_data_is_a_clear_error(tmp_path):
    corpus = write_folder_corpus(tmp_path / "corpus", n_docs=2)
    cfg = DataConfig(sources=[str(corpus)], out_dir=str(tmp_path / "p"))
    with pytest.raises(DataError, match=r"model.vocab_size=50000 is larger than this corpus supports"):
        prepare_data(cfg, vocab_size=50000, log=lambda s: None)
    assert not (tmp_path / "p").exists()  # nothing half-written where the data would be


def test_missing_prepared_data_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="moe-lm prepare"):
        load_split(tmp_path, "train")


def test_train_windows_are_a_pure_function_of_the_sample_index(prepared):
    cfg, out = prepared
    shard = load_split(out, "train")
    w = TrainWindows(shard, seq_len=16, seed=3)
    a = w.batch(5, 4)
    assert a.shape == (4, 17)
    assert np.array_equal(a.numpy(), TrainWindows(shard, 16, seed=3).batch(5, 4).numpy())
    # one epoch visits every window exactly once
    every = sorted(tuple(shard.tokens[j * 16 : j * 16 + 17]) for j in range(w.n_windows))
    assert sorted(tuple(w.sample(i)) for i in range(w.n_windows)) == every


def test_eval_windows_stay_inside_their_domain(prepared):
    cfg, out = prepared
    val = load_split(out, "val")
    sets = eval_windows(val, seq_len=16, per_domain=3)
    for domain, windows in sets.items():
        stream = np.concatenate([val.document(d) for d in val.domain_docs(domain)])
        assert np.array_equal(windows[0].numpy(), stream[:17])


@pytest.mark.parametrize("workers", [2, 3])
def test_tokenizing_in_several_processes_writes_the_same_bytes(tmp_path, prepared, workers):
    cfg, out = prepared
    cfg2 = DataConfig(sources=cfg.sources, out_dir=str(tmp_path / "parallel"), val_fraction=0.2)
    out2 = prepare_data(cfg2, vocab_size=300, log=lambda s: None, workers=workers)
    for split in ("train", "val"):
        for name in ("tokens.bin", "doc_offsets.npy", "doc_domain.npy", "doc_names.json", "shard.json"):
            assert (out / split / name).read_bytes() == (out2 / split / name).read_bytes(), (split, name)
    meta, meta2 = (json.loads((d / "meta.json").read_text()) for d in (out, out2))
    assert meta["tokens"] == meta2["tokens"]
    assert sorted(p.name for p in out2.iterdir()) == sorted(p.name for p in out.iterdir())  # no part folders left
