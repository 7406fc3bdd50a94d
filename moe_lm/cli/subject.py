"""The flags that name what the analytics study (a run, a transformers MoE checkpoint, or for `analyze` a GGUF file
run in llama.cpp) and on which documents; `moe-lm analyze` and `moe-lm ablate` take them."""

from __future__ import annotations

import argparse
import glob
import os
from pathlib import Path

from moe_lm.analysis.hf_routing import SUPPORTED
from moe_lm.analysis.requests import SubjectRequest
from moe_lm.cli.options import add_run
from moe_lm.errors import UserError
from moe_lm.flags import default_of, from_flags, torch_device, usable_device


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
        ap.add_argument("--threads", type=int, default=default_of(SubjectRequest, "threads"),
                        help="with GGUF files: llama.cpp's threads (1: steadiest on a shared machine)")  # fmt: skip
        ap.add_argument("--llama-defaults", action="store_true", help="with GGUF files: llama.cpp's default f16 KV "
                        "cache and flash attention (default: an f32 cache, no flash attention)")  # fmt: skip
    ap.add_argument(
        "--data", nargs="*", metavar="SOURCE", help="sources as in data.sources: files, folders, parquet, hf:NAME "
        "(default with --run: its validation split)",
    )  # fmt: skip
    ap.add_argument("--text-field", default=default_of(SubjectRequest, "text_field"),
                    help="the column (or .jsonl key) with the text")  # fmt: skip
    ap.add_argument("--domain-field", default=default_of(SubjectRequest, "domain_field"),
                    help="the column naming the domain (absent: source name)")  # fmt: skip
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=default_of(SubjectRequest, "dtype"),
                    help="with --hf")  # fmt: skip
    ap.add_argument("--device", default=default_of(SubjectRequest, "device"), type=device_or_auto,
                    help="with --hf: cpu, cuda, or auto (device_map='auto')")  # fmt: skip
    ap.add_argument(
        "--seq-len", type=int, default=None, help="window length, the same for every subject of a comparison "
        "(default: a run's train.seq_len, else 1024; capped by every subject's context)",
    )  # fmt: skip


def device_or_auto(value: str) -> str:
    """--device: a torch device this machine has, or `auto` (transformers' device_map)."""
    return value if value == "auto" else torch_device(value)


def subject_request(args: argparse.Namespace) -> SubjectRequest:
    """The subject flags as the analyses take them."""
    # why defaults for what is not a flag: ablate has no GGUF flags (nothing reroutes inside llama.cpp)
    gguf_flags = ("gguf", "threads", "llama_defaults")
    absent = {name: default_of(SubjectRequest, name) for name in gguf_flags if name not in args}
    return from_flags(SubjectRequest, args, data=tuple(args.data or ()), name=None, **absent)


def check_subject(args: argparse.Namespace) -> None:
    """The subject flags' combinations argparse cannot check itself."""
    if args.hf and not args.data:
        raise UserError("--hf needs --data (the documents to run it on)")
    if getattr(args, "gguf", None) and not args.data:
        raise UserError("--gguf needs --data (the documents to run it on, tokenized with the file's own tokenizer)")
    if args.device != "auto":
        usable_device(args.device)
    if args.seq_len is not None and args.seq_len < 2:
        raise UserError(f"--seq-len must be at least 2 tokens (a token and the one it predicts), got {args.seq_len}")
    if getattr(args, "threads", 1) < 1:
        raise UserError(f"--threads must be at least 1, got {args.threads}")
    cores = len(os.sched_getaffinity(0))
    if getattr(args, "threads", 1) > cores:  # why: llama.cpp's OpenMP runtime aborts the process at ~1000 threads
        print(f"--threads {args.threads}: this machine gives the command {cores} cores; llama.cpp runs {cores} threads")
        args.threads = cores
    missing = [p for p in args.data or [] if not (p.startswith("hf:") or glob.has_magic(p) or Path(p).exists())]
    if missing:
        raise UserError(f"--data: not found: {', '.join(missing)}")
