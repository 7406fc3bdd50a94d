"""Corpora in Hugging Face `datasets` formats, streamed as documents like any other source.

    corpus/part-0.parquet, corpus/*.parquet, corpus/      parquet files, a glob of them, or a folder of them
    shard.arrow                                           an Arrow file as `datasets` writes it
    saved/                                                a folder written by Dataset(Dict).save_to_disk
    hf:NAME, hf:NAME:CONFIG, hf:NAME@SPLIT, hf:NAME:CONFIG@SPLIT   `datasets.load_dataset(..., streaming=True)`

Rows are read in batches (parquet row groups, memory-mapped Arrow, or the hub's stream), so a corpus larger than
memory, or for hf: than the disk, is fine. The text is the `text_field` column; the domain is the `domain_field`
column where the source has one, else the source's name. A source without the text column, or without rows, is an
error naming it; a row whose text is not a non-empty string is a counted skip. Documents are named `<file>:<row>`,
the file's path from the folder holding the source (as documents.source_name: independent of where the corpus
lives), or `hf:NAME[:CONFIG]@SPLIT:<row>` (the split always written, so `hf:x` and `hf:x@train` agree).
"""

from __future__ import annotations

import glob
import itertools
from collections.abc import Iterator
from pathlib import Path

from moe_lm.data.documents import Document, ReadReport, source_name
from moe_lm.errors import DataError, require

BATCH = 1024
DATASET_SUFFIXES = (".parquet", ".arrow")
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def is_dataset_source(source: str) -> bool:
    """Whether `source` is one of this module's kinds (else a .txt/.jsonl file or folder)."""
    if source.startswith("hf:"):
        return True
    if glob.has_magic(source):
        return bool(_data_files(source))
    path = Path(source)
    if path.is_file():
        return path.suffix in DATASET_SUFFIXES
    return path.is_dir() and (_is_saved(path) or bool(_data_files(source)))


def dataset_files(source: str) -> list[Path]:
    """The local files a source reads, resolved (for the change fingerprint); none for hf: sources."""
    if source.startswith("hf:"):
        return []
    path = Path(source)
    if not glob.has_magic(source) and path.is_dir() and _is_saved(path):
        # why every file: the Arrow shards and the state/info json files together make the saved dataset
        return sorted(p.resolve() for p in path.rglob("*") if p.is_file())
    return [Path(f).resolve() for f in _data_files(source)]


def iter_dataset(source: str, report: ReadReport, text_field: str, domain_field: str) -> Iterator[Document]:
    """Documents of one datasets-format source."""
    if source.startswith("hf:"):
        name, config, split = parse_hf(source)
        where = hf_source_name(name, config, split)
        domain = name.rstrip("/").split("/")[-1]  # "allenai/c4" -> "c4"
        batches = _hub_batches(where, name, config, split)
        yield from _rows(batches, where, where, domain, report, text_field, domain_field)
        return
    path = Path(source)
    if not glob.has_magic(source) and path.is_dir() and _is_saved(path):
        yield from _rows(
            _saved_batches(path), source, source_name(path, path), path.name, report, text_field, domain_field
        )
        return
    files = _data_files(source)
    if not files:
        raise DataError(f"data source {source}: no .parquet or .arrow files match; check the path or the glob")
    # a glob's names start at its last folder without a wildcard, as a folder source's start at that folder
    root = (
        Path(*itertools.takewhile(lambda part: not glob.has_magic(part), path.parts))
        if glob.has_magic(source)
        else path
    )
    for f in files:
        # without a domain column: a file's own name, or its folder's for a folder or glob of parts
        domain = Path(f).stem if path.is_file() else Path(f).parent.name
        yield from _rows(
            _file_batches(Path(f)), f, source_name(Path(f), root), domain, report, text_field, domain_field
        )


def parse_hf(source: str) -> tuple[str, str | None, str]:
    """hf:NAME[:CONFIG][@SPLIT] -> (NAME, CONFIG or None, SPLIT, default "train")."""
    spec, _, split = source.removeprefix("hf:").partition("@")
    name, _, config = spec.partition(":")
    if not name:
        raise DataError(f"data source {source}: expected hf:NAME[:CONFIG][@SPLIT], e.g. hf:allenai/c4:en@train")
    return name, config or None, split or "train"


def hf_source_name(name: str, config: str | None, split: str) -> str:
    """The canonical spelling hf:NAME[:CONFIG]@SPLIT, the prefix of its documents' names."""
    return f"hf:{name}{':' + config if config else ''}@{split}"


def _is_saved(folder: Path) -> bool:
    """Whether a folder was written by Dataset.save_to_disk or DatasetDict.save_to_disk."""
    return any((folder / m).is_file() for m in SAVED_MARKERS)


def _data_files(source: str) -> list[str]:
    """The .parquet/.arrow files a file, glob or folder names, sorted (a folder: its own files, not sub-folders')."""
    if glob.has_magic(source):
        found = glob.glob(source)
    else:
        path = Path(source)
        found = [str(p) for p in path.iterdir()] if path.is_dir() else [source] if path.is_file() else []
    return sorted(f for f in found if Path(f).suffix in DATASET_SUFFIXES and Path(f).is_file())


def _rows(batches, where: str, name: str, default_domain: str, report: ReadReport, text_field: str, domain_field: str):
    """Documents `name:<row>` from (column names, batch of columns) pairs; checks the text column, counts bad rows
    (errors and skips say `where`, for the user to find)."""
    n = 0
    for columns, batch in batches:
        if columns and text_field not in columns:  # why `columns and`: an empty stream may not know its columns
            raise DataError(
                f"data source {where} has no column {text_field!r} (its columns: {', '.join(columns)}); "
                "set data.text_field to the column that holds the text"
            )
        texts, domains = batch.get(text_field, []), batch.get(domain_field)
        for i, text in enumerate(texts):
            row = n + i
            if not isinstance(text, str):
                report.skip(f"row whose {text_field!r} is not a string", f"{where}:{row}")
            elif not text.strip():
                report.skip("empty text", f"{where}:{row}")
            else:
                labelled = domains is not None and domains[i] is not None
                report.labelled += labelled
                domain = str(domains[i]) if labelled else default_domain
                yield Document(f"{name}:{row}", domain, text)
        n += len(texts)
    if n == 0:
        raise DataError(f"data source {where} has no rows (an empty file or split); remove it from data.sources")


def _file_batches(path: Path):
    """Batches of one .parquet file (by row groups) or one .arrow file (memory-mapped)."""
    if path.suffix == ".parquet":
        pq = require("pyarrow.parquet", "datasets", f"data source {path}")
        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a file it cannot read
            raise DataError(f"{path}: not a readable parquet file ({e}); replace or remove it") from None
        names = pf.schema_arrow.names
        for batch in pf.iter_batches(batch_size=BATCH):
            yield names, batch.to_pydict()
        return
    datasets = require("datasets", "datasets", f"data source {path}")
    try:
        ds = datasets.Dataset.from_file(str(path))
    except Exception as e:  # the same for Arrow files
        raise DataError(f"{path}: not an Arrow file as datasets writes them ({e}); replace or remove it") from None
    yield from _dataset_batches(ds)


def _saved_batches(folder: Path):
    """Batches of a save_to_disk folder: the Dataset, or a DatasetDict's train split (or its only split)."""
    datasets = require("datasets", "datasets", f"data source {folder}")
    try:
        loaded = datasets.load_from_disk(str(folder))
    except Exception as e:  # datasets raises several types (and fails on an empty saved table)
        raise DataError(f"{folder}: datasets cannot load this save_to_disk folder ({type(e).__name__}: {e})") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if "train" not in loaded and len(splits) != 1:
            raise DataError(f"{folder} holds splits {splits}, none named 'train'; give one split's folder instead")
        loaded = loaded["train" if "train" in loaded else splits[0]]
    yield from _dataset_batches(loaded)


def _hub_batches(where: str, name: str, config: str | None, split: str):
    """Batches of datasets.load_dataset(NAME, CONFIG, split=SPLIT, streaming=True): nothing is downloaded whole."""
    datasets = require("datasets", "datasets", f"data source {where}")
    try:
        stream = datasets.load_dataset(name, config, split=split, streaming=True)
    except StopIteration:  # why: datasets peeks at the first row to infer columns, and an empty split has none
        raise DataError(f"data source {where} has no rows (an empty split); remove it from data.sources") from None
    except Exception as e:  # unknown name, config or split, no network, gated dataset, ...: many types
        raise DataError(
            f"data source {where}: datasets.load_dataset could not open it ({type(e).__name__}: {e}); "
            "check NAME, CONFIG and SPLIT in hf:NAME[:CONFIG][@SPLIT], the network, and HF_TOKEN for gated data"
        ) from e
    try:
        yield from _dataset_batches(stream)
    except Exception as e:  # a broken shard or a dropped connection mid-stream: say which source
        raise DataError(
            f"data source {where}: reading the stream failed ({type(e).__name__}: {e}); "
            "check the dataset's files and the network, then prepare again"
        ) from e


def _dataset_batches(ds):
    """(column names, batch) pairs of a Dataset or IterableDataset; an empty one yields one empty batch."""
    names = list(ds.column_names or (ds.features or {}))
    if hasattr(ds, "__len__") and len(ds) == 0:  # why: datasets' iter() fails on an empty table
        yield names, {name: [] for name in names}
        return
    empty = True
    for batch in ds.iter(batch_size=BATCH):
        empty = False
        yield list(batch), batch
    if empty:
        yield names, {name: [] for name in names}
