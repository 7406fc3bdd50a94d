"""Benchmark routing recording against the same model's plain forward, in the same run.

    python launch/bench_routing.py                                   # a small random DeepseekV3, CPU, fp32
    python launch/bench_routing.py --device cuda --dtype bfloat16 --hidden 1024 --layers 8 --experts 64

The recording arm is `record_trace` (gate hooks, copies to the host, the trace written to disk); the plain arm runs
the same batches (the same chunking and padding) through the model with no hooks. Rounds are interleaved; medians
and the overhead (recording time / plain time - 1) are reported. Target: at most 15 % on CPU.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from moe_lm.analysis.hf_routing import HFMoEModel
from moe_lm.analysis.trace import document_chunks, record_trace
from moe_lm.cli import run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32_768)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    cfg = transformers.DeepseekV3Config(
        vocab_size=4096, hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=8, n_routed_experts=args.experts, num_experts_per_tok=args.k,
        moe_intermediate_size=args.hidden // 2, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
        kv_lora_rank=args.hidden // 4, q_lora_rank=None, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
        max_position_embeddings=args.seq_len,
    )  # fmt: skip
    model = HFMoEModel(transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(args.device).eval())
    rng = np.random.default_rng(0)
    docs = []
    while sum(len(d) for _, d in docs) < args.tokens:
        docs.append((len(docs) % 3, rng.integers(0, 4096, int(rng.integers(100, 2000)))))
    work = Path(tempfile.mkdtemp(prefix="bench_routing_"))

    @torch.no_grad()
    def plain() -> None:
        batch = []
        for chunk in document_chunks(docs, args.seq_len):
            batch.append(chunk)
            if len(batch) == args.batch_size:
                forward(batch)
                batch = []
        if batch:
            forward(batch)

    def forward(batch) -> None:
        tokens = torch.zeros(len(batch), max(len(c.tokens) for c in batch), dtype=torch.long)
        for b, c in enumerate(batch):
            tokens[b, : len(c.tokens)] = torch.from_numpy(c.tokens.astype(np.int64))
        model(tokens)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def record() -> None:
        shutil.rmtree(work / "trace", ignore_errors=True)
        record_trace(model, docs, work / "trace", ["a", "b", "c"], args.seq_len, args.batch_size, progress=False)

    arms = {"plain forward": plain, "recording": record}
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    try:
        plain()  # warm-up
        for _ in range(args.rounds):
            for name, fn in arms.items():
                t0 = time.perf_counter()
                fn()
                seconds[name].append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = sum(len(d) for _, d in docs)
    med = {name: statistics.median(s) for name, s in seconds.items()}
    shape = f"hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-{args.k}"
    print(f"# DeepseekV3 {shape}, {args.device} {args.dtype}, {n:,} tokens in {len(docs)} documents, median of "
          f"{args.rounds} rounds")  # fmt: skip
    for name in arms:
        print(f"{name}: {n / med[name]:,.0f} tokens/s")
    print(f"recording overhead {med['recording'] / med['plain forward'] - 1:+.1%} (target <= +15 %)")


if __name__ == "__main__":
    run(main)
