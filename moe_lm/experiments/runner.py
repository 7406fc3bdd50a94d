"""Running an experiment's arms x seeds: one single-process training run at a time, each cached by what determines
its result.

A run's folder is `<runs>/<key>`, the hash of its whole resolved config (every key but train.out_dir), the data's
content fingerprint and the version of the code that trains (moe_lm/experiments/provenance.py): a finished run is
never trained twice, identical arms of different experiments share their runs, and another corpus, a changed
default or a new version of the training code is another run. A run is finished when its final evaluation
(final_eval.json) matches what the experiment asks for (the scored positions, its measures, the evaluation code);
a run whose training was interrupted resumes from its last checkpoint (the training loop's own resume). No design
may pass over its training split more than MAX_EPOCHS times. Training runs as a subprocess of the real training
command (`python -m moe_lm.cli.train`, its log in <run>/train.log).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from moe_lm.checkpoint.format import latest_tag
from moe_lm.config import Config, config_to_dict, dump_config, load_config
from moe_lm.data.prepare import prepare_data, read_meta
from moe_lm.errors import RunError
from moe_lm.experiments.final_eval import RESULT, evaluate_run
from moe_lm.experiments.measures import MEASURES
from moe_lm.experiments.provenance import data_fingerprint, evaluation_code, training_code
from moe_lm.experiments.spec import Experiment
from moe_lm.output_folder import made_by, write_marker
from moe_lm.train.run_folder import LOCK as TRAIN_LOCK

DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
RUN_INFO = "experiment_run.json"


@dataclass
class Run:
    arm: str
    seed: int
    cfg: Config
    folder: Path
    result: dict | None = None  # final_eval.json
    train_seconds: float | None = None
    cached: bool = False


def resolve_run(exp: Experiment, arm: str, seed: int, runs_root: Path) -> Run:
    """The arm's config at `seed` (experiment overrides, then the arm's, then seed and steps) and its folder (its
    data prepared first if it is the embedded corpus: the key needs the data's fingerprint)."""
    overrides = [*exp.overrides, *exp.arms[arm], f"seed={seed}", f"train.max_steps={exp.steps}"]
    # every arm's evaluations during training also on the experiment's scored labels (its curves)
    overrides.append(f"cadence.eval_score_from={exp.score_from}")
    cfg = load_config(exp.config, overrides)
    folder = Path(runs_root) / run_key(cfg, inputs_of(cfg))
    check_epochs(cfg, exp, arm)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=str(folder)))
    return Run(arm, seed, cfg, folder)


def inputs_of(cfg: Config) -> dict:
    """{data_fingerprint, training_code} of a run of `cfg`."""
    data = Path(cfg.data.out_dir)
    if cfg.data.sources == ["default"] and not (data / "meta.json").is_file():
        prepare_data(cfg.data, cfg.model.vocab_size, seed=cfg.seed, log=lambda line: None)
    try:
        fingerprint = data_fingerprint(data)
    except FileNotFoundError as e:
        raise RunError(str(e)) from None
    return {"data_fingerprint": fingerprint, "training_code": training_code()}


MAX_EPOCHS = 4.0  # past a few epochs a larger model's loss measures memorisation: the comparison changes meaning


def epochs(cfg: Config) -> float:
    """Passes over the training split that `cfg`'s run (one process) makes (its data prepared)."""
    t = cfg.train
    return t.max_steps * cfg.global_batch() * t.seq_len / read_meta(cfg.data.out_dir)["tokens"]["train"]


def check_epochs(cfg: Config, exp: Experiment, arm: str) -> None:
    passes = epochs(cfg)
    if passes > MAX_EPOCHS:
        raise RunError(
            f"{exp.name}: arm {arm} would make {passes:.1f} passes over {cfg.data.out_dir}'s training split "
            f"(more than {MAX_EPOCHS:.0f}, where overfitting decides the comparison): fewer steps, or more data "
            "(data.sources)"
        )


def run_key(cfg: Config, inputs: dict) -> str:
    """12 hex digits identifying everything that determines a run's result (not where it is written): the whole
    resolved config, the data's content and the code's version."""
    settings = config_to_dict(cfg)
    settings["train"].pop("out_dir", None)
    return hashlib.sha256(json.dumps({"config": settings, **inputs}, sort_keys=True).encode()).hexdigest()[:12]


def is_done(run: Run, exp: Experiment) -> bool:
    result = _read_json(run.folder / RESULT)
    if result is None:  # none yet, or unreadable (cut short by a crash or a full disk): evaluated again
        return False
    if result.get("inputs", {}).get("evaluation_code") != evaluation_code():  # evaluated by other code: again
        return False
    if not all(MEASURES[m].recorded(result) for m in exp.measures):  # evaluated without a measure asked for
        return False
    return result.get("score_from") == exp.score_from


def execute(run: Run, exp: Experiment, log=print) -> Run:
    """Train (or resume) the run unless finished, then evaluate it; fills run.result. A run that another process is
    training or evaluating (another experiment command, a trainer started by hand) is refused, never touched."""
    if not is_done(run, exp):
        with run_lock(run):
            if not is_done(run, exp):  # else finished by the process that held it while we looked
                train_and_evaluate(run, exp, log)
                return run
    run.result, run.cached = _read_json(run.folder / RESULT), True
    run.train_seconds = _info(run).get("train_seconds")
    return run


def train_and_evaluate(run: Run, exp: Experiment, log) -> None:
    """Train the run (resuming an attempt that saved a checkpoint) unless its last checkpoint is there, then
    evaluate it; fills run.result."""
    if latest_tag(run.folder) != f"step_{exp.steps:08d}":
        set_aside_interrupted(run, log)
        run.folder.mkdir(parents=True, exist_ok=True)
        if made_by(run.folder) != "train":  # a run folder this runner made, with its own files in it
            write_marker(run.folder, "train")
        dump_config(run.cfg, run.folder / "launch.yaml")
        (run.folder / RUN_INFO).write_text(json.dumps({"experiment": exp.name, "arm": run.arm, "seed": run.seed}))
        t0 = time.perf_counter()
        with open(run.folder / "train.log", "a") as out:
            cmd = [sys.executable, "-m", "moe_lm.cli.train", "--config", str(run.folder / "launch.yaml")]
            # why a cleaned environment: a process-group address inherited from the caller (a process that trained
            # in-process, or a launcher) would make this single-process run join or collide with it
            env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
            # why a session of its own: the terminal's Ctrl-C reaches this process only, which hands the trainer one
            # signal (a second would stop it without saving)
            trainer = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            returncode = _wait_saving(trainer)
        if returncode != 0:
            tail = (run.folder / "train.log").read_text()[-2000:]
            raise RunError(f"training {run.arm} (seed {run.seed}) in {run.folder} failed:\n{tail}")
        info = {**_info(run), "train_seconds": time.perf_counter() - t0}
        (run.folder / RUN_INFO).write_text(json.dumps(info))
    run.result = evaluate_run(run.folder, exp.score_from, tuple(exp.measures))
    run.train_seconds = _info(run).get("train_seconds")


def _wait_saving(proc: subprocess.Popen) -> int:
    """The trainer's exit code. Interrupted ourselves (Ctrl-C, SIGTERM), we hand the signal on and wait: the trainer
    finishes its step and saves a checkpoint that the next command resumes from, instead of being killed mid-step."""
    try:
        return proc.wait()
    except BaseException as e:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(getattr(e, "signum", signal.SIGINT))
        try:
            proc.wait(timeout=SAVE_GRACE_S)
        except BaseException:  # a second Ctrl-C, or a trainer that does not stop: now
            proc.kill()
            proc.wait()
        raise


SAVE_GRACE_S = 600  # how long an interrupted command waits for its trainer's step and checkpoint


@contextlib.contextmanager
def run_lock(run: Run):
    """An exclusive flock on <runs>/<key>.lock for as long as this process prepares, trains and evaluates the run
    (beside the folder, which may be set aside); refused, naming the holder, while another process holds it or a
    trainer holds the run folder's own lock (<run>/.lock)."""
    path = run.folder.with_name(f"{run.folder.name}.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:  # closing it releases the flock; the file stays (others may be waiting on it)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            raise RunError(_in_use(run, f"another experiment command ({handle.read().strip() or 'unknown'})")) from None
        if (trainer := _trainer_holding(run.folder)) is not None:
            raise RunError(_in_use(run, f"a training process ({trainer})"))
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}")
        handle.flush()
        yield


def _in_use(run: Run, who: str) -> str:
    return (f"{run.arm} seed {run.seed}: its run {run.folder} is in use by {who}; nothing was touched. Wait for it to "
            "finish and run this command again (a finished run is reused), or give another --runs")  # fmt: skip


def _trainer_holding(folder: Path) -> str | None:
    """Who holds a run folder's training lock (`pid N on HOST`), or None when nobody does (or there is none)."""
    try:
        fd = os.open(folder / TRAIN_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown"
    finally:
        os.close(fd)
    return None


def set_aside_interrupted(run: Run, log) -> None:
    """An attempt stopped before its first checkpoint cannot resume (the training command refuses to start over a
    logged run): its folder is moved to <key>.prev-<time>, never deleted, and the run starts afresh."""
    if latest_tag(run.folder) is None and (run.folder / "metrics.jsonl").is_file():
        aside = run.folder.with_name(f"{run.folder.name}.prev-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.move(str(run.folder), str(aside))
        log(f"{run.arm} seed {run.seed}: an interrupted attempt without a checkpoint moved to {aside}")


def _info(run: Run) -> dict:
    return _read_json(run.folder / RUN_INFO) or {}


def _read_json(path: Path) -> dict | None:
    """A JSON object the runner wrote, or None when it is missing or unreadable (cut short by a crash or a full disk:
    what it recorded is made again)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def run_experiment(exp: Experiment, runs_root: Path, log=print) -> list[Run]:
    """Every arm x seed, one at a time, in seed-major order (so that a partial run already holds paired seeds)."""
    runs = []
    total = len(exp.arms) * exp.seeds
    for seed in exp.seed_ids:
        for arm in exp.arms:
            run = resolve_run(exp, arm, seed, runs_root)
            t0 = time.perf_counter()
            execute(run, exp, log)
            how = "cached" if run.cached else f"{time.perf_counter() - t0:.0f} s"
            log(f"[{len(runs) + 1}/{total}] {arm} seed {seed}: loss {run.result['loss']:.4f} ({how}, {run.folder})")
            runs.append(run)
    return runs
