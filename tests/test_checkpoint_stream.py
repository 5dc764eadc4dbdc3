"""Streamed safetensors files (written one tensor at a time, read with positioned reads)
are byte-compatible with the ``safetensors`` library both ways, and the recorded SHA-256 is the file's."""

import hashlib

import pytest
import torch

from tnlg.checkpoint.stream import SafetensorsReader, StreamWriter
from tnlg.io import file_sha256


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(5, 3, generator=g), "b": torch.randn(7, generator=g).bfloat16(),
            "c": torch.randn(2, 3, 4, generator=g).half(), "empty": torch.zeros(0, 3), "scalar": torch.tensor(3.0),
            "ids": torch.arange(6, dtype=torch.int64).view(2, 3)}


def test_stream_written_file_loads_with_safetensors_and_checksum(tmp_path):
    from safetensors.torch import load_file
    ts = _tensors()
    path = str(tmp_path / "x.safetensors")
    w = StreamWriter(path, [(k, tuple(v.shape), v.dtype) for k, v in ts.items()], {"format": "t"})
    for k, v in ts.items():
        w.write(k, v)
    size, sha = w.close()
    back = load_file(path)
    assert all(torch.equal(back[k], ts[k]) for k in ts)
    data = open(path, "rb").read()
    assert size == len(data) and sha == hashlib.sha256(data).hexdigest() == file_sha256(path)


def test_reader_reads_library_files_and_row_ranges(tmp_path):
    from safetensors.torch import save_file
    ts = _tensors()
    path = str(tmp_path / "y.safetensors")
    save_file(ts, path, metadata={"q": "r"})
    r = SafetensorsReader(path)
    assert sorted(r.keys()) == sorted(ts) and r.metadata == {"q": "r"}
    assert all(torch.equal(r.get_tensor(k), ts[k]) for k in ts)
    assert torch.equal(r.get_slice("a")[1:3], ts["a"][1:3])
    assert torch.equal(r.get_slice("b")[2:5], ts["b"][2:5])
    assert torch.equal(r.get_slice("c")[(slice(None), slice(1, 3))], ts["c"][:, 1:3])


def test_writer_refuses_out_of_order_and_reader_refuses_garbage(tmp_path):
    w = StreamWriter(str(tmp_path / "z.safetensors"), [("a", (2,), torch.float32)])
    with pytest.raises(ValueError, match="expected 'a'"):
        w.write("b", torch.zeros(2))
    w.abort()
    assert not list(tmp_path.iterdir())
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError):
        SafetensorsReader(str(tmp_path / "bad.safetensors"))
