"""A local stand-in for the Hugging Face Hub: a cache laid out as huggingface_hub lays it out
(``models--ORG--NAME/refs/<ref>`` holding a commit hash, the files under ``snapshots/<hash>/``), with
``HF_HUB_OFFLINE`` on and sockets refusing to connect (the ``hub_cache`` fixture of tests/conftest.py), so
nothing can reach the network."""

from __future__ import annotations

import shutil

MAIN = "0123456789abcdef0123456789abcdef01234567"


def add_to_cache(cache, repo_id: str, folder, commit: str = MAIN, ref: str | None = "main", subfolder: str = ""):
    """Puts ``folder`` into ``cache`` as ``repo_id`` at ``commit`` (under ``subfolder``), ``ref`` pointing at it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    if ref is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    shutil.copytree(folder, repo / "snapshots" / commit / subfolder, dirs_exist_ok=True)
