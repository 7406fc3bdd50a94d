"""Tokenizers: one that preparation trains (sentencepiece), or one the user must keep (a sentencepiece `.model`,
a Hugging Face `tokenizer.json`, or a folder `transformers.AutoTokenizer` loads), behind one small interface.

The data folder holds the tokenizer it was tokenized with, so that training, resume, generation, export and
analytics all use the same one:
    tokenizer.model    a sentencepiece model (trained here, or the user's, copied)
    tokenizer/         a Hugging Face tokenizer, as `save_pretrained` writes it
meta.json records which kind, its hash, its vocabulary size, and the ids of its BOS/EOS tokens.

Every document in the shards starts with the tokenizer's BOS token, or, for tokenizers without one (GPT-2 style),
its EOS token, which then separates documents.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import sentencepiece as spm

from moe_lm.data.documents import DataError
from moe_lm.errors import install_hint

SPM_FILE = "tokenizer.model"
HF_FOLDER = "tokenizer"
CONVENTIONAL_SPECIALS = {
    "bos_token": ("<s>", "<|begin_of_text|>", "<bos>"),
    "eos_token": ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>"),
}


class Tokenizer:
    """encode/decode plus the pieces analytics show. `doc_start_id` begins every document (BOS, else EOS)."""

    kind: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    @property
    def doc_start_id(self) -> int:
        start = self.bos_id if self.bos_id is not None else self.eos_id
        if start is None:
            raise DataError("the tokenizer defines neither a BOS nor an EOS token; documents need one to begin with")
        return start

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def id_to_piece(self, i: int) -> str:
        raise NotImplementedError

    def piece_to_id(self, piece: str) -> int | None:
        """The id of an exact vocabulary piece, or None."""
        raise NotImplementedError


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, path: Path) -> None:
        self.sp = spm.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(list(ids))

    def id_to_piece(self, i: int) -> str:
        return self.sp.id_to_piece(int(i))

    def piece_to_id(self, piece: str) -> int | None:
        i = self.sp.piece_to_id(piece)
        return i if self.sp.id_to_piece(i) == piece else None


class HFTokenizer(Tokenizer):
    kind = "hf"

    def __init__(self, folder: Path) -> None:
        self.tok = _auto_tokenizer(folder)
        self.vocab_size = len(self.tok)
        self.bos_id = self.tok.bos_token_id
        self.eos_id = self.tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        # why no special tokens: documents get exactly one start token, added by the caller
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids))

    def id_to_piece(self, i: int) -> str:
        return self.tok.convert_ids_to_tokens(int(i))

    def piece_to_id(self, piece: str) -> int | None:
        return self.tok.get_vocab().get(piece)


def load_data_tokenizer(data_dir: str | Path) -> Tokenizer:
    """The tokenizer a prepared data folder was tokenized with."""
    data_dir = Path(data_dir)
    redo = (
        "restore it from a copy (an export of a run on this data holds one) or prepare the data again with "
        "moe-lm prepare --config CONFIG --force"
    )
    if (data_dir / HF_FOLDER).is_dir():
        try:
            return HFTokenizer(data_dir / HF_FOLDER)
        except Exception as e:  # transformers raises several types for a damaged folder
            raise DataError(f"{data_dir / HF_FOLDER} does not load as a tokenizer ({type(e).__name__}); {redo}") from e
    if (data_dir / SPM_FILE).is_file():
        try:
            return SentencePieceTokenizer(data_dir / SPM_FILE)
        except (RuntimeError, OSError) as e:
            raise DataError(f"{data_dir / SPM_FILE} is not a readable sentencepiece model ({e}); {redo}") from e
    raise DataError(f"no tokenizer in {data_dir} (run `moe-lm prepare` first)")


def data_tokenizer_sha256(data_dir: str | Path) -> str | None:
    """A hash of the data folder's tokenizer files (None without one): checkpoints record it."""
    data_dir = Path(data_dir)
    files = sorted((data_dir / HF_FOLDER).glob("*")) if (data_dir / HF_FOLDER).is_dir() else [data_dir / SPM_FILE]
    files = [f for f in files if f.is_file()]
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def import_tokenizer(spec: str, dest: Path) -> Tokenizer:
    """Copy the user's tokenizer into the data folder being built at `dest`: a sentencepiece `.model`, a
    `tokenizer.json`, or a folder AutoTokenizer loads. Errors name the path and what is accepted."""
    src = Path(spec)
    if not src.exists():
        raise DataError(
            f"data.tokenizer={spec}: not found (give 'train', a sentencepiece .model, a tokenizer.json, or a folder "
            "transformers.AutoTokenizer loads)"
        )
    if src.is_file() and src.suffix == ".model":
        try:
            tok = SentencePieceTokenizer(src)
        except (RuntimeError, OSError) as e:
            raise DataError(f"data.tokenizer={spec}: not a sentencepiece model ({e})") from None
        shutil.copyfile(src, dest / SPM_FILE)
        return tok
    if src.is_file() and src.suffix != ".json":
        raise DataError(f"data.tokenizer={spec}: expected a sentencepiece .model or a tokenizer.json file")
    try:
        tok = _auto_tokenizer(src)
    except Exception as e:  # transformers raises several types for a folder it cannot read
        raise DataError(f"data.tokenizer={spec}: transformers cannot load it as a tokenizer ({e})") from None
    tok.save_pretrained(dest / HF_FOLDER)
    return HFTokenizer(dest / HF_FOLDER)


def _auto_tokenizer(src: Path):
    """A `transformers` tokenizer from a folder, or from a bare tokenizer.json (its special tokens inferred)."""
    try:
        import transformers
    except ImportError as e:
        raise DataError(f"Hugging Face tokenizers need transformers: {install_hint('hf')}") from e
    if src.is_dir():
        return transformers.AutoTokenizer.from_pretrained(str(src))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(src))
    # A bare tokenizer.json names no BOS/EOS: take the conventional ones among its special tokens.
    specials = {t.content for t in tok.backend_tokenizer.get_added_tokens_decoder().values() if t.special}
    for attr, names in CONVENTIONAL_SPECIALS.items():
        found = next((n for n in names if n in specials), None)
        if found is not None:
            setattr(tok, attr, found)
    return tok


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
