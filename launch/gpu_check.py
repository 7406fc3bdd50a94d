"""The first GPU run, in one call: `python3 launch/gpu_check.py --out dir` (= `make gpu-check OUT=dir`), budgeted to
BUDGET_S of wall time in all, every step cut at its own budget and reported, never the call. For a GPU machine that
may have no network (a rented node billed by the minute, an air-gapped cluster): what it lacks is carried there.

    python launch/gpu_check.py --carry-wheels .gpu_carry            # here, with network: the wheels, pinned
    python launch/gpu_check.py --carry-data .gpu_carry              # here: the token shards; prints the payload
    python3 launch/gpu_check.py --out OUT                           # there (the tree, .gpu_carry/ beside it)
    python launch/gpu_check.py --out OUT --dry-run                  # anywhere: every step at tiny shapes on CPU
    python launch/gpu_check.py --read OUT                           # the returned files as rows for the docs

Steps, in order of value (STEPS): the environment (what the carried wheels installed, versions, the attention
backend MLA's head sizes get), the GPU tests, a short gpu_1b training run with the defaults (compiled on a GPU:
tokens/s, MFU, peak memory against `moe-lm estimate`, the loss), the step before issue 65's changes against each
change and as it is, eager and compiled (`bench train --speed`), the whole step against HF, the dense twin and
torchtitan's DeepSeek-V3 (`bench train --peers`, eager), one training step under torch.profiler (the top CUDA
kernels, the share of routing, dispatch, expert GEMMs, attention, loss, optimizer), the MoE layer in bf16 (ours
against the dense twin and HF), the memory estimate. OUT receives three files, whatever happens:
summary.txt, results.json and logs.tgz (every step's log, the run's metrics.jsonl). Only the standard library is
imported here: on a bare machine this runs before the wheels are installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

BUDGET_S = 450  # the whole call, wall time: under the run's 480 s limit; a machine's start-up and this call leave a
# 15-minute lease about 4 minutes for a rerun of what broke
# step -> seconds (415 in all); the rest, RESERVE_S, is the wheels' install and the summary. The H200's first call
# took env 9, tests 13, train 75 (200 eager steps), profile 15, bench_train 32 (without torchtitan's arm, whose
# FlexAttention compiles with its max-autotune options in the arm's first step, for a time not yet measured),
# bench_moe 27 (5 rounds; 3 now) and estimate 4 s; speed is new: four eager arms and two compilations of gpu_1b
# (a compiled 90-step run took 55 s in all there)
STEPS = {"env": 15, "tests": 25, "train": 100, "speed": 80, "bench_train": 140, "profile": 20, "bench_moe": 25,
         "estimate": 10}  # fmt: skip
RESERVE_S = BUDGET_S - sum(STEPS.values())
DRY_RUN_SCALE = 4  # a dry run's budgets, the call's included, are this many times longer: on a loaded 2-core host
# the CPU steps ran into the GPU budgets (the cut itself is tested on its own, tests/test_gpu_check.py)
# the train step: gpu_1b at micro-batch 8 x 2048, no accumulation (16,384 tokens a step); at 10 % MFU on an H100
# its steps end TRAIN_START_S (imports, DeepSpeed, the model, the first step) and TRAIN_COMPILE_S (torch.compile of
# the blocks for training and for the final evaluation: about 15 s on the H200) before the step's budget
TRAIN_STEPS, TRAIN_START_S, TRAIN_COMPILE_S = 150, 35, 20
CARRY = Path(".gpu_carry")  # whl/ (--carry-wheels) and data/ (--carry-data): carried beside the tree
CARRY_LIMIT_MIB = 48  # tree + wheels + data: what a 64 MiB transfer leaves room for
DATA = ["data.max_mb_per_domain=0.5"]  # the slice of the embedded corpus prepared for the carry, read by `train`
# module -> distribution of what a GPU machine may lack (an image with torch and transformers has the rest),
# carried at the versions of the venv that makes the carry: typing_extensions too, because the carried pydantic
# needs >= 4.14 (`cannot import name 'Sentinel'` under 4.10-4.13) and a carried copy shadows an older one; torchtitan
# (pure Python, installed without its declared dependencies) and the three its model code imports
CARRIED = {"deepspeed": "deepspeed", "hjson": "hjson", "pydantic": "pydantic", "pydantic_core": "pydantic-core",
           "annotated_types": "annotated-types", "typing_inspection": "typing-inspection",
           "typing_extensions": "typing-extensions", "torchtitan": "torchtitan", "tyro": "tyro",
           "docstring_parser": "docstring-parser", "spmd_types": "spmd-types"}  # fmt: skip
# carried at this version whatever the venv holds: the release whose builder the bench's torchtitan arm calls
# (TORCHTITAN in moe_lm/bench/torchtitan_arm.py; `pip install --no-deps` puts it in a venv, no extra can)
PINNED = {"torchtitan": "0.3.0"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
ROOT = Path(__file__).resolve().parents[1]  # the checkout: steps run there (tests/, launch/)


def plan(dry_run: bool, carry: Path, work: Path) -> dict[str, list[str]]:
    """Each step's command: the GPU run's, or the same at tiny shapes on the CPU (`dry_run`), reading the carry's
    own token shards (their vocabulary: gpu_1b's, whatever preset runs)."""
    py = sys.executable
    preset, device, dtype = ("tiny", "cpu", "float32") if dry_run else ("gpu_1b", "cuda", "bfloat16")
    steps = 3 if dry_run else TRAIN_STEPS
    small = ["train.micro_batch_size=2", "train.seq_len=32"] if dry_run else []
    vocab = [f"model.vocab_size={carried_vocab(carry)}"] if dry_run else []
    rounds = ["--rounds", "1", "--warmup", "0"] if dry_run else ["--rounds", "3", "--warmup", "1"]
    return {
        "env": [py, str(ROOT / "launch" / "gpu_check.py"), "--env", str(work / "env.json")],
        "tests": [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/gpu",
                  "tests/ops/test_megablocks.py"],
        "train": [py, "-m", "moe_lm.cli.train", "--config", preset, "--out", str(work / "run"),
                  f"train.max_steps={steps}", "train.grad_accum_steps=1", "optim.warmup_steps=10",
                  f"cadence.eval_interval={steps}", "cadence.ckpt_interval=0",
                  f"cadence.log_interval={1 if dry_run else 10}", "cadence.eval_batches=1",
                  "logging.wandb_mode=disabled", f"data.out_dir={carry / 'data'}", *DATA, *vocab, *small],
        # the dry run leaves the compiled arms out: two compilations on a loaded CPU cost the suite a minute, and
        # tests/bench/test_benchmarks.py runs them
        "speed": [py, "-m", "moe_lm.bench", "train", "--speed", *(["--no-compile"] if dry_run else []), "--config",
                  preset, "--device", device, "--dtype", dtype, *rounds, *small],
        "bench_train": [py, "-m", "moe_lm.bench", "train", "--peers", "--no-compile", "--config", preset, "--device",
                        device, "--dtype", dtype, *rounds, *small],
        "profile": [py, "-m", "moe_lm.bench", "profile", "--config", preset, "--device", device, "--dtype", dtype,
                    "--warmup", "1" if dry_run else "3", *small],
        "bench_moe": [py, "-m", "moe_lm.bench", "moe", "--device", device, "--dtype", dtype,
                      *(["--shapes", "cpu", "--tokens", "256", "--seq-len", "128", "--reps", "1", "--warmup", "0"]
                        if dry_run else ["--reps", "3", "--warmup", "1"])],
        "estimate": [py, "-m", "moe_lm.cli.estimate", "--config", preset, "--world", "1"],
    }  # fmt: skip


def carried_vocab(carry: Path) -> int:
    """The vocabulary the carried token shards were prepared with (0 when there are none: the step then says so)."""
    try:
        return int(json.loads((carry / "data" / "meta.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError):
        return 0


def run_check(out: Path, carry: Path, dry_run: bool) -> dict:
    """Every step within its budget and the call's; writes OUT/summary.txt, results.json and logs.tgz on every way
    out (a step that fails, pip timing out, an error of this script, Ctrl-C)."""
    scale = DRY_RUN_SCALE if dry_run else 1
    start = time.monotonic()
    deadline = start + BUDGET_S * scale
    out.mkdir(parents=True, exist_ok=True)
    # why mkdtemp (0700, a new name): the carried wheels go into work/site, first on every step's PYTHONPATH; a
    # shared, predictable folder there would run whatever sitecustomize.py another user planted in it
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    logs = work / "logs"
    logs.mkdir()
    site = work / "site"
    env = step_environment(site, dry_run)
    results = {"dry_run": dry_run, "budget_s": BUDGET_S * scale, "preset": "tiny" if dry_run else "gpu_1b",
               "dtype": "fp32" if dry_run else "bf16", "steps": {}}  # fmt: skip
    try:
        # a dry run installs every carried wheel, even what this Python has: the offline install is what it checks
        results["install"] = install_wheels(carry, site, env, logs, everything=dry_run)
        if not dry_run and not cuda_visible(env):
            results["error"] = "no CUDA GPU visible to this Python (torch.cuda.is_available() is false)"
        commands = plan(dry_run, carry, work)
        for name, budget in STEPS.items():
            if "error" in results:
                break
            results["steps"][name] = run_step(name, commands[name], budget * scale, deadline, env, logs)
    except BaseException as e:  # noqa: BLE001 - whatever ends the call, the files below are written
        results["error"] = f"the check itself stopped: {type(e).__name__}: {e}"
        if not isinstance(e, Exception):
            raise
    finally:
        finish(results, out, work, logs, start)
    return results


def finish(results: dict, out: Path, work: Path, logs: Path, start: float) -> None:
    """OUT/results.json, summary.txt and logs.tgz from what the call got to, then its private folder removed."""
    results |= read_results(work, logs)
    results["wall_s"] = round(time.monotonic() - start, 1)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "summary.txt").write_text(summary(results))
    metrics = work / "run" / "metrics.jsonl"
    if metrics.is_file():
        shutil.copy(metrics, logs / "metrics.jsonl")
    with tarfile.open(out / "logs.tgz", "w:gz") as tar:
        tar.add(logs, arcname="logs")
    shutil.rmtree(work, ignore_errors=True)
    print((out / "summary.txt").read_text(), end="")


def step_environment(site: Path, dry_run: bool) -> dict[str, str]:
    """The steps' environment: the checkout and `site` (this call's private folder of carried wheels) first."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(site), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = f"{site / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    # why: no JIT build of our CPU kernels on the GPU machine (a minute of g++); unbuffered logs survive a cut
    env |= {"PYTHONUNBUFFERED": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    env["GPU_CHECK_SITE"] = str(site)  # the environment step reports which modules came from the carry
    if not dry_run:
        env |= {"MOE_LM_CPU_KERNEL": "0", "DS_ACCELERATOR": "cuda"}
    return env


def install_wheels(carry: Path, site: Path, env: dict, logs: Path, everything: bool = False) -> dict:
    """The carried wheels of what this Python lacks (`everything`: all of them), into `site`, never from the
    network; a pip that does not finish in time is a result too."""
    missing = list(CARRIED) if everything else not_importable(list(CARRIED), env)
    record: dict = {"missing": missing}
    if missing:
        wheels = sorted((carry / "whl").glob("*.whl"))
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target",
               str(site), *map(str, wheels)]  # fmt: skip
        with open(logs / "install.log", "w") as log:
            try:
                proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=120)
                record["rc"] = proc.returncode
            except subprocess.TimeoutExpired:
                record["rc"], record["error"] = None, "pip install did not finish in 120 s"
        record["still_missing"] = not_importable(missing, env)
    return record


def not_importable(modules: list[str], env: dict) -> list[str]:
    """Those of `modules` this Python cannot find with `env` (one interpreter asks for all of them)."""
    code = f"import importlib.util; print(' '.join(m for m in {modules!r} if importlib.util.find_spec(m) is None))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return out.stdout.split()


def cuda_visible(env: dict) -> bool:
    code = "import torch, sys; sys.exit(not torch.cuda.is_available())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True).returncode == 0


def run_step(name: str, cmd: list[str], budget: int, deadline: float, env: dict, logs: Path) -> dict:
    """Run one step for at most its budget (less when the call's deadline is nearer); a step over it is killed and
    reported as cut."""
    limit = max(0.0, min(budget, deadline - time.monotonic()))
    if limit < 1:
        return {"rc": None, "seconds": 0.0, "budget_s": budget, "cut": True, "note": "no time left"}
    t0 = time.monotonic()
    with open(logs / f"{name}.log", "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=limit, cwd=ROOT)
            rc, cut = proc.returncode, False
        except subprocess.TimeoutExpired:
            rc, cut = None, True
    return {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "budget_s": budget, "cut": cut}


# ---- reading what came back ------------------------------------------------------------------------------------


def read_results(work: Path, logs: Path) -> dict:
    """The numbers of the run: environment, training (steady state), benchmarks, estimate."""
    found = {}
    env_file = work / "env.json"
    if env_file.is_file():
        found["env"] = json.loads(env_file.read_text())
    found["train"] = train_numbers(work / "run" / "metrics.jsonl")
    found["bench_moe"] = markdown_rows(read(logs / "bench_moe.log"))
    found["bench_train"] = whole_step_ratios(read(logs / "bench_train.log"))
    found["speed"] = speed_ratios(read(logs / "speed.log"))
    m = re.search(r"^shares: (.+)$", read(logs / "profile.log"), re.MULTILINE)
    found["profile"] = {k: float(v) for k, v in re.findall(r"([a-zA-Z][\w ]*?) ([\d.]+) %", m[1])} if m else {}
    m = re.search(r"total\s+([\d.]+) GiB per GPU", read(logs / "estimate.log"))
    found["estimate_gib"] = float(m[1]) if m else None
    return found


def whole_step_ratios(log: str) -> dict:
    """`bench train --peers`' ratios line: ours over HF's best and over the dense twin, and over torchtitan where its
    arm ran (else why it was left out)."""
    m = re.search(r"ours eager / HF best ([\d.]+);.*ours eager / dense eager ([\d.]+)", log)
    if not m:
        return {}
    found = {"ours_over_hf": float(m[1]), "ours_over_dense": float(m[2])}
    titan = re.search(r"ours eager / torchtitan ([\d.]+)", log)
    left_out = re.search(r"^torchtitan arm left out: (.+)$", log, re.MULTILINE)
    if titan:
        found["ours_over_torchtitan"] = float(titan[1])
    elif left_out:
        found["torchtitan_left_out"] = left_out[1]
    return found


def speed_ratios(log: str) -> dict:
    """`bench train --speed`'s ratios line (now over before issue 65, eager and compiled; each change alone) and the
    model step's tokens/s as it is, compiled where that arm ran (the loop's against it: the loop's own cost)."""
    m = re.search(r"now / before issue 65: eager ([\d.]+)(?:, compiled ([\d.]+))?; the dispatch change alone "
                  r"([\d.]+), the attention change alone ([\d.]+)", log)  # fmt: skip
    if not m:
        return {}
    found = {"eager": float(m[1]), "dispatch": float(m[3]), "attention": float(m[4])}
    if m[2]:
        found["compiled"] = float(m[2])
    for arm in ("now compiled", "now"):
        row = re.search(rf"^\| {arm} \| [^|]+\| ([\d,]+) \|", log, re.MULTILINE)
        if row:
            found["model_step_tokens_per_s"], found["model_step_arm"] = float(row[1].replace(",", "")), arm
            break
    return found


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def train_numbers(metrics: Path) -> dict:
    """Steady state of the short run (the last two thirds of the logged steps), the first and last loss."""
    if not metrics.is_file():
        return {}
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("kind") == "train"]
    if not train:
        return {}
    steady = train[len(train) // 3 :]
    return {
        "steps": train[-1]["step"],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "mfu": statistics.median(r.get("mfu", 0.0) for r in steady),
        "peak_mem_gib": max(r.get("peak_mem_gib", 0.0) for r in train),
        "loss_first": train[0]["loss"],
        "loss_last": train[-1]["loss"],
    }


def markdown_rows(text: str) -> list[dict]:
    """The rows of the first markdown table in `text`, as {column: cell}."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    if len(lines) < 3:
        return []
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in line.strip("|").split("|")), strict=False)) for line in lines[2:]]


def summary(r: dict) -> str:
    lines = [f"gpu_check ({'dry run, CPU' if r['dry_run'] else 'GPU'}): {r['wall_s']:.0f} s of {r['budget_s']} s"]
    if "error" in r:
        lines.append(f"error: {r['error']}")
    inst = r.get("install") or {}
    if inst.get("missing"):
        lines.append(f"install: {' '.join(inst['missing'])} from the carried wheels, rc {inst.get('rc')}"
                     f"{'; ' + inst['error'] if inst.get('error') else ''}; still missing: "
                     f"{' '.join(inst.get('still_missing', [])) or 'none'}")  # fmt: skip
    for name, s in r["steps"].items():
        state = s.get("note") or ("CUT at its budget" if s["cut"] else f"rc {s['rc']}")
        lines.append(f"{name:<12} {s['seconds']:>6.1f} s of {s['budget_s']:>3} s  {state}")
    env = r.get("env", {})
    if env:
        lines.append(f"device: {env.get('device')}; torch {env.get('torch')}, CUDA {env.get('cuda')}; "
                     f"MLA attention backends: {', '.join(env.get('sdpa_backends', [])) or 'n/a'}")  # fmt: skip
    t = r.get("train") or {}
    if t:
        est = r.get("estimate_gib")
        lines.append(f"train: {t['steps']} steps; {t['tokens_per_s']:,.0f} tokens/s, MFU {100 * t['mfu']:.1f} %, "
                     f"peak {t['peak_mem_gib']:.1f} GiB (estimate {est if est is not None else 'n/a'} GiB); loss "
                     f"{t['loss_first']:.3f} -> {t['loss_last']:.3f}")  # fmt: skip
    sp = r.get("speed") or {}
    if sp:
        compiled = f", compiled {sp['compiled']:.3f}" if "compiled" in sp else ""
        lines.append(f"speed, now / before issue 65: eager {sp['eager']:.3f}{compiled}; the dispatch change alone "
                     f"{sp['dispatch']:.3f}, the attention change alone {sp['attention']:.3f}")  # fmt: skip
        if t and sp.get("model_step_tokens_per_s"):
            lines.append(f"the loop at {t['tokens_per_s'] / sp['model_step_tokens_per_s']:.3f}x the model step "
                         f"({sp['model_step_arm']})")  # fmt: skip
    for row in r.get("bench_moe", []):
        lines.append(f"moe layer d={row.get('d')} E={row.get('E')} k={row.get('k')}: ours/dense "
                     f"{row.get('ours/dense')}, ours/best HF {row.get('ours/best HF')}")  # fmt: skip
    b = r.get("bench_train") or {}
    if b:
        ratios = f"ours/HF best {b['ours_over_hf']:.3f}, ours/dense {b['ours_over_dense']:.3f}"
        lines.append(f"whole step: {ratios}{torchtitan_note(b)}")
    if r.get("profile"):
        lines.append("one step, profiled: " + ", ".join(f"{k} {v:.1f} %" for k, v in r["profile"].items()))
    return "\n".join(lines) + "\n"


def torchtitan_note(b: dict) -> str:
    """The summary's words on torchtitan's arm: its ratio, or why it was left out."""
    if "ours_over_torchtitan" in b:
        return f", ours/torchtitan {b['ours_over_torchtitan']:.3f}"
    return f"; torchtitan left out: {b['torchtitan_left_out']}" if "torchtitan_left_out" in b else ""


def doc_rows(results: dict) -> str:
    """The returned results as the rows docs/gpu.md and the README's "Measured" table take."""
    env, t, b = results.get("env", {}), results.get("train") or {}, results.get("bench_train") or {}
    device = f"{env.get('device', '?')}, torch {env.get('torch', '?')}"
    preset, dtype = results.get("preset", "gpu_1b"), results.get("dtype", "bf16")
    rows = []
    if t:
        rows.append(f"| {preset} training, one device ({device}) | {t['tokens_per_s']:,.0f} tokens/s, MFU "
                    f"{100 * t['mfu']:.1f} %, peak {t['peak_mem_gib']:.1f} GiB (estimated "
                    f"{results.get('estimate_gib')} GiB), loss {t['loss_first']:.2f} -> {t['loss_last']:.2f} "
                    f"in {t['steps']} steps | `make gpu-check` |")  # fmt: skip
    sp = results.get("speed") or {}
    if sp:
        compiled = f", compiled {sp['compiled']:.2f}x" if "compiled" in sp else ""
        rows.append(f"| whole {preset} step, {dtype} ({device}): now over before issue 65 | eager {sp['eager']:.2f}x"
                    f"{compiled}; dispatch alone {sp['dispatch']:.2f}x, attention alone {sp['attention']:.2f}x | "
                    "`moe-lm bench train --speed` |")  # fmt: skip
    ratios = [(r.get("ours/dense"), r.get("ours/best HF")) for r in results.get("bench_moe", [])]
    if ratios:
        moe = ", ".join(f"{d}x dense / {h}x HF" for d, h in ratios)
        rows.append(f"| MoE layer, {dtype} ({device}): ours over the dense twin / over HF's best | {moe} | "
                    "`moe-lm bench moe --device cuda --dtype bfloat16` |")  # fmt: skip
    if b:
        rows.append(
            f"| whole {preset} step, {dtype} ({device}): ours over HF's best / over the dense twin | "
            f"{b['ours_over_hf']:.2f}x / {b['ours_over_dense']:.2f}x | `moe-lm bench train --peers` |"
        )
    if "ours_over_torchtitan" in b:
        rows.append(f"| whole {preset} step, {dtype} ({device}): ours over torchtitan's DeepSeek-V3 (its defaults) | "
                    f"{b['ours_over_torchtitan']:.2f}x | `moe-lm bench train --peers` |")  # fmt: skip
    if results.get("profile"):
        shares = ", ".join(f"{k} {v:.0f} %" for k, v in results["profile"].items())
        rows.append(f"| one {preset} training step, {dtype} ({device}), where the time goes | {shares} | "
                    "`moe-lm bench profile` |")  # fmt: skip
    return "\n".join(rows)


# ---- the environment step (runs in its own process) --------------------------------------------------------------


def environment(path: Path) -> None:
    """Versions, the device, and which attention backends take MLA's head sizes (q/k 192, v 128), into `path`."""
    import torch

    record = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}  # fmt: skip
    site = os.environ.get("GPU_CHECK_SITE", "")
    record["from_carry"] = []
    for module in ("deepspeed", "transformers", "pydantic", "typing_extensions", "torchtitan", "triton", "megablocks"):
        try:
            imported = __import__(module)
            record[module] = getattr(imported, "__version__", None) or _version(CARRIED.get(module, module))
            if site and str(getattr(imported, "__file__", "")).startswith(site):
                record["from_carry"].append(module)
        except Exception as e:  # noqa: BLE001 - any failure to import is what this step reports
            record[module] = f"not importable ({type(e).__name__}: {str(e)[:120]})"
    if torch.cuda.is_available():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q = torch.randn(1, 16, 128, 192, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, 16, 128, 128, device="cuda", dtype=torch.bfloat16)
        record["sdpa_backends"] = []
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel(backend):
                    torch.nn.functional.scaled_dot_product_attention(q, q, v, is_causal=True)
                record["sdpa_backends"].append(backend.name)
            except RuntimeError:
                pass
    path.write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "?"


# ---- the carry ---------------------------------------------------------------------------------------------------


def pins() -> dict[str, str]:
    """distribution -> the version this Python (the project's venv) has, or PINNED's: what the carry must hold."""
    from importlib.metadata import version

    return {dist: PINNED.get(dist) or version(dist) for dist in CARRIED.values()}


def carry_wheels(carry: Path, python_version: str) -> Path:
    """carry/whl: the CARRIED distributions at `pins()`, as wheels for `python_version` on x86-64 Linux (DeepSpeed
    publishes none: pip builds its pure-Python wheel, no ops compiled). Written whole beside whl/ and renamed into
    place; an old whl/ is replaced only if it holds nothing but wheels."""
    pinned = [f"{dist}=={v}" for dist, v in pins().items()]
    whl = carry / "whl"
    if whl.exists() and any(not p.name.endswith(".whl") for p in whl.iterdir()):
        sys.exit(f"error: {whl} holds more than wheels; give another --carry-wheels folder or empty it yourself")
    fresh = Path(tempfile.mkdtemp(prefix=".whl.", dir=carry if carry.is_dir() else _made(carry)))
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", str(fresh), pinned[0]], check=True)
    platforms = [flag for p in PLATFORMS for flag in ("--platform", p)]
    subprocess.run([*pip, "download", "-q", "--only-binary=:all:", "--no-deps", "--python-version", python_version,
                    "--implementation", "cp", *platforms, "-d", str(fresh), *pinned[1:]], check=True)  # fmt: skip
    if whl.exists():
        shutil.rmtree(whl)  # wheels only (checked above)
    fresh.rename(whl)
    return whl


def _made(folder: Path) -> Path:
    folder.mkdir(parents=True)
    return folder


def carry_data(carry: Path, preset: str = "gpu_1b") -> Path:
    """The token shards the train step reads: the DATA slice of the embedded corpus, with `preset`'s tokenizer
    settings, into carry/data."""
    from moe_lm.config import load_config, preset_path
    from moe_lm.data.prepare import prepare_data

    cfg = load_config(preset_path(preset), [f"data.out_dir={carry / 'data'}", *DATA])
    return prepare_data(cfg.data, cfg.model.vocab_size, seed=cfg.seed)


def payload(carry: Path) -> tuple[str, bool]:
    """What goes to the GPU machine (the tree as git archives it, and the carry), and whether it fits."""
    tree = len(subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout) / 2**20
    whl, data = size_mib(carry / "whl"), size_mib(carry / "data")
    total = tree + whl + data
    line = (f"payload: tree {tree:.1f} MiB + {carry} {whl + data:.1f} MiB ({whl:.1f} of wheels, {data:.1f} of data) "
            f"= {total:.1f} MiB (limit {CARRY_LIMIT_MIB})")  # fmt: skip
    return line, total <= CARRY_LIMIT_MIB


def size_mib(*paths: Path) -> float:
    return sum(f.stat().st_size for p in paths if p.exists() for f in p.rglob("*") if f.is_file()) / 2**20


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python3 launch/gpu_check.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--out", help="the folder that comes back: summary.txt, results.json, logs.tgz")
    ap.add_argument("--carry", default=str(CARRY), help="the carried folder: whl/ and data/")
    ap.add_argument("--dry-run", action="store_true", help="every step at tiny shapes on the CPU")
    ap.add_argument("--read", metavar="OUT", help="print the rows of docs/gpu.md and the README from OUT")
    ap.add_argument("--carry-wheels", metavar="DIR", help="fetch the pinned wheels into DIR/whl (needs network)")
    ap.add_argument("--python-version", default="3.12", help="with --carry-wheels: the GPU machine's Python")
    ap.add_argument("--carry-data", metavar="DIR", help="prepare the token shards the train step reads into DIR/data")
    ap.add_argument("--env", metavar="FILE", help=argparse.SUPPRESS)  # the environment step (internal)
    args = ap.parse_args(argv)
    if args.env:
        environment(Path(args.env))
    elif args.read:
        print(doc_rows(json.loads((Path(args.read) / "results.json").read_text())))
    elif args.carry_wheels:
        whl = carry_wheels(Path(args.carry_wheels), args.python_version)
        print(f"{whl}: " + ", ".join(p.name for p in sorted(whl.glob("*.whl"))))
    elif args.carry_data:
        carry_data(Path(args.carry_data))
        line, fits = payload(Path(args.carry_data))
        print(line)
        if not fits:
            sys.exit(f"error: the payload is over {CARRY_LIMIT_MIB} MiB: carry less data (DATA in {__file__})")
    elif args.out:
        results = run_check(Path(args.out), Path(args.carry), args.dry_run)
        failed = "error" in results or any(s["rc"] not in (0, None) or s["cut"] for s in results["steps"].values())
        sys.exit(1 if failed else 0)
    else:
        ap.error("give --out OUT (or --read OUT, --carry-wheels DIR, --carry-data DIR)")


if __name__ == "__main__":
    main()
