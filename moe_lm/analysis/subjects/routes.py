"""Routes a serving engine recorded (`--routes FILE`): vLLM's or SGLang's responses with routed experts, SGLang's
per-token dumps or Megatron-Core's router trace with the trainer's token ids (moe_lm/interop/routes/ reads each),
with `--served MODEL`, the model the engine served: any subject whose kind gives its shape (`SubjectKind.shape`: a
moe-lm run, a transformers folder, a GGUF file) numbers the layers and says the experts and top-k, its tokenizer
shows the ids. The record's own sequences are the documents; its routes are experts only (no gate weights, margins
or log-probs). Another subject compared with it runs the record's token ids in the record's sequences; a record
only routes its own tokens. No N1: an engine's record holds what it chose, not a model."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_lm.analysis.subjects.base import (
    SEQ_LEN,
    Flag,
    Settings,
    SubjectKind,
    SubjectRequest,
    register_subject_kind,
    served_shape,
)
from moe_lm.analysis.subjects.loaded import OwnDocuments, Shape, Subject
from moe_lm.errors import UserError
from moe_lm.interop.routes import NO_ROUTES, Record, Sequence, looks_like_record, read_record
from moe_lm.routing.routed_model import BatchRouted, Routed, Window

NO_RECORD_N1 = "an engine's record holds the experts it chose, not a model to initialise afresh"
KEY_TOKENS = 16  # a window's first tokens that find its sequence (then compared whole)


@dataclass(frozen=True)
class RoutesSubject(SubjectRequest):
    kind = "routes"
    path: str
    served: str | None = None  # the model the engine served: a subject whose kind gives its shape

    @property
    def spec(self) -> str:
        return str(self.path)


SERVED: Flag[str | None] = Flag(("--served",), {"metavar": "MODEL", "help": "with --routes: the model the engine "
                                "served (a moe-lm run, a transformers folder or a GGUF file): its layers, experts and "
                                "tokenizer"})  # fmt: skip


class RoutesKind(SubjectKind):
    name, request = "routes", RoutesSubject
    flag = Flag(("--routes",), {"metavar": "FILE", "help": "routes an engine recorded: vLLM's or SGLang's responses "
                                "(JSON lines), SGLang's per-token dumps (.pt, or their folder), or Megatron-Core's "
                                "router trace (router_trace_rank*.jsonl with tokens_rank*.npy, or their folder); with "
                                "--served"})  # fmt: skip
    settings = (SERVED,)
    looks_like = "an engine's record of routes (vLLM, SGLang or Megatron-Core)"
    needs_data = False
    refuses_data = "a record routes only its own tokens"
    gives = frozenset()

    def from_flags(self, spec: str, settings: Settings) -> RoutesSubject:
        return RoutesSubject(spec, served=settings[SERVED], seq_len=settings[SEQ_LEN])

    def recognises(self, spec: str) -> bool:
        return looks_like_record(spec)

    def check(self, settings: Settings, used: bool) -> Settings:
        if used and not settings[SERVED]:
            raise UserError("--routes: give --served MODEL, the checkpoint the engine served (a transformers folder "
                            "or a moe-lm run): an engine's record numbers layers and ids by it")  # fmt: skip
        return settings

    def window_length(self, request: RoutesSubject) -> tuple[int, int | None]:
        longest = max(len(s.routes) for s in cached_record(request.path).sequences)
        return request.seq_len or longest, None

    def shape(self, request: RoutesSubject) -> Shape | None:
        return served_shape(request.served) if request.served else None  # the served model's

    def load(self, request: RoutesSubject) -> Subject:
        if not request.served:
            raise UserError(f"--routes {request.path}: give --served MODEL")
        served = served_shape(request.served)
        record = cached_record(request.path)
        routing = RecordedRoutes(record, served, request.path)
        skipped = "".join(f"; {n:,} {'' if why == NO_ROUTES else 'tokens of '}{why} left out"
                          for why, n in record.skipped.items())  # fmt: skip
        print(f"{request.path}: {record.format}, {len(record.sequences):,} sequences, "
              f"{sum(len(s.routes) for s in record.sequences):,} routed tokens{skipped}")  # fmt: skip
        provenance = {"routes": str(request.path), "format": record.format, **served.provenance}
        length = request.seq_len or max(len(s.routes) for s in record.sequences)
        say_cut(record, length)
        return Subject(routing, served.tok, length, served.vocab_size, provenance, no_untrained=NO_RECORD_N1,
                       documents=own_sequences(record, request.path, length))  # fmt: skip


def own_sequences(record: Record, path: str, length: int) -> OwnDocuments:
    """The record's sequences as its documents, each to its first window; a sequence's domain is its `domain`
    field, else the file's name."""
    named = [s.domain or Path(path).stem for s in record.sequences]
    domains = sorted(set(named))
    docs = [(domains.index(d), s.tokens[: min(len(s.routes), length)])
            for d, s in zip(named, record.sequences, strict=True)]  # fmt: skip
    return OwnDocuments(f"{path} (its own sequences)", lambda: (iter(docs), list(domains)))


def say_cut(record: Record, length: int) -> None:
    """One line when windows shorter than the record's sequences cut them: each is its first window only. why: the
    engine routed a sequence's later tokens with the whole sequence before them; a compared subject cut into windows
    would route them with the window's context only, and every flip there would be the cut context's."""
    longer = [len(s.routes) - length for s in record.sequences if len(s.routes) > length]
    if longer:
        print(f"windows of {length:,} tokens: {len(longer):,} of the record's sequences are longer, each read to "
              f"its first {length:,} tokens ({sum(longer):,} routed tokens left out: the engine routed them with "
              "context a window lacks)")  # fmt: skip


def cached_record(path: str) -> Record:
    """`read_record`, once per file as it is now (the window length, the comparison's windows and the load all ask):
    a rollout file of many sequences takes a while to decode."""
    p = Path(path)
    stamp = (p.stat().st_mtime_ns, p.stat().st_size) if p.exists() else None
    return _read_once(str(p.resolve()), stamp)


@functools.lru_cache(maxsize=1)
def _read_once(path: str, stamp) -> Record:
    return read_record(path)


class RecordedRoutes(BatchRouted):
    """A record as a RoutedModel: each window is looked up among the record's sequences (the same ids from the same
    position), and its rows are the record's experts in the MoE layers (ranked as the record is)."""

    gives = frozenset()

    def __init__(self, record: Record, served: Shape, path: str) -> None:
        self.layers, self.n_experts, self.k = served.layers, served.n_experts, served.k
        self.path, self.ranked = path, record.ranked
        self.sequences = [checked(s, served, f"{path}, sequence {i}", record)
                          for i, s in enumerate(record.sequences)]  # fmt: skip
        self._index: dict[int, dict[bytes, list[int]]] = {}  # key length -> first tokens -> sequences
        self._doc: dict[int, int] = {}  # the trace's document -> the record's sequence
        self._taken: set[int] = set()

    def route_batch(self, windows: list[Window]) -> Routed:
        rows = [self._rows(w) for w in windows]
        return Routed({layer: np.concatenate([r[:, j, :] for r in rows]) for j, layer in enumerate(self.layers)})

    def _rows(self, w: Window) -> np.ndarray:
        """[len(w), MoE layers, k]: the record's experts for the window's tokens."""
        if w.doc not in self._doc:
            self._doc[w.doc] = self._find(w)
        s = self.sequences[self._doc[w.doc]]
        end = w.start + len(w.tokens)
        if end > len(s.routes) or not np.array_equal(s.tokens[w.start : end], w.tokens):
            raise UserError(self._no_match(w))
        if w.start:  # why: the engine routed them with the tokens before the window, the window's subject without
            raise UserError(f"routes {self.path}: document {w.doc} is cut into windows (one starts at token "
                            f"{w.start:,}): the record routed its tokens with the whole sequence before them; "
                            "compare on windows as long as its sequences (--seq-len), or make the record the "
                            "subject")  # fmt: skip
        return s.routes[w.start : end]

    def _find(self, w: Window) -> int:
        """The first sequence not yet taken whose tokens from position 0 are the window's (the same prompt sampled
        several times: the k-th window of those ids takes the k-th sequence, as they were streamed)."""
        key = min(KEY_TOKENS, len(w.tokens))
        starting = self._starting(key) if w.start == 0 else {}
        for i in starting.get(np.asarray(w.tokens[:key], dtype=np.int64).tobytes(), []):
            s = self.sequences[i]
            if i not in self._taken and len(w.tokens) <= len(s.routes):
                if np.array_equal(s.tokens[: len(w.tokens)], w.tokens):
                    self._taken.add(i)
                    return i
        raise UserError(self._no_match(w))

    def _starting(self, key: int) -> dict[bytes, list[int]]:
        """The sequences by their first `key` routed tokens (built once per key length). why routed: the last
        sampled token never ran and no window holds it; a key holding it would find no window of a short sequence."""
        if key not in self._index:
            self._index[key] = {}
            for i, s in enumerate(self.sequences):
                if len(s.routes) >= key:
                    self._index[key].setdefault(s.tokens[:key].tobytes(), []).append(i)
        return self._index[key]

    def _no_match(self, w: Window) -> str:
        return (f"routes {self.path}: no sequence of the record holds the token ids of document {w.doc} at position "
                f"{w.start} ({w.tokens[:8].tolist()}...): a record routes only its own tokens; make it the subject "
                f"(moe-lm analyze --routes {self.path} --served MODEL --compare OTHER)")  # fmt: skip


def checked(s: Sequence, served: Shape, where: str, record: Record) -> Sequence:
    """The sequence with its routes cut to the MoE layers [n, layers, k], or a UserError naming the first thing of
    the record that does not fit the served model (token ids, layer count, dense layers, top-k, expert ids, an
    expert twice in a token's row)."""
    if s.tokens.size and int(s.tokens.max()) >= served.vocab_size:
        raise UserError(f"{where}: token id {int(s.tokens.max())} is past the served model's vocabulary "
                        f"({served.vocab_size:,} ids): recorded with another model")  # fmt: skip
    routes = _engine_axis(s.routes, served, where, record)
    _dense_rows_unrouted(routes, served, where, record.filler)
    routes = routes[:, served.layers, :]
    k = routes.shape[2]
    if k < served.k or (k > served.k and (routes[:, :, served.k :] != record.filler).any()):
        raise UserError(f"{where}: top-{k} routes, the served model chooses {served.k} experts a token: recorded "
                        "with another model")  # fmt: skip
    routes = routes[:, :, : served.k]
    bad = (routes < 0) | (routes >= served.n_experts)
    if bad.any():
        t, layer, j = (int(x[0]) for x in np.nonzero(bad))
        raise UserError(
            f"{where}: token {t}, MoE layer {served.layers[layer]}: expert id {int(routes[t, layer, j])}, not one of "
            f"the served model's {served.n_experts} (a filler where routes were not recorded, or physical slots of an "
            "expert-parallel placement)"
        )
    _distinct(routes, served, where)
    return Sequence(s.tokens, routes, s.domain)


def _engine_axis(routes: np.ndarray, served: Shape, where: str, record: Record) -> np.ndarray:
    """[n, decoder layers, columns]: the routes on the engines' axis of every decoder layer (a trace that names
    its layers has them put in their rows, the filler in the others)."""
    if record.layers is not None:
        if sorted(record.layers) != served.layers:
            raise UserError(f"{where}: routes of layers {record.layers}, the served model's MoE layers are "
                            f"{served.layers}: a pipeline stage's file (Megatron numbers layers within the stage), "
                            "or another model")  # fmt: skip
        return _all_layers(routes, record.layers, served.n_layers, record.filler)
    if routes.ndim == 2:  # SGLang's flat int32 rows
        if routes.shape[1] % served.n_layers:
            raise UserError(f"{where}: {routes.shape[1]} ids per token are not {served.n_layers} layers x top-k: the "
                            "served model has another layer count")  # fmt: skip
        routes = routes.reshape(len(routes), served.n_layers, -1)
    if routes.shape[1] != served.n_layers:
        raise UserError(f"{where}: routes over {routes.shape[1]} layers, the served model has {served.n_layers} "
                        "decoder layers: recorded with another model")  # fmt: skip
    return routes


def _dense_rows_unrouted(routes: np.ndarray, served: Shape, where: str, filler: int) -> None:
    """A UserError where a layer the served model does not route (a dense layer) holds anything but the engine's
    filler: the record routed it, so it was recorded with another layout of layers."""
    dense = [layer for layer in range(served.n_layers) if layer not in served.layers]
    routed = routes[:, dense, :] != filler
    if routed.any():
        t, i, _ = (int(x[0]) for x in np.nonzero(routed))
        raise UserError(f"{where}: token {t}, layer {dense[i]}: experts {routes[t, dense[i]].tolist()} in a layer the "
                        f"served model does not route (its MoE layers are {served.layers}; the engine writes "
                        f"{filler} in the others): recorded with another model")  # fmt: skip


def _distinct(routes: np.ndarray, served: Shape, where: str) -> None:
    """A UserError where a token's row names an expert twice: a router picks k different experts, and overlaps
    counted on such a row would count one expert as two."""
    ordered = np.sort(routes, axis=2)
    twice = (ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=2)
    if twice.any():
        t, layer = (int(x[0]) for x in np.nonzero(twice))
        raise UserError(f"{where}: token {t}, MoE layer {served.layers[layer]}: experts {routes[t, layer].tolist()} "
                        "name one expert twice: not a router's top-k (a row the engine never wrote holds its "
                        "filler)")  # fmt: skip


def _all_layers(routes: np.ndarray, layers: list[int], n_layers: int, filler: int) -> np.ndarray:
    """[n, n_layers, k]: routes of the named `layers` in their rows, `filler` in the others (the engines' axis)."""
    full = np.full((len(routes), n_layers, routes.shape[2]), filler, dtype=np.int64)
    full[:, layers] = routes
    return full


register_subject_kind(RoutesKind())
