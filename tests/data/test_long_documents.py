"""Long single-line documents (issue 37): the tokenizer is trained on them, and they are encoded in bounded chunks
with exactly the ids of encoding them whole."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import sentencepiece as spm

from moe_lm.config import DataConfig
from moe_lm.data import tokenizer as tokenizer_module
from moe_lm.data.prepare import load_split, prepare_data
from moe_lm.data.tokenizer import (
    ENCODE_CHUNK_CHARS,
    MAX_SENTENCE_BYTES,
    SentencePieceTokenizer,
    load_data_tokenizer,
    train_tokenizer,
    write_training_text,
)
from tests.helpers.runs import WORDS, make_text, write_folder_corpus
from tests.helpers.tokenizers import TEXT

GREEK = (
    "ο ήλιος λάμπει πάνω από τη γαλάζια θάλασσα και τα παιδιά παίζουν στην αμμουδιά ενώ οι ψαράδες γυρίζουν με τα "
    "δίχτυα γεμάτα ψάρια"
).split()
IS_GREEK = re.compile("[\u0370-\u03ff\u1f00-\u1fff]")


def greek_words(seed: int, n_words: int) -> list[str]:
    return list(np.random.default_rng(seed).choice(GREEK, n_words))


def greek_corpus(root, lines_of: int | None):
    """The tiny three-domain corpus plus a Greek domain of 4 documents of ~19 KB each: one line each
    (`lines_of=None`), or the same words in lines of `lines_of` words."""
    write_folder_corpus(root, n_docs=6)
    (root / "greek").mkdir()
    for i in range(4):
        words = greek_words(i, 1900)
        step = lines_of or len(words)
        lines = [" ".join(words[j : j + step]) for j in range(0, len(words), step)]
        (root / "greek" / f"doc{i}.txt").write_text("\n".join(lines))
    return root


def test_single_line_documents_longer_than_the_trainers_limit_train_the_tokenizer(tmp_path):
    """sentencepiece skips a training line over 16,384 bytes: a domain of single-line documents used to give the
    tokenizer no piece of its script (Greek encoded as bytes, ~1.0 token per byte). Now it learns them as it does
    from the same text in short lines, and the log says it saw the whole training split."""
    results = {}
    for lines_of in (None, 20):
        name = "one_line" if lines_of is None else "short_lines"
        corpus = greek_corpus(tmp_path / name, lines_of)
        logged = []
        cfg = DataConfig(sources=[str(corpus)], out_dir=str(tmp_path / f"data_{name}"), val_fraction=0.2)
        out = prepare_data(cfg, vocab_size=400, log=logged.append)
        tok = load_data_tokenizer(out)
        pieces = [tok.id_to_piece(i) for i in range(tok.vocab_size)]
        held_out = " ".join(greek_words(99, 2000))
        results[name] = {
            "greek_pieces": sum(1 for p in pieces if IS_GREEK.search(p)),
            "tokens_per_byte": len(tok.encode(held_out)) / len(held_out.encode()),
            "log": [line for line in logged if line.startswith("tokenizer training text")],
        }
    assert len((tmp_path / "one_line" / "greek" / "doc0.txt").read_bytes()) > MAX_SENTENCE_BYTES
    one, ref = results["one_line"], results["short_lines"]
    assert ref["greek_pieces"] >= 20 and ref["tokens_per_byte"] < 0.6  # the reference: Greek learned
    assert one["greek_pieces"] >= 0.8 * ref["greek_pieces"]
    assert one["tokens_per_byte"] < 0.6 and one["tokens_per_byte"] <= 1.1 * ref["tokens_per_byte"]
    (say,) = one["log"]
    seen, total = re.search(r"([\d,]+) of the training split's ([\d,]+) bytes", say).groups()
    assert seen == total and "limit, cut to fit: 3)" in say


def test_training_text_fits_the_trainer_whole_characters_and_every_byte(tmp_path):
    """Each line at most MAX_SENTENCE_BYTES, cut at a space (which the dummy prefix stands for) or else between
    characters, never inside one; nothing but U+2585 (which the trainer reserves) left out, and that said."""

    def lines_of(*texts):
        say = write_training_text(texts, tmp_path / "train.txt")
        lines = (tmp_path / "train.txt").read_bytes().split(b"\n")[:-1]
        assert all(0 < len(line) <= MAX_SENTENCE_BYTES for line in lines)
        return [line.decode("utf-8") for line in lines], say  # decodes: every cut is between characters

    spaced = " ".join(greek_words(1, 6000))  # ~66 KB of 2-byte characters
    lines, say = lines_of(spaced)
    assert " ".join(lines) == spaced and len(lines) == 4  # cut at spaces, each left out once
    total = len(spaced.encode())
    assert say == (
        f"tokenizer training text: {total:,} of the training split's {total:,} bytes in 4 lines "
        "(lines over sentencepiece's 16,384-byte limit, cut to fit: 1)"
    )
    unspaced = "".join(greek_words(2, 3000)) + "😀" * 5000  # no space: 2- and 4-byte characters
    lines, _ = lines_of(unspaced)
    assert "".join(lines) == unspaced and len(lines) == 3
    lines, say = lines_of("alpha\u2585beta\n\n gamma", "delta\n")
    assert lines == ["alpha", "beta", " gamma", "delta"]  # U+2585 ends a line; blank lines (skipped) dropped
    assert say.endswith(
        "of the training split's 26 bytes in 4 lines; U+2585 characters left out (sentencepiece reserves it): 1"
    )
    assert "23 of the" in say


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory):
    """A BPE tokenizer trained as preparation trains one, on English, code, Greek and other scripts."""
    folder = tmp_path_factory.mktemp("bpe")
    other = ["ναι  όχι\tπάλι", "中文没有空格的句子", "café naïve  déjà", "x = [1,  2]  # ok", "emoji 😀 ▁ literal"]
    write_training_text(TEXT + [" ".join(greek_words(i, 200)) for i in range(10)] + other * 20, folder / "t.txt")
    return train_tokenizer(folder / "t.txt", folder / "tok", 500, "bpe")


def fuzz_documents(n: int) -> list[str]:
    """Documents of spaces (single, runs, leading, trailing), newlines, tabs, literal ▁, no spaces, non-ASCII."""
    rng = np.random.default_rng(0)
    atoms = [" ", " ", "  ", "   ", "\n", "\t", "▁", "the", "galaxy", "x+1", "12345", "é", "αβγ", "ήλιος", "中文", "😀"]
    docs = ["", " ", "a", " a", "a ", "a  b", " a \n b ", "▁ ▁a", "a▁ b", "ab" * 50, "中文" * 40, "\n \n  \n"]
    return docs + ["".join(rng.choice(atoms, rng.integers(1, 400))) for _ in range(n)]


def test_chunked_encoding_gives_exactly_the_ids_of_the_whole_document(bpe_model, monkeypatch):
    """With chunks of a few characters (over 10,000 parts in all), the ids are those of encoding the whole text."""
    tok = SentencePieceTokenizer(bpe_model)
    assert tok.cuts_exactly
    parts_seen = 0
    for chunk in (1, 3, 8, 40):
        monkeypatch.setattr(tokenizer_module, "ENCODE_CHUNK_CHARS", chunk)
        for doc in fuzz_documents(150):
            parts = list(tok.encode_chunks(doc))
            assert [i for part in parts for i in part] == tok.sp.encode(doc), (chunk, doc)
            parts_seen += len(parts)
    assert parts_seen > 10_000  # the cuts were made


def test_models_the_argument_does_not_cover_encode_whole_documents(bpe_model, tmp_path, monkeypatch):
    """A unigram model (float32 ties) and sentencepiece's defaults (NFKC, whitespace folded) are not cut."""
    (tmp_path / "t.txt").write_text("\n".join(TEXT))
    unigram = train_tokenizer(tmp_path / "t.txt", tmp_path / "uni", 300, "unigram")
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "t.txt"), model_prefix=str(tmp_path / "nfkc"), vocab_size=60, minloglevel=2
    )
    monkeypatch.setattr(tokenizer_module, "ENCODE_CHUNK_CHARS", 4)
    for model in (unigram, tmp_path / "nfkc.model"):
        tok = SentencePieceTokenizer(model)
        assert not tok.cuts_exactly
        assert list(tok.encode_chunks("the bond yield rose")) == [tok.sp.encode("the bond yield rose")]


def test_a_long_document_is_never_given_to_sentencepiece_whole(bpe_model, tmp_path, monkeypatch):
    """Preparation encodes a 230 KB single-line document a chunk at a time (sentencepiece's working memory is ~50x
    what it is given), and the shard holds exactly the ids of the whole document."""
    corpus = write_folder_corpus(tmp_path / "corpus", n_docs=2)
    long_text = make_text("astronomy", 7, n_words=36_000).replace("\n", " ")
    (corpus / "astronomy" / "long.txt").write_text(long_text)
    longest, encode = [0], spm.SentencePieceProcessor.encode

    def spy(self, text, *args, **kwargs):
        longest[0] = max(longest[0], len(text))
        return encode(self, text, *args, **kwargs)

    monkeypatch.setattr(spm.SentencePieceProcessor, "encode", spy)
    cfg = DataConfig(sources=[str(corpus)], out_dir=str(tmp_path / "data"), tokenizer=str(bpe_model))
    out = prepare_data(cfg, vocab_size=500, log=lambda s: None)
    assert len(long_text) > 3 * ENCODE_CHUNK_CHARS
    assert longest[0] <= ENCODE_CHUNK_CHARS + max(map(len, WORDS["astronomy"]))
    tok = load_data_tokenizer(out)
    found = 0
    for split in ("train", "val"):
        shard = load_split(out, split)
        for d, name in enumerate(shard.doc_names()):
            if name.endswith("long.txt"):
                assert np.asarray(shard.document(d)).tolist() == [tok.doc_start_id, *encode(tok.sp, long_text)]
                found += 1
    assert found == 1
    assert json.loads((out / "meta.json").read_text())["tokenizer"]["kind"] == "sentencepiece"
