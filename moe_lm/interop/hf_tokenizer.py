"""A sentencepiece model as a Hugging Face fast tokenizer, so that an export loads with `AutoTokenizer`.

The conversion rebuilds sentencepiece's pipeline in `tokenizers` terms: the model (BPE with merges ordered by piece
score, or Unigram with its scores; byte fallback as the model has it), the normalizer (its precompiled character
map if any, the dummy-prefix "▁", spaces as "▁"), and the decoder (▁ -> space, bytes fused back, the dummy
prefix's space stripped). User-defined pieces such as "\\n" stay plain vocabulary pieces: sentencepiece never merges
them, and no merge in the vocabulary contains them, so BPE leaves them alone too. A sentencepiece setting it does
not rebuild (whitespace folding) is an error, and the caller checks the result on real text (`matches`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from moe_lm.data.prepare import load_split
from moe_lm.data.tokenizer import SPM_FILE, HFTokenizer, load_data_tokenizer

# Beside the corpus' own documents, the conversion is checked on what trips tokenizers up.
PROBES = ["  two leading spaces", "tabs\tand\n\nnewlines\n", "digits 1234567890", "unicode é ü 漢字 🙂", " ", "\n", ""]


def export_tokenizer(data_dir: str | Path, out: Path) -> str:
    """Write a data folder's tokenizer beside an HF model export so that `AutoTokenizer.from_pretrained(out)` loads
    it; returns what was written. A sentencepiece model is converted (and kept as tokenizer.model too); the
    converted tokenizer is written only if it gives the same ids on the validation documents and `PROBES`."""
    tok = load_data_tokenizer(data_dir)
    if isinstance(tok, HFTokenizer):
        tok.tok.save_pretrained(out)
        return "the Hugging Face tokenizer"
    shutil.copyfile(Path(data_dir) / SPM_FILE, out / SPM_FILE)
    try:
        hf = spm_to_hf(Path(data_dir) / SPM_FILE)
    except ValueError as e:
        return f"{SPM_FILE} only (no Hugging Face conversion: {e})"
    val = load_split(data_dir, "val")
    texts = [tok.decode(np.asarray(val.document(d))[1:].tolist()) for d in range(min(val.n_docs, 50))] + PROBES
    differs = matches(hf, tok.encode, texts)
    if differs is not None:
        return f"{SPM_FILE} only (the Hugging Face conversion gives other ids on {differs[:40]!r})"
    hf.save_pretrained(out)
    return f"{SPM_FILE} and its Hugging Face conversion (same ids on {len(texts)} texts)"


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
        if hf_tokenizer.encode(text, add_special_tokens=False) != encode(text):
            return text
    return None
