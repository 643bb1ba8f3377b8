"""``opcheck`` for ops that take FP8 tensors.

``torch.library.opcheck``'s schema test compares inputs before and after the
call with ``torch.allclose``, which torch does not implement for float8
dtypes, so it fails on any FP8 input whatever the op does. This runs every
other opcheck test and replaces the schema test by the same checks done on
the raw bytes: no input is mutated, and the output aliases no input.
"""

from __future__ import annotations

import torch

__all__ = [
    "OPCHECK_TESTS",
    "opcheck",
]

OPCHECK_TESTS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _tensors(args):
    for arg in args:
        if isinstance(arg, torch.Tensor):
            yield arg
        elif isinstance(arg, (list, tuple)):
            yield from _tensors(arg)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).clone() if t.numel() else t.detach().clone()


def opcheck(op, args, kwargs=None) -> None:
    kwargs = kwargs or {}
    torch.library.opcheck(op, args, kwargs, test_utils=OPCHECK_TESTS)
    inputs = list(_tensors(args))
    before = [_raw(t) for t in inputs]
    out = op(*args, **kwargs)
    for i, (t, raw) in enumerate(zip(inputs, before, strict=True)):
        if not torch.equal(_raw(t), raw):
            raise AssertionError(f"{op}: input tensor {i} {tuple(t.shape)} {t.dtype} was mutated")
    for t in _tensors([out]):
        for i, inp in enumerate(inputs):
            if t.numel() and inp.numel() and t.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr():
                raise AssertionError(f"{op}: output aliases input tensor {i}")
