"""The arms of the training-step benchmark: ours (a config, stepped as `moe-lm train` steps it), HF
`DeepseekV3ForCausalLM` on the same weights, and the dense twin of a MoE config (torchtitan's arm:
moe_lm/bench/torchtitan_arm.py).

- `Arm`: one config's model built from its seed, trained with the same objective as `moe-lm train` (main CE +
  lambda/D * MTP CEs + balance losses, the bias update; activation checkpointing, compile and the chunked loss as
  configured).
- `PeerArm`: another library's model stepped as its users train it (its logits and cross-entropy), then every arm's
  clipping and AdamW: `HFArm` here, torchtitan's in moe_lm/bench/torchtitan_arm.py.
- `HFArm` (`--peers`): our model as `transformers` holds it (`to_hf_model`, what `export_hf` writes), with one of
  its expert implementations (eager, grouped_mm; SDPA attention), stepped with the same loss (next-token
  cross-entropy over the same positions), clipping and AdamW. HF trains no selection bias and has no sequence-wise
  balance loss: ours does that extra work in its time.
- `dense_twin`: every layer dense, its MLP as wide as the shared + k routed experts of a MoE layer
  (inter_dim = (n_shared + k) x moe_inter_dim), so each token passes through the same matmul FLOPs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_lm.config import Config
from moe_lm.errors import UserError
from moe_lm.model import build_model, loss_chunk, train_flops_per_token
from moe_lm.parallel.deepspeed_setup import param_groups
from moe_lm.train.balance import balance_step
from moe_lm.train.objective import next_token_losses, total_loss
from moe_lm.train.recompute import apply_activation_checkpointing, apply_compile, compiles


def adamw(params, o) -> torch.optim.AdamW:
    """The optimizer of every arm, ours and HF's: torch's fused AdamW (one kernel for all parameters; what
    transformers' Trainer picks by default, adamw_torch_fused). why not the per-tensor loop: the trainer's DeepSpeed
    ZeRO steps a few flat buffers, where a loop over 260 small tensors would add overhead the real step lacks."""
    return torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)


class StepArm:
    """What every arm has: a name, its config, a model and an optimizer it steps; tokens and model FLOPs per step."""

    name: str
    cfg: Config

    def gflops_per_step(self) -> float:
        t = self.cfg.train
        return train_flops_per_token(self.cfg.model, t.seq_len, self.cfg.objective.prefix_len) * self.tokens / 1e9

    @property
    def tokens(self) -> int:
        return self.cfg.train.micro_batch_size * self.cfg.train.seq_len


class Arm(StepArm):
    """One config's model and optimizer, stepped the way `moe-lm train` steps them (without DeepSpeed)."""

    def __init__(
        self, name: str, cfg: Config, device: str = "cpu", dtype: torch.dtype = torch.float32, switched_back=()
    ) -> None:
        """`switched_back`: the changes of issue 65 undone in this arm's model (moe_lm/bench/before_65.py), before
        it is compiled."""
        self.name, self.cfg = name, cfg
        torch.manual_seed(cfg.seed)
        with torch.device(device):  # why built there: initialising a 1 B model on the CPU first takes a minute
            model = build_model(cfg.model).to(dtype=dtype).train()
        if switched_back:
            from moe_lm.bench.before_65 import switch_back

            model = switch_back(model, switched_back)
        model = apply_activation_checkpointing(model, cfg.performance.activation_checkpointing)
        self.model = apply_compile(model, compiles(cfg.performance.compile, torch.device(device)))
        o = cfg.optim
        self.opt = adamw(param_groups(self.model, o.weight_decay), o)
        self.depth = cfg.model.mtp.depth

    def step(self, batch: torch.Tensor) -> None:
        self.loss(self.forward(batch), batch).backward()
        self.update()

    # the step in its parts, for the profiler (moe_lm/bench/profile.py) to label
    def forward(self, batch: torch.Tensor):
        return self.model(batch[:, :-1], mtp=self.depth > 0, logits=not loss_chunk(self.cfg))

    def loss(self, out, batch: torch.Tensor) -> torch.Tensor:
        ce, mtp = next_token_losses(out, batch[:, 1:], self.model.lm_head.weight, loss_chunk(self.cfg))
        return total_loss(ce, mtp, self.cfg.model.mtp.loss_weight, out.aux_loss)

    def update(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        balance_step(self.model, self.cfg.model.moe.bias_update_speed)


class PeerArm(StepArm):
    """Another library's model, stepped the way its users train it: its logits, its cross-entropy over the next
    tokens, then every arm's clipping and AdamW."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer

    def step(self, batch: torch.Tensor) -> None:
        self.loss(self.logits(batch[:, :-1]), batch[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, S] token ids -> [B, S, vocab] logits."""
        raise NotImplementedError

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class HFArm(PeerArm):
    """HF DeepseekV3ForCausalLM with the weights of `model` (our Transformer), stepped like our arms."""

    def __init__(self, name: str, cfg: Config, model, experts_implementation: str, device: str, dtype) -> None:
        from moe_lm.interop.hf import to_hf_model

        if cfg.model.attention != "mla" or cfg.model.mtp.depth:
            raise UserError("--peers compares with HF DeepseekV3ForCausalLM: MLA attention and model.mtp.depth=0")
        self.name, self.cfg = name, cfg
        # why in memory: a disk round trip (save, from_pretrained, cast) took 46-55 s per arm at gpu_1b's size
        self.model = to_hf_model(model, experts_implementation).to(device=device, dtype=dtype).train()
        self.opt = adamw(self.model.parameters(), cfg.optim)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits


def dense_twin(cfg: Config) -> list[str]:
    """Overrides that turn a MoE config into the dense model of equal active FLOPs."""
    m = cfg.model
    width = (m.moe.n_shared_experts + m.moe.num_experts_per_tok) * m.moe.moe_inter_dim
    return [f"model.first_k_dense_replace={m.n_layers}", f"model.inter_dim={width}"]
