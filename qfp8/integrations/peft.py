"""peft (LoRA) on FP8 models: qfp8's layers get peft's LoRA layers, with no step of the user's.

peft picks the LoRA layer for a module by asking a list of dispatchers (its
own for bitsandbytes, torchao, HQQ..., then the default for ``nn.Linear``);
a ``QLinear`` is none of those. :func:`install` puts one more dispatcher
first: a ``QLinear`` base gets :class:`qfp8.integrations.lora.LoraQLinear`
(peft's ``lora.Linear``, whose merge re-quantizes the weight); every other
module, and a QLinear the user mapped with ``LoraConfig._register_custom_module``,
goes to peft's own dispatch unchanged.

qfp8 never imports peft itself: :func:`install_when_imported` (run by
``import qfp8``) installs the dispatcher at once when peft is loaded already,
else the moment peft's LoRA module is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

__all__ = [
    "adopt_lora_layers",
    "install",
    "install_when_imported",
]

_LORA_MODEL = "peft.tuners.lora.model"


def install() -> None:
    """Makes peft's LoRA dispatch give qfp8's layers :class:`~qfp8.integrations.lora.LoraQLinear` (idempotent)."""
    from peft.tuners.lora.model import LoraModel

    original = LoraModel.__dict__["_create_new_module"].__func__
    if getattr(original, "qfp8_dispatch", False):
        return

    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        from qfp8.integrations.lora import LoraQLinear, qlinear_base

        base = qlinear_base(target)
        custom = lora_config._custom_modules or {}
        if base is not None and kwargs.get("parameter_name") is None and not any(isinstance(base, k) for k in custom):
            return LoraQLinear(target, adapter_name, config=lora_config, **kwargs)
        return original(lora_config, adapter_name, target, **kwargs)

    _create_new_module.qfp8_dispatch = True
    _create_new_module.__wrapped__ = original
    _create_new_module.__doc__ = original.__doc__
    LoraModel._create_new_module = staticmethod(_create_new_module)


class _InstallAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when peft's LoRA module is about to load, it wraps that module's loader so that
    :func:`install` runs right after the module has executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _LORA_MODEL:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one shot; and lets the lookup below find the real module
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            install()

        loader.exec_module = exec_then_install
        return spec


def install_when_imported() -> None:
    """Installs the dispatcher now if peft's LoRA module is loaded, else when it is (peft need not be installed)."""
    if _LORA_MODEL in sys.modules:
        install()
    elif not any(isinstance(finder, _InstallAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _InstallAfterImport())


def adopt_lora_layers(model) -> None:
    """peft's plain LoRA layers in ``model`` whose base became a QLinear (LoRA applied, then ``quantize``) become
    :class:`~qfp8.integrations.lora.LoraQLinear`: the same state, the merge that re-quantizes."""
    from peft.tuners.lora.layer import Linear

    from qfp8.integrations.lora import LoraQLinear, qlinear_base

    for name, module in model.named_modules():
        if type(module) is Linear and qlinear_base(module) is not None:
            module.__class__ = LoraQLinear
            module.target_name = name
