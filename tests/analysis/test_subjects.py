"""The subjects' room (moe_lm/analysis/subjects/): every registered kind loads into a Subject whose routing satisfies
the RoutedModel contract (moe_lm/routing/routed_model.py) and gives what the kind declares, and its shape (read
without its weights) is the shape of what it loaded; the hf kind whole and streamed from disk alike. A new kind is
one class registered in a few lines, and `--compare` then recognises it, records it and reports it, metrics that need
gate weights saying so when it gives none; one that declares its shape serves an engine's record (`--served`)."""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from moe_lm.analysis.recording import record_trace
from moe_lm.analysis.subjects import (
    DEFAULT_WINDOW_LENGTH,
    KINDS,
    SEQ_LEN,
    Flag,
    Settings,
    Shape,
    Subject,
    SubjectKind,
    SubjectRequest,
    load_subject,
    served_shape,
)
from moe_lm.analysis.subjects.hf import MAX_MEMORY, hf_config
from moe_lm.analysis.subjects.routes import SERVED
from moe_lm.cli.subject import settings_flags
from moe_lm.data.tokenizer import load_data_tokenizer
from moe_lm.interop.hf_layers import HFCheckpoint
from moe_lm.routing.routed_model import OPTIONAL, BatchRouted, Routed, RoutedModel, Window

TEXT = "the telescope tracked a distant galaxy"


def test_every_kind_gives_a_routed_model_with_what_it_declares(tiny_run, cli, tmp_path):
    assert cli("export", "--run", tiny_run, "--out", tmp_path / "hf", "--gguf", tmp_path / "m.gguf").returncode == 0
    specs = {"run": str(tiny_run), "hf": str(tmp_path / "hf"), "gguf": str(tmp_path / "m.gguf"),
             "routes": str(engine_record(tiny_run, tmp_path / "vllm.jsonl"))}  # fmt: skip
    assert set(KINDS) == set(specs), "a kind without a case here: add one"
    contract = typing.get_type_hints(RoutedModel)
    settings = Settings.defaults(settings_flags(list(KINDS.values()))).replaced(Settings({SERVED: str(tiny_run)}))
    shapes = set()
    for name, spec in specs.items():
        kind = KINDS[name]
        assert [k.name for k in KINDS.values() if k.recognises(spec)] == [name]  # recognised by what it is, once
        request = kind.from_flags(spec, settings.only(kind.flags()))
        assert isinstance(request, kind.request) and request.kind == name and request.label == spec
        subject = load_subject(request)
        routing = subject.routing
        assert isinstance(routing, RoutedModel) and all(hasattr(routing, field) for field in contract)
        assert routing.gives == kind.gives and set(routing.gives) <= set(OPTIONAL)
        shapes.add((tuple(routing.layers), routing.n_experts, routing.k))
        same_shape(kind.shape(request), subject)
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


def test_the_hf_kind_streamed_from_disk_routes_as_it_does_whole(tiny_run, cli, tmp_path):
    """A transformers folder given less memory than its weights take is streamed a layer at a time: the same
    contract, the same shape, and the very experts and gate weights of the model run whole (float32)."""
    assert cli("export", "--run", tiny_run, "--out", tmp_path / "hf").returncode == 0
    kind, spec = KINDS["hf"], str(tmp_path / "hf")
    settings = Settings.defaults(kind.flags())
    whole = load_subject(kind.from_flags(spec, settings))
    weights = sum(f.stat().st_size for f in (tmp_path / "hf").glob("*.safetensors"))
    request = kind.for_analysis(kind.from_flags(spec, settings.replaced(Settings({MAX_MEMORY: weights // 2}))),
                                tmp_path / "work", None)  # fmt: skip
    streamed = load_subject(request)
    assert isinstance(streamed.routing, RoutedModel) and streamed.routing.reroutable() is None
    assert whole.routing.reroutable() is not None  # a model held whole is one `moe-lm ablate` routes around
    assert streamed.routing.gives == kind.gives  # streamed, every column the kind declares, the output norms too
    assert streamed.routing.windows_per_pass(16, 1024, 129_280) == 16
    same_shape(kind.shape(request), streamed)
    docs = [(0, np.asarray(load_data_tokenizer_ids(tiny_run) * 3))]
    traces = [record_trace(s.routing, docs, tmp_path / name, ["a"], 16, progress=False)
              for name, s in (("whole", whole), ("streamed", streamed))]  # fmt: skip
    assert traces[1].meta["streamed"]["read_bytes"] > 0 and "streamed" not in traces[0].meta
    for layer in traces[0].layers:
        assert np.array_equal(traces[0].experts(layer), traces[1].experts(layer))
        assert np.array_equal(traces[0].weights(layer), traces[1].weights(layer))
        np.testing.assert_allclose(np.asarray(traces[1].norms(layer), np.float64),
                                   np.asarray(traces[0].norms(layer), np.float64), rtol=2e-3, atol=1e-6)  # fmt: skip
    # the experts' output norms of MoE layers run whole too (the experts module again, a slot a row; above, their
    # experts came in chunks): a budget just below the weights, so that every layer fits half of it
    held = 4 * HFCheckpoint(spec, hf_config(spec)).numel()  # the float32 weights the analysis holds
    request = replace(request, max_memory=held - 1, work=str(tmp_path / "work_whole"))
    streamed = load_subject(request)
    assert all(u.whole for u in streamed.routing.units)
    trace = record_trace(streamed.routing, docs, tmp_path / "streamed_whole", ["a"], 16, progress=False)
    assert trace.meta["streamed"]["read_bytes"] > 0
    for layer in traces[0].layers:
        assert np.array_equal(traces[0].experts(layer), trace.experts(layer))
        np.testing.assert_allclose(np.asarray(trace.norms(layer), np.float64),
                                   np.asarray(traces[0].norms(layer), np.float64), rtol=2e-3, atol=1e-6)  # fmt: skip


def same_shape(shape: Shape, subject: Subject) -> None:
    """A kind's shape, read without weights, is the shape of the subject it loads: layers, experts, top-k, decoder
    layers, vocabulary and what each id the test's text uses stands for."""
    routing = subject.routing
    assert (shape.layers, shape.n_experts, shape.k) == (routing.layers, routing.n_experts, routing.k)
    assert shape.vocab_size == subject.vocab_size and shape.n_layers > max(shape.layers)
    ids = subject.tok.encode(TEXT)
    assert [shape.tok.token_bytes(i) for i in ids] == [subject.tok.token_bytes(i) for i in ids]


def engine_record(run: Path, path: Path, texts: tuple[str, ...] = (TEXT,)) -> Path:
    """The run's routes of each text (a window each), as vLLM returns them (moe_lm/interop/routes/vllm.py)."""
    from moe_lm.analysis.subjects.run import RunSubject
    from moe_lm.checkpoint.format import parse_run
    from moe_lm.interop.routes.record import engine_routes
    from moe_lm.interop.routes.vllm import vllm_response

    served = served_shape(str(run))
    lines = []
    for text in texts:
        tokens = np.asarray(load_data_tokenizer_ids(run, text))
        with load_subject(RunSubject(run=parse_run(str(run)))).routing as routing:
            experts = routing.route_batch([Window(0, 0, 0, tokens)]).experts
        routes = engine_routes(experts, served.n_layers, served.k, 0)
        lines.append(json.dumps(vllm_response(np.append(tokens, 0), 4, routes, served.n_experts)) + "\n")
    path.write_text("".join(lines))
    return path


def load_data_tokenizer_ids(run: Path, text: str = TEXT) -> list[int]:
    from moe_lm.config import load_config

    cfg = load_config(next((run / "checkpoints").glob("step_*")) / "config.yaml")
    tok = load_data_tokenizer(cfg.data.out_dir)
    return [tok.doc_start_id, *tok.encode(text)]


# ---- a kind of subject written in a few lines: routes that another tool recorded, experts only


@dataclass(frozen=True)
class ToySubject(SubjectRequest):
    kind = "toy"
    path: str

    @property
    def spec(self) -> str:
        return self.path


class ToyRouting(BatchRouted):
    """Expert (t + j) % E for token id t and rank j: what a file of recorded routes would hold, without weights."""

    gives = frozenset()

    def __init__(self, layers: list[int], n_experts: int, k: int) -> None:
        self.layers, self.n_experts, self.k = layers, n_experts, k

    def route_batch(self, windows: list[Window]) -> Routed:
        tokens = np.concatenate([w.tokens for w in windows]).astype(np.int64)
        chosen = (tokens[:, None] + np.arange(self.k)[None]) % self.n_experts
        return Routed({layer: chosen for layer in self.layers})


class ToyKind(SubjectKind):
    name, request, looks_like = "toy", ToySubject, "a toy folder (toy.json)"
    flag = Flag(("--toy",), {"metavar": "DIR", "help": "a toy subject"})

    def from_flags(self, spec: str, settings: Settings) -> ToySubject:
        return ToySubject(spec, seq_len=settings[SEQ_LEN])

    def recognises(self, spec: str) -> bool:
        return (Path(spec) / "toy.json").is_file()

    def window_length(self, request: ToySubject) -> tuple[int, int | None]:
        return request.seq_len or DEFAULT_WINDOW_LENGTH, None

    def load(self, request: ToySubject) -> Subject:
        toy = json.loads((Path(request.path) / "toy.json").read_text())
        tok = load_data_tokenizer(toy["data"])
        routing = ToyRouting(toy["layers"], toy["n_experts"], toy["k"])
        return Subject(routing, tok, request.seq_len or DEFAULT_WINDOW_LENGTH, tok.vocab_size, {"toy": request.path},
                       no_untrained="a toy has none")  # fmt: skip

    def shape(self, request: ToySubject) -> Shape:
        toy = json.loads((Path(request.path) / "toy.json").read_text())
        tok = load_data_tokenizer(toy["data"])
        return Shape(tok, tok.vocab_size, toy["n_layers"], toy["layers"], toy["n_experts"], toy["k"],
                     {"served": request.path})  # fmt: skip


def toy_folder(folder: Path, run: Path, layers: list[int]) -> Path:
    """A toy subject of the run's data, experts, top-k and decoder layers, routing `layers`."""
    from moe_lm.config import load_config

    cfg = load_config(next((run / "checkpoints").glob("step_*")) / "config.yaml")
    moe = cfg.model.moe
    folder.mkdir()
    (folder / "toy.json").write_text(json.dumps({"data": cfg.data.out_dir, "layers": layers, "n_layers":
                                                 cfg.model.n_layers, "n_experts": moe.n_routed_experts, "k":
                                                 moe.num_experts_per_tok}))  # fmt: skip
    return folder


def test_a_new_kind_is_one_class_and_compare_takes_it(tiny_run, cli, tmp_path, monkeypatch):
    monkeypatch.setitem(KINDS, "toy", ToyKind())
    from moe_lm.config import load_config

    cfg = load_config(next((tiny_run / "checkpoints").glob("step_*")) / "config.yaml")
    moe = cfg.model.moe
    toy = toy_folder(tmp_path / "recorded", tiny_run, [1])
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
    # --compare's help lists what a subject can be, the new kind among them
    assert "a toy folder (toy.json)" in " ".join(cli("analyze", "--help").stdout.split())


def test_a_kind_that_declares_its_shape_serves_an_engines_record(tiny_run, cli, tmp_path, monkeypatch):
    """`--served` takes any subject whose kind gives its shape: the toy kind, registered here and nowhere else,
    numbers the layers of a vLLM record of the run's routes, and the report holds the run's experts."""
    monkeypatch.setitem(KINDS, "toy", ToyKind())
    run = served_shape(str(tiny_run))
    toy = toy_folder(tmp_path / "served", tiny_run, run.layers)
    texts = tuple(f"{TEXT} and {word} stars in the night sky" for word in ("red", "blue", "old"))
    record = engine_record(tiny_run, tmp_path / "vllm.jsonl", texts)
    out = tmp_path / "a"
    proc = cli("analyze", "--routes", record, "--served", toy, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((out / "trace" / "meta.json").read_text())
    assert meta["provenance"]["served"] == str(toy) and meta["layers"] == run.layers and meta["n_docs"] == 3
    with load_subject(KINDS["run"].from_flags(str(tiny_run), Settings.defaults(KINDS["run"].flags()))).routing as r:
        routed = [r.route_batch([Window(0, 0, 0, np.asarray(load_data_tokenizer_ids(tiny_run, text)))]).experts
                  for text in texts]  # fmt: skip
    for layer in run.layers:
        traced = np.fromfile(out / "trace" / f"experts_L{layer}.u8", np.uint8).reshape(-1, run.k)
        assert np.array_equal(traced, np.concatenate([experts[layer] for experts in routed]))
