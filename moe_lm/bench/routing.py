"""Benchmark routing recording against the same model's plain forward, in the same run.

    python -m moe_lm.bench routing                                   # a small random DeepseekV3, CPU, fp32
    python -m moe_lm.bench routing --device cuda --dtype bfloat16 --hidden 1024 --layers 8 --experts 64

The recording arm is `record_trace` (gate hooks, copies to the host, the trace written to disk); the plain arm runs
the same batches (the same chunking and padding) through the model with no hooks. Rounds are interleaved; medians
and the overhead (recording time / plain time - 1) are reported. Target: at most 15 % on CPU.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers

from moe_lm.analysis.hf_routing import hf_routing
from moe_lm.analysis.recording import document_windows, record_trace
from moe_lm.bench.timing import time_interleaved
from moe_lm.errors import UserError
from moe_lm.flags import from_flags, torch_device
from moe_lm.routing.torch_routing import TorchRouting

VOCAB = 4096
Documents = list[tuple[int, np.ndarray]]  # (domain index, token ids)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--hidden", type=int, default=256, help="hidden size of the random DeepseekV3")
    ap.add_argument("--layers", type=int, default=4, help="its layers (the first dense, the others MoE)")
    ap.add_argument("--experts", type=int, default=16, help="routed experts per MoE layer, in 4 groups (top-2 groups)")
    ap.add_argument("--k", type=int, default=4, help="experts per token")
    ap.add_argument("--tokens", type=int, default=32_768, help="at least this many tokens of random documents")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per chunk of a document")
    ap.add_argument("--batch-size", type=int, default=8, help="chunks per forward")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds of both arms (after one plain warm-up)")
    ap.add_argument("--device", default="cpu", type=torch_device, help="torch device")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's dtype")


@dataclass(frozen=True)
class RoutingBench:
    """What the model and the arms read: the random DeepseekV3's shape, where and in what type, the windows."""

    hidden: int
    layers: int
    experts: int
    k: int
    seq_len: int
    batch_size: int
    dtype: str
    device: str


def random_model(bench: RoutingBench) -> TorchRouting:
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=bench.hidden, intermediate_size=3 * bench.hidden, num_hidden_layers=bench.layers,
        num_attention_heads=8, num_key_value_heads=8, n_routed_experts=bench.experts, num_experts_per_tok=bench.k,
        moe_intermediate_size=bench.hidden // 2, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
        kv_lora_rank=bench.hidden // 4, q_lora_rank=None, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
        max_position_embeddings=bench.seq_len,
    )  # fmt: skip
    dtype = getattr(torch, bench.dtype)
    return hf_routing(
        transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, trust_remote_code=False).to(bench.device)
    )


def random_documents(tokens: int) -> Documents:
    """Documents of 100..2000 random tokens in 3 domains, until there are `tokens` tokens."""
    rng = np.random.default_rng(0)
    docs: Documents = []
    while sum(len(d) for _, d in docs) < tokens:
        docs.append((len(docs) % 3, rng.integers(0, VOCAB, int(rng.integers(100, 2000)))))
    return docs


def arms(model: TorchRouting, docs: Documents, bench: RoutingBench, work: Path) -> dict[str, Callable[[], None]]:
    """The plain forward over the documents' batches, and `record_trace` over the same (writing into `work`)."""

    def forward(batch) -> None:
        tokens = torch.zeros(len(batch), max(len(c.tokens) for c in batch), dtype=torch.long)
        for b, c in enumerate(batch):
            tokens[b, : len(c.tokens)] = torch.from_numpy(c.tokens.astype(np.int64))
        model.forward(tokens)
        if bench.device.startswith("cuda"):
            torch.cuda.synchronize()

    @torch.no_grad()
    def plain() -> None:
        batch = []
        for chunk in document_windows(docs, bench.seq_len):
            batch.append(chunk)
            if len(batch) == bench.batch_size:
                forward(batch)
                batch = []
        if batch:
            forward(batch)

    def record() -> None:
        shutil.rmtree(work / "trace", ignore_errors=True)
        record_trace(model, docs, work / "trace", ["a", "b", "c"], bench.seq_len, bench.batch_size, progress=False)

    return {"plain forward": plain, "recording": record}


def run(args: argparse.Namespace) -> None:
    if min(args.hidden, args.layers, args.experts, args.k, args.tokens, args.seq_len, args.batch_size, args.rounds) < 1:
        raise UserError(
            "--hidden, --layers, --experts, --k, --tokens, --seq-len, --batch-size and --rounds must be >= 1"
        )
    torch.manual_seed(0)
    bench = from_flags(RoutingBench, args)
    model = random_model(bench)
    docs = random_documents(args.tokens)
    work = Path(tempfile.mkdtemp(prefix="bench_routing_"))
    try:
        fns = arms(model, docs, bench, work)
        fns["plain forward"]()  # warm-up
        stats = time_interleaved(fns, args.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = sum(len(d) for _, d in docs)
    shape = f"hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-{args.k}"
    print(f"# DeepseekV3 {shape}, {args.device} {args.dtype}, {n:,} tokens in {len(docs)} documents, median of "
          f"{args.rounds} rounds")  # fmt: skip
    for name, s in stats.items():
        print(f"{name}: {n / s.median:,.0f} tokens/s")
    print(f"recording overhead {stats['recording'].ratio - 1:+.1%} (target <= +15 %)")
