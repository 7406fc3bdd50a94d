"""llama.cpp in a process of its own, for what may end the process: loading a GGUF file (`probe`) and quantising
one (`quantize_in_child`). `python -m moe_lm.interop.llama_process probe FILE N_CTX THREADS FAITHFUL` /
`... quantize SOURCE OUT FTYPE THREADS`.

why a child: llama.cpp checks what it needs with assertions that abort the process (`GGML_ASSERT`: SIGABRT, exit
134), so moe-lm first lets this child meet them, and the command that asked gets one line instead of losing itself
and its staging folders. And the quantiser runs for minutes on a large model inside one C call, with llama.cpp's
log calling back into Python on every tensor: in the command's own process Ctrl-C could only be held until it
returned (held_signals.py); in a child, the command waits in Python and stops at once, and the child is killed.
The child imports llama_cpp only (no torch): about a second, plus the file's load (memory-mapped, so the command's
own load reads it from the page cache).
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from pathlib import Path

GGML_TYPE_F32 = 0
DONE, FAILED = 0, 3  # the child's exit codes; any other is llama.cpp (or a signal) ending it


def probe(path: Path, n_ctx: int, threads: int, faithful: bool) -> str | None:
    """None when llama.cpp loads `path` and decodes with these settings in a child process; otherwise what ended it,
    in one line (llama.cpp's own GGML_ASSERT message where it printed one)."""
    return _child("probe", path, n_ctx, threads, int(faithful), failed="llama.cpp could not load it", doing="loading")


def quantize_in_child(source: Path, out: Path, ftype: int, threads: int) -> str | None:
    """None when llama.cpp's quantiser (`llama_model_quantize`, what `llama-quantize` runs) wrote `out` from `source`
    as `ftype` in a child process; otherwise what ended it, in one line."""
    return _child("quantize", source, out, ftype, threads, failed="llama.cpp's quantiser failed", doing="quantising")


def _child(verb: str, *args, failed: str, doing: str) -> str | None:
    cmd = [sys.executable, "-m", "moe_lm.interop.llama_process", verb, *map(str, args)]
    # why run's own handling of KeyboardInterrupt and Terminated: it kills the child before re-raising
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    if proc.returncode == DONE:
        return None
    said = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    telling = [line for line in said if "GGML_ASSERT" in line or "error" in line.lower()]
    asserted = (telling or said or [""])[0 if telling else -1]
    if proc.returncode == FAILED:
        return f"{failed} ({asserted or 'no message'})"
    ended = f"signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else f"exit {proc.returncode}"
    return f"llama.cpp ended the process {doing} it ({ended}: {asserted[:300] or 'no message'})"


def _probe(path: str, n_ctx: str, threads: str, faithful: str) -> int:
    import llama_cpp as lc

    n_ctx_, threads_ = int(n_ctx), int(threads)
    params = lc.llama_model_default_params()
    params.n_gpu_layers = 0
    model = lc.llama_model_load_from_file(path.encode(), params)
    if not model:
        print("llama_model_load_from_file returned no model", file=sys.stderr)
        return FAILED
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx_, n_ctx_, min(n_ctx_, 512)
    cp.n_seq_max, cp.n_threads, cp.n_threads_batch = 1, threads_, threads_
    if faithful == "1":  # as GGUFModel runs it
        cp.flash_attn_type = 0
        cp.type_k = cp.type_v = GGML_TYPE_F32
    ctx = lc.llama_init_from_model(model, cp)
    if not ctx:
        print(f"llama_init_from_model could not make a context of {n_ctx_} tokens", file=sys.stderr)
        return FAILED
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
        return FAILED
    return DONE


def _quantize(source: str, out: str, ftype: str, threads: str) -> int:
    import llama_cpp as lc

    params = lc.llama_model_quantize_default_params()
    params.ftype, params.nthread = int(ftype), int(threads)
    rc = lc.llama_model_quantize(source.encode(), out.encode(), ctypes.byref(params))
    if rc != 0:
        print(f"llama_model_quantize returned {rc}", file=sys.stderr)
        return FAILED
    return DONE


if __name__ == "__main__":
    # why the default actions: a signal to the child ends it at once (its Python handler, run inside llama.cpp's log
    # callback, would be dropped there); the parent reports its own
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    verb, *rest = sys.argv[1:]
    sys.exit({"probe": _probe, "quantize": _quantize}[verb](*rest))
