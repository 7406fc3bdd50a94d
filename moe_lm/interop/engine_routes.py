"""Routes recorded by serving engines and trainers, read as each writes them (and written the same way, for tests
and for converting a moe-lm trace): `read_record` and `looks_like_record`, told by a file's content. Each format's
reader gives `Sequence`s: a sequence's token ids, from its first position, and the experts each routed token went
to, `routes` [tokens, layers of the record's axis, top_k], in logical expert ids.

Formats (docs/analytics.md, "Routes from serving engines", names the engine versions and code these were read from):

- **vLLM** completion responses (JSON lines): vllm_responses.py.
- **SGLang** /generate responses (JSON lines): sglang_responses.py.
- **SGLang per-token dumps** (`expert_distribution_recorder_*.pt`, one per rank, or their folder): sglang_dumps.py.
- **Megatron-Core's router trace** (`router_trace_rank*.jsonl` with the trainer's token ids): megatron_routes.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moe_lm.errors import DataError
from moe_lm.interop.megatron_routes import is_megatron_trace, read_megatron_trace
from moe_lm.interop.response_routes import NO_ROUTES, NoRoutes
from moe_lm.interop.route_records import MAX_LINE_BYTES, Record, capped_lines, json_value, open_regular
from moe_lm.interop.sglang_dumps import DUMP_GLOB, is_sglang_dump, read_sglang_dumps, sglang_dump
from moe_lm.interop.sglang_responses import read_sglang_response, sglang_response
from moe_lm.interop.vllm_responses import read_vllm_choice, vllm_response

__all__ = ["NO_ROUTES", "engine_routes", "looks_like_record", "read_record", "sglang_dump", "sglang_response",
           "vllm_response"]  # fmt: skip

SNIFF_LINES = 16  # lines looked at for a response with routes (the first ones may be aborted requests')
SNIFF_CHUNK = 1 << 20  # bytes of a line held at a time while looking


def read_record(path: str | Path) -> Record:
    """The sequences of a record (the format told by the content); a DataError naming the file, the line or pass,
    and what is wrong for anything that is not as the engine writes it."""
    path = Path(path)
    if is_megatron_trace(path):
        return read_megatron_trace(path)
    if path.is_dir():
        dumps = sorted(path.glob(DUMP_GLOB))
        if not dumps:
            raise DataError(f"{path}: no {DUMP_GLOB} files (SGLang's per-token dumps) in it")
        return read_sglang_dumps(dumps)
    with open_regular(path) as f:
        head = f.read(2)
    if head == b"PK":  # torch.save's zip container
        return read_sglang_dumps([path])
    return read_responses(path)


def looks_like_record(path: str | Path) -> bool:
    """Whether `path` is a record by its content, whatever its name (what --compare recognises): Megatron's router
    trace, a per-token dump (or a folder of them), or a JSON-lines file one of whose first lines is a vLLM or SGLang
    response with routed experts. Never waits on a FIFO, never holds more than a chunk of a line."""
    path = Path(path)
    if is_megatron_trace(path):
        return True
    if path.is_dir():
        return any(path.glob(DUMP_GLOB))
    return is_sglang_dump(path) or _responses_with_routes(path)


# ---- JSON lines: vLLM completion responses and SGLang /generate responses --------------------------------------


def read_responses(path: Path) -> Record:
    sequences = []
    formats = set()
    aborted = 0
    with open_regular(path) as f:
        for n, line in capped_lines(f, path):
            where = f"{path}, line {n}"
            obj = json_value(line, where)
            if isinstance(obj, dict) and isinstance(obj.get("choices"), list):
                formats.add("vllm")
                items = [(read_vllm_choice, (c, obj, f"{where}, choice {i}")) for i, c in enumerate(obj["choices"])]
            elif isinstance(obj, dict) and isinstance(obj.get("meta_info"), dict):
                formats.add("sglang")
                items = [(read_sglang_response, (obj, where))]
            else:
                raise DataError(f"{where}: neither a vLLM completion response (choices) nor an SGLang /generate "
                                "response (meta_info)")  # fmt: skip
            for read, args in items:
                try:
                    sequences.append(read(*args))
                except NoRoutes:
                    aborted += 1
    if not sequences:
        raise DataError(f"{path}: no response holds routes ({aborted} aborted or null): start the engine with "
                        "--enable-return-routed-experts (SGLang: and request return_routed_experts)")  # fmt: skip
    if len(formats) > 1:
        raise DataError(f"{path}: vLLM and SGLang responses in one file; give one engine's record at a time")
    return Record(f"{formats.pop()} responses", sequences, {NO_ROUTES: aborted} if aborted else {}, filler=0)


def _responses_with_routes(path: Path) -> bool:
    """Whether one of the first SNIFF_LINES lines of `path` is a JSON object naming `routed_experts` and `choices`
    (vLLM) or `meta_info` (SGLang); every line looked at must start a JSON object."""
    try:
        f = open_regular(path)
    except DataError:
        return False
    with f:
        for _ in range(SNIFF_LINES):
            keys = _line_keys(f)
            if keys is None:
                return False
            if b'"routed_experts"' in keys and keys & {b'"choices"', b'"meta_info"'}:
                return True
    return False


def _line_keys(f) -> set[bytes] | None:
    """Which of the response keys the next non-blank line of `f` names, read SNIFF_CHUNK bytes at a time; None at
    the end of the file, for a line that does not start a JSON object, or one past MAX_LINE_BYTES."""
    keys = (b'"routed_experts"', b'"choices"', b'"meta_info"')
    found: set[bytes] = set()
    tail, read = b"", 0
    while chunk := f.readline(SNIFF_CHUNK):
        if read == 0 and not chunk.strip():
            continue  # a blank line
        if read == 0 and not chunk.lstrip().startswith(b"{"):
            return None
        window = tail + chunk
        found |= {k for k in keys if k in window}
        tail, read = window[-32:], read + len(chunk)  # why a tail: a key may straddle two chunks
        if chunk.endswith(b"\n"):
            return found
        if read > MAX_LINE_BYTES:
            return None
    return found if read else None


# ---- writers: a moe-lm trace's windows as an engine writes them (tests, conversions) ----------------------------


def engine_routes(experts: dict[int, np.ndarray], n_layers: int, k: int, dense: int) -> np.ndarray:
    """[tokens, n_layers, k] with each MoE layer's experts in its row and `dense` in the other layers' rows."""
    n = len(next(iter(experts.values())))
    routes = np.full((n, n_layers, k), dense, dtype=np.int64)
    for layer, ids in experts.items():
        routes[:, layer, :] = ids
    return routes
