"""A seeded, bounded fuzzer over what a checkpoint folder holds: safetensors headers, index files and
quantization configs.

Every input either loads, bit for bit, what a valid checkpoint holds, or raises ValueError/TypeError (a missing
file: FileNotFoundError) naming the file. Headers are also checked against the safetensors library: whatever
qfp8 reads, safetensors reads to the same bytes. ``QFP8_FUZZ_EXAMPLES`` sets the examples per target (default
100, for CI; 2000 for a long local run).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import warnings

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis", reason="the fuzzer is written with hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from safetensors import SafetensorError, safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import qfp8  # noqa: E402
from qfp8.checkpoint.readers import open_checkpoint  # noqa: E402
from qfp8.checkpoint.safetensors_io import SafetensorsFile  # noqa: E402

EXAMPLES = int(os.environ.get("QFP8_FUZZ_EXAMPLES", "100"))
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=True,  # seeded: the same inputs on every run
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
REFUSED = (ValueError, TypeError, FileNotFoundError)

# Any JSON value, a few levels deep, with the values that have fooled readers before.
json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**65), 2**65),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["false", "true", "F32", "F8_E4M3", "tensor", "channel", "", "../x", "Linear", "local"]),
    st.text(max_size=8),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=8,
)


def _names_the_file(error: Exception, folder, names) -> bool:
    text = str(error)
    return str(folder) in text or any(name in text for name in names)


# ----------------------------------------------------------------- safetensors headers

BASE_TENSORS = {
    "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "s": torch.tensor([0.5], dtype=torch.float32),
    "q": torch.arange(8, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(2, 4),
}


def _base_header():
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in ("w", "s", "q"):
        t = BASE_TENSORS[name]
        size = t.numel() * t.element_size()
        dtype = {torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}[t.dtype]
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    data = b"".join(BASE_TENSORS[n].contiguous().view(torch.uint8).numpy().tobytes() for n in ("w", "s", "q"))
    return header, data


@st.composite
def header_files(draw):
    """A valid file's header, mutated a few times (or not), and its data area, cut or extended (or not)."""
    header, data = _base_header()
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(["w", "s", "q", "__metadata__", "new"]))
        action = draw(st.sampled_from(["dtype", "shape", "offsets", "offset", "entry", "copy", "drop"]))
        if name == "__metadata__" or name == "new" or action == "entry":
            header[name] = draw(json_value)
        elif not isinstance(header.get(name), dict):
            continue
        elif action == "offset":
            offsets = header[name].get("data_offsets")
            if isinstance(offsets, list) and len(offsets) == 2:
                offsets[draw(st.integers(0, 1))] = draw(st.integers(-4, 80))
        elif action == "copy":
            sources = [key for key in ("w", "s", "q") if isinstance(header.get(key), dict)]
            header[name] = dict(header[draw(st.sampled_from(sources))]) if sources else header[name]
        elif action == "drop":
            del header[name]
        else:
            key = {"dtype": "dtype", "shape": "shape", "offsets": "data_offsets"}[action]
            header[name][key] = draw(json_value)
    raw = json.dumps(header).encode()
    cut = draw(st.sampled_from([None, None, -1, -4, 4]))
    if cut is not None:
        data = data[:cut] if cut < 0 else data + bytes(cut)
    if draw(st.booleans()):
        raw += b" " * (-len(raw) % 8)
    return raw, data


def _oracle(path):
    """What safetensors reads from ``path`` (None: it refuses the file)."""
    try:
        with safe_open(path, "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, ValueError, TypeError, OSError):
        return None


@FUZZ
@given(header_files())
def test_fuzz_safetensors_headers(tmp_path_factory, case):
    raw, data = case
    path = tmp_path_factory.mktemp("header") / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    try:
        file = SafetensorsFile(path)
        ours = {name: file.read(name) for name in file.keys()}
    except (ValueError, TypeError) as error:
        assert str(path) in str(error), error
        return
    theirs = _oracle(path)
    assert theirs is not None, f"qfp8 read a header safetensors refuses: {raw[:300]!r}"
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        assert value.dtype == theirs[name].dtype and value.shape == theirs[name].shape
        assert torch.equal(value.reshape(-1).view(torch.uint8), theirs[name].reshape(-1).view(torch.uint8)), name


# ----------------------------------------------------------------- checkpoints: index files and configs

_CACHE: dict = {}


def _reference(tiny, root):
    """A sharded static-activation, KV-cache checkpoint and what qfp8 loads from it."""
    if "ref" not in _CACHE:
        model = tiny.model()
        qfp8.quantize(model, weight_scale="channel", activations="static", kv_cache="float8_e4m3fn")
        with qfp8.calibrate(model):
            model(tiny.tokens())
        folder = root / "reference"
        qfp8.save_pretrained(model, folder, max_shard_size="40KB")
        state = {k: v.clone() for k, v in open_checkpoint(folder).plan().state_dict().items()}
        _CACHE["ref"] = folder, state
    return _CACHE["ref"]


def _loads_the_reference_or_refuses(folder, state, names, full_load: bool):
    """The folder loads the reference's tensors bit for bit (and, loaded whole, gives finite logits), or is
    refused naming one of its files."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = open_checkpoint(folder).plan().state_dict()
            model = qfp8.from_pretrained(folder) if full_load else None
    except REFUSED as error:
        assert _names_the_file(error, folder, names), f"{type(error).__name__}: {error}"
        return "refused"
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        assert loaded[key].dtype == value.dtype
        assert torch.equal(loaded[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key
    if model is not None:
        with torch.no_grad():
            assert torch.isfinite(model(torch.arange(8)[None]).logits).all()
    return "loaded"


def _paths(value, prefix=()):
    """Every path into a nested dict/list."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _paths(item, (*prefix, i))


@st.composite
def edits(draw, document):
    """Replace, delete or add at a few paths of ``document`` (a JSON value), returning the edited copy."""
    document = json.loads(json.dumps(document))
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(document) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = document
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if action == "delete":
            del parent[path[-1]]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.sampled_from(["dynamic", "strategy", "num_bits", "x", "weights"]))] = draw(json_value)
        else:
            parent[path[-1]] = draw(json_value)
    return document


def _copy(reference, root):
    folder = root / "case"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(reference, folder)
    return folder


INDEX = "model.safetensors.index.json"


def test_fuzz_index_files(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("index")
    reference, state = _reference(tiny, tmp_path_factory.mktemp("reference"))
    document = json.loads((reference / INDEX).read_text())
    names = [p.name for p in reference.iterdir()]
    outcomes = []

    @FUZZ
    @given(st.data())
    def run(data):
        edited = data.draw(edits(document))
        folder = _copy(reference, root)
        (folder / INDEX).write_text(json.dumps(edited))
        outcomes.append(_loads_the_reference_or_refuses(folder, state, names, full_load=True))

    run()
    print(f"index files: {len(outcomes)} examples, {outcomes.count('loaded')} loaded, the rest refused")
    assert "refused" in outcomes


def test_fuzz_quantization_configs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("config")
    reference, state = _reference(tiny, tmp_path_factory.mktemp("reference"))
    config = json.loads((reference / "config.json").read_text())
    names = [p.name for p in reference.iterdir()]
    outcomes = []

    @FUZZ
    @given(st.data())
    def run(data):
        edited = dict(config, quantization_config=data.draw(edits(config["quantization_config"])))
        folder = _copy(reference, root)
        (folder / "config.json").write_text(json.dumps(edited))
        outcomes.append(_loads_the_reference_or_refuses(folder, state, names, full_load=True))

    run()
    print(f"quantization configs: {len(outcomes)} examples, {outcomes.count('loaded')} loaded, the rest refused")
    assert "refused" in outcomes and "loaded" in outcomes


def test_fuzz_shard_files(tiny, tmp_path_factory):
    """Headers of a real checkpoint's shard rewritten (a tensor renamed, retyped or reshaped), through the loader."""
    root = tmp_path_factory.mktemp("shards")
    reference, state = _reference(tiny, tmp_path_factory.mktemp("reference"))
    names = [p.name for p in reference.iterdir()]
    shard = sorted(reference.glob("model-*.safetensors"))[0]
    raw = shard.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])

    @FUZZ
    @given(st.data())
    def run(data):
        edited = data.draw(edits(header))
        folder = _copy(reference, root)
        text = json.dumps(edited).encode()
        (folder / shard.name).write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])
        outcomes.append(_loads_the_reference_or_refuses(folder, state, names, full_load=True))

    outcomes = []
    run()
    print(f"shard headers: {len(outcomes)} examples, {outcomes.count('loaded')} loaded, the rest refused")
    assert "refused" in outcomes


def test_the_reference_loads(tiny, tmp_path_factory):
    """The fuzzers' starting point is valid: unedited, it loads (so 'refused' above is the edits' doing)."""
    reference, state = _reference(tiny, tmp_path_factory.mktemp("reference"))
    save_file({"x": torch.zeros(1)}, tmp_path_factory.mktemp("x") / "a.safetensors")
    assert _loads_the_reference_or_refuses(reference, state, [], full_load=True) == "loaded"
