"""The first GPU run, in one call that fits a short lease: `make gpu-check OUT=dir` (= `python launch/gpu_check.py
--out dir`), budgeted to BUDGET_S of wall time in all, every step cut at its own budget and reported, never the call.

    python launch/gpu_check.py --out OUT              # on the GPU machine (the carried tree, .gpu_carry/ with it)
    python launch/gpu_check.py --out OUT --dry-run    # anywhere: every step at tiny shapes on CPU (the suite runs it)
    python launch/gpu_check.py --read OUT             # the returned files as the rows of docs/gpu.md and the README
    python launch/gpu_check.py --carry-data .gpu_carry   # make gpu-carry: the token shards the train step reads

Steps, in order of value (STEPS): the environment (what the carried wheels install, versions, the attention
backend MLA's head sizes get), the GPU tests, the MoE layer in bf16 (ours against the dense twin and HF), a short
gpu_1b training run (tokens/s, MFU, peak memory against `moe-lm estimate`, the loss), the whole step against HF and
the dense twin (`bench train --peers`, without the compiled arm: compiling gpu_1b alone can take minutes), and
MegaBlocks only with the time left. OUT receives three files: summary.txt, results.json and logs.tgz (every step's
log, the run's metrics.jsonl). Only the standard library is imported here: on a bare machine this runs before the
wheels are installed.
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

BUDGET_S = 420  # the whole call, wall time: 7 of a lease's 15 minutes, leaving a rerun
# step -> seconds; they add up to 390, the rest is the wheels' install, the estimate and the summary
STEPS = {"env": 30, "tests": 60, "bench_moe": 60, "train": 150, "bench_train": 90}
RESERVE_S = BUDGET_S - sum(STEPS.values())
CARRY = Path(".gpu_carry")  # whl/ (make gpu-wheels) and data/ (make gpu-carry): carried beside the tree
CARRY_LIMIT_MIB = 48  # tree + wheels + data: the device takes 64 MiB with the tree
DATA = ["data.max_mb_per_domain=0.5"]  # the slice of the embedded corpus prepared for the carry, read by `train`
# What the GPU machine lacks (its image holds torch, transformers, sentencepiece, safetensors, xxhash, ...)
WHEELS = ["deepspeed", "hjson", "pydantic", "pydantic_core", "annotated_types", "typing_inspection"]
ROOT = Path(__file__).resolve().parents[1]  # the checkout: steps run there (tests/, launch/)


def plan(dry_run: bool, carry: Path, work: Path) -> dict[str, list[str]]:
    """Each step's command: the GPU run's, or the same at tiny shapes on the CPU (`dry_run`)."""
    py = sys.executable
    preset, device, dtype = ("tiny", "cpu", "float32") if dry_run else ("gpu_1b", "cuda", "bfloat16")
    steps = 3 if dry_run else 100
    small = ["train.micro_batch_size=2", "train.seq_len=32"] if dry_run else []
    return {
        "env": [py, str(ROOT / "launch" / "gpu_check.py"), "--env", str(work / "env.json")],
        "tests": [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/gpu",
                  "tests/ops/test_megablocks.py"],
        "bench_moe": [py, "-m", "moe_lm.bench", "moe", "--device", device, "--dtype", dtype,
                      *(["--shapes", "cpu", "--tokens", "256", "--seq-len", "128", "--reps", "1", "--warmup", "0"]
                        if dry_run else ["--reps", "5", "--warmup", "2"])],
        "train": [py, "-m", "moe_lm.cli.train", "--config", preset, "--out", str(work / "run"),
                  f"train.max_steps={steps}", "optim.warmup_steps=10", f"cadence.eval_interval={steps}",
                  "cadence.ckpt_interval=0", f"cadence.log_interval={1 if dry_run else 10}", "cadence.eval_batches=1",
                  "logging.wandb_mode=disabled", f"data.out_dir={carry / 'data'}", *DATA, *small],
        "bench_train": [py, "-m", "moe_lm.bench", "train", "--peers", "--no-compile", "--config", preset, "--device",
                        device, "--dtype", dtype, "--rounds", "1" if dry_run else "3", "--warmup", "0" if dry_run
                        else "1", *small],
        "estimate": [py, "-m", "moe_lm.cli.estimate", "--config", preset, "--world", "1"],
    }  # fmt: skip


def run_check(out: Path, carry: Path, dry_run: bool) -> dict:
    """Every step within its budget and the call's; writes OUT/summary.txt, results.json, logs.tgz."""
    start = time.monotonic()
    deadline = start + BUDGET_S
    out.mkdir(parents=True, exist_ok=True)
    # why mkdtemp (0700, a new name): the carried wheels go into work/site, first on every step's PYTHONPATH; a
    # shared, predictable folder there would run whatever sitecustomize.py another user planted in it
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    logs = work / "logs"
    logs.mkdir()
    site = work / "site"
    env = step_environment(site, dry_run)
    results = {
        "dry_run": dry_run,
        "budget_s": BUDGET_S,
        "preset": "tiny" if dry_run else "gpu_1b",
        "dtype": "fp32" if dry_run else "bf16",
        "steps": {},
        "install": install_wheels(carry, site, env, logs),
    }
    if not dry_run and not cuda_visible(env):
        results["error"] = "no CUDA GPU visible to this Python (torch.cuda.is_available() is false)"
    commands = plan(dry_run, carry, work)
    for name, budget in STEPS.items():
        if "error" in results:
            break
        results["steps"][name] = run_step(name, commands[name], budget, deadline, env, logs)
    if "error" not in results:
        results["steps"]["estimate"] = run_step("estimate", commands["estimate"], 20, deadline, env, logs)
        results["steps"]["megablocks"] = megablocks(carry, site, deadline, env, logs, dry_run)
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
    return results


def step_environment(site: Path, dry_run: bool) -> dict[str, str]:
    """The steps' environment: the checkout and `site` (this call's private folder of carried wheels) first."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(site), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = f"{site / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    # why: no JIT build of our CPU kernels on the GPU machine (a minute of g++); unbuffered logs survive a cut
    env |= {"PYTHONUNBUFFERED": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    if not dry_run:
        env |= {"MOE_LM_CPU_KERNEL": "0", "DS_ACCELERATOR": "cuda"}
    return env


def install_wheels(carry: Path, site: Path, env: dict, logs: Path) -> dict:
    """The carried wheels of what this Python lacks, into `site` (never from the network)."""
    missing = not_importable(WHEELS, env)
    record = {"missing": missing}
    if missing:
        wheels = sorted((carry / "whl").glob("*.whl"))
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target",
               str(site), *map(str, wheels)]  # fmt: skip
        with open(logs / "install.log", "w") as log:
            record["rc"] = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=120).returncode
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


def megablocks(carry: Path, site: Path, deadline: float, env: dict, logs: Path, dry_run: bool) -> dict:
    """MegaBlocks' build from carried sources, only with the time that is left (it is optional, and slow)."""
    sources = sorted((carry / "whl" / "src").glob("*.tar.gz"))
    left = deadline - time.monotonic()
    if dry_run or not sources or left < 120:
        why = "dry run" if dry_run else "no sources carried" if not sources else f"only {left:.0f} s left"
        return {"rc": None, "seconds": 0.0, "budget_s": 0, "cut": False, "note": f"skipped: {why}"}
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site),
           *map(str, sources)]  # fmt: skip
    return run_step("megablocks", cmd, int(left) - 10, deadline, env, logs)


# ---- reading what came back ------------------------------------------------------------------------------------


def read_results(work: Path, logs: Path) -> dict:
    """The numbers of the run: environment, training (steady state), benchmarks, estimate."""
    found = {}
    env_file = work / "env.json"
    if env_file.is_file():
        found["env"] = json.loads(env_file.read_text())
    found["train"] = train_numbers(work / "run" / "metrics.jsonl")
    found["bench_moe"] = markdown_rows(read(logs / "bench_moe.log"))
    m = re.search(r"ours eager / HF best ([\d.]+);.*ours eager / dense eager ([\d.]+)", read(logs / "bench_train.log"))
    found["bench_train"] = {"ours_over_hf": float(m[1]), "ours_over_dense": float(m[2])} if m else {}
    m = re.search(r"total\s+([\d.]+) GiB per GPU", read(logs / "estimate.log"))
    found["estimate_gib"] = float(m[1]) if m else None
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
    inst = r["install"]
    if inst["missing"]:
        lines.append(f"install: {' '.join(inst['missing'])} from the carried wheels, rc {inst.get('rc')}; still "
                     f"missing: {' '.join(inst.get('still_missing', [])) or 'none'}")  # fmt: skip
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
    for row in r.get("bench_moe", []):
        lines.append(f"moe layer d={row.get('d')} E={row.get('E')} k={row.get('k')}: ours/dense "
                     f"{row.get('ours/dense')}, ours/best HF {row.get('ours/best HF')}")  # fmt: skip
    b = r.get("bench_train") or {}
    if b:
        lines.append(f"whole step: ours/HF best {b['ours_over_hf']:.3f}, ours/dense {b['ours_over_dense']:.3f}")
    return "\n".join(lines) + "\n"


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
    return "\n".join(rows)


# ---- the environment step (runs in its own process) --------------------------------------------------------------


def environment(path: Path) -> None:
    """Versions, the device, and which attention backends take MLA's head sizes (q/k 192, v 128), into `path`."""
    import torch

    record = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}  # fmt: skip
    for module in ("deepspeed", "transformers", "megablocks"):
        try:
            record[module] = __import__(module).__version__
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


# ---- the carry ---------------------------------------------------------------------------------------------------


def carry_data(carry: Path, preset: str = "gpu_1b") -> Path:
    """The token shards the train step reads: the DATA slice of the embedded corpus, with `preset`'s tokenizer
    settings, into carry/data."""
    from moe_lm.config import load_config, preset_path
    from moe_lm.data.prepare import prepare_data

    cfg = load_config(preset_path(preset), [f"data.out_dir={carry / 'data'}", *DATA])
    return prepare_data(cfg.data, cfg.model.vocab_size, seed=cfg.seed)


def size_mib(*paths: Path) -> float:
    return sum(f.stat().st_size for p in paths if p.exists() for f in p.rglob("*") if f.is_file()) / 2**20


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python launch/gpu_check.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--out", help="the folder that comes back: summary.txt, results.json, logs.tgz")
    ap.add_argument("--carry", default=str(CARRY), help="the carried folder: whl/ and data/")
    ap.add_argument("--dry-run", action="store_true", help="every step at tiny shapes on the CPU")
    ap.add_argument("--read", metavar="OUT", help="print the rows of docs/gpu.md and the README from OUT")
    ap.add_argument("--carry-data", metavar="DIR", help="prepare the token shards the train step reads into DIR/data")
    ap.add_argument("--env", metavar="FILE", help=argparse.SUPPRESS)  # the environment step (internal)
    args = ap.parse_args(argv)
    if args.env:
        environment(Path(args.env))
    elif args.read:
        print(doc_rows(json.loads((Path(args.read) / "results.json").read_text())))
    elif args.carry_data:
        carry_data(Path(args.carry_data))
        whl, data = Path(args.carry_data) / "whl", Path(args.carry_data) / "data"
        print(f"carry: {args.carry_data} = {size_mib(whl):.1f} MiB of wheels + {size_mib(data):.1f} MiB of data")
    elif args.out:
        results = run_check(Path(args.out), Path(args.carry), args.dry_run)
        failed = "error" in results or any(s["rc"] not in (0, None) or s["cut"] for s in results["steps"].values())
        sys.exit(1 if failed else 0)
    else:
        ap.error("give --out OUT (or --read OUT, --carry-data DIR)")


if __name__ == "__main__":
    main()
