"""The one safetensors reader (moe_lm/interop/safetensors_folder.py): a single file and shards with an index read the
same tensors as safetensors' own loader, names and shapes come from headers alone, and damaged folders are one line
naming the file."""

from __future__ import annotations

import json
import struct

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
