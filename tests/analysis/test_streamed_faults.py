"""Released checkpoints and streamed analyses under faults (issue 64): damaged or unusual releases refused in one
line naming the tensor, or read right; a streamed analysis stopped by Ctrl-C, SIGKILL or a full disk resumes to the
very trace an uninterrupted one writes, never mixes in another analysis's layers, and never writes into or removes
what moe-lm did not make."""

from __future__ import annotations

import contextlib
import copy
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from moe_lm.analysis import routing_workflow, stream_work, streamed
from moe_lm.analysis.hf_routing import hf_routing
from moe_lm.analysis.recording import record_trace
from moe_lm.analysis.stream_work import MAPPED, MARK, WorkFolder, kept_for_resume
from moe_lm.analysis.streamed import StreamedModel
from moe_lm.errors import UserError
from moe_lm.interop.hf_layers import HFCheckpoint
from moe_lm.interop.released_weights import SCALE_SUFFIX, ReleasedWeights, block_size, quantize_fp8, write_fp8_release
from moe_lm.output_folder import MARKER
from moe_lm.routing.trace import Trace
from tests.analysis.test_bad_input import refused
from tests.analysis.test_hf_routing import tiny_tokenizer
from tests.analysis.test_streamed import SMALL, documents, write_corpus
from tests.helpers.released import deepseek_v3, dequantized_by_blocks, random_model, release

KV = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"  # 72 x 144: a grid of [1, 2] scales


@pytest.fixture(scope="module")
def deepseek_fp8(tmp_path_factory):
    return release("deepseek_v3", tmp_path_factory.mktemp("ds") / "release")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "docs.jsonl")


def _copied(released: Path, folder: Path) -> Path:
    shutil.copytree(released, folder)
    return folder


def _rewrite(folder: Path, change) -> None:
    """`change(tensors)` applied to the shard holding KV's scale, written back."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard = folder / index[KV + SCALE_SUFFIX]
    tensors = load_file(shard)
    change(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


# ---- releases ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_nan_or_infinite_block_scale_is_refused_naming_the_tensor(deepseek_fp8, tmp_path, bad):
    """Every value of its block would be NaN or infinite and the routing computed on them garbage, with no error:
    refused as the checkpoint is opened (the scales are read then), and when the weight itself is read."""
    folder = _copied(deepseek_fp8, tmp_path / "release")
    _rewrite(folder, lambda t: t[KV + SCALE_SUFFIX].__setitem__((0, 1), bad))
    said = f"{KV}{SCALE_SUFFIX} holds 1 NaN or infinite block scales (the first at block [0, 1])"
    for read in (lambda w: w.check(), lambda w: w.weight(KV)):
        with pytest.raises(UserError) as e:
            read(ReleasedWeights(folder))
        assert said in str(e.value) and "download or convert it again" in str(e.value) and "\n" not in str(e.value)


def _release_in(dtype: torch.dtype, model, folder: Path) -> Path:
    copy.deepcopy(model).to(dtype).save_pretrained(folder)
    tiny_tokenizer(folder)
    return folder


def test_float32_float16_and_bfloat16_shards_give_the_same_experts(tmp_path):
    """One model's values, exact in all three (bf16 values of at least 1e-4 are fp16 values too), stored three
    ways: read in float32 they are the same model, with the same experts and weights for every token."""
    model = random_model(deepseek_v3())
    with torch.no_grad():
        for p in [*model.parameters(), *model.buffers()]:
            p.copy_(torch.where(p.abs() < 1e-4, 0.0, p).to(torch.bfloat16).float())
    traces = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        folder = _release_in(dtype, model, tmp_path / str(dtype))
        checkpoint = HFCheckpoint(folder, transformers.AutoConfig.from_pretrained(folder))
        traces.append(record_trace(hf_routing(checkpoint.model()), documents(3), tmp_path / f"t{dtype}", ["a", "b"],
                                   48, 4, progress=False))  # fmt: skip
    for trace in traces[1:]:
        for layer in traces[0].layers:
            assert np.array_equal(trace.experts(layer), traces[0].experts(layer))
            assert np.array_equal(trace.weights(layer), traces[0].weights(layer))


@pytest.mark.parametrize("dtype, stored", [(torch.float64, "F64"), (torch.int32, "I32")])
def test_float64_and_int32_shards_are_refused_naming_the_tensor(tmp_path, dtype, stored):
    model = random_model(deepseek_v3())
    folder = _release_in(torch.bfloat16, model, tmp_path / "release")
    shard = next(folder.glob("*.safetensors"))
    tensors = load_file(shard)
    name = next(n for n in sorted(tensors) if n.endswith("q_a_proj.weight") or n.endswith("q_proj.weight"))
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(UserError) as e:
        HFCheckpoint(folder, transformers.AutoConfig.from_pretrained(folder))
    assert f"tensor {name} is stored as {stored}, which moe-lm does not read" in str(e.value)


@pytest.mark.parametrize(
    "q, said",
    [
        ({"quant_method": "awq", "bits": 4}, "quantised with awq"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "quantised with fp8 (e5m2)"),
        ("fp8", "quantised with 'fp8'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size [128] is not two block sides"),
        ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "weight_block_size [128, 0] is not two"),
        ({"quant_method": "fp8", "weight_block_size": [1, 128, 128]}, "weight_block_size [1, 128, 128] is not two"),
        ({"quant_method": "fp8", "weight_block_size": [64.0, 64.0]}, "weight_block_size [64.0, 64.0] is not two"),
        ({"quant_method": "fp8", "weight_block_size": [True, True]}, "weight_block_size [True, True] is not two"),
        ({"quant_method": "fp8", "weight_block_size": "128x128"}, "weight_block_size '128x128' is not two"),
    ],
)
def test_another_quantisation_or_block_is_one_line(q, said):
    with pytest.raises(UserError) as e:
        block_size({"quantization_config": q}, Path("/models/m"))
    assert said in str(e.value) and "/models/m/config.json" in str(e.value) and "\n" not in str(e.value)


def test_blocks_of_another_shape_are_read_by_the_same_rule(tmp_path):
    """weight_block_size [64, 32]: ragged blocks of 64 rows and 32 columns, each with its scale."""
    torch.manual_seed(0)
    w = torch.randn(100, 70) * torch.logspace(-2, 1, 100)[:, None]
    w8, scale = quantize_fp8(w, (64, 32))
    assert scale.shape == (2, 3)
    folder = tmp_path / "m"
    folder.mkdir()
    save_file({"w": w8, "w" + SCALE_SUFFIX: scale}, folder / "model.safetensors")
    config = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 32]}}
    assert torch.equal(ReleasedWeights(folder, config).weight("w"), dequantized_by_blocks(w8, scale, (64, 32)))


def _no_scale(folder: Path) -> None:
    """KV's scale gone from its shard and the index."""
    _rewrite(folder, lambda tensors: tensors.pop(KV + SCALE_SUFFIX))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"][KV + SCALE_SUFFIX]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _transposed_scale(tensors):
    tensors[KV + SCALE_SUFFIX] = tensors[KV + SCALE_SUFFIX].T.contiguous()


def _other_blocks(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "damage, said",
    [
        (_no_scale, f"the FP8 weight {KV} has no {KV}{SCALE_SUFFIX}"),
        (lambda f: _rewrite(f, _transposed_scale), "is a grid of [2, 1] scales for a 72 x 144 weight in 128 x 128 "
         "blocks (it needs [1, 2])"),
        (_other_blocks, "is a grid of [2, 2] scales for a 144 x 200 weight in 64 x 64 blocks (it needs [3, 4])"),
    ],
    ids=["missing-scale", "transposed-scale", "blocks-the-scales-do-not-fit"],
)  # fmt: skip
def test_a_scale_grid_that_does_not_fit_is_one_line(deepseek_fp8, tmp_path, damage, said):
    folder = _copied(deepseek_fp8, tmp_path / "release")
    damage(folder)
    with pytest.raises(UserError) as e:
        HFCheckpoint(folder, transformers.AutoConfig.from_pretrained(folder))
    assert said in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---- streaming: flags -------------------------------------------------------------------------------------------


def _analyze(folder: Path, corpus: Path, out: Path, *more) -> tuple:
    """The analysis of these tests: 900 tokens, the model alone (no N1), layer 3's figures alone (all 4 layers
    run, with the log-probs)."""
    return ("analyze", "--hf", folder, "--data", corpus, "--seq-len", "64", "--max-tokens", "900",
            "--no-init-baseline", "--layers", "3", "--out", out, *more)  # fmt: skip


@pytest.mark.parametrize("size, said", [("0", "'0' is not a size"), ("-1", "'-1' is not a size"),
                                        ("abc", "'abc' is not a size"), ("0.5", "'0.5' is less than a byte"),
                                        ("0.4B", "'0.4B' is less than a byte"),
                                        ("1", "give at least --max-memory")])  # fmt: skip
def test_max_memory_that_is_no_budget_is_refused_never_dropped(deepseek_fp8, corpus, cli, tmp_path, size, said):
    """Half a byte rounded to 0, which read as "no limit": the model was analysed whole in memory."""
    out = tmp_path / "a"
    err = refused(cli(*_analyze(deepseek_fp8, corpus, out, "--max-memory", size)), said)
    assert len([line for line in err.splitlines() if "error" in line]) == 1, err
    assert not out.exists() and not (tmp_path / ".a.stream").exists()


@pytest.mark.parametrize("layers", [["10000"], ["-1"], ["0"], ["1", "10000"]])
def test_layers_that_are_no_moe_layer_are_refused_before_any_layer_is_read(
    deepseek_fp8, corpus, cli, tmp_path, monkeypatch, layers
):
    """10000 streamed every layer (hours for DeepSeek-V3) and was refused afterwards; -1 was a traceback."""

    def no_read(*a, **k):
        raise AssertionError("a layer was read")

    monkeypatch.setattr(streamed.StreamedModel, "_read", no_read)
    out = tmp_path / "a"
    proc = cli(*_analyze(deepseek_fp8, corpus, out, "--max-memory", SMALL, "--layers", *layers))
    refused(proc, f"--layers {max(map(int, layers))}: {deepseek_fp8} has no MoE layer", "its MoE layers: [1, 2, 3]")
    assert not out.exists() and not (tmp_path / ".a.stream").exists()


def test_layers_of_a_model_in_memory_are_checked_before_it_is_recorded(
    deepseek_fp8, corpus, cli, tmp_path, monkeypatch
):
    def no_recording(*a, **k):
        raise AssertionError("recorded")

    monkeypatch.setattr(routing_workflow, "record_trace", no_recording)
    refused(cli(*_analyze(deepseek_fp8, corpus, tmp_path / "a", "--layers", "1", "10000")),
            "layers [10000] are not MoE layers of this model")  # fmt: skip


# ---- streaming: the work folder is moe-lm's own ------------------------------------------------------------------


def _listing(folder: Path) -> list:
    return sorted((str(p.relative_to(folder)), p.is_symlink(), p.read_bytes() if p.is_file() else None)
                  for p in folder.rglob("*"))  # fmt: skip


@pytest.mark.parametrize("kind", ["folder", "symlink", "file"])
def test_a_users_stream_path_is_refused_untouched(deepseek_fp8, corpus, cli, tmp_path, kind):
    work = tmp_path / ".a.stream"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "README").write_text("my notes\n")
    if kind == "folder":
        shutil.copytree(tmp_path / "mine", work)
    elif kind == "symlink":
        work.symlink_to(tmp_path / "mine")
    else:
        work.write_text("my file")
    before = _listing(tmp_path)
    refused(cli(*_analyze(deepseek_fp8, corpus, tmp_path / "a", "--max-memory", SMALL)), f"{work} is not moe-lm's")
    assert _listing(tmp_path) == before


def test_a_second_identical_analysis_into_the_same_out_is_refused_and_the_first_left_intact(
    deepseek_fp8, corpus, cli, tmp_path
):
    """The first, as it runs: its staging folder under its lock, its work folder with a finished layer."""
    stage = tmp_path / f".a.partial-{socket.gethostname()}-{os.getpid() + 1}"
    stage.mkdir()
    (stage / MARKER).write_text('{"command": "analyze"}')
    lock = os.open(stage / MARKER, os.O_RDONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)
    work = tmp_path / ".a.stream" / "0123456789" / "model" / "0123456789abcdef"
    work.mkdir(parents=True)
    (work / "README").write_text(MARK + "\n")
    (work / "progress.json").write_text('{"key": "0123456789abcdef", "done": [0], "turn": 1}')
    before = _listing(tmp_path)
    try:
        refused(cli(*_analyze(deepseek_fp8, corpus, tmp_path / "a", "--max-memory", SMALL)),
                "is being written by another moe-lm process")  # fmt: skip
    finally:
        os.close(lock)
    assert _listing(tmp_path) == before


def test_the_work_files_take_their_size_on_disk_as_the_analysis_starts(tmp_path):
    """Sparse files met a full disk as a memory-mapped write mid-layer: SIGBUS, the process dead without a word."""
    padded = [(torch.zeros(3, 64, dtype=torch.long), [64, 64, 10])]
    state = WorkFolder(tmp_path / "work", "k", padded, 144, torch.float32)
    size = 3 * 64 * 144 * 4
    for name in MAPPED:
        info = (state.folder / f"{name}.bin").stat()
        assert info.st_size == size and info.st_blocks * 512 >= size, name


def test_an_empty_stream_folder_of_the_users_is_used_and_left_in_place(tmp_path):
    """An empty folder of that name is accepted (nothing in it to harm); moe-lm removes its own files from it, never
    the folder it did not make."""
    work = tmp_path / ".a.stream"
    work.mkdir()
    with kept_for_resume(stream_work.stream_work(tmp_path / "a")):
        WorkFolder(work / "subject" / "model", "k", [(torch.zeros(1, 8, dtype=torch.long), [8])], 16, torch.float32)
    assert work.is_dir() and list(work.iterdir()) == []


def test_a_key_tells_apart_windows_weights_dtype_and_layers(deepseek_fp8, tmp_path):
    """The same tokens cut into windows of another length (same bytes), and a release whose files were replaced,
    had the key of the analysis before them: a resume would have mixed their layers."""
    hub = tmp_path / "hub"
    hub.mkdir()
    for p in deepseek_fp8.iterdir():
        (hub / p.name).symlink_to(p)
    config = transformers.AutoConfig.from_pretrained(hub)

    def key(padded, dtype=torch.float32, last=None):
        return StreamedModel(HFCheckpoint(hub, config, dtype), 1_200_000, tmp_path / "w", last)._key(padded)

    tokens = torch.arange(256) % 290
    base = [(tokens.view(4, 64), [64] * 4)]
    assert key(base) == key([(tokens.view(4, 64).clone(), [64] * 4)])
    keys = [key(base), key([(tokens.view(8, 32), [32] * 8)]), key([(tokens.view(4, 64), [64, 64, 64, 63])]),
            key([(tokens.view(4, 64) + 1, [64] * 4)]), key(base, torch.bfloat16), key(base, last=2)]  # fmt: skip
    shard = next(hub.glob("*.safetensors"))
    target = shard.resolve()
    shard.unlink()
    shutil.copy(target, shard)  # the same bytes put in its place: a copy can not be told from other weights
    keys.append(key(base))
    assert len(set(keys)) == len(keys)


# ---- streaming: interrupted, killed, a full disk ------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(deepseek_fp8, corpus, cli, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "a"
    proc = cli(*_analyze(deepseek_fp8, corpus, out, "--max-memory", SMALL))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Trace(out / "trace")


def _bit_equal(a: Trace, b: Trace) -> None:
    assert a.layers == b.layers == [1, 2, 3]
    for layer in a.layers:
        assert np.array_equal(a.experts(layer), b.experts(layer)) and np.array_equal(a.weights(layer), b.weights(layer))
    assert np.array_equal(a.logprob, b.logprob, equal_nan=True)


def _stop_mid_layer_2(monkeypatch, stop) -> None:
    """`stop()` called as layer 2's second chunk of experts starts (its first chunk added in already)."""
    run = streamed.run_experts

    def stopping(weights, unit, *a):
        if unit.layer == 2 and unit.experts[0] > 0:
            stop()
        return run(weights, unit, *a)

    monkeypatch.setattr(streamed, "run_experts", stopping)


def _progress(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / ".a.stream").rglob("progress.json"))


def _relink(hub: Path, released: Path) -> None:
    for p in released.glob("*.safetensors"):
        (hub / p.name).unlink(missing_ok=True)
        (hub / p.name).symlink_to(released / p.name)


@pytest.fixture
def hub(deepseek_fp8, tmp_path):
    """The release as the hub cache lays it out: symlinks to its files."""
    folder = tmp_path / "hub"
    folder.mkdir()
    for p in deepseek_fp8.iterdir():
        (folder / p.name).symlink_to(p)
    return folder


def test_ctrl_c_mid_layer_resumes_bit_equal_and_the_kept_folder_survives_another_analysis(
    uninterrupted, hub, deepseek_fp8, corpus, cli, tmp_path, monkeypatch
):
    """Stopped mid-layer, its finished layers kept; the user puts a file there; another analysis into the same --out
    (the folder's weights replaced) starts over beside it and leaves it; with the weights back, the first resumes to
    the uninterrupted trace, bit for bit, and removes its own files, not the user's."""
    out, command = tmp_path / "a", _analyze(hub, corpus, tmp_path / "a", "--max-memory", SMALL)

    def ctrl_c():
        raise KeyboardInterrupt

    _stop_mid_layer_2(monkeypatch, ctrl_c)
    stopped = cli(*command)
    assert stopped.returncode == 130 and "finished layers of the streamed analysis are kept in" in stopped.stderr
    [progress] = _progress(tmp_path)
    kept = progress.parent
    assert json.loads(progress.read_text())["done"] == [0, 1]
    (kept / "my notes.txt").write_text("mine")
    monkeypatch.undo()

    other = tmp_path / "other"
    write_fp8_release(random_model(deepseek_v3(), seed=1), other)
    _relink(hub, other)
    replaced = cli(*command)
    assert replaced.returncode == 0 and "resuming" not in replaced.stdout, replaced.stderr[-3000:]
    assert "still holds the work of other streamed analyses" in replaced.stdout
    assert _progress(tmp_path) == [progress] and json.loads(progress.read_text())["done"] == [0, 1]

    _relink(hub, deepseek_fp8)
    resumed = cli(*command)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming the streamed analysis: layers 0..1 finished before, kept in {kept}" in resumed.stdout
    _bit_equal(uninterrupted, Trace(out / "trace"))
    assert [p.name for p in kept.iterdir()] == ["my notes.txt"] and (kept / "my notes.txt").read_text() == "mine"
    assert f"kept {kept}: it holds files moe-lm did not write (my notes.txt)" in resumed.stderr


def test_sigkill_mid_layer_resumes_bit_equal(uninterrupted, deepseek_fp8, corpus, cli, process, tmp_path):
    command = [str(a) for a in _analyze(deepseek_fp8, corpus, tmp_path / "a", "--max-memory", SMALL)]
    killed = process.python(
        "import os, signal, torch\n"
        # why this process's thread count: layers 0..1 come from the killed process, the rest from this one, and
        # float32 sums split over other threads differ in their last bits (pytest-xdist runs a thread a worker)
        f"torch.set_num_threads({torch.get_num_threads()})\n"
        "from moe_lm.analysis import streamed\n"
        "run = streamed.run_experts\n"
        "def killed(weights, unit, *a):\n"
        "    if unit.layer == 2 and unit.experts[0] > 0:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return run(weights, unit, *a)\n"
        "streamed.run_experts = killed\n"
        "from moe_lm.cli.main import main\n"
        f"main({command!r})\n"
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = cli(*command)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming the streamed analysis: layers 0..1 finished before" in resumed.stdout
    _bit_equal(uninterrupted, Trace(tmp_path / "a" / "trace"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # the killed staging and work folders gone


def test_a_disk_filled_by_another_writer_is_one_line_and_a_cut_progress_file_starts_over(
    uninterrupted, deepseek_fp8, corpus, cli, tmp_path, monkeypatch
):
    """The disk fills as layer 2's choices are saved: one line saying what is kept, no file of layer 2 left cut
    short; progress.json then cut short (a copy, a crash of the disk): the analysis starts over, to the same trace."""
    out, command = tmp_path / "a", _analyze(deepseek_fp8, corpus, tmp_path / "a", "--max-memory", SMALL)
    save = np.save

    def full_at_layer_2(file, array, *a, **k):
        if "experts_L2.npy" in str(getattr(file, "name", file)):
            with open(file, "wb") if isinstance(file, str | Path) else contextlib.nullcontext(file) as f:
                f.write(b"\x93NUMPY")  # part of it written
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return save(file, array, *a, **k)

    monkeypatch.setattr(np, "save", full_at_layer_2)
    err = refused(cli(*command), "the disk filled up during the streamed analysis",
                  "finished layers of the streamed analysis are kept in", "run the same command to resume")  # fmt: skip
    assert len([line for line in err.splitlines() if line.startswith(("error", "note"))]) == 1, err
    [progress] = _progress(tmp_path)
    assert json.loads(progress.read_text())["done"] == [0, 1] and not list(progress.parent.glob("*L2*"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".a.stream"]
    monkeypatch.undo()

    progress.write_text(progress.read_text()[:20])
    again = cli(*command)
    assert again.returncode == 0 and "resuming" not in again.stdout, again.stderr[-3000:]
    _bit_equal(uninterrupted, Trace(out / "trace"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_a_disk_too_small_for_the_planned_work_files_is_one_line_and_leaves_nothing(
    deepseek_fp8, corpus, cli, tmp_path, monkeypatch
):
    """Another writer takes the room between the check and the reservation: the fourth file finds the disk full."""
    reserve, calls = os.posix_fallocate, []

    def full_at_the_fourth(fd, offset, length):
        calls.append(length)
        if len(calls) == 4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return reserve(fd, offset, length)

    monkeypatch.setattr(stream_work.os, "posix_fallocate", full_at_the_fourth)
    err = refused(cli(*_analyze(deepseek_fp8, corpus, tmp_path / "a", "--max-memory", SMALL)),
                  "the disk filled up while the streamed analysis reserved its work files", "--max-tokens")  # fmt: skip
    assert len([line for line in err.splitlines() if line.startswith(("error", "note"))]) == 1, err
    assert list(tmp_path.iterdir()) == []
