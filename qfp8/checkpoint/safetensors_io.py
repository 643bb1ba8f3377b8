"""Reading and writing safetensors files tensor by tensor, and atomic file replacement.

A safetensors file is an 8-byte little-endian header length ``H``, a JSON
header of ``H`` bytes (``{name: {dtype, shape, data_offsets: [begin, end]},
"__metadata__": {str: str}}``, offsets relative to the end of the header),
then the tensor bytes. qfp8 parses the header itself so that

- loading maps the file (``UntypedStorage.from_file``, private mapping) and
  hands out views of it: no copy of a weight is made;
- streaming reads one tensor with ``pread`` into its own buffer, so pages of
  tensors already processed do not stay in the process's memory;
- writing streams one tensor at a time after a header computed up front,
  so a shard is never held in memory whole;
- a truncated or corrupt file raises ``ValueError`` naming the file, the
  tensor and the sizes involved.

Only safetensors is read: nothing here can unpickle.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import stat
import struct
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "AtomicDirectoryWrite",
    "DTYPES",
    "DTYPE_NAMES",
    "MAX_HEADER_BYTES",
    "OLD_TEMP_FILE",
    "PICKLE_SUFFIXES",
    "PlannedTensor",
    "SafetensorsFile",
    "TEMP_FILE",
    "TensorInfo",
    "is_temporary_file",
    "refuse_pickle_message",
    "write_safetensors",
]

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """The header of one safetensors file, and its tensors on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if self.path.suffix in PICKLE_SUFFIXES:
            raise ValueError(refuse_pickle_message(self.path))
        self.size = check_regular_file(self.path, "safetensors file")
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(
                    f"{self.path}: not a safetensors file ({self.size} bytes, shorter than its 8-byte header length)"
                )
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(MAX_HEADER_BYTES, self.size - 8):
                raise ValueError(
                    f"{self.path}: header length {header_len} does not fit in the file ({self.size} bytes); "
                    "the file is truncated or not safetensors"
                )
            raw = f.read(header_len)
        header = parse_header(raw, self.path)
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.data_start = 8 + header_len
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            self.tensors[name] = self._check_entry(name, entry)
        self._check_layout()

    def _check_entry(self, name: str, entry) -> TensorInfo:
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise ValueError(f"{self.path}: tensor {name!r} has a corrupt header entry {entry!r}")
        dtype_name, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype_name!r}")
        if not isinstance(shape, list) or not all(_is_count(size) for size in shape):
            raise ValueError(f"{self.path}: tensor {name!r} has shape {shape!r}; expected a list of ints >= 0")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
            raise ValueError(f"{self.path}: tensor {name!r} has data_offsets {offsets!r}; expected [begin, end] ints")
        begin, end = offsets
        dtype = DTYPES[dtype_name]
        expected = math.prod(shape) * dtype.itemsize
        if end - begin != expected:
            raise ValueError(
                f"{self.path}: tensor {name!r} {dtype_name} {list(shape)} needs {expected} bytes, "
                f"its header gives {end - begin} (offsets {begin}..{end})"
            )
        if self.data_start + end > self.size:
            raise ValueError(
                f"{self.path}: tensor {name!r} {dtype_name} {list(shape)} ends at byte {self.data_start + end}, "
                f"past the end of the file ({self.size} bytes); the file is truncated"
            )
        return TensorInfo(name, dtype, tuple(shape), self.data_start + begin, self.data_start + end)

    def _check_layout(self) -> None:
        """As safetensors requires: the tensors tile the data area, in some order, with no gap, overlap (two
        names for one region) or trailing byte."""
        position = self.data_start
        for info in sorted(self.tensors.values(), key=lambda t: (t.begin, t.end)):
            if info.begin != position:
                what = "overlaps the tensor before it" if info.begin < position else "leaves a gap before it"
                raise ValueError(
                    f"{self.path}: tensor {info.name!r} starts at data offset {info.begin - self.data_start}, "
                    f"expected {position - self.data_start}: it {what} (safetensors tensors tile the data)"
                )
            position = info.end
        if position != self.size:
            raise ValueError(
                f"{self.path}: {self.size - position} byte(s) after the last tensor; a safetensors file ends "
                "with its last tensor"
            )

    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        return self.tensors[name]

    _storage = None

    def get(self, name: str) -> torch.Tensor:
        """A view of the memory-mapped file (private mapping: writes never reach the file)."""
        info = self.info(name)
        if self._storage is None:
            self._storage = torch.UntypedStorage.from_file(str(self.path), shared=False, nbytes=self.size)
        data = torch.empty(0, dtype=torch.uint8, device="cpu").set_(self._storage, info.begin, (info.nbytes,), (1,))
        if info.begin % max(info.dtype.itemsize, 1):
            data = data.clone()  # misaligned (not written by qfp8 or safetensors): copy the few bytes
        return data.view(info.dtype).reshape(info.shape)

    def read(self, name: str) -> torch.Tensor:
        """A fresh copy of one tensor, read with ``pread`` (no mapping kept)."""
        info = self.info(name)
        buffer = bytearray(info.nbytes)
        with open(self.path, "rb") as f:
            f.seek(info.begin)
            got = f.readinto(buffer)
        if got != info.nbytes:
            raise ValueError(f"{self.path}: tensor {name!r}: read {got} of {info.nbytes} bytes; the file is truncated")
        if not buffer:
            return torch.empty(info.shape, dtype=info.dtype, device="cpu")
        return torch.frombuffer(buffer, dtype=torch.uint8).view(info.dtype).reshape(info.shape)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_regular_file(path: Path, what: str) -> int:
    """The size of ``path``; FileNotFoundError if missing, ValueError naming it if it is a folder, FIFO, device
    or socket (a FIFO would block the first read forever): checked before it is opened."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such {what}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFSOCK: "a socket"}.get(
            stat.S_IFMT(info.st_mode), "a device"
        )
        raise ValueError(f"{path} is {kind}, not a {what}")
    return info.st_size


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _unique_keys(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"key {key!r} appears twice")
        seen[key] = value
    return seen


def parse_json(raw: bytes, path: Path, what: str):
    """Strict JSON from ``raw``: UTF-8, no duplicate keys, no NaN/Infinity, bounded nesting; ValueError naming
    ``path`` otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: {what} is not UTF-8 text: {error}") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_refuse_constant)
    except RecursionError:
        raise ValueError(f"{path}: {what} is nested too deeply") from None
    except ValueError as error:  # json.JSONDecodeError is one
        raise ValueError(f"{path}: {what} is not valid JSON: {error}") from None


MAX_JSON_BYTES = 256 * 1024 * 1024


def read_json_file(path: str | os.PathLike, what: str = "JSON file"):
    """A checkpoint's JSON file (config.json, an index, a quanto map), strictly parsed (see :func:`parse_json`);
    special files are refused before they are opened."""
    path = Path(path)
    size = check_regular_file(path, what)
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{path}: {size} bytes, larger than any {what} ({MAX_JSON_BYTES} bytes at most)")
    with open(path, "rb") as f:
        return parse_json(f.read(), path, what)


def parse_header(raw: bytes, path: Path) -> dict:
    """A safetensors header, parsed and checked as safetensors does: a UTF-8 JSON object, with
    ``__metadata__`` (if any) a map of strings to strings."""
    if not raw.startswith(b"{"):
        raise ValueError(f"{path}: corrupt safetensors header: it must start with '{{'")
    header = parse_json(raw, path, "its safetensors header")
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header: expected a JSON object")
    metadata = header.get("__metadata__")
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
    ):
        raise ValueError(f"{path}: safetensors __metadata__ must map strings to strings, got {metadata!r:.200}")
    return header


def refuse_pickle_message(path) -> str:
    return (
        f"{path}: refusing to load a pickle file (loading one can run arbitrary code); qfp8 reads only "
        "safetensors. Convert it in a trusted environment (for example with transformers: "
        "model.save_pretrained(dir, safe_serialization=True))"
    )


# ------------------------------------------------------------------ writing


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor to write: its header entry, and a callable giving its data when its turn comes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _ordered(tensors: Iterable[PlannedTensor]) -> list[PlannedTensor]:
    # Larger elements first keeps every tensor aligned to its element size
    # (the header is padded to 8 bytes), as safetensors' own writer does.
    return sorted(tensors, key=lambda t: (-t.dtype.itemsize, t.name))


def write_safetensors(path: str | os.PathLike, tensors: Iterable[PlannedTensor], metadata: dict | None = None) -> None:
    """Writes ``tensors`` to ``path`` one at a time (header first, computed from the plan)."""
    planned = _ordered(tensors)
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for t in planned:
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"tensor {t.name!r}: dtype {t.dtype} cannot be stored in safetensors")
        header[t.name] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in planned:
            value = t.produce()
            if value.dtype != t.dtype or tuple(value.shape) != t.shape:
                raise ValueError(
                    f"tensor {t.name!r}: planned {t.dtype} {list(t.shape)}, produced {value.dtype} {list(value.shape)}"
                )
            value = value.detach().to("cpu").contiguous()
            if value.numel():
                f.write(memoryview(value.view(torch.uint8).reshape(-1).numpy()))
            del value
        f.flush()
        os.fsync(f.fileno())


# AtomicDirectoryWrite's temporary files: ".{name}.qfp8-{8 random characters}.tmp" (tempfile.mkstemp's random
# part), and before that ".{name}.{8 random characters}.tmp", which only the checkpoint's own names are taken for.
TEMP_FILE = re.compile(r"\.(?P<name>.+)\.qfp8-[a-z0-9_]{8}\.tmp")
OLD_TEMP_FILE = re.compile(
    r"\.(?P<name>model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json|config\.json)\.[a-z0-9_]{8}\.tmp"
)


def is_temporary_file(name: str) -> bool:
    """Whether ``name`` is one of AtomicDirectoryWrite's temporary files (other names are never removed)."""
    return bool(TEMP_FILE.fullmatch(name) or OLD_TEMP_FILE.fullmatch(name))


def _umask() -> int:
    """The process umask (read by setting it and setting it back: the one portable way)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def _interrupts_deferred():
    """SIGINT (Ctrl-C) received inside the block is delivered when it ends (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            signal.raise_signal(signal.SIGINT)


class AtomicDirectoryWrite:
    """Files written under temporary names in ``directory``, renamed into place together at the end.

    If anything fails before :meth:`commit`, the temporary files are removed
    and the files already in ``directory`` (an older checkpoint) are left as
    they were. ``stale`` files (an older checkpoint's shards that the new one
    does not have) are removed after the renames.

    A process killed while writing (SIGKILL, or SIGTERM without a handler)
    cannot remove its temporary files; the next write into the folder removes
    every file named as these are (see :func:`is_temporary_file`) when it
    starts. Two writes into one folder at the same time are not supported.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        # The folders this write creates (innermost first): a failed write removes them again.
        self.created = [p for p in (self.directory, *self.directory.parents) if not p.exists()]
        self.directory.mkdir(parents=True, exist_ok=True)
        self.pending: dict[str, Path] = {}
        self.removed_leftovers = self._remove_leftovers()

    def _remove_leftovers(self) -> list[str]:
        """Removes the temporary files an earlier, killed write left in the folder; returns their names."""
        removed = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False) and is_temporary_file(entry.name):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                        removed.append(entry.name)
        return sorted(removed)

    def path_for(self, name: str) -> Path:
        """A temporary path whose file becomes ``directory/name`` on commit."""
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.qfp8-", suffix=".tmp", dir=self.directory)
        os.close(fd)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes the file 0600; a checkpoint is shared as open() would
        self.pending[name] = Path(tmp)
        return Path(tmp)

    def write_text(self, name: str, text: str) -> None:
        path = self.path_for(name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def commit(self, stale: Iterable[str] = ()) -> None:
        """Renames the files into place and removes ``stale`` ones; Ctrl-C waits until all is done.

        Order: shards, then an older single ``model.safetensors`` that a
        sharded checkpoint replaces (readers take that file before an index),
        then the index and ``config.json``, then the other stale files. A
        process killed between two renames thus leaves either the old files
        or a folder no reader loads, never old weights under a new config.
        """
        last = ("model.safetensors.index.json", "config.json")
        stale = list(stale)
        early = [
            name for name in stale if name == "model.safetensors" and "model.safetensors.index.json" in self.pending
        ]
        with _interrupts_deferred():
            for name in [n for n in self.pending if n not in last]:
                os.replace(self.pending[name], self.directory / name)
            for name in early:
                with contextlib.suppress(FileNotFoundError):
                    (self.directory / name).unlink()
            for name in [n for n in last if n in self.pending]:
                os.replace(self.pending[name], self.directory / name)
            self.pending.clear()
            for name in stale:
                if name not in early:
                    with contextlib.suppress(FileNotFoundError):
                        (self.directory / name).unlink()

    def abort(self) -> None:
        for tmp in self.pending.values():
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        self.pending.clear()
        for folder in self.created:  # only while empty: nothing of anyone else's is removed
            with contextlib.suppress(OSError):
                folder.rmdir()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
        return False
