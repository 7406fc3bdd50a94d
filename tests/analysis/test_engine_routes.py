"""Routes recorded by serving engines as subjects (moe_lm/interop/routes/, subjects/routes.py).

The fixtures are written as each engine writes its record (moe_lm.testing.trace_as_engine_record), from the engines'
own code: vLLM 0.33.0 (commit 4ba787ec9) `vllm/entrypoints/openai/completion/protocol.py` CompletionResponseChoice
(prompt_token_ids, token_ids, routed_experts = base64 of .npy [tokens - 1, num_hidden_layers, top_k]) and
`routed_experts_capturer.py`; SGLang 0.5.23 `srt/managers/detokenizer_manager.py` (meta_info.routed_experts = base64
of int32 bytes, [tokens - 1, num_hidden_layers, top_k]) and `srt/eplb/expert_distribution.py` (per-token dumps:
records of input_ids, positions, extend_seq_lens, topk_ids_of_layer [layers, tokens, 8] with -1, physical slots,
last_physical_to_logical_map); Megatron-Core at 059f0f5c `megatron/core/transformer/moe/router_trace.py` (a JSON
line per router call: step, block, layer, num_tokens, top_indices in [sequence, batch] row order, ascending ids; no
token ids, so the trainer's micro-batches as tokens_rank{r}.npy). A moe-lm trace written in an engine's format and
read back agrees with the run on every token and layer.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_lm.analysis.subjects import served_shape
from moe_lm.files import read_small
from moe_lm.interop.routes import (
    FORMATS,
    Record,
    RouteFormat,
    Sequence,
    looks_like_record,
    read_record,
    register_route_format,
)
from moe_lm.interop.routes.sglang import sglang_response
from moe_lm.interop.routes.vllm import vllm_response
from moe_lm.routing.trace import Trace
from moe_lm.testing import trace_as_engine_record


def refused(proc, *needles: str) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert all(n in proc.stderr for n in needles), proc.stderr[-3000:]
    return proc.stderr


@pytest.fixture(scope="module")
def served(tiny_run):
    """The shared run's layers (all of them: the engines' axis), MoE layers, experts and top-k."""
    return served_shape(str(tiny_run))


@pytest.fixture(scope="module")
def run_trace(tiny_run, cli, tmp_path_factory):
    out = tmp_path_factory.mktemp("engine") / "run"
    proc = cli("analyze", "--run", tiny_run, "--out", out, "--max-tokens", "1500", "--no-init-baseline")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "trace"


def replicas(served) -> np.ndarray:
    """An EPLB-like placement [layers, slots]: every expert once, slots out of logical order, then replicas of the
    first three."""
    order = [*np.random.default_rng(0).permutation(served.n_experts).tolist(), 0, 1, 2]
    return np.array([order] * served.n_layers)


def recount(record: Path, engine: str, served) -> dict[int, np.ndarray]:
    """Each MoE layer's expert loads counted from the raw files alone, as the engines' docs describe them: vLLM's
    base64 .npy and SGLang's base64 int32 (null or absent routes skipped), the rank-0 dump's prefills mapped by its
    own map (rank 1 is its tensor-parallel copy), Megatron's rank-0 decoder records halved (recompute traces each
    micro-batch twice)."""
    counts = {layer: np.zeros(served.n_experts, dtype=np.int64) for layer in served.layers}
    rows = []  # [tokens, layers, columns] per sequence, in the engines' layer axis
    if engine == "vllm":
        for line in record.read_text().splitlines():
            for choice in json.loads(line)["choices"]:
                if choice["routed_experts"] is not None:
                    rows.append(np.load(io.BytesIO(base64.b64decode(choice["routed_experts"]))))
    elif engine == "sglang":
        for line in record.read_text().splitlines():
            if "routed_experts" in (meta := json.loads(line)["meta_info"]):
                flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
                rows.append(flat.reshape(-1, served.n_layers, served.k))
    elif engine == "dump":
        dump = torch.load(next(record.glob("*_0.pt")), weights_only=True)
        slots = dump["last_physical_to_logical_map"].numpy()
        for rec in dump["records"]:
            if rec["extend_seq_lens"] is not None:
                topk = rec["topk_ids_of_layer"].numpy()[:, :, : served.k]
                rows.append(np.take_along_axis(slots[:, None], topk.clip(0), axis=2).transpose(1, 0, 2))
    for r in rows:
        for layer in served.layers:
            counts[layer] += np.bincount(r[:, layer].ravel().astype(np.int64), minlength=served.n_experts)
    if engine == "megatron":
        for line in (record / "router_trace_rank0.jsonl").read_text().splitlines():
            rec = json.loads(line)
            counts[rec["layer"]] += np.bincount(np.ravel(rec["top_indices"]), minlength=served.n_experts)
        counts = {layer: c // 2 for layer, c in counts.items()}
    return counts


def loads_are_the_recount(out: Path, record: Path, engine: str, served) -> None:
    """metrics.json's load and the trace's experts, per MoE layer, equal `recount` of the raw files."""
    metrics = json.loads((out / "metrics.json").read_text())
    trace = Trace(out / "trace")
    for layer, expected in recount(record, engine, served).items():
        assert metrics["layers"][str(layer)]["load"] == expected.tolist(), layer
        traced = np.bincount(np.asarray(trace.experts(layer)).ravel().astype(np.int64), minlength=served.n_experts)
        assert traced.tolist() == expected.tolist(), layer


def with_extras(record: Path, engine: str, run_trace) -> None:
    """What the engines write beside the run's sequences: an aborted request's response (vLLM: routed_experts
    null; SGLang: no routed_experts, finish_reason abort), a tensor-parallel rank's copy of the dump."""
    tokens = np.asarray(Trace(run_trace).token[:8], dtype=np.int64)
    if engine == "dump":
        (dump,) = record.glob("*_0.pt")
        shutil.copy(dump, dump.with_name(dump.name.replace("_0.pt", "_1.pt")))
        return
    aborted = vllm_response(tokens, 4, None, 8) if engine == "vllm" else sglang_response(tokens, 4, None)
    with open(record, "a") as f:
        f.write(json.dumps(aborted) + "\n")


@pytest.mark.parametrize("engine", ["vllm", "sglang", "dump"])
def test_a_trace_written_as_an_engine_writes_it_reads_back_as_the_run_routed_it(engine, run_trace, served, tiny_run,
                                                                                cli, tmp_path):  # fmt: skip
    """... and each expert's load in metrics.json and in the trace is a recount of the raw files."""
    record = tmp_path / ("dumps" if engine == "dump" else f"{engine}.jsonl")
    n = trace_as_engine_record(run_trace, record, engine, served.n_layers, replicas(served))
    with_extras(record, engine, run_trace)
    out = tmp_path / "out"
    proc = cli("analyze", "--routes", record, "--served", tiny_run, "--compare", tiny_run, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{n:,} sequences" in proc.stdout and "no untrained baseline N1" in proc.stdout
    loads_are_the_recount(out, record, engine, served)
    metrics = json.loads((out / "metrics.json").read_text())
    c = metrics["comparisons"][str(tiny_run)]
    assert c["tokens_differing_in_any_layer"]["mean"] == 0.0
    assert all(m["flips"] == 0 and m["top1_agreement"]["mean"] == 1.0 for m in c["layers"].values())
    # the record's tokens are the run's trace's, in the same order
    mine, run = (np.fromfile(t / "token.u32", dtype=np.uint32) for t in (out / "trace", run_trace))
    assert np.array_equal(mine, run)


def test_several_ranks_and_steps_that_are_not_prefills(run_trace, served, tiny_run, cli, tmp_path):
    """Every rank of plain tensor parallelism dumps the same passes (read once); decode steps lack their request's
    earlier tokens (counted, left out); ids are physical slots, mapped by the dump's own map."""
    folder = tmp_path / "dumps"
    n = trace_as_engine_record(run_trace, folder, "dump", served.n_layers, replicas(served))
    (dump,) = folder.glob("*.pt")
    data = torch.load(dump, weights_only=True)
    data["records"].append({"forward_pass_id": 99, "rank": 0, "input_ids": [5, 6], "positions": [40, 17],
                            "extend_seq_lens": None, "forward_mode": 2,
                            "topk_ids_of_layer": torch.zeros(served.n_layers, 2, 8, dtype=torch.int32)})  # fmt: skip
    torch.save(data, dump)
    torch.save(data, folder / "expert_distribution_recorder_1700000000.0_1.pt")
    proc = cli("analyze", "--routes", folder, "--served", tiny_run, "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{n:,} sequences" in proc.stdout and "2 tokens of decode steps left out" in proc.stdout


def _one_line(record, edit) -> None:
    lines = record.read_text().splitlines()
    obj = json.loads(lines[0])
    edit(obj)
    record.write_text("\n".join([json.dumps(obj), *lines[1:]]) + "\n")


def _sglang_routes(obj) -> np.ndarray:
    return np.frombuffer(base64.b64decode(obj["meta_info"]["routed_experts"]), dtype=np.int32).copy()


def _set_routes(obj, flat: np.ndarray) -> None:
    obj["meta_info"]["routed_experts"] = base64.b64encode(flat.astype(np.int32).tobytes()).decode()


def _filler(obj, served) -> None:
    flat = _sglang_routes(obj).reshape(-1, served.n_layers, served.k)
    flat[3, served.layers[0], 1] = 255
    _set_routes(obj, flat.ravel())


def _top_more(obj, served) -> None:
    flat = _sglang_routes(obj).reshape(-1, served.n_layers, served.k)
    _set_routes(obj, np.concatenate([flat, flat[:, :, :1]], axis=2).ravel())


@pytest.mark.parametrize(
    "edit, needles",
    [
        (lambda o, _: o["input_ids"].__setitem__(0, 10**6), ["sequence 0", "token id 1000000", "vocabulary"]),
        (lambda o, _: _set_routes(o, _sglang_routes(o)[:-1]), ["line 1", "not a whole number of rows", "cut short"]),
        (lambda o, _: o.__setitem__("routed_experts_start_len", 2), ["line 1", "start at token 2", "record with"]),
        (lambda o, _: o["meta_info"].__setitem__("routed_experts", "%%%"), ["line 1", "not base64"]),
        (lambda o, _: o.pop("input_ids"), ["line 1", "input_ids", "add the request's input_ids"]),
        (_filler, ["token 3, MoE layer", "expert id 255", "filler"]),
        (_top_more, ["routes", "the served model chooses"]),
    ],
)
def test_a_record_that_does_not_fit_is_one_line_naming_the_first_mismatch(edit, needles, run_trace, served, tiny_run,
                                                                          cli, tmp_path):  # fmt: skip
    record = tmp_path / "sglang.jsonl"
    trace_as_engine_record(run_trace, record, "sglang", served.n_layers)
    _one_line(record, lambda obj: edit(obj, served))
    refused(cli("analyze", "--routes", record, "--served", tiny_run, "--out", tmp_path / "out"), *needles)
    assert not (tmp_path / "out" / "metrics.json").exists()


def test_other_layer_counts_other_tokens_and_a_missing_model_are_refused(run_trace, served, tiny_run, cli, tmp_path):
    record = tmp_path / "vllm.jsonl"
    trace_as_engine_record(run_trace, record, "vllm", served.n_layers + 2)
    refused(cli("analyze", "--routes", record, "--served", tiny_run, "--out", tmp_path / "a"),
            f"routes over {served.n_layers + 2} layers", f"{served.n_layers} decoder layers")  # fmt: skip
    trace_as_engine_record(run_trace, record, "vllm", served.n_layers)
    refused(cli("analyze", "--routes", record, "--out", tmp_path / "b"), "give --served MODEL")
    # the record is asked to route documents it never saw (the run's validation split)
    refused(cli("analyze", "--run", tiny_run, "--compare", record, "--served", tiny_run, "--out", tmp_path / "c"),
            "no sequence of the record holds the token ids", "make it the subject")  # fmt: skip
    refused(cli("analyze", "--routes", record, "--served", tiny_run, "--data", record, "--out", tmp_path / "d"),
            "leave out --data")  # fmt: skip


def test_a_record_of_a_served_transformers_checkpoint_lines_up_with_that_checkpoint(run_trace, served, tiny_run, cli,
                                                                                   tmp_path):  # fmt: skip
    """What engines serve: a transformers folder; --served reads its layers from its config (the model on the meta
    device) and its tokenizer, and --compare runs the checkpoint itself on the record's sequences."""
    assert cli("export", "--run", tiny_run, "--out", tmp_path / "hf").returncode == 0
    record = tmp_path / "vllm.jsonl"
    trace_as_engine_record(run_trace, record, "vllm", served.n_layers)
    out = tmp_path / "out"
    proc = cli("analyze", "--routes", record, "--served", tmp_path / "hf", "--compare", tmp_path / "hf", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    c = json.loads((out / "metrics.json").read_text())["comparisons"][str(tmp_path / "hf")]
    assert c["tokens_differing_in_any_layer"]["mean"] == 0.0


def test_aborted_requests_without_routes_are_counted_and_left_out(run_trace, served, tiny_run, cli, tmp_path):
    """Both engines return null routes for a request aborted before its first forward pass (their protocols say so):
    such responses are counted and left out; a file of nothing else says how to record routes."""
    record = tmp_path / "vllm.jsonl"
    n = trace_as_engine_record(run_trace, record, "vllm", served.n_layers)
    _one_line(record, lambda obj: obj["choices"][0].__setitem__("routed_experts", None))
    proc = cli("analyze", "--routes", record, "--served", tiny_run, "--out", tmp_path / "a")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{n - 1:,} sequences" in proc.stdout
    assert "1 responses whose routes are null (aborted requests) left out" in proc.stdout
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    for obj in lines:
        obj["choices"][0]["routed_experts"] = None
    record.write_text("".join(json.dumps(obj) + "\n" for obj in lines))
    refused(cli("analyze", "--routes", record, "--served", tiny_run, "--out", tmp_path / "b"),
            "no response holds routes", "--enable-return-routed-experts")  # fmt: skip


def test_megatron_router_trace_with_the_trainers_tokens_reads_back_as_the_run_routed_it(run_trace, served, tiny_run,
                                                                                       cli, tmp_path):  # fmt: skip
    """Megatron-Core's router trace (megatron/core/transformer/moe/router_trace.py at 059f0f5c) holds no token ids,
    its rows in [sequence, batch] order, each token's experts ascending (the routing map's nonzero()), and activation
    recompute's records twice: with the trainer's tokens file it agrees with the run on every token's experts, and
    the metrics of a first choice say they are not known."""
    folder = tmp_path / "megatron"
    n = trace_as_engine_record(run_trace, folder, "megatron", served.n_layers)
    assert n >= 4  # two steps of two micro-batches
    out = tmp_path / "out"
    proc = cli("analyze", "--routes", folder, "--served", tiny_run, "--compare", tiny_run, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"megatron router trace, {n:,} sequences" in proc.stdout
    assert "routes repeated by activation recompute left out" in proc.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    c = metrics["comparisons"][str(tiny_run)]
    assert c["tokens_differing_in_any_layer"]["mean"] == 0.0  # rows put back in token order, or experts would differ
    assert all(m["flips"] == 0 and m["top1_agreement"] is None for m in c["layers"].values())
    assert all(lm["repetition"]["same_first"] is None and lm["repetition"]["topk_overlap"] > 0
               for lm in metrics["layers"].values())  # fmt: skip
    assert "not known (unranked experts)" in (out / "routing.html").read_text()
    loads_are_the_recount(out, folder, "megatron", served)


def _megatron_lines(folder, edit) -> None:
    trace = folder / "router_trace_rank0.jsonl"
    trace.write_text(
        "".join(json.dumps(r) + "\n" for r in edit([json.loads(x) for x in trace.read_text().splitlines()]))
    )


def _stage_local(records):
    first = min(r["layer"] for r in records)
    return [{**r, "layer": r["layer"] - first} for r in records]


def _cut(records):
    records[0]["top_indices"] = records[0]["top_indices"][:-1]
    return records


@pytest.mark.parametrize(
    "damage, needles",
    [
        (lambda f: (f / "tokens_rank0.npy").unlink(), ["holds no token ids", "tokens_rank0.npy beside it"]),
        (
            lambda f: np.save(f / "tokens_rank0.npy", np.load(f / "tokens_rank0.npy")[:-1]),
            ["not a whole number of records per micro-batch", "exactly the traced steps"],
        ),
        (
            lambda f: np.save(
                f / "tokens_rank0.npy",
                np.load(f / "tokens_rank0.npy").reshape(-1, 1, np.load(f / "tokens_rank0.npy").shape[2]),
            ),
            ["routed rows", "sequence or context parallelism"],
        ),
        (lambda f: _megatron_lines(f, _stage_local), ["a pipeline stage's file"]),
        (lambda f: _megatron_lines(f, _cut), ["line 1", "cut short"]),
    ],
)
def test_a_megatron_trace_that_does_not_fit_is_one_line(damage, needles, run_trace, served, tiny_run, cli, tmp_path):
    folder = tmp_path / "megatron"
    trace_as_engine_record(run_trace, folder, "megatron", served.n_layers)
    damage(folder)
    refused(cli("analyze", "--routes", folder, "--served", tiny_run, "--out", tmp_path / "out"), *needles)


def test_a_record_is_compared_on_the_windows_it_was_recorded_on(run_trace, served, tiny_run, cli, tmp_path):
    """A record's routes (each sequence whole) against the run cut into windows of 16 tokens: the flips were only the
    cut context. Windows shorter than the sequences now cut each to its first window, said in one line."""
    record = tmp_path / "vllm.jsonl"
    trace_as_engine_record(run_trace, record, "vllm", served.n_layers)
    out = tmp_path / "out"
    proc = cli("analyze", "--routes", record, "--served", tiny_run, "--compare", tiny_run, "--seq-len", "16", "--out",
               out)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    c = json.loads((out / "metrics.json").read_text())["comparisons"][str(tiny_run)]
    assert c["tokens_differing_in_any_layer"]["mean"] == 0.0
    assert "each read to its first 16 tokens" in proc.stdout


class CSVRoutes(RouteFormat):
    """A toy format, registered by the test alone: a CSV whose first line is `sequence,token,layer,experts`, then a
    row per routed token and MoE layer (its experts space-separated, first choice first)."""

    name, looks_like = "csv routes", "a CSV of sequence, token, layer, experts"
    HEADER = "sequence,token,layer,experts\n"

    def recognises(self, path: Path) -> bool:
        return read_small(path, len(self.HEADER), head=True) == self.HEADER

    def read(self, path: Path) -> Record:
        rows = [[int(x) for x in line.replace(" ", ",").split(",")] for line in path.read_text().splitlines()[1:]]
        layers = sorted({r[2] for r in rows})
        sequences = []
        for s in sorted({r[0] for r in rows}):
            mine = [r for r in rows if r[0] == s]
            tokens = [r[1] for r in mine if r[2] == layers[0]]
            routes = [[r[3:] for r in mine if r[2] == layer] for layer in layers]  # [layers, tokens, k]
            sequences.append(Sequence(np.array(tokens), np.array(routes).transpose(1, 0, 2)))
        return Record(self.name, sequences, layers=layers)

    def write(self, path: Path, record: Record) -> None:
        rows = [f"{i},{token},{layer},{' '.join(map(str, s.routes[t, j]))}\n"
                for i, s in enumerate(record.sequences) for t, token in enumerate(s.tokens)
                for j, layer in enumerate(record.layers)]  # fmt: skip
        path.write_text(self.HEADER + "".join(rows))


@pytest.fixture
def csv_format():
    fmt = CSVRoutes()
    register_route_format(fmt)
    yield fmt
    FORMATS.remove(fmt)


def test_a_format_registered_from_outside_is_recognised_read_and_analysed(csv_format, run_trace, served, tiny_run, cli,
                                                                          tmp_path):  # fmt: skip
    """A new format is one RouteFormat, registered (docs/analytics.md, "Adding a record format"): this toy CSV,
    converted from a vLLM record by the two formats' own reader and writer, is recognised by its content, read, and
    analysed against the run that routed it (0 tokens differing)."""
    n = trace_as_engine_record(run_trace, tmp_path / "vllm.jsonl", "vllm", served.n_layers)
    moe = [Sequence(s.tokens[: len(s.routes)], s.routes[:, served.layers])
           for s in read_record(tmp_path / "vllm.jsonl").sequences]  # fmt: skip
    record = tmp_path / "routes.txt"
    csv_format.write(record, Record(csv_format.name, moe, layers=served.layers))
    assert looks_like_record(record) and read_record(record).format == "csv routes"
    out = tmp_path / "out"
    proc = cli("analyze", "--routes", record, "--served", tiny_run, "--compare", tiny_run, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"csv routes, {n:,} sequences" in proc.stdout
    c = json.loads((out / "metrics.json").read_text())["comparisons"][str(tiny_run)]
    assert c["tokens_differing_in_any_layer"]["mean"] == 0.0
