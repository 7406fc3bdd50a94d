"""GGUF check: llama.cpp (through llama-cpp-python, built from source in its own venv) runs `moe-lm export --gguf`
files with our model's prompt log-probs and our tokenizer's ids.

    make gguf-check                                                        # runs:
    .venv/bin/python launch/gguf_check.py [--llama-python PYTHON] [--out DIR] [--cases mla gqa ...]

Two halves in two interpreters, as launch/serve_check.py does for vLLM:
- the project half (this interpreter) prepares a small corpus and its sentencepiece tokenizer, builds the check
  models of moe_lm/testing.py on that vocabulary (CASES: MLA with and without a query LoRA, GQA, each
  rotary with YaRN; every one with non-zero selection biases and group-limited routing that limits), exports each
  to HF with the tokenizer and then to GGUF (f32), and computes our log-prob of every prompt token;
- the llama.cpp half (`--llama DIR`, run by --llama-python; it imports only llama_cpp and numpy) loads the GGUF
  with an f32 KV cache, tokenizes the texts with llama.cpp's own tokenizer (BOS added as the file says) and
  evaluates the same token ids.
Passes when every |our log-prob - llama.cpp's| <= --tol and llama.cpp's ids equal ours on every text; the largest
gap with llama.cpp's default f16 KV cache is printed beside it (not judged).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# why only the standard library at module level: the llama.cpp half runs in its own venv, which has no moe_lm.

# case -> (attention, YaRN, query LoRA rank)
CASES = {
    "mla": ("mla", False, 0),
    "mla-qlora": ("mla", False, 32),
    "gqa": ("gqa", False, 0),
    "mla-yarn": ("mla", True, 32),
    "gqa-yarn": ("gqa", True, 0),
}
TEXTS = [
    "def parse(self, text):\n    return [line.strip() for line in text.splitlines() if line]\n",
    "The mixture of experts routes each token to a few of its experts.",
    "  two spaces,   three spaces, a tab\tand a newline\nthen text",
    "Ελληνικά, 中文, émigré, naïve — and an emoji 🙂 at the end",
]
VOCAB = 512
N_CTX = 64
REDUCED = ("bf16", "q8_0")  # GGUF types whose gap to our f32 model is measured (f32 KV cache), not judged


def prepare_tokenizer(work: Path) -> Path:
    """A data folder with a sentencepiece BPE tokenizer trained on the embedded corpus (VOCAB pieces)."""
    from moe_lm.config import DataConfig
    from moe_lm.data.prepare import prepare_data

    cfg = DataConfig(sources=["default"], out_dir=str(work / "data"), max_mb_per_domain=0.2)
    return prepare_data(cfg, VOCAB, log=lambda line: None)


def prepare_case(case: str, data_dir: Path, case_dir: Path) -> dict:
    """The case's check model exported to case_dir/hf (with the tokenizer) and case_dir/model.gguf; writes and
    returns case_dir/expected.json: texts, our ids, our log-probs."""
    from moe_lm.data.tokenizer import load_data_tokenizer
    from moe_lm.interop.gguf import export_gguf
    from moe_lm.interop.hf import export_hf
    from moe_lm.interop.hf_tokenizer import export_tokenizer
    from moe_lm.testing import check_model, prompt_logprobs

    attention, yarn, q_lora_rank = CASES[case]
    tok = load_data_tokenizer(data_dir)
    model = check_model(attention, yarn, vocab_size=VOCAB, q_lora_rank=q_lora_rank)
    export_hf(model, case_dir / "hf", tok.doc_start_id, tok.eos_id)
    export_tokenizer(data_dir, case_dir / "hf", max_len=model.cfg.max_seq_len)
    said = export_gguf(case_dir / "hf", case_dir / "model.gguf", "f32")
    for kind in REDUCED:  # measured, not judged
        export_gguf(case_dir / "hf", case_dir / f"model-{kind}.gguf", kind)
    ids = [([tok.doc_start_id] + tok.encode(text))[:N_CTX] for text in TEXTS]
    record = {"case": case, "gguf": said, "texts": TEXTS, "ids": ids,
              "ours": [prompt_logprobs(model, [p])[0] for p in ids]}  # fmt: skip
    (case_dir / "expected.json").write_text(json.dumps(record))
    return record


def run_llama(case_dir: Path) -> None:
    """The llama.cpp half: its tokenization of the texts and its prompt log-probs of our ids, with an f32 and an
    f16 KV cache, into case_dir/llama.json."""
    import numpy as np
    from llama_cpp import Llama

    expected = json.loads((case_dir / "expected.json").read_text())
    result = {}
    # (result key, file, KV cache type): GGML_TYPE_F32 0, GGML_TYPE_F16 1 (llama.cpp's default cache)
    runs = [("f32", "model.gguf", 0), ("f16", "model.gguf", 1)] + [(k, f"model-{k}.gguf", 0) for k in REDUCED]
    for cache, file, ggml_type in runs:
        llm = Llama(str(case_dir / file), n_ctx=N_CTX, logits_all=True, type_k=ggml_type, type_v=ggml_type,
                    n_threads=2, verbose=False)  # fmt: skip
        if cache == "f32":
            result["ids"] = [llm.tokenize(t.encode("utf-8"), add_bos=True)[:N_CTX] for t in expected["texts"]]
        logprobs = []
        for ids in expected["ids"]:
            llm.reset()
            llm.eval(ids)
            logits = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
            logits -= logits.max(-1, keepdims=True)
            logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            logprobs.append([float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)])
        result[cache] = logprobs
        del llm
    (case_dir / "llama.json").write_text(json.dumps(result))


def run_check(out: Path, llama_python: str, cases: list[str], tol: float) -> dict[str, dict]:
    """Export, run in llama.cpp and compare each case; {case: {gap, gap_f16, ids_equal, llama_s, ok}}."""
    from moe_lm.console import quiet_deepspeed
    from moe_lm.testing import max_abs_gap

    quiet_deepspeed()
    data_dir = prepare_tokenizer(out)
    results = {}
    for case in cases:
        case_dir = out / case
        record = prepare_case(case, data_dir, case_dir)
        start = time.perf_counter()
        proc = subprocess.run([llama_python, str(Path(__file__).resolve()), "--llama", str(case_dir)],
                              capture_output=True, text=True)  # fmt: skip
        llama_s = time.perf_counter() - start
        if proc.returncode != 0:
            print(f"--- llama.cpp failed on {case} (exit {proc.returncode}); its last output:", file=sys.stderr)
            print(proc.stderr[-6000:], file=sys.stderr)
            results[case] = {"gap": math.inf, "ids_equal": False, "llama_s": llama_s}
            results[case] |= {f"gap_{k}": math.inf for k in ("f16", *REDUCED)}
        else:
            got = json.loads((case_dir / "llama.json").read_text())
            results[case] = {"gap": max_abs_gap(record["ours"], got["f32"]),
                             "ids_equal": got["ids"] == record["ids"], "llama_s": llama_s}  # fmt: skip
            results[case] |= {f"gap_{k}": max_abs_gap(record["ours"], got[k]) for k in ("f16", *REDUCED)}
            if not results[case]["ids_equal"]:
                for text, ours, theirs in zip(TEXTS, record["ids"], got["ids"], strict=True):
                    if ours != theirs:
                        print(f"{case}: ids differ on {text!r}:\n  ours  {ours}\n  llama {theirs}", file=sys.stderr)
        results[case]["ok"] = results[case]["gap"] <= tol and results[case]["ids_equal"]
        results[case]["gguf"] = record["gguf"]
    return results


def report(results: dict[str, dict], tol: float) -> str:
    head = f"{'case':<10} {'max |Δ logprob| (f32)':>21} {'f16 KV':>8} {'bf16':>8} {'q8_0':>8} {'ids':>5}  result"
    lines = [head, f"{'':<10} {'judged':>21} {'(measured, not judged: f32 KV for bf16/q8_0 files)':>37}"]
    for case, r in results.items():
        verdict = "ok" if r["ok"] else ("llama.cpp failed" if math.isinf(r["gap"]) else f"MISMATCH (tol {tol:g})")
        ids = "same" if r["ids_equal"] else "DIFF"
        lines.append(f"{case:<10} {r['gap']:>21.2e} {r['gap_f16']:>8.1e} {r['gap_bf16']:>8.1e} "
                     f"{r['gap_q8_0']:>8.1e} {ids:>5}  {verdict}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--llama-python",
        default=sys.executable,
        help="the interpreter with llama-cpp-python (default: this one, as the dev install has it)",
    )
    ap.add_argument("--out", help="folder for the exports and log-probs (default: a temporary one)")
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--tol", type=float, default=1e-3, help="largest allowed |our log-prob - llama.cpp's| (f32)")
    ap.add_argument("--llama", metavar="DIR", help=argparse.SUPPRESS)  # the llama.cpp half (internal)
    args = ap.parse_args()
    if args.llama:
        run_llama(Path(args.llama))
        return
    if not Path(args.llama_python).exists():
        sys.exit(f"error: no {args.llama_python}; give one with llama-cpp-python (pip install -e '.[llama]')")
    with tempfile.TemporaryDirectory() as tmp:
        results = run_check(Path(args.out or tmp), args.llama_python, args.cases, args.tol)
    print(report(results, args.tol))
    if not all(r["ok"] for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
