"""The torchtitan arm of `bench train --peers`: torchtitan's own DeepSeek-V3 (its MLA attention, router, grouped
experts and loss) built at our config's shape, holding our initial weights, stepped beside ours.

Shape: `_build_dsv3_layers` (the builder of torchtitan's own DeepSeek-V3 flavours) with our dims, MLA ranks, dense
and MoE layers, routed experts top-k in groups (sigmoid scores, our scaling and normalisation), shared experts,
vocabulary and RoPE; `tests/bench` checks its logits against ours (fp32, the two defaults below changed).
Weights: ours as `transformers` holds them (`to_hf_model`: DeepSeek's published layout, rotary rows interleaved as
torchtitan's complex RoPE pairs them), experts split one by one as a checkpoint stores them, then torchtitan's
`DeepSeekV3StateDictAdapter.from_hf`: every arm starts from the same model.

torchtitan's defaults are kept (what its users run): its routed experts compute in bf16 on every device
(`GroupedExperts.forward` casts), its RMSNorm eps is 1e-5 (DeepSeek's 1e-6), and its attention is FlexAttention
(compiled, with its autotuning options; the block-causal mask built every step, as its trainer does) on CUDA; on
the CPU its `ScaledDotProductAttention` module (Flex has no CPU backward, varlen is CUDA-only). Its loss is its own
`cross_entropy_loss` over the full logits (a sum, divided by the tokens as its trainer does). The optimizer,
clipping and batch are every arm's. Not run: its expert-bias update (an optimizer hook wired to its
ParallelDims); HF trains none either.
"""

from __future__ import annotations

import importlib.util
import re
from importlib.metadata import version

import torch

from moe_lm.bench.arms import PeerArm, adamw
from moe_lm.bench.torchtitan_compat import import_torchtitan as titan  # importable without triton, on torch 2.11
from moe_lm.config import Config, ModelConfig

TORCHTITAN = "0.3.0"  # the release this arm calls: `_build_dsv3_layers` is private there and may change


def unavailable(cfg: ModelConfig) -> str | None:
    """Why the arm cannot run for `cfg` here (None: it can)."""
    if importlib.util.find_spec("torchtitan") is None:
        return f"torchtitan is not installed (pip install --no-deps torchtitan=={TORCHTITAN} 'moe-lm[peers]')"
    if version("torchtitan") != TORCHTITAN:
        return f"torchtitan {version('torchtitan')} is installed; the arm calls {TORCHTITAN}'s builder"
    if cfg.attention != "mla" or cfg.mtp.depth:
        return "the arm builds torchtitan's DeepSeek-V3: MLA attention and model.mtp.depth=0"
    if cfg.rope_scaling.rope_type != "default":
        return "the arm maps plain RoPE only (model.rope_scaling.rope_type=default)"
    try:
        titan()
    except Exception as e:  # noqa: BLE001 - whatever stops its import (a torch it was not written for) is the reason
        return f"torchtitan {TORCHTITAN} does not import here: {type(e).__name__}: {str(e)[:200]}"
    return None


def titan_config(cfg: ModelConfig, flex: bool, norm_eps: float | None = None):
    """torchtitan's DeepSeekV3Model.Config at the shape of `cfg` (MLA). `flex`: its default FlexAttention, else its
    SDPA module; `norm_eps`: every RMSNorm's eps (None: torchtitan's default)."""
    tt, m, a = titan(), cfg.moe, cfg.mla
    rope = tt.common.ComplexRoPE.Config(dim=a.qk_rope_head_dim, max_seq_len=cfg.max_seq_len, theta=cfg.rope_theta)
    layers = tt.layers(
        n_layers=cfg.n_layers, n_dense_layers=cfg.first_k_dense_replace, dim=cfg.dim, n_heads=cfg.n_heads,
        q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim,
        qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim, mscale=1.0, dense_hidden_dim=cfg.inter_dim,
        moe_hidden_dim=m.moe_inter_dim, num_experts=m.n_routed_experts, num_shared_experts=m.n_shared_experts,
        router_top_k=m.num_experts_per_tok, router_score_func="sigmoid", router_num_expert_groups=m.n_group,
        router_num_limited_groups=m.topk_group, router_route_scale=m.routed_scaling_factor,
        router_route_norm=m.norm_topk_prob, attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None, rope=rope,
    )  # fmt: skip
    if not flex:
        for layer in layers:
            layer.attention.inner_attention = tt.sdpa.Config()
    model_cfg = tt.Model.Config(
        vocab_size=cfg.vocab_size, dim=cfg.dim, layers=layers, mtp_layers=[],
        tok_embeddings=tt.common.Embedding.Config(num_embeddings=cfg.vocab_size, embedding_dim=cfg.dim),
        norm=tt.common.RMSNorm.Config(normalized_shape=cfg.dim),
        lm_head=tt.common.Linear.Config(in_features=cfg.dim, out_features=cfg.vocab_size),
    )  # fmt: skip
    if norm_eps is not None:
        for norm in _norm_configs(model_cfg, tt.common.RMSNorm.Config):
            norm.eps = norm_eps
    return model_cfg


def _norm_configs(node, kind):
    """Every `kind` (an RMSNorm config) inside a torchtitan config tree."""
    if isinstance(node, kind):
        yield node
    elif isinstance(node, list):
        for item in node:
            yield from _norm_configs(item, kind)
    elif hasattr(node, "__dataclass_fields__"):
        for name in node.__dataclass_fields__:
            yield from _norm_configs(getattr(node, name, None), kind)


def titan_model(ours, flex: bool, device: str, dtype: torch.dtype, norm_eps: float | None = None):
    """torchtitan's DeepSeek-V3 at the shape of `ours` (our Transformer), holding its weights, on `device`: its
    parameters in `dtype`, its buffers (RoPE cache, expert bias and counts) in its own dtypes."""
    from moe_lm.interop.hf import to_hf_model

    tt = titan()
    model_cfg = titan_config(ours.cfg, flex, norm_eps)
    # its trainer's order: built on the meta device, materialised where it runs, initialised, then a checkpoint
    with torch.device("meta"):
        model = model_cfg.build().to(dtype=dtype)
    model.to_empty(device=device)
    model.init_states(buffer_device=torch.device(device))
    state = tt.Adapter(model_cfg, None).from_hf(published_experts(to_hf_model(ours).state_dict()))
    model.load_state_dict(state, strict=True)
    return model.train()


def published_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`transformers`' fused expert tensors (`mlp.experts.gate_up_proj` [E, 2I, D], `down_proj` [E, D, I]) as a
    checkpoint stores them, one expert at a time (`mlp.experts.<e>.gate_proj.weight`, ...): what the adapter reads."""
    out = {}
    for key, value in state.items():
        fused = re.fullmatch(r"(.*\.mlp\.experts\.)(gate_up_proj|down_proj)", key)
        if fused is None:
            out[key] = value
        elif fused[2] == "down_proj":
            out |= {f"{fused[1]}{e}.down_proj.weight": w for e, w in enumerate(value)}
        else:
            gate, up = value.chunk(2, dim=1)  # transformers' order: gate rows, then up rows
            out |= {f"{fused[1]}{e}.gate_proj.weight": w for e, w in enumerate(gate)}
            out |= {f"{fused[1]}{e}.up_proj.weight": w for e, w in enumerate(up)}
    return out


class TorchtitanArm(PeerArm):
    """torchtitan's DeepSeek-V3 holding the weights of `model` (our Transformer), stepped like the other peers."""

    def __init__(self, name: str, cfg: Config, model, device: str, dtype: torch.dtype) -> None:
        self.name, self.cfg = name, cfg
        self.flex = torch.device(device).type == "cuda"  # its default attention; the CPU has no Flex backward
        self.attention = "its FlexAttention" if self.flex else "its SDPA module"
        self.model = titan_model(model, self.flex, device, dtype)
        self.opt = adamw(self.model.parameters(), cfg.optim)
        self.loss_fn = titan().cross_entropy_loss

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        masks = None
        if self.flex:  # its trainer builds the block-causal mask from every batch's positions
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
            masks = self.model.get_attention_masks(positions)
        return self.model(tokens, attention_masks=masks)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(logits, labels) / labels.numel()  # a sum over tokens; its trainer divides
