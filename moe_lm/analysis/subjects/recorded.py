"""Routes a serving engine recorded (`--routes FILE`): vLLM's or SGLang's responses with routed experts, SGLang's
per-token dumps (moe_lm/interop/engine_routes.py reads them) or Megatron-Core's router trace with the trainer's token
ids (megatron_routes.py), with `--served MODEL`, the checkpoint the engine served
(a transformers folder or a moe-lm run): its config numbers the layers and says the experts and top-k, its tokenizer
shows the ids. The record's own sequences are the documents; its routes are experts only (no gate weights, margins
or log-probs). Another subject compared with it runs the record's token ids in the record's sequences; a record
only routes its own tokens. No N1: an engine's record holds what it chose, not a model."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_lm.analysis.subjects.base import KINDS, Flag, Subject, SubjectKind, SubjectRequest, register_subject_kind
from moe_lm.data.tokenizer import Tokenizer
from moe_lm.errors import UserError
from moe_lm.interop.engine_routes import NO_ROUTES, looks_like_record, read_record
from moe_lm.interop.route_records import Record, Sequence
from moe_lm.routing.routed_model import Routed, Window

NO_RECORD_N1 = "an engine's record holds the experts it chose, not a model to initialise afresh"
KEY_TOKENS = 16  # a window's first tokens that find its sequence (then compared whole)


@dataclass(frozen=True)
class RecordedSubject(SubjectRequest):
    kind = "routes"
    path: str
    served: str | None = None  # the checkpoint the engine served: a transformers folder or a moe-lm run

    @property
    def spec(self) -> str:
        return str(self.path)


@dataclass
class Served:
    """What the record needs of the model the engine served."""

    tok: Tokenizer
    vocab_size: int
    n_layers: int  # decoder layers: the engines' layer axis
    layers: list[int]  # MoE layer ids in the model's numbering
    n_experts: int
    k: int
    provenance: dict


class RecordedKind(SubjectKind):
    name, request = "routes", RecordedSubject
    flag = Flag(("--routes",), {"metavar": "FILE", "help": "routes an engine recorded: vLLM's or SGLang's responses "
                                "(JSON lines), SGLang's per-token dumps (.pt, or their folder), or Megatron-Core's "
                                "router trace (router_trace_rank*.jsonl with tokens_rank*.npy, or their folder); with "
                                "--served"})  # fmt: skip
    settings = (
        Flag(("--served",), {"metavar": "MODEL", "help": "with --routes: the checkpoint the engine served (a "
                             "transformers folder or a moe-lm run): its layers, experts and tokenizer"}),
    )  # fmt: skip
    looks_like = "an engine's record of routes (vLLM, SGLang or Megatron-Core)"
    needs_data = False
    gives = frozenset()

    def from_flags(self, spec: str, args) -> RecordedSubject:
        return RecordedSubject(spec, served=getattr(args, "served", None), seq_len=args.seq_len)

    def recognises(self, spec: str) -> bool:
        return looks_like_record(spec)

    def check(self, args) -> None:
        routes = getattr(args, "routes", None)  # moe-lm ablate has no --routes (a record cannot be rerouted)
        uses = routes or any(self._names_one(c) for c in (getattr(args, "compare", None) or []))
        if uses and not getattr(args, "served", None):
            raise UserError("--routes: give --served MODEL, the checkpoint the engine served (a transformers folder "
                            "or a moe-lm run): an engine's record numbers layers and ids by it")  # fmt: skip
        if routes and getattr(args, "data", None):
            raise UserError(f"--routes {routes}: a record routes only its own tokens; leave out --data")

    def _names_one(self, spec: str) -> bool:
        """Whether --compare `spec` is a record: the first kind that recognises it is this one (a transformers folder
        that also holds a dump is the transformers folder, as `recognise` takes it)."""
        first = next((kind for kind in KINDS.values() if kind.recognises(spec)), None)
        return first is not None and first.name == self.name

    def windows(self, request: RecordedSubject) -> tuple[int, int | None]:
        longest = max(len(s.routes) for s in cached_record(request.path).sequences)
        return request.seq_len or longest, None

    def load(self, request: RecordedSubject) -> Subject:
        if not request.served:
            raise UserError(f"--routes {request.path}: give --served MODEL")
        served = served_model(request.served)
        record = cached_record(request.path)
        routing = RecordedRouting(record, served, request.path)
        skipped = "".join(f"; {n:,} {'' if why == NO_ROUTES else 'tokens of '}{why} left out"
                          for why, n in record.skipped.items())  # fmt: skip
        print(f"{request.path}: {record.format}, {len(record.sequences):,} sequences, "
              f"{sum(len(s.routes) for s in record.sequences):,} routed tokens{skipped}")  # fmt: skip
        provenance = {"routes": str(request.path), "format": record.format, **served.provenance}
        named = [s.domain or Path(request.path).stem for s in record.sequences]  # unnamed: the file's
        domains = sorted(set(named))
        windows = request.seq_len or max(len(s.routes) for s in record.sequences)
        docs = [(domains.index(d), s.tokens[: min(len(s.routes), windows)])
                for d, s in zip(named, record.sequences, strict=True)]  # fmt: skip
        say_cut(record, windows)
        return Subject(routing, served.tok, windows, served.vocab_size, provenance, no_untrained=NO_RECORD_N1,
                       documents=(docs, domains))  # fmt: skip


def say_cut(record: Record, windows: int) -> None:
    """One line when windows shorter than the record's sequences cut them: each is its first window only. why: the
    engine routed a sequence's later tokens with the whole sequence before them; a compared subject cut into windows
    would route them with the window's context only, and every flip there would be the cut context's."""
    longer = [len(s.routes) - windows for s in record.sequences if len(s.routes) > windows]
    if longer:
        print(f"windows of {windows:,} tokens: {len(longer):,} of the record's sequences are longer, each read to "
              f"its first {windows:,} tokens ({sum(longer):,} routed tokens left out: the engine routed them with "
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


class RecordedRouting:
    """A record as a RoutedModel: each window is looked up among the record's sequences (the same ids from the same
    position), and its rows are the record's experts in the MoE layers."""

    gives = frozenset()

    def __init__(self, record: Record, served: Served, path: str) -> None:
        self.layers, self.n_experts, self.k = served.layers, served.n_experts, served.k
        self.path, self.ranked = path, record.ranked
        self.sequences = [checked(s, served, f"{path}, sequence {i}", record)
                          for i, s in enumerate(record.sequences)]  # fmt: skip
        self._index: dict[int, dict[bytes, list[int]]] = {}  # key length -> first tokens -> sequences
        self._doc: dict[int, int] = {}  # the trace's document -> the record's sequence
        self._taken: set[int] = set()

    def __enter__(self) -> RecordedRouting:
        return self

    def __exit__(self, *exc) -> None:
        return None

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


def checked(s: Sequence, served: Served, where: str, record: Record) -> Sequence:
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


def _engine_axis(routes: np.ndarray, served: Served, where: str, record: Record) -> np.ndarray:
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


def _dense_rows_unrouted(routes: np.ndarray, served: Served, where: str, filler: int) -> None:
    """A UserError where a layer the served model does not route (a dense layer) holds anything but the engine's
    filler: the record routed it, so it was recorded with another layout of layers."""
    dense = [layer for layer in range(served.n_layers) if layer not in served.layers]
    routed = routes[:, dense, :] != filler
    if routed.any():
        t, i, _ = (int(x[0]) for x in np.nonzero(routed))
        raise UserError(f"{where}: token {t}, layer {dense[i]}: experts {routes[t, dense[i]].tolist()} in a layer the "
                        f"served model does not route (its MoE layers are {served.layers}; the engine writes "
                        f"{filler} in the others): recorded with another model")  # fmt: skip


def _distinct(routes: np.ndarray, served: Served, where: str) -> None:
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


def served_model(spec: str) -> Served:
    """The layers, experts, top-k and tokenizer of the model an engine served: a moe-lm run or a transformers
    folder (its model built on the meta device: nothing is read but the config and the tokenizer)."""
    import torch

    path = Path(spec)
    if (path / "checkpoints").is_dir():
        from moe_lm.checkpoint.format import checkpoint_folder, parse_run
        from moe_lm.config import load_config
        from moe_lm.data.tokenizer import load_data_tokenizer
        from moe_lm.model import Transformer

        run, tag = parse_run(spec)
        cfg = load_config(checkpoint_folder(run, tag) / "config.yaml")
        with torch.device("meta"):
            model = Transformer(cfg.model)
        layers = [i for i in model.moe_layer_ids() if i < cfg.model.n_layers]
        moe = cfg.model.moe
        return Served(load_data_tokenizer(cfg.data.out_dir), cfg.model.vocab_size, cfg.model.n_layers, layers,
                      moe.n_routed_experts, moe.num_experts_per_tok, {"served": str(run)})  # fmt: skip
    if (path / "config.json").is_file():
        import transformers

        from moe_lm.analysis.hf_routing import GATE
        from moe_lm.analysis.subjects.hf import hf_config
        from moe_lm.data.tokenizer import HFTokenizer

        config = hf_config(spec)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=False)
        gates = {int(m[1]): mod for name, mod in model.named_modules() if (m := GATE.match(name))}
        if not gates:
            raise UserError(f"--served {spec}: no MoE gates (model.layers.<l>.mlp.gate) in this {config.model_type}")
        first = next(iter(gates.values()))
        provenance = {"served": str(path), "model_type": config.model_type}
        return Served(HFTokenizer(path), config.vocab_size, config.num_hidden_layers, sorted(gates),
                      first.num_experts, first.top_k, provenance)  # fmt: skip
    raise UserError(f"--served {spec}: neither a moe-lm run (checkpoints/) nor a transformers folder (config.json)")


register_subject_kind(RecordedKind())
