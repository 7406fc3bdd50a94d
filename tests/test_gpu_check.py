"""`make gpu-check` (launch/gpu_check.py) gets one short call on a GPU machine: here it runs whole on the CPU in its
dry-run mode, on a carry made as the real one is, so that a wrong flag, a wheel that does not install offline, a file
missing from the carry or a broken summary fails here, not there."""

from __future__ import annotations

import json
import os
import runpy
import sys
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the check is a script of launch/ (not a module of the package): its functions and constants, not run as __main__
gpu_check = SimpleNamespace(**runpy.run_path(str(ROOT / "launch" / "gpu_check.py"), run_name="gpu_check"))


def test_the_budget_adds_up_and_the_train_step_ends_inside_its_own_at_10_percent_mfu():
    """Steps + reserve = the call, <= 450 s (the run's limit is 480); the train step's steps at 10 % of an H100's bf16
    peak (FLOPs by the model's own count, the final evaluation's one micro-batch as a third of a step) plus its start
    and its compilation fit its budget."""
    from moe_lm.config import load_config, preset_path
    from moe_lm.model import train_flops_per_token
    from moe_lm.train.flops import GPU_PEAK_TFLOPS

    assert sum(gpu_check.STEPS.values()) + gpu_check.RESERVE_S == gpu_check.BUDGET_S <= 450
    assert gpu_check.RESERVE_S >= 20  # the install and the summary
    cfg = load_config(preset_path("gpu_1b"))
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len  # train.grad_accum_steps=1 in the plan
    assert "train.grad_accum_steps=1" in gpu_check.plan(False, Path("c"), Path("w"))["train"]
    step_s = train_flops_per_token(cfg.model, cfg.train.seq_len) * tokens / (0.10 * GPU_PEAK_TFLOPS["H100"] * 1e12)
    start = gpu_check.TRAIN_START_S + gpu_check.TRAIN_COMPILE_S
    assert (gpu_check.TRAIN_STEPS + 1 / 3) * step_s + start <= gpu_check.STEPS["train"]


def test_the_carried_wheels_are_the_venvs_versions_and_pydantics_typing_extensions(carry):
    """What --carry-wheels fetched is every CARRIED distribution at this venv's version (torchtitan: the release the
    bench's arm is written for, whatever the venv holds), and the carried typing-extensions satisfies what the
    carried pydantic requires (4.10-4.13 cannot import it)."""
    from importlib.metadata import requires, version

    from packaging.requirements import Requirement

    from moe_lm.bench.torchtitan_arm import TORCHTITAN

    names = {w.name.split("-")[0].replace("_", "-").lower(): w.name.split("-")[1] for w in (carry / "whl").iterdir()}
    assert names == {dist: gpu_check.PINNED.get(dist) or version(dist) for dist in gpu_check.CARRIED.values()}
    assert names["torchtitan"] == TORCHTITAN
    needed = next(Requirement(r) for r in requires("pydantic") if r.startswith("typing-extensions"))
    assert needed.specifier.contains(names["typing-extensions"]), (needed, names["typing-extensions"])


@pytest.fixture(scope="module")
def carry(tmp_path_factory, process):
    """A carry made the way `make gpu-carry` makes one (gpu_1b's token shards), its wheels for this Python."""
    folder = tmp_path_factory.mktemp("carry")
    gpu_check.carry_wheels(folder, f"{sys.version_info.major}.{sys.version_info.minor}")
    gpu_check.carry_data(folder)
    return folder


def test_the_dry_run_installs_the_real_carry_offline_and_exercises_every_step(process, carry, tmp_path):
    """The dry run on that carry: every carried wheel installed offline into the check's own folder, imported from
    there in front of the venv's copies, then every step and the summary."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "launch" / "gpu_check.py"), "--out", str(out), "--dry-run", "--carry", str(carry)]
    proc = process.run(cmd, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["logs.tgz", "results.json", "summary.txt"]
    r = json.loads((out / "results.json").read_text())
    assert r["install"]["rc"] == 0 and r["install"]["still_missing"] == [] and "error" not in r["install"]
    assert {"deepspeed", "pydantic", "typing_extensions", "torchtitan"} <= set(r["env"]["from_carry"])
    assert set(r["steps"]) == set(gpu_check.STEPS) and r["budget_s"] == gpu_check.BUDGET_S * gpu_check.DRY_RUN_SCALE
    for name in gpu_check.STEPS:
        assert r["steps"][name]["rc"] == 0 and not r["steps"][name]["cut"], (name, r["steps"][name])
    # every number the summary and the docs' rows are made of was read from the steps' own output
    assert r["env"]["device"] == "cpu" and r["env"]["torch"]
    assert r["train"]["steps"] == 3 and r["train"]["tokens_per_s"] > 0 and r["train"]["loss_last"] > 0
    assert len(r["bench_moe"]) == 3 and all(float(row["ours/dense"]) > 0 for row in r["bench_moe"])
    assert r["bench_train"]["ours_over_hf"] > 0 and r["bench_train"]["ours_over_dense"] > 0
    assert r["bench_train"]["ours_over_torchtitan"] > 0  # its arm ran, from the carried wheels
    speed = r["speed"]
    assert min(speed["eager"], speed["dispatch"], speed["attention"]) > 0 and "compiled" not in speed  # --no-compile
    assert speed["model_step_arm"] == "now" and speed["model_step_tokens_per_s"] > 0
    assert set(r["profile"]) == {"routing", "dispatch", "expert GEMMs", "shared experts", "attention", "loss",
                                 "optimizer", "other"} and 99 < sum(r["profile"].values()) < 101  # fmt: skip
    assert r["estimate_gib"] > 0
    rows = gpu_check.doc_rows(r).splitlines()
    assert len(rows) == 6 and all(row.startswith("| ") and row.endswith(" |") for row in rows)
    summary = (out / "summary.txt").read_text()
    assert "train: 3 steps" in summary and "whole step: ours/HF best" in summary and "profiled: routing" in summary
    assert ", ours/torchtitan " in summary and "speed, now / before issue 65: eager " in summary
    assert "the loop at " in summary and "x the model step (now)" in summary
    with tarfile.open(out / "logs.tgz") as tar:
        names = set(tar.getnames())
    assert {f"logs/{s}.log" for s in gpu_check.STEPS} | {"logs/install.log", "logs/metrics.jsonl"} <= names


def test_a_step_is_cut_at_its_budget_or_at_the_calls_deadline(tmp_path, process):
    sleep = [sys.executable, "-c", "import time; time.sleep(30)"]
    t0 = time.monotonic()
    cut = gpu_check.run_step("s", sleep, 1, t0 + 100, dict(os.environ), tmp_path)
    assert cut["cut"] and cut["rc"] is None and 1 <= cut["seconds"] < 10
    nearer = gpu_check.run_step("s", sleep, 100, time.monotonic() + 1, dict(os.environ), tmp_path)
    assert nearer["cut"] and nearer["seconds"] < 10  # the call's deadline comes first
    late = gpu_check.run_step("s", sleep, 100, time.monotonic() - 1, dict(os.environ), tmp_path)
    assert late == {"rc": None, "seconds": 0.0, "budget_s": 100, "cut": True, "note": "no time left"}
    done = gpu_check.run_step("s", [sys.executable, "-c", "print('ok')"], 30, time.monotonic() + 30, {}, tmp_path)
    assert done["rc"] == 0 and not done["cut"] and "ok" in (tmp_path / "s.log").read_text()


def test_every_way_out_writes_the_files(tmp_path, monkeypatch, process):
    """pip running out of time is a result, and an error of the check itself still leaves summary.txt,
    results.json and logs.tgz, saying what stopped it."""
    names = gpu_check.run_check.__globals__  # the script's own namespace (run with runpy)
    subprocess = names["subprocess"]

    class Slow:
        TimeoutExpired, STDOUT = subprocess.TimeoutExpired, subprocess.STDOUT

        @staticmethod
        def run(cmd, **kw):  # pip hangs; the rest runs
            if "pip" in cmd:
                raise subprocess.TimeoutExpired(cmd, kw.get("timeout"))
            return subprocess.run(cmd, **kw)

    (tmp_path / "carry" / "whl").mkdir(parents=True)
    monkeypatch.setitem(names, "subprocess", Slow)
    record = gpu_check.install_wheels(tmp_path / "carry", tmp_path / "site", {}, tmp_path, everything=True)
    assert record["rc"] is None and record["error"] == "pip install did not finish in 120 s"
    monkeypatch.setitem(names, "subprocess", subprocess)

    def broken(*args):
        raise RuntimeError("a bug in the plan")

    monkeypatch.setitem(names, "plan", broken)
    r = gpu_check.run_check(tmp_path / "out", tmp_path / "carry", dry_run=True)
    assert r["error"] == "the check itself stopped: RuntimeError: a bug in the plan"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["logs.tgz", "results.json", "summary.txt"]
    assert "a bug in the plan" in (tmp_path / "out" / "summary.txt").read_text()


def test_without_a_gpu_the_real_run_says_so_and_fails_and_runs_no_planted_code(process, tmp_path):
    """Another user of a shared machine plants a sitecustomize.py where a predictable temporary folder would be:
    the check's own folder of carried wheels is private and new, so it never runs."""
    tmp = tmp_path / "shared_tmp"
    planted = tmp / "moe_lm_site"
    planted.mkdir(parents=True)
    ran = tmp_path / "planted_code_ran"
    (planted / "sitecustomize.py").write_text(f"open({str(ran)!r}, 'w').write('yes')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, str(ROOT / "launch" / "gpu_check.py"), "--out", str(tmp_path / "out")]
    proc = process.run(cmd, env={**env, "TMPDIR": str(tmp)}, timeout=120)
    assert proc.returncode == 1
    assert "no CUDA GPU visible" in proc.stdout
    assert json.loads((tmp_path / "out" / "results.json").read_text())["steps"] == {}
    assert not ran.exists()


def test_one_torchtitan_release_everywhere():
    """The release the bench's arm calls (its builder is private and may change), the one `make setup` installs and
    the one the GPU check carries are the same."""
    from moe_lm.bench.torchtitan_arm import TORCHTITAN

    made = (ROOT / "Makefile").read_text().split("TORCHTITAN ?= ", 1)[1].split("\n", 1)[0]
    assert made == TORCHTITAN == gpu_check.PINNED["torchtitan"]
