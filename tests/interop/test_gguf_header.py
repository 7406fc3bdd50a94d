"""A GGUF file's header as moe-lm reads it before any other reader (moe_lm/interop/gguf_header.py): the same keys,
values and tensors as gguf-py's reader on a valid file, and every damaged or hostile length refused in one line
naming the file, without allocating what the length says, and without waiting on a FIFO."""

from __future__ import annotations

import os
import struct

import gguf
import numpy as np
import pytest

from moe_lm.errors import UserError
from moe_lm.interop.gguf_header import is_gguf, read_gguf_header, tensor_types


def write_gguf(path, **keys) -> None:
    """A small GGUF file: an architecture, `keys` (ints as u32, strings, lists of strings), two tensors."""
    w = gguf.GGUFWriter(str(path), arch="deepseek2")
    for key, value in keys.items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_uint32(key, value)
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.arange(24, dtype=np.float32).reshape(3, 8))
    w.add_tensor("token_embd.weight", np.ones((4, 64), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_header_holds_what_gguf_py_reads(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, **{"deepseek2.expert_count": 8, "tokenizer.ggml.tokens": ["<s>", "▁the", "<0x0A>"]})
    header, reader = read_gguf_header(path), gguf.GGUFReader(path)
    assert header.arch == "deepseek2" and header.get("expert_count") == 8
    assert header.fields["tokenizer.ggml.tokens"] == ["<s>", "▁the", "<0x0A>"]
    assert set(header.fields) == set(reader.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    assert [(t.name, t.shape, t.type, t.offset) for t in header.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset) - reader.data_offset)
        for t in reader.tensors
    ]
    assert header.data_offset == reader.data_offset
    assert tensor_types(header) == "1 F32, 1 F16" and is_gguf(path)


def hostile_array(count: int) -> bytes:
    """49 bytes: GGUF v3, no tensors, one key `a` holding an array of `count` u8 (none of them present)."""
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a"
    return head + struct.pack("<IIQ", 9, 0, count)


@pytest.mark.parametrize(
    "damage, needle",
    [
        (lambda ok: hostile_array(2**62), "4,611,686,018,427,387,904 elements of a"),
        (lambda ok: b"GGUF" + struct.pack("<IQQ", 3, 2**40, 2**40), "key-values and"),
        (lambda ok: b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**60) + bytes(16), "key 0"),
        (lambda ok: b"GGUF" + struct.pack("<IQQ", 7, 0, 0), "GGUF version 7"),
        (lambda ok: ok[:-100], "runs past the end of the file"),
        (lambda ok: ok[:60], "damaged GGUF header"),
        (lambda ok: b"GGUX" + ok[4:], "not a GGUF file"),
    ],
)
def test_a_damaged_or_hostile_header_is_one_line_naming_the_file(tmp_path, damage, needle):
    """The 49-byte file declaring a 2**62-element array took gguf-py 0.19's reader 19 s and 3.4 GB before
    llama.cpp refused it; here every length is checked against the bytes the file has, before it is read."""
    write_gguf(tmp_path / "ok.gguf", **{"deepseek2.expert_count": 8})
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage((tmp_path / "ok.gguf").read_bytes()))
    with pytest.raises(UserError) as e:
        read_gguf_header(bad)
    assert str(bad) in str(e.value) and needle in str(e.value) and "\n" not in str(e.value)


def test_analyze_refuses_a_hostile_gguf_before_llama_cpp_reads_it(tmp_path, cli):
    (tmp_path / "bad.gguf").write_bytes(hostile_array(2**62))
    data = tmp_path / "docs.txt"
    data.write_text("the telescope tracked a distant galaxy " * 20)
    proc = cli("analyze", "--gguf", tmp_path / "bad.gguf", "--data", data, "--out", tmp_path / "a")
    assert proc.returncode == 2 and "elements of a" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_fifo_is_refused_without_being_waited_on(tmp_path, cli):
    """gguf-py opened a FIFO before any check and waited for a writer forever; moe-lm opens it without blocking and
    refuses it (as a subject and as a compared subject)."""
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    assert not is_gguf(fifo)
    with pytest.raises(UserError, match="is a FIFO, not a GGUF file"):
        read_gguf_header(fifo)
    data = tmp_path / "docs.txt"
    data.write_text("the telescope tracked a distant galaxy " * 20)
    proc = cli("analyze", "--gguf", fifo, "--data", data, "--out", tmp_path / "a")
    assert proc.returncode == 2 and "is a FIFO" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    proc = cli("analyze", "--hf", tmp_path, "--data", data, "--out", tmp_path / "b", "--compare", fifo)
    assert proc.returncode == 2 and "not a GGUF file, a transformers folder" in proc.stderr, proc.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
