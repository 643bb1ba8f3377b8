"""Shared machinery of the FP8 tensor subclasses.

A subclass declares its fields once -- ``tensor_data_names`` (inner tensors)
and ``tensor_attribute_names`` (plain metadata) -- and gets flatten /
unflatten for ``torch.compile`` from that declaration. Ops are looked up in
a per-class table filled by ``@implements``; both the ``__torch_function__``
and the ``__torch_dispatch__`` level consult it, and an op with no handler
raises ``NotImplementedError`` naming it: a silent dequantize would hide a
slow path.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from qfp8 import formats

__all__ = [
    "CONVERSIONS",
    "FLOAT_CONVERSIONS",
    "Float8Tensor",
    "conversion_target",
    "convert",
]


class Float8Tensor(torch.Tensor):
    tensor_data_names: tuple[str, ...] = ()
    tensor_attribute_names: tuple[str, ...] = ()
    # Filled per subclass by ``implements``: function or aten overload -> handler.
    _handlers: dict = {}

    @classmethod
    def implements(cls, *functions) -> Callable:
        def decorator(handler):
            table = cls.__dict__.get("_handlers")
            if table is None:
                table = {}
                cls._handlers = table
            for function in functions:
                table[function] = handler
            return handler

        return decorator

    # ---- torch.compile: the declared fields are the whole state
    def __tensor_flatten__(self):
        return list(self.tensor_data_names), tuple(getattr(self, name) for name in self.tensor_attribute_names)

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, attributes, outer_size, outer_stride):
        fields = [inner_tensors[name] for name in cls.tensor_data_names]
        return cls(*fields, *attributes)

    def _stable_hash_for_caching(self) -> str:
        """AOT autograd's cache key for this tensor: its type, layout and attributes, not its values.

        What torch's default computes for a traceable subclass, without the
        warning it gives every compile of a subclass that lacks this method.
        """
        inner = [
            (name, tuple(t.shape), str(t.dtype), str(t.device), tuple(t.stride()))
            for name in self.tensor_data_names
            for t in [getattr(self, name)]
        ]
        attributes = tuple(getattr(self, name) for name in self.tensor_attribute_names)
        payload = repr((type(self).__qualname__, tuple(self.shape), self.requires_grad, attributes, inner))
        return hashlib.blake2b(payload.encode(), digest_size=16).hexdigest()

    # ---- shared memory (torch.multiprocessing): a wrapper has no storage of its own (torch's method segfaults)
    def share_memory_(self):
        for name in self.tensor_data_names:
            getattr(self, name).share_memory_()
        return self

    def is_shared(self) -> bool:
        return all(getattr(self, name).is_shared() for name in self.tensor_data_names)

    # ---- op routing
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for klass in _subclasses_in(types):
            handler = klass._handlers.get(func)
            if handler is not None:
                if kwargs and func in _POSITIONAL:
                    args, kwargs = _positional(args, kwargs, _POSITIONAL[func])
                return handler(func, types, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for klass in _subclasses_in(types):
            handler = klass._handlers.get(func)
            if handler is not None:
                return handler(func, types, args, kwargs)
        names = ", ".join(sorted({t.__name__ for t in types}))
        raise NotImplementedError(
            f"{names} does not implement {func}; call .dequantize() first if a float copy is what you want"
        )


# Tensor.float() and its kin ask for a float tensor: an explicit dequantize, like ``.to(dtype)``. torch's own
# methods would hand back the FP8 tensor itself whenever it already reports that dtype (weight.float() on a
# float32 model), so that the same call dequantized on a bf16 model only.
FLOAT_CONVERSIONS = {
    torch.Tensor.float: torch.float32,
    torch.Tensor.double: torch.float64,
    torch.Tensor.half: torch.float16,
    torch.Tensor.bfloat16: torch.bfloat16,
}
CONVERSIONS = (torch.Tensor.to, torch.ops.aten._to_copy.default, torch.Tensor.type, *FLOAT_CONVERSIONS)


def conversion_target(func, args, kwargs) -> tuple[torch.device | None, torch.dtype | None] | None:
    """The (device, dtype) a conversion in :data:`CONVERSIONS` asks for; None for ``x.type()`` (a type name)."""
    if func in FLOAT_CONVERSIONS:
        return None, FLOAT_CONVERSIONS[func]
    if func is torch.Tensor.type:
        target = args[1] if len(args) > 1 else kwargs.get("dtype")
        if target is None:
            return None
        if isinstance(target, torch.dtype):
            return None, target
        if isinstance(target, str):  # "torch.FloatTensor", "torch.cuda.HalfTensor"
            target = torch._utils._import_dotted_name(target)
        return torch.device("cuda" if target.is_cuda else "cpu"), target.dtype
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    for arg in args[1:]:
        if isinstance(arg, torch.dtype):
            dtype = arg
        elif isinstance(arg, (torch.device, str)):
            device = arg
        elif isinstance(arg, torch.Tensor):
            device, dtype = arg.device, arg.dtype
    return (torch.device(device) if device is not None else None), dtype


def convert(tensor, func, args, kwargs, moved: Callable[[torch.device], torch.Tensor]):
    """A conversion of :data:`CONVERSIONS` on an FP8 tensor: a float dtype dequantizes, its own FP8 dtype and
    device return it, another device gives ``moved(device)``; another FP8 dtype is a TypeError."""
    target = conversion_target(func, args, kwargs)
    if target is None:  # x.type(): the type's name
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    device, dtype = target
    if dtype is not None and dtype not in formats.FP8_DTYPES.values():
        out = tensor.dequantize(dtype)  # a float dtype asks for a float tensor: an explicit dequantize
        return out.to(device) if device is not None else out
    if dtype is not None and dtype != tensor.fp8_dtype:
        raise TypeError(f"{type(tensor).__name__}.to({dtype}): converting between FP8 formats is not supported")
    if device is None or device == tensor.qdata.device:
        return tensor
    return moved(device)


# The leading parameters of the functions the handlers take, in order: an operand given by keyword
# (F.linear(x, weight=w), torch.matmul(x, other=w.t())) reaches its handler as a positional argument.
_POSITIONAL = {
    torch.nn.functional.linear: ("input", "weight", "bias"),
    torch.matmul: ("input", "other"),
    torch.Tensor.matmul: ("self", "other"),
    torch.Tensor.__matmul__: ("self", "other"),
    torch.addmm: ("input", "mat1", "mat2"),
    torch.bmm: ("input", "mat2"),
    torch.nn.functional.embedding: ("input", "weight", "padding_idx", "max_norm"),
}


def _positional(args: tuple, kwargs: dict, names: tuple[str, ...]) -> tuple[tuple, dict]:
    """``args`` extended with the keyword arguments among ``names`` (None for one skipped before a given one)."""
    kwargs = dict(kwargs)
    given = [i for i, name in enumerate(names) if i >= len(args) and name in kwargs]
    if not given:
        return args, kwargs
    extra = [kwargs.pop(name, None) for name in names[len(args) : given[-1] + 1]]
    return (*args, *extra), kwargs


def _subclasses_in(types):
    for klass in types:
        if isinstance(klass, type) and issubclass(klass, Float8Tensor):
            yield klass
