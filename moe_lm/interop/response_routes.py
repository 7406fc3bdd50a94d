"""What vLLM's and SGLang's responses share (vllm_responses.py, sglang_responses.py read each): token ids, the
routes' token range (all tokens but the last sampled one, from the prompt's first unless the request asked for a
later start), and aborted requests, whose responses hold no routes."""

from __future__ import annotations

import base64
import binascii

import numpy as np

from moe_lm.errors import DataError
from moe_lm.interop.route_records import Sequence, integer

NO_ROUTES = "responses whose routes are null (aborted requests)"
START = (
    "moe-lm analyses a sequence from its first token, so that any other model can be run on the same context; "
    "record with the default routed_experts_prompt_start / routed_experts_start_len 0"
)


class NoRoutes(Exception):
    """A response without routes that the engine writes so on purpose: the request was aborted before its first
    forward pass (vLLM: routed_experts null; SGLang: no meta_info.routed_experts, finish_reason abort)."""


def token_ids(obj: dict, key: str, where: str) -> np.ndarray:
    """The list of token ids under `key` (integers >= 0: a float or a boolean is not an id), or a DataError saying
    how to make the engine write it."""
    value = obj.get(key)
    if not isinstance(value, list) or not all(type(i) is int and i >= 0 for i in value):  # noqa: E721 - no bools
        raise DataError(f"{where}: no list of token ids under {key!r} ({_what_to_ask(key)})")
    return np.asarray(value, dtype=np.int64)


def _what_to_ask(key: str) -> str:
    return {
        "prompt_token_ids": 'make the request with "return_token_ids": true',
        "token_ids": 'make the request with "return_token_ids": true',
        "input_ids": "request return_prompt_token_ids, or add the request's input_ids to each response line",
        "output_ids": "SGLang's /generate response holds output_ids",
    }.get(key, "")


def base64_bytes(encoded, what: str, where: str) -> bytes:
    if not isinstance(encoded, str):
        raise DataError(f"{where}: {what} is {type(encoded).__name__}, not a base64 string")
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as e:
        raise DataError(f"{where}: {what} is not base64 ({e})") from None


def from_the_first_token(start, where: str) -> None:
    """`start`: the routes' first token where the line says it (the request's field, added; 0: not said)."""
    if integer(start, "routed_experts_prompt_start / routed_experts_start_len", where):
        raise DataError(f"{where}: its routes start at token {start}, not at the prompt's first ({START})")


def response_sequence(tokens, routes, prompt_len: int, where: str, domain) -> Sequence:
    """A response's sequence; its routes [rows, ...] must cover every token but the last sampled one (never
    forwarded), from the prompt's first."""
    rows = len(tokens) - 1
    fewer = rows - len(routes)
    if 0 < fewer <= prompt_len:  # why: vLLM writes the routes from prompt token routed_experts_prompt_start on
        raise DataError(
            f"{where}: routes for the last {len(routes)} of its {rows} routed tokens, as when the "
            f"request sets routed_experts_prompt_start {fewer} (or the record was cut short): {START}"
        )
    if fewer:
        raise DataError(f"{where}: routes for {len(routes)} tokens, where the engine routes {rows} (all but the "
                        "last sampled token): cut short, or another request's")  # fmt: skip
    return Sequence(tokens, routes.astype(np.int64), str(domain) if domain is not None else None)
