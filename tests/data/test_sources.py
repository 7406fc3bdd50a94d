"""Dataset sources: parquet, Arrow, save_to_disk folders and hf:NAME, read as documents like any other source."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moe_lm.config import DataConfig
from moe_lm.data.dataset_sources import parse_hf
from moe_lm.data.documents import DataError, ReadReport, iter_source
from moe_lm.data.prepare import load_split, prepare_data
from moe_lm.data.tokenizer import load_data_tokenizer
from tests.conftest import WORDS, make_text

ROWS = [{"text": make_text(domain, i), "domain": domain} for domain in WORDS for i in range(5)]


def read(source, **fields):
    report = ReadReport()
    return list(iter_source(str(source), report, **fields)), report


def write_parquet(path, rows, schema=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=4)
    return path


def test_a_parquet_file_gives_its_rows_with_their_domains(tmp_path):
    path = write_parquet(tmp_path / "c.parquet", ROWS)
    docs, report = read(path)
    assert [(d.text, d.domain) for d in docs] == [(r["text"], r["domain"]) for r in ROWS]
    assert [d.name for d in docs] == [f"{path}:{i}" for i in range(len(ROWS))]
    assert report.documents == {d: 5 for d in WORDS}


def test_folders_globs_and_custom_fields(tmp_path):
    rows = [{"body": r["text"], "topic": r["domain"]} for r in ROWS]
    for i in range(3):
        write_parquet(tmp_path / "corpus" / f"part-{i}.parquet", rows[i * 5 : (i + 1) * 5])
    for source in (tmp_path / "corpus", f"{tmp_path}/corpus/part-*.parquet"):
        docs, _ = read(source, text_field="body", domain_field="topic")
        assert [d.text for d in docs] == [r["body"] for r in rows]
        assert [d.domain for d in docs] == [r["topic"] for r in rows]
    docs, _ = read(tmp_path / "corpus", text_field="body", domain_field="missing")
    assert {d.domain for d in docs} == {"corpus"}  # no domain column: the source's name


def test_save_to_disk_folders_and_arrow_files(tmp_path):
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(tmp_path / "saved")
    datasets.DatasetDict({"train": ds.select(range(7)), "test": ds.select(range(7, 9))}).save_to_disk(tmp_path / "dd")
    assert [d.text for d in read(tmp_path / "saved")[0]] == [r["text"] for r in ROWS]
    assert [d.text for d in read(tmp_path / "dd")[0]] == [r["text"] for r in ROWS[:7]]  # the train split
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    assert [d.domain for d in read(arrow)[0]] == [r["domain"] for r in ROWS]


def test_hf_names_go_through_load_dataset_streaming(tmp_path):
    """The hub path is `datasets.load_dataset(NAME, CONFIG, split=SPLIT, streaming=True)`; here NAME is a local
    folder of parquet files, which load_dataset resolves with its parquet builder."""
    write_parquet(tmp_path / "hub" / "train.parquet", ROWS)
    docs, _ = read(f"hf:{tmp_path / 'hub'}@train")
    assert [d.text for d in docs] == [r["text"] for r in ROWS]
    assert docs[0].name == f"hf:{tmp_path / 'hub'}@train:0"
    assert parse_hf("hf:allenai/c4:en@validation") == ("allenai/c4", "en", "validation")
    assert parse_hf("hf:wikitext") == ("wikitext", None, "train")


def test_bad_rows_are_counted_and_bad_sources_are_named(tmp_path):
    rows = [*ROWS[:3], {"text": None, "domain": "x"}, {"text": "   ", "domain": "x"}]
    docs, report = read(write_parquet(tmp_path / "a.parquet", rows))
    assert len(docs) == 3 and sum(report.skipped.values()) == 2
    assert any(f"{tmp_path / 'a.parquet'}:3" in ex for ex in sum(report.examples.values(), []))
    write_parquet(tmp_path / "b.parquet", [{"content": "hello"}])
    with pytest.raises(DataError, match=r"b.parquet has no column 'text' \(its columns: content\)"):
        read(tmp_path / "b.parquet")
    write_parquet(tmp_path / "c.parquet", [], schema=pa.schema([("text", pa.string())]))
    with pytest.raises(DataError, match="c.parquet has no rows"):
        read(tmp_path / "c.parquet")
    (tmp_path / "d.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="d.parquet: not a readable parquet file"):
        read(tmp_path / "d.parquet")
    datasets.Dataset.from_dict(
        {"text": []}, features=datasets.Features({"text": datasets.Value("string")})
    ).save_to_disk(tmp_path / "empty")
    with pytest.raises(DataError, match="empty"):  # named, whether or not datasets can load it
        read(tmp_path / "empty")


def test_prepare_on_parquet_keeps_the_domain_column(tmp_path):
    src = write_parquet(tmp_path / "corpus.parquet", ROWS)
    cfg = DataConfig(sources=[str(src)], out_dir=str(tmp_path / "data"), val_fraction=0.25)
    out = prepare_data(cfg, vocab_size=300, log=lambda s: None)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["domains"] == sorted(WORDS)
    tok = load_data_tokenizer(out)
    by_name = {f"{src}:{i}": r for i, r in enumerate(ROWS)}
    for split in ("train", "val"):
        shard = load_split(out, split)
        for d, name in enumerate(shard.doc_names()):
            assert shard.domains[shard.doc_domain[d]] == by_name[name]["domain"]
            assert tok.decode(np.asarray(shard.document(d))[1:].tolist()) == by_name[name]["text"]
    assert meta["signature"]["source_files"]  # an edit to the parquet file makes the data stale
