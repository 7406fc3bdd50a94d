"""The output head's training loss, plain vs chunked (performance.loss_chunk): peak memory and time of one forward
and backward, side by side.

    python -m moe_lm.bench loss                                      # 2048 tokens of gpu_1b's head (1024 x 32768)
    python -m moe_lm.bench loss --tokens 16384 --chunks 0 2048 4096 --device cuda --dtype bfloat16

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
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_lm.bench.timing import Stat, interleave, markdown_table, summarize
from moe_lm.errors import UserError
from moe_lm.flags import from_flags, torch_device
from moe_lm.ops.linear_cross_entropy import IGNORE, linear_cross_entropy


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tokens", type=int, default=2048, help="rows of h (tokens of the batch)")
    ap.add_argument("--dim", type=int, default=1024, help="width of h (the model's dim)")
    ap.add_argument("--vocab", type=int, default=32768, help="rows of the head's weight W")
    ap.add_argument(
        "--chunks",
        type=int,
        nargs="+",
        default=[0, 512, 2048],
        help="tokens per chunk, one variant each; 0 = the plain loss; ratios are to the first",
    )
    ap.add_argument("--device", default="cpu", type=torch_device, help="torch device")
    ap.add_argument("--dtype", default="float32", help="dtype of h and W (torch's name)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of one process per variant")
    ap.add_argument("--iters", type=int, default=2, help="timed steps per process (after the memory step)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)  # one measurement, in this process


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@dataclass(frozen=True)
class LossBench:
    """What one measurement reads: the head's shape, where and in what type, how many timed steps."""

    tokens: int
    dim: int
    vocab: int
    device: str
    dtype: str
    iters: int


def measure(bench: LossBench, chunk: int) -> dict[str, float]:
    """One process's measurement of `chunk` (0: the plain loss): peak bytes above the inputs, seconds per step."""
    dev, dtype = torch.device(bench.device), getattr(torch, bench.dtype)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(bench.tokens, bench.dim, generator=gen).to(dev, dtype).requires_grad_()
    w = (torch.randn(bench.vocab, bench.dim, generator=gen) * bench.dim**-0.5).to(dev, dtype).requires_grad_()
    labels = torch.randint(0, bench.vocab, (bench.tokens,), generator=gen).to(dev)
    labels[::10] = IGNORE

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
    for _ in range(bench.iters):
        t0 = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"peak": peak, "seconds": statistics.median(times)}


def in_child(bench: LossBench, chunk: int) -> dict[str, float]:
    """`measure` of `chunk` in a fresh process (this package's `loss --child`): its peak memory is its own."""
    flags = [f"--tokens={bench.tokens}", f"--dim={bench.dim}", f"--vocab={bench.vocab}", f"--device={bench.device}",
             f"--dtype={bench.dtype}", f"--iters={bench.iters}", f"--child={chunk}"]  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "moe_lm.bench", "loss", *flags], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"error: chunk {chunk} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def name(chunk: int) -> str:
    return "plain" if chunk == 0 else f"chunk {chunk}"


def table(stats: dict[str, dict[str, Stat]], reference: str) -> str:
    """Median peak GiB and ms per step of every variant, each with its ratio to `reference`'s."""
    columns = ["loss", "peak memory above the inputs, GiB (median)", f"vs {reference}", "ms per forward+backward",
               f"vs {reference}"]  # fmt: skip
    rows = [
        [variant, f"{s['peak'].median / 2**30:.2f}", f"{s['peak'].ratio:.3f}", f"{1e3 * s['seconds'].median:.0f}",
         f"{s['seconds'].ratio:.3f}"]
        for variant, s in stats.items()
    ]  # fmt: skip
    return markdown_table(columns, rows)


def run(args: argparse.Namespace) -> None:
    if min(args.chunks) < 0 or min(args.tokens, args.dim, args.vocab, args.rounds, args.iters) < 1:
        raise UserError("--chunks must be >= 0 (0: the plain loss); --tokens, --dim, --vocab, --rounds, --iters >= 1")
    if args.child is not None:
        print(json.dumps(measure(from_flags(LossBench, args), args.child)))
        return
    print(
        f"{args.tokens} tokens x dim {args.dim} x vocab {args.vocab}, {args.dtype} on {args.device}: {args.rounds} "
        f"rounds, one process per measurement"
    )
    bench = from_flags(LossBench, args)
    measures = {name(c): (lambda c=c: in_child(bench, c)) for c in args.chunks}
    stats = summarize(interleave(measures, args.rounds))
    print(f"(one fp32 [tokens, vocab] tensor is {args.tokens * args.vocab * 4 / 2**30:.2f} GiB)")
    print(table(stats, name(args.chunks[0])))
