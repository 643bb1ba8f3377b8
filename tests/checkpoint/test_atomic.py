"""Replacing a checkpoint: whatever stops the writer when, the folder loads as the old model or the new one, whole.

The writer is killed (SIGKILL, in a forked child) or fails (OSError) at each step of the commit
(:data:`qfp8.checkpoint.atomic.COMMIT_STEPS`), for every change of layout (one file, shards); what the folder then
holds is compared byte for byte with the old and the new checkpoint, and loaded with qfp8 and with transformers,
whose logits must be the old model's or the new one's, bit for bit. The next save then finishes the job: the new
checkpoint, the user's files and folders, no leftovers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import warnings

import pytest
import torch
from safetensors.torch import load_file

import qfp8
from qfp8.checkpoint.atomic import COMMIT_STEPS, FolderInUseError
from qfp8.checkpoint.safetensors_io import PlannedTensor
from qfp8.checkpoint.writer import write_checkpoint

SHARD_SIZES = {"single": "5GB", "sharded": "40KB"}
LAYOUTS = [(a, b) for a in SHARD_SIZES for b in SHARD_SIZES]
USER_FILES = {"README.md": b"my notes\n", "tokenizer.json": b'{"mine": true}\n'}


def _quantized(tiny, seed):
    model = tiny.model(seed=seed)
    qfp8.quantize(model, weight_scale="channel")
    return model


def _snapshot(folder):
    """The checkpoint's files (not the user's, not hidden ones): name -> sha256."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.name not in USER_FILES
    }


def _plan(folder):
    """A saved checkpoint as write_checkpoint's arguments (tensors in memory: a forked child only writes files)."""
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    plan = [PlannedTensor(k, v.dtype, tuple(v.shape), lambda v=v: v) for k, v in tensors.items()]
    extra = {p.name: p for p in folder.glob("generation_config.json")}
    return plan, json.loads((folder / "config.json").read_text()), extra


def _logits_by(loader, folder, x):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return loader(folder)(x).logits


def _transformers_load(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


class Generations:
    def __init__(self, tiny, root):
        self.x = tiny.tokens()
        self.refs, self.plans, self.logits = {}, {}, {}
        for age, seed in (("old", 1), ("new", 2)):
            model = _quantized(tiny, seed)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                qfp8.save_pretrained(model, root / f"{age}-saved")
            for layout in SHARD_SIZES:
                folder = root / f"{age}-{layout}"
                self.plans[age, layout] = _plan(root / f"{age}-saved")
                self.write(folder, age, layout)
                self.refs[age, layout] = _snapshot(folder)
            self.logits[age] = {
                "qfp8": _logits_by(qfp8.from_pretrained, folder, self.x),
                "transformers": _logits_by(_transformers_load, folder, self.x),
            }
        assert not torch.equal(self.logits["old"]["qfp8"], self.logits["new"]["qfp8"])
        assert len(self.refs["old", "sharded"]) > 3  # an index and at least 3 shards

    def write(self, folder, age, layout):
        plan, config, extra = self.plans[age, layout]
        write_checkpoint(folder, plan, config, SHARD_SIZES[layout], extra)

    def prepare(self, folder, layout):
        """``folder`` holding the old checkpoint in ``layout`` and the user's files and sub-folder."""
        shutil.rmtree(folder, ignore_errors=True)
        self.write(folder, "old", layout)
        for name, data in USER_FILES.items():
            (folder / name).write_bytes(data)
        (folder / "notes").mkdir()
        (folder / "notes" / "a.txt").write_text("kept")

    def which(self, folder, old_layout, new_layout, x) -> str:
        """'old' or 'new': what the folder holds, by its files and as qfp8 and transformers load it."""
        files = _snapshot(folder)
        age = {self.refs["old", old_layout] == files: "old", self.refs["new", new_layout] == files: "new"}.get(True)
        assert age is not None, f"torn: {sorted(files)}"
        for reader, loader in (("qfp8", qfp8.from_pretrained), ("transformers", _transformers_load)):
            assert torch.equal(_logits_by(loader, folder, x), self.logits[age][reader]), (reader, age)
        assert all((folder / name).read_bytes() == data for name, data in USER_FILES.items())
        return age

    def finish(self, folder, new_layout):
        """The next save into the folder completes it: the new checkpoint, the user's entries, nothing left over."""
        self.write(folder, "new", new_layout)
        assert _snapshot(folder) == self.refs["new", new_layout]
        assert (folder / "notes" / "a.txt").read_text() == "kept"
        assert all((folder / name).read_bytes() == data for name, data in USER_FILES.items())
        assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []
        assert sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(".")) == []


_CACHE: dict[str, Generations] = {}


@pytest.fixture
def gens(tiny, tmp_path_factory):
    """Built once for the module (a few saves and loads)."""
    if "gens" not in _CACHE:
        _CACHE["gens"] = Generations(tiny, tmp_path_factory.mktemp("generations"))
    return _CACHE["gens"]


def _killed_write(gens, folder, layout, step) -> int:
    """Forks a child that writes the checkpoint with ``QFP8_COMMIT_FAULT=kill:<step>``; returns its signal."""
    pid = os.fork()
    if pid == 0:  # the child: write, and be killed at the step
        try:
            os.environ["QFP8_COMMIT_FAULT"] = f"kill:{step}"
            gens.write(folder, "new", layout)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0


def test_a_writer_killed_at_every_commit_step_leaves_the_old_or_the_new_checkpoint(gens, tmp_path):
    folder = tmp_path / "ckpt"
    outcomes, torn = {}, []
    for old_layout, new_layout in LAYOUTS:
        for step in COMMIT_STEPS:
            gens.prepare(folder, old_layout)
            killed = _killed_write(gens, folder, new_layout, step)
            assert killed == signal.SIGKILL, (step, "the child was not killed at the step")
            try:
                outcomes[old_layout, new_layout, step] = gens.which(folder, old_layout, new_layout, gens.x)
            except AssertionError as error:
                torn.append((old_layout, new_layout, step, str(error)))
            gens.finish(folder, new_layout)
    print(f"{len(COMMIT_STEPS)} steps x {len(LAYOUTS)} layouts: {len(torn)} torn, {outcomes}")
    assert torn == []
    assert len(outcomes) == len(COMMIT_STEPS) * len(LAYOUTS)
    # Before the swap the folder is the old checkpoint, from the swap on the new one.
    for (_, _, step), age in outcomes.items():
        assert age == ("old" if COMMIT_STEPS.index(step) < COMMIT_STEPS.index("exchanged") else "new"), step


def test_an_error_at_every_commit_step_leaves_the_old_or_the_new_checkpoint(gens, tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    for old_layout, new_layout in LAYOUTS:
        for step in COMMIT_STEPS:
            gens.prepare(folder, old_layout)
            monkeypatch.setenv("QFP8_COMMIT_FAULT", f"raise:{step}")
            before_swap = COMMIT_STEPS.index(step) < COMMIT_STEPS.index("exchanged")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if before_swap:  # the save fails, and says so; nothing of it is left
                    with pytest.raises(OSError, match=step):
                        gens.write(folder, "new", new_layout)
                else:  # the new checkpoint is in place: the save succeeds, warning that cleanup is left to the next
                    gens.write(folder, "new", new_layout)
                    assert any("the new checkpoint is in place" in str(w.message) for w in caught), step
            monkeypatch.delenv("QFP8_COMMIT_FAULT")
            age = gens.which(folder, old_layout, new_layout, gens.x)
            assert age == ("old" if before_swap else "new"), (old_layout, new_layout, step)
            if before_swap:
                assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging folder, no lock
            gens.finish(folder, new_layout)


def test_save_pretrained_killed_in_a_subprocess_keeps_the_old_checkpoint(tiny, tmp_path):
    """The hook in a real process running qfp8.save_pretrained: killed after the files are staged."""
    folder = tmp_path / "ckpt"
    qfp8.save_pretrained(_quantized(tiny, 1), folder)
    before = _snapshot(folder)
    script = (
        "import sys, torch, transformers, qfp8\n"
        "torch.manual_seed(2)\n"
        "config = transformers.LlamaConfig(**__import__('json').loads(sys.argv[2]))\n"
        "model = transformers.AutoModelForCausalLM.from_config(config)\n"
        "qfp8.quantize(model)\n"
        "qfp8.save_pretrained(model, sys.argv[1])\n"
    )
    env = {**os.environ, "QFP8_COMMIT_FAULT": "kill:carried"}
    run = subprocess.run(
        [sys.executable, "-c", script, str(folder), json.dumps(tiny.sizes)], env=env, capture_output=True, timeout=300
    )
    assert run.returncode == -signal.SIGKILL, run.stderr.decode()[-2000:]
    assert _snapshot(folder) == before
    assert any(p.name.startswith(".ckpt.qfp8-stage-") for p in tmp_path.iterdir())  # what it had staged
    qfp8.save_pretrained(_quantized(tiny, 3), folder)  # the next save removes it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_second_writer_fails_at_once_and_the_first_is_not_broken(gens, tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    gens.prepare(folder, "single")
    plan, config, extra = gens.plans["new", "sharded"]
    first_writing, second_done, errors = threading.Event(), threading.Event(), []

    def slow(entry):
        def produce():
            first_writing.set()
            second_done.wait(60)
            return entry.produce()

        return PlannedTensor(entry.name, entry.dtype, entry.shape, produce)

    def first():
        try:
            write_checkpoint(folder, [slow(e) for e in plan], config, SHARD_SIZES["sharded"], extra)
        except Exception as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert first_writing.wait(60)
        with pytest.raises(FolderInUseError, match="another process is saving a checkpoint into this folder"):
            gens.write(folder, "old", "single")
    finally:
        second_done.set()
        thread.join(60)
    assert errors == []
    assert gens.which(folder, "single", "sharded", gens.x) == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_new_folder_and_the_working_folder(gens, tmp_path, monkeypatch):
    """A folder that does not exist is created by the swap; a process working in the folder follows it."""
    folder = tmp_path / "a" / "b" / "ckpt"
    gens.write(folder, "old", "single")
    assert _snapshot(folder) == gens.refs["old", "single"]
    monkeypatch.chdir(folder)
    gens.write(".", "new", "single")
    assert _snapshot(folder) == gens.refs["new", "single"]
    assert os.path.realpath(os.getcwd()) == str(folder) and os.path.exists("config.json")


def test_without_rename_exchange_the_swap_is_two_renames(gens, tmp_path, monkeypatch):
    from qfp8.checkpoint import atomic

    folder = tmp_path / "ckpt"
    gens.prepare(folder, "sharded")
    monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    gens.finish(folder, "single")
    # Killed between the two renames: the folder is absent and the old generation beside it; the next save
    # puts it back first, then replaces it.
    old = tmp_path / ".ckpt.qfp8-stage-abcd1234"
    folder.rename(old)
    gens.finish(folder, "sharded")


def test_a_folder_that_cannot_be_swapped_is_replaced_in_place_with_a_warning(gens, tmp_path, monkeypatch):
    from qfp8.checkpoint import atomic

    folder = tmp_path / "ckpt"
    gens.prepare(folder, "single")
    monkeypatch.setattr(atomic.os, "access", lambda path, mode: False)  # as if the parent were read-only
    with pytest.warns(UserWarning, match="is a mount point or its parent folder cannot be written"):
        gens.write(folder, "new", "sharded")
    assert gens.which(folder, "single", "sharded", gens.x) == "new"
    assert (folder / "notes" / "a.txt").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []
