"""vLLM's completion responses with routed experts, recognised, read and written as vLLM's OpenAI server writes them.

Read from vLLM 0.33.0 (commit 4ba787ec9; the fields are as at d5dba2d7 / 002032ee of the stored tree):
`vllm/entrypoints/openai/completion/protocol.py`, `CompletionResponseChoice`: with `--enable-return-routed-experts`
and requests made with `"return_token_ids": true`, each choice holds `prompt_token_ids`, `token_ids` (the
completion) and `routed_experts`: base64 of `.npy` bytes, [prompt + completion - 1 - start, num_hidden_layers,
top_k] (uint8, uint16 past 256 experts), `None` "if (a) the request was aborted before any forward pass, or (b)
`enable_return_routed_experts` is off server-side". The last sampled token never ran; `start` is the request's
`routed_experts_prompt_start` (`CompletionRequest`, "Skip the first N prompt tokens from returned routed-expert
data", default 0), which the response does not repeat. Ids are logical (`routed_experts_capturer.py` captures
`topk_ids` before EPLB's mapping); its buffer is `torch.zeros` and only MoE layers write into it, so dense layers'
rows are 0.
"""

from __future__ import annotations

import base64
import io

import numpy as np

from moe_lm.errors import DataError
from moe_lm.interop.routes.record import Sequence, npy_array
from moe_lm.interop.routes.registry import register_route_format
from moe_lm.interop.routes.responses import (
    NoRoutes,
    ResponseFormat,
    base64_bytes,
    from_the_first_token,
    response_sequence,
    token_ids,
)


def read_vllm_choice(choice, response: dict, where: str) -> Sequence:
    """One choice of a completion response as a sequence; NoRoutes for an aborted request's."""
    if not isinstance(choice, dict):
        raise DataError(f"{where}: a choice that is not a JSON object")
    if choice.get("routed_experts", "") is None:  # why before the ids: an aborted request may have none
        raise NoRoutes
    prompt = token_ids(choice if "prompt_token_ids" in choice else response, "prompt_token_ids", where)
    tokens = np.concatenate([prompt, token_ids(choice, "token_ids", where)])
    if "routed_experts" not in choice:
        raise DataError(f"{where}: no routed_experts (start vLLM with --enable-return-routed-experts)")
    raw = base64_bytes(choice["routed_experts"], "routed_experts", where)
    routes = npy_array(io.BytesIO(raw), len(raw), "routed_experts", where)
    if routes.ndim != 3:
        raise DataError(f"{where}: routed_experts of shape {routes.shape}, not [tokens, layers, top_k]")
    from_the_first_token(
        choice.get("routed_experts_prompt_start", response.get("routed_experts_prompt_start", 0)), where
    )
    return response_sequence(tokens, routes, len(prompt), where, response.get("domain"))


def vllm_response(tokens: np.ndarray, prompt_len: int, routes: np.ndarray | None, n_experts: int) -> dict:
    """A vLLM completion response of one choice, as its OpenAI server writes it (`return_token_ids`); `routes` None:
    a request aborted before its first forward pass."""
    encoded = None
    if routes is not None:
        buffer = io.BytesIO()
        np.save(buffer, routes.astype(np.uint8 if n_experts <= 256 else np.uint16), allow_pickle=False)
        encoded = base64.b64encode(buffer.getvalue()).decode()
    choice = {"index": 0, "text": "", "finish_reason": "length" if routes is not None else "abort",
              "prompt_token_ids": tokens[:prompt_len].tolist(), "token_ids": tokens[prompt_len:].tolist(),
              "routed_experts": encoded}  # fmt: skip
    return {"id": "cmpl-0", "object": "text_completion", "model": "moe-lm", "choices": [choice]}


class VLLMResponses(ResponseFormat):
    name, engine, key, key_type = "vllm responses", "vLLM", "choices", list
    response = "a vLLM completion response (choices)"
    looks_like = "vLLM's completion responses with routed_experts, JSON lines"
    order = 30

    def requests(self, obj: dict, where: str) -> list[tuple[object, str]]:
        return [(choice, f"{where}, choice {i}") for i, choice in enumerate(obj["choices"])]

    def sequence(self, request, obj: dict, where: str) -> Sequence:
        return read_vllm_choice(request, obj, where)

    def response_of(self, tokens: np.ndarray, prompt_len: int, routes: np.ndarray | None) -> dict:
        return vllm_response(tokens, prompt_len, routes, 1 + int(routes.max(initial=0)) if routes is not None else 0)


register_route_format(VLLMResponses())
