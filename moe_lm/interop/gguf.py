"""A GGUF file that llama.cpp (and so Ollama and LM Studio) runs with the model's own logits, written with gguf-py,
the `gguf` package llama.cpp maintains, from an HF export folder (`moe-lm export`).

llama.cpp's own converter cannot take our exports: for DeepSeek-V2/V3 and GLM-4-MoE it accepts only tokenizers whose
ids on a check text hash to a published model's, writes no query-LoRA rank when there is none, and writes group keys
that its loader refuses when they limit nothing. So the file is written here, as that converter would write a
published model, with three differences: the tokenizer is llama.cpp's sentencepiece vocabulary (`llama`) from
tokenizer.model; `attention.q_lora_rank` is written as 0 when the model has no query LoRA; the group keys only when
they limit the choice (`topk_group < n_group`).

    MLA  -> `deepseek2`: head_count_kv 1 (MLA runs as MQA over the latent), kv_b_proj split into attn_k_b
            (transposed per head) and attn_v_b; q/k rope rows already interleaved in the export (llama.cpp's
            deepseek2 rotates interleaved pairs, as DeepSeek publishes).
    GQA  -> `glm4moe`: NEOX rotation of the first head_dim * partial_rotary_factor dims, as ours.

Both: the sigmoid gate (written: deepseek2's loader would default to softmax), the selection-only bias
(exp_probs_b), top-k normalisation and scale, shared experts, leading dense layers, YaRN. Left out: the MTP
modules (llama.cpp does not run them). What llama.cpp cannot run as trained is refused in one line, never written
approximately (`gguf_problems`). Key names, tensor names and transforms: docs/serving.md.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from moe_lm.data.tokenizer import SPM_FILE
from moe_lm.errors import UserError, require
from moe_lm.interop.safetensors_folder import SafetensorsFolder
from moe_lm.model.attention import yarn_mscale

OUT_TYPES = ("f32", "f16", "bf16", "q8_0")
ARCH = {"deepseek_v3": "deepseek2", "glm4_moe": "glm4moe"}
EXPORT_AGAIN = "give a folder written by `moe-lm export`, or export the run again"
LLAMA_YARN_BETA = (32.0, 1.0)  # llama.cpp's yarn beta_fast/beta_slow: fixed for these architectures


def export_gguf(hf_dir: str | Path, out_file: str | Path, out_type: str = "f32") -> str:
    """Write `hf_dir` (an HF export of ours) as GGUF to `out_file`; returns what was written (and left out)."""
    gguf = require("gguf", "gguf", "moe-lm export --gguf")
    hf_dir = Path(hf_dir)
    config = read_config(hf_dir)
    # why first: a config.json that lies about the tensors would write part of the model, or run for minutes
    if mismatch := config_mismatch(config, tensor_shapes(hf_dir)):
        raise UserError(
            f"{hf_dir / 'config.json'} does not describe the tensors beside it ({'; '.join(mismatch[:3])}"
            f"{'; ...' if len(mismatch) > 3 else ''}); export the run again, or restore config.json"
        )
    if problems := gguf_problems(config, hf_dir):
        raise UserError(f"{hf_dir} cannot be written as GGUF faithfully: {'; '.join(problems)}")
    arch = ARCH[config["model_type"]]
    writer = gguf.GGUFWriter(str(out_file), arch=arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(hf_dir.name)
    writer.add_file_type(FILE_TYPES[out_type](gguf))
    if out_type == "q8_0":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    write_hparams(writer, gguf, config, arch)
    n_pieces = write_vocab(writer, gguf, hf_dir / SPM_FILE, config)
    state = read_state(hf_dir)
    tensors = gguf_tensors(state, config, arch)
    fallback = 0
    for name, array in tensors:
        fallback += add_tensor(writer, gguf, name, array, out_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    said = f"{arch} GGUF ({out_type}, {len(tensors)} tensors, {n_pieces} sentencepiece pieces)"
    if fallback:
        said += f"; {fallback} tensors in f16 (rows not a multiple of Q8_0's 32-value blocks)"
    if config.get("num_nextn_predict_layers"):
        said += f"; the {config['num_nextn_predict_layers']} MTP module(s) left out (llama.cpp does not run them)"
    return said


def write_gguf(hf_dir: str | Path, out_file: str | Path, out_type: str) -> str:
    """`hf_dir` written as a GGUF file of `out_type`: the types gguf-py writes (OUT_TYPES) directly, a k-quant by
    llama.cpp's own quantiser from an f32 file written beside `out_file` first (and removed); what was written."""
    out_file = Path(out_file)
    if out_type in OUT_TYPES:
        return export_gguf(hf_dir, out_file, out_type)
    from moe_lm.interop.llama_cpp import quantize

    f32 = out_file.with_name(f".{out_file.name}.f32")
    try:
        said = export_gguf(hf_dir, f32, "f32").replace("(f32,", f"({out_type} by llama.cpp's quantiser,")
        return said + f"; tensors: {quantize(f32, out_file, out_type)}"
    finally:
        f32.unlink(missing_ok=True)


FILE_TYPES = {
    "f32": lambda g: g.LlamaFileType.ALL_F32,
    "f16": lambda g: g.LlamaFileType.MOSTLY_F16,
    "bf16": lambda g: g.LlamaFileType.MOSTLY_BF16,
    "q8_0": lambda g: g.LlamaFileType.MOSTLY_Q8_0,
}


def read_config(hf_dir: Path) -> dict:
    path = hf_dir / "config.json"
    if not path.is_file():
        raise UserError(f"{hf_dir} holds no config.json: give a folder written by `moe-lm export`")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); export the run again") from None
    if config.get("model_type") not in ARCH:
        raise UserError(
            f"{path}: model_type {config.get('model_type')!r}; GGUF is written for moe-lm's exports (deepseek_v3, "
            "glm4_moe)"
        )
    return config


# the config.json entries the GGUF is written from, with their types (None: may be null); MLA's and GQA's own below
CONFIG_FIELDS = {
    "num_hidden_layers": int, "max_position_embeddings": int, "hidden_size": int, "intermediate_size": int,
    "num_attention_heads": int, "vocab_size": int, "n_routed_experts": int, "num_experts_per_tok": int,
    "n_shared_experts": int, "moe_intermediate_size": int, "rms_norm_eps": float, "routed_scaling_factor": float,
    "norm_topk_prob": bool,
}  # fmt: skip
OPTIONAL_FIELDS = {"first_k_dense_replace": int, "n_group": int, "topk_group": int, "num_nextn_predict_layers": int}
MLA_FIELDS = {"kv_lora_rank": int, "qk_nope_head_dim": int, "qk_rope_head_dim": int, "v_head_dim": int}
GQA_FIELDS = {"head_dim": int, "num_key_value_heads": int}


def tensor_shapes(hf_dir: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the export's safetensors files, read from their headers (no tensor is loaded)."""
    return SafetensorsFolder(hf_dir, EXPORT_AGAIN).shapes()


def hf_parameter_count(hf_dir: Path) -> int:
    """The number of values in an export's tensors (for the space a GGUF of it needs)."""
    return sum(math.prod(shape) for shape in tensor_shapes(Path(hf_dir)).values())


def config_mismatch(c: dict, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """Where config.json disagrees with the tensors (empty when it describes them): a missing entry or one of the
    wrong type, a layer count other than the tensors', a tensor missing or of another shape than the config
    implies."""
    fields = CONFIG_FIELDS | (MLA_FIELDS if c.get("model_type") == "deepseek_v3" else GQA_FIELDS)
    wrong = [f"{k} is missing" for k in fields if c.get(k) is None]
    for key, kind in (fields | OPTIONAL_FIELDS).items():
        value = c.get(key)
        if value is None:
            continue
        ok = isinstance(value, bool) if kind is bool else isinstance(value, int) and not isinstance(value, bool)
        ok = ok or (kind is float and isinstance(value, int | float) and not isinstance(value, bool))
        if not ok or (kind is int and value < 0):
            wrong.append(f"{key} is {str(value)[:40]!r}, not a {'non-negative ' if kind is int else ''}{kind.__name__}")
    if wrong:
        return wrong
    layers = {int(k.split(".")[2]) for k in shapes if k.startswith("model.layers.") and k.split(".")[2].isdigit()}
    L, mtp = c["num_hidden_layers"], c.get("num_nextn_predict_layers") or 0
    if layers != set(range(L + mtp)):
        held = f"layers {min(layers)}..{max(layers)}" if layers else "no layers"
        return [f"num_hidden_layers={L} (+{mtp} MTP) but the tensors hold {held}"]
    routers = [shape for key, shape in shapes.items() if key.endswith("mlp.gate.weight")]
    if routers and routers[0][0] != c["n_routed_experts"]:  # why before the rest: the loops below are per expert
        return [f"n_routed_experts={c['n_routed_experts']} but the routers score {routers[0][0]} experts"]
    if c["num_experts_per_tok"] > c["n_routed_experts"]:
        return [f"num_experts_per_tok={c['num_experts_per_tok']} > n_routed_experts={c['n_routed_experts']}"]
    fused = any(k.endswith("mlp.experts.gate_up_proj") for k in shapes)
    for name, shape in expected_hf_shapes(c, fused).items():
        if name not in shapes:
            wrong.append(f"no tensor {name}")
        elif shapes[name] != shape:
            wrong.append(f"{name} is {list(shapes[name])}, config.json implies {list(shape)}")
    return wrong


def expected_hf_shapes(c: dict, fused: bool) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor the GGUF is written from, as config.json implies it; the routed experts one
    tensor per expert, or stacked (`fused`: transformers' [E, 2I, D] and [E, D, I])."""
    D, V, L, E = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"], c["n_routed_experts"]
    inter = c["moe_intermediate_size"]
    shared = c["n_shared_experts"] * inter
    out = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(L):
        s = f"model.layers.{i}."
        out |= {s + "input_layernorm.weight": (D,), s + "post_attention_layernorm.weight": (D,)}
        a = s + "self_attn."
        if c["model_type"] == "deepseek_v3":
            H, nope, rope, v, kv = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                                    c["v_head_dim"], c["kv_lora_rank"])  # fmt: skip
            q = c.get("q_lora_rank")
            out |= ({a + "q_a_proj.weight": (q, D), a + "q_b_proj.weight": (H * (nope + rope), q)} if q else
                    {a + "q_proj.weight": (H * (nope + rope), D)})  # fmt: skip
            out |= {a + "kv_a_proj_with_mqa.weight": (kv + rope, D), a + "kv_b_proj.weight": (H * (nope + v), kv),
                    a + "o_proj.weight": (D, H * v)}  # fmt: skip
        else:
            H, Hkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
            out |= {a + "q_proj.weight": (H * hd, D), a + "k_proj.weight": (Hkv * hd, D),
                    a + "v_proj.weight": (Hkv * hd, D), a + "o_proj.weight": (D, H * hd)}  # fmt: skip
        m = s + "mlp."
        if i < (c.get("first_k_dense_replace") or 0):
            dense = c["intermediate_size"]
            out |= {m + "gate_proj.weight": (dense, D), m + "up_proj.weight": (dense, D),
                    m + "down_proj.weight": (D, dense)}  # fmt: skip
        else:
            out |= {m + "gate.weight": (E, D), m + "gate.e_score_correction_bias": (E,),
                    m + "shared_experts.gate_proj.weight": (shared, D),
                    m + "shared_experts.down_proj.weight": (D, shared)}  # fmt: skip
            if fused:
                out |= {m + "experts.gate_up_proj": (E, 2 * inter, D), m + "experts.down_proj": (E, D, inter)}
            else:
                for e in range(E):
                    x = f"{m}experts.{e}."
                    out |= {x + "gate_proj.weight": (inter, D), x + "up_proj.weight": (inter, D),
                            x + "down_proj.weight": (D, inter)}  # fmt: skip
    return out


def gguf_problems(config: dict, hf_dir: Path) -> list[str]:
    """Why llama.cpp would not run this model and tokenizer as trained (empty when it would)."""
    problems = []
    if not config.get("n_shared_experts"):
        problems.append("llama.cpp's deepseek2/glm4moe graphs always add a shared expert; this model has none")
    if config.get("attention_bias") or config.get("use_qk_norm"):
        problems.append("attention bias or q/k norms (moe-lm does not train them)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        return [*problems, f"config.json's rope_parameters is {str(rope)[:40]!r}, not a mapping"]
    if rope.get("rope_type", "default") not in ("default", "yarn"):
        problems.append(f"rope scaling {rope.get('rope_type')!r}")
    if rope.get("rope_type") == "yarn" and not all(
        isinstance(rope.get(k), int | float) for k in ("factor", "original_max_position_embeddings")
    ):
        problems.append("config.json's YaRN has no numeric factor and original_max_position_embeddings")
    elif rope.get("rope_type") == "yarn":
        if (rope.get("beta_fast", 32.0), rope.get("beta_slow", 1.0)) != LLAMA_YARN_BETA:
            problems.append(f"YaRN beta_fast/beta_slow other than llama.cpp's fixed {LLAMA_YARN_BETA}")
        if config["model_type"] == "deepseek_v3" and rope.get("mscale", 1.0) != rope.get("mscale_all_dim", 0.0):
            problems.append("YaRN mscale != mscale_all_dim (llama.cpp's deepseek2 reads one, as DeepSeek-V3 has)")
    if config["model_type"] == "deepseek_v3" and config.get("q_lora_rank") and config["num_hidden_layers"] in (26, 27):
        problems.append("a query LoRA at 26 or 27 layers (llama.cpp takes these as DeepSeek-V2-Lite, which has none)")
    problems += vocab_problems(hf_dir / SPM_FILE, hf_dir)
    return problems


def vocab_problems(model_file: Path, hf_dir: Path) -> list[str]:
    """What keeps llama.cpp's sentencepiece tokenizer from giving this tokenizer's ids."""
    if not model_file.is_file() and (hf_dir / "tokenizer.json").is_file():
        return [
            f"its tokenizer is a Hugging Face tokenizer.json, not a sentencepiece {SPM_FILE} (llama.cpp reads "
            "byte-level BPE only through its table of known pre-tokenizers, so its ids would differ)"
        ]
    if not model_file.is_file():
        return ["it holds no tokenizer (an export of --config has none: export a run)"]
    proto = spm_proto(model_file)
    n, t = proto.normalizer_spec, proto.trainer_spec
    problems = []
    if t.model_type != t.BPE:
        problems.append("a unigram sentencepiece model (llama.cpp's sentencepiece tokenizer merges pieces by score "
                        "as BPE does; a unigram segmentation can differ)")  # fmt: skip
    if n.name not in ("identity", "") or n.precompiled_charsmap:
        problems.append(f"sentencepiece normalization {n.name!r} (llama.cpp applies none)")
    if n.remove_extra_whitespaces:
        problems.append("remove_extra_whitespaces (llama.cpp keeps every space)")
    kept = [p.piece for p in proto.pieces if p.type == p.USER_DEFINED and not written_as_normal(p.piece, proto)]
    if kept and n.add_dummy_prefix:
        problems.append(f"user-defined symbols {kept[:3]} (llama.cpp puts a space before the text after each)")
    return problems


def written_as_normal(piece: str, proto) -> bool:
    """Whether a user-defined piece is written as a normal one: one character that no other piece holds. llama.cpp
    cuts user-defined tokens out of the text first and then adds a space before the text that follows each (as a
    document's start), which sentencepiece does not; as a normal piece it comes out the same, never merged with a
    neighbour (no longer piece holds it), without that space."""
    return len(piece) == 1 and not any(piece in p.piece and p.piece != piece for p in proto.pieces)


def spm_proto(model_file: Path):
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    return proto


def write_hparams(w, gguf, c: dict, arch: str) -> None:
    w.add_block_count(c["num_hidden_layers"])  # the MTP layers are not written, and not counted
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_vocab_size(c["vocab_size"])
    w.add_leading_dense_block_count(c.get("first_k_dense_replace", 0))
    w.add_expert_count(c["n_routed_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_weights_scale(float(c["routed_scaling_factor"]))
    w.add_expert_weights_norm(bool(c["norm_topk_prob"]))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if c.get("n_group", 1) > 1 and c.get("topk_group", 1) < c["n_group"]:  # else: limits nothing, and llama.cpp
        w.add_expert_group_count(c["n_group"])  # asserts topk_group < n_group
        w.add_expert_group_used_count(c["topk_group"])
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", c.get("rope_theta", 10000.0))))
    if arch == "deepseek2":
        w.add_head_count_kv(1)  # MLA runs as MQA over the latent
        w.add_q_lora_rank(c.get("q_lora_rank") or 0)  # 0: a plain query projection (the loader requires the key)
        w.add_kv_lora_rank(c["kv_lora_rank"])
        w.add_key_length(c["kv_lora_rank"] + c["qk_rope_head_dim"])
        w.add_value_length(c["kv_lora_rank"])
        w.add_key_length_mla(c["qk_nope_head_dim"] + c["qk_rope_head_dim"])
        w.add_value_length_mla(c["v_head_dim"])
        w.add_rope_dimension_count(c["qk_rope_head_dim"])
    else:
        head_dim = c["head_dim"]
        w.add_head_count_kv(c["num_key_value_heads"])
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(int(head_dim * c.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1))))
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        if arch == "deepseek2":  # llama.cpp's deepseek2 applies DeepSeek's softmax scale from this multiplier
            w.add_rope_scaling_yarn_log_mul(0.1 * float(rope.get("mscale_all_dim") or 0.0))
        else:  # cos/sin: llama.cpp scales them by YaRN's default 1 + 0.1 ln(factor), times this attn_factor
            f, m, m_all = float(rope["factor"]), rope.get("mscale") or 0.0, rope.get("mscale_all_dim") or 0.0
            ours = yarn_mscale(f, m) / yarn_mscale(f, m_all) if m and m_all else yarn_mscale(f)  # as our rotary
            w.add_rope_scaling_attn_factors(ours / yarn_mscale(f))


def write_vocab(w, gguf, model_file: Path, c: dict) -> int:
    """llama.cpp's sentencepiece vocabulary: pieces, scores and types as in tokenizer.model (sentencepiece's piece
    types are GGUF's token types, number for number; user-defined ones: `written_as_normal`), padded with unused
    pieces to the embedding's rows; the start token every training document began with (config.json's
    bos_token_id) is added first, as training did."""
    proto = spm_proto(model_file)
    pieces = list(proto.pieces)
    if len(pieces) > c["vocab_size"]:
        raise UserError(f"{model_file} has {len(pieces)} pieces, more than the model's {c['vocab_size']} embeddings")
    tokens = [p.piece.encode("utf-8") for p in pieces]
    scores = [float(p.score) for p in pieces]
    types = [int(gguf.TokenType.NORMAL) if p.type == p.USER_DEFINED and written_as_normal(p.piece, proto) else
             int(p.type) for p in pieces]  # fmt: skip
    for i in range(len(pieces), c["vocab_size"]):  # rows the tokenizer never produces
        tokens.append(f"[moe-lm unused {i}]".encode())
        scores.append(-1e9)
        types.append(int(gguf.TokenType.UNUSED))
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    t = proto.trainer_spec
    start = c.get("bos_token_id")
    if start is None:
        start = t.bos_id if t.bos_id >= 0 else t.eos_id
    w.add_bos_token_id(start)
    if c.get("eos_token_id") is not None or t.eos_id >= 0:
        w.add_eos_token_id(c["eos_token_id"] if c.get("eos_token_id") is not None else t.eos_id)
    if t.unk_id >= 0:
        w.add_unk_token_id(t.unk_id)
    if t.pad_id >= 0:
        w.add_pad_token_id(t.pad_id)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(bool(proto.normalizer_spec.add_dummy_prefix))
    return len(pieces)


def read_state(hf_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of the export's safetensors files, as float32 numpy arrays."""
    import torch

    return {name: t.to(torch.float32).numpy() for name, t in SafetensorsFolder(hf_dir, EXPORT_AGAIN).tensors()}


def gguf_tensors(hf: dict[str, np.ndarray], c: dict, arch: str) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, array in numpy's order) for every tensor llama.cpp's loader takes, as its converter names them."""
    out = [("token_embd.weight", hf["model.embed_tokens.weight"]), ("output_norm.weight", hf["model.norm.weight"]),
           ("output.weight", hf["lm_head.weight"])]  # fmt: skip
    for i in range(c["num_hidden_layers"]):
        p, s = f"blk.{i}.", f"model.layers.{i}."
        out.append((p + "attn_norm.weight", hf[s + "input_layernorm.weight"]))
        post_norm = "ffn_norm" if arch == "deepseek2" else "post_attention_norm"
        out.append((p + post_norm + ".weight", hf[s + "post_attention_layernorm.weight"]))
        out += attention_tensors(hf, c, arch, p, s + "self_attn.")
        out += ffn_tensors(hf, c, p, s + "mlp.", moe=i >= c.get("first_k_dense_replace", 0))
    return out


def attention_tensors(hf: dict, c: dict, arch: str, p: str, s: str) -> list[tuple[str, np.ndarray]]:
    if arch == "glm4moe":
        return [(p + f"attn_{x}.weight", hf[s + f"{x}_proj.weight"]) for x in ("q", "k", "v")] + [
            (p + "attn_output.weight", hf[s + "o_proj.weight"])
        ]
    H, nope, v, kv = c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    out = []
    if c.get("q_lora_rank"):
        out += [(p + "attn_q_a.weight", hf[s + "q_a_proj.weight"]),
                (p + "attn_q_a_norm.weight", hf[s + "q_a_layernorm.weight"]),
                (p + "attn_q_b.weight", hf[s + "q_b_proj.weight"])]  # fmt: skip
    else:
        out.append((p + "attn_q.weight", hf[s + "q_proj.weight"]))
    # why split: llama.cpp absorbs W_UK into the query and applies W_UV after attention over the latent cache
    kv_b = hf[s + "kv_b_proj.weight"].reshape(H, nope + v, kv)
    out += [(p + "attn_kv_a_mqa.weight", hf[s + "kv_a_proj_with_mqa.weight"]),
            (p + "attn_kv_a_norm.weight", hf[s + "kv_a_layernorm.weight"]),
            (p + "attn_k_b.weight", np.ascontiguousarray(kv_b[:, :nope, :].transpose(0, 2, 1))),  # [H, kv, nope]
            (p + "attn_v_b.weight", np.ascontiguousarray(kv_b[:, nope:, :])),  # [H, v, kv]
            (p + "attn_output.weight", hf[s + "o_proj.weight"])]  # fmt: skip
    return out


def ffn_tensors(hf: dict, c: dict, p: str, s: str, moe: bool) -> list[tuple[str, np.ndarray]]:
    names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    if not moe:
        return [(p + f"ffn_{g}.weight", hf[s + f"{h}.weight"]) for h, g in names.items()]
    out = [(p + "ffn_gate_inp.weight", hf[s + "gate.weight"]),
           (p + "exp_probs_b.bias", hf[s + "gate.e_score_correction_bias"])]  # fmt: skip
    E, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    if s + "experts.gate_up_proj" in hf:  # transformers' fused layout: [E, 2I, D] (gate first) and [E, D, I]
        gate_up = hf[s + "experts.gate_up_proj"]
        experts = {"gate": gate_up[:, :inter], "up": gate_up[:, inter:], "down": hf[s + "experts.down_proj"]}
    else:
        experts = {g: np.stack([hf[s + f"experts.{e}.{h}.weight"] for e in range(E)]) for h, g in names.items()}
    out += [(p + f"ffn_{g}_exps.weight", np.ascontiguousarray(experts[g])) for g in ("gate", "up", "down")]
    out += [(p + f"ffn_{g}_shexp.weight", hf[s + f"shared_experts.{h}.weight"]) for h, g in names.items()]
    return out


def add_tensor(w, gguf, name: str, array: np.ndarray, out_type: str) -> int:
    """Write one tensor in `out_type` (norms, biases and the router in f32, as llama.cpp's converter keeps them);
    returns 1 when Q8_0 fell back to f16 for it."""
    QT = gguf.GGMLQuantizationType
    a = np.ascontiguousarray(array, dtype=np.float32)
    if out_type == "f32" or a.ndim == 1 or ".ffn_gate_inp." in name:
        w.add_tensor(name, a)
    elif out_type == "f16" or (out_type == "q8_0" and a.shape[-1] % 32):
        w.add_tensor(name, a.astype(np.float16))
        return int(out_type == "q8_0")
    else:
        qt = QT.BF16 if out_type == "bf16" else QT.Q8_0
        w.add_tensor(name, gguf.quants.quantize(a, qt), raw_dtype=qt)
    return 0


def needed_bytes(n_params: int, out_type: str) -> int:
    """About the size of the file: bytes per parameter of the type (Q8_0: 34 bytes per 32 values)."""
    per = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}[out_type]
    return math.ceil(n_params * per) + 2**20
