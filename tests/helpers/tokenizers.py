"""Tokenizers and data prepared with them, for the tokenizer and evaluation tests."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moe_lm.config import DataConfig
from moe_lm.data.prepare import prepare_data
from tests.helpers.runs import WORDS, write_folder_corpus

TEXT = [" ".join(words) for words in WORDS.values()] * 40 + ["def f(x):\n\treturn  x + 1\n"] * 40


def bpe_json(folder: Path, specials: list[str], vocab: int = 280) -> Path:
    """A byte-level BPE tokenizer.json trained with `tokenizers` (GPT-2 style)."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXT, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def prepare_with(tmp_path, tokenizer: str, vocab_size: int = 300) -> Path:
    corpus = write_folder_corpus(tmp_path / "corpus", n_docs=6)
    cfg = DataConfig(sources=[str(corpus)], out_dir=str(tmp_path / "data"), val_fraction=0.2, tokenizer=tokenizer)
    return prepare_data(cfg, vocab_size=vocab_size, log=lambda s: None)
