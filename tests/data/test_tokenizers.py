"""Existing tokenizers: a sentencepiece .model, a Hugging Face tokenizer.json or tokenizer folder, kept as they are."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import transformers

from moe_lm.config import DataConfig
from moe_lm.data.prepare import load_split, prepare_data
from moe_lm.data.tokenizer import load_data_tokenizer
from moe_lm.errors import DataError
from moe_lm.interop.hf_tokenizer import export_tokenizer
from tests.helpers.hf import answer_yes_if_asked, remote_code_folder
from tests.helpers.runs import write_folder_corpus
from tests.helpers.tokenizers import TEXT, bpe_json, prepare_with


def spm_model(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "text.txt").write_text("\n".join(TEXT))
    spm.SentencePieceTrainer.train(
        input=str(folder / "text.txt"), model_prefix=str(folder / "m"), vocab_size=60, minloglevel=2
    )
    return folder / "m.model"


def assert_documents_round_trip(out: Path, start_id: int, lossless: bool = True) -> None:
    """Every shard document is the start token plus exactly the tokenizer's encoding of its source file (which
    decodes back to the file when the tokenizer is lossless)."""
    tok = load_data_tokenizer(out)
    (source_folder,) = json.loads((out / "meta.json").read_text())["signature"]["sources"]
    n = 0
    for split in ("train", "val"):
        shard = load_split(out, split)
        for d, name in enumerate(shard.doc_names()):
            doc = np.asarray(shard.document(d)).tolist()
            source = (Path(source_folder).parent / name).read_text()  # a name is a path from the source's folder
            assert doc == [start_id, *tok.encode(source)]
            assert not lossless or tok.decode(doc[1:]) == source
            n += 1
    assert n == 18


def test_a_given_sentencepiece_model_is_kept(tmp_path):
    model = spm_model(tmp_path / "spm")
    out = prepare_with(tmp_path, str(model))
    assert (out / "tokenizer.model").read_bytes() == model.read_bytes()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == 60 and meta["tokenizer"]["kind"] == "sentencepiece"
    assert meta["bos_id"] == spm.SentencePieceProcessor(model_file=str(model)).bos_id()
    assert_documents_round_trip(out, meta["bos_id"], lossless=False)  # its NFKC folds newlines to spaces


def test_a_tokenizer_json_with_bos_starts_documents_with_it(tmp_path):
    path = bpe_json(tmp_path / "hf", ["<unk>", "<s>", "</s>"])
    out = prepare_with(tmp_path, str(path))
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == {"kind": "hf", "source": str(path), "bos_id": 1, "eos_id": 2}
    assert meta["bos_id"] == 1
    assert_documents_round_trip(out, 1)


def test_an_autotokenizer_folder_without_bos_separates_documents_with_eos(tmp_path):
    """GPT-2 style: only <|endoftext|>, which then begins every document."""
    path = bpe_json(tmp_path / "raw", ["<|endoftext|>"])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>")
    fast.save_pretrained(tmp_path / "gpt2ish")
    out = prepare_with(tmp_path, str(tmp_path / "gpt2ish"))
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"]["bos_id"] is None and meta["bos_id"] == meta["tokenizer"]["eos_id"] == 0
    assert_documents_round_trip(out, 0)


def test_tokenizer_errors_name_the_problem_and_the_fix(tmp_path):
    path = bpe_json(tmp_path / "hf", ["<unk>", "<s>", "</s>"])
    with pytest.raises(DataError, match=r"has 280 tokens but model.vocab_size=256: set model.vocab_size=280"):
        prepare_with(tmp_path / "a", str(path), vocab_size=256)
    with pytest.raises(DataError, match="neither a BOS nor an EOS"):
        prepare_with(tmp_path / "b", str(bpe_json(tmp_path / "plain", ["<unk>"])))
    with pytest.raises(DataError, match="data.tokenizer=.*nowhere.json: not found"):
        prepare_with(tmp_path / "c", str(tmp_path / "nowhere.json"))
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match="not a sentencepiece model"):
        prepare_with(tmp_path / "d", str(tmp_path / "junk.model"))
    assert not (tmp_path / "d" / "data").exists() and not (tmp_path / "d" / "data.partial").exists()


def test_export_writes_a_tokenizer_autotokenizer_loads(tmp_path):
    out = prepare_with(tmp_path, str(bpe_json(tmp_path / "hf", ["<unk>", "<s>", "</s>"])))
    (tmp_path / "export").mkdir()
    export_tokenizer(out, tmp_path / "export")
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    ours = load_data_tokenizer(out)
    for text in TEXT[:3] + ["unicode é 漢字 and  two spaces\n"]:
        assert auto.encode(text, add_special_tokens=False) == ours.encode(text)
        assert auto(text).input_ids == [ours.bos_id, *ours.encode(text)]  # as training and generate.py feed it
    assert auto.bos_token_id == ours.bos_id and auto.eos_token_id == ours.eos_id


def test_an_exported_gpt2_style_tokenizer_starts_prompts_with_eos_as_training_did(tmp_path):
    path = bpe_json(tmp_path / "hf", ["<|endoftext|>"])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>")
    fast.save_pretrained(tmp_path / "folder")
    out = prepare_with(tmp_path, str(tmp_path / "folder"))
    (tmp_path / "export").mkdir()
    said = export_tokenizer(out, tmp_path / "export", max_len=64)
    assert "adding '<|endoftext|>'" in said and "warning" not in said
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    ours = load_data_tokenizer(out)
    assert ours.bos_id is None
    for text in TEXT[:3] + ["def f(x):\n\treturn  x + 1\n"]:
        assert auto(text).input_ids == [ours.eos_id, *ours.encode(text)]
    assert auto.model_max_length == 64


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_a_trained_sentencepiece_tokenizer_exports_to_an_autotokenizer_with_the_same_ids(tmp_path, kind):
    corpus = write_folder_corpus(tmp_path / "corpus", n_docs=6)
    (corpus / "code").mkdir()
    for f in sorted(Path(json.__file__).parent.glob("*.py")):  # real source: indentation, quotes, unicode escapes
        (corpus / "code" / f"{f.stem}.txt").write_text(f.read_text())
    cfg = DataConfig(sources=[str(corpus)], out_dir=str(tmp_path / "data"), val_fraction=0.3, tokenizer_type=kind)
    out = prepare_data(cfg, vocab_size=400, log=lambda s: None)
    (tmp_path / "export").mkdir()
    said = export_tokenizer(out, tmp_path / "export")
    assert "Hugging Face conversion (same ids" in said
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    ours = load_data_tokenizer(out)
    texts = [Path(f).read_text() for f in sorted(Path(json.__file__).parent.glob("*.py"))]
    texts += ["  lead\n\n\ttab 12345 é 漢字 🙂 end  ", "\n", " "]
    for text in texts:
        ids = auto.encode(text, add_special_tokens=False)
        assert ids == ours.encode(text)
        assert auto.decode(ids) == ours.decode(ids) == text  # byte fallback and identity normalisation: lossless
        assert auto(text).input_ids == [ours.bos_id, *ids]  # BOS first, as every training document began
    assert (auto.bos_token_id, auto.eos_token_id) == (ours.bos_id, ours.eos_id)


def test_a_run_on_a_hugging_face_tokenizer_trains_generates_and_exports(tmp_path, train, cli):
    """The tokenizer travels with the run: training, generation and export all use the data folder's one."""
    from tests.helpers.runs import tiny_train_cfg

    corpus = write_folder_corpus(tmp_path / "corpus", n_docs=6)
    data = DataConfig(
        sources=[str(corpus)], out_dir=str(tmp_path / "data"), val_fraction=0.2,
        tokenizer=str(bpe_json(tmp_path / "hf", ["<unk>", "<s>", "</s>"])),
    )  # fmt: skip
    prepare_data(data, vocab_size=300, log=lambda s: None)
    train(tiny_train_cfg(data, tmp_path / "run", max_steps=2))  # model.vocab_size 300 > the tokenizer's 280

    def script(name, *args):
        proc = cli.script(name, *args)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    text = script("generate.py", "--run", str(tmp_path / "run"), "--prompt", "the bond", "--max-new-tokens", "8")
    assert text.startswith("the bond") and len(text) > len("the bond")
    script("export_hf.py", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "export"))
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    ours = load_data_tokenizer(data.out_dir)
    assert auto("the bond yield").input_ids == [ours.bos_id, *ours.encode("the bond yield")]
    generation = json.loads((tmp_path / "export" / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (ours.bos_id, ours.eos_id)


def test_a_tokenizer_folder_with_code_of_its_own_is_refused_and_its_code_never_runs(tmp_path, cli, monkeypatch):
    folder = remote_code_folder(tmp_path / "custom")
    asked = answer_yes_if_asked(monkeypatch)
    corpus = write_folder_corpus(tmp_path / "corpus", n_docs=4)
    proc = cli("prepare", "--config", "tiny", "model.vocab_size=300", f"data.sources=[{corpus}]",
               f"data.tokenizer={folder}", "--out", tmp_path / "data", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.splitlines()[-1]  # after the reading pass's progress bar, which a terminal erases
    assert "Traceback" not in proc.stderr
    assert line.startswith(f"error: the tokenizer in {folder} asks to run the folder's own Python code (auto_map)")
    assert "trust_remote_code is off" in line and "tokenizer.json" in line
    assert not asked and not (folder / "RAN").exists()
