"""`moe-lm analyze --quantise`: the run written once as a transformers export, then as a GGUF file of each type
(moe_lm/interop: what `moe-lm export` runs), each a GGUF subject named by its type, to be run in llama.cpp and
compared with the run on the same token ids. The files live in the report's staging folder and go with it."""

from __future__ import annotations

from pathlib import Path

from moe_lm.analysis.subjects import SEQ_LEN, GGUFSubject, RunSubject, Settings
from moe_lm.analysis.subjects.gguf import LLAMA_DEFAULTS, THREADS


def quantised_subjects(types: list[str], folder: Path, settings: Settings) -> tuple[GGUFSubject, ...]:
    """A GGUF subject for each type, its file in `folder` (not written yet: `write_quantised` writes them), run with
    the command's llama.cpp settings."""
    return tuple(GGUFSubject(str(quantised_file(folder, t)), name=t, threads=settings[THREADS],
                             seq_len=settings[SEQ_LEN], llama_defaults=settings[LLAMA_DEFAULTS])
                 for t in types)  # fmt: skip


def write_quantised(run: RunSubject, subjects: tuple[GGUFSubject, ...], folder: Path) -> None:
    """The run exported once into `folder`/hf, then each subject's file written from it at its type."""
    if not subjects:
        return
    from moe_lm.interop.gguf import write_gguf
    from moe_lm.interop.hf import export_run

    export_run(*run.run, folder / "hf", tokenizer_required=False)
    for subject in subjects:
        write_gguf(folder / "hf", Path(subject.path), subject.name)  # named by its type


def quantised_file(folder: Path, gguf_type: str) -> Path:
    return folder / f"model-{gguf_type}.gguf"
