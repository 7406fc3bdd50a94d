"""The config tree's schema: every section as a dataclass, each field with the comment that is its documentation
(docs/config.md is generated from these comments: moe_lm/config_docs.py), and the cross-field rules (`validate`).

Loading (presets, `base:` chains, dotted overrides) is moe_lm/config/loading.py; the names some keys accept are
moe_lm/config/choices.py; renamed keys, moe_lm/config/moved_keys.py; the typed decoder, moe_lm/config/decode.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from moe_lm.config.choices import CHOICES, require_choice
from moe_lm.errors import ConfigError

# ----------------------------------------------------------------------------------------------- model


@dataclass
class RopeScalingConfig:
    """Context extension of RoPE: "default" (none) or "yarn", as DeepSeek-V3 ships it and HF computes it."""

    # "default" (plain RoPE) or "yarn" (context extension).
    rope_type: Literal["default", "yarn"] = "default"
    # YaRN: how many times the original context is extended.
    factor: float = 1.0
    # The context the model was pretrained with; YaRN keeps the dims that rotate fast within it unchanged.
    original_max_position_embeddings: int = 4096
    # YaRN: dims turning more than this many times within the original context are kept as they are.
    beta_fast: float = 32.0
    # YaRN: dims turning fewer than this many times are interpolated by `factor`; a ramp in between.
    beta_slow: float = 1.0
    # cos/sin are scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim) and MLA's softmax scale by
    # mscale(factor, mscale_all_dim)^2, with mscale(s, m) = 0.1 m ln(s) + 1 (DeepSeek-V3: both 1.0).
    mscale: float = 1.0
    # YaRN: the mscale of the softmax temperature correction (DeepSeek-V3: 1.0; 0 = none).
    mscale_all_dim: float = 0.0


@dataclass
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3)."""

    # Rank of the low-rank query projection; 0 uses a direct q_proj (DeepSeek-V2-Lite style).
    q_lora_rank: int = 0
    # Rank of the compressed key/value latent (what an inference KV cache stores).
    kv_lora_rank: int = 32
    # Per-head query/key dims without position information.
    qk_nope_head_dim: int = 16
    # Rotary query/key dims; the rotary key is shared by all heads.
    qk_rope_head_dim: int = 8
    # Per-head value dims.
    v_head_dim: int = 16


@dataclass
class GQAConfig:
    """Grouped-query attention with (partial) RoPE, as in GLM-4.5-style MoE models."""

    # Key/value heads, shared by n_heads / n_kv_heads query heads each.
    n_kv_heads: int = 2
    # Dims per head (queries, keys and values alike).
    head_dim: int = 32
    # Share of each head's dims that is rotated (GLM-4.5 uses 0.5).
    partial_rotary_factor: float = 0.5


@dataclass
class MoEConfig:
    """DeepSeek-V3 MoE layer: shared experts plus sigmoid-gated top-k routed experts."""

    # Routed experts per MoE layer (E).
    n_routed_experts: int = 8
    # Shared experts form one SwiGLU MLP of width n_shared_experts * moe_inter_dim, added unweighted.
    n_shared_experts: int = 1
    # Routed experts each token is sent to (K, top-k).
    num_experts_per_tok: int = 2
    # Group-limited routing: experts are split into n_group groups and only topk_group groups are eligible.
    n_group: int = 1
    # Groups kept per token (the rest of the experts are not eligible for it).
    topk_group: int = 1
    # The routed experts' gate weights are scaled by this (DeepSeek-V3: 2.5).
    routed_scaling_factor: float = 1.0
    # Normalise the K selected gate weights to sum to 1 before the scaling.
    norm_topk_prob: bool = True
    # Width of one routed (and one shared) expert.
    moe_inter_dim: int = 64
    # Local expert compute: "loop" (the reference), "grouped" (sorted segments, dropless, the fast path) or
    # "megablocks" (MegaBlocks' dropless kernels on the same weights; CUDA and the optional extra only).
    experts_impl: Literal["loop", "grouped", "megablocks"] = "grouped"
    # Auxiliary-loss-free balancing speed gamma (DeepSeek-V3: 0.001); 0 switches the bias update off.
    bias_update_speed: float = 1e-3
    # Complementary sequence-wise balance loss weight alpha (DeepSeek-V3: 1e-4); 0 switches it off.
    seq_aux_alpha: float = 1e-4
    # Classic batch-level auxiliary loss weight, for comparisons with loss-free balancing; 0 = off.
    aux_alpha: float = 0.0

    def validate(self, path: str = "model.moe") -> None:
        m = self
        E, K = m.n_routed_experts, m.num_experts_per_tok
        _require(E > 0, f"{path}.n_routed_experts", "must be positive")
        _require(m.n_shared_experts >= 0, f"{path}.n_shared_experts", "must be >= 0")
        _require(m.moe_inter_dim > 0, f"{path}.moe_inter_dim", "must be positive")
        _require(1 <= K <= E, f"{path}.num_experts_per_tok", f"must be between 1 and n_routed_experts={E}")
        _require(m.n_group >= 1 and E % m.n_group == 0, f"{path}.n_group", f"must divide n_routed_experts={E}")
        _require(1 <= m.topk_group <= m.n_group, f"{path}.topk_group", f"must be between 1 and n_group={m.n_group}")
        if m.n_group > 1:
            # why: a group's score is the sum of its top-2 experts, so a group needs at least two.
            _require(E // m.n_group >= 2, f"{path}.n_group", "each group needs at least 2 experts")
        eligible = m.topk_group * E // m.n_group
        _require(
            K <= eligible,
            f"{path}.num_experts_per_tok",
            f"= {K} exceeds the {eligible} experts in the topk_group={m.topk_group} kept groups",
        )
        _require(m.routed_scaling_factor > 0, f"{path}.routed_scaling_factor", "must be positive")
        for name in ("bias_update_speed", "seq_aux_alpha", "aux_alpha"):
            _require(getattr(m, name) >= 0, f"{path}.{name}", "must be >= 0")


@dataclass
class MTPConfig:
    """Multi-token prediction (DeepSeek-V3 §2.2): D sequential modules, module k predicting the token k + 1 ahead.

    Module k shares the embedding and the output head with the main model and has its own projection, two RMSNorms,
    one Transformer block (with an MoE FFN, its own router and bias) and its own head norm. The training loss adds
    L_MTP = (loss_weight / D) * sum_k CE_k. The modules are a training objective and a draft model for speculative
    decoding; the main model's next-token prediction never depends on them.
    """

    # D; 0 switches MTP off (the model is then exactly the one without this section).
    depth: int = 0
    # lambda (DeepSeek-V3: 0.3 for the first 10T tokens, then 0.1).
    loss_weight: float = 0.3
    # lambda from `late_start` on (the second phase of DeepSeek-V3's schedule).
    late_loss_weight: float = 0.1
    # When late_loss_weight takes over: a fraction of train.max_steps if <= 1 (DeepSeek-V3: 10/14.8 = 0.68), a step
    # number if > 1; 0 = never (loss_weight throughout).
    late_start: float = 0.0

    def validate(self, path: str = "model.mtp") -> None:
        _require(self.depth >= 0, f"{path}.depth", "must be >= 0 (0 = off)")
        for name in ("loss_weight", "late_loss_weight", "late_start"):
            value = getattr(self, name)
            _require(
                math.isfinite(value) and value >= 0, f"{path}.{name}", f"must be a finite number >= 0, got {value}"
            )


@dataclass
class ModelConfig:
    """Decoder-only Transformer; the first `first_k_dense_replace` blocks use a dense SwiGLU MLP."""

    # "decoder": the decoder-only Transformer. Research variants register other architectures (the encoder-decoder
    # "encdec" of moe_lm/experiments/variants/encdec.py).
    arch: str = "decoder"
    # Vocabulary size (the tokenizer's; `moe-lm prepare` trains one of this size by default).
    vocab_size: int = 4096
    # Model (hidden) dimension D.
    dim: int = 128
    # Layers of the decoder (of the decoder stack where an architecture has an encoder too).
    n_layers: int = 4
    # Layers of an encoder stack, for architectures that have one (the encoder-decoder variant).
    n_enc_layers: int = 0
    # Attention (query) heads.
    n_heads: int = 4
    # Width of the dense SwiGLU MLP in the first `first_k_dense_replace` layers.
    inter_dim: int = 256
    # The first this many layers use the dense MLP; the rest are MoE layers (DeepSeek-V3: 3).
    first_k_dense_replace: int = 1
    # "mla" (multi-head latent attention, DeepSeek-V2/V3) or "gqa" (grouped-query attention, GLM-4.5 style).
    attention: Literal["mla", "gqa"] = "mla"
    # "causal". Research variants register other masks (moe_lm/experiments/variants/masks.py): "prefix"
    # (bidirectional inside a prefix: prefix-LM / UniLM) and, for masked-language models, "bidirectional",
    # "mixed_heads" and "mixed_layers" (Su's mixed forward/backward attention).
    attn_mask: str = "causal"
    # The longest sequence the model takes (RoPE positions, the KV cache, generation's context).
    max_seq_len: int = 256
    # RoPE base frequency.
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    # RMSNorm epsilon.
    norm_eps: float = 1e-6
    # Standard deviation of the normal initialisation of every linear and embedding weight.
    init_std: float = 0.02
    mla: MLAConfig = field(default_factory=MLAConfig)
    gqa: GQAConfig = field(default_factory=GQAConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    mtp: MTPConfig = field(default_factory=MTPConfig)

    def validate(self, path: str = "model") -> None:
        _require(self.vocab_size > 1, f"{path}.vocab_size", "must be > 1")
        for name in ("dim", "n_layers", "n_heads", "inter_dim", "max_seq_len"):
            _require(getattr(self, name) > 0, f"{path}.{name}", "must be positive")
        _require(self.n_enc_layers >= 0, f"{path}.n_enc_layers", "must be >= 0")
        deepest = max(self.n_layers, self.n_enc_layers)  # dense layers are counted within each stack
        _require(
            0 <= self.first_k_dense_replace <= deepest,
            f"{path}.first_k_dense_replace",
            f"must be between 0 and the number of layers, {deepest}",
        )
        if self.attention == "mla":
            _require(self.mla.qk_rope_head_dim % 2 == 0, f"{path}.mla.qk_rope_head_dim", "must be even (RoPE)")
            _require(self.mla.q_lora_rank >= 0, f"{path}.mla.q_lora_rank", "must be >= 0 (0 = no low rank)")
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                _require(getattr(self.mla, name) > 0, f"{path}.mla.{name}", "must be positive")
        else:
            _require(
                self.gqa.n_kv_heads > 0 and self.n_heads % self.gqa.n_kv_heads == 0,
                f"{path}.gqa.n_kv_heads",
                f"must divide n_heads={self.n_heads}",
            )
            rot = int(self.gqa.head_dim * self.gqa.partial_rotary_factor)
            _require(
                rot > 0 and rot % 2 == 0,
                f"{path}.gqa.partial_rotary_factor",
                f"head_dim * factor = {rot} must be a positive even number of rotary dims",
            )
        r = self.rope_scaling
        if r.rope_type == "yarn":
            _require(r.factor >= 1.0, f"{path}.rope_scaling.factor", "must be >= 1 for yarn")
            _require(
                r.original_max_position_embeddings > 0,
                f"{path}.rope_scaling.original_max_position_embeddings",
                "must be positive",
            )
        self.moe.validate(f"{path}.moe")
        self.mtp.validate(f"{path}.mtp")
        require_choice("model.arch", self.arch, f"{path}.arch")
        require_choice("model.attn_mask", self.attn_mask, f"{path}.attn_mask")


# ------------------------------------------------------------------------------------------- data/train


@dataclass
class DataConfig:
    """Corpus, tokenizer and token shards (built by `moe-lm prepare`, read by training and analytics)."""

    # "default" builds the embedded multi-domain corpus from text this Python installation carries; otherwise
    # paths to .txt / .jsonl files or folders (a folder of sub-folders is one domain per sub-folder), .parquet /
    # .arrow files, globs or folders of them, save_to_disk folders, or hf:NAME[:CONFIG][@SPLIT] (streamed).
    sources: list[str] = field(default_factory=lambda: ["default"])
    # The column (or .jsonl key) that holds a document's text.
    text_field: str = "text"
    # The column (or .jsonl key) that names a document's domain; absent: the source's name.
    domain_field: str = "domain"
    # Where the manifest, tokenizer and shards go.
    out_dir: str = "data/default"
    # Share of documents held out for validation (chosen by a hash of the document name, so stable).
    val_fraction: float = 0.1
    # Cap per domain (MB of text) of the embedded corpus (at most the 2.0 it ships) and of an hf: stream.
    max_mb_per_domain: float = 2.0
    # "train": a sentencepiece tokenizer trained on the training split, of model.vocab_size pieces; or one to keep:
    # a sentencepiece .model, a Hugging Face tokenizer.json, or a folder transformers.AutoTokenizer loads.
    tokenizer: str = "train"
    # The kind of tokenizer "train" trains.
    tokenizer_type: Literal["bpe", "unigram"] = "bpe"

    def validate(self, path: str = "data") -> None:
        _require(len(self.sources) > 0, f"{path}.sources", "must name at least one source (or 'default')")
        for name in ("text_field", "domain_field"):
            _require(bool(getattr(self, name)), f"{path}.{name}", "must name a column (e.g. 'text' / 'domain')")
        _require(0.0 < self.val_fraction < 0.5, f"{path}.val_fraction", "must be in (0, 0.5)")
        _require(self.max_mb_per_domain > 0, f"{path}.max_mb_per_domain", "must be positive")


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine (or warmup-stable-decay) to min_lr."""

    # Peak learning rate (AdamW), reached after the warmup.
    lr: float = 3e-3
    # The learning rate at the end of the decay.
    min_lr: float = 3e-4
    # Steps of linear warmup from lr / warmup_steps to lr (a warmup as long as the run warns).
    warmup_steps: int = 50
    # After the warmup: "cosine" decay to min_lr, or "wsd" (warmup-stable-decay: constant, then linear).
    schedule: Literal["cosine", "wsd"] = "cosine"
    # WSD only: share of the run spent in the final linear decay.
    decay_fraction: float = 0.2
    # AdamW's decoupled weight decay (not applied to norm gains).
    weight_decay: float = 0.1
    # AdamW's first-moment decay.
    beta1: float = 0.9
    # AdamW's second-moment decay.
    beta2: float = 0.95
    # AdamW's epsilon.
    eps: float = 1e-8
    # Global gradient-norm clipping (0 = off).
    grad_clip: float = 1.0

    def validate(self, path: str = "optim") -> None:
        for name in ("lr", "min_lr", "beta1", "beta2", "eps", "weight_decay", "grad_clip", "decay_fraction"):
            _require(math.isfinite(getattr(self, name)), f"{path}.{name}", "must be a finite number")
        _require(self.lr > 0, f"{path}.lr", f"must be positive, got {self.lr}")
        _require(0 <= self.min_lr <= self.lr, f"{path}.min_lr", "must satisfy 0 <= min_lr <= lr")
        for name in ("beta1", "beta2"):
            _require(0 <= getattr(self, name) < 1, f"{path}.{name}", f"must be in [0, 1), got {getattr(self, name)}")
        _require(self.eps > 0, f"{path}.eps", f"must be positive, got {self.eps}")
        _require(self.weight_decay >= 0, f"{path}.weight_decay", f"must be >= 0, got {self.weight_decay}")
        _require(self.warmup_steps >= 0, f"{path}.warmup_steps", "must be >= 0")
        _require(0 < self.decay_fraction <= 1, f"{path}.decay_fraction", "must be in (0, 1]")
        _require(self.grad_clip >= 0, f"{path}.grad_clip", "must be >= 0")


@dataclass
class TrainConfig:
    """The training run: its length, batch and folder, and where it starts from."""

    # Optimizer steps of the run (the learning-rate schedule spans them).
    max_steps: int = 600
    # Tokens per training window (at most model.max_seq_len).
    seq_len: int = 256
    # Sequences per rank per micro-step; the global batch is micro_batch_size * grad_accum_steps * the data-parallel
    # size (the world size / parallel.pp_size: the ranks of one pipeline stage).
    micro_batch_size: int = 8
    # Micro-batches per optimizer step on every rank.
    grad_accum_steps: int = 1
    # The run folder: config, metrics, checkpoints, wandb and TensorBoard files (--out sets it).
    out_dir: str = "runs/tiny"
    # Resume from the latest complete checkpoint in out_dir if there is one; false moves an old run aside.
    resume: bool = True
    # Stop the run after this many consecutive steps with a non-finite loss (each is skipped).
    max_bad_steps: int = 5
    # Stop early (with a checkpoint) after this step, leaving the run resumable; 0 = run to max_steps.
    stop_at: int = 0
    # Start a new run from pretrained weights: "hf:PATH" (a transformers DeepseekV3 / Glm4Moe checkpoint, whose
    # config replaces the architecture in `model`); "" = random initialisation. Resuming ignores it.
    init_from: str = ""
    # Initialise each part of the model (the embedding, each block, the head, each MTP module) from its own seed
    # derived from `seed`, instead of drawing all of them from one generator in turn: a pipeline stage then builds
    # only its own layers, with the weights they have in the whole model. Always on with parallel.pp_size > 1; set it
    # on a run without stages to start from the same weights as a pipelined one. Decoder-only models.
    layer_seeds: bool = False

    def validate(self, path: str = "train") -> None:
        for name in ("max_steps", "seq_len", "micro_batch_size", "grad_accum_steps", "max_bad_steps"):
            _require(getattr(self, name) > 0, f"{path}.{name}", "must be positive")
        _require(self.stop_at >= 0, f"{path}.stop_at", f"must be >= 0 (0: run to max_steps), got {self.stop_at}")
        _require(
            self.init_from == "" or self.init_from.startswith("hf:"),
            f"{path}.init_from",
            f"must be '' or hf:PATH (a transformers checkpoint folder), got {self.init_from!r}",
        )


@dataclass
class CadenceConfig:
    """How often the run logs, evaluates and checkpoints, and how much it keeps."""

    # Steps between train rows (console, metrics.jsonl, wandb, TensorBoard); the last step is always logged.
    log_interval: int = 10
    # Steps between evaluations on the validation windows; the last step is always evaluated.
    eval_interval: int = 100
    # Batches of train.micro_batch_size sequences per domain at each evaluation.
    eval_batches: int = 4
    # Checkpoint every ckpt_interval steps and at the last one; 0 = none (benchmark runs; a signal still saves).
    ckpt_interval: int = 200
    # Complete checkpoints kept; older ones are deleted once a newer one is complete.
    keep_last: int = 2
    # > 1: evaluations also log loss_scored, the loss on the labels at window positions >= this one (an experiment's
    # scored labels, the same for every arm whatever it trains on); 1: not logged.
    eval_score_from: int = 1

    def validate(self, path: str = "cadence") -> None:
        for name in ("log_interval", "eval_interval", "eval_batches", "keep_last", "eval_score_from"):
            _require(getattr(self, name) > 0, f"{path}.{name}", "must be positive")
        _require(self.ckpt_interval >= 0, f"{path}.ckpt_interval", "must be >= 0 (0: no checkpoints)")


@dataclass
class ObjectiveConfig:
    """What a window of train.seq_len + 1 tokens trains: "lm" predicts every next token.

    Research variants register other objectives (moe_lm/experiments/variants/objectives.py): "prefix_lm" predicts
    only the tokens after the window's first prefix_len tokens (with model.attn_mask=prefix the model sees the prefix
    bidirectionally: prefix-LM / UniLM); "mlm" corrupts mlm_prob of the positions (80 % to id 0, 10 % to a random
    token, 10 % kept) and predicts them in place, with masks fixed by the window's content and the seed.
    """

    # "lm", or an objective a research variant registers ("prefix_lm", "mlm").
    name: str = "lm"
    # prefix_lm: tokens of the window that are input only.
    prefix_len: int = 0
    # mlm: share of positions corrupted and predicted.
    mlm_prob: float = 0.15

    def validate(self, path: str = "objective") -> None:
        _require(self.prefix_len >= 0, f"{path}.prefix_len", f"must be >= 0, got {self.prefix_len}")
        _require(0 < self.mlm_prob < 1, f"{path}.mlm_prob", f"must be in (0, 1), got {self.mlm_prob}")
        require_choice("objective.name", self.name, f"{path}.name")


@dataclass
class PerformanceConfig:
    """How a step is computed: the same losses and gradients, other memory and speed."""

    # Recompute activations in backward instead of keeping them: "full" (every block), "selective" (the MoE blocks),
    # "none". Losses and gradients are those of "none" (moe_lm/train/recompute.py).
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    # torch.compile every block (its MoE FFN runs eagerly); the first step pays the compilation (its time is
    # logged). "auto": on a CUDA GPU, where it won (gpu_1b on one H200: 15.9 % MFU against 12.2 % eager, docs/gpu.md),
    # not on the CPU (minutes of compilation for 2-4 %, docs/benchmarks.md); true or false: always or never.
    compile: Literal["auto"] | bool = "auto"
    # Training loss of the output head(s) computed this many tokens at a time, without the [tokens, vocab] logits
    # (moe_lm/ops/linear_cross_entropy.py: same loss and gradients); 0 = the plain loss over full logits. 1024:
    # the whole training step measured 0.88x the plain loss's time at the tiny preset and 0.95x at a 32k vocabulary
    # on CPU (docs/benchmarks.md), within 2 % of the best chunk at both.
    loss_chunk: int = 1024

    def validate(self, path: str = "performance") -> None:
        _require(self.loss_chunk >= 0, f"{path}.loss_chunk", f"must be >= 0 (0: full logits), got {self.loss_chunk}")


@dataclass
class ParallelConfig:
    """How DeepSpeed runs the model."""

    # ZeRO stage: 1 or 2 (DeepSpeed refuses MoE with ZeRO-3; ZeRO-0 clips expert gradients wrongly).
    zero_stage: int = 2
    # "auto": bf16 on CUDA, fp32 on CPU (bf16 is not faster on CPU).
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    # Expert parallelism: routed experts are sharded over groups of ep_size ranks (must divide the world size and
    # the number of routed experts); everything else stays data-parallel over the whole world (over a stage's ranks
    # with pipeline stages).
    ep_size: int = 1
    # Pipeline parallelism: the layers are cut into pp_size stages (DeepSpeed's pipeline engine, 1F1B schedule); the
    # world is pp_size x data-parallel, and expert parallelism groups ep_size ranks inside each stage. ZeRO-1 only.
    pp_size: int = 1
    # The pipeline's schedule: "1f1b" (each stage one slice of the layers), or "dualpipev" (DeepSeek-V3's DualPipeV as
    # DeepSpeed implements it: each rank holds two slices, the first and the mirrored last, and micro-batches go out
    # and come back; needs train.grad_accum_steps >= 2 x pp_size).
    pp_schedule: Literal["1f1b", "dualpipev"] = "1f1b"

    def validate(self, path: str = "parallel") -> None:
        _require(self.ep_size >= 1, f"{path}.ep_size", "must be >= 1")
        _require(self.pp_size >= 1, f"{path}.pp_size", "must be >= 1")
        _require(
            self.pp_size == 1 or self.zero_stage == 1,
            f"{path}.zero_stage",
            f"= {self.zero_stage} with {path}.pp_size={self.pp_size}: DeepSpeed's pipeline engine runs ZeRO-1 at most "
            f"(it refuses ZeRO-2 and ZeRO-3); set {path}.zero_stage=1",
        )
        _require(
            self.zero_stage in (1, 2),
            f"{path}.zero_stage",
            "must be 1 or 2: DeepSpeed refuses MoE under ZeRO-3, and under ZeRO-0 its gradient-norm clipping "
            "averages per-rank norms instead of computing the global norm (see README, 'ZeRO and MoE')",
        )


@dataclass
class LoggingConfig:
    """Console, metrics.jsonl, wandb and TensorBoard."""

    # wandb mode: offline by default (no network assumed; `wandb sync` later), or online, or disabled.
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    # The wandb project runs are logged to.
    wandb_project: str = "moe-lm"
    # The wandb run's display name; "" = the run folder's name.
    run_name: str = ""
    # The libraries' INFO lines and banners on the console (DeepSpeed's, wandb's); off: only their warnings and
    # errors show (also --verbose, or MOE_LM_VERBOSE=1).
    verbose: bool = False
    # TensorBoard event files in <run>/tb/ with the scalars and expert-load histograms wandb gets.
    tensorboard: bool = False
    # Peak FLOP/s per device for MFU; 0 = look it up for known GPUs, or measure an fp32 matmul on CPU.
    peak_tflops: float = 0.0


# ------------------------------------------------------------------------------------------------ root


@dataclass
class Config:
    """The whole run. Sections are handed to the components that own them."""

    # Seeds the initialisation, the data order and the tokenizer's training: 0 to 2**32 - 1 (what numpy and
    # sentencepiece accept).
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    cadence: CadenceConfig = field(default_factory=CadenceConfig)
    performance: PerformanceConfig = field(default_factory=PerformanceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def global_batch(self, world: int = 1) -> int:
        """Sequences one optimizer step consumes over `world` ranks: micro_batch_size x grad_accum_steps on each
        data-parallel rank (world / parallel.pp_size: every stage of a replica reads the same micro-batches)."""
        return self.train.micro_batch_size * self.train.grad_accum_steps * (world // self.parallel.pp_size)

    def validate(self) -> None:
        _require(
            0 <= self.seed < 2**32, "seed", f"= {self.seed} is out of range: give an integer from 0 to {2**32 - 1}"
        )
        self.model.validate("model")
        self.data.validate("data")
        self.optim.validate("optim")
        self.train.validate("train")
        self.objective.validate("objective")
        self.cadence.validate("cadence")
        self.performance.validate("performance")
        self.parallel.validate("parallel")
        require_ep_divides(self.parallel.ep_size, self.model.moe.n_routed_experts)
        if self.parallel.pp_size > 1:
            require_pipeline_fits(self)
        _require(self.parallel.pp_size > 1 or self.parallel.pp_schedule == "1f1b", "parallel.pp_schedule",
                 f"= {self.parallel.pp_schedule} needs pipeline stages: set parallel.pp_size > 1")  # fmt: skip
        _require(not self.train.layer_seeds or self.model.arch == "decoder", "train.layer_seeds",
                 f"initialises decoder-only models only; got model.arch={self.model.arch}")  # fmt: skip
        _require(
            self.train.seq_len <= self.model.max_seq_len,
            "train.seq_len",
            f"= {self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}",
        )
        _require(
            self.train.seq_len > self.model.mtp.depth,
            "model.mtp.depth",
            f"= {self.model.mtp.depth} leaves no position to predict in windows of train.seq_len={self.train.seq_len}",
        )
        for key, value in (
            ("model.arch", self.model.arch),
            ("model.attn_mask", self.model.attn_mask),
            ("objective.name", self.objective.name),
        ):
            rule = CHOICES[key][value]
            if rule is not None:
                rule(self)


def require_ep_divides(ep_size: int, n_routed_experts: int, world: int | None = None, pp_size: int = 1) -> None:
    """The layout rules, in one place: ep_size divides the routed experts (each rank holds the same number) and,
    once the world size is known, pp_size divides it and ep_size divides each stage's ranks (every rank belongs to
    one expert-parallel group, inside its stage)."""
    if world is None:
        _require(n_routed_experts % ep_size == 0, "parallel.ep_size",
                 f"= {ep_size} must divide model.moe.n_routed_experts={n_routed_experts}")  # fmt: skip
        return
    _require(world % pp_size == 0, "parallel.pp_size", f"= {pp_size} must divide the world size ({world})")
    stage = world // pp_size
    where = f"each pipeline stage's ranks ({stage})" if pp_size > 1 else f"the world size ({world})"
    _require(n_routed_experts % ep_size == 0 and stage % ep_size == 0, "parallel.ep_size",
             f"= {ep_size} must divide both {where} and model.moe.n_routed_experts ({n_routed_experts})")  # fmt: skip


def require_pipeline_fits(cfg: Config) -> None:
    """What pipeline stages need of the rest of the config (checked when parallel.pp_size > 1)."""
    pp = cfg.parallel.pp_size
    if cfg.parallel.pp_schedule == "dualpipev":
        _require(cfg.train.grad_accum_steps >= 2 * pp, "train.grad_accum_steps",
                 f"= {cfg.train.grad_accum_steps} is below 2 x parallel.pp_size = {2 * pp}, the micro-batches "
                 "DualPipeV needs per step (parallel.pp_schedule=dualpipev)")  # fmt: skip
        _require(2 * pp <= cfg.model.n_layers + 2, "parallel.pp_size",
                 f"= {pp} with DualPipeV cuts the pipeline's {cfg.model.n_layers + 2} layers into {2 * pp} "
                 "slices: lower it")  # fmt: skip
    # the pipeline's layers: the embedding, the blocks, the final norm and head (with the MTP modules)
    _require(pp <= cfg.model.n_layers + 2, "parallel.pp_size",
             f"= {pp} exceeds the pipeline's {cfg.model.n_layers + 2} layers (embedding, "
             f"{cfg.model.n_layers} blocks, head): lower it")  # fmt: skip
    _require(cfg.objective.name == "lm", "parallel.pp_size",
             f"= {pp} trains objective.name=lm only (the stages pass hidden states, not a prefix length); "
             "got objective.name=" + cfg.objective.name)  # fmt: skip
    _require(cfg.model.arch == "decoder", "parallel.pp_size",
             f"= {pp} cuts decoder-only models only; got model.arch={cfg.model.arch}")  # fmt: skip


def config_warnings(cfg: Config) -> list[str]:
    """What a valid config probably does not mean to do (the run says so at start; --print-config shows it)."""
    warnings = []
    if cfg.optim.warmup_steps >= cfg.train.max_steps:
        peak = cfg.optim.lr * cfg.train.max_steps / max(cfg.optim.warmup_steps, 1)
        warnings.append(
            f"warning: optim.warmup_steps={cfg.optim.warmup_steps} >= train.max_steps={cfg.train.max_steps}: the run "
            f"ends while warming up, at a learning rate of {peak:.3g} (optim.lr={cfg.optim.lr:g}), and never decays; "
            "lower optim.warmup_steps"
        )
    return warnings


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key} {message}")
