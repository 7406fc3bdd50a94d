"""Small models for the tests and the check scripts, their configs written once: the tiny MoE config every test builds
on (`tiny_model_cfg`), and the check models that tell engines apart (`check_model`: launch/serve_check.py for vLLM,
launch/gguf_check.py and the llama.cpp tests): weights large enough that positions and routing change the logits,
non-zero routing biases, group-limited routing; with the prompts and measures those checks compare. Nothing of the
trainer imports this module."""

from __future__ import annotations

import dataclasses
import math

from moe_lm.config import GQAConfig, MLAConfig, ModelConfig, MoEConfig, RopeScalingConfig

TINY_MOE = dict(
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    moe_inter_dim=24,
)


def tiny_model_cfg(attention: str = "mla", moe: dict | None = None, **fields) -> ModelConfig:
    """A 3-layer MLA (or GQA) MoE model of a few thousand parameters; `moe` overrides fields of the MoE section
    (`moe=dict(n_group=1)`), other keywords override ModelConfig fields."""
    base = dict(
        vocab_size=97,
        dim=32,
        n_layers=3,
        n_heads=4,
        inter_dim=48,
        first_k_dense_replace=1,
        attention=attention,
        max_seq_len=64,
        mla=MLAConfig(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
        gqa=GQAConfig(n_kv_heads=2, head_dim=8, partial_rotary_factor=0.5),
        moe=MoEConfig(**{**TINY_MOE, **(moe or {})}),
    )
    return ModelConfig(**{**base, **fields})


def replace_moe(cfg: ModelConfig, **kw) -> ModelConfig:
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **kw))


PROMPTS = 4  # prompts per check model
PROMPT_LEN = 40  # tokens per prompt (positions far enough apart for the rotary layout to matter)
WEIGHT_SCALE = 5.0  # a check model's matrices times this: attention far from uniform, so a wrong rotary layout shows


def check_model(attention: str, yarn: bool = False, vocab_size: int = 256, q_lora_rank: int = 32):
    """The tiny config at vLLM-friendly sizes (attention head size 32, the CPU kernel's smallest; d 64), grouped
    routing, non-zero routing biases and weights large enough that positions change the logits.
    `q_lora_rank` 0: MLA with a plain query projection."""

    rope_scaling = RopeScalingConfig()
    if yarn:  # DeepSeek-V3's shape of YaRN (mscale = mscale_all_dim = 1), at a small scale
        rope_scaling = RopeScalingConfig("yarn", 4.0, 32, mscale=1.0, mscale_all_dim=1.0)  # 32 * 4 = max_seq_len
    cfg = tiny_model_cfg(
        attention,
        moe=dict(moe_inter_dim=32),
        vocab_size=vocab_size,
        dim=64,
        inter_dim=96,
        max_seq_len=128,
        rope_scaling=rope_scaling,
        # MLA: q/k head 16 + 16 = 32; vLLM's MHA path pads v to the q/k head size
        mla=MLAConfig(
            q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16
        ),
        gqa=GQAConfig(n_kv_heads=2, head_dim=32, partial_rotary_factor=0.5),
    )
    return check_weights(cfg)


def check_weights(cfg: ModelConfig):
    """A model of `cfg` (seed 0) with a check model's weights: matrices times WEIGHT_SCALE, non-zero routing
    biases."""
    import torch

    from moe_lm.model import Transformer

    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(WEIGHT_SCALE)
        for router in model.routers():  # biases that change which experts are chosen
            router.e_score_correction_bias.normal_(0.0, 0.05)
    return model


def check_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """PROMPTS random token-id prompts of PROMPT_LEN tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (PROMPTS, PROMPT_LEN), generator=g).tolist()


def prompt_logprobs(model, prompts: list[list[int]]) -> list[list[float]]:
    """Our log p(token i | tokens < i) for i >= 1 of every prompt ([n_prompts][len - 1])."""
    import torch

    tokens = torch.tensor(prompts)
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens).logits.double(), dim=-1)
    return logp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1).tolist()


def _apply_rope_interleaved(x, cos, sin):
    """apply_rope with the other pairing (x_{2i} with x_{2i+1}), from the same cos/sin [S, R]."""
    import torch

    c, s = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)


def wrong_layout_logprobs(model, prompts: list[list[int]]) -> list[list[float]]:
    """The logprobs an engine would give with the other rotary pairing than the export's weights are written for.

    why this equals it: such an engine applies pairing P' to rows written for P; permuting both q and k back to our
    layout (exact: q.k is invariant) leaves our weights under the other pairing."""
    from unittest import mock

    import moe_lm.model.attention as attention

    with mock.patch.object(attention, "apply_rope", _apply_rope_interleaved):
        return prompt_logprobs(model, prompts)


def max_abs_gap(a: list[list[float]], b: list[list[float]]) -> float:
    """max |a - b| over all prompt tokens; inf when the shapes differ or a value is missing."""
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b, strict=True)):
        return math.inf
    return max((abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True)), default=0.0)


def trace_as_engine_record(trace_dir, path, engine: str, n_layers: int, phys_to_log=None) -> int:
    """A moe-lm trace's windows written as an engine writes its record (moe_lm/interop/routes/): `engine`
    "vllm" or "sglang" (JSON lines of responses: each window a request, half prompt, half completion, and one more
    sampled token that has no route), "dump" (an SGLang per-token dump into the folder `path`: each window a
    prefill, its ids physical slots of `phys_to_log` [n_layers, slots], the first slot of each logical expert), or
    "megatron" (Megatron-Core's router trace and the tokens file into the folder `path`: the full-length windows in
    micro-batches of two, two a step, each recorded again as activation recompute does). Returns the sequences
    written."""
    import json
    from pathlib import Path

    import numpy as np
    import torch

    from moe_lm.interop.routes.record import engine_routes
    from moe_lm.interop.routes.sglang import sglang_response
    from moe_lm.interop.routes.sglang_dumps import sglang_dump
    from moe_lm.interop.routes.vllm import vllm_response
    from moe_lm.routing.trace import Trace

    trace = Trace(trace_dir)
    experts = {layer: np.asarray(trace.experts(layer), dtype=np.int64) for layer in trace.layers}
    token, doc, pos = (np.asarray(c, dtype=np.int64) for c in (trace.token, trace.doc, trace.pos))
    window = doc * (1 << 32) + pos // trace.meta["windows"]
    cuts = np.flatnonzero(np.diff(window)) + 1
    rows = np.split(np.arange(trace.n), cuts)
    if engine == "megatron":
        from moe_lm.interop.routes.megatron import megatron_trace

        full = [r for r in rows if len(r) == trace.meta["windows"]]
        pairs = [np.stack(full[i : i + 2]) for i in range(0, len(full) - 1, 2)]  # [2, s] rows each
        megatron_trace(Path(path), [(token[r], {lay: e[r] for lay, e in experts.items()}) for r in pairs],
                       recompute=True)  # fmt: skip
        return 2 * len(pairs)
    if engine == "dump":
        first_slot = np.stack([np.argmax(phys_to_log == e, axis=1) for e in range(trace.n_experts)], axis=1)
        passes = []
        for r in rows:
            routes = engine_routes({lay: e[r] for lay, e in experts.items()}, n_layers, trace.k, -1)
            physical = np.where(routes >= 0, np.take_along_axis(first_slot[None], routes.clip(0), axis=2), -1)
            passes.append((token[r], physical.transpose(1, 0, 2)))
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save(sglang_dump(passes, phys_to_log), Path(path) / "expert_distribution_recorder_1700000000.0_0.pt")
        return len(passes)
    with open(path, "w") as f:
        for r in rows:
            tokens = np.append(token[r], 0)  # the last sampled token: never forwarded, so never routed
            routes = engine_routes({lay: e[r] for lay, e in experts.items()}, n_layers, trace.k, 0)
            line = (vllm_response(tokens, len(r) // 2, routes, trace.n_experts) if engine == "vllm"
                    else sglang_response(tokens, len(r) // 2, routes))  # fmt: skip
            f.write(json.dumps(line) + "\n")
    return len(rows)
