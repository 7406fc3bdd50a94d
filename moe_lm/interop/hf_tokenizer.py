"""A sentencepiece model as a Hugging Face fast tokenizer, so that an export loads with `AutoTokenizer`.

The conversion rebuilds sentencepiece's pipeline in `tokenizers` terms: the model (BPE with merges ordered by piece
score, or Unigram with its scores; byte fallback as the model has it), the normalizer (its precompiled character
map if any, the dummy-prefix "▁", spaces as "▁"), and the decoder (▁ -> space, bytes fused back, the dummy
prefix's space stripped). User-defined pieces such as "\\n" stay plain vocabulary pieces: sentencepiece never merges
them, and no merge in the vocabulary contains them, so BPE leaves them alone too. A sentencepiece setting it does
not rebuild (whitespace folding) is an error, and the caller checks the result on real text (`matches`).

Every exported tokenizer, converted or the run's own Hugging Face one, adds the token that begins every training
document (BOS, else EOS: `Tokenizer.doc_start_id`) when called with special tokens, as `transformers`, `pipeline()`
and lm-eval call it: `AutoTokenizer.from_pretrained(export)(text).input_ids == [doc_start_id, *encode(text)]`,
checked on the written folder.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from moe_lm.data.prepare import load_split
from moe_lm.data.tokenizer import SPM_FILE, HFTokenizer, load_data_tokenizer

# Beside the corpus' own documents, the conversion is checked on what trips tokenizers up.
PROBES = ["  two leading spaces", "tabs\tand\n\nnewlines\n", "digits 1234567890", "unicode é ü 漢字 🙂", " ", "\n", ""]


def export_tokenizer(data_dir: str | Path, out: Path, max_len: int | None = None) -> str:
    """Write a data folder's tokenizer beside an HF model export so that `AutoTokenizer.from_pretrained(out)` loads
    it and gives the ids training fed the model; returns what was written. A sentencepiece model is converted (and
    kept as tokenizer.model too); the converted tokenizer is written only if it gives the same ids on the
    validation documents and `PROBES`. `max_len` (the model's context) becomes `model_max_length`."""
    tok = load_data_tokenizer(data_dir)
    val = load_split(data_dir, "val")
    texts = [tok.decode(np.asarray(val.document(d))[1:].tolist()) for d in range(min(val.n_docs, 50))] + PROBES
    if isinstance(tok, HFTokenizer):
        hf, what = tok.tok, "the Hugging Face tokenizer"
    else:
        shutil.copyfile(Path(data_dir) / SPM_FILE, out / SPM_FILE)
        try:
            hf = spm_to_hf(Path(data_dir) / SPM_FILE)
        except ValueError as e:
            return f"{SPM_FILE} only (no Hugging Face conversion: {e})"
        differs = matches(hf, tok.encode, texts)
        if differs is not None:
            return f"{SPM_FILE} only (the Hugging Face conversion gives other ids on {differs[:40]!r})"
        what = f"{SPM_FILE} and its Hugging Face conversion (same ids on {len(texts)} texts)"
    start_documents_with(hf, tok.doc_start_id)
    if max_len is not None:
        hf.model_max_length = max_len
    hf.save_pretrained(out)
    differs = starts_documents(out, tok, texts)
    if differs is not None:
        return f"{what}; warning: AutoTokenizer does not give [{tok.doc_start_id}] + the training ids on {differs!r}"
    return f"{what}, adding {hf.bos_token!r} (id {tok.doc_start_id}) first as training did"


def start_documents_with(hf_tokenizer, start_id: int) -> None:
    """Make a fast tokenizer add `start_id` before the text when called with special tokens (pairs: before each)."""
    from tokenizers import processors

    start = hf_tokenizer.convert_ids_to_tokens(start_id)
    # why a template on the backend: it is saved in tokenizer.json, so every loader of the folder applies it
    hf_tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{start} $A", pair=f"{start} $A {start} $B:1", special_tokens=[(start, start_id)]
    )
    if hf_tokenizer.bos_token_id != start_id:
        hf_tokenizer.bos_token = start  # GPT-2 style: EOS begins documents, as BOS would


def starts_documents(folder: Path, tok, texts: list[str]) -> str | None:
    """The first text on which the folder's AutoTokenizer does not give [doc_start_id] + the training ids, or None."""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    for text in texts:
        if auto(text, verbose=False).input_ids != [tok.doc_start_id, *tok.encode(text)]:  # longer than a window: fine
            return text[:40]
    return None


def spm_to_hf(model_file: str | Path):
    """A `transformers.PreTrainedTokenizerFast` that tokenizes exactly as the sentencepiece model."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE, Unigram
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import generate_merges

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(model_file).read_bytes())
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    if norm.remove_extra_whitespaces:
        raise ValueError("its normalizer folds whitespace (remove_extra_whitespaces), which is not rebuilt here")
    pieces = [(p.piece, p.score) for p in proto.pieces]
    if spec.model_type == spec.BPE:
        vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
        merges = generate_merges(vocab, dict(pieces))  # why by score: sentencepiece merges the best-scored pair first
        model = BPE(
            vocab=vocab, merges=merges, unk_token=spec.unk_piece, fuse_unk=True, byte_fallback=spec.byte_fallback
        )
    elif spec.model_type == spec.UNIGRAM:
        model = Unigram(pieces, unk_id=spec.unk_id, byte_fallback=spec.byte_fallback)
    else:
        raise ValueError(f"sentencepiece model type {spec.model_type} is not BPE or Unigram")
    tok = Tokenizer(model)
    steps = [normalizers.Precompiled(norm.precompiled_charsmap)] if norm.precompiled_charsmap else []
    steps += [normalizers.Prepend("▁")] if norm.add_dummy_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tok.add_special_tokens([AddedToken(p.piece, special=True) for p in proto.pieces if p.type == p.CONTROL])
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(decode + ([decoders.Strip(content=" ", left=1)] if norm.add_dummy_prefix else []))
    sp = spm.SentencePieceProcessor(model_file=str(model_file))

    def piece(i: int) -> str | None:
        return sp.id_to_piece(i) if i >= 0 else None

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=piece(sp.bos_id()), eos_token=piece(sp.eos_id()), unk_token=piece(sp.unk_id())
    )


def matches(hf_tokenizer, encode, texts: list[str]) -> str | None:
    """The first text on which the converted tokenizer's ids differ from `encode`'s, or None."""
    for text in texts:
        if hf_tokenizer.encode(text, add_special_tokens=False, verbose=False) != encode(text):
            return text
    return None
