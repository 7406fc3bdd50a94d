"""The one safetensors reader (moe_lm/interop/safetensors_folder.py): a single file and shards with an index read the
same tensors as safetensors' own loader, names and shapes come from headers alone, and damaged folders are one line
naming the file."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_lm.errors import UserError
from moe_lm.interop.safetensors_folder import INDEX, SafetensorsFolder

TENSORS = {"a.weight": torch.arange(12.0).reshape(3, 4), "b.bias": torch.ones(5, dtype=torch.bfloat16),
           "c.scale_inv": torch.full((2, 2), 0.5)}  # fmt: skip


def sharded(folder):
    """The tensors in two shards and an index, as save_pretrained writes them."""
    folder.mkdir()
    save_file({"a.weight": TENSORS["a.weight"]}, folder / "model-00001-of-00002.safetensors")
    save_file({k: TENSORS[k] for k in ("b.bias", "c.scale_inv")}, folder / "model-00002-of-00002.safetensors")
    weight_map = {"a.weight": "model-00001-of-00002.safetensors", "b.bias": "model-00002-of-00002.safetensors",
                  "c.scale_inv": "model-00002-of-00002.safetensors"}  # fmt: skip
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def test_a_single_file_and_shards_read_the_same_tensors(tmp_path):
    (tmp_path / "one").mkdir()
    save_file(TENSORS, tmp_path / "one" / "model.safetensors")
    for folder in (tmp_path / "one", sharded(tmp_path / "two")):
        st = SafetensorsFolder(folder)
        assert sorted(st.names()) == sorted(TENSORS) and "a.weight" in st and "z" not in st
        assert st.shapes() == {k: tuple(v.shape) for k, v in TENSORS.items()}
        assert st.dtype("b.bias") == "BF16" and st.nbytes("a.weight") == 48
        read = dict(st.tensors())
        for name, tensor in TENSORS.items():
            assert torch.equal(read[name], tensor) and read[name].dtype == tensor.dtype
        assert torch.equal(st.tensor("c.scale_inv"), load_file(st.files["c.scale_inv"])["c.scale_inv"])


def test_names_and_shapes_come_from_the_headers_alone(tmp_path, monkeypatch):
    """Names, shapes and sizes never open a tensor (safetensors' reader is not called)."""
    import safetensors

    folder = sharded(tmp_path / "f")
    monkeypatch.setattr(safetensors, "safe_open", None)
    st = SafetensorsFolder(folder)
    assert st.shape("b.bias") == (5,) and set(st.names()) == set(TENSORS)


def test_a_shard_cut_short_is_said_to_be_truncated_from_its_header(tmp_path):
    """A download cut after the header is named when its header is read (when a long analysis starts), not when
    its last tensors are reached."""
    folder = sharded(tmp_path / "cut")
    shard = folder / "model-00002-of-00002.safetensors"
    (n,) = struct.unpack("<Q", shard.read_bytes()[:8])
    shard.write_bytes(shard.read_bytes()[: 8 + n])
    st = SafetensorsFolder(folder)
    assert torch.equal(st.tensor("a.weight"), TENSORS["a.weight"])  # the whole shard still reads
    with pytest.raises(UserError, match=r"00002-of-00002.safetensors is truncated: its header lists [\d,]+ bytes"):
        st.shape("b.bias")


@pytest.mark.parametrize(
    "damage, said",
    [(lambda f: (f / "model-00001-of-00002.safetensors").unlink(), "model-00001-of-00002.safetensors is missing"),
     (lambda f: (f / "model-00001-of-00002.safetensors").write_bytes(struct.pack("<Q", 2**60) + b"{}"),
      "a header of 1,152,921,504,606,846,976 bytes"),
     (lambda f: (f / INDEX).write_text("{}"), "is not a safetensors index"),
     (lambda f: [p.unlink() for p in f.iterdir()], "holds no .safetensors file")],
)  # fmt: skip
def test_a_damaged_folder_is_one_line_naming_the_file(tmp_path, damage, said):
    folder = sharded(tmp_path / "f")
    damage(folder)
    with pytest.raises(UserError) as e:
        SafetensorsFolder(folder, "export it again").shapes()
    assert said in str(e.value) and "export it again" in str(e.value) and "\n" not in str(e.value)


# ---- shards out of place, and headers that lie (issue 64) -----------------------------------------------------------


def _one_file(folder, header: dict | list, data: bytes = b"", extra_header: bytes = b""):
    """A safetensors file written by hand: `header` as its JSON, then `data`."""
    folder.mkdir(exist_ok=True)
    text = json.dumps(header).encode() + extra_header
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + data)
    return folder


def _entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize(
    "header, data, said",
    [
        ([{"a": 1}], b"", "its header is a JSON list, not a mapping of tensors"),
        ({"a": _entry(offsets=(0, 4))}, b"\0" * 4, "takes 8 bytes and its data_offsets [0, 4] give it 4"),
        ({"a": _entry(offsets=(8, 0))}, b"\0" * 8, "give it -8"),
        ({"a": _entry(shape=(2**25, 2**25), offsets=(0, 8))}, b"\0" * 8,
         "takes 4,503,599,627,370,496 bytes and its data_offsets [0, 8] give it 8"),  # 2**50 values
        ({"a": _entry(shape=(2**25, 2**25), offsets=(0, 2**52))}, b"\0" * 8, "is truncated: its header lists"),
        ({"a": _entry(), "b": _entry(offsets=(4, 12))}, b"\0" * 12, "tensor 'b' at bytes 4..12 overlaps 'a'"),
        ({"a": _entry(), "b": _entry()}, b"\0" * 8, "tensor 'b' at bytes 0..8 overlaps 'a'"),
        ({"a": _entry(offsets=(8, 16))}, b"\0" * 16, "tensor 'a' at bytes 8..16 leaves a gap"),
        ({"a": _entry()}, b"\0" * 12, "4 bytes after the tensors its header lists"),
        ({"a": _entry(shape=("2",))}, b"\0" * 8, "tensor 'a' is not a dtype, a shape and two data_offsets"),
        ({"a": _entry(offsets=(0,))}, b"\0" * 8, "tensor 'a' is not a dtype, a shape and two data_offsets"),
        ({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, "tensor 'a' is not a dtype, a shape and two data_offsets"),
    ],
    ids=["a-list", "short-offsets", "reversed-offsets", "2^50-values", "2^50-values-truncated", "overlap",
         "same-bytes", "gap", "trailing-bytes", "shape-of-strings", "one-offset", "no-offsets"],
)  # fmt: skip
def test_a_header_that_lies_is_one_line_naming_the_file(tmp_path, header, data, said):
    """Each lie refused from the header, before safetensors opens the file: its own reader checks the same only
    when a tensor is read (hours into a streamed analysis), and a list for a header was an AttributeError."""
    folder = _one_file(tmp_path / "f", header, data)
    with pytest.raises(UserError) as e:
        SafetensorsFolder(folder, "export it again").shapes()
    message = str(e.value)
    assert said in message and "model.safetensors" in message and "export it again" in message, message
    assert "\n" not in message


def test_safetensors_own_reader_refuses_what_the_header_check_refuses(tmp_path):
    """The rule is safetensors' own: a gap or bytes after the last tensor are refused by safe_open too."""
    from safetensors import SafetensorError, safe_open

    for name, header, data in (("gap", {"a": _entry(offsets=(8, 16))}, b"\0" * 16),
                               ("tail", {"a": _entry()}, b"\0" * 12)):  # fmt: skip
        folder = _one_file(tmp_path / name, header, data)
        with pytest.raises(SafetensorError), safe_open(folder / "model.safetensors", framework="pt") as f:
            f.get_tensor("a")


@pytest.mark.parametrize("where", ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors", ""])
def test_an_index_naming_a_file_outside_the_folder_is_refused(tmp_path, where):
    folder = sharded(tmp_path / "f")
    save_file({"x": torch.ones(2)}, tmp_path / "outside.safetensors")
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"]["a.weight"] = where
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(UserError, match=r"as the file of tensor a.weight, which is not a file inside"):
        SafetensorsFolder(folder)


def test_an_index_naming_a_tensor_its_shard_lacks_is_one_line(tmp_path):
    folder = sharded(tmp_path / "f")
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"]["b.bias"] = "model-00001-of-00002.safetensors"
    (folder / INDEX).write_text(json.dumps(index))
    st = SafetensorsFolder(folder)
    for read in (lambda: st.shape("b.bias"), lambda: dict(st.tensors(["b.bias"]))):
        with pytest.raises(UserError, match=r"puts tensor b.bias in .*00001-of-00002.safetensors, whose header"):
            read()


def test_symlinked_shards_are_read_as_the_hub_cache_lays_them_out(tmp_path):
    """snapshots/<revision>/ holds symlinks into blobs/ (huggingface_hub's cache): read through them."""
    blobs = sharded(tmp_path / "blobs")
    snapshot = tmp_path / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for p in blobs.iterdir():
        (snapshot / p.name).symlink_to(Path("../..") / "blobs" / p.name)
    read = dict(SafetensorsFolder(snapshot).tensors())
    assert all(torch.equal(read[k], v) for k, v in TENSORS.items())


def _blocked_open(path):
    """Whether reading `path`'s shapes ends within 10 s (a FIFO opened for reading waits for a writer), and how."""
    result = {}

    def read():
        try:
            SafetensorsFolder(path).shapes()
        except UserError as e:
            result["error"] = str(e)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(10)
    return thread.is_alive(), result.get("error", "")


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder"])
def test_a_shard_that_is_a_fifo_or_a_device_is_refused_without_waiting(tmp_path, kind):
    folder = sharded(tmp_path / "f")
    shard = folder / "model-00002-of-00002.safetensors"
    shard.unlink()
    if kind == "fifo":
        os.mkfifo(shard)
    elif kind == "dev-zero":
        shard.symlink_to("/dev/zero")
    else:
        shard.mkdir()
    try:
        waiting, error = _blocked_open(folder)
    finally:
        if kind == "fifo":  # a reader left waiting (before the fix) is let go
            with contextlib.suppress(OSError):
                os.close(os.open(shard, os.O_WRONLY | os.O_NONBLOCK))
    what = {"fifo": "a FIFO", "dev-zero": "a device", "folder": "a folder"}[kind]
    assert not waiting and f"00002-of-00002.safetensors is {what}, not a safetensors file" in error, error
