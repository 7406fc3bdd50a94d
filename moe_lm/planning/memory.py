"""Memory per GPU of a training configuration, estimated from the config: weights, gradients, optimizer state,
activations, the logits, and DeepSpeed's communication buckets.

Weights and optimizer state follow the ZeRO paper's mixed-precision accounting (Rajbhandari et al. 2020): bf16
weights and gradients (2 + 2 bytes) and fp32 master weights, Adam momentum and variance (12 bytes) per parameter.
ZeRO-1 shards the 12 bytes over the data-parallel ranks, ZeRO-2 also the gradients. Routed experts are first split
over the expert-parallel group (ep_size) and their states sharded over the expert-data-parallel group (world /
ep_size); everything else over the whole world. With pipeline stages (parallel.pp_size) each stage holds its own
layers (moe_lm/planning/stages.py), its data-parallel ranks are world / pp_size, and it keeps the activations of
the micro-batches 1F1B has in flight there; the estimate per GPU is the largest stage's.

Activations are the tensors autograd keeps per token and layer in bf16 (counted from the model's own ops: norms'
inputs and outputs, projections, attention inputs and output, the FFN's gate/up/activation, each routed slot's
gathered input and expert activations, fp32 router scores), with fused attention (no S x S matrix kept). The
logits are kept in bf16 and as an fp32 copy, and cross-entropy keeps its fp32 log-softmax: 10 bytes per token and
vocabulary entry, per output head (main and MTP). With performance.loss_chunk = c only one chunk's logits exist (a bf16
product, its fp32 copy, a bf16 gradient: 8 bytes per chunk token and vocabulary entry), and each head keeps its
dL/dh (bf16, per token and dim) and an fp32 dL/dW (vocab x dim). Full activation checkpointing keeps each block's
input only (plus one block recomputed at a time); selective keeps the MoE blocks' inputs only. An estimate, to be
checked against a measured peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_lm.config import Config
from moe_lm.planning.stages import stages

GB = 1024**3
BF16, FP32 = 2, 4
BUCKET_ELEMENTS = 5e8  # DeepSpeed's default reduce_bucket_size and allgather_bucket_size (elements)


@dataclass
class MemoryEstimate:
    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    buckets: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.buckets


def block_activation_elements(cfg, moe: bool) -> float:
    """bf16-sized elements autograd keeps for one token in one block (fp32 values count twice)."""
    D, H = cfg.dim, cfg.n_heads
    if cfg.attention == "mla":
        m = cfg.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = (2 * m.q_lora_rank if m.q_lora_rank else 0) + H * qk
        kv = (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank + H * (m.qk_nope_head_dim + m.v_head_dim)
        attn = 2 * D + q + kv + 2 * H * qk + H * m.v_head_dim + 2 * H * m.v_head_dim + 2 * H
    else:
        g = cfg.gqa
        attn = 2 * D + 2 * (H + 2 * g.n_kv_heads) * g.head_dim + 2 * H * g.head_dim + 2 * H
    if not moe:
        return attn + 2 * D + 3 * cfg.inter_dim
    e, K, I = cfg.moe, cfg.moe.num_experts_per_tok, cfg.moe.moe_inter_dim
    routed = K * (D + 3 * I + D)  # per slot: gathered input, gate/up, activation, weighted output
    shared = 3 * I * e.n_shared_experts
    return attn + 2 * D + 2 * e.n_routed_experts + routed + shared


def estimate(cfg: Config, world: int, recompute: str | None = None) -> MemoryEstimate:
    """Bytes per GPU for `world` GPUs: of the stage that needs the most with pipeline stages (parallel.pp_size), of
    the whole model otherwise. `recompute`: this activation checkpointing mode instead of the config's."""
    return max(stage_estimates(cfg, world, recompute), key=lambda e: e.total)


def stage_estimates(cfg: Config, world: int, recompute: str | None = None) -> list[MemoryEstimate]:
    """Bytes per GPU of each pipeline stage (one without pipeline parallelism). A stage's ranks are world / pp,
    data-parallel; its routed experts are split over ep_size of them and their states over the rest."""
    m, t, p, perf = cfg.model, cfg.train, cfg.parallel, cfg.performance
    mode = recompute or perf.activation_checkpointing
    dp = world / p.pp_size  # the ranks of one stage
    edp = dp / p.ep_size  # ranks holding the same experts
    # one rank runs ZeRO-1 without contiguous gradients, whatever zero_stage says (parallel/deepspeed_setup.py,
    # zero_optimization): no gradient partition, no reduction buckets
    grad_shard = p.zero_stage >= 2 and world > 1
    tokens = t.micro_batch_size * t.seq_len
    out = []
    for stage in stages(cfg):
        other, local_experts = stage.other_params, stage.expert_params / p.ep_size
        weights = BF16 * (other + local_experts)
        gradients = BF16 * (other / (dp if grad_shard else 1) + local_experts / (edp if grad_shard else 1))
        optimizer = 3 * FP32 * (other / dp + local_experts / edp)
        blocks = [block_activation_elements(m, moe=moe) for moe in stage.blocks]
        kept = {"none": 0, "full": len(blocks), "selective": sum(stage.blocks)}[mode]
        recomputed = sorted(blocks)[-kept:] if kept else []
        # every micro-batch in flight keeps its blocks' activations (their inputs only where recomputed); one
        # block is recomputed at a time
        per_token = (sum(blocks) - sum(recomputed) + kept * m.dim) * stage.in_flight
        per_token += max(recomputed) if recomputed else 0
        activations = BF16 * tokens * per_token
        logits = _logits(cfg, tokens) if stage.head else 0
        buckets = BF16 * min(2 * BUCKET_ELEMENTS, 2 * (other + local_experts)) if world > 1 else 0
        out.append(MemoryEstimate(weights, gradients, optimizer, activations, logits, buckets))
    return out


def _logits(cfg: Config, tokens: int) -> float:
    """The output heads' logits (main and MTP) of one micro-batch, or their chunks with performance.loss_chunk."""
    m, chunk = cfg.model, cfg.performance.loss_chunk
    heads = 1 + m.mtp.depth
    if chunk:
        kept = heads * (BF16 * tokens * m.dim + FP32 * m.vocab_size * m.dim)
        return (BF16 + FP32 + BF16) * min(chunk, tokens) * m.vocab_size + kept
    return (BF16 + FP32 + FP32) * tokens * m.vocab_size * heads
