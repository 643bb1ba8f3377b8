"""The public API matches the docs: every module declares ``__all__``, every name in it exists, and every
``qfp8.*`` name README.md and docs/*.md mention resolves to a name a module exports."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import qfp8

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# qfp8.x.y, not part of torch.ops.qfp8.x, a path (qfp8/nn) or a file name (qfp8_kv_rounding.st)
DOTTED_NAME = re.compile(r"(?<![\w./-])qfp8(?:\.[A-Za-z_]\w*)+")
NOT_MODULES = {"qfp8.__main__", "qfp8._C"}  # the `python -m qfp8` entry; the compiled extension


def modules() -> list[str]:
    found = ["qfp8"]
    for info in pkgutil.walk_packages(qfp8.__path__, "qfp8."):
        if info.name not in NOT_MODULES:
            found.append(info.name)
    return found


@pytest.mark.parametrize("name", modules())
def test_every_module_declares_what_it_exports(name):
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert isinstance(exported, list) and exported, f"{name} has no __all__"
    assert len(set(exported)) == len(exported), f"{name}.__all__ repeats a name"
    missing = [item for item in exported if not hasattr(module, item)]
    assert not missing, f"{name}.__all__ names what it does not define: {missing}"


def documented_names() -> list[tuple[str, str]]:
    names = {}
    for document in DOCUMENTS:
        for match in DOTTED_NAME.finditer(document.read_text()):
            names.setdefault(match.group(0).rstrip("."), document.relative_to(ROOT).as_posix())
    return sorted(names.items())


def test_the_docs_name_some_api():
    assert len(documented_names()) >= 10, [d.name for d in DOCUMENTS]


@pytest.mark.parametrize(("name", "document"), documented_names(), ids=[n for n, _ in documented_names()])
def test_every_documented_name_is_exported(name, document):
    """The longest importable prefix is a module; the next part is in its ``__all__`` (or is a submodule);
    any further parts are attributes of that (``qfp8.QLinear.forward``)."""
    parts = name.split(".")
    depth = len(parts)
    while depth > 1:
        try:
            module = importlib.import_module(".".join(parts[:depth]))
            break
        except ModuleNotFoundError:
            depth -= 1
    else:
        module = qfp8
    assert ".".join(parts[:depth]) not in NOT_MODULES, f"{document} sends users to {name}, which is private"
    if depth == len(parts):
        assert hasattr(module, "__all__"), f"{document} names module {name}, which declares no __all__"
        return
    head = parts[depth]
    assert head in module.__all__, f"{document} names {name}, but {module.__name__}.__all__ lacks {head!r}"
    target = getattr(module, head)
    for part in parts[depth + 1 :]:
        assert hasattr(target, part), f"{document} names {name}: {target!r} has no {part!r}"
        target = getattr(target, part)
