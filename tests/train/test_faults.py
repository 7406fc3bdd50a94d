"""Training under faults: nothing lost, no silent restart, no bad model promoted, every failure explained.

Each test injects one fault of the README's reliability table and checks what the user relies on afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import signal
import struct
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

import moe_lm.experiments.variants  # noqa: F401  (registers the research variants used below)
from moe_lm.checkpoint import save_resume
from moe_lm.checkpoint.format import COMPLETE, latest_tag, load_model
from moe_lm.config import ConfigError, dump_config, load_config
from moe_lm.data.prepare import load_split, prepare_data
from moe_lm.errors import DataError, RunError
from moe_lm.train import loop, run_folder
from moe_lm.train.flops import Throughput
from tests.helpers.runs import VOCAB, rows, tiny_train_cfg, with_train, write_folder_corpus

ROOT = Path(__file__).resolve().parents[2]


# ---- 2. never silently restart a run ---------------------------------------------------------------------------


def test_missing_latest_pointer_resumes_from_the_newest_complete_checkpoint(tmp_path, train, copied_run, capsys):
    cfg = copied_run(max_steps=4, ckpt_interval=2)
    (tmp_path / "run" / "checkpoints" / "latest").unlink()
    train(with_train(cfg, max_steps=6))
    assert (
        "latest is missing or unreadable; using the newest complete checkpoint, step_00000004"
        in capsys.readouterr().out
    )
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]  # the log was kept, not wiped


def test_a_truncated_checkpoint_falls_back_to_the_previous_one_and_names_the_file(tmp_path, train, copied_run, capsys):
    cfg = copied_run(max_steps=4, ckpt_interval=2)
    model_file = tmp_path / "run" / "checkpoints" / "step_00000004" / "mp_rank_00_model_states.pt"
    model_file.write_bytes(model_file.read_bytes()[:1000])
    train(with_train(cfg, max_steps=5))
    out = capsys.readouterr().out
    assert f"{model_file} has 1000 bytes" in out and "resumed from" in out and "at step 2" in out
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("marker", ["hashes", "sizes only"])
def test_a_garbled_checkpoint_of_the_same_size_falls_back_too(tmp_path, train, copied_run, capsys, marker):
    cfg = copied_run(max_steps=4, ckpt_interval=2)
    folder = tmp_path / "run" / "checkpoints" / "step_00000004"
    if marker == "sizes only":  # a COMPLETE written before the hashes: the failed load names the file
        record = json.loads((folder / COMPLETE).read_text())
        (folder / COMPLETE).write_text(json.dumps({name: entry["bytes"] for name, entry in record.items()}))
    model_file = folder / "mp_rank_00_model_states.pt"
    model_file.write_bytes(b"\0" * model_file.stat().st_size)
    train(with_train(cfg, max_steps=5))
    out = capsys.readouterr().out
    named = "content hash differs" if marker == "hashes" else "mp_rank_00_model_states.pt does not load"
    assert named in out and "mp_rank_00_model_states.pt" in out and "at step 2" in out


def flip_one_bit(path: Path) -> None:
    """Flip one bit in the middle of the file's largest tensor: the size stays, and torch reads it unawares."""
    with zipfile.ZipFile(path) as z:
        data = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    content = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", content[data.header_offset + 26 : data.header_offset + 30])
    content[data.header_offset + 30 + name_len + extra_len + data.file_size // 2] ^= 0x40
    path.write_bytes(bytes(content))


def test_one_flipped_bit_is_named_by_load_model_and_resume(tmp_path, train, copied_run, capsys):
    cfg = copied_run(max_steps=4, ckpt_interval=2)
    folder = tmp_path / "run" / "checkpoints" / "step_00000004"
    written = load_model(tmp_path / "run")[1].state_dict()
    expert_file = sorted(folder.glob("layer_*_expert_*_mp_rank_00_model_states.pt"))[-1]
    flip_one_bit(expert_file)
    with pytest.raises(ValueError, match=f"{expert_file} is not the file that was written .*content hash differs"):
        load_model(tmp_path / "run")
    # the reference: with sizes only (a COMPLETE from before the hashes) the altered weights load unnoticed
    hashed = (folder / COMPLETE).read_text()
    (folder / COMPLETE).write_text(json.dumps({n: e["bytes"] for n, e in json.loads(hashed).items()}))
    altered = load_model(tmp_path / "run")[1].state_dict()
    assert [k for k in written if not torch.equal(written[k], altered[k])] == ["layers.1.mlp.experts.gate_up_proj"]
    (folder / COMPLETE).write_text(hashed)
    train(with_train(cfg, max_steps=5))
    out = capsys.readouterr().out
    assert f"{expert_file} is not the file that was written" in out and "at step 2" in out
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 2, 3, 4, 5]


def test_a_history_without_a_loadable_checkpoint_is_refused(tmp_path, train, copied_run):
    cfg = copied_run(max_steps=2, ckpt_interval=2)
    (tmp_path / "run" / "checkpoints" / "step_00000002" / COMPLETE).unlink()
    with pytest.raises(RunError, match="no complete checkpoint to resume from.*train.resume=false"):
        train(cfg)
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 2]


def test_a_half_written_last_metrics_line_does_not_block_resume(tmp_path, train, copied_run):
    cfg = with_train(copied_run(max_steps=4, ckpt_interval=2, stop_at=2), stop_at=0)
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 3, "lo')  # killed mid-write
    train(cfg)
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 2, 3, 4]


# ---- 3. never promote a bad model ------------------------------------------------------------------------------


def test_non_finite_weights_are_never_saved_and_the_cli_exits_non_zero(tiny_data, tmp_path, train, monkeypatch, capsys):
    """A NaN that reaches the weights through a finite-loss step (as through the Adam state): no checkpoint of it,
    `latest` stays on the good one, the offline tools refuse it."""
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=6, ckpt_interval=2, max_bad_steps=10)
    real_step = loop.train_step

    def poisoned(engine, model, batches, *args):
        result = real_step(engine, model, batches, *args)
        if engine.global_steps == 4:  # after step 4's update, whose loss was finite
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))
        return result

    monkeypatch.setattr(loop, "train_step", poisoned)
    with pytest.raises(RunError, match="ended with an unhealthy model; the last good checkpoint is step_00000002"):
        train(cfg)
    out = capsys.readouterr().out
    assert "not saving step 4: the weights are not finite; the last good checkpoint is step_00000002" in out
    assert latest_tag(tmp_path / "run") == "step_00000002"
    assert not (tmp_path / "run" / "checkpoints" / "step_00000006").exists()
    # a NaN checkpoint written by other means is refused by export / generate / analytics
    good = tmp_path / "run" / "checkpoints" / "step_00000002"
    state = torch.load(good / "mp_rank_00_model_states.pt", weights_only=True)
    first = next(iter(state["module"]))
    state["module"][first] = state["module"][first] * float("nan")
    torch.save(state, good / "mp_rank_00_model_states.pt")
    sizes = json.loads((good / COMPLETE).read_text())
    sizes["mp_rank_00_model_states.pt"] = (good / "mp_rank_00_model_states.pt").stat().st_size
    (good / COMPLETE).write_text(json.dumps(sizes))
    with pytest.raises(ValueError, match="non-finite weights.*diverged"):
        load_model(tmp_path / "run")


def test_a_run_that_ends_unhealthy_exits_non_zero_naming_the_last_good_checkpoint(tiny_data, tmp_path, cli):
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=3, max_bad_steps=10)
    dump_config(cfg, tmp_path / "cfg.yaml")
    proc = cli("train", "--config", tmp_path / "cfg.yaml", "model.init_std=1e30")  # every gradient overflows
    assert proc.returncode != 0, proc.stdout[-2000:]  # all steps skipped
    err = proc.stderr
    assert "error: the run ended with an unhealthy model; the last good checkpoint is none" in err, err[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_non_finite_final_evaluation_fails_the_run(tiny_data, tmp_path, train, monkeypatch):
    real = loop.evaluate

    def nan_loss(*args):
        return {**real(*args), "loss": float("nan")}

    monkeypatch.setattr(loop, "evaluate", nan_loss)
    with pytest.raises(RunError, match="final validation loss is nan: the run diverged"):
        train(tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=2))


# ---- 4. train on the data the config names ---------------------------------------------------------------------


def test_other_sources_than_the_prepared_ones_are_refused(tiny_data, tmp_path, train):
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run")
    other = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, sources=[str(tmp_path)]))
    with pytest.raises(DataError, match="not prepared from what data.* names now.*sources"):
        train(other)
    assert not (tmp_path / "run").exists()  # a failed start leaves no half-made run folder


def test_a_corpus_prepared_again_under_a_run_is_refused_on_resume(tmp_path, train):
    """Edited sources, prepared again with --force: the config still matches, the tokenizer does not."""
    from moe_lm.config import DataConfig

    corpus = write_folder_corpus(tmp_path / "corpus", n_docs=6)
    data = DataConfig(sources=[str(corpus)], out_dir=str(tmp_path / "data"), val_fraction=0.2)
    prepare_data(data, vocab_size=VOCAB, log=lambda s: None)
    cfg = tiny_train_cfg(data, tmp_path / "run", max_steps=2, ckpt_interval=2)
    train(cfg)
    for i in range(6):  # distinct documents (duplicates are dropped), enough to change a 300-piece vocabulary
        (corpus / "cooking" / f"new{i}.txt").write_text(f"recipe {i}: " + "quantum chromodynamics gluon lattice " * 40)
    with pytest.raises(DataError, match="the source files' contents"):  # training notices the edit first
        train(with_train(cfg, max_steps=4))
    prepare_data(data, vocab_size=VOCAB, force=True, log=lambda s: None)
    with pytest.raises(RunError, match="the tokenizer in .* is not the one .* was trained with"):
        train(with_train(cfg, max_steps=4))


# ---- 5. no silent zeros, no silent skips, no MFU above 100 % ---------------------------------------------------


def test_mfu_never_reads_above_100_percent():
    notes = []
    meter = Throughput(flops_per_step=2e12, tokens_per_step=1000, peak=1e12, note=notes.append)
    assert meter(1.0)["mfu"] == pytest.approx(1.0) and len(notes) == 1  # 2 TFLOP/s against a 1 TFLOP/s peak
    assert meter(4.0)["mfu"] == pytest.approx(0.25)  # the raised peak stays
    assert meter(4.0)["tokens_per_s"] == pytest.approx(250)


def test_stop_at_below_zero_is_a_config_error():
    with pytest.raises(ConfigError, match="train.stop_at must be >= 0"):
        load_config(ROOT / "configs" / "tiny.yaml", ["train.stop_at=-1"])


@pytest.mark.parametrize(
    "override, key",
    [("optim.lr=nan", "optim.lr"), ("optim.lr=0", "optim.lr"), ("optim.beta2=1.0", "optim.beta2"),
     ("optim.eps=0", "optim.eps"), ("optim.weight_decay=-0.1", "optim.weight_decay")],
)  # fmt: skip
def test_optimizer_values_are_validated_up_front(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(ROOT / "configs" / "tiny.yaml", [override])


def test_prefix_mask_without_a_prefix_objective_is_refused_before_anything_is_built(tiny_data, tmp_path, train):
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attn_mask="prefix"))
    with pytest.raises(ConfigError, match="attn_mask = prefix needs objective.name=prefix_lm"):
        train(cfg)
    assert not (tmp_path / "run").exists()


def test_generate_rejects_top_p_zero_with_a_clear_message(cli):
    proc = cli.script("generate.py", "--run", "runs/none", "--top-p", "0")
    assert proc.returncode == 2 and "--top-p must be in (0, 1]" in proc.stderr


# ---- 6. signals save work --------------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_a_checkpoint_and_the_same_command_resumes(tiny_data, tmp_path, process, cli, sig):
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=400, ckpt_interval=1000, eval_interval=1000)
    dump_config(cfg, tmp_path / "cfg.yaml")
    proc = process.train(tmp_path / "cfg.yaml")
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, (proc.returncode, err[-2000:])
    assert f"stopped by {signal.Signals(sig).name}" in err
    tag = latest_tag(tmp_path / "run")
    step = int(tag.split("_")[1])
    assert step >= 3 and [r["step"] for r in rows(tmp_path / "run")] == list(range(1, step + 1))
    again = cli.script("train.py", "--config", tmp_path / "cfg.yaml", f"train.max_steps={step + 2}")
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / tag} at step {step}" in again.stdout


def test_sigterm_to_a_two_rank_deepspeed_job_saves_on_every_rank(tiny_data, tmp_path, launcher):
    """What a scheduler does: SIGTERM to every process of the job (launcher and ranks)."""
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=400, ckpt_interval=1000, eval_interval=1000)
    dump_config(cfg, tmp_path / "cfg.yaml")
    port = str(launcher.free_port())
    proc = launcher.start(launcher.deepspeed(2, port, "launch/train.py", "--config", f"{tmp_path}/cfg.yaml"))
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3) and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "stopped by SIGTERM" in out, out[-3000:]
    tag = latest_tag(tmp_path / "run")
    assert tag is not None and (tmp_path / "run" / "checkpoints" / tag / "rng_rank1.pt").is_file(), out[-3000:]
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


MOE_LM = str(Path(sys.executable).with_name("moe-lm"))


def wait_for_rows(run: Path, n: int, proc) -> None:
    metrics, deadline = run / "metrics.jsonl", time.time() + 300
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= n) and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.2)


def still_running(marker: str) -> list[int]:
    """Processes whose command line holds `marker` (a rank of that run), other than this test's."""
    import psutil

    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        if process.info["pid"] != os.getpid() and marker in " ".join(process.info["cmdline"] or []):
            found.append(process.info["pid"])
    return found


@pytest.mark.parametrize(
    "how, sig, settings",
    [
        # the terminal's Ctrl-C: SIGINT to the foreground process group (wandb's service on, pipeline stages)
        (
            "group",
            signal.SIGINT,
            ["logging.wandb_mode=offline", "parallel.pp_size=2", "parallel.zero_stage=1", "model.n_layers=4"],
        ),
        # `kill PID`, `timeout`, a scheduler: SIGTERM to the command's process only
        ("pid", signal.SIGTERM, []),
    ],
)
def test_a_signal_to_moe_lm_train_nproc_2_saves_on_every_rank_and_exits_128_plus_it(
    tiny_data, tmp_path, launcher, how, sig, settings
):
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=400, ckpt_interval=1000, eval_interval=1000)
    dump_config(cfg, tmp_path / "cfg.yaml")
    proc = launcher.start([MOE_LM, "train", "--nproc", "2", "--config", tmp_path / "cfg.yaml", *settings])
    try:
        wait_for_rows(tmp_path / "run", 3, proc)
        os.killpg(proc.pid, sig) if how == "group" else proc.send_signal(sig)
        out, _ = proc.communicate(timeout=240)
    finally:
        leftover = still_running(str(tmp_path / "cfg.yaml"))
        for pid in leftover:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 128 + sig, (proc.returncode, out[-3000:])
    assert not leftover, "ranks or the launcher went on training"
    assert f"stopped by {signal.Signals(sig).name}" in out and "Traceback" not in out, out[-3000:]
    tag = latest_tag(tmp_path / "run")
    step = int(tag.split("_")[1])
    assert step >= 3 and step == rows(tmp_path / "run")[-1]["step"], out[-3000:]
    assert (tmp_path / "run" / "checkpoints" / tag / "rng_rank1.pt").is_file()


# ---- 7. one run per folder -------------------------------------------------------------------------------------


def test_a_second_process_on_the_same_run_folder_is_refused(tiny_data, tmp_path, train):
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=2)
    (tmp_path / "run").mkdir()
    held = run_folder._lock(tmp_path / "run")  # as the first process holds it
    try:
        with pytest.raises(RunError, match=r"in use by another training process \(pid \d+"):
            train(cfg)
        with pytest.raises(RunError, match="in use"):  # also when it would move the old run aside
            train(with_train(cfg, resume=False))
    finally:
        held.close()
    assert not list(tmp_path.glob("run.prev-*"))
    train(cfg)  # free again


def test_a_users_folder_as_train_out_dir_is_refused_before_anything_is_written(tiny_data, tmp_path, train, cli):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my own config")
    cfg = tiny_train_cfg(tiny_data, mine, max_steps=2)
    with pytest.raises(RunError, match="holds files that are not a run \\(config.yaml\\); nothing was written"):
        train(cfg)
    assert sorted(p.name for p in mine.iterdir()) == ["config.yaml"] and (mine / "config.yaml").read_text() == (
        "my own config"
    )
    dump_config(cfg, tmp_path / "cfg.yaml")  # the command: one line
    proc = cli("train", "--config", tmp_path / "cfg.yaml")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "nothing was written" in proc.stderr
    assert sorted(p.name for p in mine.iterdir()) == ["config.yaml"]
    # the failed command left no process group behind: the same process trains next (a notebook, a sweep)
    again = cli("train", "--config", tmp_path / "cfg.yaml", "--out", tmp_path / "fresh")
    assert again.returncode == 0 and latest_tag(tmp_path / "fresh"), again.stderr[-3000:]
    with pytest.raises(RunError, match="lies inside the prepared data folder"):
        train(tiny_train_cfg(tiny_data, Path(tiny_data.out_dir) / "run", max_steps=2))
    assert not (Path(tiny_data.out_dir) / "run").exists()


def test_an_empty_folder_is_a_new_run_and_a_failed_start_empties_it_again(tiny_data, tmp_path, train, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = tiny_train_cfg(tiny_data, empty, max_steps=2)

    def fails(*a, **k):
        raise RuntimeError("a failure after the run folder was set up")

    monkeypatch.setattr(loop, "_start", fails)
    with pytest.raises(RuntimeError, match="after the run folder"):
        train(cfg)
    assert empty.is_dir() and list(empty.iterdir()) == []
    monkeypatch.undo()
    train(cfg)
    assert latest_tag(empty) and json.loads((empty / ".moe-lm.json").read_text())["command"] == "train"


def test_rotation_removes_only_its_own_checkpoint_folders(tmp_path, train, copied_run):
    cfg = copied_run(max_steps=4, ckpt_interval=2)
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "step_00000002.bak").mkdir()
    (ckpts / "step_00000002.bak" / "notes.txt").write_text("the user's copy")
    (ckpts / "step_00000001").mkdir()  # a name save would write, holding a file it does not
    (ckpts / "step_00000001" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (ckpts / "step_00000001" / "notes.txt").write_text("mine")
    (ckpts / "step_00000003").mkdir()  # an interrupted save's leftover: SAVING and only a save's files
    (ckpts / "step_00000003" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (ckpts / "step_00000003" / save_resume.SAVING).write_text("pid 1 on elsewhere")
    (ckpts / "step_00000005").mkdir()  # a step folder of the user's without COMPLETE: the docs say it stays
    (ckpts / "step_00000005" / "best.pt").write_bytes(b"my best weights")
    train(with_train(cfg, max_steps=8, keep_last=1))
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == [
        "step_00000001",
        "step_00000002.bak",
        "step_00000005",
        "step_00000008",
    ]
    assert (ckpts / "step_00000002.bak" / "notes.txt").read_text() == "the user's copy"
    assert (ckpts / "step_00000001" / "notes.txt").read_text() == "mine"
    assert (ckpts / "step_00000005" / "best.pt").read_bytes() == b"my best weights"


def test_a_save_into_a_leftover_folder_lists_only_what_it_wrote_and_resume_keeps_the_optimizer(
    tmp_path, train, copied_run, capsys
):
    """An interrupted save left step_00000006 behind (files of a 2-rank save); the save of step 6 starts afresh."""
    cfg = copied_run(max_steps=4, ckpt_interval=2)
    leftover = tmp_path / "run" / "checkpoints" / "step_00000006"
    leftover.mkdir()
    (leftover / save_resume.SAVING).write_text("pid 1 on elsewhere")
    for r in (0, 1):
        (leftover / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"stale")
    train(with_train(cfg, max_steps=6))
    done = tmp_path / "run" / "checkpoints" / "step_00000006"
    listed = json.loads((done / COMPLETE).read_text())
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" not in listed and not (done / save_resume.SAVING).exists()
    assert save_resume.saved_world_size(done) == 1
    capsys.readouterr()
    train(with_train(cfg, max_steps=7))
    out = capsys.readouterr().out
    assert "fresh optimizer state" not in out and "resumed from" in out and "at step 6" in out


def test_a_step_folder_of_the_users_in_the_way_of_a_save_is_moved_aside(tmp_path, train, copied_run, capsys):
    cfg = copied_run(max_steps=4, ckpt_interval=2)
    mine = tmp_path / "run" / "checkpoints" / "step_00000006"
    mine.mkdir()
    (mine / "best.pt").write_bytes(b"my best weights")
    train(with_train(cfg, max_steps=6))
    (aside,) = (tmp_path / "run" / "checkpoints").glob("step_00000006.prev-*")
    assert (aside / "best.pt").read_bytes() == b"my best weights" and str(aside) in capsys.readouterr().out
    assert latest_tag(tmp_path / "run") == "step_00000006"


def test_another_trainers_folder_is_not_taken_for_a_run(tiny_data, tmp_path, train):
    theirs = tmp_path / "theirs"
    (theirs / "checkpoints").mkdir(parents=True)
    (theirs / "checkpoints" / "latest").write_text("global_step100")  # DeepSpeed's own pointer
    (theirs / "metrics.jsonl").write_text('{"loss": 2.1, "iteration": 100}\n')
    (theirs / "config.yaml").write_text("their: config\n")
    before = {p.name: p.read_bytes() for p in theirs.rglob("*") if p.is_file()}
    with pytest.raises(RunError, match="holds files that are not a run"):
        train(tiny_train_cfg(tiny_data, theirs, max_steps=2))
    assert {p.name: p.read_bytes() for p in theirs.rglob("*") if p.is_file()} == before
    # a run from before the marker is still a run: marker removed from a real one, it resumes
    ours = tmp_path / "ours"
    train(tiny_train_cfg(tiny_data, ours, max_steps=2, ckpt_interval=2))
    (ours / ".moe-lm.json").unlink()
    train(tiny_train_cfg(tiny_data, ours, max_steps=3, ckpt_interval=2))
    assert latest_tag(ours) == "step_00000003"


def test_a_dangling_symlink_as_train_out_dir_is_one_line(tiny_data, tmp_path, cli):
    (tmp_path / "run").symlink_to(tmp_path / "gone")
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=2)
    dump_config(cfg, tmp_path / "cfg.yaml")
    proc = cli("train", "--config", tmp_path / "cfg.yaml")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "symlink" in proc.stderr and str(tmp_path / "gone") in proc.stderr
    assert not (tmp_path / "gone").exists()


def test_data_prepared_again_under_a_running_training_is_refused_and_never_claimed(tmp_path, train, monkeypatch, cli):
    """While a run trains: `prepare --force` on its data is refused; a tokenizer edited by hand is not recorded as
    the one the run trained with, and the run's closing entropy is of the corpus it read."""
    from moe_lm.config import DataConfig
    from moe_lm.data.shards import unigram_entropy

    corpus = write_folder_corpus(tmp_path / "corpus", n_docs=6)
    data = DataConfig(sources=[str(corpus)], out_dir=str(tmp_path / "data"), val_fraction=0.2)
    prepare_data(data, vocab_size=VOCAB, log=lambda s: None)
    trained_on = (tmp_path / "data" / "tokenizer.model").read_bytes()
    entropy = unigram_entropy(load_split(data.out_dir, "train").tokens, VOCAB)
    cfg = tiny_train_cfg(data, tmp_path / "run", max_steps=4, ckpt_interval=2)
    real = loop._save

    def prepare_again_after_the_first_save(run, state):
        saved = real(run, state)
        if state["step"] == 2:
            with pytest.raises(DataError, match="read by a running training"):
                prepare_data(data, vocab_size=VOCAB + 20, force=True, log=lambda s: None)
            (tmp_path / "data" / "tokenizer.model").write_bytes(trained_on[::-1])  # edited outside moe-lm
        return saved

    monkeypatch.setattr(loop, "_save", prepare_again_after_the_first_save)
    final = train(cfg)
    ckpts = tmp_path / "run" / "checkpoints"
    first, last = (json.loads((ckpts / t / "data_ref.json").read_text()) for t in ("step_00000002", "step_00000004"))
    assert last == first  # the tokenizer the run read at its start
    assert final["unigram_entropy"] == pytest.approx(entropy)
    proc = cli("generate", "--run", tmp_path / "run", "--prompt", "the", "--max-new-tokens", "3")
    assert proc.returncode == 2 and "is not the one this checkpoint was trained with" in proc.stderr
    (tmp_path / "data" / "tokenizer.model").write_bytes(trained_on)
    prepare_data(data, vocab_size=VOCAB + 20, force=True, log=lambda s: None)  # no run reads it now


# ---- 8. a full disk during a save ------------------------------------------------------------------------------


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint_and_says_so(tiny_data, tmp_path, train, monkeypatch):
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=4, ckpt_interval=2)
    real = save_resume.torch.save
    calls = {"n": 0}

    def disk_full(obj, path, *a, **k):
        if str(path).endswith("rng_rank0.pt"):
            calls["n"] += 1
            if calls["n"] == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(obj, path, *a, **k)

    monkeypatch.setattr(save_resume.torch, "save", disk_full)
    with pytest.raises(RunError, match="the disk is full.*step_00000002, is intact"):
        train(cfg)
    assert latest_tag(tmp_path / "run") == "step_00000002"
    assert not (tmp_path / "run" / "checkpoints" / "step_00000004").exists()  # its partial folder removed


def test_torchs_writer_failing_on_a_full_disk_is_one_line_and_the_half_written_checkpoint_goes(
    tiny_data, tmp_path, train, monkeypatch, cli
):
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=4, ckpt_interval=2)
    real, calls = save_resume.torch.save, {"n": 0}

    def zip_writer_on_a_full_disk(obj, path, *a, **k):  # what torch raises for ENOSPC, after a partial write
        if str(path).endswith("rng_rank0.pt"):
            calls["n"] += 1
            if calls["n"] == 2:
                Path(path).write_bytes(b"PK\x03\x04")
                raise RuntimeError(
                    "[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0 PytorchStreamWriter failed "
                    "writing file data/0: file write failed"
                )
        return real(obj, path, *a, **k)

    monkeypatch.setattr(save_resume.torch, "save", zip_writer_on_a_full_disk)
    dump_config(cfg, tmp_path / "cfg.yaml")
    proc = cli("train", "--config", tmp_path / "cfg.yaml")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr[-3000:]
    assert "step_00000004" in errors[0] and "the disk is full" in errors[0] and "step_00000002, is intact" in errors[0]
    assert latest_tag(tmp_path / "run") == "step_00000002"
    assert not (tmp_path / "run" / "checkpoints" / "step_00000004").exists()


# ---- 9. no garbage ---------------------------------------------------------------------------------------------


def test_a_failed_distributed_run_leaves_no_shared_memory_buffers(tiny_data, tmp_path, launcher):
    cfg = tiny_train_cfg(tiny_data, tmp_path / "run", max_steps=2)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=512))  # fails after init
    dump_config(cfg, tmp_path / "cfg.yaml")
    port = str(launcher.free_port())
    proc = launcher.run(launcher.deepspeed(2, port, "launch/train.py", "--config", tmp_path / "cfg.yaml"), timeout=300)
    # every rank ended in its own words (the check's error, or the launcher's SIGTERM once the other had failed):
    # none was left spinning in DeepSpeed's shared-memory start-up, looking for a buffer the failed rank had
    # removed, deaf to SIGTERM until the launcher's SIGKILL 30 s later
    said = proc.stdout.count("tokenized with 300 pieces") + proc.stdout.count("terminated (SIGTERM)")
    assert proc.returncode != 0 and "tokenized with 300 pieces" in proc.stdout and said == 2, proc.stdout[-3000:]
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    assert not (tmp_path / "run").exists()
