"""qfp8's safetensors header reader keeps the safetensors rules, and special files are refused before opening.

Every malformed header here is refused by the safetensors library too (checked, as the oracle), and by qfp8
with a ValueError naming the file: through the header reader, ``from_pretrained``, ``qfp8 inspect`` and
``qfp8 quantize``.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

import qfp8
from qfp8.checkpoint.safetensors_io import SafetensorsFile
from qfp8.cli import main


def raw_file(path, header, data: bytes, pad=True):
    """A safetensors file from a header (a dict, or the raw header bytes) and the data area."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


TWO = {"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 8, 16)}
BAD_HEADERS = {
    "aliased": ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 0, 8)}, 8, "overlaps"),
    "partly-overlapping": ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, 12, "overlaps"),
    "gap": ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 12, 20)}, 20, "leaves a gap"),
    "not-from-zero": ({"a": entry("F32", [2], 4, 12)}, 12, "leaves a gap"),
    "trailing-bytes": (TWO, 20, r"4 byte\(s\) after the last tensor"),
    "duplicate-key": (
        b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}',
        16,
        "key 'a' appears twice",
    ),  # fmt: skip
    "utf16": (json.dumps(TWO).encode("utf-16"), 16, "must start with"),
    "not-utf8": (b'{"\xff":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', 8, "not UTF-8"),
    "metadata-list": ({"__metadata__": ["x"], **TWO}, 16, "__metadata__ must map strings to strings"),
    "metadata-int-value": ({"__metadata__": {"format": 1}, **TWO}, 16, "__metadata__ must map strings to strings"),
    "float-shape": ({"a": entry("F32", [2.0], 0, 8)}, 8, r"shape \[2\.0\]; expected a list of ints"),
    "negative-shape": ({"a": entry("F32", [-2], 0, 8)}, 8, r"shape \[-2\]"),
    "bool-shape": ({"a": entry("F32", [True, 2], 0, 8)}, 8, r"shape \[True, 2\]"),
    "dtype-list": ({"a": entry(["F32"], [2], 0, 8)}, 8, r"unsupported dtype \['F32'\]"),
    "float-offsets": ({"a": entry("F32", [2], 0.0, 8)}, 8, "data_offsets"),
    "wrong-size": ({"a": entry("F32", [3], 0, 8)}, 8, "needs 12 bytes"),
    "nan": (b'{"a":{"dtype":"F32","shape":[NaN],"data_offsets":[0,8]}}', 8, "NaN is not JSON"),
    "deep": (b'{"a":' + b"[" * 100000 + b"]" * 100000 + b"}", 0, "nested too deeply"),
    "not-an-object": (b"[1, 2]", 0, "must start with"),
    "not-json": (b"{not json}", 0, "not valid JSON"),
}


@pytest.mark.parametrize("header, size, match", BAD_HEADERS.values(), ids=BAD_HEADERS.keys())
def test_a_header_safetensors_refuses_is_refused_naming_the_file(tmp_path, header, size, match):
    path = raw_file(tmp_path / "x.safetensors", header, bytes(size))
    with pytest.raises(SafetensorError):  # the oracle
        with safe_open(path, "pt") as f:
            [f.get_tensor(k) for k in f.keys()]
    with pytest.raises(ValueError, match=match) as error:
        SafetensorsFile(path)
    assert str(path) in str(error.value)


def test_valid_headers_still_load(tmp_path):
    tensors = {"w": torch.randn(3, 5), "b": torch.arange(4, dtype=torch.int64), "z": torch.zeros(0, 7)}
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert f.metadata == {"format": "pt"}
    for name, value in tensors.items():
        assert torch.equal(f.get(name), value) and torch.equal(f.read(name), value)
    raw_file(tmp_path / "y.safetensors", {"__metadata__": None, **TWO}, bytes(16))  # null metadata, as safetensors
    assert SafetensorsFile(tmp_path / "y.safetensors").keys() == ["a", "b"]


@pytest.fixture
def saved(tiny, tmp_path):
    model = tiny.model()
    qfp8.quantize(model, weight_scale="channel")
    qfp8.save_pretrained(model, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _alias(folder, target, source):
    """Rewrites model.safetensors so that ``target``'s header entry points at ``source``'s bytes."""
    tensors = load_file(folder / "model.safetensors")
    del tensors[target]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header[target] = dict(header[source])
    raw_file(path, header, raw[8 + length :])


def test_aliased_tensors_in_a_checkpoint_are_refused_by_from_pretrained_and_the_cli(saved, tmp_path):
    _alias(saved, "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_proj.weight")
    for run in (
        lambda: qfp8.from_pretrained(saved),
        lambda: main(["inspect", str(saved)]),
        lambda: main(["quantize", str(saved), str(tmp_path / "out"), "--no-progress"]),
    ):
        with pytest.raises(ValueError, match=r"model\.safetensors: tensor .* overlaps the tensor before it"):
            run()


def _unblocker(fifo, stop):
    """Opens the FIFO for writing now and then, so that a reader blocked in open() gets EOF instead of hanging
    the test run forever (the test then fails, not hangs)."""
    while not stop.wait(2):
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_special_file_named_model_safetensors_is_refused_by_name(saved, tmp_path, kind):
    path = saved / "model.safetensors"
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    stop = threading.Event()
    threading.Thread(target=_unblocker, args=(path, stop), daemon=True).start()
    what = "a FIFO" if kind == "fifo" else "a folder"
    try:
        for run in (
            lambda: qfp8.from_pretrained(saved),
            lambda: main(["inspect", str(saved)]),
            lambda: main(["quantize", str(saved), str(tmp_path / "out"), "--no-progress"]),
        ):
            start = time.monotonic()
            with pytest.raises(ValueError, match=rf"model\.safetensors is {what}"):
                run()
            assert time.monotonic() - start < 2  # refused before any open(), not after a reader gave up
    finally:
        stop.set()


JSON_FILES = {
    "config-latin1": ("config.json", "é".encode("latin-1"), "config.json is not UTF-8 text"),
    "config-deep": ("config.json", b"[" * 100000 + b"]" * 100000, "config.json is nested too deeply"),
    "config-duplicate": ("config.json", b'{"model_type": "llama", "model_type": "gpt2"}', "appears twice"),
    "config-folder": ("config.json", None, "config.json is a folder"),
    "index-deep": ("model.safetensors.index.json", b"[" * 100000 + b"]" * 100000, "nested too deeply"),
    "qmap-string-entry": ("quanto_qmap.json", b'{"model.layers.0.mlp.up_proj": "qfloat8"}', "expected an object"),
    "qmap-list-weights": (
        "quanto_qmap.json",
        b'{"model.layers.0.mlp.up_proj": {"weights": ["qfloat8"]}}',
        "weights must be a qtype name",
    ),
}


@pytest.mark.parametrize("name, content, match", JSON_FILES.values(), ids=JSON_FILES.keys())
def test_bad_json_files_are_refused_naming_the_file(saved, name, content, match):
    path = saved / name
    if content is None:
        path.unlink()
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=match) as error:
        qfp8.from_pretrained(saved)
    assert str(path) in str(error.value)
