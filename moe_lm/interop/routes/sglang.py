"""SGLang's /generate responses with routed experts, recognised, read and written as SGLang's TokenizerManager
writes them.

Read from SGLang 0.5.23 (`srt/managers/tokenizer_manager.py` as stored at 001067ff, `_handle_batch_output` and
`_handle_abort_req`; `srt/managers/detokenizer_manager.py`): with `--enable-return-routed-experts` and requests
with `return_routed_experts`, a finished response is {"text", "output_ids" (the completion), "meta_info": {...,
"routed_experts"}}, `routed_experts` base64 of raw int32 bytes, [prompt + completion - 1 - start, num_hidden_layers,
top_k] in C order (start: the request's `routed_experts_start_len`, default 0, not repeated in the response),
logical ids, dense layers' rows 0. The prompt's ids are the response's own `prompt_token_ids` (top level) when the
request set `return_prompt_token_ids`, else the request's `input_ids` added to the line. A request aborted before
its first forward pass is answered by `_handle_abort_req`: meta_info {id, finish_reason {"type": "abort"}, ...}
without `routed_experts` (and without `prompt_token_ids`).
"""

from __future__ import annotations

import base64

import numpy as np

from moe_lm.errors import DataError
from moe_lm.interop.routes.record import Sequence
from moe_lm.interop.routes.registry import register_route_format
from moe_lm.interop.routes.responses import (
    NoRoutes,
    ResponseFormat,
    base64_bytes,
    from_the_first_token,
    response_sequence,
    token_ids,
)


def read_sglang_response(obj: dict, where: str) -> Sequence:
    """One /generate response as a sequence; NoRoutes for an aborted request's."""
    meta = obj["meta_info"]
    if meta.get("routed_experts", "") is None or ("routed_experts" not in meta and _aborted(meta)):
        raise NoRoutes  # why before the ids: SGLang's abort response holds no prompt ids
    tokens = np.concatenate([_prompt_ids(obj, where), token_ids(obj, "output_ids", where)])
    if "routed_experts" not in meta:
        raise DataError(f"{where}: no meta_info.routed_experts (start SGLang with --enable-return-routed-experts and "
                        "request return_routed_experts)")  # fmt: skip
    raw = base64_bytes(meta["routed_experts"], "meta_info.routed_experts", where)
    if len(raw) % 4:
        raise DataError(f"{where}: meta_info.routed_experts holds {len(raw)} bytes, not int32 ids")
    flat = np.frombuffer(raw, dtype=np.int32)
    from_the_first_token(obj.get("routed_experts_start_len", 0), where)
    rows = len(tokens) - 1
    if rows <= 0 or flat.size % rows:
        raise DataError(f"{where}: meta_info.routed_experts holds {flat.size} ids, not a whole number of rows for the "
                        f"{rows} tokens it covers (prompt + completion - 1): cut short, another request's, or a "
                        "request that set routed_experts_start_len")  # fmt: skip
    return response_sequence(tokens, flat.reshape(rows, -1), 0, where, obj.get("domain"))


def _aborted(meta: dict) -> bool:
    reason = meta.get("finish_reason")
    return isinstance(reason, dict) and reason.get("type") == "abort"


def _prompt_ids(obj: dict, where: str) -> np.ndarray:
    """SGLang's own `prompt_token_ids` (return_prompt_token_ids) or the request's `input_ids`; both must agree."""
    if "prompt_token_ids" not in obj:
        return token_ids(obj, "input_ids", where)
    prompt = token_ids(obj, "prompt_token_ids", where)
    if "input_ids" in obj and not np.array_equal(prompt, token_ids(obj, "input_ids", where)):
        raise DataError(f"{where}: prompt_token_ids and input_ids differ: the line mixes two requests")
    return prompt


def sglang_response(tokens: np.ndarray, prompt_len: int, routes: np.ndarray | None,
                    prompt_field: str = "input_ids") -> dict:  # fmt: skip
    """An SGLang /generate response: the prompt's ids under `prompt_field` ("input_ids": the request's, added;
    "prompt_token_ids": SGLang's own, return_prompt_token_ids); `routes` None: `_handle_abort_req`'s response to a
    request aborted before its first forward pass."""
    if routes is None:
        return {"text": "", "output_ids": [], "meta_info": {"id": "0", "completion_tokens": 0, "e2e_latency": 0.1,
                "finish_reason": {"type": "abort", "message": "Abort in waiting queue"}}}  # fmt: skip
    encoded = base64.b64encode(np.ascontiguousarray(routes, dtype=np.int32).tobytes()).decode()
    return {prompt_field: tokens[:prompt_len].tolist(), "output_ids": tokens[prompt_len:].tolist(), "text": "",
            "meta_info": {"prompt_tokens": prompt_len, "completion_tokens": len(tokens) - prompt_len,
                          "finish_reason": {"type": "length", "length": len(tokens) - prompt_len},
                          "routed_experts": encoded}}  # fmt: skip


class SGLangResponses(ResponseFormat):
    name, engine, key, key_type = "sglang responses", "SGLang", "meta_info", dict
    response = "an SGLang /generate response (meta_info)"
    looks_like = "SGLang's /generate responses with meta_info.routed_experts, JSON lines"
    order = 40

    def requests(self, obj: dict, where: str) -> list[tuple[object, str]]:
        return [(obj, where)]

    def sequence(self, request, obj: dict, where: str) -> Sequence:
        return read_sglang_response(obj, where)

    def response_of(self, tokens: np.ndarray, prompt_len: int, routes: np.ndarray | None) -> dict:
        return sglang_response(tokens, prompt_len, routes)


register_route_format(SGLangResponses())
