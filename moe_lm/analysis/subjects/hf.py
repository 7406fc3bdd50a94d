"""A transformers MoE checkpoint (`--hf DIR`: DeepseekV3/V2, Glm4Moe, Qwen2Moe/Qwen3Moe, OlmoE, Mixtral) with its own
tokenizer, in `--dtype` on `--device`; its routing read from its gates (moe_lm/analysis/hf_routing.py); N1 is its
architecture re-initialised (seed 0). Its own `.py` files (auto_map) never run."""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from moe_lm.analysis.hf_routing import SUPPORTED, hf_routing
from moe_lm.analysis.streamed import StreamedModel
from moe_lm.analysis.subjects.base import (
    DEFAULT_WINDOWS,
    Flag,
    Subject,
    SubjectKind,
    SubjectRequest,
    register_subject_kind,
)
from moe_lm.data.tokenizer import HFTokenizer
from moe_lm.errors import REMOTE_CODE_OFF, UserError, remote_code_refused
from moe_lm.files import gib
from moe_lm.flags import byte_size, torch_device, usable_device
from moe_lm.interop.hf_layers import HFCheckpoint, UntrainedCheckpoint
from moe_lm.interop.released_weights import ReleasedWeights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class HFSubject(SubjectRequest):
    kind = "hf"
    path: str
    dtype: str = "float32"
    device: str = "cpu"  # a torch device, or auto (transformers' device_map="auto")
    max_memory: int | None = None  # bytes of weights held at once; a larger model is streamed a layer at a time
    last_layer: int | None = None  # streamed: run the layers up to this one only (None: all, with the log-probs)
    work: str | None = None  # streamed: the folder of its hidden states and finished layers (resumable)

    @property
    def spec(self) -> str:
        return str(self.path)


def device_or_auto(value: str) -> str:
    """--device: a torch device, or `auto` (transformers' device_map)."""
    return value if value == "auto" else torch_device(value)


class HFKind(SubjectKind):
    name, request = "hf", HFSubject
    flag = Flag(("--hf",), {"metavar": "DIR", "help": f"a transformers MoE checkpoint folder ({', '.join(SUPPORTED)}); "
                            "its own .py files (auto_map) never run"})  # fmt: skip
    settings = (
        Flag(("--dtype",), {"choices": list(DTYPES), "default": "float32", "help": "with transformers subjects"}),
        Flag(("--device",), {"default": "cpu", "type": device_or_auto,
                             "help": "with transformers subjects: cpu, cuda, or auto (device_map='auto')"}),
        Flag(("--max-memory",), {"type": byte_size, "metavar": "SIZE",
                                 "help": "with transformers subjects: the memory its weights may take (e.g. 64GiB); a "
                                 "larger model is streamed from disk a layer at a time (default: as the machine has "
                                 "free)"}),
    )  # fmt: skip
    looks_like = "a transformers folder (with config.json)"
    reroutable = True
    gives = frozenset({"weights", "logprob"})  # transformers' gates return weights and indices, not their scores

    def from_flags(self, spec: str, args) -> HFSubject:
        work = getattr(args, "stream_work", None)  # the command's folder for streamed work, one per subject
        drawn = getattr(args, "layers", None)
        return HFSubject(spec, dtype=args.dtype, device=args.device, seq_len=args.seq_len, max_memory=args.max_memory,
                         last_layer=max(drawn) if drawn else None,
                         work=f"{work}/{hashlib.sha1(spec.encode()).hexdigest()[:10]}" if work else None)  # fmt: skip

    def recognises(self, spec: str) -> bool:
        path = Path(spec)
        return (path / "config.json").is_file() and not (path / "checkpoints").is_dir()

    def check(self, args) -> None:
        if args.device != "auto":
            usable_device(args.device)

    def windows(self, request: HFSubject) -> tuple[int, int | None]:
        return request.seq_len or DEFAULT_WINDOWS, getattr(hf_config(request.path), "max_position_embeddings", None)

    def load(self, request: HFSubject) -> Subject:
        dtype = DTYPES[request.dtype]
        config = hf_config(request.path)
        if config.model_type not in SUPPORTED:
            raise UserError(f"{request.path}: model_type {config.model_type!r} is not one the analytics read: "
                            f"{', '.join(SUPPORTED)}")  # fmt: skip
        windows = min(request.seq_len or DEFAULT_WINDOWS, getattr(config, "max_position_embeddings", None) or 1 << 62)
        provenance = {"hf": str(request.path), "model_type": config.model_type}
        tok = HFTokenizer(Path(request.path))
        if request.device == "auto":  # transformers' own loader and device map (several GPUs)
            return Subject(*_device_mapped(request.path, config, dtype), tok, windows, config.vocab_size, provenance)
        checkpoint = HFCheckpoint(request.path, config, dtype)
        total = checkpoint.numel() * torch.tensor([], dtype=dtype).element_size()
        budget = memory_budget(request, total)
        how = f": streamed a layer at a time within {gib(budget)}" if budget else ""
        n = checkpoint.numel()
        count = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"
        print(f"{request.path}: {count} parameters, {gib(total)} in {request.dtype}{how}")
        twin = UntrainedCheckpoint(checkpoint)
        if budget:
            work = Path(request.work or tempfile.mkdtemp(prefix="moe_lm_stream_"))
            streamed = StreamedModel(checkpoint, budget, work / "model", request.last_layer)

            def untrained():
                return StreamedModel(twin, budget, work / "init", request.last_layer)

            return Subject(streamed, tok, windows, config.vocab_size, provenance, untrained=untrained)

        def untrained():  # why the twin's own reader: the trained weights may be freed first
            return hf_routing(twin.model().to(request.device))

        routing = hf_routing(checkpoint.model().to(request.device))
        return Subject(routing, tok, windows, config.vocab_size, provenance, untrained=untrained)


def memory_budget(request: HFSubject, total: int) -> int | None:
    """The bytes of weights a streamed analysis may hold (None: the model is analysed whole): --max-memory when the
    weights pass it, else half the memory available when the weights pass 80 % of it (said in one line)."""
    if request.max_memory is not None:
        budget = request.max_memory if total > request.max_memory else None
    else:
        available = psutil.virtual_memory().available
        budget = available // 2 if total > 0.8 * available else None
        if budget:
            print(f"the weights ({gib(total)}) do not fit the memory available ({gib(available)}): streaming them")
    if budget and request.device != "cpu":
        raise UserError(f"a streamed analysis runs on the CPU: give --device cpu, or a --max-memory of at least "
                        f"{gib(total)} to analyse the model whole on {request.device}")  # fmt: skip
    return budget


def _device_mapped(path: str, config, dtype):
    """(routing, untrained) of a model transformers loads and places across devices (device_map="auto")."""
    import transformers

    # why safetensors only, checked first as on the CPU path: a pytorch_model.bin is a pickle, which transformers
    # would hand to torch.load (weights-only, so a pickled call is refused, but as a traceback)
    ReleasedWeights(Path(path), config.to_dict()).check()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False,
                                                           device_map="auto", use_safetensors=True)  # fmt: skip

    def untrained():
        torch.manual_seed(0)
        twin = transformers.AutoModelForCausalLM.from_config(hf.config, dtype=dtype, trust_remote_code=False)
        return hf_routing(twin.to(hf.device))

    return hf_routing(hf), untrained


def hf_config(path: str):
    """A checkpoint's transformers config; one whose config asks for its own code is refused in one line."""
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(path, trust_remote_code=False)
    except ValueError as e:
        if remote_code_refused(e):
            raise UserError(
                f"{path}: its config.json {REMOTE_CODE_OFF}; the transformers model types the analytics read are "
                f"built into transformers: {', '.join(SUPPORTED)}"
            ) from None
        raise


register_subject_kind(HFKind())
