"""What a command that writes a folder may touch (moe_lm/output_folder.py): it writes the folder whole beside --out
and renames it into place, replaces only its own earlier output, moves anything else aside only with --force, never
writes through a symlink, never writes inside a run or data folder, and a failed, full-disk or interrupted write
leaves nothing that looks complete."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import threading
from pathlib import Path

import pytest

from moe_lm.checkpoint.format import latest_tag
from moe_lm.errors import UserError
from moe_lm.output_folder import MARKER, OutputFolder, enclosing_folder, made_by


def one_line_error(proc, *needles: str, code: int = 2) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


def listing(folder: Path) -> dict:
    """Every entry under `folder` with its content (links as their target), to compare before and after."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        out[rel] = ("link", os.readlink(p)) if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"
    return out


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name)


def test_export_refuses_a_users_folder_and_force_moves_it_aside_never_writing_through_its_links(
    cli, trained_run, tmp_path
):
    victim = tmp_path / "elsewhere" / "precious.json"
    victim.parent.mkdir()
    victim.write_text("the user's file outside --out")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    (out / "model.safetensors").symlink_to(victim)  # an export would write this name
    before = listing(out)

    one_line_error(cli("export", "--run", trained_run(), "--out", out), "--out", "did not write", "--force")
    assert listing(out) == before and victim.read_text() == "the user's file outside --out"

    done = cli("export", "--run", trained_run(), "--out", out, "--force")
    assert done.returncode == 0, done.stderr[-2000:]
    assert victim.read_text() == "the user's file outside --out"
    (aside,) = tmp_path.glob("mine.prev-*")
    assert listing(aside) == before and str(aside) in done.stdout + done.stderr
    assert json.loads((out / MARKER).read_text())["command"] == "export"
    assert not (out / "model.safetensors").is_symlink() and "mine" not in (out / "config.json").read_text()
    assert leftovers(tmp_path) == []


def test_an_earlier_export_is_replaced_and_one_the_user_added_to_is_moved_aside(cli, trained_run, tmp_path):
    out = tmp_path / "export"
    assert cli("export", "--run", trained_run(), "--out", out).returncode == 0
    first = listing(out)
    assert cli("export", "--run", trained_run(), "--out", out).returncode == 0  # its own output: replaced
    assert listing(out).keys() == first.keys() and not list(tmp_path.glob("export.prev-*"))

    (out / "README.md").write_text("my notes on this model")
    (out / "model.safetensors").unlink()
    (out / "model.safetensors").symlink_to(tmp_path / "outside.bin")
    (tmp_path / "outside.bin").write_bytes(b"not ours")
    assert cli("export", "--run", trained_run(), "--out", out).returncode == 0
    (aside,) = tmp_path.glob("export.prev-*")
    assert (aside / "README.md").read_text() == "my notes on this model"
    assert (tmp_path / "outside.bin").read_bytes() == b"not ours"
    assert listing(out).keys() == first.keys() and not (out / "README.md").exists()


def test_export_and_analyze_refuse_a_run_or_data_folder_and_what_lies_inside(cli, trained_run, tiny_data, tmp_path):
    data = Path(tiny_data.out_dir)
    before = listing(data)
    for out in (data, data / "export", trained_run(), trained_run() / "export", trained_run() / "checkpoints"):
        line = one_line_error(cli("export", "--run", trained_run(), "--out", out), "--out", str(out))
        assert "data folder" in line or "run folder" in line, line
    assert listing(data) == before
    one_line_error(cli("analyze", "--run", trained_run(), "--out", trained_run() / "analysis"), "inside the run")


def test_analyze_leaves_a_users_metrics_alone(cli, trained_run, tmp_path):
    out = tmp_path / "analysis"
    out.mkdir()
    (out / "metrics.json").write_text("my metrics")
    (out / "routing.html").write_text("my page")
    one_line_error(cli("analyze", "--run", trained_run(), "--out", out, "--max-tokens", "200"), "did not write")
    assert (out / "metrics.json").read_text() == "my metrics" and (out / "routing.html").read_text() == "my page"


def test_a_symlink_or_the_current_folder_as_out_is_refused(cli, trained_run, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    one_line_error(cli("export", "--run", trained_run(), "--out", tmp_path / "link"), "symlink")
    assert list((tmp_path / "real").iterdir()) == []
    (tmp_path / "real" / "mine.txt").write_text("the user's")
    for out in (".", ".."):  # --force would move the folder we stand in
        proc = cli("export", "--run", trained_run(), "--out", out, "--force", cwd=tmp_path / "real")
        one_line_error(proc, "current folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
    assert [p.name for p in (tmp_path / "real").iterdir()] == ["mine.txt"]


def test_a_full_disk_during_export_leaves_nothing_and_says_what_is_needed(cli, trained_run, tmp_path, monkeypatch):
    import moe_lm.interop.hf_tokenizer as hf_tokenizer

    def half_then_full(src, dst, *a, **k):  # the tokenizer is written after the weights: part-way through
        Path(dst).write_bytes(Path(src).read_bytes()[:100])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))

    monkeypatch.setattr(hf_tokenizer.shutil, "copyfile", half_then_full)
    out = tmp_path / "new" / "deeper" / "export"
    line = one_line_error(cli("export", "--run", trained_run(), "--out", out), str(out), "disk filled up", "needed")
    assert "MiB needed" in line
    assert not (tmp_path / "new").exists()  # nor the parents it made


def test_a_failed_or_interrupted_export_leaves_nothing(cli, trained_run, tmp_path, monkeypatch):
    import moe_lm.interop.hf_tokenizer as hf_tokenizer

    def interrupted(*a, **k):  # Ctrl-C after the weights were written
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_tokenizer, "export_tokenizer", interrupted)
    out = tmp_path / "export"
    proc = cli("export", "--run", trained_run(), "--out", out)
    assert one_line_error(proc, "interrupted", code=130)
    assert list(tmp_path.iterdir()) == []


def locked_partial(tmp_path: Path, pid: int) -> tuple[Path, int]:
    """A staging folder as a live writer holds it: its marker under an flock (this process holds it)."""
    stage = tmp_path / f".export.partial-{socket.gethostname()}-{pid}"
    stage.mkdir()
    (stage / MARKER).write_text('{"command": "export"}')
    fd = os.open(stage / MARKER, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return stage, fd


def test_a_partial_folder_of_a_live_process_is_a_lock_and_a_dead_ones_is_cleared(cli, trained_run, tmp_path):
    out = tmp_path / "export"
    live, fd = locked_partial(tmp_path, os.getppid())
    try:
        one_line_error(cli("export", "--run", trained_run(), "--out", out), "another moe-lm process", str(os.getppid()))
    finally:
        os.close(fd)
    assert live.is_dir() and not out.exists()

    shutil.rmtree(live)
    dead = tmp_path / f".export.partial-{socket.gethostname()}-{os.getppid()}"  # a live pid, but nobody holds it
    dead.mkdir()
    (dead / MARKER).write_text('{"command": "export"}')
    assert cli("export", "--run", trained_run(), "--out", out).returncode == 0
    assert leftovers(tmp_path) == [] and (out / "config.json").is_file()


def test_a_second_writer_never_sweeps_a_live_writers_staging_folder(tmp_path, monkeypatch):
    """The race of two writers: the second one's checks ran before the first one's staging folder existed."""
    out = tmp_path / "report"
    first, second = OutputFolder(out, "analyze"), OutputFolder(out, "analyze")
    with first.staged() as stage:
        (stage / "metrics.json").write_text("the first writer's work")
        monkeypatch.setattr(OutputFolder, "check", lambda self: None)  # its checks are behind it
        with pytest.raises(UserError, match="being written by another moe-lm process"), second.staged():
            pass
        monkeypatch.undo()
        assert (stage / "metrics.json").read_text() == "the first writer's work"
    assert (out / "metrics.json").read_text() == "the first writer's work"


def test_an_edited_earlier_export_is_moved_aside_naming_the_changed_file(cli, trained_run, tmp_path):
    out = tmp_path / "export"
    assert cli("export", "--run", trained_run(), "--out", out).returncode == 0
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "my_note": "edited by hand"}))
    again = cli("export", "--run", trained_run(), "--out", out)
    assert again.returncode == 0, again.stderr[-2000:]
    (aside,) = tmp_path.glob("export.prev-*")
    assert "edited by hand" in (aside / "config.json").read_text()
    assert "config.json" in again.stdout and str(aside) in again.stdout
    assert "my_note" not in (out / "config.json").read_text()


@pytest.mark.parametrize("listed", [["notes.txt"], {"notes.txt": {"bytes": 4, "xxh3_128": "0" * 32}}])
def test_a_hand_made_marker_cannot_make_an_export_delete_a_users_file(cli, trained_run, tmp_path, listed):
    out = tmp_path / "export"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / MARKER).write_text(json.dumps({"command": "export", "files": listed}))
    assert cli("export", "--run", trained_run(), "--out", out).returncode == 0
    (aside,) = tmp_path.glob("export.prev-*")
    assert (aside / "notes.txt").read_text() == "mine"


def test_a_mount_point_as_out_is_refused_before_anything_is_written(cli, trained_run, tmp_path, monkeypatch):
    mount = tmp_path / "disk"
    mount.mkdir()
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == mount or real(p))
    one_line_error(cli("export", "--run", trained_run(), "--out", mount), "mount point", str(mount / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk"] and list(mount.iterdir()) == []


def test_a_fifo_marker_or_pointer_is_not_waited_on(tmp_path):
    """A FIFO where a marker (in any parent folder) or `checkpoints/latest` is looked for: reading it would block."""
    (tmp_path / "ckpt" / "checkpoints").mkdir(parents=True)
    fifos = [tmp_path / MARKER, tmp_path / "ckpt" / "checkpoints" / "latest"]
    for fifo in fifos:
        os.mkfifo(fifo)
    answers = {}
    readers = [
        threading.Thread(target=lambda: answers.__setitem__("made_by", made_by(tmp_path)), daemon=True),
        threading.Thread(target=lambda: answers.__setitem__("latest", latest_tag(tmp_path / "ckpt")), daemon=True),
        threading.Thread(
            target=lambda: answers.__setitem__("inside", enclosing_folder(tmp_path / "a" / "b")), daemon=True
        ),  # fmt: skip
    ]
    for t in readers:
        t.start()
    for t in readers:
        t.join(timeout=10)
    blocked = [t for t in readers if t.is_alive()]
    for fifo in fifos:  # let a blocked reader go (a writer that closes at once: end of file)
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert not blocked and answers == {"made_by": None, "latest": None, "inside": None}


def test_a_marker_whose_command_is_not_a_string_proves_nothing(cli, trained_run, tmp_path):
    (tmp_path / MARKER).write_text(json.dumps({"command": ["train"]}))  # in a parent of --out
    out = tmp_path / "export"
    done = cli("export", "--run", trained_run(), "--out", out)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert made_by(tmp_path) is None
