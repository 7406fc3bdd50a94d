"""A GGUF MoE file of any type (`--gguf FILE`) run in llama.cpp (the llama extra) with the file's own tokenizer, its
experts read from llama.cpp's graph (moe_lm/interop/llama_cpp.py); its header is checked by moe-lm first and llama.cpp
first loads it in a process of its own. No N1: a GGUF file holds trained weights only. Recognised by its magic."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from moe_lm.analysis.subjects.base import (
    DEFAULT_WINDOWS,
    Flag,
    Subject,
    SubjectKind,
    SubjectRequest,
    register_subject_kind,
)
from moe_lm.errors import UserError
from moe_lm.interop.gguf_header import is_gguf, read_gguf_header

NO_GGUF_N1 = (
    "a GGUF file holds trained weights only, and llama.cpp has no way to initialise its architecture afresh: the "
    "untrained baseline N1 comes from the same model's original (--run or --hf)"
)


@dataclass(frozen=True)
class GGUFSubject(SubjectRequest):
    kind = "gguf"
    path: str
    threads: int = 1  # llama.cpp's threads
    llama_defaults: bool = False  # llama.cpp's default f16 KV cache and flash attention (else f32, no flash)

    @property
    def spec(self) -> str:
        return str(self.path)


class GGUFKind(SubjectKind):
    name, request = "gguf", GGUFSubject
    flag = Flag(("--gguf",), {"metavar": "FILE", "help": "a GGUF MoE model, run in llama.cpp (the llama extra)"})
    settings = (
        Flag(("--threads",), {"type": int, "default": 1,
                              "help": "with GGUF files: llama.cpp's threads (1: steadiest on a shared machine)"}),
        Flag(("--llama-defaults",), {"action": "store_true", "help": "with GGUF files: llama.cpp's default f16 KV "
                                     "cache and flash attention (default: an f32 cache, no flash attention)"}),
    )  # fmt: skip
    looks_like = "a GGUF file"
    gives = frozenset({"weights", "margins", "logprob"})

    def from_flags(self, spec: str, args) -> GGUFSubject:
        return GGUFSubject(spec, threads=args.threads, llama_defaults=args.llama_defaults, seq_len=args.seq_len)

    def recognises(self, spec: str) -> bool:
        return is_gguf(spec)

    def check(self, args) -> None:
        if args.threads < 1:
            raise UserError(f"--threads must be at least 1, got {args.threads}")
        cores = len(os.sched_getaffinity(0))
        if args.threads > cores:  # why: llama.cpp's OpenMP runtime aborts the process at ~1000 threads
            print(f"--threads {args.threads}: this machine gives the command {cores} cores; llama.cpp runs {cores} "
                  "threads")  # fmt: skip
            args.threads = cores

    def windows(self, request: GGUFSubject) -> tuple[int, int | None]:
        return request.seq_len or DEFAULT_WINDOWS, gguf_context(request.path)

    def load(self, request: GGUFSubject) -> Subject:
        from moe_lm.interop.llama_cpp import GGUFModel, tensor_types

        windows = min(request.seq_len or DEFAULT_WINDOWS, gguf_context(request.path) or 1 << 62)
        model = GGUFModel(request.path, threads=request.threads, faithful=not request.llama_defaults, n_ctx=windows)
        how = "its default settings" if request.llama_defaults else "an f32 KV cache, no flash attention"
        print(f"{request.path}: {model.arch}, {model.n_experts} experts, top-{model.k}, MoE blocks {model.layers[0]}.."
              f"{model.layers[-1]}, run in llama.cpp with {how}")  # fmt: skip
        provenance = {"gguf": str(request.path), "tensors": tensor_types(model.header), **model.settings()}
        return Subject(model, model.tok, model.n_ctx, model.n_vocab, provenance, no_untrained=NO_GGUF_N1)


def gguf_context(path: str) -> int | None:
    """The context length a GGUF file declares (None if it declares none), from its checked header."""
    context = read_gguf_header(path, tensors=False).get("context_length")
    return int(context) if isinstance(context, (int, np.integer)) and context > 0 else None


register_subject_kind(GGUFKind())
