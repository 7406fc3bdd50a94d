"""Dataset sources: parquet, Arrow, save_to_disk folders and hf:NAME, read as documents like any other source."""

from __future__ import annotations

import json
import re

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moe_lm.config import ConfigError, DataConfig
from moe_lm.data.dataset_sources import parse_hf
from moe_lm.data.documents import ReadReport
from moe_lm.data.prepare import load_split, prepare_data, sources_fingerprint
from moe_lm.data.sources import iter_source, source_files
from moe_lm.data.tokenizer import load_data_tokenizer
from moe_lm.errors import DataError
from tests.helpers.runs import WORDS, make_text

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
    assert [d.name for d in docs] == [f"c.parquet:{i}" for i in range(len(ROWS))]  # not where the file lives
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
    by_name = {f"corpus.parquet:{i}": r for i, r in enumerate(ROWS)}
    for split in ("train", "val"):
        shard = load_split(out, split)
        for d, name in enumerate(shard.doc_names()):
            assert shard.domains[shard.doc_domain[d]] == by_name[name]["domain"]
            assert tok.decode(np.asarray(shard.document(d))[1:].tolist()) == by_name[name]["text"]
    assert meta["signature"]["source_files"]  # an edit to the parquet file makes the data stale


def test_domains_come_from_the_column_stringified_else_from_the_source(tmp_path):
    rows = [{"text": "alpha beta", "domain": 3}, {"text": "gamma delta", "domain": None}]
    assert [d.domain for d in read(write_parquet(tmp_path / "nums.parquet", rows))[0]] == ["3", "nums"]
    for domain in ("law", "art"):  # a glob over domain folders: each file's folder names its domain
        write_parquet(tmp_path / "by" / domain / "p.parquet", [{"text": f"{domain} text"}])
    docs, report = read(f"{tmp_path}/by/*/*.parquet")
    assert [(d.text, d.domain) for d in docs] == [("art text", "art"), ("law text", "law")]
    assert report.documents == {"art": 1, "law": 1}
    # named from the glob's last folder without a wildcard, as a folder source is from its own folder
    assert [d.name for d in docs] == ["by/art/p.parquet:0", "by/law/p.parquet:0"]


def test_a_dataset_dict_reads_its_only_split_and_refuses_an_ambiguous_one(tmp_path):
    ds = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"validation": ds.select(range(4))}).save_to_disk(tmp_path / "one")
    assert [d.text for d in read(tmp_path / "one")[0]] == [r["text"] for r in ROWS[:4]]
    datasets.DatasetDict({"a": ds, "b": ds}).save_to_disk(tmp_path / "two")
    with pytest.raises(DataError, match=r"splits \['a', 'b'\], none named 'train'; give one split's folder"):
        read(tmp_path / "two")


def test_hf_documents_are_named_canonically_with_the_name_as_domain(tmp_path):
    hub = tmp_path / "org" / "corpus"
    write_parquet(hub / "train.parquet", [{"text": r["text"]} for r in ROWS])
    docs, report = read(f"hf:{hub}")  # no split given: train, written out in the names
    assert [d.name for d in docs] == [f"hf:{hub}@train:{i}" for i in range(len(ROWS))]
    assert [d.text for d in docs] == [r["text"] for r in ROWS]
    assert report.documents == {"corpus": len(ROWS)}  # NAME's last path component


def test_hf_errors_name_the_source(tmp_path):
    (tmp_path / "empty").mkdir()
    pq.ParquetWriter(tmp_path / "empty" / "train.parquet", pa.schema([("text", pa.string())])).close()
    with pytest.raises(DataError, match=re.escape(f"hf:{tmp_path / 'empty'}@train has no rows")):
        read(f"hf:{tmp_path / 'empty'}")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "train.jsonl").write_text("")  # no rows, and so no columns either
    with pytest.raises(DataError, match=re.escape(f"hf:{tmp_path / 'blank'}@train has no rows")):
        read(f"hf:{tmp_path / 'blank'}")
    write_parquet(tmp_path / "hub" / "train.parquet", [{"content": "hello"}])
    with pytest.raises(DataError, match=r"hub@train has no column 'text' \(its columns: content\)"):
        read(f"hf:{tmp_path / 'hub'}")
    with pytest.raises(DataError, match=r"hub@validation: datasets.load_dataset could not open it .*SPLIT"):
        read(f"hf:{tmp_path / 'hub'}@validation")


def test_missing_paths_and_empty_globs_are_named(tmp_path):
    for source in (tmp_path / "gone.parquet", tmp_path / "gone", f"{tmp_path}/gone/*.parquet"):
        with pytest.raises(DataError, match=re.escape(f"data source not found: {source}")):
            read(source)


def test_jsonl_honours_text_and_domain_fields(tmp_path):
    path = tmp_path / "c.jsonl"
    lines = [json.dumps({"body": r["text"], "topic": r["domain"]}) for r in ROWS] + [json.dumps({"body": 3})]
    path.write_text("\n".join(lines) + "\n")
    docs, report = read(path, text_field="body", domain_field="topic")
    assert [(d.text, d.domain) for d in docs] == [(r["text"], r["domain"]) for r in ROWS]
    assert report.skipped == {"jsonl line without a string 'body' field": 1}
    assert report.examples["jsonl line without a string 'body' field"] == [f"{path}:{len(ROWS) + 1}"]
    docs, report = read(path)  # the default fields: no line has a "text" key
    assert docs == [] and report.skipped == {"jsonl line without a string 'text' field": len(ROWS) + 1}


def test_source_files_and_the_fingerprint_follow_what_is_read(tmp_path):
    parts = [write_parquet(tmp_path / "corpus" / f"p{i}.parquet", ROWS[:2]) for i in range(2)]
    (tmp_path / "corpus" / "README.md").write_text("not data")
    expected = [p.resolve() for p in parts]
    assert source_files(tmp_path / "corpus") == expected
    assert source_files(f"{tmp_path}/corpus/*.parquet") == expected
    assert source_files(parts[0]) == expected[:1]
    datasets.Dataset.from_list(ROWS).save_to_disk(tmp_path / "saved")
    saved = source_files(tmp_path / "saved")
    assert {"state.json", "dataset_info.json"} <= {p.name for p in saved} and any(p.suffix == ".arrow" for p in saved)
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("some text")
    assert source_files(tmp_path / "txt") == [(tmp_path / "txt" / "a.txt").resolve()]
    assert source_files("hf:allenai/c4:en@train") == []

    sources = [str(tmp_path / "corpus"), "hf:allenai/c4:en@train"]
    before = sources_fingerprint(sources)
    assert sources_fingerprint(["hf:allenai/c4:en@train"]) is not None  # a hub name alone still counts
    assert sources_fingerprint([sources[0], "hf:allenai/c4:en@validation"]) != before
    write_parquet(parts[0], ROWS[:3])  # an edit to one part
    assert sources_fingerprint(sources) != before


def test_empty_field_names_are_refused():
    for name in ("text_field", "domain_field"):
        with pytest.raises(ConfigError, match=rf"data\.{name} must name a column"):
            DataConfig(**{name: ""}).validate()
