"""A transformers MoE checkpoint (`--hf DIR`: DeepseekV3/V2, Glm4Moe, Qwen2Moe/Qwen3Moe, OlmoE, Mixtral) with its own
tokenizer, in `--dtype` on `--device`; its routing read from its gates (moe_lm/analysis/hf_routing.py); N1 is its
architecture re-initialised (seed 0). Its own `.py` files (auto_map) never run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moe_lm.analysis.hf_routing import SUPPORTED, hf_routing, parameter_count
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
from moe_lm.flags import torch_device, usable_device

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class HFSubject(SubjectRequest):
    kind = "hf"
    path: str
    dtype: str = "float32"
    device: str = "cpu"  # a torch device, or auto (transformers' device_map="auto")

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
    )  # fmt: skip
    looks_like = "a transformers folder (with config.json)"
    reroutable = True
    gives = frozenset({"weights", "logprob"})  # transformers' gates return weights and indices, not their scores

    def from_flags(self, spec: str, args) -> HFSubject:
        return HFSubject(spec, dtype=args.dtype, device=args.device, seq_len=args.seq_len)

    def recognises(self, spec: str) -> bool:
        path = Path(spec)
        return (path / "config.json").is_file() and not (path / "checkpoints").is_dir()

    def check(self, args) -> None:
        if args.device != "auto":
            usable_device(args.device)

    def windows(self, request: HFSubject) -> tuple[int, int | None]:
        return request.seq_len or DEFAULT_WINDOWS, getattr(hf_config(request.path), "max_position_embeddings", None)

    def load(self, request: HFSubject) -> Subject:
        import transformers

        dtype = DTYPES[request.dtype]
        config = hf_config(request.path)
        n = parameter_count(config)
        gib = n * torch.tensor([], dtype=dtype).element_size() / 2**30
        print(f"{request.path}: {n / 1e9:.2f} B parameters, {gib:.1f} GiB of weights in {request.dtype}")
        placement = {"device_map": "auto"} if request.device == "auto" else {}
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            request.path, dtype=dtype, trust_remote_code=False, **placement
        )
        if request.device != "auto":
            hf = hf.to(request.device)
        config, where = hf.config, hf.device

        def untrained():  # why config and device, not hf: the checkpoint's weights may be freed first
            torch.manual_seed(0)
            twin = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
            return hf_routing(twin.to(where))

        windows = min(request.seq_len or DEFAULT_WINDOWS, getattr(config, "max_position_embeddings", None) or 1 << 62)
        provenance = {"hf": str(request.path), "model_type": config.model_type}
        return Subject(hf_routing(hf), HFTokenizer(Path(request.path)), windows, config.vocab_size, provenance,
                       untrained=untrained)  # fmt: skip


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
