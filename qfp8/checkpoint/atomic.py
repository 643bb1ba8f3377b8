"""Replacing a checkpoint folder as one step, under a lock.

A checkpoint is several files (``config.json``, one or more shards, an
index) that must change together: renaming them into place one at a time
leaves, at some instant, new weights beside an old config or a mix of two
models' shards. :class:`FolderCommit` instead

1. takes an exclusive ``flock`` on ``.<folder>.qfp8-lock`` beside the folder
   (a second writer fails at once with :class:`FolderInUseError`);
2. has the caller write every new file into a sibling staging folder
   ``.<folder>.qfp8-stage-XXXXXXXX`` (same file system, so renames work);
3. hard-links into it the files of the folder that are not the old
   checkpoint's (tokenizer files, a README: the user's), copies where a link
   cannot be made;
4. exchanges the two folders with one ``renameat2(RENAME_EXCHANGE)`` (a plain
   ``rename`` when the folder did not exist): the folder's path names the
   old checkpoint before and the new one after, nothing in between;
5. moves the user's sub-folders (which are not linked) and anything added
   meanwhile from the old generation into the new folder, and removes the
   old generation.

A process killed at any point leaves the folder old or new, whole; the next
write into it (under the lock) finishes what the killed one left: a staging
folder not yet swapped in is removed, an old generation gives back the user's
entries it still holds and is removed. Without ``RENAME_EXCHANGE`` (not
Linux, or a file system without it) the swap is two renames and the folder
is briefly absent (never mixed). A folder that is a mount point, or whose
parent cannot be written, cannot be swapped: its files are renamed into it
one by one (:class:`qfp8.checkpoint.safetensors_io.AtomicDirectoryWrite`),
with a warning when an older checkpoint is replaced that way.

``QFP8_COMMIT_FAULT=kill:<step>`` (or ``raise:<step>``) makes the writer
SIGKILL itself (or raise OSError) at the named step: the test hook that
proves the above (steps: :data:`COMMIT_STEPS`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import stat
import tempfile
import warnings
from collections.abc import Iterable
from pathlib import Path

from qfp8.checkpoint.naming import KV_ROUNDING_FILE
from qfp8.checkpoint.safetensors_io import AtomicDirectoryWrite, _interrupts_deferred, is_temporary_file

__all__ = [
    "CHECKPOINT_FILE",
    "COMMIT_STEPS",
    "FolderCommit",
    "FolderInUseError",
    "FolderLock",
    "INDEX_NAME",
    "LOCK_SUFFIX",
    "STAGED_MARKER",
    "exchange",
    "previous_checkpoint_files",
]

STAGED_MARKER = ".qfp8-staged"  # in a staging folder: it has not been swapped in (removed right after the swap)
LOCK_SUFFIX = ".qfp8-lock"
COMMIT_STEPS = ("staged", "carried", "exchanged", "unmarked", "merged", "removing")
_RENAME_EXCHANGE = 2
INDEX_NAME = "model.safetensors.index.json"
# Names of the weight files a checkpoint save writes (ours and transformers'): only these, and the shards an
# existing index names, are an older checkpoint's, to be replaced; other files in the folder are the user's.
CHECKPOINT_FILE = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$")


class FolderInUseError(ValueError):
    """Another process is writing a checkpoint into the same folder."""


def _fault(step: str) -> None:
    """The test hook: ``QFP8_COMMIT_FAULT=kill:<step>`` or ``raise:<step>`` (see the module docstring)."""
    action, _, where = os.environ.get("QFP8_COMMIT_FAULT", "").partition(":")
    if where != step:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "raise":
        raise OSError(errno.EIO, f"QFP8_COMMIT_FAULT at commit step {step!r}")


def _fsync_directory(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        return libc if hasattr(libc, "renameat2") else None
    except OSError:
        return None


_LIBC = _libc() if os.name == "posix" else None


def exchange(a: Path, b: Path) -> bool:
    """Swaps the folders ``a`` and ``b`` atomically; False if the system cannot (the caller then renames)."""
    if _LIBC is None:
        return False
    at_cwd = -100  # AT_FDCWD
    if _LIBC.renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"cannot exchange {a} and {b}: {os.strerror(code)}")


class FolderLock:
    """An exclusive ``flock`` on ``path`` (created, and removed on release), taken without waiting."""

    def __init__(self, path: Path, folder: Path):
        self.path, self.folder, self.fd = path, folder, None

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise FolderInUseError(
                    f"{self.folder}: another process is saving a checkpoint into this folder (it holds "
                    f"{self.path}); wait until it finishes, or save into another folder"
                ) from None
            # The previous holder removes the file as it releases it: a lock on a removed file locks nothing.
            try:
                here, held = os.stat(self.path), os.fstat(fd)
                if (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino):
                    self.fd = fd
                    return
            except FileNotFoundError:
                pass
            os.close(fd)

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = None


def previous_checkpoint_files(directory: Path) -> set[str]:
    """The files of a checkpoint saved in ``directory`` before: its index, the shards it names, model weight files.

    Other files (a user's ``model_backup.safetensors``) are not the checkpoint's and are left alone.
    """
    if not directory.is_dir():
        return set()
    found = {p.name for p in directory.iterdir() if CHECKPOINT_FILE.match(p.name) or p.name == KV_ROUNDING_FILE}
    index = directory / INDEX_NAME
    if index.is_file():
        found.add(INDEX_NAME)
        try:
            shards = json.loads(index.read_text())["weight_map"].values()
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            shards = []  # not a readable index: only the names above are known to be a checkpoint's
        for name in shards:
            # Plain file names only: an index must not send the removal outside the folder.
            if isinstance(name, str) and name.endswith(".safetensors") and Path(name).name == name:
                found.add(name)
    return found


def _staging_pattern(folder: Path) -> re.Pattern:
    return re.compile(re.escape(f".{folder.name}.qfp8-stage-") + r"[a-z0-9_]{8}")


def _move_user_entries(source: Path, folder: Path, checkpoint_files: set[str]) -> list[str]:
    """Moves each entry of ``source`` that ``folder`` lacks (but the old checkpoint's own files) into ``folder``;
    returns the names that could not be moved."""
    stuck = []
    for entry in sorted(os.listdir(source)):
        if entry in checkpoint_files or entry == STAGED_MARKER:
            continue
        if is_temporary_file(entry) and not (source / entry).is_dir():  # a killed in-place write's partial file
            continue
        if os.path.lexists(folder / entry):
            continue
        try:
            os.rename(source / entry, folder / entry)
        except OSError:
            stuck.append(entry)
    return stuck


def _remove_tree(path: Path) -> None:
    """Removes a swapped-out generation (the ``removing`` step comes after its first file)."""
    first = True
    for root, folders, files in os.walk(path, topdown=False):
        for name in files + [f for f in folders if os.path.islink(os.path.join(root, f))]:
            os.unlink(os.path.join(root, name))
            if first:
                first = False
                _fault("removing")
        for name in folders:
            if not os.path.islink(os.path.join(root, name)):
                os.rmdir(os.path.join(root, name))
    os.rmdir(path)


def _carry(folder: Path, staging: Path, skip: set[str]) -> None:
    """Links (else copies) the regular files and links of ``folder`` that ``staging`` lacks into it; sub-folders
    are moved after the swap instead (see :func:`_move_user_entries`)."""
    for entry in os.scandir(folder):
        name = entry.name
        if name in skip or name == STAGED_MARKER or is_temporary_file(name) or os.path.lexists(staging / name):
            continue
        if not (entry.is_file(follow_symlinks=False) or entry.is_symlink()):
            continue
        try:
            os.link(entry.path, staging / name, follow_symlinks=False)
        except OSError:
            if entry.is_symlink():
                os.symlink(os.readlink(entry.path), staging / name)
            else:
                shutil.copy2(entry.path, staging / name)


class FolderCommit:
    """Writes a checkpoint into ``folder`` so that readers see the old one or the new one, whole.

    Use as a context manager: :meth:`path_for` gives where each new file
    goes, :meth:`commit` swaps the new files in (``replaced``: the names of
    the old checkpoint's files, which are not carried over). Leaving the
    block without a commit removes everything written.
    """

    def __init__(self, folder: str | os.PathLike):
        folder = Path(os.path.realpath(folder))
        self.folder = folder
        # The folders this write creates (innermost first): a failed write removes them again.
        self.created = [p for p in (folder.parent, *folder.parent.parents) if not p.exists()]
        folder.parent.mkdir(parents=True, exist_ok=True)
        self.swap = os.access(folder.parent, os.W_OK) and not (
            folder.is_dir() and os.stat(folder).st_dev != os.stat(folder.parent).st_dev
        )
        lock_path = folder.parent / f".{folder.name}{LOCK_SUFFIX}" if self.swap else folder / LOCK_SUFFIX
        if not self.swap:
            folder.mkdir(exist_ok=True)
        self.lock = FolderLock(lock_path, folder)
        self.lock.acquire()
        self.staging: Path | None = None
        self.in_place: AtomicDirectoryWrite | None = None
        try:
            self.recover()
            if self.swap:
                self.staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.qfp8-stage-", dir=folder.parent))
                (self.staging / STAGED_MARKER).touch()
            else:
                self.in_place = AtomicDirectoryWrite(folder)
        except BaseException:
            self.lock.release()
            raise

    # ------------------------------------------------------------ recovery

    def recover(self) -> None:
        """Finishes what a killed write into this folder left (under the lock: no live writer owns it)."""
        folder = self.folder
        with contextlib.suppress(FileNotFoundError):
            (folder / STAGED_MARKER).unlink()  # killed right after its swap: the folder is the new checkpoint
        pattern = _staging_pattern(folder)
        for leftover in sorted(folder.parent.iterdir()):
            if not pattern.fullmatch(leftover.name) or leftover.is_symlink() or not leftover.is_dir():
                continue
            if not (leftover / STAGED_MARKER).exists():  # an old generation, swapped out
                if not folder.exists():  # killed between the two renames of a swap without RENAME_EXCHANGE
                    os.rename(leftover, folder)
                    continue
                stuck = _move_user_entries(leftover, folder, previous_checkpoint_files(leftover) | {"config.json"})
                if stuck:
                    warnings.warn(
                        f"{leftover}: could not move {stuck[:5]} back into {folder}; left there", stacklevel=4
                    )
                    continue
            shutil.rmtree(leftover, ignore_errors=True)

    # ------------------------------------------------------------ writing

    def path_for(self, name: str) -> Path:
        if self.in_place is not None:
            return self.in_place.path_for(name)
        return self.staging / name

    def write_text(self, name: str, text: str) -> None:
        with open(self.path_for(name), "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def commit(self, replaced: Iterable[str] = ()) -> None:
        """Swaps the new files in; ``replaced``: the old checkpoint's files (not carried into the new folder)."""
        replaced = set(replaced)
        if self.in_place is not None:
            if previous_checkpoint_files(self.folder) or (self.folder / "config.json").exists():
                warnings.warn(
                    f"{self.folder} is a mount point or its parent folder cannot be written: the checkpoint is "
                    "replaced file by file, and a save killed in the middle can leave a mix of the two",
                    UserWarning,
                    stacklevel=4,
                )
            self.in_place.commit(stale=sorted(replaced - set(self.in_place.pending)))
            return
        staging, folder = self.staging, self.folder
        existed = folder.is_dir()
        with _interrupts_deferred():
            _fault("staged")
            if existed:
                _carry(folder, staging, replaced | {"config.json"})
                os.chmod(staging, stat.S_IMODE(os.stat(folder).st_mode))
            else:
                os.chmod(staging, 0o777 & ~_umask())
            _fsync_directory(staging)
            _fault("carried")
            follow_cwd = _cwd() == str(folder)
            old = staging
            if not existed:
                os.rename(staging, folder)
            elif not exchange(staging, folder):
                # Two renames: the folder is absent between them (recover() puts the old one back if killed there).
                old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.qfp8-stage-", dir=folder.parent))
                os.rename(folder, old)
                os.rename(staging, folder)
            self.staging = None  # from here on the new checkpoint is in place: nothing to undo
            _fsync_directory(folder.parent)
            if follow_cwd:  # the process worked in the folder: it goes on in the new one
                os.chdir(folder)
            self._finish(folder, old if existed else None, replaced)

    def _finish(self, folder: Path, old: Path | None, replaced: set[str]) -> None:
        """After the swap: the marker goes, the user's entries come over, the old generation goes. A failure
        here leaves the new checkpoint in place and the rest to the next write (see :meth:`recover`)."""
        try:
            _fault("exchanged")
            (folder / STAGED_MARKER).unlink()
            _fault("unmarked")
            if old is not None:
                stuck = _move_user_entries(old, folder, replaced | {"config.json"})
                if stuck:
                    warnings.warn(f"{old}: could not move {stuck[:5]} into {folder}; left there", stacklevel=5)
                    return
                _fault("merged")
                _remove_tree(old)
        except OSError as error:
            warnings.warn(
                f"{folder}: the new checkpoint is in place, but cleaning up after it failed ({error}); the next "
                "save into the folder finishes it",
                UserWarning,
                stacklevel=5,
            )

    def abort(self) -> None:
        """Removes what this write staged (under the lock)."""
        if self.in_place is not None:
            self.in_place.abort()
            self.in_place = None
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        failed = exc_type is not None or self.staging is not None
        try:
            if failed:
                self.abort()
        finally:
            self.lock.release()
        if failed:
            for folder in self.created:  # only while empty: nothing of anyone else's is removed
                with contextlib.suppress(OSError):
                    folder.rmdir()
        return False


def _cwd() -> str | None:
    try:
        return os.path.realpath(os.getcwd())
    except FileNotFoundError:
        return None


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
