"""The subjects' room (moe_lm/analysis/subjects/): every registered kind loads into a Subject whose routing satisfies
the RoutedModel contract (moe_lm/routing/routed_model.py) and gives what the kind declares; a new kind is one class
registered in a few lines, and `--compare` then recognises it, records it and reports it, metrics that need gate
weights saying so when it gives none."""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_lm.analysis.subjects import KINDS, Flag, Subject, SubjectKind, SubjectRequest, load_subject
from moe_lm.analysis.subjects.base import DEFAULT_WINDOWS
from moe_lm.data.tokenizer import load_data_tokenizer
from moe_lm.routing.routed_model import OPTIONAL, Routed, RoutedModel, Window


def test_every_kind_gives_a_routed_model_with_what_it_declares(tiny_run, cli, tmp_path):
    assert cli("export", "--run", tiny_run, "--out", tmp_path / "hf", "--gguf", tmp_path / "m.gguf").returncode == 0
    specs = {"run": str(tiny_run), "hf": str(tmp_path / "hf"), "gguf": str(tmp_path / "m.gguf"),
             "routes": str(engine_record(tiny_run, tmp_path / "vllm.jsonl"))}  # fmt: skip
    assert set(KINDS) == set(specs), "a kind without a case here: add one"
    contract = typing.get_type_hints(RoutedModel)
    args = type("Args", (), {"seq_len": None, "dtype": "float32", "device": "cpu", "threads": 1, "max_memory": None,
                             "llama_defaults": False, "served": str(tiny_run)})()  # fmt: skip
    shapes = set()
    for name, spec in specs.items():
        kind = KINDS[name]
        assert [k.name for k in KINDS.values() if k.recognises(spec)] == [name]  # recognised by what it is, once
        request = kind.from_flags(spec, args)
        assert isinstance(request, kind.request) and request.kind == name and request.label == spec
        subject = load_subject(request)
        routing = subject.routing
        assert isinstance(routing, RoutedModel) and all(hasattr(routing, field) for field in contract)
        assert routing.gives == kind.gives and set(routing.gives) <= set(OPTIONAL)
        shapes.add((tuple(routing.layers), routing.n_experts, routing.k))
        window = Window(0, 0, 0, np.asarray(load_data_tokenizer_ids(tiny_run)))
        with routing:
            routed = routing.route_batch([window])
        for layer in routing.layers:
            assert routed.experts[layer].shape == (len(window.tokens), routing.k)
        assert (routed.weights is not None) == ("weights" in kind.gives)
        assert (routed.logprob is not None) == ("logprob" in kind.gives)
        assert bool(routed.margins) == ("margins" in kind.gives)
        assert (subject.untrained is None) == bool(subject.no_untrained)
    assert len(shapes) == 1  # the same model, whichever way it is read


def engine_record(run: Path, path: Path) -> Path:
    """The run's routes of the test's window, as vLLM returns them (moe_lm/interop/engine_routes.py)."""
    from moe_lm.analysis.subjects.recorded import served_model
    from moe_lm.analysis.subjects.run import RunSubject
    from moe_lm.checkpoint.format import parse_run
    from moe_lm.interop.engine_routes import engine_routes, vllm_response

    tokens = np.asarray(load_data_tokenizer_ids(run))
    with load_subject(RunSubject(run=parse_run(str(run)))).routing as routing:
        experts = routing.route_batch([Window(0, 0, 0, tokens)]).experts
    served = served_model(str(run))
    routes = engine_routes(experts, served.n_layers, served.k, 0)
    path.write_text(json.dumps(vllm_response(np.append(tokens, 0), 4, routes, served.n_experts)) + "\n")
    return path


def load_data_tokenizer_ids(run: Path) -> list[int]:
    from moe_lm.config import load_config

    cfg = load_config(next((run / "checkpoints").glob("step_*")) / "config.yaml")
    tok = load_data_tokenizer(cfg.data.out_dir)
    return [tok.doc_start_id, *tok.encode("the telescope tracked a distant galaxy")]


# ---- a kind of subject written in a few lines: routes that another tool recorded, experts only


@dataclass(frozen=True)
class ToySubject(SubjectRequest):
    kind = "toy"
    path: str

    @property
    def spec(self) -> str:
        return self.path


class ToyRouting:
    """Expert (t + j) % E for token id t and rank j: what a file of recorded routes would hold, without weights."""

    gives = frozenset()

    def __init__(self, layers: list[int], n_experts: int, k: int) -> None:
        self.layers, self.n_experts, self.k = layers, n_experts, k

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def route_batch(self, windows: list[Window]) -> Routed:
        tokens = np.concatenate([w.tokens for w in windows]).astype(np.int64)
        chosen = (tokens[:, None] + np.arange(self.k)[None]) % self.n_experts
        return Routed({layer: chosen for layer in self.layers})


class ToyKind(SubjectKind):
    name, request, looks_like = "toy", ToySubject, "a toy folder (toy.json)"
    flag = Flag(("--toy",), {"metavar": "DIR", "help": "a toy subject"})

    def from_flags(self, spec: str, args) -> ToySubject:
        return ToySubject(spec, seq_len=args.seq_len)

    def recognises(self, spec: str) -> bool:
        return (Path(spec) / "toy.json").is_file()

    def windows(self, request: ToySubject) -> tuple[int, int | None]:
        return request.seq_len or DEFAULT_WINDOWS, None

    def load(self, request: ToySubject) -> Subject:
        toy = json.loads((Path(request.path) / "toy.json").read_text())
        tok = load_data_tokenizer(toy["data"])
        routing = ToyRouting(toy["layers"], toy["n_experts"], toy["k"])
        return Subject(routing, tok, request.seq_len or DEFAULT_WINDOWS, tok.vocab_size, {"toy": request.path},
                       no_untrained="a toy has none")  # fmt: skip


def test_a_new_kind_is_one_class_and_compare_takes_it(tiny_run, cli, tmp_path, monkeypatch):
    monkeypatch.setitem(KINDS, "toy", ToyKind())
    from moe_lm.config import load_config

    cfg = load_config(next((tiny_run / "checkpoints").glob("step_*")) / "config.yaml")
    moe = cfg.model.moe
    toy = tmp_path / "recorded"
    toy.mkdir()
    (toy / "toy.json").write_text(json.dumps({"data": cfg.data.out_dir, "layers": [1], "n_experts":
                                              moe.n_routed_experts, "k": moe.num_experts_per_tok}))  # fmt: skip
    out = tmp_path / "a"
    proc = cli("analyze", "--run", tiny_run, "--compare", toy, "--out", out, "--max-tokens", "800",
               "--no-init-baseline")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    c = json.loads((out / "metrics.json").read_text())["comparisons"][str(toy)]
    assert c["provenance"] == {"toy": str(toy)} and c["logprob"] is None
    assert c["layers"]["1"]["weights"]["needs"].startswith("the gate weights of both subjects")
    meta = json.loads((out / "trace_compare_0" / "meta.json").read_text())
    assert meta["columns"] == [] and not list((out / "trace_compare_0").glob("weights_*"))
    # the flips are what the two traces hold, recounted here
    ours = np.fromfile(out / "trace" / "experts_L1.u8", np.uint8).reshape(-1, moe.num_experts_per_tok)
    token = np.fromfile(out / "trace" / "token.u32", np.uint32).astype(np.int64)
    theirs = (token[:, None] + np.arange(moe.num_experts_per_tok)[None]) % moe.n_routed_experts
    flips = np.mean([set(a) != set(b) for a, b in zip(ours.tolist(), theirs.tolist(), strict=True)])
    assert c["layers"]["1"]["flip_rate"]["mean"] == flips
    # as the subject itself, with its own flag: the report of routes without gate weights or log-probs
    (tmp_path / "docs.txt").write_text("the telescope tracked a distant galaxy and the stars " * 30)
    proc = cli("analyze", "--toy", toy, "--data", tmp_path / "docs.txt", "--out", tmp_path / "b")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no untrained baseline N1: a toy has none" in proc.stdout
    result = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert result["trace"]["tokens"] > 0 and "vocabulary_specialisation" in result["layers"]["1"]
    assert "e" in (tmp_path / "b" / "routing.html").read_text()
