"""Backward through the linear ops (qfp8/library/autograd.py): x and bias get gradients, the FP8 weights none.

Every op is differentiable through ``autograd.linear`` (what QLinear and
Float8WeightTensor call); the reference op and the CPU kernel's op also when
called directly (a graph torch.export traced calls them so), the CUDA
kernels' ops refuse a direct call that needs a gradient.
"""

import pytest
import torch
from torch import nn

import qfp8
from qfp8 import formats
from qfp8.library import autograd, cpu
from qfp8.library.testing import opcheck

N, K = 40, 33


def _layer(granularity, block_size=(16, 8)):
    w = torch.randn(N, K) * torch.rand(N, 1).add(0.1)
    q, scale = formats.quantize_weight(w, torch.float8_e4m3fn, granularity, block_size)
    return q, scale, (list(block_size) if granularity == "block" else [])


def _ops(q, block_size):
    """name -> (op, unpack, weight argument, the op's arguments after input_scale) for every linear op."""
    ops = {"reference": (torch.ops.qfp8.scaled_linear, None, q, (block_size,))}
    if cpu.cpu_kernel_isa() is not None:
        packed = torch.ops.qfp8.pack_weight_cpu(q)
        ops["cpu"] = (torch.ops.qfp8.scaled_linear_cpu, torch.ops.qfp8.unpack_weight_cpu, packed, (N, K, block_size))
    # The CUDA routes' CPU implementations (emulations with the same contract).
    packed = torch.ops.qfp8.pack_weight_cuda(q)
    ops["cuda-marlin"] = (
        torch.ops.qfp8.scaled_linear_cuda,
        torch.ops.qfp8.unpack_weight_cuda,
        packed,
        (N, K, block_size),
    )
    if not block_size:
        packed = torch.ops.qfp8.pack_weight_scaled_mm(q)
        ops["cuda-scaled-mm"] = (
            torch.ops.qfp8.scaled_mm_linear,
            torch.ops.qfp8.unpack_weight_scaled_mm,
            packed,
            (N, K),
        )
    return ops


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
@pytest.mark.parametrize("activation", ["none", "token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["x-f32", "x-bf16"])
def test_grad_x_and_bias_match_float64(granularity, activation, dtype):
    q, scale, block_size = _layer(granularity)
    w = formats.dequantize_weight(q, scale, block_size or None).double()
    x0 = torch.randn(2, 3, K).to(dtype)
    grad_y = torch.randn(2, 3, N).to(dtype)
    # Straight-through: the gradient of x @ W^T + b with W the dequantized weight.
    want_x = (grad_y.double().reshape(-1, N) @ w).reshape(2, 3, K)
    want_bias = grad_y.double().reshape(-1, N).sum(0)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for name, (op, unpack, weight, tail) in _ops(q, block_size).items():
        if name == "cuda-scaled-mm" and activation == "none":
            continue  # _scaled_mm takes FP8 activations only
        x = x0.clone().requires_grad_()
        bias = torch.randn(N).to(dtype).requires_grad_()
        y = autograd.linear(op, unpack, x, weight, scale, bias, None, *tail, activation, torch.float8_e4m3fn)
        y.backward(grad_y)
        for got, want, what in ((x.grad, want_x, "x"), (bias.grad, want_bias, "bias")):
            assert got is not None and got.dtype == dtype, f"{name}: no {dtype} gradient for {what}"
            error = (got.double() - want).norm() / want.norm()
            assert error < tolerance, f"{name}: {what} gradient relative error {error:.3g}"


def test_no_gradient_is_asked_for_the_weight_or_scales():
    q, scale, block_size = _layer("channel")
    x = torch.randn(3, K, requires_grad=True)
    for name, (op, unpack, weight, tail) in _ops(q, block_size).items():
        y = autograd.linear(op, unpack, x, weight, scale, None, None, *tail, "token", torch.float8_e4m3fn)
        (grad_x,) = torch.autograd.grad(y.sum(), x)
        assert torch.isfinite(grad_x).all() and grad_x.abs().sum() > 0, name


def test_direct_calls_reference_and_cpu_differentiate_cuda_kernels_refuse():
    q, scale, block_size = _layer("channel")
    x = torch.randn(3, K, requires_grad=True)
    for name, (op, unpack, weight, tail) in _ops(q, block_size).items():
        args = (x, weight, scale, None, None, *tail, "token", torch.float8_e4m3fn)
        if name in ("reference", "cpu"):
            opcheck(op, args)  # test_autograd_registration included
            (grad_x,) = torch.autograd.grad(op(*args).sum(), x)
            (want,) = torch.autograd.grad(autograd.linear(op, unpack, *args).sum(), x)
            assert torch.equal(grad_x, want)
        else:
            with pytest.raises(NotImplementedError, match="not differentiable; call qfp8.library.autograd.linear"):
                op(*args)
            with torch.no_grad():
                assert op(*args).shape == (3, N)  # no gradient asked: fine


def test_linear_refuses_arguments_of_no_linear_op():
    with pytest.raises(TypeError, match="5 op arguments; the linear ops take 8, 9 or 10"):
        autograd.linear(torch.ops.aten.mm.default, None, torch.randn(2, 3, requires_grad=True), None, None, None, None)


def test_quantized_model_backward_reaches_the_input_eager_and_compiled():
    """A residual block: without the formula the linear's share of x.grad was silently dropped."""
    torch.manual_seed(0)
    lin = nn.Linear(K, K)
    model = nn.Sequential(lin)
    qfp8.quantize(model)
    w = model[0].weight.dequantize().double()

    def run(fn):
        x = torch.randn(4, K, requires_grad=True)
        (fn(x) + x).pow(2).sum().backward()
        y = x.detach().double() @ w.t() + model[0].bias.double()
        grad_y = 2 * (y + x.detach().double())
        return x.grad, grad_y @ w + grad_y

    for fn in (model, torch.compile(model, fullgraph=True)):
        got, want = run(fn)
        error = (got.double() - want).norm() / want.norm()
        assert error < 1e-4, f"x.grad relative error {error:.3g}"


@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_second_order_gradients_and_torch_func_match_the_dequantized_float64_model(granularity):
    """A gradient penalty (the input gradient's own gradient) and ``torch.func.grad``: the input-gradient op has a
    backward, and under torch.func the formula runs in aten ops."""
    torch.manual_seed(0)
    block = {"block_size": (8, 16)} if granularity == "block" else {}
    model = nn.Sequential(nn.Linear(K, N), nn.Tanh(), nn.Linear(N, 7))
    qfp8.quantize(model, weight_scale=granularity, exclude=(), **block)
    float64 = nn.Sequential(nn.Linear(K, N), nn.Tanh(), nn.Linear(N, 7)).double()
    with torch.no_grad():
        for i in (0, 2):
            layer = model[i]
            weight = formats.dequantize_weight(layer.canonical_weight(), layer.weight_scale, layer.scheme.block_size)
            float64[i].weight.copy_(weight)
            float64[i].bias.copy_(layer.bias)
    x = torch.randn(5, K)

    def penalty_gradient(forward, x):
        x = x.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(forward(x).sum(), x, create_graph=True)
        return torch.autograd.grad(grad.square().sum(), x)[0]

    want = penalty_gradient(float64, x.double())
    assert want.abs().sum() > 0
    assert (penalty_gradient(model, x).double() - want).norm() / want.norm() < 1e-5
    want_grad = torch.func.grad(lambda x: float64(x).sum())(x.double())
    got_grad = torch.func.grad(lambda x: model(x).sum())(x)
    assert (got_grad.double() - want_grad).norm() / want_grad.norm() < 1e-5


@pytest.mark.parametrize("activation", ["none", "token"])
def test_torch_func_grad_of_a_direct_cpu_kernel_call_matches_autograd(activation):
    """torch.func.grad over the op itself (an exported graph calls it so): the op's Autograd kernel cannot run an
    autograd.Function under torch.func, so the same formula runs in aten ops there."""
    if cpu.cpu_kernel_isa() is None:
        pytest.skip("the CPU kernel's op needs the qfp8 extension, which this build lacks")
    q, scale, block_size = _layer("block")
    op, unpack, weight, tail = _ops(q, block_size)["cpu"]
    bias = torch.randn(N)
    x = torch.randn(3, K)

    def f(x, bias):
        return op(x, weight, scale, bias, None, *tail, activation, torch.float8_e4m3fn).square().sum()

    got = torch.func.grad(f, argnums=(0, 1))(x, bias)
    xr, br = x.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    want = torch.autograd.grad(f(xr, br), (xr, br))
    for g, w in zip(got, want, strict=True):
        assert w.abs().sum() > 0 and torch.allclose(g, w, rtol=1e-5, atol=1e-6)


def test_forward_mode_ad_through_a_kernel_layer_is_refused_not_dropped():
    """A dual tensor's tangent through the CPU kernel would silently come out zero; the op refuses it."""
    if cpu.cpu_kernel_isa() is None:
        pytest.skip("the CPU kernel's op needs the qfp8 extension, which this build lacks")
    import torch.autograd.forward_ad as forward_ad

    model = nn.Sequential(nn.Linear(K, N))
    qfp8.quantize(model, exclude=())
    x, tangent = torch.randn(3, K), torch.randn(3, K)
    with pytest.raises(NotImplementedError, match="forward-mode AD"), forward_ad.dual_level():
        model(forward_ad.make_dual(x, tangent))
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(model, (x,), (tangent,))
    assert torch.isfinite(model(x)).all()  # plain calls are untouched
