"""The flags that name what the analytics study (a run, a transformers MoE checkpoint, or for `analyze` a GGUF file
run in llama.cpp) and on which documents; `moe-lm analyze` and `moe-lm ablate` take them."""

from __future__ import annotations

import argparse
import glob
from pathlib import Path

from moe_lm.analysis.hf_routing import SUPPORTED
from moe_lm.analysis.requests import SubjectRequest
from moe_lm.cli.options import add_run
from moe_lm.errors import UserError


def add_subject(ap: argparse.ArgumentParser, gguf: bool = False) -> None:
    """The subject flags; `gguf`: also --gguf FILE and llama.cpp's settings (a GGUF runs in llama.cpp, where
    nothing can be rerouted: `analyze` takes it, `ablate` does not)."""
    what = ap.add_mutually_exclusive_group(required=True)
    add_run(ap, required=False, group=what)
    what.add_argument(
        "--hf", metavar="DIR",
        help=f"a transformers MoE checkpoint folder ({', '.join(SUPPORTED)}); its own .py files (auto_map) never run",
    )  # fmt: skip
    if gguf:
        what.add_argument("--gguf", metavar="FILE", help="a GGUF MoE model, run in llama.cpp (the llama extra)")
        ap.add_argument("--threads", type=int, default=1, help="with GGUF files: llama.cpp's threads (1: steadiest "
                        "on a shared machine)")  # fmt: skip
        ap.add_argument("--llama-defaults", action="store_true", help="with GGUF files: llama.cpp's default f16 KV "
                        "cache and flash attention (default: an f32 cache, no flash attention)")  # fmt: skip
    ap.add_argument(
        "--data", nargs="*", metavar="SOURCE", help="sources as in data.sources: files, folders, parquet, hf:NAME "
        "(default with --run: its validation split)",
    )  # fmt: skip
    ap.add_argument("--text-field", default="text", help="the column (or .jsonl key) with the text")
    ap.add_argument("--domain-field", default="domain", help="the column naming the domain (absent: source name)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="with --hf")
    ap.add_argument("--device", default="cpu", help="with --hf: cpu, cuda, or auto (device_map='auto')")
    ap.add_argument("--seq-len", type=int, default=1024,
                    help="with --hf or --gguf: window length (capped by the model's)")  # fmt: skip


def subject_request(args: argparse.Namespace) -> SubjectRequest:
    """The subject flags as the analyses take them."""
    return SubjectRequest(run=args.run, hf=args.hf, gguf=getattr(args, "gguf", None), data=tuple(args.data or ()),
                          text_field=args.text_field, domain_field=args.domain_field, dtype=args.dtype,
                          device=args.device, seq_len=args.seq_len, threads=getattr(args, "threads", 1),
                          llama_defaults=getattr(args, "llama_defaults", False))  # fmt: skip


def check_subject(args: argparse.Namespace) -> None:
    """The subject flags' combinations argparse cannot check itself."""
    if args.hf and not args.data:
        raise UserError("--hf needs --data (the documents to run it on)")
    if getattr(args, "gguf", None) and not args.data:
        raise UserError("--gguf needs --data (the documents to run it on, tokenized with the file's own tokenizer)")
    if getattr(args, "threads", 1) < 1:
        raise UserError(f"--threads must be at least 1, got {args.threads}")
    missing = [p for p in args.data or [] if not (p.startswith("hf:") or glob.has_magic(p) or Path(p).exists())]
    if missing:
        raise UserError(f"--data: not found: {', '.join(missing)}")
