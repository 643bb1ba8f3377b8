"""What QLinear's fast path relies on in torch's nn.Module internals, checked so that a torch release that changes
them fails here, loudly, instead of letting a hook go silently unrun.

The fast path (``QLinear.__call__`` without ``nn.Module.__call__``) is armed only while the module has no hook:
it watches the module's hook dicts (``_forward_hooks``, ``_forward_pre_hooks``, ``_backward_hooks``,
``_backward_pre_hooks``, replaced by a dict subclass that disarms on any write) and reads nn.Module's global hook
registries by identity. Both are torch internals: these tests pin down that every public way of adding a hook
still goes through them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qfp8.nn import QLinear, QuantizationScheme
from qfp8.nn import qlinear as qlinear_module


def armed_layer() -> QLinear:
    layer = QLinear.from_linear(nn.Linear(64, 32).to(torch.bfloat16), QuantizationScheme(), "layer")
    layer(torch.randn(1, 64, dtype=torch.bfloat16))  # arms the fast path
    assert layer.__dict__["_fast"] is not None, "the fast path did not arm on a layer without hooks"
    return layer


HOOKS = {
    "forward": lambda layer, seen: layer.register_forward_hook(lambda *args: seen.append("forward")),
    "forward-kwargs": lambda layer, seen: layer.register_forward_hook(
        lambda *args: seen.append("forward-kwargs"), with_kwargs=True
    ),
    "forward-always": lambda layer, seen: layer.register_forward_hook(
        lambda *args: seen.append("forward-always"), always_call=True
    ),
    "forward-pre": lambda layer, seen: layer.register_forward_pre_hook(lambda *args: seen.append("forward-pre")),
    "forward-pre-prepend": lambda layer, seen: layer.register_forward_pre_hook(
        lambda *args: seen.append("forward-pre-prepend"), prepend=True
    ),
    "full-backward": lambda layer, seen: layer.register_full_backward_hook(lambda *args: seen.append("backward")),
    "full-backward-pre": lambda layer, seen: layer.register_full_backward_pre_hook(
        lambda *args: seen.append("backward-pre")
    ),
}


@pytest.mark.parametrize("kind", list(HOOKS))
def test_every_public_hook_registration_disarms_the_fast_path(kind):
    layer = armed_layer()
    seen = []
    handle = HOOKS[kind](layer, seen)
    assert layer.__dict__["_fast"] is None, (
        f"nn.Module's {kind} hook registration no longer writes to a hook dict QLinear watches "
        f"({qlinear_module._WATCHED}): the fast path would skip the hook"
    )
    x = torch.randn(1, 64, dtype=torch.bfloat16, requires_grad=kind.startswith("full-backward"))
    out = layer(x)
    if kind.startswith("full-backward"):
        out.float().sum().backward()
    assert seen, f"the {kind} hook did not run"
    handle.remove()
    layer(torch.randn(1, 64, dtype=torch.bfloat16))
    assert layer.__dict__["_fast"] is not None, "removing the hook left the fast path off"


def test_the_watched_hook_dicts_are_nn_modules_own():
    plain = nn.Linear(4, 4)
    for name in qlinear_module._WATCHED:
        assert isinstance(getattr(plain, name), dict), f"nn.Module no longer keeps {name} as a dict"
    layer = armed_layer()
    for name in qlinear_module._WATCHED:
        assert type(layer.__dict__[name]) is qlinear_module._WatchedDict


@pytest.mark.parametrize(
    "register",
    [
        nn.modules.module.register_module_forward_hook,
        nn.modules.module.register_module_forward_pre_hook,
    ],
    ids=["forward", "forward-pre"],
)
def test_global_hooks_are_seen_through_the_registries_qlinear_reads(register):
    names = (
        "_global_forward_hooks",
        "_global_forward_pre_hooks",
        "_global_backward_hooks",
        "_global_backward_pre_hooks",
    )
    for name in names:  # bound at import: torch must still mutate these dicts in place, never rebind them
        assert getattr(qlinear_module, name) is getattr(nn.modules.module, name), f"torch rebound {name}"
    layer = armed_layer()
    seen = []
    handle = register(lambda *args: seen.append(True))
    try:
        layer(torch.randn(1, 64, dtype=torch.bfloat16))
    finally:
        handle.remove()
    assert seen, "a global hook registered through torch's public function did not run on a QLinear call"
