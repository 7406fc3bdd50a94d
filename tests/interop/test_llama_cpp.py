"""A GGUF file as llama.cpp runs it (moe_lm/interop/llama_cpp.py, through llama-cpp-python, part of the dev install):
the experts and weights read from llama.cpp's own graph equal moe-lm's for every token at full precision (MLA and
GQA exports with biased, group-limited routing), `moe-lm analyze --gguf` and `--compare` report it, llama.cpp's
quantiser writes the k-quants, and bad input is one line."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from moe_lm.analysis.agreement import agreement
from moe_lm.analysis.recording import record_trace
from moe_lm.data.prepare import load_split
from moe_lm.data.tokenizer import load_data_tokenizer
from moe_lm.interop.gguf import export_gguf
from moe_lm.interop.hf import export_hf
from moe_lm.interop.hf_tokenizer import export_tokenizer
from moe_lm.interop.llama_cpp import GGUFModel, quantize
from moe_lm.model import Transformer
from moe_lm.routing.torch_routing import transformer_routing
from moe_lm.testing import check_model, tiny_model_cfg

VOCAB = 320


def documents(data_dir) -> list[tuple[int, np.ndarray]]:
    """Every validation document of the tiny corpus (its domain, its ids from the start token)."""
    val = load_split(data_dir, "val")
    return [(int(val.doc_domain[d]), np.asarray(val.document(d)).astype(np.int64)) for d in range(val.n_docs)]


@pytest.fixture(scope="module", params=["mla", "gqa"])
def exported(request, tiny_data, tmp_path_factory):
    """A check model (weights scaled up, non-zero selection biases, group-limited top-3 of 8) on the tiny corpus'
    tokenizer, exported to HF and to an f32 GGUF: (model, folder)."""
    folder = tmp_path_factory.mktemp(f"llama_{request.param}")
    tok = load_data_tokenizer(tiny_data.out_dir)
    model = check_model(request.param, vocab_size=VOCAB, q_lora_rank=0)
    export_hf(model, folder / "hf", tok.doc_start_id, tok.eos_id)
    export_tokenizer(tiny_data.out_dir, folder / "hf", max_len=model.cfg.max_seq_len)
    export_gguf(folder / "hf", folder / "f32.gguf", "f32")
    return model, folder


def test_llama_cpp_chooses_moe_lms_experts_for_every_token_at_full_precision(exported, tiny_data, tmp_path):
    """Every token of the validation split, every MoE layer: the same experts in the same order, the same gate
    weights (float32, matched by position), the same log-probs; near ties counted (none flip here)."""
    model, folder = exported
    docs = documents(tiny_data.out_dir)
    domains = list(load_split(tiny_data.out_dir, "val").domains)
    gguf_model = GGUFModel(folder / "f32.gguf", n_ctx=model.cfg.max_seq_len)
    ours = record_trace(transformer_routing(model), docs, tmp_path / "ours", domains, seq_len=model.cfg.max_seq_len,
                        progress=False)  # fmt: skip
    theirs = record_trace(gguf_model, docs, tmp_path / "llama", domains, seq_len=model.cfg.max_seq_len,
                          progress=False)  # fmt: skip
    assert ours.n >= 2000 and theirs.layers == ours.layers == model.moe_layer_ids()
    a = agreement(ours, theirs, "f32.gguf", n_boot=10)
    for layer, m in a["layers"].items():
        assert m["flips"] == m["flips_near_ties"] == 0 and m["order_differs"] == 0, (layer, m)
        assert m["top1_agreement"]["mean"] == 1.0 and m["topk_overlap"]["mean"] == 1.0
    assert a["logprob"]["all"]["max_abs"] < 2e-5, a["logprob"]
    for layer in ours.layers:  # each chosen expert's output norm: llama.cpp's down projection against moe-lm's experts
        theirs_norms, ours_norms = (np.asarray(t.norms(layer), np.float32) for t in (theirs, ours))
        np.testing.assert_allclose(theirs_norms, ours_norms, rtol=2e-3, atol=1e-4)
    # the weights at full width (the trace keeps float16): llama.cpp's final stage, normalised and scaled
    tokens = docs[0][1][: model.cfg.max_seq_len]
    routed = gguf_model.route(tokens)
    from moe_lm.routing.recorder import RoutingRecorder, routers_by_layer

    with RoutingRecorder(routers_by_layer(model)) as recorder, torch.no_grad():
        model(torch.from_numpy(tokens)[None])
    for layer in model.moe_layer_ids():
        idx, w = (t.numpy() for t in recorder.last[layer])
        assert np.array_equal(idx, routed.experts[layer])
        np.testing.assert_allclose(routed.weights[layer], w, rtol=0, atol=2e-6)
        assert np.isfinite(routed.margins[layer]).all() and (routed.margins[layer] >= 0).all()
    gguf_model.close()


def test_analyze_a_gguf_and_compare_it_with_its_run_and_a_quantised_copy(exported, tiny_data, tmp_path, cli):
    """`moe-lm analyze --hf` (the export's original) with --compare f32.gguf q4_K_M.gguf: one report, one
    figure for both, the f32 file agreeing exactly and the quantised one reported as measured; `--gguf` alone
    leaves N1 out and says why."""
    model, folder = exported
    said = quantize(folder / "f32.gguf", tmp_path / "q4.gguf", "q4_K_M")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "q4.gguf").tensors}
    assert types["blk.1.ffn_gate_inp.weight"] == "F32" and types["blk.1.exp_probs_b.bias"] == "F32"  # the routers
    assert any(t not in ("F32", "F16") for t in types.values()) and "Q" in said
    data = tmp_path / "docs.jsonl"
    val = load_split(tiny_data.out_dir, "val")
    tok = load_data_tokenizer(tiny_data.out_dir)
    data.write_text("".join(json.dumps({"text": tok.decode(list(val.document(d))[1:]), "domain": str(
        val.domains[val.doc_domain[d]])}) + "\n" for d in range(val.n_docs)))  # fmt: skip
    compare = ["--compare", folder / "f32.gguf", tmp_path / "q4.gguf"]
    proc = cli("analyze", "--hf", folder / "hf", "--data", data, "--out", tmp_path / "a", "--max-tokens", "1500",
               "--seq-len", "128", "--no-init-baseline", *compare)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "a" / "metrics.json").read_text())
    exact, quantised = (result["comparisons"][str(p)] for p in (folder / "f32.gguf", tmp_path / "q4.gguf"))
    assert exact["tokens_differing_in_any_layer"]["mean"] == 0.0
    assert exact["logprob"]["all"]["max_abs"] < 1e-4
    assert quantised["logprob"]["all"]["mean_abs"] > exact["logprob"]["all"]["mean_abs"]
    assert (tmp_path / "a" / "figures" / "agreement.png").is_file()
    assert "Compared subjects" in (tmp_path / "a" / "routing.html").read_text()
    proc = cli("analyze", "--gguf", folder / "f32.gguf", "--data", data, "--out", tmp_path / "g", "--max-tokens",
               "500", "--seq-len", "128")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "g" / "metrics.json").read_text())
    assert "init_N1" not in result and "no way to initialise" in result["init_N1_left_out"]
    assert result["trace"]["tokens"] == 500


def test_analyze_quantise_compares_the_run_with_its_gguf_exports(trained_run, tmp_path, cli):
    """`moe-lm analyze --run R --quantise f32 q8_0`: each export run in llama.cpp on the run's own token ids, named by
    its type; the f32 file routes exactly as the run, comparisons.md says what metrics.json holds, and the files
    themselves are gone with the staging folder."""
    out = tmp_path / "drift"
    proc = cli("analyze", "--run", trained_run(), "--quantise", "f32", "q8_0", "--max-tokens", "1500",
               "--no-init-baseline", "--out", out)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "metrics.json").read_text())
    assert list(result["comparisons"]) == ["f32", "q8_0"]
    exact, q8 = result["comparisons"]["f32"], result["comparisons"]["q8_0"]
    assert exact["tokens_differing_in_any_layer"]["mean"] == 0.0 and exact["logprob"]["all"]["max_abs"] < 1e-4
    assert "Q8_0" in q8["provenance"]["tensors"] and q8["provenance"]["kv_cache"] == "f32"
    rows = {line.split(" | ")[0].lstrip("| "): line for line in (out / "comparisons.md").read_text().splitlines()}
    any_layer = q8["tokens_differing_in_any_layer"]
    assert rows["q8_0"].split(" | ")[1].startswith(f"{100 * any_layer['mean']:.2f} (")
    assert rows["f32"].split(" | ")[1] == "0.00 (0.00-0.00)"
    assert not list(out.rglob("*.gguf")) and not (out / "quantised").exists()
    refused = cli("analyze", "--hf", tmp_path, "--data", tmp_path, "--quantise", "q8_0", "--out", tmp_path / "x")
    one_line(refused, "--quantise exports a moe-lm run")


def test_sigterm_during_quantise_leaves_nothing_behind(trained_run, tmp_path, process):
    """SIGTERM (`kill`, `timeout`, a scheduler) during --quantise left the staging folder, an HF export and every GGUF
    made so far (hundreds of GB for a 16 B model), until the next command into the same --out; Ctrl-C already
    cleaned up. It now ends as Ctrl-C does: one line, 128 + SIGTERM, the staging folder removed."""
    out = tmp_path / "drift"
    proc = process.start("analyze", "--run", trained_run(), "--quantise", "f32", "q8_0", "q6_K", "q4_K_M",
                         "--max-tokens", "1500", "--no-init-baseline", "--out", out)  # fmt: skip
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob(".drift.partial-*/quantised/model-*.gguf")) and proc.poll() is None:
        assert time.monotonic() < deadline, "no GGUF file was made"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM and "terminated (SIGTERM)" in err, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and sorted(p.name for p in tmp_path.iterdir()) == []


def test_ctrl_c_while_llama_cpp_decodes_is_raised_not_dropped(exported):
    """Python raises Ctrl-C's KeyboardInterrupt in whichever callback llama.cpp runs next (its log, the evaluation
    callback, entered for every graph node), and ctypes drops an exception raised there: a Ctrl-C during a GGUF
    analysis was lost (the command ran on to exit 0). Five Ctrl-Cs, each sent while decodes run back to back: each is
    raised, within a few decodes."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("Python handles signals in the main thread only")
    model, folder = exported
    tokens = (np.arange(128) * 7 + 3) % VOCAB
    with GGUFModel(folder / "f32.gguf", n_ctx=128) as m:
        for _ in range(5):
            sent = threading.Event()
            sender = threading.Thread(target=_ctrl_c_after, args=(0.05, sent))
            after = 0
            with pytest.raises(KeyboardInterrupt):
                sender.start()
                while after < 20:
                    m.route(tokens)
                    after += sent.is_set()
            sender.join()
        assert m.route(tokens).logprob.shape == (128,)  # a decode cut short leaves the context usable


def test_ctrl_c_during_quantisation_stops_it_and_its_process(exported, tmp_path):
    """llama.cpp's quantiser runs in a process of its own: Ctrl-C reaches the command, which waits in Python, and the
    quantiser's process is ended with it (in the command's own process the signal waited for the whole
    quantisation, minutes on a large model)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("Python handles signals in the main thread only")
    import psutil

    model, folder = exported
    me = psutil.Process()
    # why only new children: an earlier test in this worker may have left a library's service (wandb-core) running
    before = {c.pid for c in me.children()}

    def quantiser() -> list:
        return [c for c in me.children() if c.pid not in before]

    sender = threading.Thread(target=lambda: (_wait_for(quantiser), os.kill(os.getpid(), signal.SIGINT)))
    sender.start()
    with pytest.raises(KeyboardInterrupt):
        quantize(folder / "f32.gguf", tmp_path / "q4.gguf", "q4_K_M")
    sender.join()
    _, alive = psutil.wait_procs(quantiser(), timeout=30)  # killed (SIGKILL lands within moments, even under load)
    assert [c for c in alive if c.status() != psutil.STATUS_ZOMBIE] == []


def _ctrl_c_after(seconds: float, sent: threading.Event) -> None:
    time.sleep(seconds)
    os.kill(os.getpid(), signal.SIGINT)
    sent.set()


def _wait_for(condition, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_export_writes_k_quants_with_llama_cpps_quantiser(trained_run, tmp_path, cli):
    proc = cli("export", "--run", trained_run(), "--gguf", tmp_path / "q.gguf", "--gguf-type", "q6_K")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "q6_K by llama.cpp's quantiser" in proc.stdout and "tensors:" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.gguf"]  # the f32 file it was made from is gone
    assert gguf.GGUFReader(tmp_path / "q.gguf").fields["general.file_type"].contents() == 18  # MOSTLY_Q6_K


def one_line(proc, *needles: str) -> str:
    """The one error line of a refused command (progress lines of the recording before it aside)."""
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-2000:]
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


def test_bad_gguf_subjects_are_one_line(exported, trained_run, tiny_data, tmp_path, cli, monkeypatch):
    model, folder = exported
    data = tmp_path / "docs.txt"
    data.write_text("the telescope tracked a distant galaxy " * 40)
    run = ["--data", data, "--max-tokens", "200"]
    (tmp_path / "text.gguf").write_text("not a model")
    one_line(cli("analyze", "--gguf", tmp_path / "text.gguf", *run, "--out", tmp_path / "o1"), "not a GGUF file")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((folder / "f32.gguf").read_bytes()[:5000])
    one_line(cli("analyze", "--gguf", cut, *run, "--out", tmp_path / "o2"), str(cut), "truncated")
    one_line(cli("analyze", "--gguf", folder / "f32.gguf", "--out", tmp_path / "o3"), "--gguf needs --data")
    # a compared subject of another vocabulary (the trained run's 300 pieces against the check model's 320 rows)
    proc = cli("analyze", "--gguf", folder / "f32.gguf", *run, "--out", tmp_path / "o4", "--compare", trained_run())
    one_line(proc, "compared subject", "another vocabulary")
    # ... or of another architecture: the same vocabulary, another number of experts per token
    other = tmp_path / "other"
    tok = load_data_tokenizer(tiny_data.out_dir)
    top2 = tiny_model_cfg("mla", vocab_size=VOCAB, moe=dict(num_experts_per_tok=2))
    export_hf(Transformer(top2).eval(), other, tok.doc_start_id, tok.eos_id)
    export_tokenizer(tiny_data.out_dir, other)
    export_gguf(other, tmp_path / "other.gguf", "f32")
    proc = cli("analyze", "--gguf", folder / "f32.gguf", *run, "--out", tmp_path / "o5", "--compare",
               tmp_path / "other.gguf")  # fmt: skip
    one_line(proc, "compared subject", "not the same architecture")
    # llama-cpp-python missing: the extra named
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    one_line(cli("analyze", "--gguf", folder / "f32.gguf", *run, "--out", tmp_path / "o6"), ".[llama]")
    assert not any(tmp_path.glob("o[0-9]"))


def test_threads_beyond_the_cores_are_capped(exported, tmp_path, cli):
    """`--threads 1000` killed the process inside llama.cpp's OpenMP runtime; llama.cpp gets the cores there are."""
    model, folder = exported
    data = tmp_path / "docs.txt"
    data.write_text("the telescope tracked a distant galaxy " * 20)
    proc = cli("analyze", "--gguf", folder / "f32.gguf", "--data", data, "--out", tmp_path / "a", "--max-tokens", "100",
               "--threads", "1000")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"llama.cpp runs {len(os.sched_getaffinity(0))} threads" in proc.stdout
    assert json.loads((tmp_path / "a" / "metrics.json").read_text())["trace"]["tokens"] == 100


def rewrite_gguf(src: Path, dst: Path, fields: dict | None = None, tensors: dict | None = None) -> None:
    """`src` written again to `dst` with gguf-py, its keys replaced or added by `fields` (key -> (value, type)) and
    tensors added by `tensors` (name -> array): a GGUF file that differs from one llama.cpp runs in just that."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch=arch)
    given = dict(fields or {})
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value, kind = given.pop(name, (f.contents(), f.types[0]))
        w.add_key_value(name, value, kind, sub_type=f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for name, (value, kind) in given.items():
        w.add_key_value(name, value, kind)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, array in (tensors or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


U32 = gguf.GGUFValueType.UINT32


@pytest.mark.parametrize(
    "fields, needle",
    [({"expert_used_count": 0}, "expert_used_count 0 is not between 1 and expert_count 8"),
     ({"expert_used_count": 9}, "expert_used_count 9 is not between 1 and expert_count 8"),
     ({"expert_group_count": 3, "expert_group_used_count": 1}, "expert groups 3 (of which 1 used) do not split 8"),
     ({"expert_group_count": 4, "expert_group_used_count": 4}, "expert groups 4 (of which 4 used)"),
     ({"expert_group_count": 8}, "expert_group_count 8 is not below expert_count 8"),
     ({"expert_group_count": 4, "expert_group_used_count": 1}, "top-3 of the 2 experts in 1 of 4 groups")],
)  # fmt: skip
def test_moe_keys_llama_cpp_would_abort_on_are_one_line(exported, tmp_path, cli, fields, needle):
    """llama.cpp asserts these keys at load (GGML_ASSERT: SIGABRT, exit 134, the staging folder left behind); moe-lm
    reads them first and refuses the file in one line, before llama.cpp sees it."""
    model, folder = exported
    arch = gguf.GGUFReader(folder / "f32.gguf").fields["general.architecture"].contents()
    bad = tmp_path / "bad.gguf"
    rewrite_gguf(folder / "f32.gguf", bad, {f"{arch}.{key}": (value, U32) for key, value in fields.items()})
    data = tmp_path / "docs.txt"
    data.write_text("the telescope tracked a distant galaxy " * 20)
    proc = cli("analyze", "--gguf", bad, "--data", data, "--out", tmp_path / "a")
    one_line(proc, str(bad), needle, "llama.cpp would abort")
    assert not (tmp_path / "a").exists() and not list(tmp_path.glob(".a.partial-*"))


def test_llama_cpp_aborting_takes_only_its_own_process(exported, tmp_path):
    """What moe-lm does not check itself, llama.cpp meets first in a process of its own (llama_process.py): its abort
    is a line naming the signal and llama.cpp's own message, and the command goes on to say so."""
    from moe_lm.interop.llama_process import probe

    model, folder = exported
    arch = gguf.GGUFReader(folder / "f32.gguf").fields["general.architecture"].contents()
    bad = tmp_path / "bad.gguf"
    rewrite_gguf(folder / "f32.gguf", bad, {f"{arch}.expert_used_count": (0, U32)})
    said = probe(bad, 64, 1, True)
    assert said is not None and "SIGABRT" in said and "GGML_ASSERT" in said, said
    assert probe(folder / "f32.gguf", 64, 1, True) is None


def test_a_nextn_block_is_skipped_as_llama_cpp_skips_it(exported, tiny_data, tmp_path, cli):
    """GLM-4.5 (glm4moe) and DeepSeek-V3 (deepseek2) GGUF files carry their MTP module as a last, NextN block
    (`nextn_predict_layers`), which llama.cpp loads but never runs in a forward pass: its routing is not asked
    for, and the file routes as the one without it."""
    model, folder = exported
    reader = gguf.GGUFReader(folder / "f32.gguf")
    arch = reader.fields["general.architecture"].contents()
    blocks = reader.fields[f"{arch}.block_count"].contents()
    last = f"blk.{blocks - 1}."
    d = model.cfg.dim
    extra = {
        t.name.replace(last, f"blk.{blocks}."): np.array(t.data) for t in reader.tensors if t.name.startswith(last)
    }
    extra.update({f"blk.{blocks}.nextn.eh_proj.weight": np.ones((d, 2 * d), np.float32),
                  f"blk.{blocks}.nextn.enorm.weight": np.ones(d, np.float32),
                  f"blk.{blocks}.nextn.hnorm.weight": np.ones(d, np.float32)})  # fmt: skip
    nextn = tmp_path / "nextn.gguf"
    rewrite_gguf(folder / "f32.gguf", nextn, {f"{arch}.block_count": (blocks + 1, U32),
                                              f"{arch}.nextn_predict_layers": (1, U32)}, extra)  # fmt: skip
    data = tmp_path / "docs.txt"
    data.write_text("the telescope tracked a distant galaxy, and the galaxy held its stars " * 20)
    proc = cli("analyze", "--gguf", nextn, "--data", data, "--out", tmp_path / "a", "--max-tokens", "300",
               "--compare", folder / "f32.gguf")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert result["trace"]["layers"] == model.moe_layer_ids()
    assert result["comparisons"][str(folder / "f32.gguf")]["tokens_differing_in_any_layer"]["mean"] == 0.0


def swapped_pieces(src: Path, dst: Path, ids: tuple[int, int]) -> None:
    """`src` with the vocabulary strings of two token ids of equal byte length swapped in place (nothing else)."""
    reader = gguf.GGUFReader(src)
    field = reader.fields["tokenizer.ggml.tokens"]
    base = reader.data.__array_interface__["data"][0]
    where = [field.parts[field.data[i]].__array_interface__["data"][0] - base for i in ids]
    pieces = [bytes(field.parts[field.data[i]]) for i in ids]
    assert len(pieces[0]) == len(pieces[1]) and pieces[0] != pieces[1]
    raw = bytearray(src.read_bytes())
    raw[where[0] : where[0] + len(pieces[0])], raw[where[1] : where[1] + len(pieces[1])] = pieces[1], pieces[0]
    dst.write_bytes(bytes(raw))


def test_a_vocabulary_with_two_pieces_swapped_is_refused_naming_the_id(exported, tiny_data, tmp_path, cli):
    """Two files whose vocabularies swap two pieces route the same text identically, but the same ids mean other
    words to them: compared on the subject's ids, 79 % of tokens "flipped" where none had. Every id the documents
    use must stand for the same bytes in both, or the comparison is refused naming the first that does not."""
    model, folder = exported
    text = "the telescope tracked a distant galaxy, and the galaxy held its stars " * 20
    tok = load_data_tokenizer(tiny_data.out_dir)
    used = sorted(set(tok.encode(text)))
    by_length = {}
    for i in used:
        by_length.setdefault(len(tok.id_to_piece(i).encode()), []).append(i)
    pair = next(tuple(ids[:2]) for ids in by_length.values() if len(ids) >= 2)
    swapped = tmp_path / "swapped.gguf"
    swapped_pieces(folder / "f32.gguf", swapped, pair)
    data = tmp_path / "docs.txt"
    data.write_text(text)
    proc = cli("analyze", "--gguf", folder / "f32.gguf", "--data", data, "--out", tmp_path / "a", "--max-tokens",
               "300", "--compare", swapped)  # fmt: skip
    line = one_line(proc, "compared subject", "another vocabulary", f"token id {min(pair)} stands for")
    assert repr(tok.token_bytes(min(pair))) in line


# llama.cpp's own converter, from the llama-cpp-python sdist `make setup` unpacks into the venv (never committed)
CONVERTER = Path(sys.prefix) / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
# the pre-tokenizer regex of Qwen2 (tokenizer.json's Split), which llama.cpp implements as pre-tokenizer "qwen2"
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def tiny_hf_moe(kind: str, folder: Path, texts: list[str]) -> Path:
    """A random transformers Qwen3Moe or OLMoE (2 MoE blocks of 8 experts, top-2; weights x5 so that routing is
    far from uniform) with a byte-level BPE tokenizer trained here on `texts`, Qwen2's pre-tokenizer in front."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    split = pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated")
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet,
                                                       special_tokens=["<|endoftext|>"]))  # fmt: skip
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(folder)
    common = dict(vocab_size=len(fast), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_experts=8,
                  num_experts_per_tok=2, max_position_embeddings=256, eos_token_id=fast.eos_token_id)  # fmt: skip
    if kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32, head_dim=16,
                                          num_key_value_heads=2, norm_topk_prob=True,
                                          tie_word_embeddings=False)  # fmt: skip
    else:
        cfg = transformers.OlmoeConfig(**common, intermediate_size=32, num_key_value_heads=4, norm_topk_prob=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(5.0)
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind, arch", [("qwen3_moe", "qwen3moe"), ("olmoe", "olmoe")])
def test_a_gguf_written_by_llama_cpps_converter_routes_as_transformers(kind, arch, tmp_path, process, cli):
    """Released models reach llama.cpp through its own converter (convert_hf_to_gguf.py): a tiny random Qwen3Moe and
    OLMoE, converted, recorded through --hf and through --gguf on the same ids: every decision equal. The converter
    refuses a tokenizer whose ids on its check text hash to no published model's (ours is trained here): the test
    tells it the pre-tokenizer (`qwen2`, the regex the tokenizer was built with) instead of letting it guess."""
    assert (CONVERTER / "convert_hf_to_gguf.py").is_file(), f"no converter in {CONVERTER}: run make setup"
    texts = [Path(p).read_text() for p in ("README.md", "docs/analytics.md", "moe_lm/output_folder.py")]
    hf = tiny_hf_moe(kind, tmp_path / kind, texts)
    code = (f"import runpy, sys; sys.path[:0] = [{str(CONVERTER / 'gguf-py')!r}, {str(CONVERTER)!r}]\n"
            "import conversion.base as base\n"
            "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen2'\n"
            f"sys.argv = ['convert_hf_to_gguf.py', {str(hf)!r}, '--outfile', {str(tmp_path / 'm.gguf')!r}, "
            "'--outtype', 'f32']\n"
            f"runpy.run_path({str(CONVERTER / 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n")  # fmt: skip
    converted = process.python(code)
    assert converted.returncode == 0, converted.stderr[-3000:]
    assert gguf.GGUFReader(tmp_path / "m.gguf").fields["general.architecture"].contents() == arch
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t[i : i + 1200], "domain": name}) + "\n"
                            for name, t in zip(("readme", "docs", "code"), texts, strict=True)
                            for i in range(0, 12000, 1200)))  # fmt: skip
    proc = cli("analyze", "--hf", hf, "--data", data, "--out", tmp_path / "a", "--max-tokens", "3000", "--seq-len",
               "256", "--no-init-baseline", "--compare", tmp_path / "m.gguf")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    c = json.loads((tmp_path / "a" / "metrics.json").read_text())["comparisons"][str(tmp_path / "m.gguf")]
    assert set(c["layers"]) == {"0", "1"}
    for m in c["layers"].values():
        assert m["flips"] == 0 and m["order_differs"] == 0 and m["weights"]["max"] < 1e-3  # the trace keeps float16
    assert c["logprob"]["all"]["tokens"] > 2900 and c["logprob"]["all"]["max_abs"] < 1e-4


def test_one_llama_cpp_python_version_everywhere():
    """pyproject's llama extra, the Makefile's converter source and the installed build name one version."""
    import llama_cpp

    pinned = Path("pyproject.toml").read_text().split('"llama-cpp-python==', 1)[1].split('"', 1)[0]
    unpacked = Path("Makefile").read_text().split("LLAMA_CPP_PYTHON ?= ", 1)[1].split("\n", 1)[0]
    assert pinned == unpacked == llama_cpp.__version__ and pinned in str(CONVERTER)
