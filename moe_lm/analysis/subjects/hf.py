"""A transformers MoE checkpoint (`--hf DIR`: DeepseekV3/V2, Glm4Moe, Qwen2Moe/Qwen3Moe, OlmoE, Mixtral) with its own
tokenizer, in `--dtype` on `--device`; its routing read from its gates (moe_lm/analysis/hf_routing.py); N1 is its
architecture re-initialised (seed 0). Its own `.py` files (auto_map) never run."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import torch

from moe_lm.analysis.hf_routing import GATE, SUPPORTED, declared, hf_routing
from moe_lm.analysis.streamed import StreamedModel
from moe_lm.analysis.subjects.base import (
    DEFAULT_WINDOW_LENGTH,
    SEQ_LEN,
    Flag,
    PruneSource,
    Settings,
    SubjectKind,
    SubjectRequest,
    WeightsBuilder,
    register_subject_kind,
)
from moe_lm.analysis.subjects.loaded import Shape, Subject
from moe_lm.data.tokenizer import HFTokenizer
from moe_lm.errors import REMOTE_CODE_OFF, UserError, remote_code_refused
from moe_lm.files import gib
from moe_lm.flags import byte_size, torch_device, usable_device
from moe_lm.interop.hf_layers import HFCheckpoint, UntrainedCheckpoint
from moe_lm.interop.released_weights import ReleasedWeights

if TYPE_CHECKING:
    from moe_lm.analysis.subjects.run import RunSubject  # why only here: the kinds register in the package's order

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


DTYPE: Flag[str] = Flag(("--dtype",), {"choices": list(DTYPES), "default": "float32",
                                         "help": "with transformers subjects"})  # fmt: skip
DEVICE: Flag[str] = Flag(("--device",), {"default": "cpu", "type": device_or_auto, "help": "with transformers "
                                         "subjects: cpu, cuda, or auto (device_map='auto')"})  # fmt: skip
MAX_MEMORY: Flag[int | None] = Flag(("--max-memory",), {"type": byte_size, "metavar": "SIZE", "help": "with "
                                    "transformers subjects: the memory its weights may take (e.g. 64GiB); a larger "
                                    "model is streamed from disk a layer at a time (default: as the machine has "
                                    "free)"})  # fmt: skip


class HFKind(SubjectKind):
    name, request = "hf", HFSubject
    flag = Flag(("--hf",), {"metavar": "DIR", "help": f"a transformers MoE checkpoint folder ({', '.join(SUPPORTED)}); "
                            "its own .py files (auto_map) never run"})  # fmt: skip
    settings = (DTYPE, DEVICE, MAX_MEMORY)
    looks_like = "a transformers folder (with config.json)"
    reroutable = True
    # transformers' gates return weights and indices, not their scores; the experts' output norms come from hooks on
    # the experts of a model held in memory, or from the expert passes of a folder streamed from disk
    gives = frozenset({"weights", "logprob", "norms"})

    def from_flags(self, spec: str, settings: Settings) -> HFSubject:
        return HFSubject(spec, dtype=settings[DTYPE], device=settings[DEVICE], seq_len=settings[SEQ_LEN],
                         max_memory=settings[MAX_MEMORY])  # fmt: skip

    def recognises(self, spec: str) -> bool:
        path = Path(spec)
        return (path / "config.json").is_file() and not (path / "checkpoints").is_dir()

    def check(self, settings: Settings, used: bool) -> Settings:
        if settings[DEVICE] != "auto":
            usable_device(settings[DEVICE])
        return settings

    def for_analysis(self, request: HFSubject, work: Path | None, last_layer: int | None) -> HFSubject:
        # why a folder per subject: a comparison streams each of its transformers subjects into its own
        ours = f"{work}/{hashlib.sha1(request.spec.encode()).hexdigest()[:10]}" if work else None
        last = last_layer if request.last_layer is None else request.last_layer
        return dataclasses.replace(request, work=request.work or ours, last_layer=last)

    def window_length(self, request: HFSubject) -> tuple[int, int | None]:
        return request.seq_len or DEFAULT_WINDOW_LENGTH, declared(hf_config(request.path), "max_position_embeddings")

    def shape(self, request: HFSubject) -> Shape:
        import transformers

        config = hf_config(request.path)
        with torch.device("meta"):  # why: its gates as the model has them, and nothing read but the config
            model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=False)
        gates = {int(m[1]): mod for name, mod in model.named_modules() if (m := GATE.match(name))}
        if not gates:
            raise UserError(f"--served {request.path}: no MoE gates (model.layers.<l>.mlp.gate) in this "
                            f"{config.model_type}")  # fmt: skip
        first = next(iter(gates.values()))
        provenance = {"served": str(request.path), "model_type": config.model_type}
        return Shape(HFTokenizer(Path(request.path)), config.vocab_size, config.num_hidden_layers, sorted(gates),
                     first.num_experts, first.top_k, provenance)  # fmt: skip

    def in_architecture(self, request: HFSubject, run: RunSubject) -> WeightsBuilder:
        from moe_lm.interop.hf import import_hf

        path = Path(request.path)
        if hf_config(request.path).model_type != "deepseek_v3":
            return super().in_architecture(request, run)
        # why moe-lm's reader, not from_pretrained: the weights the comparison ran (an FP8 release dequantised by
        # DeepSeek's rule in float32; transformers' CPU path rounds it to bf16 and misreads ragged blocks)
        return lambda cfg: import_hf(path, HFCheckpoint(path, hf_config(request.path)).model())

    def described(self, provenance: dict) -> str:
        return f"transformers {provenance.get('model_type', '')}" if "hf" in provenance else ""

    def prune_source(self, request: HFSubject) -> PruneSource:
        # why config.json read as JSON: a quantised folder is pruned byte for byte, never loaded (a quantisation other
        # than DeepSeek's FP8 blocks is refused by name by that writer)
        path = Path(request.path)
        try:
            quantised = bool(json.loads((path / "config.json").read_text()).get("quantization_config"))
        except (OSError, ValueError, AttributeError):
            quantised = False  # the writer reads config.json again and names what is wrong
        return PruneSource("fp8-release" if quantised else "transformers", path)

    def load(self, request: HFSubject) -> Subject:
        dtype = DTYPES[request.dtype]
        config = hf_config(request.path)
        if config.model_type not in SUPPORTED:
            raise UserError(f"{request.path}: model_type {config.model_type!r} is not one the analytics read: "
                            f"{', '.join(SUPPORTED)}")  # fmt: skip
        length = min(request.seq_len or DEFAULT_WINDOW_LENGTH, declared(config, "max_position_embeddings") or 1 << 62)
        provenance = {"hf": str(request.path), "model_type": config.model_type}
        tok = HFTokenizer(Path(request.path))
        if request.device == "auto":  # transformers' own loader and device map (several GPUs)
            routing, untrained = _device_mapped(request.path, config, dtype)
            return Subject(routing, tok, length, config.vocab_size, provenance, untrained=untrained)
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
                return StreamedModel(twin, budget, work / "init", request.last_layer, seed=twin.seed)

            return Subject(streamed, tok, length, config.vocab_size, provenance, untrained=untrained)

        def untrained():  # why the twin's own reader: the trained weights may be freed first
            return hf_routing(twin.model().to(request.device))

        routing = hf_routing(checkpoint.model().to(request.device))
        return Subject(routing, tok, length, config.vocab_size, provenance, untrained=untrained)


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
