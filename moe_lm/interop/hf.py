"""Hugging Face `transformers` interop: MLA models <-> DeepseekV3ForCausalLM, GQA models <-> Glm4MoeForCausalLM.

Our module names are HF's, so the state dicts match key for key up to the `model.` prefix. We build the HF
model in memory and let `save_pretrained` / `from_pretrained` own the on-disk format (safetensors +
config.json, including HF's per-expert checkpoint layout), so exports load anywhere HF loads.

Layout facts handled here:
- Our MLA rotates halves (x_i with x_{i+R/2}); DeepSeek publishes its weights for interleaved pairs (x_{2i} with
  x_{2i+1}). vLLM hard-codes the published layout for DeepSeek-V2/V3 (`is_neox_style=False`) whatever
  `rope_interleave` says, and SGLang reads it with a default of true, so exports permute the rotary rows of the
  query and shared-key projections into the interleaved order and say `rope_interleave: true`; imports permute
  them back (served by vLLM: `make serve-check`, docs/serving.md). Exact both ways: attention
  scores are dot products, and the permutation is applied to queries and keys alike. (GQA exports are
  Glm4Moe, whose published layout and the engines' rotary are rotate-half, like ours.)
- The config names the gate's rule as DeepSeek-V3's config.json does (`scoring_func: sigmoid`,
  `topk_method: noaux_tc`): serving engines build `e_score_correction_bias` and route with sigmoid only then.
- HF never updates `e_score_correction_bias`; it is carried as a buffer both ways.

MTP modules (model.mtp) are written and read in DeepSeek's published layout, as layers past the last decoder
layer (moe_lm/interop/hf_mtp.py); `transformers` itself loads such a checkpoint as the main model alone.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from moe_lm.config import GQAConfig, MLAConfig, ModelConfig, MoEConfig, MTPConfig, RopeScalingConfig
from moe_lm.console import transformers_quiet
from moe_lm.errors import REMOTE_CODE_OFF, ConfigError, DataError, MissingKey, install_hint, remote_code_refused
from moe_lm.interop.hf_mtp import add_to_export, mtp_state_from_hf, mtp_tensors_for_hf, read_mtp_layers
from moe_lm.model import Transformer


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(f"Hugging Face interop needs transformers: {install_hint('hf')}") from e
    return transformers


def hf_config(path: str | Path):
    """A checkpoint folder's `transformers` config, read without running the folder's own code (one-line error)."""
    try:
        return _transformers().AutoConfig.from_pretrained(path, trust_remote_code=False)
    except ValueError as e:
        if remote_code_refused(e):
            raise DataError(
                f"{path}: its config.json {REMOTE_CODE_OFF}; the model types it can be imported from are built into "
                "transformers: deepseek_v3, glm4_moe"
            ) from None
        raise


def to_hf_config(cfg: ModelConfig):
    """The `transformers` config (DeepseekV3Config or Glm4MoeConfig) of an equivalent model."""
    tf = _transformers()
    m = cfg.moe
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.inter_dim,
        moe_intermediate_size=m.moe_inter_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        n_shared_experts=m.n_shared_experts,
        n_routed_experts=m.n_routed_experts,
        num_experts_per_tok=m.num_experts_per_tok,
        n_group=m.n_group,
        topk_group=m.topk_group,
        routed_scaling_factor=m.routed_scaling_factor,
        norm_topk_prob=m.norm_topk_prob,
        first_k_dense_replace=cfg.first_k_dense_replace,
        num_nextn_predict_layers=cfg.mtp.depth,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        initializer_range=cfg.init_std,
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if cfg.attention == "mla":
        a = cfg.mla
        return tf.DeepseekV3Config(
            **common,
            num_key_value_heads=cfg.n_heads,
            q_lora_rank=a.q_lora_rank or None,
            kv_lora_rank=a.kv_lora_rank,
            qk_nope_head_dim=a.qk_nope_head_dim,
            qk_rope_head_dim=a.qk_rope_head_dim,
            v_head_dim=a.v_head_dim,
            rope_interleave=True,  # the weights are written in the published layout (`_interleave_rope`)
            rope_parameters=_rope_parameters(cfg),
            # why: vLLM and SGLang read these, not transformers; without them they route with softmax and
            # have no e_score_correction_bias to load (DeepSeek-V3's own config.json carries the same keys)
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            moe_layer_freq=1,
        )
    g = cfg.gqa
    return tf.Glm4MoeConfig(
        **common,
        num_key_value_heads=g.n_kv_heads,
        head_dim=g.head_dim,
        use_qk_norm=False,
        partial_rotary_factor=g.partial_rotary_factor,
        rope_parameters={**_rope_parameters(cfg), "partial_rotary_factor": g.partial_rotary_factor},
    )


YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _rope_parameters(cfg: ModelConfig) -> dict:
    r = cfg.rope_scaling
    if r.rope_type == "default":
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {"rope_type": "yarn", "rope_theta": cfg.rope_theta, **{k: getattr(r, k) for k in YARN_KEYS}}


def _rope_scaling(hf, rope: dict, problems: list[str]) -> RopeScalingConfig:
    """Our RopeScalingConfig from HF's rope_parameters; what we cannot reproduce goes into `problems`."""
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return RopeScalingConfig()
    if kind != "yarn":
        problems.append(f"rope scaling {kind!r} (implemented: plain RoPE and yarn)")
        return RopeScalingConfig()
    if rope.get("attention_factor") is not None:
        problems.append("yarn with an explicit attention_factor")
    if rope.get("truncate", True) is False:
        problems.append("yarn with truncate=False")
    original = int(rope["original_max_position_embeddings"])
    # as HF: DeepSeek-style configs may leave factor out and mean the ratio of the two context lengths
    factor = rope.get("factor") or hf.max_position_embeddings / original
    return RopeScalingConfig(
        rope_type="yarn",
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        mscale=float(rope.get("mscale") or 0.0),
        mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
    )


def from_hf_config(hf, mtp_depth: int = 0) -> ModelConfig:
    """Our ModelConfig for a `transformers` DeepseekV3 / Glm4Moe config; unsupported features are errors.

    `mtp_depth`: the MTP modules the checkpoint's weights hold (its config's num_nextn_predict_layers is an upper
    bound only: transformers' DeepseekV3Config says 1 by default, with or without the weights)."""
    kind = hf.model_type
    if kind not in ("deepseek_v3", "glm4_moe"):
        raise DataError(f"cannot import model_type {kind!r}: supported are deepseek_v3 and glm4_moe")
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    problems = []
    rope_scaling = _rope_scaling(hf, rope, problems)
    if getattr(hf, "attention_bias", False):
        problems.append("attention_bias=True")
    if getattr(hf, "tie_word_embeddings", False):
        problems.append("tie_word_embeddings=True")
    if getattr(hf, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf.hidden_act!r}")
    if getattr(hf, "use_qk_norm", False):
        problems.append("use_qk_norm=True")
    if problems:
        raise DataError(f"this {kind} checkpoint uses features moe-lm does not implement: {'; '.join(problems)}")
    moe = MoEConfig(
        n_routed_experts=hf.n_routed_experts,
        n_shared_experts=hf.n_shared_experts,
        num_experts_per_tok=hf.num_experts_per_tok,
        n_group=hf.n_group or 1,
        topk_group=hf.topk_group or 1,
        routed_scaling_factor=float(hf.routed_scaling_factor),
        norm_topk_prob=bool(hf.norm_topk_prob),
        moe_inter_dim=hf.moe_intermediate_size,
    )
    common = dict(
        vocab_size=hf.vocab_size,
        dim=hf.hidden_size,
        n_layers=hf.num_hidden_layers,
        n_heads=hf.num_attention_heads,
        inter_dim=hf.intermediate_size,
        first_k_dense_replace=hf.first_k_dense_replace,
        max_seq_len=hf.max_position_embeddings,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling,
        norm_eps=float(hf.rms_norm_eps),
        init_std=float(hf.initializer_range),
        moe=moe,
        mtp=MTPConfig(depth=mtp_depth),
    )
    if kind == "deepseek_v3":
        mla = MLAConfig(
            q_lora_rank=hf.q_lora_rank or 0,
            kv_lora_rank=hf.kv_lora_rank,
            qk_nope_head_dim=hf.qk_nope_head_dim,
            qk_rope_head_dim=hf.qk_rope_head_dim,
            v_head_dim=hf.v_head_dim,
        )
        return _checked(ModelConfig(attention="mla", mla=mla, **common))
    factor = float(rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)))
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    gqa = GQAConfig(n_kv_heads=hf.num_key_value_heads, head_dim=head_dim, partial_rotary_factor=factor)
    return _checked(ModelConfig(attention="gqa", gqa=gqa, **common))


def _checked(cfg: ModelConfig) -> ModelConfig:
    """A model config read from a checkpoint, held to the same rules as a loaded one (a boundary of the config)."""
    cfg.validate()
    return cfg


def export_bytes(cfg: ModelConfig) -> int:
    """About the disk space an export of `cfg` takes: every parameter in fp32 (the MTP modules' included) and a
    mebibyte for the config and tokenizer files."""
    from moe_lm.model.architectures import count_params

    count = count_params(cfg)
    return 4 * (count.total + count.mtp_total) + 2**20


def export_hf(
    model: Transformer,
    out_dir: str | Path,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    max_shard_size: str | None = None,
) -> Path:
    """Write `model` as a `transformers` checkpoint (safetensors + config.json) loadable by from_pretrained.

    `bos_token_id`: the token every training document began with; `eos_token_id`: the tokenizer's end of text.
    Both go into config.json and generation_config.json, where `generate()` and serving engines read them.
    `max_shard_size` (e.g. "5GB"): safetensors shards with an index, as `save_pretrained` writes them."""
    own = _hf_layout(model)
    hf_model = _hf_model(model.cfg, own, bos_token_id, eos_token_id)
    out_dir = Path(out_dir)
    shards = {"max_shard_size": max_shard_size} if max_shard_size else {}
    with transformers_quiet():
        hf_model.save_pretrained(out_dir, safe_serialization=True, **shards)
    add_to_export(out_dir, mtp_tensors_for_hf(own, model.cfg.n_layers, model.cfg.mtp.depth))
    return out_dir


def to_hf_model(model: Transformer, experts_implementation: str | None = None):
    """`model` as a `transformers` DeepseekV3ForCausalLM (MLA) or Glm4MoeForCausalLM (GQA) in memory, fp32 on the
    CPU, SDPA attention, without its MTP modules (HF runs none): what `export_hf` writes and from_pretrained would
    read back, without the disk. `experts_implementation`: HF's expert loop (eager, grouped_mm, ...)."""
    return _hf_model(model.cfg, _hf_layout(model), experts_implementation=experts_implementation, on="cpu")


def _hf_layout(model: Transformer) -> dict[str, torch.Tensor]:
    """Our state dict in fp32 on the CPU with the rotary rows in DeepSeek's published interleaved order (MTP
    blocks included)."""
    cfg = model.cfg
    if cfg.arch != "decoder":
        raise ConfigError(
            f"model.arch={cfg.arch}: HF DeepseekV3/Glm4Moe are decoder-only; an encoder-decoder cannot be exported"
        )
    if cfg.attn_mask != "causal":
        raise ConfigError(
            f"model.attn_mask={cfg.attn_mask}: HF DeepseekV3/Glm4Moe are causal only; this model cannot be exported"
        )
    own = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    if cfg.attention == "mla":
        _interleave_rope(own, cfg)
    return own


def _hf_model(cfg: ModelConfig, own: dict[str, torch.Tensor], bos_token_id=None, eos_token_id=None,
              experts_implementation: str | None = None, on: str = "meta"):  # fmt: skip
    """The HF model of `cfg` holding `own` (`_hf_layout`'s tensors; the MTP blocks left out). Built on the meta
    device to be saved (no memory, no random init); `on="cpu"` to be run: its buffers that no checkpoint holds
    (the rotary frequencies) are computed as HF computes them, and no weight is initialised only to be replaced."""
    tf = _transformers()
    hf_cfg = to_hf_config(cfg)
    hf_cfg.bos_token_id, hf_cfg.eos_token_id = bos_token_id, eos_token_id
    if experts_implementation:
        hf_cfg._attn_implementation, hf_cfg._experts_implementation = "sdpa", experts_implementation
    hf_cls = tf.DeepseekV3ForCausalLM if cfg.attention == "mla" else tf.Glm4MoeForCausalLM
    with torch.device(on), _no_init_weights():
        hf_model = hf_cls(hf_cfg)
    state = {_to_hf_key(k): v for k, v in own.items() if not k.startswith("mtp.")}
    hf_model.load_state_dict(_fill_empty(state, hf_model), strict=True, assign=True)
    hf_model.generation_config = tf.GenerationConfig(bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    return hf_model


def _no_init_weights():
    """transformers' own switch that skips the random init of weights a checkpoint then replaces (5.x)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # an older transformers: initialised, then replaced (slower, the same result)
        return contextlib.nullcontext()
    return no_init_weights()


def import_hf(path: str | Path, hf_model=None) -> Transformer:
    """Load a `transformers` DeepseekV3 / Glm4Moe checkpoint into our Transformer (fp32), with the MTP modules its
    weights hold (DeepSeek's layout: layers past num_hidden_layers); `hf_model`: the folder's model as another reader
    built it (default: transformers' `from_pretrained`)."""
    tf = _transformers()
    path = Path(path)
    hf_cfg = hf_config(path)
    mtp_layers = read_mtp_layers(path, hf_cfg.num_hidden_layers, getattr(hf_cfg, "num_nextn_predict_layers", 0) or 0)
    cfg = from_hf_config(hf_cfg, mtp_depth=len(mtp_layers))
    if hf_model is None:
        hf_model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=False)
    hf_state = hf_model.state_dict()
    model = Transformer(cfg)
    ours = model.state_dict()
    state = {}
    for j, layer in mtp_layers.items():
        main = {
            "embed_tokens.weight": hf_state["model.embed_tokens.weight"],
            "lm_head.weight": hf_state["lm_head.weight"],
        }
        state.update(mtp_state_from_hf(layer, j, main, f"{path} layer {cfg.n_layers + j}"))
    for key in ours:
        if key.startswith("mtp."):
            if key not in state and ours[key].numel():
                raise MissingKey(f"{path}: MTP layer {cfg.n_layers + int(key.split('.')[1])} has no tensor for {key!r}")
            continue
        hf_key = _to_hf_key(key)
        if hf_key not in hf_state:
            if ours[key].numel() == 0:
                continue
            raise MissingKey(f"{path}: checkpoint has no tensor {hf_key!r} (needed for our {key!r})")
        state[key] = hf_state[hf_key].float()
    if cfg.attention == "mla" and getattr(hf_cfg, "rope_interleave", False):
        deinterleave_rope(state, cfg)
    model.load_state_dict(state, strict=True)
    return model


def _to_hf_key(key: str) -> str:
    return key if key.startswith("lm_head.") else f"model.{key}"


def _fill_empty(state: dict[str, torch.Tensor], hf_model) -> dict[str, torch.Tensor]:
    """Zero-size HF tensors we do not hold (e.g. the shared MLP when n_shared_experts = 0)."""
    for key, p in hf_model.state_dict().items():
        if key not in state and p.numel() == 0:
            state[key] = torch.empty(p.shape)
    return state


def deinterleave_rope(state: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Reorder rotary rows from interleaved pairs (x0, x1), (x2, x3)... to rotate-half (x0, x2, ..., x1, x3, ...),
    in every decoder layer and MTP block."""
    _permute_rope_rows(state, cfg, _half_from_interleaved(cfg.mla.qk_rope_head_dim))


def _interleave_rope(state: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """The inverse of `deinterleave_rope`: our rotate-half rows into DeepSeek's published interleaved order."""
    _permute_rope_rows(state, cfg, torch.argsort(_half_from_interleaved(cfg.mla.qk_rope_head_dim)))


def _half_from_interleaved(R: int) -> torch.Tensor:
    """Row i of the rotate-half layout is row perm[i] of the interleaved one: even dims first, then odd."""
    return torch.cat((torch.arange(0, R, 2), torch.arange(1, R, 2)))


def _permute_rope_rows(state: dict[str, torch.Tensor], cfg: ModelConfig, perm: torch.Tensor) -> None:
    """Reorder the rotary rows of every query and shared rotary key projection (our keys) by `perm`, in place."""
    m = cfg.mla
    R, nope, H = m.qk_rope_head_dim, m.qk_nope_head_dim, cfg.n_heads
    blocks = [f"layers.{i}." for i in range(cfg.n_layers)] + [f"mtp.{j}." for j in range(cfg.mtp.depth)]
    for block in blocks:
        prefix = f"{block}self_attn."
        q_key = prefix + ("q_b_proj.weight" if m.q_lora_rank else "q_proj.weight")
        q = state[q_key].view(H, nope + R, -1)
        state[q_key] = torch.cat((q[:, :nope], q[:, nope:][:, perm]), dim=1).reshape(H * (nope + R), -1)
        kv_key = prefix + "kv_a_proj_with_mqa.weight"
        kv = state[kv_key]
        state[kv_key] = torch.cat((kv[: m.kv_lora_rank], kv[m.kv_lora_rank :][perm]))


def export_run(
    run_dir: str | Path, tag: str | None, out: Path, tokenizer_required: bool = True, max_shard_size: str | None = None
) -> tuple[str, str]:
    """A run's checkpoint (the latest complete one when `tag` is None) exported into `out` with its tokenizer, its
    start token and context length: (the tag, what was written of the tokenizer). Without the run's tokenizer the
    model alone is written, unless `tokenizer_required`."""
    from moe_lm.checkpoint.format import load_model
    from moe_lm.data.tokenizer import load_data_tokenizer
    from moe_lm.errors import DataError
    from moe_lm.interop.hf_tokenizer import export_tokenizer

    cfg, model, tag = load_model(run_dir, tag)
    try:
        tok = load_data_tokenizer(cfg.data.out_dir)
    except DataError as e:
        if tokenizer_required:
            raise
        export_hf(model.eval(), out, max_shard_size=max_shard_size)
        return tag, f"no tokenizer ({e})"
    export_hf(model.eval(), out, tok.doc_start_id, tok.eos_id, max_shard_size)
    return tag, export_tokenizer(cfg.data.out_dir, out, max_len=cfg.model.max_seq_len)
