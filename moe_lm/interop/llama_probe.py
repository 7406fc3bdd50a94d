"""llama.cpp loading a GGUF file and decoding two tokens, in a process of its own: `python -m
moe_lm.interop.llama_probe FILE N_CTX THREADS FAITHFUL`. llama.cpp checks what it needs with assertions that abort the
process (`GGML_ASSERT`: SIGABRT, exit 134), so moe-lm first lets this child meet them (`probe`), and the command that
asked gets one line instead of losing itself and its staging folders. It imports llama_cpp only (no torch): about a
second, plus the file's load (memory-mapped, so the command's own load reads it from the page cache).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

GGML_TYPE_F32 = 0
LOADED, NOT_LOADED = 0, 3  # the child's exit codes; any other is llama.cpp ending it


def probe(path: Path, n_ctx: int, threads: int, faithful: bool) -> str | None:
    """None when llama.cpp loads `path` and decodes with these settings in a child process; otherwise what ended it,
    in one line (llama.cpp's own GGML_ASSERT message where it printed one)."""
    cmd = [sys.executable, "-m", "moe_lm.interop.llama_probe", str(path), str(n_ctx),
           str(threads), str(int(faithful))]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    if proc.returncode == LOADED:
        return None
    said = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    telling = [line for line in said if "GGML_ASSERT" in line or "error" in line.lower()]
    asserted = (telling or said or [""])[0 if telling else -1]
    if proc.returncode == NOT_LOADED:
        return f"llama.cpp could not load it ({asserted or 'no message'})"
    ended = f"signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else f"exit {proc.returncode}"
    return f"llama.cpp ended the process loading it ({ended}: {asserted[:300] or 'no message'})"


def main(argv: list[str]) -> int:
    import llama_cpp as lc

    path, n_ctx, threads, faithful = argv[0], int(argv[1]), int(argv[2]), argv[3] == "1"
    params = lc.llama_model_default_params()
    params.n_gpu_layers = 0
    model = lc.llama_model_load_from_file(path.encode(), params)
    if not model:
        print("llama_model_load_from_file returned no model", file=sys.stderr)
        return NOT_LOADED
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_ctx, min(n_ctx, 512)
    cp.n_seq_max, cp.n_threads, cp.n_threads_batch = 1, threads, threads
    if faithful:  # as GGUFModel runs it
        cp.flash_attn_type = 0
        cp.type_k = cp.type_v = GGML_TYPE_F32
    ctx = lc.llama_init_from_model(model, cp)
    if not ctx:
        print(f"llama_init_from_model could not make a context of {n_ctx} tokens", file=sys.stderr)
        return NOT_LOADED
    batch = lc.llama_batch_init(2, 0, 1)
    for i in range(2):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = 0, i, 1, 0, 1
    batch.n_tokens = 2
    rc = lc.llama_decode(ctx, batch)
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    if rc != 0:
        print(f"llama_decode returned {rc}", file=sys.stderr)
        return NOT_LOADED
    return LOADED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
