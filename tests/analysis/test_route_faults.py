"""Route records under faults (reliability issue 64): records as the engines write them in the cases the engines'
own code produces (a micro-batch repeated, a collapsed router, an aborted request, SGLang's own prompt ids, a request
asking for routes from a later prompt token, Megatron's inference trace) and records damaged or hostile (declared
sizes past their bytes, FIFOs, endless lines, deep JSON, ids of the wrong type, malformed dumps). Each is read as
the engine meant it or refused in one DataError / UserError naming the file; none is a traceback, a hang or all of
the memory. Unit tests: records are written in tmp_path and read in process, no model runs."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import tracemalloc

import numpy as np
import pytest
import torch

from moe_lm.analysis.subjects import KINDS, Settings, Shape, recognise
from moe_lm.analysis.subjects.routes import RecordedRoutes, RoutesKind, checked
from moe_lm.errors import DataError, UserError
from moe_lm.interop.routes import (
    FORMATS,
    NO_ROUTES,
    Record,
    RouteFormat,
    Sequence,
    looks_like_record,
    read_record,
    register_route_format,
    responses,
    sglang_dumps,
)
from moe_lm.interop.routes import record as route_records
from moe_lm.interop.routes.megatron import megatron_trace
from moe_lm.interop.routes.record import engine_routes as all_layers
from moe_lm.interop.routes.sglang import sglang_response
from moe_lm.interop.routes.sglang_dumps import sglang_dump
from moe_lm.interop.routes.vllm import vllm_response
from moe_lm.routing.routed_model import Window

N_LAYERS, MOE, E, K, VOCAB = 4, [1, 2, 3], 8, 2, 100  # a model of one dense layer first, as DeepSeek-V3's kind


def served() -> Shape:
    return Shape(None, VOCAB, N_LAYERS, MOE, E, K, {})


def experts(n: int, seed: int) -> np.ndarray:
    """[n, K] distinct experts per token, first choice first."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(E)[:K] for _ in range(n)])


def routes_of(n: int, seed: int, dense: int) -> np.ndarray:
    """[n, N_LAYERS, K]: every MoE layer routed, `dense` in the dense layer's row."""
    return all_layers({layer: experts(n, seed + layer) for layer in MOE}, N_LAYERS, K, dense)


def tokens_of(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, VOCAB, n)


def jsonl(path, lines) -> str:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


# ---- Megatron: repeats by count (E1, E2, R11), inference traces, layers of other top-k (R12) ------------------------


def batch(seed: int, b: int = 2, s: int = 4, collapsed: int | None = None) -> tuple[np.ndarray, dict]:
    """A micro-batch's tokens [b, s] and its experts per MoE layer [b, s, K] (`collapsed`: a layer whose router
    sends every token to experts 0 and 1, as a dead router does)."""
    chosen = {layer: experts(b * s, seed + layer).reshape(b, s, K) for layer in MOE}
    if collapsed is not None:
        chosen[collapsed] = np.broadcast_to(np.arange(K), (b, s, K)).copy()
    return tokens_of(b * s, seed).reshape(b, s), chosen


@pytest.mark.parametrize(
    "batches, recompute",
    [
        ([batch(1), batch(1), batch(2), batch(3)], False),  # the data loader gives micro-batch 0 twice
        ([batch(1), batch(1), batch(2), batch(3)], True),
        ([batch(1, collapsed=2), batch(2, collapsed=2), batch(3, collapsed=2), batch(4, collapsed=2)], True),
    ],
    ids=["repeated micro-batch", "repeated micro-batch, recompute", "collapsed router, recompute"],
)
def test_megatron_repeats_are_told_by_count_not_by_content(batches, recompute, tmp_path):
    """Two micro-batches can route alike (the same batch twice, a collapsed router): equal records were taken for
    recompute's repeats, one dropped, and every later micro-batch paired with the wrong tokens (or a whole trace
    refused as cut short). The tokens file's micro-batches tell how many records each one has."""
    megatron_trace(tmp_path, batches, recompute=recompute)
    record = read_record(tmp_path)
    expected = [(t[i], np.stack([np.sort(e[layer][i], axis=-1) for layer in MOE], axis=1))
                for t, e in batches for i in range(len(t))]  # fmt: skip
    assert len(record.sequences) == len(expected)
    for s, (tokens, routes) in zip(record.sequences, expected, strict=True):
        assert np.array_equal(s.tokens, tokens) and np.array_equal(s.routes, routes)


def test_megatron_inference_traces_and_layers_of_other_top_k_are_named(tmp_path):
    """Megatron's inference engine traces each forward pass of its dynamic batch (text_generation_controller.py:
    record_indices per step, packed prefill chunks and decode tokens): records of every size, no token ids."""
    passes = [13, 2, 2]  # a prefill of two requests (8 + 5 tokens), then two decode steps
    lines = [{"step": i, "stage": "pre_dispatch", "block": "decoder", "layer": layer, "rank": 0, "num_tokens": n,
              "topk": K, "top_indices": experts(n, i).tolist()}
             for i, n in enumerate(passes) for layer in MOE]  # fmt: skip
    jsonl(tmp_path / "router_trace_rank0.jsonl", lines)
    with pytest.raises(DataError, match="inference trace"):
        read_record(tmp_path)
    tokens, chosen = batch(1)
    chosen[3] = np.concatenate([chosen[3], (chosen[3][..., :1] + 3) % E], axis=-1)  # top-3 in one layer
    megatron_trace(tmp_path / "k", [(tokens, chosen)])
    with pytest.raises(DataError, match="layer 3 routes top-3, layer 1 top-2"):
        read_record(tmp_path / "k")


# ---- responses: aborted requests, SGLang's own prompt ids (E3), a later routes start -------------------------------


def test_sglang_aborted_requests_and_its_own_prompt_ids_are_read_as_sglang_writes_them(tmp_path):
    """SGLang's abort response has no meta_info.routed_experts (and no prompt ids): counted and left out, not the
    whole file refused. Its `prompt_token_ids` (return_prompt_token_ids) is the prompt, as input_ids is."""
    tokens = [tokens_of(12, 1), tokens_of(20, 2)]
    lines = [sglang_response(tokens[0], 5, routes_of(11, 1, 0), prompt_field="prompt_token_ids"),
             sglang_response(tokens[0], 5, None),
             sglang_response(tokens[1], 9, routes_of(19, 2, 0))]  # fmt: skip
    record = read_record(jsonl(tmp_path / "sglang.jsonl", lines))
    assert [len(s.tokens) for s in record.sequences] == [12, 20] and record.skipped == {NO_ROUTES: 1}
    lines[0]["input_ids"] = [1, 2, 3, 4, 5]
    with pytest.raises(DataError, match="prompt_token_ids and input_ids differ"):
        read_record(jsonl(tmp_path / "mixed.jsonl", lines))


def test_a_vllm_request_that_skipped_prompt_routes_is_refused_for_that(tmp_path):
    """vLLM writes routes from prompt token `routed_experts_prompt_start` on and does not say so in the response:
    2 rows fewer is that request's record, not one cut short."""
    tokens = tokens_of(12, 1)
    line = vllm_response(tokens, 6, routes_of(9, 1, 0), E)
    with pytest.raises(DataError, match="request sets routed_experts_prompt_start 2"):
        read_record(jsonl(tmp_path / "vllm.jsonl", [line]))


def npy_line(tokens, npy: bytes) -> dict:
    line = vllm_response(tokens, 4, routes_of(len(tokens) - 1, 1, 0), E)
    line["choices"][0]["routed_experts"] = base64.b64encode(npy).decode()
    return line


def npy_bytes(array) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return buffer.getvalue()


def huge_header() -> bytes:
    """.npy bytes whose header declares 10^12 x 61 x 8 uint8 ids, followed by 16 bytes."""
    header = "{'descr': '|u1', 'fortran_order': False, 'shape': (1000000000000, 61, 8), }"
    header += " " * (64 - (10 + len(header) + 1) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + bytes(16)


@pytest.mark.parametrize(
    "npy, needle",
    [
        (huge_header(), "declares uint8 (1000000000000, 61, 8)"),
        (npy_bytes(np.array([[[None]]], dtype=object)), "object arrays"),
        (npy_bytes(np.zeros((11, N_LAYERS, K), dtype=np.float32)), "float32 values"),
        (b"\x93NUMPY\x01", "not .npy bytes"),
    ],
    ids=["declared past its bytes", "pickled objects", "floats", "cut header"],
)
def test_routes_npy_bytes_are_checked_before_numpy_allocates_them(npy, needle, tmp_path):
    with pytest.raises(DataError, match=re.escape(needle)):
        read_record(jsonl(tmp_path / "vllm.jsonl", [npy_line(tokens_of(12, 1), npy)]))


# ---- files and lines: FIFOs (R2), endless lines (R3), deep JSON (R4), ids of other types (R5) ----------------------


@pytest.mark.parametrize("name", ["expert_distribution_recorder_1.0_1.pt", "router_trace_rank1.jsonl",
                                  "tokens_rank0.npy", "vllm.jsonl"])  # fmt: skip
def test_a_fifo_among_a_records_files_is_named_not_waited_on(name, tmp_path):
    if name.startswith("expert"):
        torch.save(sglang_dump([(tokens_of(6, 1), routes_of(6, 1, -1).transpose(1, 0, 2))], np.tile(np.arange(E),
                   (N_LAYERS, 1))), tmp_path / "expert_distribution_recorder_1.0_0.pt")  # fmt: skip
    elif name != "vllm.jsonl":
        megatron_trace(tmp_path, [batch(1)])
        (tmp_path / "tokens_rank1.npy").write_bytes((tmp_path / "tokens_rank0.npy").read_bytes())
        (tmp_path / name).unlink(missing_ok=True)
    os.mkfifo(tmp_path / name)
    target = tmp_path / name if name == "vllm.jsonl" else tmp_path
    with pytest.raises(DataError, match="is a FIFO"):
        read_record(target)
    assert looks_like_record(target) == (name != "vllm.jsonl")


def test_lines_are_read_with_a_cap_and_recognition_holds_a_chunk(tmp_path, monkeypatch):
    """A "first line" of gigabytes was read whole before anything was checked."""
    monkeypatch.setattr(route_records, "MAX_LINE_BYTES", 4096)
    monkeypatch.setattr(responses, "MAX_LINE_BYTES", 4096)  # recognition's cap
    path = tmp_path / "long.jsonl"
    path.write_text('{"choices": [{"text": "' + "x" * 10_000 + '"}]}\n')
    with pytest.raises(DataError, match="line 1: longer than 4,096 bytes"):
        read_record(path)
    monkeypatch.undo()
    path.write_text('{"text": "' + "A" * 30_000_000 + '", "choices": [{"routed_experts": null}]}\n')
    tracemalloc.start()
    try:
        assert looks_like_record(path)  # its keys found past 30 MB of one line, a chunk at a time
        assert tracemalloc.get_traced_memory()[1] < 8 << 20
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("line", ["[" * 100_000, '{"step": 0, "layer": 1, "top_indices": ' + "[" * 100_000],
                         ids=["response", "megatron"])  # fmt: skip
def test_deeply_nested_json_is_one_line(line, tmp_path):
    megatron_trace(tmp_path, [batch(1)])  # its tokens file beside it
    path = tmp_path / ("router_trace_rank0.jsonl" if "step" in line else "r.jsonl")
    path.write_text(line + "\n")
    with pytest.raises(DataError, match="nested too deeply"):
        read_record(path)


def megatron_edit(tmp_path, edit) -> str:
    megatron_trace(tmp_path, [batch(1)])
    trace = tmp_path / "router_trace_rank0.jsonl"
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    edit(lines[0])
    jsonl(trace, lines)
    return str(tmp_path)


def vllm_edit(tmp_path, edit) -> str:
    line = vllm_response(tokens_of(12, 1), 5, routes_of(11, 1, 0), E)
    edit(line)
    return jsonl(tmp_path / "vllm.jsonl", [line])


def sglang_edit(tmp_path, edit) -> str:
    line = sglang_response(tokens_of(12, 1), 5, routes_of(11, 1, 0))
    edit(line)
    return jsonl(tmp_path / "sglang.jsonl", [line])


@pytest.mark.parametrize(
    "write, needle",
    [
        (lambda p: vllm_edit(p, lambda o: o["choices"][0]["prompt_token_ids"].__setitem__(0, 3.0)), "token ids"),
        (lambda p: vllm_edit(p, lambda o: o["choices"][0]["token_ids"].__setitem__(0, True)), "token ids"),
        (lambda p: megatron_edit(p, lambda r: r["top_indices"][0].__setitem__(0, 1.0)), "top_indices"),
        (lambda p: megatron_edit(p, lambda r: r["top_indices"][0].__setitem__(0, True)), "top_indices"),
        (lambda p: megatron_edit(p, lambda r: r["top_indices"][0].append(3)), "rows of different lengths"),
        (lambda p: megatron_edit(p, lambda r: r.__setitem__("step", 1.5)), "step is '1.5'"),
        (lambda p: megatron_edit(p, lambda r: r.update(block="mtp", num_tokens="x")), "num_tokens is 'x'"),
        (lambda p: sglang_edit(p, lambda o: o.__setitem__("routed_experts_start_len", "x")), "is 'x'"),
    ],
    ids=[
        "float token id",
        "boolean token id",
        "float expert id",
        "boolean expert id",
        "ragged expert ids",
        "float step",
        "string num_tokens",
        "string start",
    ],  # fmt: skip
)
def test_fields_of_another_type_are_refused_not_cast(write, needle, tmp_path):
    with pytest.raises(DataError, match=needle):
        read_record(write(tmp_path))


# ---- SGLang dumps: structure (R6), passes across ranks --------------------------------------------------------------


def dump_file(path, edit=None, passes=None) -> str:
    """An SGLang per-token dump of two prefills (identity map), edited as `edit` says, saved to `path`."""
    passes = passes or [(tokens_of(6, 1), routes_of(6, 1, -1).transpose(1, 0, 2)),
                        (tokens_of(7, 2), routes_of(7, 2, -1).transpose(1, 0, 2))]  # fmt: skip
    dump = sglang_dump(passes, np.tile(np.arange(E), (N_LAYERS, 1)))
    if edit:
        edit(dump)
    torch.save(dump, path)
    return str(path)


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda d: d.__setitem__("records", {"a": 1}), "a list of records"),
        (lambda d: d["records"].__setitem__(0, [1, 2]), "record 0: not a dict"),
        (lambda d: d["records"][0].pop("topk_ids_of_layer"), "no topk_ids_of_layer"),
        (
            lambda d: d["records"][0].update(topk_ids_of_layer=d["records"][0]["topk_ids_of_layer"].float()),
            "topk_ids_of_layer is torch.float32|float32",
        ),
        (lambda d: d["records"][0].update(extend_seq_lens=[9]), "extend_seq_lens"),
        (lambda d: d["records"][0].update(positions=[0, 1]), "does not fit"),
        (lambda d: d.__setitem__("last_physical_to_logical_map", torch.arange(E)), "last_physical_to_logical_map"),
    ],
    ids=[
        "records not a list",
        "record not a dict",
        "no topk",
        "float topk",
        "segments past the tokens",
        "positions short",
        "map of one dimension",
    ],  # fmt: skip
)
def test_a_malformed_dump_is_one_line(edit, needle, tmp_path):
    with pytest.raises(DataError, match=needle):
        read_record(dump_file(tmp_path / "expert_distribution_recorder_1.0_0.pt", edit))


def test_dump_passes_a_rank_recorded_twice_are_two_and_tokens_past_segments_are_said(tmp_path):
    """The same prompt prefilled in two passes of one rank is two sequences; the same passes in a second rank's
    file (plain tensor parallelism) are read once; tokens past extend_seq_lens are counted, not dropped unsaid."""
    twice = [(tokens_of(6, 1), routes_of(6, 1, -1).transpose(1, 0, 2))] * 2
    dump_file(tmp_path / "expert_distribution_recorder_1.0_0.pt", passes=twice)
    dump_file(tmp_path / "expert_distribution_recorder_1.0_1.pt", passes=twice)
    assert len(read_record(tmp_path).sequences) == 2
    cut = dump_file(tmp_path / "cut.pt", lambda d: d["records"][1].update(extend_seq_lens=[5]))
    record = read_record(cut)
    assert [len(s.tokens) for s in record.sequences] == [6, 5]
    assert record.skipped == {sglang_dumps.PAST_SEGMENTS: 2}


# ---- the served model's check and lookup: short requests (R7), [e, e] (R8), dense rows (R9), windows (R10) ---------


def test_a_short_request_is_found_by_its_routed_tokens(tmp_path):
    """The lookup key held the first 16 tokens, the never-routed last one among them for a request of 12: no window
    found it, and the whole record was unusable."""
    sequences = [Sequence(tokens_of(12, 1), routes_of(11, 1, 0)), Sequence(tokens_of(40, 2), routes_of(39, 2, 0))]
    routing = RecordedRoutes(Record("vllm responses", sequences, filler=0), served(), "r.jsonl")
    for doc, s in enumerate(sequences):
        routed = routing.route_batch([Window(doc, 0, 0, s.tokens[: len(s.routes)])])
        assert np.array_equal(routed.experts[MOE[0]], s.routes[:, MOE[0]])
    with pytest.raises(UserError, match="starts at token 8"):
        routing.route_batch([Window(1, 0, 8, sequences[1].tokens[8:16])])
    with pytest.raises(UserError, match="no sequence of the record holds the token ids of document 2 at position 8"):
        routing.route_batch([Window(2, 0, 8, sequences[1].tokens[8:16])])


@pytest.mark.parametrize(
    "edit, needle",
    [
        (
            lambda r: r[3, 2].__setitem__(slice(None), 5),
            "token 3, MoE layer 2: experts \\[5, 5\\] name one expert twice",
        ),
        (lambda r: r[4, 0].__setitem__(0, 6), "token 4, layer 0: experts \\[6, 0\\] in a layer the served model does"),
    ],
    ids=["an expert twice", "routes in a dense layer"],
)
def test_rows_no_router_writes_are_refused(edit, needle):
    routes = routes_of(11, 1, 0)
    edit(routes)
    with pytest.raises(UserError, match=needle):
        checked(Sequence(tokens_of(12, 1), routes), served(), "r.jsonl, sequence 0", Record("vllm", [], filler=0))


# ---- --compare knows a record by its content --------------------------------------------------------------------


def test_compare_recognises_every_kind_by_content_never_by_name(tmp_path):
    """A dump renamed .pt, a GGUF named .jsonl, a vLLM record named .gguf, a transformers folder that also holds a
    dump, a run as RUN and as RUN:TAG."""
    dump = dump_file(tmp_path / "renamed.pt")
    (tmp_path / "model.jsonl").write_bytes(b"GGUF" + bytes(60))
    vllm = jsonl(tmp_path / "rollouts.gguf", [vllm_response(tokens_of(12, 1), 5, routes_of(11, 1, 0), E)])
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    dump_file(hf / "expert_distribution_recorder_1.0_0.pt")
    (tmp_path / "run" / "checkpoints" / "step_00000002").mkdir(parents=True)
    kinds = list(KINDS.values())
    cases = {dump: "routes", str(tmp_path / "model.jsonl"): "gguf", vllm: "routes", str(hf): "hf",
             str(tmp_path / "run"): "run", f"{tmp_path / 'run'}:step_00000002": "run"}  # fmt: skip
    assert {spec: recognise(spec, kinds).name for spec in cases} == cases
    # a transformers folder is compared without --served, dump or not: no subject is of the routes kind
    RoutesKind().check(Settings.defaults(RoutesKind().flags()), used=recognise(str(hf), kinds).name == "routes")


# ---- the registry of formats (moe_lm/interop/routes/): each writes what it reads, tried in a stated order ----------


def written_record(name: str) -> Record:
    """Three sequences as the format `name` holds them: responses one more token than routes (the last sampled one)
    with 0 in the dense layer's rows, dumps -1 there, Megatron only the MoE layers (equal lengths, experts ascending:
    its trace holds them as a set)."""
    if name == "megatron router trace":
        sequences = [Sequence(tokens_of(6, i), np.sort(routes_of(6, i, -1)[:, MOE], axis=-1)) for i in range(3)]
        return Record(name, sequences, layers=MOE, ranked=False)
    extra, dense = (1, 0) if name.endswith("responses") else (0, -1)
    return Record(name, [Sequence(tokens_of(n + extra, n), routes_of(n, n, dense)) for n in (5, 9, 12)], filler=dense)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_each_format_reads_back_what_it_writes(fmt, tmp_path):
    """Through the registry: the file each format writes is recognised by its content (under a name that says
    nothing) and read back by the same format into the sequences written."""
    record = written_record(fmt.name)
    path = tmp_path / "record"
    fmt.write(path, record)
    assert looks_like_record(path)
    back = read_record(path)
    assert back.format == fmt.name and len(back.sequences) == len(record.sequences)
    for got, wrote in zip(back.sequences, record.sequences, strict=True):
        routes = got.routes.reshape(len(got.routes), wrote.routes.shape[1], -1)  # SGLang responses: flat rows
        k = wrote.routes.shape[2]  # a dump's rows are 8 wide (SGLang's recorder), its filler past top-k
        assert np.array_equal(got.tokens, wrote.tokens) and np.array_equal(routes[..., :k], wrote.routes)
        assert (routes[..., k:] == back.filler).all()
    assert (back.layers, back.ranked, back.filler) == (record.layers, record.ranked, record.filler)


def test_formats_are_tried_in_the_registrys_order(tmp_path):
    """A folder holding a Megatron trace and SGLang dumps is the trace (order 10 before 20); a format registered with
    a lower order is tried before both; a folder no format recognises is one line naming every format."""
    megatron_trace(tmp_path, [batch(1)])
    dump_file(tmp_path / "expert_distribution_recorder_1.0_0.pt")
    assert [f.order for f in FORMATS] == sorted(f.order for f in FORMATS)
    assert read_record(tmp_path).format == "megatron router trace"

    class Everything(RouteFormat):
        name, looks_like, order = "everything", "anything at all", 5

        def recognises(self, path):
            return True

        def read(self, path):
            return Record(self.name, [])

        def write(self, path, record):
            raise NotImplementedError

    everything = Everything()
    register_route_format(everything)
    try:
        assert FORMATS[0] is everything and read_record(tmp_path).format == "everything"
    finally:
        FORMATS.remove(everything)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="not a record of routes moe-lm reads.*Megatron-Core's router trace"):
        read_record(tmp_path / "empty")
