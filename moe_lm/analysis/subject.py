"""What the analytics study: a moe-lm run's checkpoint, a transformers MoE checkpoint, or a GGUF file run in
llama.cpp, with its tokenizer and documents; shared by `moe-lm analyze` and `moe-lm ablate`."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from moe_lm.analysis.hf_routing import SUPPORTED, HFMoEModel, parameter_count
from moe_lm.analysis.requests import SubjectRequest
from moe_lm.checkpoint.format import checkpoint_folder, load_model
from moe_lm.config import Config, load_config
from moe_lm.data.documents import ReadReport, check_domain_field
from moe_lm.data.sources import iter_source
from moe_lm.data.tokenizer import HFTokenizer, Tokenizer, load_data_tokenizer
from moe_lm.errors import REMOTE_CODE_OFF, UserError, remote_code_refused
from moe_lm.model import initial_model


def user_documents(
    paths: list[str],
    tok: Tokenizer,
    domains: list[str],
    text_field: str,
    domain_field: str,
    max_tokens_per_domain: int | None = None,
):
    """(domain index, token ids) for every document of the user's sources; `domains` fills as names appear.
    A domain that has given `max_tokens_per_domain` tokens gives no more (its documents are read, not tokenized)."""
    report = ReadReport()
    given: dict[int, int] = {}
    for path in paths:
        for doc in iter_source(path, report, text_field, domain_field):
            if doc.domain not in domains:
                domains.append(doc.domain)
            d = domains.index(doc.domain)
            if max_tokens_per_domain is not None and given.get(d, 0) >= max_tokens_per_domain:
                continue
            ids = np.array([tok.doc_start_id, *tok.encode(doc.text)], dtype=np.int64)
            given[d] = given.get(d, 0) + len(ids)
            yield d, ids
    check_domain_field(report, domain_field, paths)
    print(report.summary(), file=sys.stderr)


@dataclass
class Subject:
    """What is analysed: the model (a PyTorch module, or a GGUF file in llama.cpp), its tokenizer, the window
    length, and how to build its untrained twin (N1; None, with the reason, where there is none)."""

    model: nn.Module
    tok: Tokenizer
    seq_len: int
    untrained: Callable[[], nn.Module] | None
    source: dict
    run: Path | None = None  # a moe-lm run folder (its metrics, wandb and validation split)
    cfg: Config | None = None
    vocab_size: int = 0  # the model's embedding rows (subjects compared must have the same)
    no_untrained: str = ""  # why there is no N1 baseline


def run_subject(spec, seq_len: int | None = None) -> Subject:
    """A moe-lm run's checkpoint, cut into windows of `seq_len` (default: its train.seq_len); N1 is the same config
    at the run's own initial weights."""
    run, tag = spec
    cfg, model, tag = load_model(run, tag)

    def untrained() -> nn.Module:
        return initial_model(cfg)

    tok = load_data_tokenizer(cfg.data.out_dir)
    source = {"run": str(run), "tag": tag}
    windows = min(seq_len or cfg.train.seq_len, cfg.model.max_seq_len)
    return Subject(model, tok, windows, untrained, source, run, cfg, vocab_size=cfg.model.vocab_size)


DEFAULT_WINDOWS = 1024  # the windows of a released model (--hf, --gguf) when neither --seq-len nor a run says


def hf_subject(path: str, dtype: str, device: str, seq_len: int | None) -> Subject:
    """A transformers MoE checkpoint with its own tokenizer; N1 is its architecture re-initialised (seed 0)."""
    import transformers

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    config = _hf_config(path)
    n = parameter_count(config)
    gib = n * torch.tensor([], dtype=torch_dtype).element_size() / 2**30
    print(f"{path}: {n / 1e9:.2f} B parameters, {gib:.1f} GiB of weights in {dtype}")
    placement = {"device_map": "auto"} if device == "auto" else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype, trust_remote_code=False, **placement
    )
    if device != "auto":
        hf = hf.to(device)
    model, config, where = HFMoEModel(hf.eval()), hf.config, hf.device

    def untrained() -> nn.Module:  # why config and device, not hf: the checkpoint's weights may be freed first
        torch.manual_seed(0)
        twin = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype, trust_remote_code=False)
        return HFMoEModel(twin.to(where).eval())

    windows = min(seq_len or DEFAULT_WINDOWS, getattr(config, "max_position_embeddings", None) or 1 << 62)
    source = {"hf": str(path), "model_type": config.model_type}
    return Subject(model, HFTokenizer(Path(path)), windows, untrained, source, vocab_size=config.vocab_size)


def _hf_config(path: str):
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


NO_GGUF_N1 = (
    "a GGUF file holds trained weights only, and llama.cpp has no way to initialise its architecture afresh: the "
    "untrained baseline N1 comes from the same model's original (--run or --hf)"
)


def gguf_subject(path: str, threads: int, faithful: bool, seq_len: int | None) -> Subject:
    """A GGUF file run in llama.cpp with the file's own tokenizer (no N1: NO_GGUF_N1); its header is checked first
    (moe_lm/interop/gguf_header.py), and llama.cpp first loads it in a process of its own (`probe_in_child`)."""
    from moe_lm.interop.llama_cpp import GGUFModel, tensor_types

    windows = min(seq_len or DEFAULT_WINDOWS, gguf_context(path) or 1 << 62)
    model = GGUFModel(path, threads=threads, faithful=faithful, n_ctx=windows)
    how = "an f32 KV cache, no flash attention" if faithful else "its default settings"
    print(f"{path}: {model.arch}, {model.n_experts} experts, top-{model.k}, MoE blocks {model.layers[0]}.."
          f"{model.layers[-1]}, run in llama.cpp with {how}")  # fmt: skip
    source = {"gguf": str(path), "tensors": tensor_types(model.header), **model.settings()}
    return Subject(model, model.tok, model.n_ctx, None, source, vocab_size=model.n_vocab, no_untrained=NO_GGUF_N1)


def gguf_context(path: str) -> int | None:
    """The context length a GGUF file declares (None if it declares none), from its checked header."""
    from moe_lm.interop.gguf_header import read_gguf_header

    context = read_gguf_header(path, tensors=False).get("context_length")
    return int(context) if isinstance(context, (int, np.integer)) and context > 0 else None


def context_of(what: SubjectRequest) -> tuple[int, int | None]:
    """(the windows the subject is cut into alone, the longest window it takes or None), read without loading any
    weights: a run's train.seq_len and model.max_seq_len, a released model's --seq-len (DEFAULT_WINDOWS) and its
    declared context. What cannot be read is left to `load_subject` to report."""
    try:
        if what.gguf:
            return what.seq_len or DEFAULT_WINDOWS, gguf_context(what.gguf)
        if what.hf:
            return what.seq_len or DEFAULT_WINDOWS, getattr(_hf_config(what.hf), "max_position_embeddings", None)
        run, tag = what.run
        cfg = load_config(checkpoint_folder(run, tag) / "config.yaml")
        return what.seq_len or cfg.train.seq_len, cfg.model.max_seq_len
    except Exception:  # noqa: BLE001 - load_subject reads it again and names what is wrong
        return what.seq_len or DEFAULT_WINDOWS, None


def load_subject(what: SubjectRequest) -> Subject:
    """The Subject a request names: its run, its hf folder or its GGUF file; a clear error for what cannot be
    loaded."""
    try:
        if what.gguf:
            return gguf_subject(what.gguf, what.threads, not what.llama_defaults, what.seq_len)
        if what.hf:
            return hf_subject(what.hf, what.dtype, what.device, what.seq_len)
        return run_subject(what.run, what.seq_len)
    except OSError as e:  # a folder transformers cannot read: the user's to fix, not a bug
        raise UserError(str(e)) from None
