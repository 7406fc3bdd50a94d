"""Every benchmark end to end at its smallest settings (`moe-lm bench <what>` = `python -m moe_lm.bench <what>`, as a
user runs it): its table's header and a row appear; and every `--help`, of the command and of the launch/ wrappers;
`python -m moe_lm.bench` itself in a process of its own (its wiring: a user error's one line and exit code)."""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from moe_lm.bench.torchtitan_arm import unavailable
from moe_lm.bench.train import peer_arms
from moe_lm.cli.bench import BENCHMARKS
from moe_lm.config import MTPConfig, load_config, preset_path
from moe_lm.model import build_model
from tests.helpers.runs import tiny_train_cfg

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(cli):
    """`bench(what, ...)`: `moe-lm bench what ...` in this process, which must succeed; its stdout."""

    def run(*args) -> str:
        proc = cli("bench", *args, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    return run


def test_moe(bench):
    out = bench("moe", "--shapes", "cpu", "--tokens", 64, "--seq-len", 64, "--reps", 1, "--warmup", 0)
    assert "| d | I | E | k | groups | ours | dense-equiv | ours/dense | loop | HF eager |" in out
    assert "\n| 256 | 256 | 8 | 2 | - | " in out and "TFLOP/s of expert matmuls" in out


def test_loss_measures_each_variant_in_a_child_process(bench):
    out = bench("loss", "--tokens", 64, "--dim", 32, "--vocab", 128, "--chunks", 0, 16, "--rounds", 1, "--iters", 1)
    assert (
        "| loss | peak memory above the inputs, GiB (median) | vs plain | ms per forward+backward | vs plain |" in out
    )
    assert "\n| plain | " in out and "\n| chunk 16 | " in out


def test_train(bench):
    small = "train.micro_batch_size=2 train.seq_len=32"
    out = bench("train", "--arms", small, f"{small} model.mtp.depth=1", "--rounds", 1, "--warmup", 0)
    assert f"| arm | median ms/step (min-max) | tokens/s | model GFLOP/step | time vs {small} |" in out
    assert f"\n| {small} model.mtp.depth=1 | " in out


def test_train_speed_times_the_step_before_issue_65_against_each_change(bench):
    """`--speed`: the step before issue 65, with the dispatch or the attention change undone, and now, eager; then
    before and now compiled (the switched-back attention compiles too); the ratios line the GPU check reads, whose
    numbers are the tables' medians."""
    out = bench("train", "--speed", "--rounds", 1, "--warmup", 0, "train.micro_batch_size=2", "train.seq_len=32")
    medians = {m[1]: float(m[2]) for m in re.finditer(r"^\| ([\w ]+) \| ([\d.]+) \(", out, re.MULTILINE)}
    assert set(medians) == {"before issue 65", "dispatch as before", "attention as before", "now",
                            "before issue 65 compiled", "now compiled"}  # fmt: skip
    line = re.search(r"^now / before issue 65: eager ([\d.]+), compiled ([\d.]+); the dispatch change alone "
                     r"([\d.]+), the attention change alone ([\d.]+)$", out, re.MULTILINE)  # fmt: skip
    now, before = medians["now"], medians["before issue 65"]
    compiled = medians["now compiled"] / medians["before issue 65 compiled"]
    expected = [now / before, compiled, now / medians["dispatch as before"], now / medians["attention as before"]]
    for shown, ratio in zip(line.groups(), expected, strict=True):
        assert float(shown) == pytest.approx(ratio, abs=0.002 + 0.002 * ratio)  # medians printed to 0.1 ms


def test_train_against_peers(bench):
    """`--peers`: ours eager and compiled, HF DeepseekV3ForCausalLM with both expert implementations, the dense
    twin, torchtitan's DeepSeek-V3 where it is installed (else one line says why not), and the ratios line; the HF
    arms hold our weights (their logits are ours) and the dense twin has the active FLOPs of ours."""
    small = ["train.micro_batch_size=2", "train.seq_len=32"]
    out = bench("train", "--peers", "--rounds", 1, "--warmup", 0, *small)
    for arm in ("ours", "ours compiled", "HF eager", "HF grouped_mm", "dense (equal active FLOPs)"):
        assert f"\n| {arm} | " in out
    assert "ours eager / HF best " in out and "ours eager / dense eager " in out
    if unavailable(load_config(preset_path("tiny")).model):
        assert "\ntorchtitan arm left out: " in out
    else:
        assert "\n| torchtitan | " in out
        assert math.isfinite(float(re.search(r"ours eager / torchtitan ([\d.]+)$", out, re.MULTILINE)[1]))
    arms = peer_arms("tiny", small)
    batch = torch.randint(0, 4096, (2, 32))
    with torch.no_grad():
        ours = arms[0].model(batch).logits
        for hf in arms[2:4]:
            torch.testing.assert_close(hf.model(input_ids=batch).logits, ours, atol=1e-4, rtol=1e-4)
    flops = [a.gflops_per_step() for a in arms]
    assert flops[4] == pytest.approx(flops[0], rel=0.01)  # the dense twin: same active matmul FLOPs


GPU_1B_FEATURES = "model.mla.q_lora_rank=32 model.moe.n_routed_experts=16 model.moe.n_group=8 model.moe.topk_group=4 "
GPU_1B_FEATURES += "model.moe.num_experts_per_tok=6 model.moe.routed_scaling_factor=2.5"


@pytest.mark.parametrize("shape", [[], GPU_1B_FEATURES.split()], ids=["tiny", "gpu_1b's features"])
def test_the_torchtitan_arm_builds_our_model(shape, monkeypatch):
    """torchtitan's DeepSeek-V3 as the arm builds it, at the tiny shape and with gpu_1b's features (query LoRA, 8
    expert groups of which the best 4 are eligible, top-6, scaling 2.5; 16 experts for its 64), holds our weights and
    gives our logits in fp32 once the two torchtitan defaults the arm keeps for speed are set to ours: RMSNorm eps
    (its 1e-5, the config's 1e-6) and its routed experts' bf16 casts (off). With them kept, the logits differ by
    ~0.1."""
    from moe_lm.bench.torchtitan_arm import titan_model

    cfg = load_config(preset_path("tiny"), shape).model
    if unavailable(cfg):
        pytest.skip(unavailable(cfg))
    torch.manual_seed(0)
    ours = build_model(cfg).eval()
    theirs = titan_model(ours, flex=False, device="cpu", dtype=torch.float32, norm_eps=cfg.norm_eps)
    assert sum(p.numel() for p in theirs.parameters()) == sum(p.numel() for p in ours.parameters())
    batch = torch.randint(0, cfg.vocab_size, (2, 64))
    # why: GroupedExperts.forward casts tokens and weights with .bfloat16(), whatever the model's dtype
    monkeypatch.setattr(torch.Tensor, "bfloat16", lambda t: t)
    with torch.no_grad():
        torch.testing.assert_close(theirs(batch), ours(batch).logits, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def mtp_run(tmp_path_factory, tiny_data, train):
    """A run with an MTP module (a model change: not one of the shared trained runs)."""
    run = tmp_path_factory.mktemp("bench_mtp") / "run"
    cfg = tiny_train_cfg(tiny_data, run, max_steps=2)
    train(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mtp=MTPConfig(depth=1))))
    return run


def test_decode(mtp_run, bench):
    out = bench("decode", "--run", mtp_run, "--prompts", 2, "--prompt-tokens", 8, "--max-new-tokens", 8, "--rounds", 2)
    assert "2 prompts of 8 tokens, 8 new tokens each" in out
    assert "tokens/s | MTP speculative" in out and "drafts accepted: depth 1 " in out
    assert "greedy outputs identical" in out


def test_routing(bench):
    flags = ["--hidden", 64, "--layers", 2, "--experts", 8, "--k", 2, "--tokens", 256, "--seq-len", 64]
    out = bench("routing", *flags, "--batch-size", 2, "--rounds", 1)
    assert "# DeepseekV3 hidden 64, 2 layers, 8 experts top-2" in out
    assert "plain forward: " in out and "recording: " in out and "recording overhead " in out


def test_served(bench, trained_run, cli, tmp_path):
    assert cli("export", "--run", trained_run(), "--gguf", tmp_path / "m.gguf").returncode == 0
    out = bench("served", "--gguf", tmp_path / "m.gguf", "--windows", 2, "--seq-len", 32, "--rounds", 1)
    assert "llama.cpp: " in out and "llama.cpp + routing callback: " in out and "routing callback: " in out


def test_profile_places_each_operation_in_its_part_of_the_step(bench):
    """`bench profile`: its two tables and the shares line; and, on the profiled step itself, every operation whose
    name says what it is lands in that part, forward and backward alike (attention's kernels in attention, the
    router's sigmoid in routing, the CPU kernels' segment GEMMs in the expert GEMMs, the loss's and the optimizer's
    in theirs), and the parts add up to the whole step."""
    from moe_lm.bench.profile import PARTS, ProfileBench, parts, placed, profiled_step, top_kernels

    small = ["train.micro_batch_size=2", "train.seq_len=32"]
    out = bench("profile", "--warmup", 1, *small)
    assert "| operation (CPU) | ms | share |" in out and "| part of the step | ms | share |" in out
    assert "\nshares: routing " in out and all(f"{part} " in out.split("shares: ")[1] for part in PARTS)
    prof, _ = profiled_step(ProfileBench("tiny", "cpu", "float32", 1, small))
    where = [(e.name, part) for e, part in placed(prof.events())]
    expected = {"scaled_dot_product": "attention", "sigmoid": "routing", "SegmentMLPKernel": "expert GEMMs",
                "CrossEntropy": "loss", "_fused_adamw_": "optimizer"}  # fmt: skip
    for fragment, part in expected.items():
        ops = [(name, p) for name, p in where if fragment in name]
        assert len({name for name, _ in ops}) >= 1 + (fragment != "_fused_adamw_"), fragment  # forward and backward
        assert all(p == part for _, p in ops), (fragment, ops)
    _, total = top_kernels(prof, on_gpu=False, n=10**6)
    assert sum(parts(prof.events(), on_gpu=False).values()) == pytest.approx(total, rel=1e-9)


def test_loop_times_the_training_loop_against_the_model_step_and_splits_it(bench):
    """`bench loop`: the model step, the loop and (`--before`) the loop as it was, on the same samples; `--profile`:
    each part's own time, DeepSpeed's ZeRO work and the loop's bookkeeping beside the model's, adding up to the whole
    step; the loop as it was copied the gradients into ZeRO-2's flat partition, today's does not."""
    small = ["train.micro_batch_size=2", "train.seq_len=32", "cadence.log_interval=2", "--warmup", 0]
    out = bench("loop", "--rounds", 1, "--before", *small)
    assert "| arm | ms per optimizer step (min-max) | tokens/s | time vs model step | speed vs model step |" in out
    for arm in ("model step", "loop (the config)", "loop before issue 65 (the config)"):
        assert f"\n| {arm} | " in out
    tables = bench("loop", "--profile", "--before", *small).split(" warm-up ")[1:]
    now, before = (profiled_parts(table) for table in tables)
    zero = ["AdamW (fp32 master partition)", "ZeRO: gradients divided, flattened, all-reduced, copied back"]
    bookkeeping = ["balance_step (counts, bias update, metrics)", "logged row (grad norm, metrics.jsonl, console)"]
    for part in ["model: forward", *zero, *bookkeeping]:
        assert float(now[part][0]) > 0, part
    assert float(now["AdamW"][2]) > 0  # the model step's
    partition = "ZeRO: gradient copied into the flat partition"  # ZeRO-2's contiguous path only
    assert partition in before and partition not in now
    for split in (now, before):
        own = sum(float(ms) for part, (ms, *_) in split.items() if part != "the whole step")
        assert own == pytest.approx(float(split["the whole step"][0]), abs=0.005 * len(split))  # rounded to 0.01 ms


def profiled_parts(table: str) -> dict[str, list[str]]:
    """`bench loop --profile`'s table: each part's cells after its name."""
    rows = [line.strip("| ").split(" | ") for line in table.splitlines() if line.startswith("| ")]
    return {row[0]: row[1:] for row in rows[1:]}  # after the header


def test_prepare(bench):
    out = bench("prepare", "--repeat", 1, "--rounds", 1, "data.max_mb_per_domain=0.05", "model.vocab_size=512")
    assert "| arm | tokens/s | vs ceiling |" in out and "\n| 2 workers | " in out
    assert "per-worker efficiency " in out


def test_help_lists_every_benchmark(cli):
    proc = cli("bench", "--help")
    assert proc.returncode == 0
    assert all(f"    {name}  " in proc.stdout for name in BENCHMARKS), proc.stdout


@pytest.mark.parametrize("what", list(BENCHMARKS))
def test_help_of_each_benchmark_shows_its_flags_and_defaults(what, cli):
    proc = cli("bench", what, "--help")
    assert proc.returncode == 0
    assert f"usage: moe-lm bench {what}" in proc.stdout and "(default: " in proc.stdout


@pytest.mark.parametrize("what", list(BENCHMARKS))
def test_the_launch_wrappers_are_the_same_command(what, cli):
    proc = cli.script(f"bench_{what}.py", "--help")
    assert proc.returncode == 0 and f"usage: python -m moe_lm.bench {what}" in proc.stdout, proc.stderr[-2000:]


def test_a_user_error_is_one_line_and_exit_code_2(process):
    """`python -m moe_lm.bench` as a user runs it (a process of its own: the entry point's wiring)."""
    proc = process.run([sys.executable, "-m", "moe_lm.bench", "train", "--arms", "", "--rounds", "0"], cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.strip().startswith(
        "error: --rounds must be >= 1, --warmup and --threads >= 0"
    )
    assert len(proc.stderr.strip().splitlines()) == 1
