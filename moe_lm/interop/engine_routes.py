"""Routes recorded by serving engines, read as each engine writes them (and written the same way, for tests and for
converting a moe-lm trace). Each reader gives `Sequence`s: a sequence's token ids, from its first position, and the
experts each routed token went to, `routes` [tokens, layers of the engine's axis, top_k], in logical expert ids.

Formats (docs/analytics.md, "Routes from serving engines", names the engine versions these were read from):

- **vLLM** (`--enable-return-routed-experts`; `vllm/entrypoints/openai/completion/protocol.py`,
  `CompletionResponseChoice`): a JSON-lines file of completion responses, the request made with
  `"return_token_ids": true`. Each choice holds `prompt_token_ids`, `token_ids` (the completion) and
  `routed_experts`, base64 of `.npy` bytes of shape [prompt + completion - 1 - start, num_hidden_layers, top_k]
  (uint8, uint16 past 256 experts): the last sampled token never ran, and `routed_experts_prompt_start` (a
  request field, 0 by default) skips prompt tokens. Logical ids (captured before EPLB's mapping); dense layers' rows
  are 0.
- **SGLang responses** (`--enable-return-routed-experts`; `srt/managers/io_struct.py`, `detokenizer_manager.py`):
  a JSON-lines file of `/generate` responses, each with the request's `input_ids` added (SGLang's response does not
  repeat the prompt) and its `routed_experts_start_len` when the request set one. `meta_info.routed_experts` is
  base64 of raw int32 bytes, [prompt + completion - 1 - start, num_hidden_layers, top_k] in C order, logical ids;
  dense layers' rows are 0. The completion's ids are `output_ids`.
- **SGLang per-token dumps** (`--expert-distribution-recorder-mode per_token`, `/dump_expert_distribution_record`;
  `srt/eplb/expert_distribution.py`): `expert_distribution_recorder_{time}_{rank}.pt`, one per rank, a `torch.save`
  of {records: [per forward pass: input_ids, positions, extend_seq_lens, forward_mode, topk_ids_of_layer
  [num_hidden_layers, tokens, 8] int32], last_physical_to_logical_map [num_hidden_layers, physical experts]}. Ids
  are physical slots (mapped to logical here by the dump's own map); -1 fills dense layers and the columns past
  top_k. A pass holds several requests' tokens; a document here is a prefill segment that starts at position 0 (a
  decode step, or a prefill continuing a cached prefix, lacks its request's earlier tokens: counted, not read).
- **Megatron-Core's router trace** (`--moe-routing-trace-path`): moe_lm/interop/megatron_routes.py, with the token
  ids the trainer fed it; its routes name their layers (`Record.layers`) and are unranked.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from pathlib import Path

import numpy as np

from moe_lm.errors import DataError
from moe_lm.interop.megatron_routes import is_megatron_trace, read_megatron_trace
from moe_lm.interop.route_records import Record, Sequence

SGLANG_TOPK_COLUMNS = 8  # the per-token recorder's fixed width (_TOP_K_NUM); columns past top_k are -1
FILLER = -1  # SGLang's per-token recorder: dense layers, unused columns


def read_record(path: str | Path) -> Record:
    """The sequences of an engine's record (the format told by the file's content); a DataError naming the file, the
    line or pass, and what is wrong for anything that is not as the engine writes it."""
    path = Path(path)
    if is_megatron_trace(path):
        return read_megatron_trace(path)
    if path.is_dir():
        dumps = sorted(path.glob("expert_distribution_recorder_*.pt"))
        if not dumps:
            raise DataError(f"{path}: no expert_distribution_recorder_*.pt files (SGLang's per-token dumps) in it")
        return read_sglang_dumps(dumps)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    with open(path, "rb") as f:
        head = f.read(4)
    if head[:2] == b"PK":  # torch.save's zip container
        return read_sglang_dumps([path])
    return read_responses(path)


def looks_like_record(path: str | Path) -> bool:
    """Whether `path` is an engine's record by its content: a per-token dump (or a folder of them), a JSON-lines
    file whose first line is a vLLM or SGLang response with routed experts, or Megatron's router trace (what --compare
    recognises)."""
    path = Path(path)
    if is_megatron_trace(path):
        return True
    if path.is_dir():
        return any(path.glob("expert_distribution_recorder_*.pt"))
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            if f.read(2) == b"PK":  # torch.save's zip container: SGLang names its dumps
                return path.name.startswith("expert_distribution_recorder_")
            f.seek(0)
            first = json.loads(f.readline())  # why the whole line: a long sequence's ids come before its routes
    except (OSError, ValueError):
        return False
    if not isinstance(first, dict):
        return False
    choices = first.get("choices")
    if isinstance(choices, list):
        return any(isinstance(c, dict) and "routed_experts" in c for c in choices)
    return isinstance(first.get("meta_info"), dict) and "routed_experts" in first["meta_info"]


# ---- JSON lines: vLLM completion responses and SGLang /generate responses --------------------------------------


class _NoRoutes(Exception):
    """A response whose routes are null: the request was aborted before its first forward pass (both engines say
    so in their protocol), or the engine ran without the option."""


NO_ROUTES = "responses whose routes are null (aborted requests)"


def read_responses(path: Path) -> Record:
    sequences: list[Sequence] = []
    formats = set()
    aborted = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}, line {n}: not JSON ({e}); one response per line") from None
            where = f"{path}, line {n}"
            if isinstance(obj, dict) and isinstance(obj.get("choices"), list):
                formats.add("vllm")
                items = [(_vllm_choice, (c, obj, f"{where}, choice {i}")) for i, c in enumerate(obj["choices"])]
            elif isinstance(obj, dict) and isinstance(obj.get("meta_info"), dict):
                formats.add("sglang")
                items = [(_sglang_response, (obj, where))]
            else:
                raise DataError(f"{where}: neither a vLLM completion response (choices) nor an SGLang /generate "
                                "response (meta_info)")  # fmt: skip
            for read, args in items:
                try:
                    sequences.append(read(*args))
                except _NoRoutes:
                    aborted += 1
    if not sequences:
        raise DataError(f"{path}: no response holds routes ({aborted} null): start the engine with "
                        "--enable-return-routed-experts (SGLang: and request return_routed_experts)")  # fmt: skip
    if len(formats) > 1:
        raise DataError(f"{path}: vLLM and SGLang responses in one file; give one engine's record at a time")
    return Record(f"{formats.pop()} responses", sequences, {NO_ROUTES: aborted} if aborted else {})


def _ids(obj: dict, key: str, where: str) -> np.ndarray:
    value = obj.get(key)
    if not isinstance(value, list) or not all(isinstance(i, int) and i >= 0 for i in value):
        raise DataError(f"{where}: no list of token ids under {key!r} ({_what_to_ask(key)})")
    return np.asarray(value, dtype=np.int64)


def _what_to_ask(key: str) -> str:
    return {
        "prompt_token_ids": 'make the request with "return_token_ids": true',
        "token_ids": 'make the request with "return_token_ids": true',
        "input_ids": "add the request's input_ids to each response line",
        "output_ids": "SGLang's /generate response holds output_ids",
    }.get(key, "")


def _vllm_choice(choice: dict, response: dict, where: str) -> Sequence:
    prompt = _ids(choice if "prompt_token_ids" in choice else response, "prompt_token_ids", where)
    tokens = np.concatenate([prompt, _ids(choice, "token_ids", where)])
    encoded = choice.get("routed_experts")
    if encoded is None and "routed_experts" in choice:
        raise _NoRoutes
    if not isinstance(encoded, str):
        raise DataError(f"{where}: no routed_experts (start vLLM with --enable-return-routed-experts)")
    try:
        routes = np.load(io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as e:
        raise DataError(f"{where}: routed_experts is not base64 of .npy bytes ({e})") from None
    start = int(response.get("routed_experts_prompt_start", choice.get("routed_experts_prompt_start", 0)) or 0)
    return _sequence(tokens, routes, start, where, response.get("domain"))


def _sglang_response(obj: dict, where: str) -> Sequence:
    tokens = np.concatenate([_ids(obj, "input_ids", where), _ids(obj, "output_ids", where)])
    encoded = obj["meta_info"].get("routed_experts")
    if encoded is None and "routed_experts" in obj["meta_info"]:
        raise _NoRoutes
    if not isinstance(encoded, str):
        raise DataError(f"{where}: no meta_info.routed_experts (start SGLang with --enable-return-routed-experts and "
                        "request return_routed_experts)")  # fmt: skip
    try:
        flat = np.frombuffer(base64.b64decode(encoded, validate=True), dtype=np.int32)
    except (binascii.Error, ValueError) as e:
        raise DataError(f"{where}: meta_info.routed_experts is not base64 of int32 bytes ({e})") from None
    start = int(obj.get("routed_experts_start_len", 0) or 0)
    _from_the_first_token(start, where)
    rows = len(tokens) - 1 - start
    if rows <= 0 or flat.size % rows:
        raise DataError(f"{where}: meta_info.routed_experts holds {flat.size} ids, not a whole number of rows for the "
                        f"{rows} tokens it covers (prompt + completion - 1 - start {start}): cut short, or another "
                        "request's")  # fmt: skip
    return _sequence(tokens, flat.reshape(rows, -1), start, where, obj.get("domain"), flat_layers=True)


def _from_the_first_token(start: int, where: str) -> None:
    if start != 0:
        raise DataError(
            f"{where}: its routes start at token {start}, not at the prompt's first (the request set "
            "routed_experts_start_len / routed_experts_prompt_start): moe-lm analyses a sequence from its first token, "
            "so that any other model can be run on the same context; record with the default 0"
        )


def _sequence(tokens, routes, start: int, where: str, domain, flat_layers: bool = False) -> Sequence:
    """A response's sequence; its routes must cover [start, len(tokens) - 1), the engine's range."""
    _from_the_first_token(start, where)
    rows = len(tokens) - 1
    if routes.shape[0] != rows:
        raise DataError(f"{where}: routes for {routes.shape[0]} tokens, where the engine routes {rows} (all but the "
                        "last sampled token): cut short, or another request's")  # fmt: skip
    if not flat_layers and routes.ndim != 3:
        raise DataError(f"{where}: routes of shape {routes.shape}, not [tokens, layers, top_k]")
    return Sequence(tokens, routes.astype(np.int64), str(domain) if domain is not None else None)


# ---- SGLang's per-token dumps -------------------------------------------------------------------------------------


def read_sglang_dumps(paths: list[Path]) -> Record:
    """Every rank's dump of one recording: each rank's passes, physical ids mapped by its own map; a pass two ranks
    both recorded (plain tensor parallelism: every rank routes every token) is read once."""
    import torch

    sequences: list[Sequence] = []
    skipped: dict[str, int] = {}
    seen: set[bytes] = set()
    for path in paths:
        try:
            dump = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch.load raises many kinds for a damaged file
            raise DataError(f"{path}: not a readable torch.save file ({type(e).__name__}: {str(e)[:120]})") from None
        if not isinstance(dump, dict) or "records" not in dump or "last_physical_to_logical_map" not in dump:
            raise DataError(f"{path}: not an SGLang per-token dump (records, last_physical_to_logical_map)")
        phys_to_log = np.asarray(dump["last_physical_to_logical_map"], dtype=np.int64)
        for i, rec in enumerate(dump["records"]):
            where = f"{path}, forward pass {rec.get('forward_pass_id', i)}"
            ids = np.asarray(rec.get("input_ids", []), dtype=np.int64)
            key = ids.tobytes() + np.asarray(rec["topk_ids_of_layer"]).tobytes()
            if key in seen:
                continue
            seen.add(key)
            sequences += _dump_pass(rec, ids, phys_to_log, where, skipped)
    return Record("sglang per-token dump", sequences, skipped)


def _dump_pass(rec: dict, ids: np.ndarray, phys_to_log: np.ndarray, where: str, skipped: dict) -> list[Sequence]:
    topk = np.asarray(rec["topk_ids_of_layer"], dtype=np.int64)  # [layers, tokens, 8]
    positions = np.asarray(rec.get("positions", []), dtype=np.int64)
    if topk.ndim != 3 or topk.shape[1] != len(ids) or len(positions) != len(ids):
        raise DataError(f"{where}: topk_ids_of_layer {tuple(topk.shape)} does not fit its {len(ids)} input_ids and "
                        f"{len(positions)} positions")  # fmt: skip
    if phys_to_log.ndim != 2 or phys_to_log.shape[0] != topk.shape[0]:
        raise DataError(f"{where}: last_physical_to_logical_map {tuple(phys_to_log.shape)} does not cover its "
                        f"{topk.shape[0]} layers")  # fmt: skip
    if topk.max(initial=-1) >= phys_to_log.shape[1]:
        raise DataError(f"{where}: expert slot {int(topk.max())} past the map's {phys_to_log.shape[1]} physical slots")
    logical = np.where(topk >= 0, np.take_along_axis(phys_to_log[:, None, :], topk.clip(0), axis=2), FILLER)
    routes = logical.transpose(1, 0, 2)  # [tokens, layers, 8]
    lens = rec.get("extend_seq_lens")
    segments = [int(n) for n in lens] if lens is not None else [1] * len(ids)  # decode: a token per request
    out, at = [], 0
    for n in segments:
        if positions[at] == 0 and lens is not None:
            out.append(Sequence(ids[at : at + n], routes[at : at + n]))
        else:
            why = "decode steps" if lens is None else "prefills continuing a cached or earlier chunk"
            skipped[why] = skipped.get(why, 0) + n
        at += n
    return out


# ---- writers: a moe-lm trace's windows as an engine writes them (tests, conversions) ----------------------------


def engine_routes(experts: dict[int, np.ndarray], n_layers: int, k: int, dense: int) -> np.ndarray:
    """[tokens, n_layers, k] with each MoE layer's experts in its row and `dense` in the other layers' rows."""
    n = len(next(iter(experts.values())))
    routes = np.full((n, n_layers, k), dense, dtype=np.int64)
    for layer, ids in experts.items():
        routes[:, layer, :] = ids
    return routes


def vllm_response(tokens: np.ndarray, prompt_len: int, routes: np.ndarray, n_experts: int) -> dict:
    """A vLLM completion response of one choice, as its OpenAI server writes it (`return_token_ids`)."""
    buffer = io.BytesIO()
    np.save(buffer, routes.astype(np.uint8 if n_experts <= 256 else np.uint16), allow_pickle=False)
    encoded = base64.b64encode(buffer.getvalue()).decode()
    choice = {"index": 0, "text": "", "finish_reason": "length", "prompt_token_ids": tokens[:prompt_len].tolist(),
              "token_ids": tokens[prompt_len:].tolist(), "routed_experts": encoded}  # fmt: skip
    return {"id": "cmpl-0", "object": "text_completion", "model": "moe-lm", "choices": [choice]}


def sglang_response(tokens: np.ndarray, prompt_len: int, routes: np.ndarray) -> dict:
    """An SGLang /generate response with the request's input_ids added (meta_info.routed_experts: raw int32)."""
    encoded = base64.b64encode(np.ascontiguousarray(routes, dtype=np.int32).tobytes()).decode()
    return {"input_ids": tokens[:prompt_len].tolist(), "output_ids": tokens[prompt_len:].tolist(), "text": "",
            "meta_info": {"prompt_tokens": prompt_len, "completion_tokens": len(tokens) - prompt_len,
                          "routed_experts": encoded}}  # fmt: skip


def sglang_dump(passes: list[tuple[np.ndarray, np.ndarray]], phys_to_log: np.ndarray, rank: int = 0) -> dict:
    """An SGLang per-token dump of prefill passes, each (tokens, physical ids [layers, tokens, k] with -1 in dense
    layers) one request from position 0, as the recorder saves it."""
    import torch

    records = []
    for i, (tokens, ids) in enumerate(passes):
        topk = np.full((ids.shape[0], len(tokens), SGLANG_TOPK_COLUMNS), FILLER, dtype=np.int32)
        topk[:, :, : ids.shape[2]] = ids
        records.append({"forward_pass_id": i, "rank": rank, "gatherer_key": "primary",
                        "input_ids": tokens.tolist(), "positions": list(range(len(tokens))),
                        "extend_seq_lens": [len(tokens)], "forward_mode": 1,
                        "topk_ids_of_layer": torch.from_numpy(topk)})  # fmt: skip
    return {"records": records, "last_physical_to_logical_map": torch.from_numpy(phys_to_log.astype(np.int64))}
