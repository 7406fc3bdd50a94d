"""The work folder of a streamed analysis (moe_lm/analysis/streamed.py): `.<out>.stream/` beside the report, one
folder in it per analysis (`<subject>/<model or init>/<key>`, the key a hash of everything the analysis computes
from), holding the hidden states, a layer's parts, each finished layer's choices and its chosen experts' output
norms, and `progress.json`.

moe-lm's own: a README in each analysis's folder says so, and a path of that name that is not moe-lm's is refused,
never written into (`stream_work`). A command removes the folders of the analyses it ran when it ends, or keeps
them (said) when it fails with finished layers, so that the same command resumes from them; it removes only the
files an analysis writes (a file the user put there stays, said) and never another analysis's folder: an interrupted
analysis survives any other command into the same --out (`kept_for_resume`). The hidden-state files take their
whole size on disk when the analysis starts, so that a disk too small is said then, in one line, and never met by a
memory-mapped write mid-layer, which the kernel answers with SIGBUS (the process dies without a word).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from moe_lm.errors import UserError
from moe_lm.files import disk_full, gib, read_small, size_of, some

PROGRESS = "progress.json"
MARK = "moe-lm streamed analysis: work files, removed when the analysis ends"
MAPPED = ("hidden_0", "hidden_1", "part_h", "part_y", "part_t", "part_e")  # the memory-mapped files, .bin
# what an analysis writes into its folder: the only names it ever removes
OURS = re.compile(r"README|progress\.json(\.partial)?|(hidden_[01]|part_[hyte])\.bin|(experts|weights|norms)_L\d+"
                  r"\.npy(\.partial)?")  # fmt: skip
# why a list kept here: the analyses are opened deep inside a command (a subject's loader), and the command removes
# the folders of its own analyses when it ends, and no other (kept_for_resume empties it as a command starts)
_OPENED: list[Path] = []


def stream_work(out: Path) -> Path:
    """Where a streamed analysis into `out` keeps its work (resumable): beside it, a folder of moe-lm's own (a
    README in it says so); anything else of that name is refused."""
    work = out.parent / f".{out.name}.stream"
    if (work.exists() or work.is_symlink()) and not _ours(work) and not (work.is_dir() and not any(work.iterdir())):
        raise UserError(f"{work} is not moe-lm's (a streamed analysis into {out} keeps its work there); move it away")
    return work


def _ours(work: Path) -> bool:
    return work.is_dir() and not work.is_symlink() and any(read_small(p) == MARK + "\n" for p in work.rglob("README"))


@contextlib.contextmanager
def kept_for_resume(work: Path):
    """The folders of the streamed analyses a command runs, in `work`: removed when the command ends; when it fails,
    those holding finished layers are kept (said), so that the same command resumes from them. A full disk with
    layers kept is one line saying so. Entered before the output folder's staging, so that this has the last word."""
    _OPENED.clear()
    made = not work.exists() or _ours(work)  # else an empty folder of the user's: used, never removed
    failed = None
    try:
        yield
    except BaseException as e:
        failed = e
    opened, _OPENED[:] = list(_OPENED), []
    kept = [f for f in opened if failed is not None and finished_layers(f)]
    _remove([f for f in opened if f not in kept], work, made)
    if failed is None:
        if work.is_dir() and any(work.rglob(PROGRESS)):
            print(f"note: {work} still holds the work of other streamed analyses ({gib(size_of(work))}): the command "
                  "that began each resumes it; delete the folder if none is to be resumed")  # fmt: skip
        return
    if kept and disk_full(failed):  # the output folder's message would say that nothing was left behind
        raise UserError(f"the disk filled up during the streamed analysis ({gib(shutil.disk_usage(work).free)} "
                        f"free there); {_kept(kept)}, nothing else was left behind: free space, then run the same "
                        "command to resume from them")  # fmt: skip
    if kept:
        print(f"note: {_kept(kept)}: the same command resumes from them (delete the folder to start over)",
              file=sys.stderr)  # fmt: skip
    raise failed


def _kept(folders: list[Path]) -> str:
    return "the finished layers of the streamed analysis are kept in " + ", ".join(map(str, folders))


def finished_layers(folder: Path) -> int:
    """The layers the analysis in `folder` finished and noted."""
    return len(_progress(folder).get("done", []))


def _progress(folder: Path) -> dict:
    """`folder`'s progress.json, or {} when it is missing or damaged (cut short by a full disk or a copy): the
    analysis then starts over, never mixing in layers it cannot vouch for."""
    try:
        progress = json.loads(read_small(folder / PROGRESS) or "")
    except ValueError:
        return {}
    return progress if isinstance(progress, dict) and isinstance(progress.get("done"), list) else {}


def remove_ours(folder: Path) -> list[str]:
    """Delete the files an analysis writes in `folder` (by name: OURS) and the folder when that empties it; the
    names of what is left (a user's files, never removed)."""
    if not folder.is_dir() or folder.is_symlink():
        return []
    for p in folder.iterdir():
        if OURS.fullmatch(p.name) and (p.is_symlink() or not p.is_dir()):
            p.unlink()
    left = sorted(p.name for p in folder.iterdir())
    if not left:
        folder.rmdir()
    return left


def _allocated(path: Path, size: int) -> bool:
    """`path` created with `size` bytes on disk (posix_fallocate), or False when the disk is full."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if not disk_full(e):
            raise
        return False
    finally:
        os.close(fd)
    return True


def _remove(folders: list[Path], top: Path, made: bool) -> None:
    """Each analysis's folder removed (its files only), then its parents up to `top` (`top` itself when moe-lm
    `made` it) that this empties; a folder kept for a user's files is said."""
    for folder in folders:
        if left := remove_ours(folder):
            print(f"note: kept {folder}: it holds files moe-lm did not write ({some(left)})", file=sys.stderr)
            continue
        for parent in folder.parents:
            if (parent == top and not made) or (parent != top and top not in parent.parents):
                break
            with contextlib.suppress(OSError):  # not empty: another analysis's work, or a user's file
                parent.rmdir()


class WorkFolder:
    """One analysis's files (in `base / key`): the hidden states (two files taking turns: `in` is the input of the
    layer being run, `out` its output), the parts a chunked layer keeps between its units, each MoE layer's choices
    and its chosen experts' output norms, and `progress.json` (which layers are finished and which hidden file holds
    their output)."""

    def __init__(self, base: Path, key: str, padded, dim: int, dtype: torch.dtype) -> None:
        self.folder, self.key, self.dtype, self.dim = Path(base) / key, key, dtype, dim
        self.shapes = [tuple(t.shape) + (dim,) for t, _ in padded]
        self.lengths = [lengths for _, lengths in padded]
        self.offsets = np.cumsum([0] + [int(np.prod(s)) for s in self.shapes]).tolist()
        self.elem = torch.tensor([], dtype=dtype).element_size()
        self.tokens = sum(s[0] * s[1] for s in self.shapes)
        self.bytes = len(MAPPED) * self.offsets[-1] * self.elem  # the hidden states twice (in, out) and 4 parts
        _OPENED.append(self.folder)
        progress = _progress(self.folder)
        if progress.get("key") != key:  # new, or cut short before its first note: started (over)
            progress = self._start()
        self.progress = progress
        self._tensors: dict[str, torch.Tensor] = {}
        self._inputs: dict[int, list[tuple]] = {}  # batch -> its windows' (experts, weights), in order
        self._choices: dict[tuple[int, int, int], tuple] = {}  # (layer, batch, first window) -> choices
        self._norms: dict[int, torch.Tensor] = {}  # batch -> its chosen experts' output norms, as `norms` says

    def _start(self) -> dict:
        """The folder made (or what an earlier start left in it removed), its README, the work files at their full
        size, and the first note."""
        remove_ours(self.folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        need, free = self.bytes, shutil.disk_usage(self.folder).free
        if need > free:
            remove_ours(self.folder)
            raise UserError(f"{self.folder}: the streamed analysis needs {gib(need)} of disk for its hidden states "
                            f"and {gib(free)} is free there: free space, or analyse fewer tokens "
                            "(--max-tokens)")  # fmt: skip
        (self.folder / "README").write_text(MARK + "\n")
        self._reserve()
        progress = {"key": self.key, "done": [], "turn": 0}
        self._write(progress)
        return progress

    def _reserve(self) -> None:
        """Each memory-mapped file created at its full size on disk, or one line when the disk has not the room
        (another writer took it since the check). Raised outside the except: the output folder would otherwise
        put its own full-disk message in its place."""
        size = max(self.offsets[-1] * self.elem, 1)
        if all(_allocated(self.folder / f"{name}.bin", size) for name in MAPPED):
            return
        remove_ours(self.folder)
        raise UserError(f"{self.folder}: the disk filled up while the streamed analysis reserved its work files "
                        f"({gib(self.bytes)}, {gib(shutil.disk_usage(self.folder.parent).free)} free now): free space, "
                        "or analyse fewer tokens (--max-tokens)")  # fmt: skip

    def _write(self, progress: dict) -> None:
        tmp = self.folder / f"{PROGRESS}.partial"
        tmp.write_text(json.dumps(progress))
        os.replace(tmp, self.folder / PROGRESS)

    def done(self) -> list[int]:
        return list(self.progress["done"])

    def _file(self, name: str) -> torch.Tensor:
        if name not in self._tensors:
            path = self.folder / f"{name}.bin"
            self._tensors[name] = torch.from_file(str(path), shared=True, size=self.offsets[-1], dtype=self.dtype)
        return self._tensors[name]

    def _view(self, name: str, b: int) -> torch.Tensor:
        return self._file(name)[self.offsets[b] : self.offsets[b + 1]].view(self.shapes[b])

    def hidden(self, b: int, which: str) -> torch.Tensor:
        turn = self.progress["turn"] if which == "in" else 1 - self.progress["turn"]
        return self._view(f"hidden_{turn}", b)

    def part(self, b: int, name: str) -> torch.Tensor:
        return self._view(f"part_{name}", b)

    def keep_expert_input(self, b: int, rows: slice, t, idx, w) -> None:
        """The routed experts' input for windows `rows` of batch b, and their choices (kept until the layer ends)."""
        S = self.shapes[b][1]
        self.part(b, "t").view(-1, self.dim)[rows.start * S : rows.stop * S] = t
        self._inputs.setdefault(b, []).append((idx.clone(), w.clone()))

    def expert_input(self, b: int):
        idx, w = (torch.cat(parts) for parts in zip(*self._inputs[b], strict=True))
        return self.part(b, "t").view(-1, self.dim), idx, w

    def norms(self, b: int) -> torch.Tensor:
        """Batch b's output norm of each chosen expert before its weight, [B * S, K] float32 in the gate's own slot
        order (as `expert_input` holds the choices), filled in as the experts run; kept until the layer ends."""
        if b not in self._norms:
            self._norms[b] = torch.zeros(self.shapes[b][0] * self.shapes[b][1], self._inputs[b][0][0].shape[1])
        return self._norms[b]

    def finish_batch(self, b: int, experts: torch.Tensor | None = None) -> None:
        """Batch b's layer output from its parts, as the layer adds them (experts_deferred); the experts' sum given,
        or the one added up chunk by chunk."""
        e = self.part(b, "e") if experts is None else experts
        self.hidden(b, "out")[:] = self.part(b, "h") + (self.part(b, "y") + e)

    def keep_choices(self, layer: int, at: tuple[int, int], idx, w, lengths: list[int]) -> None:
        """The choices (experts by weight, largest first) of the windows of batch at[0] from window at[1] on, without
        their padding rows."""
        S = self.shapes[at[0]][1]
        rows = torch.cat([torch.arange(i * S, i * S + n) for i, n in enumerate(lengths)])
        self._choices[(layer, *at)] = (idx[rows].numpy(), w[rows].numpy())

    def finish(self, layer: int) -> None:
        """Layer `layer` is complete: its choices saved, its output made the next layer's input, noted."""
        keys = sorted(k for k in self._choices if k[0] == layer)  # in window order
        if keys:
            self._save(f"experts_L{layer}.npy", np.concatenate([self._choices[k][0] for k in keys]))
            self._save(f"weights_L{layer}.npy", np.concatenate([self._choices[k][1] for k in keys]))
            self._save(f"norms_L{layer}.npy", np.concatenate([self._ranked_norms(b) for b in sorted(self._norms)]))
            for k in keys:
                del self._choices[k]
        self.progress = {**self.progress, "done": self.progress["done"] + [layer], "turn": 1 - self.progress["turn"]}
        self._write(self.progress)
        self._inputs.clear()
        self._norms.clear()

    def _ranked_norms(self, b: int) -> np.ndarray:
        """Batch b's norms as its choices are kept: largest weight first (recorder.gate_choices), padding left out."""
        _, w = (torch.cat(parts) for parts in zip(*self._inputs[b], strict=True))
        norms = self._norms[b].gather(-1, w.float().argsort(dim=-1, descending=True, stable=True))
        S = self.shapes[b][1]
        return norms[torch.cat([torch.arange(i * S, i * S + n) for i, n in enumerate(self.lengths[b])])].numpy()

    def _save(self, name: str, array: np.ndarray) -> None:
        """`array` saved whole under `name` or not at all (written aside, then renamed): a disk that fills up leaves
        no file cut short under a finished layer's name."""
        tmp = self.folder / f"{name}.partial"
        try:
            with open(tmp, "wb") as f:
                np.save(f, array)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, self.folder / name)

    def routing(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A finished layer's (experts, weights, output norms), each [tokens, K] in the trace's order."""
        return tuple(np.load(self.folder / f"{name}_L{layer}.npy") for name in ("experts", "weights", "norms"))
