"""What vLLM's and SGLang's responses share (vllm.py and sglang.py are their formats): a JSON object a line, each
line read by the format whose responses hold its top-level key; token ids, the routes' token range (all tokens but
the last sampled one, from the prompt's first unless the request asked for a later start), and aborted requests,
whose responses hold no routes."""

from __future__ import annotations

import base64
import binascii
import json
from abc import abstractmethod
from pathlib import Path
from typing import BinaryIO, ClassVar

import numpy as np

from moe_lm.errors import DataError
from moe_lm.interop.routes.record import (
    MAX_LINE_BYTES,
    Record,
    Sequence,
    capped_lines,
    integer,
    json_value,
    open_regular,
)
from moe_lm.interop.routes.registry import FORMATS, RouteFormat

NO_ROUTES = "responses whose routes are null (aborted requests)"
START = (
    "moe-lm analyses a sequence from its first token, so that any other model can be run on the same context; "
    "record with the default routed_experts_prompt_start / routed_experts_start_len 0"
)
SNIFF_LINES = 16  # lines looked at for a response with routes (the first ones may be aborted requests')
SNIFF_CHUNK = 1 << 20  # bytes of a line held at a time while looking
ROUTED = b'"routed_experts"'


class NoRoutes(Exception):
    """A response without routes that the engine writes so on purpose: the request was aborted before its first
    forward pass (vLLM: routed_experts null; SGLang: no meta_info.routed_experts, finish_reason abort)."""


class ResponseFormat(RouteFormat):
    """An engine's responses with routed experts, a JSON object a line. Declares `engine` (its name in a message),
    `key` and `key_type` (the top-level key only its responses hold, and what that key holds) and `response` (one
    response in a few words, for a line that is no engine's); gives each response's requests and reads each."""

    engine: ClassVar[str]
    key: ClassVar[str]
    key_type: ClassVar[type]
    response: ClassVar[str]

    def recognises(self, path: Path) -> bool:
        """One of the first SNIFF_LINES lines is a JSON object naming `routed_experts` and the engine's key (every
        line looked at must start one), read SNIFF_CHUNK bytes at a time."""
        return _sniffed(path, f'"{self.key}"'.encode())

    def claims(self, path: Path) -> bool:
        # why any path but a folder: the JSON-lines reader names what a file is not (a FIFO, a missing file, an
        # endless line, JSON that is not, a line no engine writes) where a format's recognition only says no
        return not path.is_dir()

    def read(self, path: Path) -> Record:
        return read_responses(path)

    def holds(self, obj) -> bool:
        """Whether a line's JSON value is one of this engine's responses."""
        return isinstance(obj, dict) and isinstance(obj.get(self.key), self.key_type)

    @abstractmethod
    def requests(self, obj: dict, where: str) -> list[tuple[object, str]]:
        """The response's requests, each with where it is (a vLLM response holds a choice per request)."""

    @abstractmethod
    def sequence(self, request, obj: dict, where: str) -> Sequence:
        """One request's sequence; NoRoutes for a request aborted before its first forward pass."""

    def write(self, path: Path, record: Record) -> None:
        """Each sequence (its routed tokens and the last sampled one) a response, the first half of its routed
        tokens the prompt."""
        lines = [self.response_of(s.tokens, len(s.routes) // 2, s.routes) for s in record.sequences]
        Path(path).write_text("".join(json.dumps(line) + "\n" for line in lines))

    @abstractmethod
    def response_of(self, tokens: np.ndarray, prompt_len: int, routes: np.ndarray | None) -> dict:
        """The engine's response to a request of `prompt_len` prompt tokens that sampled the rest of `tokens`,
        `routes` [len(tokens) - 1, layers, k] (None: a request aborted before its first forward pass)."""


def read_responses(path: Path) -> Record:
    """The sequences of a JSON-lines file of one engine's responses, each line read by the format that holds it."""
    engines = [f for f in FORMATS if isinstance(f, ResponseFormat)]
    sequences: list[Sequence] = []
    seen: set[str] = set()
    aborted = 0
    with open_regular(path) as f:
        for n, line in capped_lines(f, path):
            where = f"{path}, line {n}"
            obj = json_value(line, where)
            fmt = next((e for e in engines if e.holds(obj)), None)
            if fmt is None:
                raise DataError(f"{where}: {'neither' if len(engines) > 1 else 'not'} "
                                + " nor ".join(e.response for e in engines))  # fmt: skip
            seen.add(fmt.name)
            for request, at in fmt.requests(obj, where):
                try:
                    sequences.append(fmt.sequence(request, obj, at))
                except NoRoutes:
                    aborted += 1
    if not sequences:
        raise DataError(f"{path}: no response holds routes ({aborted} aborted or null): start the engine with "
                        "--enable-return-routed-experts (SGLang: and request return_routed_experts)")  # fmt: skip
    if len(seen) > 1:
        named = " and ".join(e.engine for e in engines if e.name in seen)
        raise DataError(f"{path}: {named} responses in one file; give one engine's record at a time")
    return Record(seen.pop(), sequences, {NO_ROUTES: aborted} if aborted else {}, filler=0)


def _sniffed(path: Path, key: bytes) -> bool:
    """Whether one of the first SNIFF_LINES lines of `path` is a JSON object naming `routed_experts` and `key`."""
    try:
        f = open_regular(path)
    except DataError:
        return False
    with f:
        for _ in range(SNIFF_LINES):
            keys = _line_keys(f, (ROUTED, key))
            if keys is None:
                return False
            if keys == {ROUTED, key}:
                return True
    return False


def _line_keys(f: BinaryIO, keys: tuple[bytes, ...]) -> set[bytes] | None:
    """Which of `keys` the next non-blank line of `f` names, read SNIFF_CHUNK bytes at a time; None at the end of
    the file, for a line that does not start a JSON object, or one past MAX_LINE_BYTES."""
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
