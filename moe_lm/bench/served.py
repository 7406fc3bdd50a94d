"""What recording the routing costs inside llama.cpp: a GGUF file decoded with the evaluation callback that reads
every MoE block's experts and weights (`moe-lm analyze --gguf`), against the same decodes without it.

    python -m moe_lm.bench served --gguf model.gguf                       # 1 thread, 16 windows of 256 tokens
    python -m moe_lm.bench served --gguf model-Q4_K_M.gguf --threads 2 --llama-defaults

Both arms decode the same random token windows one sequence per decode, every position an output, in one process
(two contexts of the same file); rounds are interleaved and the medians' ratio is reported.
"""

from __future__ import annotations

import argparse

import numpy as np

from moe_lm.bench.timing import time_interleaved
from moe_lm.errors import UserError


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--gguf", required=True, metavar="FILE", help="a GGUF MoE model (moe-lm export --gguf)")
    ap.add_argument("--windows", type=int, default=16, help="token windows decoded per round")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per window")
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp's threads")
    ap.add_argument("--llama-defaults", action="store_true", help="llama.cpp's f16 KV cache and flash attention")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds of both arms (after one warm-up)")


def run(args: argparse.Namespace) -> None:
    from moe_lm.interop.llama_cpp import GGUFModel

    if min(args.windows, args.seq_len, args.threads, args.rounds) < 1:
        raise UserError("--windows, --seq-len, --threads and --rounds must be >= 1")
    common = dict(threads=args.threads, faithful=not args.llama_defaults, n_ctx=args.seq_len)
    recording, plain = GGUFModel(args.gguf, **common), GGUFModel(args.gguf, record=False, **common)
    rng = np.random.default_rng(0)
    windows = [rng.integers(0, plain.n_vocab, args.seq_len) for _ in range(args.windows)]
    fns = {
        "llama.cpp": lambda: [plain.route(w) for w in windows],
        "llama.cpp + routing callback": lambda: [recording.route(w) for w in windows],
    }
    for fn in fns.values():  # warm-up
        fn()
    stats = time_interleaved(fns, args.rounds)
    n = args.windows * args.seq_len
    print(f"# {args.gguf} ({plain.arch}, {plain.settings()['file_type']} file type), {args.threads} thread(s), "
          f"{'llama.cpp defaults' if args.llama_defaults else 'f32 KV cache'}, {n:,} tokens per round, median of "
          f"{args.rounds} rounds")  # fmt: skip
    for name, s in stats.items():
        print(f"{name}: {n / s.median:,.0f} tokens/s")
    print(f"routing callback: {stats['llama.cpp + routing callback'].ratio - 1:+.1%} time (the recorder's cost)")
    recording.close()
    plain.close()
