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

import functools
import hashlib
import json
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import sentencepiece as spm

from moe_lm.errors import REMOTE_CODE_OFF, DataError, install_hint, remote_code_refused

SPM_FILE = "tokenizer.model"
HF_FOLDER = "tokenizer"
CONVENTIONAL_SPECIALS = {
    "bos_token": ("<s>", "<|begin_of_text|>", "<bos>"),
    "eos_token": ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>"),
}
# The sentencepiece trainer skips every line longer than this (in UTF-8 bytes) and every line holding U+2585 (its
# placeholder for rare characters), and trains on a random INPUT_SENTENCE_SIZE of the lines when there are more.
MAX_SENTENCE_BYTES = 16384
INPUT_SENTENCE_SIZE = 2_000_000
RESERVED = "\u2585".encode()
# Characters of a long text that one sentencepiece encode call gets at most (plus a word): given a whole text, its
# working memory is ~50x the text (a 21 MB document: +978 MiB; docs/data.md, long documents).
ENCODE_CHUNK_CHARS = 1 << 16
# Where encode_chunks cuts: a space after a character that is not whitespace to sentencepiece, with text after it.
_CUT = re.compile("(?<=[^ \u2581]) (?=.)", re.S)


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

    def encode_chunks(self, text: str) -> Iterator[list[int]]:
        """`encode(text)` in consecutive parts, so that a long document need not be encoded at once; here one part.
        Why a Hugging Face tokenizer keeps it so: its normalizer, pre-tokenizer and added tokens differ from one
        tokenizer to the next (a Prepend("▁") normalizer acts once per call, pre-tokenizer regexes and Metaspace
        schemes vary, a converted sentencepiece model has no pre-tokenizer), so no one cut gives them all the ids
        of the whole text."""
        yield self.encode(text)

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def id_to_piece(self, i: int) -> str:
        raise NotImplementedError

    def piece_to_id(self, piece: str) -> int | None:
        """The id of an exact vocabulary piece, or None."""
        raise NotImplementedError

    def token_bytes(self, i: int) -> bytes:
        """What id `i` stands for, comparable across tokenizer kinds: the bytes it adds to running text (its leading
        space included, a byte token its byte), or for a control or unknown token SPECIAL + its name. Two subjects
        route "the same token ids" only where these agree."""
        raise NotImplementedError


SPECIAL = b"\xff"  # never in UTF-8 text: marks a control token's name in `token_bytes`
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def metaspace_bytes(piece: str) -> bytes:
    """A sentencepiece-style piece's bytes: a byte-fallback piece <0xNN> its byte, else ▁ as a space."""
    byte = _BYTE_PIECE.fullmatch(piece)
    return bytes([int(byte[1], 16)]) if byte else piece.replace("\u2581", " ").encode("utf-8")


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, path: Path) -> None:
        self.sp = spm.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None

    @functools.cached_property
    def cuts_exactly(self) -> bool:
        # why on first use: it reads every piece (~8 ms per 4096), which only long documents need
        return _cuts_exactly(self.sp)

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_chunks(self, text: str) -> Iterator[list[int]]:
        """`encode(text)` in parts of about ENCODE_CHUNK_CHARS characters with exactly the ids of the whole text,
        for a model `_cuts_exactly` accepts (the BPE models trained here); any other model gets one part.

        Why the same ids: a part ends before a space that follows a non-space, and the next part starts after that
        space. Without character normalization and with spaces kept, the whole text normalizes to "▁A▁B" (each
        space a ▁, the dummy prefix one more in front) and the parts to "▁A" and "▁B": the next part's dummy prefix
        is the space's ▁. BPE then merges neighbours only into vocabulary pieces, best score first and ties to the
        left; no piece holds a ▁ right after another character, so no merge crosses the cut and each part merges
        as it does in place (byte fallback is per piece too). Not for unigram models: their Viterbi sums a float32
        path score along the text, so equally scored segmentations (f|ff, ff|f) are told apart by rounding, which
        the score before a cut changes (measured: 13 of the 93 chunks of a 6 MB text got other ids)."""
        start = 0
        while len(text) - start > ENCODE_CHUNK_CHARS and self.cuts_exactly:
            cut = _CUT.search(text, start + ENCODE_CHUNK_CHARS)
            if cut is None:  # no space further on: the rest is one part
                break
            yield self.sp.encode(text[start : cut.start()])
            start = cut.end()
        yield self.sp.encode(text[start:])

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(list(ids))

    def id_to_piece(self, i: int) -> str:
        return self.sp.id_to_piece(int(i))

    def piece_to_id(self, piece: str) -> int | None:
        i = self.sp.piece_to_id(piece)
        return i if self.sp.id_to_piece(i) == piece else None

    def token_bytes(self, i: int) -> bytes:
        piece = self.sp.id_to_piece(int(i))
        if self.sp.is_control(int(i)) or self.sp.is_unknown(int(i)):
            return SPECIAL + piece.encode("utf-8")
        return metaspace_bytes(piece)


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

    def token_bytes(self, i: int) -> bytes:
        piece = self.tok.convert_ids_to_tokens(int(i))
        if piece is None or int(i) in self._special_ids:
            return SPECIAL + str(piece).encode("utf-8")
        if self._byte_level:
            return bytes(_GPT2_BYTES.get(c, 0) for c in piece)
        return metaspace_bytes(piece)

    @functools.cached_property
    def _special_ids(self) -> set[int]:
        return set(self.tok.all_special_ids)

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether the tokenizer's pieces are GPT-2 byte-level characters (its decoder says so)."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
        kinds = [d.get("type") for d in (decoder or {}).get("decoders", [decoder or {}])]
        return "ByteLevel" in kinds


def _gpt2_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte (its `bytes_to_unicode`)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


_GPT2_BYTES = _gpt2_bytes()


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
    except DataError:
        raise
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
        try:
            return transformers.AutoTokenizer.from_pretrained(str(src), trust_remote_code=False)
        except ValueError as e:
            if remote_code_refused(e):
                raise DataError(
                    f"the tokenizer in {src} {REMOTE_CODE_OFF}: give a tokenizer class transformers has built in, "
                    "its tokenizer.json, or a sentencepiece .model"
                ) from None
            raise
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(src))
    # A bare tokenizer.json names no BOS/EOS: take the conventional ones among its special tokens.
    specials = {t.content for t in tok.backend_tokenizer.get_added_tokens_decoder().values() if t.special}
    for attr, names in CONVENTIONAL_SPECIALS.items():
        found = next((n for n in names if n in specials), None)
        if found is not None:
            setattr(tok, attr, found)
    return tok


def write_training_text(texts: Iterable[str], path: Path) -> str:
    """Write the training documents to `path` as lines the sentencepiece trainer reads whole; returns a line for the
    log saying how much of them it will see.

    A line longer than MAX_SENTENCE_BYTES, which the trainer would skip (a single-line document of a JSONL or parquet
    corpus, say), is cut into pieces that fit: at its last space that fits, the space left out (the trainer's dummy
    prefix puts back the ▁ it stands for, as encoding sees that word in place), else at the last character boundary
    that fits. A U+2585 ends a line instead of losing the trainer its whole line. Blank lines, which it skips, are
    left out."""
    total = reserved = lines = long_lines = 0
    with open(path, "wb") as f:
        for text in texts:
            data = text.encode("utf-8")
            total += len(data)
            reserved += data.count(RESERVED)
            data = data.replace(RESERVED, b"\n")
            start = 0
            while start < len(data):
                end = data.find(b"\n", start)
                end = len(data) if end < 0 else end
                long_lines += end - start > MAX_SENTENCE_BYTES
                while end - start > MAX_SENTENCE_BYTES:
                    cut = data.rfind(b" ", start + 1, start + MAX_SENTENCE_BYTES + 1)
                    skip = 1
                    if cut < 0:
                        cut, skip = start + MAX_SENTENCE_BYTES, 0
                        while data[cut] & 0xC0 == 0x80:  # a UTF-8 continuation byte: inside a character
                            cut -= 1
                    f.write(data[start:cut] + b"\n")
                    lines += 1
                    start = cut + skip
                if end > start:
                    f.write(data[start:end] + b"\n")
                    lines += 1
                start = end + 1
    seen = total - reserved * len(RESERVED)
    say = f"tokenizer training text: {seen:,} of the training split's {total:,} bytes in {lines:,} lines"
    if long_lines:
        say += f" (lines over sentencepiece's {MAX_SENTENCE_BYTES:,}-byte limit, cut to fit: {long_lines:,})"
    if reserved:
        say += f"; U+2585 characters left out (sentencepiece reserves it): {reserved:,}"
    if lines > INPUT_SENTENCE_SIZE:
        say += (
            f"; sentencepiece trains on a random {INPUT_SENTENCE_SIZE:,} of the lines, about "
            f"{seen * INPUT_SENTENCE_SIZE // lines:,} bytes"
        )
    return say


def train_tokenizer(text_file: Path, model_prefix: Path, vocab_size: int, model_type: str, seed: int = 0) -> Path:
    """Train on a file of training text (one sentence per line, as write_training_text writes it); returns the
    .model path."""
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
            max_sentence_length=MAX_SENTENCE_BYTES,
            input_sentence_size=INPUT_SENTENCE_SIZE,
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


def _cuts_exactly(sp: spm.SentencePieceProcessor) -> bool:
    """Whether SentencePieceTokenizer.encode_chunks may cut long texts (the argument is in its docstring): a BPE
    model with whitespace as a piece prefix, no character normalization, a dummy prefix and spaces kept as ▁; no
    piece holding a space or a ▁ after another character; and ▁ a piece (an unknown one would fuse with an unknown
    character before it). The settings are read from the model file itself: sentencepiece does not require the
    protobuf package that its own reader needs."""
    model = _proto_fields(sp.serialized_model_proto())
    trainer, norm = _proto_fields(model.get(2, b"")), _proto_fields(model.get(3, b""))
    if trainer.get(3, 1) != 2 or trainer.get(24, 0):  # model_type (BPE = 2), treat_whitespace_as_suffix
        return False
    # precompiled_charsmap (none: identity), add_dummy_prefix, remove_extra_whitespaces, escape_whitespaces
    if norm.get(2) or not norm.get(3, 1) or norm.get(4, 1) or not norm.get(5, 1):
        return False
    pieces = sp.id_to_piece(list(range(sp.get_piece_size())))
    return sp.piece_to_id("▁") != sp.unk_id() and not any(" " in p or re.search("[^▁]▁", p) for p in pieces)


def _proto_fields(message: bytes) -> dict[int, int | bytes]:
    """The fields of a serialized protobuf message by number (the last value of a repeated one): varints as ints,
    anything else as its bytes."""
    fields, i = {}, 0
    while i < len(message):
        key, i = _varint(message, i)
        if key & 7 == 0:
            fields[key >> 3], i = _varint(message, i)
            continue
        if key & 7 == 2:  # length-delimited: bytes, strings, messages
            n, i = _varint(message, i)
        else:  # 64- or 32-bit (wire types 1 and 5); groups (3, 4) are not in sentencepiece's model
            n = 8 if key & 7 == 1 else 4
        fields[key >> 3], i = message[i : i + n], i + n
    return fields


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        value |= (data[i] & 0x7F) << shift
        shift += 7
        i += 1
        if data[i - 1] < 0x80:
            return value, i
