"""`make gpu-check` (launch/gpu_check.py) is run on a GPU only inside a short lease: here it runs whole on the CPU
in its dry-run mode, so that a wrong flag, a file missing from the carry or a broken summary fails here, not there."""

from __future__ import annotations

import json
import os
import re
import runpy
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
# the check is a script of launch/ (not a module of the package): its functions and constants, not run as __main__
gpu_check = SimpleNamespace(**runpy.run_path(str(ROOT / "launch" / "gpu_check.py"), run_name="gpu_check"))


def test_the_budget_adds_up_to_the_call_and_the_carried_wheels_are_the_ones_made():
    assert sum(gpu_check.STEPS.values()) + gpu_check.RESERVE_S == gpu_check.BUDGET_S <= 420
    assert gpu_check.RESERVE_S >= 20  # the install, the estimate and the summary
    made = ROOT.joinpath("Makefile").read_text().split("gpu-wheels:")[1].split("\n\n")[0]
    for wheel in gpu_check.WHEELS:  # what the check installs is what `make gpu-wheels` fetches
        assert re.search(rf"\b{wheel.replace('_', '[-_]')}\b", made), wheel


def test_the_dry_run_exercises_every_step_and_its_summary(process, tmp_path):
    carry = tmp_path / "carry"
    gpu_check.carry_data(carry, preset="tiny")  # as `make gpu-carry` prepares gpu_1b's
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "launch" / "gpu_check.py"), "--out", str(out), "--dry-run", "--carry", str(carry)]
    proc = process.run(cmd, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["logs.tgz", "results.json", "summary.txt"]
    r = json.loads((out / "results.json").read_text())
    assert set(r["steps"]) == {*gpu_check.STEPS, "estimate", "megablocks"}
    for name in gpu_check.STEPS:
        assert r["steps"][name]["rc"] == 0 and not r["steps"][name]["cut"], (name, r["steps"][name])
    assert r["wall_s"] <= 120, r["wall_s"]
    # every number the summary and the docs' rows are made of was read from the steps' own output
    assert r["env"]["device"] == "cpu" and r["env"]["torch"]
    assert r["train"]["steps"] == 3 and r["train"]["tokens_per_s"] > 0 and r["train"]["loss_last"] > 0
    assert len(r["bench_moe"]) == 3 and all(float(row["ours/dense"]) > 0 for row in r["bench_moe"])
    assert r["bench_train"]["ours_over_hf"] > 0 and r["bench_train"]["ours_over_dense"] > 0
    assert r["estimate_gib"] > 0
    rows = gpu_check.doc_rows(r).splitlines()
    assert len(rows) == 3 and all(row.startswith("| ") and row.endswith(" |") for row in rows)
    summary = (out / "summary.txt").read_text()
    assert "train: 3 steps" in summary and "whole step: ours/HF best" in summary
    with tarfile.open(out / "logs.tgz") as tar:
        names = set(tar.getnames())
    assert {f"logs/{s}.log" for s in [*gpu_check.STEPS, "estimate"]} | {"logs/metrics.jsonl"} <= names


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
