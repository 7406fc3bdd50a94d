"""Data preparation under faults: it never deletes what it did not create, and damaged inputs are named errors."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import xxhash

from moe_lm.config import DataConfig
from moe_lm.data import prepare
from moe_lm.data.batches import eval_windows
from moe_lm.data.documents import ReadReport
from moe_lm.data.prepare import load_split, prepare_data
from moe_lm.data.sources import iter_source
from moe_lm.errors import DataError, UserError
from moe_lm.output_folder import MARKER
from tests.helpers.runs import VOCAB, tiny_train_cfg, write_folder_corpus


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


def test_a_failed_build_leaves_no_partial_copy_and_leaves_a_users_look_alike_alone(cli, tmp_path):
    corpus = write_folder_corpus(tmp_path / "corpus", n_docs=4)
    out = tmp_path / "out"
    proc = prepare_cli(cli, tmp_path, f"data.sources=[{corpus}]", f"data.out_dir={out}", "model.vocab_size=60000")
    assert proc.returncode != 0 and "vocab" in proc.stderr.lower()
    assert not list(tmp_path.glob(".out.partial-*")) and not out.exists()
    look_alikes = ("out.partial", f".out.partial-{socket.gethostname()}-1")  # a user's: no marker in them
    for name in look_alikes:
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine.txt").write_text("a user's folder that happens to have this name")
    assert prepare_cli(cli, tmp_path, f"data.sources=[{corpus}]", f"data.out_dir={out}").returncode == 0
    assert all((tmp_path / name / "mine.txt").is_file() for name in look_alikes)


def test_force_replaces_only_our_own_outputs(tmp_path):
    corpus = write_folder_corpus(tmp_path / "corpus", n_docs=4)
    cfg = DataConfig(sources=[str(corpus)], out_dir=str(tmp_path / "out"), val_fraction=0.25)
    prepare_data(cfg, vocab_size=300, log=lambda s: None)
    prepare_data(cfg, vocab_size=300, force=True, log=lambda s: None)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        MARKER,
        "manifest.json",
        "meta.json",
        "tokenizer.model",
        "train",
        "val",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "out"]  # the earlier build: ours, deleted


def test_a_second_prepare_into_the_same_folder_is_refused_while_the_first_runs(tmp_path, monkeypatch):
    corpus = write_folder_corpus(tmp_path / "corpus", n_docs=4)
    cfg = DataConfig(sources=[str(corpus)], out_dir=str(tmp_path / "out"), val_fraction=0.25)
    build, second = prepare._build, []

    def build_while_another_starts(*a, **k):
        build(*a, **k)
        with pytest.raises(UserError, match=r"being written by another moe-lm process \(pid \d+") as refused:
            prepare_data(cfg, vocab_size=300, force=True, log=lambda s: None)
        second.append(str(refused.value))

    monkeypatch.setattr(prepare, "_build", build_while_another_starts)
    prepare_data(cfg, vocab_size=300, log=lambda s: None)
    assert second and load_split(cfg.out_dir, "train").n_docs > 0  # the first one finished intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "out"]


@pytest.mark.parametrize("fault", ["full disk", "ctrl-c"])
def test_a_full_disk_or_ctrl_c_during_prepare_is_one_line_and_leaves_nothing(cli, tmp_path, monkeypatch, fault):
    corpus = write_folder_corpus(tmp_path / "corpus", n_docs=4)
    tokenize = prepare.tokenize_to_shards

    def fails_part_way(docs_file, split_of, domains, tok_dir, out_dir, workers):
        tokenize(docs_file, split_of, domains, tok_dir, out_dir, workers)
        if fault == "ctrl-c":
            raise KeyboardInterrupt
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(out_dir) / "meta.json"))

    monkeypatch.setattr(prepare, "tokenize_to_shards", fails_part_way)
    proc = prepare_cli(cli, tmp_path, f"data.sources=[{corpus}]", f"data.out_dir={tmp_path / 'out'}")
    lines = [line for line in proc.stderr.splitlines() if line.startswith(("error", "interrupted"))]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-2000:]
    if fault == "ctrl-c":
        assert proc.returncode == 130 and lines[0] == "interrupted (Ctrl-C)"
    else:
        assert proc.returncode == 2 and f"data.out_dir={tmp_path / 'out'}: the disk filled up" in lines[0]
        assert "needed" in lines[0] and "nothing was left behind" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


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
        # fields of the wrong type: each one line naming the field, never a TypeError from deep inside
        (lambda d: edit_meta(d, domains=7), "'domains' is a int, not a list"),
        (lambda d: edit_meta(d, domains=[1, 2]), "'domains' is not a list of names"),
        (lambda d: edit_meta(d, vocab_size="300"), "'vocab_size' is a str, not a int"),
        (lambda d: edit_meta(d, tokens={"train": "many"}), "'tokens' does not count"),
        (lambda d: edit_meta(d, tokens_xxh3_128=[1]), "'tokens_xxh3_128' is not a mapping"),
        (lambda d: edit_meta(d, signature=None), "'signature' is a NoneType"),
        (lambda d: (d / "meta.json").write_text("[1, 2]"), "a JSON list, not an object"),
    ],
)
def test_damaged_shards_and_meta_are_named_errors(prepared_copy, damage, match):
    damage(prepared_copy)
    with pytest.raises(DataError, match=match) as err:
        load_split(prepared_copy, "train")
    assert str(prepared_copy) in str(err.value) and "--force" in str(err.value)


def edit_meta(folder: Path, **fields) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, **fields}))


def test_line_separators_inside_a_jsonl_string_keep_every_document_and_its_name(tmp_path):
    """Raw U+2028, U+2029 and U+0085 are valid inside a JSON string; only \\n ends a JSON Lines record."""
    docs = [{"text": f"document {i}" + ("\u2028 next\u2029 para\u0085 nel" if i % 10 == 3 else ""), "domain": "d"}
            for i in range(60)]  # fmt: skip
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    report = ReadReport()
    read = list(iter_source(str(path), report, "text", "domain"))
    assert [d.text for d in read] == [d["text"] for d in docs] and not report.skipped
    assert [d.name for d in read] == [f"corpus.jsonl:{i + 1}" for i in range(60)]  # names decide the split


def test_a_lone_surrogate_is_repaired_and_counted_and_the_tokenizer_trains(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    lines = ['{"text": "smile \\ud83d at line ' + str(i) + " words" * 30 + '", "domain": "d"}' for i in range(8)]
    corpus.write_text("\n".join(lines) + "\n")  # the escape written as JSON writes it: \ud83d without its pair
    assert "\\ud83d" in corpus.read_text()
    cfg = DataConfig(sources=[str(corpus)], out_dir=str(tmp_path / "out"), val_fraction=0.25)
    said = []
    prepare_data(cfg, vocab_size=300, log=said.append)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["repaired_documents"] == 8 and any("lone surrogates, replaced by U+FFFD" in s for s in said)


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


def copy_prepared(tiny_data, tmp_path) -> Path:
    """A copy of the shared tiny prepared folder, to damage (the shared one stays as it was)."""
    copy = tmp_path / "prepared"
    shutil.copytree(tiny_data.out_dir, copy)
    return copy


def set_token(folder: Path, split: str, value: int) -> int:
    """Overwrite the last token of a split's tokens.bin in place (the file keeps its size); returns the old id."""
    tokens = np.memmap(folder / split / "tokens.bin", mode="r+", dtype=json.loads((folder / split / "shard.json")
                       .read_text())["dtype"])  # fmt: skip
    old = int(tokens[-1])
    tokens[-1] = value
    tokens.flush()
    del tokens
    return old


def test_a_token_id_beyond_the_vocabulary_stops_training_at_start_naming_the_shard(tiny_data, tmp_path, train):
    """A DataError is the command's one line `error: ...` (exit code 2), not the embedding's IndexError mid-run.
    why `train` and not the command in this process: a start that fails after joining the process group leaves
    the group to the next training in this process, whose environment the command's runner puts back."""
    data = copy_prepared(tiny_data, tmp_path)
    set_token(data, "train", VOCAB + 7)  # the file keeps its size: only the id is wrong
    with pytest.raises(DataError) as err:
        train(tiny_train_cfg(dataclasses.replace(tiny_data, out_dir=str(data)), tmp_path / "run"))
    message = str(err.value)
    assert message.startswith(f"token shard {data / 'train'} is damaged (tokens.bin holds token id {VOCAB + 7}")
    assert f"vocabulary of {VOCAB}" in message and "--force" in message and "\n" not in message
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_changed_token_inside_the_vocabulary_fails_the_recorded_hash(tiny_data, tmp_path):
    data = copy_prepared(tiny_data, tmp_path)
    meta = json.loads((data / "meta.json").read_text())
    for split in ("train", "val"):  # preparation recorded each split's tokens.bin hash
        assert meta["tokens_xxh3_128"][split] == xxhash.xxh3_128((data / split / "tokens.bin").read_bytes()).hexdigest()
    load_split(data, "val")
    old = set_token(data, "val", 0)
    assert old != 0  # a valid id, another one than was written
    with pytest.raises(DataError, match=r"tokens.bin is not the file preparation wrote: its xxh3_128 hash") as err:
        load_split(data, "val")
    assert str(data / "val") in str(err.value) and "--force" in str(err.value)


def test_a_folder_prepared_before_the_hashes_loads_and_its_ids_are_still_checked(tiny_data, tmp_path):
    data = copy_prepared(tiny_data, tmp_path)
    meta = json.loads((data / "meta.json").read_text())
    meta.pop("tokens_xxh3_128", None)  # as a folder prepared before the hashes
    (data / "meta.json").write_text(json.dumps(meta))
    set_token(data, "train", 1)  # inside the vocabulary: nothing to compare it with
    assert load_split(data, "train").n_docs > 0
    set_token(data, "train", VOCAB)
    with pytest.raises(DataError, match=f"tokens.bin holds token id {VOCAB}, beyond the vocabulary of {VOCAB}"):
        load_split(data, "train")
