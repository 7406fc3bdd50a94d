"""SentencePiece tokenizer: trained on the training split, saved with the data, pieces decodable for analytics."""

from __future__ import annotations

import re
from pathlib import Path

import sentencepiece as spm

from moe_lm.data.documents import DataError

BOS_ID = 1  # sentencepiece's default ids: unk 0, bos 1, eos 2


def train_tokenizer(text_file: Path, model_prefix: Path, vocab_size: int, model_type: str, seed: int = 0) -> Path:
    """Train on a file of training text (one sentence per line); returns the .model path."""
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            input=str(text_file),
            model_prefix=str(model_prefix),
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=True,  # any byte is representable: no <unk> in code or odd scripts
            character_coverage=0.9995,
            # why identity and no whitespace folding: code needs its exact spaces and characters back.
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            user_defined_symbols=["\n", "\t"],  # training reads lines, so newlines must be declared
            max_sentence_length=16384,
            input_sentence_size=2_000_000,
            shuffle_input_sentence=True,
            num_threads=2,
            minloglevel=2,
        )
    except RuntimeError as e:
        m = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", str(e))
        if m:
            raise DataError(
                f"model.vocab_size={m.group(1)} is larger than this corpus supports (at most {m.group(2)} pieces): "
                f"set model.vocab_size<={m.group(2)} or add more text"
            ) from None
        raise DataError(f"sentencepiece could not train a tokenizer on {text_file}: {e}") from e
    return model_prefix.with_suffix(".model")


def load_tokenizer(path: str | Path) -> spm.SentencePieceProcessor:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"tokenizer not found: {path} (run launch/prepare_data.py first)")
    return spm.SentencePieceProcessor(model_file=str(path))
