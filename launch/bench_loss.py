"""The output head's training loss, plain vs chunked (train.loss_chunk): peak memory and time of one forward and
backward, side by side.

    python launch/bench_loss.py                                      # 2048 tokens of gpu_1b's head (1024 x 32768)
    python launch/bench_loss.py --tokens 16384 --chunks 0 2048 4096 --device cuda --dtype bfloat16

Chunk 0 is the plain loss, F.cross_entropy(F.linear(h, W).float(), labels); a chunk c > 0 is
moe_lm/ops/linear_cross_entropy.py. Every measurement runs in a fresh process on the same random h, W and labels
(a tenth of them unlabelled): its first step gives the peak memory above what the inputs already hold (CUDA:
max_memory_allocated; CPU: the process's high-water mark of resident memory, ru_maxrss, minus the resident memory
before the step), the following steps the time. Variants take turns round by round, so a shared machine's noise
hits all alike; medians and ratios to the first variant are printed.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from moe_lm.cli import run
from moe_lm.ops.linear_cross_entropy import IGNORE, linear_cross_entropy


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(args) -> dict:
    """One process's measurement of chunk args.child: peak bytes above the inputs, and seconds per step."""
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(args.tokens, args.dim, generator=gen).to(dev, dtype).requires_grad_()
    w = (torch.randn(args.vocab, args.dim, generator=gen) * args.dim**-0.5).to(dev, dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(dev)
    labels[::10] = IGNORE
    chunk = args.child

    def step() -> None:
        if chunk:
            loss = linear_cross_entropy(h, w, labels, chunk)
        else:
            loss = F.cross_entropy(F.linear(h, w).float(), labels, ignore_index=IGNORE)
        loss.backward()
        h.grad = w.grad = None  # the gradients' own memory is the same in both: not part of the comparison

    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        before = _rss_bytes()
        step()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"peak": peak, "seconds": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 512, 2048], help="0 = the plain loss")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=2, help="timed steps per process (after the memory step)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if min(args.chunks) < 0 or min(args.tokens, args.dim, args.vocab, args.rounds, args.iters) < 1:
        ap.error("--chunks must be >= 0 (0: the plain loss); --tokens, --dim, --vocab, --rounds, --iters >= 1")
    if args.child is not None:
        print(json.dumps(measure(args)))
        return
    common = [f"--tokens={args.tokens}", f"--dim={args.dim}", f"--vocab={args.vocab}", f"--device={args.device}",
              f"--dtype={args.dtype}", f"--iters={args.iters}"]  # fmt: skip
    results: dict[int, list[dict]] = {c: [] for c in args.chunks}
    print(
        f"{args.tokens} tokens x dim {args.dim} x vocab {args.vocab}, {args.dtype} on {args.device}: {args.rounds} "
        f"rounds, one process per measurement"
    )
    for _ in range(args.rounds):
        for c in args.chunks:
            cmd = [sys.executable, __file__, *common, f"--child={c}"]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f"error: chunk {c} failed:\n{out.stderr[-2000:]}")
            results[c].append(json.loads(out.stdout.strip().splitlines()[-1]))
    first = args.chunks[0]
    base_peak = statistics.median(r["peak"] for r in results[first])
    base_time = statistics.median(r["seconds"] for r in results[first])
    logits_gib = args.tokens * args.vocab * 4 / 2**30
    print(f"(one fp32 [tokens, vocab] tensor is {logits_gib:.2f} GiB)")
    ref = _name(first)
    print(f"| loss | peak memory above the inputs, GiB (median) | vs {ref} | ms per forward+backward | vs {ref} |")
    print("|---|---|---|---|---|")
    for c, rows in results.items():
        peak = statistics.median(r["peak"] for r in rows)
        sec = statistics.median(r["seconds"] for r in rows)
        print(f"| {_name(c)} | {peak / 2**30:.2f} | {peak / base_peak:.3f} | {1e3 * sec:.0f} | {sec / base_time:.3f} |")


def _name(chunk: int) -> str:
    return "plain" if chunk == 0 else f"chunk {chunk}"


if __name__ == "__main__":
    run(main)
