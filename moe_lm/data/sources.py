"""A data source's reader, picked from how the source is written: datasets formats (parquet, arrow, save_to_disk
folders, hf:NAME; dataset_sources.py) or text files and folders (.txt/.jsonl; documents.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from moe_lm.data.dataset_sources import dataset_files, is_dataset_source, iter_dataset
from moe_lm.data.documents import Document, ReadReport, counted, iter_text_source, text_files
from moe_lm.errors import DataError


def iter_source(
    source: str | Path, report: ReadReport, text_field: str = "text", domain_field: str = "domain"
) -> Iterator[Document]:
    """Documents of one user source: a file, a folder of files (one domain), a folder of domain folders, or a
    datasets-format source; each counted in `report.documents` by domain."""
    if is_dataset_source(str(source)):
        yield from counted(iter_dataset(str(source), report, text_field, domain_field), report)
        return
    path = Path(source)
    if not path.exists():
        raise DataError(
            f"data source not found: {path} (give .txt/.jsonl/.parquet/.arrow files or folders, hf:NAME, or 'default')"
        )
    yield from iter_text_source(path, report, text_field, domain_field)


def source_files(source: str | Path) -> list[Path]:
    """The local files a source reads, resolved, for the change fingerprint ([] for hf: sources: nothing to stat)."""
    return dataset_files(str(source)) if is_dataset_source(str(source)) else text_files(Path(source))
