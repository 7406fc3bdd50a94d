"""A GGUF MoE file of any type (`--gguf FILE`) run in llama.cpp (the llama extra) with the file's own tokenizer, its
experts read from llama.cpp's graph (moe_lm/interop/llama_cpp.py); its header is checked by moe-lm first and llama.cpp
first loads it in a process of its own. No N1: a GGUF file holds trained weights only. Recognised by its magic."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from moe_lm.analysis.subjects.base import (
    DEFAULT_WINDOW_LENGTH,
    SEQ_LEN,
    Flag,
    NotInArchitecture,
    PruneSource,
    Settings,
    SubjectKind,
    SubjectRequest,
    WeightsBuilder,
    register_subject_kind,
)
from moe_lm.analysis.subjects.loaded import Shape, Subject
from moe_lm.errors import UserError
from moe_lm.interop.gguf_header import is_gguf, read_gguf_header

if TYPE_CHECKING:
    from moe_lm.analysis.subjects.run import RunSubject  # why only here: the kinds register in the package's order

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


THREADS: Flag[int] = Flag(("--threads",), {"type": int, "default": 1, "help": "with GGUF files: llama.cpp's "
                          "threads (1: steadiest on a shared machine)"})  # fmt: skip
LLAMA_DEFAULTS: Flag[bool] = Flag(("--llama-defaults",), {"action": "store_true", "help": "with GGUF files: "
                                  "llama.cpp's default f16 KV cache and flash attention (default: an f32 cache, no "
                                  "flash attention)"})  # fmt: skip


class GGUFKind(SubjectKind):
    name, request = "gguf", GGUFSubject
    flag = Flag(("--gguf",), {"metavar": "FILE", "help": "a GGUF MoE model, run in llama.cpp (the llama extra)"})
    settings = (THREADS, LLAMA_DEFAULTS)
    looks_like = "a GGUF file"
    gives = frozenset({"weights", "margins", "logprob", "norms"})

    def from_flags(self, spec: str, settings: Settings) -> GGUFSubject:
        return GGUFSubject(spec, threads=settings[THREADS], llama_defaults=settings[LLAMA_DEFAULTS],
                           seq_len=settings[SEQ_LEN])  # fmt: skip

    def recognises(self, spec: str) -> bool:
        return is_gguf(spec)

    def check(self, settings: Settings, used: bool) -> Settings:
        threads = settings[THREADS]
        if threads < 1:
            raise UserError(f"--threads must be at least 1, got {threads}")
        cores = len(os.sched_getaffinity(0))
        if threads > cores:  # why: llama.cpp's OpenMP runtime aborts the process at ~1000 threads
            print(f"--threads {threads}: this machine gives the command {cores} cores; llama.cpp runs {cores} "
                  "threads")  # fmt: skip
            return settings.replaced(Settings({THREADS: cores}))
        return settings

    def window_length(self, request: GGUFSubject) -> tuple[int, int | None]:
        return request.seq_len or DEFAULT_WINDOW_LENGTH, gguf_context(request.path)

    def shape(self, request: GGUFSubject) -> Shape:
        # why a model loaded: its tokenizer is llama.cpp's own (the weights memory-mapped, a context of few tokens)
        model = self._model(request, n_ctx=16)
        header = model.header
        decoder = int(header.get("block_count")) - int(header.get("nextn_predict_layers", 0) or 0)
        return Shape(model.tok, model.n_vocab, decoder, model.layers, model.n_experts, model.k,
                     {"served": str(request.path), "arch": model.arch})  # fmt: skip

    def in_architecture(self, request: GGUFSubject, run: RunSubject) -> WeightsBuilder:
        from moe_lm.analysis.subjects.run import run_config
        from moe_lm.interop.gguf_weights import model_from_gguf

        attention = run_config(run).model.attention
        if attention != "mla":  # why: GGUF weights are read back into MLA runs only (moe_lm/interop/gguf_weights.py)
            raise NotInArchitecture(f"a GGUF file's weights are read back into MLA runs only; {run.spec} is "
                                    f"{attention}")  # fmt: skip
        return lambda cfg: model_from_gguf(Path(request.path), cfg)

    def described(self, provenance: dict) -> str:
        if "gguf" not in provenance:
            return ""
        return f"GGUF in llama.cpp ({provenance.get('kv_cache', '?')} KV cache): {provenance.get('tensors', '?')}"

    def prune_source(self, request: GGUFSubject) -> PruneSource:
        return PruneSource("gguf", Path(request.path))

    @staticmethod
    def _model(request: GGUFSubject, n_ctx: int):
        from moe_lm.interop.llama_cpp import GGUFModel

        return GGUFModel(request.path, threads=request.threads, faithful=not request.llama_defaults, n_ctx=n_ctx)

    def load(self, request: GGUFSubject) -> Subject:
        from moe_lm.interop.llama_cpp import tensor_types

        length = min(request.seq_len or DEFAULT_WINDOW_LENGTH, gguf_context(request.path) or 1 << 62)
        model = self._model(request, n_ctx=length)
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
