"""The FP8 subclasses' dequantizing routes trace under ``torch.compile(fullgraph=True)`` and match eager.

Eager dequantization indexes a cached 256-entry table; compiled code casts
instead (a traced graph cannot hold the table). The cast is exact, so every
route must give the eager result bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from qfp8 import Float8ActivationTensor, Float8WeightTensor
from qfp8.library.routing import select_kernel

FP8 = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e4m3fnuz": torch.float8_e4m3fnuz}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def packed(w: Float8WeightTensor) -> Float8WeightTensor:
    """``w`` in the layout of the kernel this device picks for it (what a frozen QLinear hands out)."""
    kernel, _ = select_kernel(w.kernel_request())
    return w._with(qdata=kernel.pack(w.qdata), packing=kernel.name)


# name -> (function, which inputs it takes from the ``operands`` dict)
ROUTES = {
    "act.dequantize": (lambda a: a.dequantize(), ("act",)),
    "act.dequantize-float64": (lambda a: a.dequantize(torch.float64), ("act",)),
    "quantize-dequantize-in-graph": (lambda x, dt: Float8ActivationTensor.quantize(x, dt).dequantize(), ("x", "dt")),
    "weight.dequantize": (lambda w: w.dequantize(), ("weight",)),
    "reference-weight.dequantize": (lambda w: w.dequantize(), ("reference_weight",)),
    "F.linear(act, weight)": (lambda a, w: F.linear(a, w), ("act", "weight")),
    "F.linear(act, float-weight)": (lambda a, w: F.linear(a, w), ("act", "float_weight")),
    "act @ weight.t()": (lambda a, w: a @ w.t(), ("act", "weight")),
    "act @ weight": (lambda a, w: a @ w, ("act_n", "weight")),
    "torch.matmul(act, float)": (lambda a, w: torch.matmul(a, w.t()), ("act", "float_weight")),
    "plain @ act": (lambda p, a: p @ a, ("left", "act")),
    "bmm(act, plain)": (lambda a, p: torch.bmm(a, p), ("act3", "right3")),
    "bmm(plain, act)": (lambda p, a: torch.bmm(p, a), ("left3", "act3")),
    "weight.float()": (lambda w: w.float(), ("weight",)),
    "act.float()": (lambda a: a.float(), ("act",)),
}


def operands(dtype: torch.dtype) -> dict:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    reference_weight = Float8WeightTensor.from_float(randn(48, 80), dtype=dtype)
    return {
        "dt": dtype,
        "x": randn(3, 80),
        "act": Float8ActivationTensor.quantize(randn(3, 80), dtype),
        "act_n": Float8ActivationTensor.quantize(randn(3, 48), dtype, granularity="group"),
        "act3": Float8ActivationTensor.quantize(randn(2, 3, 80), dtype, granularity="tensor"),
        "x_n": randn(3, 48),
        "left": randn(4, 3),
        "left3": randn(2, 4, 3),
        "right3": randn(2, 80, 5),
        "weight": packed(reference_weight),
        "reference_weight": reference_weight,
        "float_weight": randn(48, 80),
    }


@pytest.mark.parametrize("fp8", list(FP8), ids=lambda name: f"fp8-{name}")
@pytest.mark.parametrize("route", list(ROUTES))
def test_route_compiles_fullgraph_and_matches_eager_bitwise(route, fp8):
    fn, names = ROUTES[route]
    inputs = operands(FP8[fp8])
    args = [inputs[name] for name in names]
    eager = fn(*args)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
    assert type(compiled) is torch.Tensor and compiled.dtype == eager.dtype
    assert torch.equal(compiled, eager)


def test_inductor_dequantizes_every_code_as_eager():
    """Every FP8 code of each format (NaN and Inf included) through both subclasses, compiled by Inductor."""
    tensors = []
    for dtype in FP8.values():
        codes = torch.arange(256, dtype=torch.uint8).view(dtype).reshape(16, 16)
        tensors.append(Float8ActivationTensor(codes, torch.full((16, 1), 0.5), "token", torch.float32))
        tensors.append(Float8WeightTensor(codes, torch.full((16, 1), 2.0), "reference", (), torch.float32, 16, 16))

    def dequantize_all(*tensors):
        return [t.dequantize() for t in tensors]

    compiled = torch.compile(dequantize_all, fullgraph=True)(*tensors)
    for got, want in zip(compiled, dequantize_all(*tensors), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        assert want.isnan().any()  # the special codes were part of it
