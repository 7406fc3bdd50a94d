"""Where a pruned model is written: a new folder or file beside nothing of the source's, through the project's
OutputFolder (moe_lm/output_folder.py), so that it is written whole under a hidden staging name in the destination's
folder and renamed into place at the end: a failure, a full disk or Ctrl-C leaves nothing that looks complete, and a
full disk is one line naming the path."""

from __future__ import annotations

from pathlib import Path

from moe_lm.errors import UserError
from moe_lm.output_folder import OutputFolder

# why not "prune": that marks a pruned run folder (moe-lm prune, FOLDER_KINDS), which moe-lm reads as a run and
# replaces whole; a pruned transformers folder, FP8 release or GGUF is neither
COMMAND = "prune-copy"


def pruned_output(source: Path, out: Path, file: bool = False) -> OutputFolder:
    """The checked destination of a pruned copy of `source` (`file`: one file, a GGUF). Refused in one line: the
    source itself, a path inside the source, an existing file, a folder that is not empty (nothing is moved aside or
    replaced: a pruned model is always written new)."""
    source, out = Path(source), Path(out)
    if out.resolve() == source.resolve():
        raise UserError(f"--out {out} is the source itself; give a new {'file' if file else 'folder'}")
    if source.resolve() in out.resolve().parents:
        raise UserError(f"--out {out} lies inside the source {source}; give a path outside it")
    if file and (out.exists() or out.is_symlink()):
        raise UserError(f"--out {out} exists; give a new file (nothing was written)")
    if not file and out.is_dir() and not out.is_symlink() and any(out.iterdir()):
        raise UserError(f"--out {out} is a folder that is not empty; give a new or empty folder (nothing was written)")
    return OutputFolder(out, COMMAND, file=file)
