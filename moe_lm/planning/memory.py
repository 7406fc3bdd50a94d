"""Memory per GPU of a training configuration, estimated from the config: weights, gradients, optimizer state,
activations, the logits, and DeepSpeed's communication buckets.

Weights and optimizer state follow the ZeRO paper's mixed-precision accounting (Rajbhandari et al. 2020): bf16
weights and gradients (2 + 2 bytes) and fp32 master weights, Adam momentum and variance (12 bytes) per parameter.
ZeRO-1 shards the 12 bytes over the data-parallel ranks, ZeRO-2 also the gradients. Routed experts are first split
over the expert-parallel group (ep_size) and their states sharded over the expert-data-parallel group (world /
ep_size); everything else over the whole world.

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
from moe_lm.model import count_params

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


def estimate(cfg: Config, world: int) -> MemoryEstimate:
    """Bytes per GPU for `world` GPUs (data-parallel over all, routed experts over parallel.ep_size)."""
    m, t, p, perf = cfg.model, cfg.train, cfg.parallel, cfg.performance
    n = count_params(m)
    n_moe_blocks = m.n_layers - m.first_k_dense_replace + m.mtp.depth
    expert_params = n_moe_blocks * m.moe.n_routed_experts * n.routed_expert
    other_params = n.total + n.mtp_total - expert_params
    local_experts = expert_params / p.ep_size
    edp = world / p.ep_size  # ranks holding the same experts
    weights = BF16 * (other_params + local_experts)
    grad_shard = p.zero_stage >= 2
    gradients = BF16 * (other_params / (world if grad_shard else 1) + local_experts / (edp if grad_shard else 1))
    optimizer = 3 * FP32 * (other_params / world + local_experts / edp)
    tokens = t.micro_batch_size * t.seq_len
    dense = [block_activation_elements(m, moe=False)] * min(m.first_k_dense_replace, m.n_layers)
    sparse = [block_activation_elements(m, moe=True)] * (m.n_layers - len(dense) + m.mtp.depth)
    kept = {"none": 0, "full": len(dense) + len(sparse), "selective": len(sparse)}[perf.activation_checkpointing]
    blocks = dense + sparse
    recomputed = sorted(blocks)[-kept:] if kept else []
    per_token = sum(blocks) - sum(recomputed) + kept * m.dim + (max(recomputed) if recomputed else 0)
    activations = BF16 * tokens * per_token
    heads = 1 + m.mtp.depth
    if perf.loss_chunk:
        kept = heads * (BF16 * tokens * m.dim + FP32 * m.vocab_size * m.dim)
        logits = (BF16 + FP32 + BF16) * min(perf.loss_chunk, tokens) * m.vocab_size + kept
    else:
        logits = (BF16 + FP32 + FP32) * tokens * m.vocab_size * heads
    buckets = BF16 * min(2 * BUCKET_ELEMENTS, 2 * (other_params + local_experts)) if world > 1 or grad_shard else 0
    return MemoryEstimate(weights, gradients, optimizer, activations, logits, buckets)
