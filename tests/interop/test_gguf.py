"""GGUF export (`moe-lm export --gguf`), read back with gguf-py's reader: the keys llama.cpp's loader reads, with
their types; every tensor named and shaped as gguf-py's tables and llama.cpp's loader say; the vocabulary equal to
the sentencepiece model; f32 tensors equal to the checkpoint's. llama.cpp itself runs the files in `make
gguf-check` (outside the suite: it builds llama.cpp)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import gguf
import numpy as np
import pytest
import sentencepiece as spm
import torch
from safetensors.torch import load_file

from moe_lm.checkpoint.format import load_model
from moe_lm.data.tokenizer import load_data_tokenizer
from moe_lm.interop.gguf import export_gguf, spm_proto
from moe_lm.interop.hf import export_hf
from moe_lm.interop.hf_tokenizer import export_tokenizer
from moe_lm.model import Transformer
from moe_lm.testing import tiny_model_cfg

U32, F32, BOOL, STR, ARR = (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.BOOL,
                            gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY)  # fmt: skip

# what llama.cpp's loader reads for these architectures (src/llama-model.cpp, src/models/deepseek2.cpp,
# src/models/glm4-moe.cpp of the llama.cpp llama-cpp-python 0.3.36 vendors), with the types it requires
COMMON_KEYS = {
    "context_length": U32, "embedding_length": U32, "block_count": U32, "feed_forward_length": U32,
    "attention.head_count": U32, "attention.head_count_kv": U32, "attention.layer_norm_rms_epsilon": F32,
    "expert_count": U32, "expert_used_count": U32, "expert_shared_count": U32, "expert_feed_forward_length": U32,
    "expert_weights_scale": F32, "expert_weights_norm": BOOL, "expert_gating_func": U32,
    "leading_dense_block_count": U32, "rope.dimension_count": U32, "rope.freq_base": F32,
    "attention.key_length": U32, "attention.value_length": U32,
}  # fmt: skip
MLA_KEYS = {"attention.q_lora_rank": U32, "attention.kv_lora_rank": U32, "attention.key_length_mla": U32,
            "attention.value_length_mla": U32}  # fmt: skip
TOKENIZER_KEYS = {
    "tokenizer.ggml.model": STR, "tokenizer.ggml.tokens": ARR, "tokenizer.ggml.scores": ARR,
    "tokenizer.ggml.token_type": ARR, "tokenizer.ggml.bos_token_id": U32, "tokenizer.ggml.eos_token_id": U32,
    "tokenizer.ggml.add_bos_token": BOOL, "tokenizer.ggml.add_space_prefix": BOOL,
}  # fmt: skip


def field(reader, key):
    return reader.fields[key].contents()


def tensors(reader) -> dict:
    return {t.name: t for t in reader.tensors}


def expected_shapes(c: dict, arch: str) -> dict[str, tuple]:
    """Every tensor llama.cpp's loader creates for the model of HF config `c`, numpy order (GGUF's reversed)."""
    D, L, E, V = c["hidden_size"], c["num_hidden_layers"], c["n_routed_experts"], c["vocab_size"]
    ie, ish = c["moe_intermediate_size"], c["moe_intermediate_size"] * c["n_shared_experts"]
    out = {"token_embd.weight": (V, D), "output_norm.weight": (D,), "output.weight": (V, D)}
    for i in range(L):
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = (D,)
        out[p + ("ffn_norm" if arch == "deepseek2" else "post_attention_norm") + ".weight"] = (D,)
        if arch == "deepseek2":
            H, nope, rope, v, kv = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                                    c["v_head_dim"], c["kv_lora_rank"])  # fmt: skip
            if c.get("q_lora_rank"):
                q = c["q_lora_rank"]
                out |= {p + "attn_q_a.weight": (q, D), p + "attn_q_a_norm.weight": (q,),
                        p + "attn_q_b.weight": (H * (nope + rope), q)}  # fmt: skip
            else:
                out[p + "attn_q.weight"] = (H * (nope + rope), D)
            out |= {p + "attn_kv_a_mqa.weight": (kv + rope, D), p + "attn_kv_a_norm.weight": (kv,),
                    p + "attn_k_b.weight": (H, kv, nope), p + "attn_v_b.weight": (H, v, kv),
                    p + "attn_output.weight": (D, H * v)}  # fmt: skip
        else:
            H, Hkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
            out |= {p + "attn_q.weight": (H * hd, D), p + "attn_k.weight": (Hkv * hd, D),
                    p + "attn_v.weight": (Hkv * hd, D), p + "attn_output.weight": (D, H * hd)}  # fmt: skip
        if i < c["first_k_dense_replace"]:
            I = c["intermediate_size"]  # noqa: E741
            out |= {p + "ffn_gate.weight": (I, D), p + "ffn_up.weight": (I, D), p + "ffn_down.weight": (D, I)}
        else:
            out |= {p + "ffn_gate_inp.weight": (E, D), p + "exp_probs_b.bias": (E,),
                    p + "ffn_gate_exps.weight": (E, ie, D), p + "ffn_up_exps.weight": (E, ie, D),
                    p + "ffn_down_exps.weight": (E, D, ie), p + "ffn_gate_shexp.weight": (ish, D),
                    p + "ffn_up_shexp.weight": (ish, D), p + "ffn_down_shexp.weight": (D, ish)}  # fmt: skip
    return out


def check_file(path, hf_dir, arch: str) -> None:
    """Keys, tensor names and shapes, vocabulary, and tensors equal to the HF export's (f32)."""
    reader = gguf.GGUFReader(path)
    c = json.loads((hf_dir / "config.json").read_text())
    assert field(reader, "general.architecture") == arch
    keys = {f"{arch}.{k}": t for k, t in (COMMON_KEYS | (MLA_KEYS if arch == "deepseek2" else {})).items()}
    for key, kind in (keys | TOKENIZER_KEYS).items():
        assert key in reader.fields, key
        assert reader.fields[key].types[0] == kind, (key, reader.fields[key].types)
    assert field(reader, f"{arch}.expert_gating_func") == int(gguf.ExpertGatingFuncType.SIGMOID)
    assert field(reader, f"{arch}.expert_weights_scale") == pytest.approx(c["routed_scaling_factor"])
    assert field(reader, f"{arch}.expert_weights_norm") == c["norm_topk_prob"]
    limits = c["n_group"] > 1 and c["topk_group"] < c["n_group"]
    assert (f"{arch}.expert_group_count" in reader.fields) == limits
    if arch == "deepseek2":
        assert field(reader, f"{arch}.attention.q_lora_rank") == (c["q_lora_rank"] or 0)
        assert field(reader, f"{arch}.attention.head_count_kv") == 1
        assert field(reader, f"{arch}.attention.key_length") == c["kv_lora_rank"] + c["qk_rope_head_dim"]

    # names: exactly the loader's tensors, each one gguf-py's tables know for the architecture
    arch_enum = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch_enum]}
    got = tensors(reader)
    shapes = expected_shapes(c, arch)
    assert set(got) == set(shapes)
    for name, t in got.items():
        base = name.removesuffix(".weight").removesuffix(".bias")
        assert any(base == k.format(bid=name.split(".")[1]) for k in known), name
        assert tuple(int(d) for d in reversed(t.shape)) == shapes[name], (name, t.shape)
        assert t.tensor_type == gguf.GGMLQuantizationType.F32

    # values: byte for byte the export's (the attention's kv_b split by heads as llama.cpp absorbs it)
    hf = {k: v.numpy() for k, v in load_file(hf_dir / "model.safetensors").items()}
    s = "model.layers.1."
    assert np.array_equal(got["token_embd.weight"].data, hf["model.embed_tokens.weight"])
    assert np.array_equal(got["blk.1.exp_probs_b.bias"].data, hf[s + "mlp.gate.e_score_correction_bias"])
    experts = np.stack([hf[s + f"mlp.experts.{e}.down_proj.weight"] for e in range(c["n_routed_experts"])])
    assert np.array_equal(got["blk.1.ffn_down_exps.weight"].data, experts)
    if arch == "deepseek2":
        H, nope, kv = c["num_attention_heads"], c["qk_nope_head_dim"], c["kv_lora_rank"]
        kv_b = hf[s + "self_attn.kv_b_proj.weight"].reshape(H, -1, kv)
        assert np.array_equal(got["blk.1.attn_k_b.weight"].data, kv_b[:, :nope].transpose(0, 2, 1))
        assert np.array_equal(got["blk.1.attn_v_b.weight"].data, kv_b[:, nope:])

    # vocabulary: the sentencepiece model's pieces, scores and types, padded to the embedding's rows
    sp = spm.SentencePieceProcessor(model_file=str(hf_dir / "tokenizer.model"))
    pieces = list(field(reader, "tokenizer.ggml.tokens"))
    n = sp.get_piece_size()
    assert pieces[:n] == [sp.id_to_piece(i) for i in range(n)] and len(pieces) == c["vocab_size"]
    assert len(set(pieces)) == len(pieces)
    scores = field(reader, "tokenizer.ggml.scores")
    assert np.allclose(scores[:n], [sp.get_score(i) for i in range(n)], rtol=0, atol=0)
    types = field(reader, "tokenizer.ggml.token_type")
    # llama.cpp's token types (NORMAL 1, UNKNOWN 2, CONTROL 3, UNUSED 5, BYTE 6) from what the tokenizer says of
    # each piece; the one-character symbols it was trained to keep whole ("\n", "\t") are normal pieces there
    kept = set(spm_proto(hf_dir / "tokenizer.model").trainer_spec.user_defined_symbols)
    assert kept == {"\n", "\t"}
    want = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 5 if sp.is_unused(i)
            else 1 for i in range(n)]  # fmt: skip
    assert list(types[:n]) == want and set(types[n:]) <= {5}
    assert field(reader, "tokenizer.ggml.bos_token_id") == c["bos_token_id"]
    assert bool(field(reader, "tokenizer.ggml.add_bos_token"))


def test_a_runs_gguf_export_holds_what_llama_cpps_loader_reads(cli, trained_run, tmp_path):
    run = trained_run()
    proc = cli("export", "--run", run, "--out", tmp_path / "hf", "--gguf", tmp_path / "run.gguf")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "deepseek2 GGUF (f32" in proc.stdout
    check_file(tmp_path / "run.gguf", tmp_path / "hf", "deepseek2")
    # the checkpoint's own tensors, byte for byte (those without a layout change on the way)
    _, model, _ = load_model(run)
    reader = tensors(gguf.GGUFReader(tmp_path / "run.gguf"))
    state = model.state_dict()
    assert np.array_equal(reader["output.weight"].data, state["lm_head.weight"].numpy())
    E = state["layers.1.mlp.gate.weight"].shape[0]
    gate = state["layers.1.mlp.experts.gate_up_proj"][:, : state["layers.1.mlp.experts.gate_up_proj"].shape[1] // 2]
    assert E > 1 and np.array_equal(reader["blk.1.ffn_gate_exps.weight"].data, gate.numpy())
    assert [p.name for p in tmp_path.iterdir()] and not list(tmp_path.glob(".*partial*"))


@pytest.mark.parametrize("attention, q_lora_rank, mtp", [("gqa", 0, 0), ("mla", 16, 0), ("mla", 0, 1)])
def test_gqa_query_lora_and_mtp_exports_from_an_hf_folder(tiny_data, tmp_path, cli, attention, q_lora_rank, mtp):
    tok = load_data_tokenizer(tiny_data.out_dir)
    cfg = tiny_model_cfg(attention, vocab_size=320)
    cfg = dataclasses.replace(cfg, mla=dataclasses.replace(cfg.mla, q_lora_rank=q_lora_rank),
                              mtp=dataclasses.replace(cfg.mtp, depth=mtp))  # fmt: skip
    torch.manual_seed(0)
    export_hf(Transformer(cfg).eval(), tmp_path / "hf", tok.doc_start_id, tok.eos_id)
    export_tokenizer(tiny_data.out_dir, tmp_path / "hf")
    arch = "glm4moe" if attention == "gqa" else "deepseek2"
    proc = cli("export", "--hf", tmp_path / "hf", "--gguf", tmp_path / "m.gguf")
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_file(tmp_path / "m.gguf", tmp_path / "hf", arch)  # the MTP layers' tensors are not among them
    assert ("MTP module(s) left out" in proc.stdout) == bool(mtp)


def test_reduced_types_and_what_cannot_be_written(tiny_data, tmp_path, cli):
    tok = load_data_tokenizer(tiny_data.out_dir)
    cfg = tiny_model_cfg("mla", vocab_size=320)
    export_hf(Transformer(cfg).eval(), tmp_path / "hf", tok.doc_start_id, tok.eos_id)
    export_tokenizer(tiny_data.out_dir, tmp_path / "hf")
    for kind, qt in (("f16", "F16"), ("bf16", "BF16"), ("q8_0", "Q8_0")):
        said = export_gguf(tmp_path / "hf", tmp_path / f"{kind}.gguf", kind)
        ts = tensors(gguf.GGUFReader(tmp_path / f"{kind}.gguf"))
        assert ts["token_embd.weight"].tensor_type.name == qt, said
        assert ts["output_norm.weight"].tensor_type.name == "F32"  # norms stay f32, as llama.cpp's converter does
    # a tokenizer llama.cpp would not reproduce is refused in one line, and no file is left
    hf = tmp_path / "hf"
    (hf / "tokenizer.model").unlink()
    proc = cli("export", "--hf", hf, "--gguf", tmp_path / "no.gguf")
    assert proc.returncode == 2 and "tokenizer.json" in proc.stderr and "cannot be written" in proc.stderr
    assert not (tmp_path / "no.gguf").exists() and not list(tmp_path.glob(".no.gguf*"))
    (tmp_path / "text.txt").write_text("ab ba abba baab\n" * 500)
    spm.SentencePieceTrainer.train(input=str(tmp_path / "text.txt"), model_prefix=str(tmp_path / "uni"),
                                   vocab_size=8, model_type="unigram", minloglevel=2)  # fmt: skip
    shutil.copyfile(tmp_path / "uni.model", hf / "tokenizer.model")
    proc = cli("export", "--hf", hf, "--gguf", tmp_path / "no.gguf")
    assert proc.returncode == 2 and "unigram" in proc.stderr and not (tmp_path / "no.gguf").exists()
    # an existing file is replaced only with --force, and moved aside
    (tmp_path / "mine.gguf").write_text("the user's file")
    proc = cli("export", "--hf", hf, "--gguf", tmp_path / "mine.gguf")
    assert (
        proc.returncode == 2
        and "--force" in proc.stderr
        and (tmp_path / "mine.gguf").read_text() == ("the user's file")
    )


@pytest.fixture(scope="module")
def hf_export(tiny_data, tmp_path_factory):
    tok = load_data_tokenizer(tiny_data.out_dir)
    folder = tmp_path_factory.mktemp("gguf_hf") / "hf"
    export_hf(Transformer(tiny_model_cfg("mla", vocab_size=320)).eval(), folder, tok.doc_start_id, tok.eos_id)
    export_tokenizer(tiny_data.out_dir, folder)
    return folder


LIES = {
    "fewer layers": {"num_hidden_layers": 1},
    "a billion words (float)": {"vocab_size": 1e9},
    "a billion words": {"vocab_size": 10**9},
    "a string": {"hidden_size": "128"},
    "missing": {"n_routed_experts": None},
    "expert width": {"moe_intermediate_size": 7},
    "expert count": {"n_routed_experts": 4},
    "top-k above the experts": {"num_experts_per_tok": 99},
    "latent width": {"kv_lora_rank": 3},
    "a list": {"num_attention_heads": [2]},
    "yarn without its factor": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0}},
    "rope as a string": {"rope_parameters": "yarn"},
}


@pytest.mark.parametrize("lie", LIES)
def test_a_config_json_that_lies_about_the_tensors_is_one_line_and_writes_nothing(hf_export, tmp_path, cli, lie):
    hf = tmp_path / "hf"
    shutil.copytree(hf_export, hf)
    config = json.loads((hf / "config.json").read_text())
    config.update(LIES[lie])
    (hf / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    proc = cli("export", "--hf", hf, "--gguf", tmp_path / "lie.gguf")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-2000:]
    assert "config.json" in lines[0] and len(lines[0]) < 600, lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_full_disk_during_a_gguf_export_from_an_hf_folder_is_one_line_with_the_real_size(
    hf_export, tmp_path, cli, monkeypatch
):
    """numpy's tofile reports a short write as an OSError without an errno ("N requested and M written")."""
    from moe_lm.files import gib
    from moe_lm.interop.gguf import hf_parameter_count, needed_bytes

    def short_write(self, *a, **k):
        self.fout[0].write(b"GGUF" + b"\0" * 100) if isinstance(self.fout, list) else None
        raise OSError("4194304 requested and 1000 written")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", short_write)
    proc = cli("export", "--hf", hf_export, "--gguf", tmp_path / "full.gguf")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "disk filled up" in lines[0], proc.stderr[-2000:]
    need = needed_bytes(hf_parameter_count(hf_export), "f32")
    assert gib(need) != gib(needed_bytes(0, "f32")) and f"about {gib(need)} needed" in lines[0]
    assert list(tmp_path.iterdir()) == []
