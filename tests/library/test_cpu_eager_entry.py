"""qfp8._C.scaled_linear_cpu_eager: QLinear's eager entry into the CPU kernel.

It must give exactly what ``torch.ops.qfp8.scaled_linear_cpu`` gives, and
hand every call the dispatcher has work for (modes, subclasses, autograd,
profiling, functorch) to that op, so that nothing a user can observe changes
but the time per call.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from qfp8 import formats
from qfp8.library import cpu

pytestmark = pytest.mark.skipif(cpu._EXTENSION is None, reason="needs the compiled CPU extension (qfp8._C)")

OP = torch.ops.qfp8.scaled_linear_cpu.default


def eager(*args):
    return cpu._EXTENSION.scaled_linear_cpu_eager(*args)


def layer_args(x, n=40, granularity="channel", activation="none", bias_dtype=None, seed=0):
    k = x.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5
    block = (16, 16) if granularity == "block" else ()
    q, scale = formats.quantize_weight(w, torch.float8_e4m3fn, granularity, block)
    bias = None
    if bias_dtype is not None:
        bias = torch.nn.Parameter(torch.randn(n, generator=gen).to(bias_dtype), requires_grad=False)
    input_scale = torch.tensor([0.02]) if activation == "static" else None
    packed = torch.ops.qfp8.pack_weight_cpu(q)
    return (x, packed, scale, bias, input_scale, n, k, list(block), activation, torch.float8_e4m3fn)


CASES = [
    ("channel", "none", None, torch.bfloat16),
    ("tensor", "token", torch.bfloat16, torch.bfloat16),
    ("block", "none", torch.float32, torch.float32),
    ("channel", "static", torch.float16, torch.float16),
    ("channel", "group", None, torch.float32),
    ("channel", "token-mse", torch.bfloat16, torch.bfloat16),
]


@pytest.mark.parametrize(("granularity", "activation", "bias_dtype", "x_dtype"), CASES)
@pytest.mark.parametrize("shape", [(1, 33), (3, 2, 64), (7, 129)])
def test_same_result_as_the_op(granularity, activation, bias_dtype, x_dtype, shape):
    x = torch.randn(*shape).to(x_dtype)
    args = layer_args(x, granularity=granularity, activation=activation, bias_dtype=bias_dtype)
    got = eager(*args)
    assert got.dtype == x_dtype and got.shape == (*shape[:-1], 40)
    assert torch.equal(got, OP(*args))


def test_inference_tensors_take_the_direct_route():
    with torch.inference_mode():
        x = torch.randn(2, 48, dtype=torch.bfloat16)
        args = layer_args(x, bias_dtype=torch.bfloat16)
        assert torch.equal(eager(*args), OP(*args))


def test_dispatch_mode_sees_the_op():
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    args = layer_args(torch.randn(1, 32))
    expected = OP(*args)
    with Record():
        got = eager(*args)
    assert OP in seen
    assert torch.equal(got, expected)


def test_torch_function_mode_sees_the_op():
    seen = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    args = layer_args(torch.randn(1, 32))
    with Record():
        eager(*args)
    assert seen == [OP]


def test_profiler_records_the_op():
    args = layer_args(torch.randn(1, 32))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        eager(*args)
    assert "qfp8::scaled_linear_cpu" in [event.name for event in prof.events()]


def test_tensor_subclass_keeps_its_type():
    class Marked(torch.Tensor):
        pass

    args = layer_args(torch.randn(2, 32).as_subclass(Marked))
    got = eager(*args)
    assert type(got) is type(OP(*args)) is Marked
    assert torch.equal(got.as_subclass(torch.Tensor), OP(*args).as_subclass(torch.Tensor))


def test_autograd_goes_through_autograd_linear():
    """A call that needs a gradient is differentiable, through the entry and through the op's Autograd kernel."""
    from qfp8.library import autograd

    x = torch.randn(2, 32, requires_grad=True)
    args = layer_args(x)
    got = eager(*args)
    expected = autograd.linear(OP, torch.ops.qfp8.unpack_weight_cpu.default, *args)
    assert got.requires_grad and expected.requires_grad
    assert torch.equal(got.detach(), expected.detach())
    (grad_got,) = torch.autograd.grad(got.sum(), x)
    (grad_expected,) = torch.autograd.grad(expected.sum(), x)
    assert torch.equal(grad_got, grad_expected) and grad_got.abs().sum() > 0
    direct = OP(*args)
    assert torch.equal(direct.detach(), expected.detach())
    (grad_direct,) = torch.autograd.grad(direct.sum(), x)
    assert torch.equal(grad_direct, grad_expected)
    with torch.no_grad():
        assert not eager(*args).requires_grad


def test_errors_are_the_ops():
    args = layer_args(torch.randn(1, 32))
    wrong_k = (torch.randn(1, 31), *args[1:])
    for fn in (eager, OP):
        with pytest.raises(RuntimeError, match=r"x has shape \[1, 31\] but in_features is 32"):
            fn(*wrong_k)
    with pytest.raises(RuntimeError, match="missing value for argument 'weight_scale'"):
        eager(*args[:2])


def test_other_devices_go_to_the_op():
    # A meta activation is not a plain CPU tensor: the op's meta kernel answers.
    args = layer_args(torch.randn(1, 32))
    got = eager(torch.empty(3, 32, device="meta"), *args[1:])
    assert got.device.type == "meta" and got.shape == (3, 40)


def test_functorch_transforms_see_the_op():
    """The entry mirrors the dispatcher's guards with c10's TLS internals: under vmap (FuncTorchBatched in the TLS
    included set, batched tensors) it must give what the op gives, result or error, or torch changed them."""
    args = layer_args(torch.randn(2, 32))
    batch = torch.randn(3, 2, 32)

    def under_vmap(fn):
        try:
            return torch.vmap(lambda x: fn(x, *args[1:]))(batch)
        except Exception as error:  # the op's own answer to vmap, whatever it is, is what the entry must give
            return type(error), str(error).splitlines()[0]

    got, expected = under_vmap(eager), under_vmap(OP)
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, expected)
    else:
        assert got == expected


def test_forward_mode_ad_reaches_the_ops_refusal():
    import torch.autograd.forward_ad as forward_ad

    args = layer_args(torch.randn(2, 32))
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(args[0], torch.randn(2, 32))
        for fn in (eager, OP):
            with pytest.raises(NotImplementedError, match="forward-mode AD"):
                fn(dual, *args[1:])
